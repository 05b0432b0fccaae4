// Programmatic dependent launch (PDL) on sm_90: a kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start while the kernel before it in the
// stream (or graph) is still running, as soon as every CTA of that kernel has called
// GridDepLaunchDependents (or exited). It must call GridDepWait before it touches anything the
// earlier kernel writes; the wait returns once that kernel has completed and its memory is
// visible. The overlap hides the launch latency and lets a kernel start its own independent
// reads (weights) early: 1.2 -> 0.86 us per node for a chain of 1 MB kernels (docs/gpu-facts.md,
// PDL). Both device calls are no-ops in a kernel launched without the attribute.
//
// The chain rule: every kernel of ours calls GridDepWait before GridDepLaunchDependents (a kernel
// that never triggers counts as triggering at its exit, and cuBLASLt's are launched without the
// attribute). So when a kernel starts, the kernel before it has passed its wait, and every kernel
// older than that one has completed with its writes in L2. A kernel may therefore read before its
// own wait, through L2 (ld.global.cg, not an L1-cached load), what only older kernels wrote: the
// attention combine reads the context lengths that way (kernels/attention_combine.cu). A kernel
// that triggers before it waits would break this for the kernel after it.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace ts::kernels {

__device__ __forceinline__ void GridDepWait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void GridDepLaunchDependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization when
// `pdl`. Returns the launch error.
template <typename... KernelArgs, typename... Args>
cudaError_t LaunchWithPdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                          cudaStream_t stream, bool pdl, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace ts::kernels
