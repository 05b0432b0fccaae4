// Device helpers shared by the elementwise kernels: 16-byte bf16 vectors and warp reductions.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace ts::kernels {

struct alignas(16) Bf16x8 {
  __nv_bfloat16 h[8];
};

// `p` must be 16-byte aligned (the launchers check the base pointers and the row strides).
__device__ __forceinline__ Bf16x8 LoadBf16x8(const __nv_bfloat16* p) {
  Bf16x8 v;
  *reinterpret_cast<uint4*>(&v) = __ldg(reinterpret_cast<const uint4*>(p));
  return v;
}
// Plain (coherent) load, for data this kernel itself may have written.
__device__ __forceinline__ Bf16x8 LoadBf16x8Coherent(const __nv_bfloat16* p) {
  Bf16x8 v;
  *reinterpret_cast<uint4*>(&v) = *reinterpret_cast<const uint4*>(p);
  return v;
}
__device__ __forceinline__ void StoreBf16x8(__nv_bfloat16* p, const Bf16x8& v) {
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&v);
}

// Transformers runs a bf16 Llama as a chain of bf16 tensor ops: each computes in fp32 and rounds
// its result to bf16. The kernels round at the same points (not once per fused kernel), so their
// logits track transformers' to within fp32 summation order, not to within bf16 noise.
__device__ __forceinline__ float RoundBf16(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}
// LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)).to(bf16), two roundings.
__device__ __forceinline__ float RmsNormScale(float x, float inv_rms, float weight) {
  return RoundBf16(weight * RoundBf16(x * inv_rms));
}
// LlamaMLP's act_fn(gate) * up: silu rounded to bf16, then the product.
// expf, not __expf: the fast one loses accuracy for large |x|.
__device__ __forceinline__ float SiluMul(float gate, float up) {
  return RoundBf16(RoundBf16(gate / (1.0f + expf(-gate))) * up);
}

// Llama's rotary embedding (rotate_half) for the pair (x1, x2) = (x[i], x[i + head_dim / 2]):
// the angle float(position) * inv_freq[i] in fp32 as transformers forms it, accurate sincosf
// (positions reach 1e5 and more), cos and sin cast to bf16, then x * cos + rotate_half(x) * sin
// with each product rounded; the caller rounds the sums when it stores them.
struct RopeCosSin {
  float c, s;
};
__device__ __forceinline__ RopeCosSin RopeAngle(int32_t position, float inv_freq) {
  float sn, cs;
  sincosf(static_cast<float>(position) * inv_freq, &sn, &cs);
  return {RoundBf16(cs), RoundBf16(sn)};
}
__device__ __forceinline__ void RopeRotate(float x1, float x2, RopeCosSin r, float& o1, float& o2) {
  o1 = RoundBf16(x1 * r.c) + RoundBf16(-x2 * r.s);
  o2 = RoundBf16(x2 * r.c) + RoundBf16(x1 * r.s);
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

}  // namespace ts::kernels
