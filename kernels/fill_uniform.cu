#include "kernels/fill_uniform.cuh"

#include <algorithm>

#include "common/philox.h"
#include "common/status.h"
#include "kernels/cuda_check.h"

namespace ts::kernels {
namespace {

__global__ void FillUniformKernel(FillUniformParams p) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n;
       i += stride) {
    p.out[i] = __float2bfloat16(p.lo + (p.hi - p.lo) * UniformFromSeed(p.seed, i));
  }
}

}  // namespace

absl::Status LaunchFillUniform(FillUniformParams p, cudaStream_t stream) {
  if (p.n == 0) return absl::OkStatus();
  if (p.out == nullptr) return absl::InvalidArgumentError("fill_uniform.out is null");
  if (!(p.lo <= p.hi)) return absl::InvalidArgumentError("fill_uniform: lo > hi (or NaN)");
  const int threads = 256;
  const size_t want = (p.n + threads - 1) / threads;
  const int blocks = static_cast<int>(std::min<size_t>(want, 132 * 32));
  FillUniformKernel<<<blocks, threads, 0, stream>>>(p);
  TS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace ts::kernels
