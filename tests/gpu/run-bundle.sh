#!/usr/bin/env bash
# Runs on the device machine over a bundle from scripts/gpu-bundle.sh (carry: .bundle): every
# gpu-labelled test binary, then the benchmarks named in BENCH (default: none). Full logs under $OUT
# in two files (tests.log, bench.log), since only a few files come back from the device machine.
#   TS_LLAMA1B_DIR: when set and missing, tests/gpu/make_llama1b_reference.py writes it first.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.bundle/lib:${LD_LIBRARY_PATH:-}
export TS_SOURCE_DIR=$PWD TS_BINARY_DIR=$PWD/.bundle TS_TAILSERVE_BIN=$PWD/.bundle/bin/tailserve
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
if [ -n "${TS_LLAMA1B_DIR:-}" ] && [ ! -f "$TS_LLAMA1B_DIR/reference_logits.safetensors" ]; then
  t0=$(date +%s)
  PYTHONUNBUFFERED=1 python3 tests/gpu/make_llama1b_reference.py --out "$TS_LLAMA1B_DIR" \
    > "$OUT/llama1b-reference.log" 2>&1 || { echo "llama1b reference FAILED"; tail -20 "$OUT/llama1b-reference.log"; }
  echo "llama1b reference: $(( $(date +%s) - t0 )) s"
fi
export TS_LLAMA1B_DIR=${TS_LLAMA1B_DIR:-}
pass=0; fail=0; skip=0; failed=()
for t in $(cat .bundle/gpu-tests.txt); do
  [ -x ".bundle/bin/$t" ] || { echo "missing $t"; fail=$((fail+1)); failed+=("$t(missing)"); continue; }
  echo "==== $t" >> "$OUT/tests.log"
  timeout 300 ".bundle/bin/$t" ${GTEST_ARGS:-} > "$OUT/last.log" 2>&1
  rc=$?
  cat "$OUT/last.log" >> "$OUT/tests.log"
  if [ $rc -eq 0 ]; then pass=$((pass+1));
  elif [ $rc -eq 77 ]; then skip=$((skip+1));
  else fail=$((fail+1)); failed+=("$t(rc=$rc)"); grep -E "Failure|FAILED|error|Expected|Which is|actual" "$OUT/last.log" | head -12; fi
done
for b in ${BENCH:-}; do
  echo "==== $b"
  echo "==== $b" >> "$OUT/bench.log"
  timeout 400 .bundle/bin/$b ${BENCH_ARGS:-} > "$OUT/last.log" 2>&1
  echo "rc=$?"; cat "$OUT/last.log" >> "$OUT/bench.log"; tail -${BENCH_TAIL:-30} "$OUT/last.log"
done
echo "==== gpu tests: $pass passed, $fail failed, $skip skipped"
printf '  failed: %s\n' "${failed[@]}"
rm -f "$OUT/last.log"
