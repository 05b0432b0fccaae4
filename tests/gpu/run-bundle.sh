#!/usr/bin/env bash
# Runs on the device machine over a bundle from scripts/gpu-bundle.sh (carry: .bundle): every
# gpu-labelled test binary, each under the TIMEOUT CTest registers for it, then the benchmarks
# named in BENCH (default: none). Full logs under $OUT (tests.log, bench.log), since only a few
# files come back from the device machine; a table of every binary's result and seconds is printed
# last.
#   TS_LLAMA1B_DIR, TS_LLAMA8B_DIR: when set and missing, tests/gpu/make_llama_reference.py writes
#     them first (the 1B and 8B shapes for engine_cuda_hf_logits_test).
#   SANITIZE="memcheck racecheck initcheck": instead of the plain run, run the tests under each
#     compute-sanitizer tool in turn (log: sanitize-<tool>.log). A binary passes when it passes and
#     the tool reports no error (--error-exitcode). CUDA API errors are not counted: the tests of
#     error paths provoke them on purpose and check the returned codes themselves. SANITIZE_TESTS narrows the binaries (a regex),
#     SANITIZE_GTEST_ARGS passes gtest arguments (e.g. a --gtest_filter for the slower tools),
#     SANITIZE_ARGS more compute-sanitizer arguments (e.g. a kernel-name filter that leaves out
#     cuBLASLt's own kernels, whose TMA/mbarrier code racecheck reports as hazards),
#     SANITIZE_TIMEOUT caps each binary (default: its CTest TIMEOUT), SANITIZE_JOBS runs that
#     many tool runs at once (default 1; each is its own process on the one GPU, and a tool's
#     slowdown is mostly its own instrumentation, so they overlap well).
#     engine_cuda_loop_test measures the loop at its real speed: under memcheck its scripted run
#     outlasts its 120 s and the host prepares a shrink too late, and racecheck's own library
#     crashes in it (bench/results/2026-12-07e-h200.md). Leave it out of racecheck runs, and read
#     its memcheck result by the error summary. Under racecheck kernels_decode_attention_test,
#     kernels_sampling_test and kernels_gemv_test each need more than one device call's 600 s
#     with other tools beside them (bench/results/2026-12-07f-h100.md): SANITIZE_SHARD=1 runs
#     each test of a binary (each test left by SANITIZE_GTEST_ARGS' filter) as its own job, so
#     that SANITIZE_JOBS of them share the call. SANITIZE_BUDGET=N (seconds) ends every tool run
#     N s after the start and starts none in the last 20 s, so that a call with a wall-clock limit
#     still prints its table (runs not started are listed as NOT RUN and count as failures).
#     Even alone, SamplingIdsTest at vocab 50257 and 128256 with 32 splits outlasts a call under
#     racecheck (> 520 s, 2026-12-07j-h100.md); SeededDrawsAgreeWithCpu launches those shapes.
#     Every tool run gets TS_UNDER_SANITIZER=<tool> (tests/common/sanitizer.h): the tests that
#     repeat launches for statistics or odds, not coverage, repeat less under it.
#   TESTS: a regex of the binaries to run (default: all).
# TS_REQUIRE_GPU=1 turns "no CUDA device" into a failure: on this machine a skip would hide a
# broken device (tests/common/gpu_main.cc).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
# scripts/gpu-bundle.sh writes both; the archive is what fits the device tool's carry limit.
[ -d .bundle ] || [ ! -f .bundle.tar.xz ] || tar -xJf .bundle.tar.xz
export LD_LIBRARY_PATH=$PWD/.bundle/lib:${LD_LIBRARY_PATH:-}
export TS_SOURCE_DIR=$PWD TS_BINARY_DIR=$PWD/.bundle TS_TAILSERVE_BIN=$PWD/.bundle/bin/tailserve
export TS_REQUIRE_GPU=1
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1

make_reference() {  # shape dir
  [ -n "$2" ] || return 0
  [ -f "$2/reference_logits.safetensors" ] && return 0
  local t0=$(date +%s)
  PYTHONUNBUFFERED=1 python3 tests/gpu/make_llama_reference.py --shape "$1" --out "$2" \
    > "$OUT/llama$1-reference.log" 2>&1 || { echo "llama$1 reference FAILED"; tail -20 "$OUT/llama$1-reference.log"; }
  echo "llama$1 reference: $(( $(date +%s) - t0 )) s"
  grep -E "^variant|^rerun" "$OUT/llama$1-reference.log"
}
if [ -z "${SANITIZE:-}" ]; then
  make_reference 1b "${TS_LLAMA1B_DIR:-}"
  make_reference 8b "${TS_LLAMA8B_DIR:-}"
fi
export TS_LLAMA1B_DIR=${TS_LLAMA1B_DIR:-} TS_LLAMA8B_DIR=${TS_LLAMA8B_DIR:-}

table=()
jobs_run=()
# Per-run sanitizer logs stay off $OUT: only a few files come back from the machine, and a run
# cut short must not crowd out the logs that matter.
jobdir=$(mktemp -d)
sanitize_end=$(( $(date +%s) + ${SANITIZE_BUDGET:-0} ))
pass=0; fail=0; skip=0; failed=()
# run_one <log> <name> <timeout> <command...>
run_one() {
  local log=$1 name=$2 limit=$3; shift 3
  echo "==== $name" >> "$log"
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/last.log" 2>&1
  local rc=$? secs=$(( $(date +%s) - t0 ))
  cat "$OUT/last.log" >> "$log"
  local verdict
  if [ $rc -eq 0 ]; then verdict=pass; pass=$((pass+1));
  elif [ $rc -eq 77 ]; then verdict=skip; skip=$((skip+1));
  else
    verdict="FAIL rc=$rc"; [ $rc -eq 124 ] && verdict="TIMEOUT ${limit}s"
    fail=$((fail+1)); failed+=("$name")
    grep -E "Failure|FAILED|ERROR SUMMARY: [1-9]|Invalid|Race|Uninitialized|error|Expected|Which is|actual" "$OUT/last.log" | head -12
  fi
  table+=("$(printf '%-44s %-16s %5s s' "$name" "$verdict" "$secs")")
}

