// Internal helpers shared by the attention kernels (decode, combine, prefill). Not a public header:
// only kernels/*attention*.cu include it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#ifdef __CUDACC__
#include "kernels/ptx.cuh"  // device code only; host tests include this header too
#endif

namespace ts::kernels::attention_internal {

// The one place a runtime head_dim becomes a compile-time constant. Every attention launcher goes
// through here, so adding a size means one new case (and one more template instance per kernel).
inline constexpr int kSupportedHeadDims[] = {16, 64, 128};

template <typename Fn>
absl::Status DispatchHeadDim(int head_dim, const char* field, Fn&& fn) {
  switch (head_dim) {
    case 16:
      return fn(std::integral_constant<int, 16>{});
    case 64:
      return fn(std::integral_constant<int, 64>{});
    case 128:
      return fn(std::integral_constant<int, 128>{});
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, " = ", head_dim, " is not supported; supported: 16, 64, 128"));
  }
}

inline bool IsAligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

inline bool IsPowerOfTwo(int v) {
  return v > 0 && (v & (v - 1)) == 0;
}

inline int Log2Exact(int v) {
  int s = 0;
  while ((1 << s) < v) ++s;
  return s;
}

// How one sequence's context is cut into splits. The split kernels and the combine kernel both
// evaluate it, so the combine knows how many partial results a sequence has without any host
// involvement. Splits are block-aligned and cover [i * tokens, min(ctx, (i+1) * tokens)).
struct SplitGeometry {
  int32_t num_splits;        // upper bound of splits per sequence (<= workspace max_splits)
  int32_t min_split_tokens;  // a split never holds fewer tokens than this (except the last)
  int32_t block_size;        // tokens per KV block; split sizes are multiples of it
  int32_t max_context;       // max_blocks_per_seq * block_size; longer context_lens are clamped
};

__host__ __device__ inline int32_t ClampedContext(const SplitGeometry& g, int32_t context_len) {
  return context_len < 0 ? 0 : (context_len > g.max_context ? g.max_context : context_len);
}

// Tokens per split for a sequence with `ctx` tokens; always >= 1.
__host__ __device__ inline int32_t SplitTokens(const SplitGeometry& g, int32_t ctx) {
  int32_t per = (ctx + g.num_splits - 1) / g.num_splits;
  per = (per + g.block_size - 1) / g.block_size * g.block_size;
  if (per < g.min_split_tokens) per = g.min_split_tokens;
  return per < 1 ? 1 : per;
}

// Non-empty splits of a sequence with `ctx` tokens: ceil(ctx / SplitTokens) <= num_splits.
__host__ __device__ inline int32_t NumActiveSplits(const SplitGeometry& g, int32_t ctx) {
  const int32_t per = SplitTokens(g, ctx);
  return (ctx + per - 1) / per;
}

constexpr float kLog2e = 1.4426950408889634f;

#ifdef __CUDACC__
// Device helpers of the tensor-core attention kernels (decode and prefill); the mma fragment
// layout is ptx::MmaBf16's.
using ptx::MmaBf16;

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t PackBf16(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}

// The warp holds an 8x8 bf16 matrix, lane 4g + t its row g at columns 2t, 2t+1; returns the same
// lane's part of the transpose. Turns a C fragment into the matching B fragment of the next mma.
__device__ __forceinline__ uint32_t TransposeBf16x8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Entry `index` of a block-table row, or block 0 with *error_flag = 1 when the entry is not a block
// of the pool (kInvalidKvBlock padding, a negative id, one >= num_blocks). A context that reaches
// padding is a bug upstream: block 0 keeps the kernel in bounds while the flag fails the step.
__device__ __forceinline__ int32_t CheckedBlock(const int32_t* row, int index, int32_t num_blocks,
                                                int32_t* error_flag) {
  const int32_t b = __ldg(row + index);
  if (static_cast<uint32_t>(b) < static_cast<uint32_t>(num_blocks)) return b;
  if (error_flag != nullptr) *error_flag = 1;
  return 0;
}

// CheckedBlock for an id already read from the table, so that the read can be issued well before
// the id is needed: `b` when it is a block of the pool, else block 0 with *error_flag = 1.
__device__ __forceinline__ int32_t CheckedBlockId(int32_t b, int32_t num_blocks,
                                                  int32_t* error_flag) {
  if (static_cast<uint32_t>(b) < static_cast<uint32_t>(num_blocks)) return b;
  if (error_flag != nullptr) *error_flag = 1;
  return 0;
}

// 2^x on the SFU alone: exp2f adds a range fix-up (4 instructions instead of 1) to keep results
// below 2^-126 from flushing to zero, which softmax weights that small never need. -inf gives 0.
__device__ __forceinline__ float Exp2Approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Safe max for the exponent shift: an all -inf row shifts by 0 so 2^(-inf - 0) = 0, never NaN.
__device__ __forceinline__ float SafeShift(float m) {
  return m == -INFINITY ? 0.f : m;
}
#endif  // __CUDACC__

}  // namespace ts::kernels::attention_internal
