#include "kernels/rmsnorm.cuh"

#include <cstdint>

#include "common/status.h"
#include "kernels/bf16_vec.cuh"
#include "kernels/cuda_check.h"
#include "kernels/pdl.cuh"

namespace ts::kernels {
namespace {

// Each thread keeps up to kVecsPerThread 16-byte vectors of its row in registers, so the row is
// read once and there is a single kernel instance: blockDim = ceil(hidden/8 / kVecsPerThread)
// rounded up to a warp (<= 1024 threads, hence kRmsNormMaxHidden = 1024 * 4 * 8).
constexpr int kVecsPerThread = 4;
constexpr int kMaxThreads = 1024;
static_assert(kRmsNormMaxHidden == kMaxThreads * kVecsPerThread * 8);

__device__ float BlockSum(float v, float* scratch /* [32] */) {
  v = WarpSum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  v = lane < warps ? scratch[lane] : 0.0f;
  return WarpSum(v);  // every warp reduces the same 32 values, so all threads get the total
}

__global__ void __launch_bounds__(kMaxThreads) RmsNormKernel(RmsNormParams p) {
  __shared__ float scratch[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * p.hidden;
  const int vecs = p.hidden / 8;
  // The weight is independent of the kernel before us, so it is fetched into L1 while that kernel
  // drains under PDL (kernels/pdl.cuh); everything else waits. A prefetch rather than a load: at
  // 1,024 threads a thread has 64 registers, which the row alone nearly fills.
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v < vecs) asm volatile("prefetch.global.L1 [%0];" ::"l"(p.weight + v * 8));
  }
  GridDepWait();
  GridDepLaunchDependents();
  // Every load is issued before the first store: a store to the residual may alias a later
  // load as far as the compiler knows, so a loop that added and stored one vector at a time took
  // one memory round trip per vector (x may alias out, which is written only at the end).
  Bf16x8 r[kVecsPerThread], x[kVecsPerThread];
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v >= vecs) continue;
    r[i] = LoadBf16x8Coherent(p.residual + base + v * 8);
    if (p.x != nullptr) x[i] = LoadBf16x8Coherent(p.x + base + v * 8);
  }
  float sum_sq = 0.0f;
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v >= vecs) continue;
    if (p.x != nullptr) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
        r[i].h[j] = __float2bfloat16_rn(__bfloat162float(r[i].h[j]) + __bfloat162float(x[i].h[j]));
      StoreBf16x8(p.residual + base + v * 8, r[i]);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float f = __bfloat162float(r[i].h[j]);
      sum_sq = fmaf(f, f, sum_sq);
    }
  }
  const float inv_rms = rsqrtf(BlockSum(sum_sq, scratch) / p.hidden + p.eps);
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v >= vecs) continue;
    const Bf16x8 w = LoadBf16x8(p.weight + v * 8);
    Bf16x8 o;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      o.h[j] = __float2bfloat16_rn(
          RmsNormScale(__bfloat162float(r[i].h[j]), inv_rms, __bfloat162float(w.h[j])));
    }
    StoreBf16x8(p.out + base + v * 8, o);
  }
}

}  // namespace

absl::Status LaunchRmsNorm(const RmsNormParams& p, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(RequireNonNegative("rmsnorm.rows", p.rows));
  if (p.rows == 0) return absl::OkStatus();
  TS_RETURN_IF_ERROR(RequireMultipleOf("rmsnorm.hidden", p.hidden, 8));
  if (p.hidden > kRmsNormMaxHidden) {
    return absl::InvalidArgumentError(
        absl::StrCat("rmsnorm.hidden must be <= ", kRmsNormMaxHidden, ", got ", p.hidden));
  }
  if (!(p.eps > 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("rmsnorm.eps must be > 0, got ", p.eps));
  }
  if (p.x != nullptr) TS_RETURN_IF_ERROR(RequirePointer("rmsnorm.x", p.x));
  TS_RETURN_IF_ERROR(RequirePointer("rmsnorm.residual", p.residual));
  TS_RETURN_IF_ERROR(RequirePointer("rmsnorm.weight", p.weight));
  TS_RETURN_IF_ERROR(RequirePointer("rmsnorm.out", p.out));
  if (p.out == p.residual) {
    return absl::InvalidArgumentError("rmsnorm.out must not alias rmsnorm.residual");
  }
  const int vecs = p.hidden / 8;
  const int threads_needed = (vecs + kVecsPerThread - 1) / kVecsPerThread;
  const int threads = (threads_needed + 31) / 32 * 32;
  TS_CUDA_RETURN_IF_ERROR(
      LaunchWithPdl(RmsNormKernel, dim3(p.rows), dim3(threads), 0, stream, p.pdl, p));
  return absl::OkStatus();
}

}  // namespace ts::kernels
