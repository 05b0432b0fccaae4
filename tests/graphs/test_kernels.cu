#include "tests/graphs/test_kernels.cuh"

namespace ts::graphs::testing {
namespace {

__global__ void WriteKernel(float* out, int32_t width, int32_t bucket, int32_t splits,
                            int32_t max_context_len) {
  const int32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= width) return;
  out[i] = static_cast<float>(bucket) * 100.0f + static_cast<float>(splits) * 7.0f +
           static_cast<float>(max_context_len) * 0.25f + static_cast<float>(i);
}

// Depends on WriteKernel's result, so a wrong node order shows in the value.
__global__ void AffineKernel(float* out, int32_t width, float scale, float shift) {
  const int32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= width) return;
  out[i] = out[i] * scale + shift;
}

__global__ void CountKernel(int32_t* counter) {
  *counter += 1;
}

__global__ void CombineKernel(float* out, int32_t width) {
  const int32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < width) out[i] = out[i] + 0.0f;
}

}  // namespace

int32_t TestStepNodes(const TestStepParams& p) {
  return 3 + (p.combine_only_when_split && p.splits > 1 ? 1 : 0);
}

cudaError_t EnqueueTestStep(const TestStepParams& p, cudaStream_t stream) {
  constexpr int32_t kThreads = 64;
  const int32_t blocks = (p.width + kThreads - 1) / kThreads;
  WriteKernel<<<blocks, kThreads, 0, stream>>>(p.out, p.width, p.bucket, p.splits,
                                               p.max_context_len);
  AffineKernel<<<blocks, kThreads, 0, stream>>>(p.out, p.width, static_cast<float>(p.splits),
                                                static_cast<float>(p.bucket));
  CountKernel<<<1, 1, 0, stream>>>(p.counter);
  if (p.combine_only_when_split && p.splits > 1) {
    CombineKernel<<<blocks, kThreads, 0, stream>>>(p.out, p.width);
  }
  return cudaGetLastError();
}

}  // namespace ts::graphs::testing