while read -r t limit; do
  [ -n "$t" ] || continue
  [[ -z "${TESTS:-}" || "$t" =~ ${TESTS} ]] || continue
  if [ ! -x ".bundle/bin/$t" ]; then
    fail=$((fail+1)); failed+=("$t(missing)"); table+=("$(printf '%-44s missing' "$t")"); continue
  fi
  if [ -z "${SANITIZE:-}" ]; then
    run_one "$OUT/tests.log" "$t" "${limit:-600}" ".bundle/bin/$t" ${GTEST_ARGS:-}
  else
    [[ -z "${SANITIZE_TESTS:-}" || "$t" =~ ${SANITIZE_TESTS} ]] || continue
    # One run of the binary, or with SANITIZE_SHARD=1 one run per test it lists (after
    # SANITIZE_GTEST_ARGS' filter), each its own job.
    shards=("")
    if [ -n "${SANITIZE_SHARD:-}" ]; then
      mapfile -t shards < <(".bundle/bin/$t" ${SANITIZE_GTEST_ARGS:-} --gtest_list_tests < /dev/null |
        awk '/^[^ ]/ { suite = $1 } /^  [^ ]/ { print suite $1 }')
      [ ${#shards[@]} -gt 0 ] || shards=("")
    fi
    for tool in $SANITIZE; do
      for i in "${!shards[@]}"; do
        shard=${shards[$i]}
        while [ "$(jobs -rp | wc -l)" -ge "${SANITIZE_JOBS:-1}" ]; do wait -n; done
        job="$jobdir/$tool-$t-$i"
        jobs_run+=("$tool $t $i $shard")
        cap=${SANITIZE_TIMEOUT:-${limit:-600}}
        if [ -n "${SANITIZE_BUDGET:-}" ]; then
          left=$(( sanitize_end - $(date +%s) ))
          if [ "$left" -lt 20 ]; then echo "not-run 0" > "$job.rc"; continue; fi
          [ "$left" -ge "$cap" ] || cap=$left
        fi
        ( t0=$(date +%s)
          TS_UNDER_SANITIZER=$tool timeout "$cap" compute-sanitizer --tool "$tool" \
            --error-exitcode 86 --print-limit 20 --report-api-errors no ${SANITIZE_ARGS:-} \
            ".bundle/bin/$t" ${SANITIZE_GTEST_ARGS:-} ${shard:+--gtest_filter=$shard} \
            > "$job.log" 2>&1
          echo "$? $(( $(date +%s) - t0 ))" > "$job.rc" ) &
      done
    done
  fi
done < .bundle/gpu-tests.txt
wait
# One log per tool and the table, in launch order (only a few files come back from the machine).
for j in "${jobs_run[@]}"; do
  read -r tool t i shard <<< "$j"
  job="$jobdir/$tool-$t-$i"
  read -r rc secs < "$job.rc"
  if [ "$rc" = not-run ]; then
    fail=$((fail+1)); failed+=("$t${shard:+ $shard} [$tool] (not run)")
    table+=("$(printf '%-44s %-16s' "$t${shard:+ $shard} [$tool]" "NOT RUN (budget)")")
    continue
  fi
  { echo "==== $t${shard:+ $shard}"; cat "$job.log"; } >> "$OUT/sanitize-$tool.log"
  if [ "$rc" -eq 0 ]; then verdict=pass; pass=$((pass+1));
  elif [ "$rc" -eq 77 ]; then verdict=skip; skip=$((skip+1));
  else
    verdict="FAIL rc=$rc"; [ "$rc" -eq 86 ] && verdict="SANITIZER ERROR"
    [ "$rc" -eq 124 ] && verdict="TIMEOUT"
    fail=$((fail+1)); failed+=("$t${shard:+ $shard} [$tool]")
    grep -E "Failure|FAILED|ERROR SUMMARY: [1-9]|Invalid|Race|Uninitialized|Expected" "$job.log" | head -8
  fi
  table+=("$(printf '%-44s %-16s %5s s' "$t${shard:+ $shard} [$tool]" "$verdict" "$secs")")
  rm -f "$job.log" "$job.rc"
done
rm -rf "$jobdir"

for b in ${BENCH:-}; do
  echo "==== $b"
  echo "==== $b" >> "$OUT/bench.log"
  timeout 400 .bundle/bin/$b ${BENCH_ARGS:-} > "$OUT/last.log" 2>&1
  echo "rc=$?"; cat "$OUT/last.log" >> "$OUT/bench.log"; tail -${BENCH_TAIL:-30} "$OUT/last.log"
done
rm -f "$OUT/last.log"
echo "==== gpu tests${SANITIZE:+ under compute-sanitizer ($SANITIZE)}"
printf '%s\n' "${table[@]}"
echo "==== $pass passed, $fail failed, $skip skipped"
[ ${#failed[@]} -eq 0 ] || printf '  failed: %s\n' "${failed[@]}"
[ "$fail" -eq 0 ]
