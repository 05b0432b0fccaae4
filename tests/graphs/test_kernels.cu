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

__device__ __forceinline__ uint64_t GlobalNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__global__ void LateWriteKernel(float* buf, int32_t width, float base, int64_t delay_ns) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const uint64_t t0 = GlobalNs();
  while (GlobalNs() - t0 < static_cast<uint64_t>(delay_ns)) {
  }
  const int32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < width) buf[i] = base + static_cast<float>(i);
}

__global__ void AddPdlKernel(float* buf, int32_t width, float add) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < width) buf[i] += add;
}

__global__ void CopyPdlKernel(const float* buf, float* out, int32_t width) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < width) out[i] = buf[i];
}

constexpr int32_t kPdlThreads = 64;

template <typename... Args>
cudaError_t LaunchPdl(void (*kernel)(Args...), int32_t width, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<uint32_t>((width + kPdlThreads - 1) / kPdlThreads));
  cfg.blockDim = dim3(kPdlThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

}  // namespace

cudaError_t LaunchLateWrite(float* buf, int32_t width, float base, int64_t delay_ns,
                            cudaStream_t stream) {
  return LaunchPdl(LateWriteKernel, width, stream, buf, width, base, delay_ns);
}

cudaError_t LaunchAddPdl(float* buf, int32_t width, float add, cudaStream_t stream) {
  return LaunchPdl(AddPdlKernel, width, stream, buf, width, add);
}

cudaError_t LaunchCopyPdl(const float* buf, float* out, int32_t width, cudaStream_t stream) {
  return LaunchPdl(CopyPdlKernel, width, stream, buf, out, width);
}

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
