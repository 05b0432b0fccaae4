#include "kernels/global_timer.cuh"

#include "absl/status/status.h"
#include "kernels/cuda_check.h"
#include "kernels/step_stamps.cuh"

namespace ts::kernels {
namespace {

__global__ void ReadGlobalTimerKernel(uint64_t* out) {
  *out = GlobalTimerNs();
}

}  // namespace

absl::Status LaunchReadGlobalTimer(ReadGlobalTimerParams p, cudaStream_t stream) {
  if (p.out == nullptr) return absl::InvalidArgumentError("read_global_timer.out is null");
  ReadGlobalTimerKernel<<<1, 1, 0, stream>>>(p.out);
  TS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace ts::kernels
