#!/usr/bin/env bash
# The CUDA backend's checks on the GPU machine, after tests/gpu/run.sh's build stage:
#   1. engine_cuda_memory_plan_test and engine_cuda_backend_test (the committed fixtures);
#   2. the Llama-3.2-1B-shape reference (transformers, bf16, random weights) and
#      engine_cuda_hf_logits_test against it;
#   3. tailserve-bench (decode step time per shape and batch, JSON lines) with --profile.
# Logs go under $OUT; a short summary is printed last.
#   CUDA_STAGES="test hf bench" (default all three); BENCH_ARGS="--shapes 1b --batches 1,16"
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
BUILD_DIR=${BUILD_DIR:-build-gpu}
CUDA_STAGES=${CUDA_STAGES:-"test hf bench"}
LLAMA1B_DIR=${TS_LLAMA1B_DIR:-/tmp/llama1b}
mkdir -p "$OUT"
summary=()
has() { [[ " $CUDA_STAGES " == *" $1 "* ]]; }

if has test; then
  (cd "$BUILD_DIR" && ctest -R 'engine_cuda_(memory_plan|backend)_test' --output-on-failure \
    --timeout 600) >"$OUT/cuda-backend-test.log" 2>&1
  rc=$?
  grep -E "Test +#|tests passed|FAILED|Failure|max \|logit" "$OUT/cuda-backend-test.log" | tail -30
  summary+=("cuda backend tests rc=$rc")
fi

if has hf; then
  if [ -f "$LLAMA1B_DIR/reference_logits.safetensors" ] ||
     python3 tests/gpu/make_llama_reference.py --shape 1b --out "$LLAMA1B_DIR" \
       >"$OUT/llama1b-reference.log" 2>&1; then
    (cd "$BUILD_DIR" && TS_LLAMA1B_DIR="$LLAMA1B_DIR" ctest -R engine_cuda_hf_logits_test -V \
      --timeout 600) >"$OUT/cuda-hf-logits.log" 2>&1
    rc=$?
    grep -E "prompt [0-9]|overall|Passed|Failed|Skipped" "$OUT/cuda-hf-logits.log" | tail -12
    summary+=("hf logits test rc=$rc")
  else
    tail -20 "$OUT/llama1b-reference.log"
    summary+=("llama1b reference FAILED")
  fi
fi

if has bench; then
  bench="$BUILD_DIR/bench/tailserve-bench"
  if [ -x "$bench" ]; then
    # shellcheck disable=SC2086
    "$bench" --out "$OUT/tailserve-bench.jsonl" --profile ${BENCH_ARGS:-} \
      >"$OUT/tailserve-bench.log" 2>"$OUT/tailserve-bench.err"
    rc=$?
    tail -40 "$OUT/tailserve-bench.log"
    [ $rc -ne 0 ] && tail -20 "$OUT/tailserve-bench.err"
    summary+=("tailserve-bench rc=$rc")
  else
    summary+=("tailserve-bench not built (bench/CMakeLists.txt: add_subdirectory(decode))")
  fi
fi

echo "==== cuda backend summary"
printf '%s\n' "${summary[@]}"
