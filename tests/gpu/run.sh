#!/usr/bin/env bash
# One call on the GPU machine: build, run every `gpu`-labelled test, run the benchmarks, print a
# short table last. Full logs go under $OUT (or ./gpu-out when OUT is unset).
#   STAGES="build test bench peer" (default "build test bench")
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
STAGES=${STAGES:-"build test bench"}
BUILD_DIR=${BUILD_DIR:-build-gpu}
export PATH=/usr/local/cuda/bin:$PATH
summary=()
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has build; then
  t0=$(date +%s)
  # The GPU machine has no gRPC; the server targets are optional and skip themselves.
  if cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >"$OUT/configure.log" 2>&1 &&
     cmake --build "$BUILD_DIR" -j "$(nproc)" >"$OUT/build.log" 2>&1; then
    summary+=("build ok ($(( $(date +%s) - t0 )) s)")
  else
    tail -40 "$OUT/build.log" "$OUT/configure.log"
    summary+=("build FAILED")
    printf '%s\n' "${summary[@]}"
    exit 1
  fi
fi

if has test; then
  # Each test under the TIMEOUT it registers; no device here is a failure, not a skip.
  (cd "$BUILD_DIR" && TS_REQUIRE_GPU=1 ctest -L gpu --output-on-failure) >"$OUT/ctest-gpu.log" 2>&1
  rc=$?
  grep -E "tests passed|Test +#|Failed|\*\*\*" "$OUT/ctest-gpu.log" | tail -40
  summary+=("gpu ctest rc=$rc: $(grep -E 'tests passed' "$OUT/ctest-gpu.log")")
fi

if has bench; then
  for b in "$BUILD_DIR"/bench/attention/tailserve-attn-bench "$BUILD_DIR"/bench/tailserve-bench; do
    [ -x "$b" ] || continue
    name=$(basename "$b")
    "$b" >"$OUT/$name.log" 2>&1
    summary+=("$name rc=$?")
    tail -25 "$OUT/$name.log"
  done
fi

if has peer; then
  PYTHONUNBUFFERED=1 python3 bench/peer/peer_decode.py ${PEER_ARGS:-} --out "$OUT/peer.jsonl" \
    >"$OUT/peer.log" 2>&1
  summary+=("peer rc=$?")
  tail -15 "$OUT/peer.log"
fi

echo "==== summary"
printf '%s\n' "${summary[@]}"
