#include "tests/graphs/loop_test_kernels.cuh"

namespace ts::graphs::testing {
namespace {

__global__ void SimStepKernel(SimStepParams p) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const int32_t step = (*p.log_count)++;
  if (step < p.max_steps) {
    int32_t* entry = p.log + static_cast<int64_t>(step) * (1 + p.max_bucket);
    entry[0] = p.bucket;
    for (int32_t r = 0; r < p.bucket; ++r) entry[1 + r] = p.row_slots[r];
  }
  for (int32_t r = 0; r < p.bucket; ++r) {
    const int32_t s = p.row_slots[r];
    if (s < 0 || p.slots[s].state != kernels::kSlotActive) continue;
    p.slots[s].generated += 1;
    if (--p.remaining[s] <= 0) p.slots[s].state = kernels::kSlotFinished;
  }
}

}  // namespace

cudaError_t EnqueueSimStep(const SimStepParams& p, cudaStream_t stream) {
  SimStepKernel<<<1, 1, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace ts::graphs::testing
