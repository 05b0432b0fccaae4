#!/usr/bin/env bash
# Runs on the device machine over a bundle from scripts/gpu-bundle.sh (carry: .bundle): every
# gpu-labelled test binary, then the benchmarks named in BENCH (default: none). Full logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.bundle/lib:${LD_LIBRARY_PATH:-}
export TS_SOURCE_DIR=$PWD TS_BINARY_DIR=$PWD/.bundle
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
pass=0; fail=0; skip=0; failed=()
for t in $(cat .bundle/gpu-tests.txt); do
  [ -x ".bundle/bin/$t" ] || { echo "missing $t"; fail=$((fail+1)); failed+=("$t(missing)"); continue; }
  timeout 300 ".bundle/bin/$t" ${GTEST_ARGS:-} > "$OUT/$t.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then pass=$((pass+1));
  elif [ $rc -eq 77 ]; then skip=$((skip+1));
  else fail=$((fail+1)); failed+=("$t(rc=$rc)"); grep -E "Failure|FAILED|error|Expected|Which is|actual" "$OUT/$t.log" | head -12; fi
done
for b in ${BENCH:-}; do
  echo "==== $b"
  timeout 300 .bundle/bin/$b ${BENCH_ARGS:-} > "$OUT/$b.log" 2>&1
  echo "rc=$?"; tail -30 "$OUT/$b.log"
done
echo "==== gpu tests: $pass passed, $fail failed, $skip skipped"
printf '  failed: %s\n' "${failed[@]}"
