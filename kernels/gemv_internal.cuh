// Internal to the GEMV op (kernels/gemv.cuh): what its two kernels share, the epilogue of one
// output value and the m > 8 launcher. Only kernels/gemv*.cu include it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/bf16_vec.cuh"
#include "kernels/gemv.cuh"
#include "kernels/kv_layout.cuh"
#include "kernels/rope_kv.cuh"

namespace ts::kernels::gemv_internal {

// Epilogue for element e = i * n + col of C (kStore / kAccumulate); returns the value stored.
__device__ __forceinline__ float StoreOutput(const GemvParams& p, int64_t e, float v) {
  const bool acc = p.epilogue == GemvEpilogue::kAccumulate;
  if (p.c_f32 != nullptr) {
    if (acc) v += p.c_f32[e];
    p.c_f32[e] = v;
    return v;
  }
  // A bf16 Linear rounds its output, then the residual add rounds the sum.
  if (acc) v = RoundBf16(v) + __bfloat162float(p.c[e]);
  const __nv_bfloat16 b = __float2bfloat16_rn(v);
  p.c[e] = b;
  return __bfloat162float(b);
}

// kRopeKv output of row i of A, pair (d, d + head_dim / 2) of head `head`, from the fp32 sums x1
// (row d of the head) and x2 (row d + head_dim / 2).
__device__ __forceinline__ void RopeEpilogue(const GemvParams& p, int i, int32_t head, int32_t d,
                                             float x1, float x2) {
  const GemvRopeKv& r = p.rope;
  const KvLayout& l = r.layout;
  x1 = RoundBf16(x1);  // the q/k/v Linear's bf16 output
  x2 = RoundBf16(x2);
  const int32_t hq = r.num_q_heads, hkv = l.num_kv_heads, half = l.head_dim / 2;
  if (head < hq + hkv) RopeRotate(x1, x2, RopeAngle(r.positions[i], r.inv_freq[d]), x1, x2);
  __nv_bfloat16* dst;
  if (head < hq) {
    dst = p.c + (static_cast<int64_t>(i) * hq + head) * l.head_dim;
  } else {
    const int32_t slot = r.slot_mapping[i];
    if (!KvSlotInPool(slot, l.num_blocks, l.block_size)) {
      if (slot != kNoKvWrite && r.error_flag != nullptr) *r.error_flag = 1;
      return;
    }
    const bool is_k = head < hq + hkv;
    dst = (is_k ? r.k_cache : r.v_cache) +
          KvOffset(l, slot / l.block_size, head - hq - (is_k ? 0 : hkv), slot % l.block_size);
  }
  dst[d] = __float2bfloat16_rn(x1);
  dst[d + half] = __float2bfloat16_rn(x2);
}

// The m > 8 kernel (gemv_tc.cu): LaunchGemv has validated `p` except for what only this kernel
// needs (split_k against the cluster size and the k range, kRopeKv's head_dim).
absl::Status LaunchGemvTc(const GemvParams& p, cudaStream_t stream);
int32_t ChooseGemvTcSplitK(int32_t m, int32_t n, int32_t k, int32_t num_sms, GemvEpilogue epilogue);
int32_t GemvTcTiles(int32_t n, GemvEpilogue epilogue);

}  // namespace ts::kernels::gemv_internal
