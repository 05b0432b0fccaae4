#!/usr/bin/env bash
# The multi-GPU issue's run (#16, docs/pipeline.md, The CUDA pipeline), on a device kind with two
# or more GPUs, over a bundle from scripts/gpu-bundle.sh (carry: .bundle.tar.xz), in one call:
#   1. correctness: the GPU pipeline tests, whose two-GPU cases skip on one GPU; with the 8B
#      checkpoint (TS_LLAMA8B_DIR, made here when missing) 32 requests with arrivals and cancels
#      through 2 stages, in one process and as two ranks over NCCL, must give one GPU's greedy
#      tokens;
#   2. scaling: tailserve-bench, one GPU against 2 stages on GPUs 0 and 1, batches 1, 64 and 128;
#   3. end to end: tailserve-load through the gRPC server with --pipeline_stages 2 at three rates;
#   4. failure: server_cuda_e2e_test's CudaRanksE2ETest kills one rank's process (its worker on
#      GPU 1, over NCCL) and requires the other to exit 1 within the timeout (part of 1's tests).
# Full logs under $OUT; a short table last. NVLink multicast stays off, as the machine requires.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
echo "GPUs: $gpus" | tee "$OUT/summary.txt"
if [ "$gpus" -lt 2 ]; then echo "run-pipeline-multi-gpu: needs two GPUs"; exit 1; fi
if [ ! -d .bundle ] && [ ! -f .bundle.tar.xz ]; then
  echo "run-pipeline-multi-gpu: no .bundle (scripts/gpu-bundle.sh makes it)"; exit 1
fi
[ -d .bundle ] || tar -xJf .bundle.tar.xz
export LD_LIBRARY_PATH=$PWD/.bundle/lib:${LD_LIBRARY_PATH:-}
export TS_LLAMA8B_DIR=${TS_LLAMA8B_DIR:-/tmp/llama8b}

# 1. Correctness (run-bundle.sh makes the 8B checkpoint when TS_LLAMA8B_DIR is missing).
OUT=$OUT/tests TESTS='engine_cuda_pipeline|engine_nccl|server_cuda' bash tests/gpu/run-bundle.sh \
  > "$OUT/tests.txt" 2>&1
tests_rc=$?
grep -E "lockstep|link between" "$OUT/tests/tests.log" >> "$OUT/summary.txt"

# 2. Scaling: one GPU, then 2 stages on GPUs 0 and 1.
.bundle/bin/tailserve-bench --shapes 8b --batches 1,64,128 --modes host,pipe \
  --pipeline_stages 2 --pipeline_devices 0,1 --new_tokens 128 --out "$OUT/scaling.jsonl" \
  > "$OUT/scaling.log" 2>&1
scaling_rc=$?

# 3. End to end through the server, host-driven on both (a pipeline's steps are host-driven).
MODEL=$TS_LLAMA8B_DIR MODES=host RATES="4 16 48" REQUESTS=200 OUT=$OUT/serve \
  bash bench/serving/serve_bench.sh > "$OUT/serve-one.txt" 2>&1
MODEL=$TS_LLAMA8B_DIR MODES=host RATES="4 16 48" REQUESTS=200 OUT=$OUT/serve TAG=-pp2 \
  SERVER_ARGS="--pipeline_stages 2" bash bench/serving/serve_bench.sh > "$OUT/serve-pp2.txt" 2>&1

{
  echo "==== correctness: tests rc=$tests_rc"
  tail -8 "$OUT/tests.txt"
  echo "==== scaling: rc=$scaling_rc (step_ms and tokens/s; the target: pipe at 128 >= 1.7x host at 64)"
  grep -E "^8b " "$OUT/scaling.log"
  echo "==== end to end: one GPU, then 2 stages"
  tail -4 "$OUT/serve-one.txt"
  tail -4 "$OUT/serve-pp2.txt"
  echo "==== failure (a killed rank ends the other with exit 1, over NCCL and through the host)"
  grep -E "CudaRanksE2ETest|CudaRanksTest" "$OUT/tests/tests.log" | grep -E "OK|FAILED|SKIPPED"
} | tee -a "$OUT/summary.txt"
