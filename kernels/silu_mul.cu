#include "kernels/silu_mul.cuh"

#include <cstdint>

#include "common/status.h"
#include "kernels/bf16_vec.cuh"
#include "kernels/cuda_check.h"
#include "kernels/pdl.cuh"

namespace ts::kernels {
namespace {

constexpr int kThreads = 256;

// grid: (rows, ceil(intermediate / 8 / kThreads)); one 16-byte output vector per thread.
__global__ void __launch_bounds__(kThreads) SiluMulKernel(SiluMulParams p) {
  const int32_t vec = blockIdx.y * kThreads + threadIdx.x;
  GridDepWait();
  GridDepLaunchDependents();
  if (vec >= p.intermediate / 8) return;
  const __nv_bfloat16* gate = p.in + static_cast<int64_t>(blockIdx.x) * 2 * p.intermediate;
  const Bf16x8 g = LoadBf16x8(gate + vec * 8);
  const Bf16x8 u = LoadBf16x8(gate + p.intermediate + vec * 8);
  Bf16x8 o;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    o.h[j] = __float2bfloat16_rn(SiluMul(__bfloat162float(g.h[j]), __bfloat162float(u.h[j])));
  }
  StoreBf16x8(p.out + static_cast<int64_t>(blockIdx.x) * p.intermediate + vec * 8, o);
}

}  // namespace

absl::Status LaunchSiluMul(const SiluMulParams& p, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(RequireNonNegative("silu_mul.rows", p.rows));
  if (p.rows == 0) return absl::OkStatus();
  TS_RETURN_IF_ERROR(RequireMultipleOf("silu_mul.intermediate", p.intermediate, 8));
  TS_RETURN_IF_ERROR(RequirePointer("silu_mul.in", p.in));
  TS_RETURN_IF_ERROR(RequirePointer("silu_mul.out", p.out));
  const dim3 grid(p.rows, (p.intermediate / 8 + kThreads - 1) / kThreads);
  TS_CUDA_RETURN_IF_ERROR(LaunchWithPdl(SiluMulKernel, grid, dim3(kThreads), 0, stream, p.pdl, p));
  return absl::OkStatus();
}

}  // namespace ts::kernels
