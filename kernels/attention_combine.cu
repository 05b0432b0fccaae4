#include "kernels/attention_combine.cuh"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/attention_common.cuh"
#include "kernels/cuda_check.h"
#include "kernels/pdl.cuh"

namespace ts::kernels {
namespace {

using attention_internal::ClampedContext;
using attention_internal::NumActiveSplits;
using attention_internal::SplitGeometry;

constexpr int kCombineWarps = 4;

struct CombineArgs {
  const float* partial_out;     // [num_seqs, num_heads, max_splits, D]
  const float* partial_lse;     // [num_seqs, num_heads, max_splits]
  const int32_t* context_lens;  // [num_seqs]
  __nv_bfloat16* out;           // [num_seqs, num_heads, D]
  int32_t num_rows;             // num_seqs * num_heads
  int32_t num_heads;
  int32_t max_splits;
  SplitGeometry geo;
};

// Splits merged with every load issued at once: the split kernel's usual split counts at decode
// contexts. More splits take the loop below, a load round trip per split.
constexpr int kUnrolledSplits = 8;

// One warp per (seq, head) row; lanes own 4 consecutive dims each.
template <int D>
__global__ void __launch_bounds__(kCombineWarps * 32) AttentionCombineKernel(CombineArgs a) {
  static_assert(D % 4 == 0 && D / 4 <= 32, "a warp covers the head in float4s");
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kCombineWarps + (threadIdx.x >> 5);
  // The context lengths come from a kernel older than the split kernel, so they are read before
  // the wait, through L2 (the chain rule of kernels/pdl.cuh); the partials only after it.
  int n = 0;
  if (row < a.num_rows) {
    const int ctx = ClampedContext(a.geo, __ldcg(a.context_lens + row / a.num_heads));
    n = ctx > 0 ? NumActiveSplits(a.geo, ctx) : 0;
  }
  GridDepWait();
  GridDepLaunchDependents();
  if (row >= a.num_rows) return;
  if (a.geo.num_splits == 1 && n == 1) return;  // the split kernel wrote this row itself
  const float* lse = a.partial_lse + static_cast<int64_t>(row) * a.max_splits;
  const float* po = a.partial_out + static_cast<int64_t>(row) * a.max_splits * D + lane * 4;
  const bool lane_in = lane * 4 < D;

  // Splits below n are never empty (NumActiveSplits); an empty one would have lse -inf and an
  // undefined output, skipped below in either path.
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  float wsum = 0.f;
  auto add = [&](float l, float m, const float4& v) {
    const float w = exp2f(l - m);
    wsum += w;
    acc[0] += w * v.x;
    acc[1] += w * v.y;
    acc[2] += w * v.z;
    acc[3] += w * v.w;
  };
  if (n <= kUnrolledSplits) {
    float l[kUnrolledSplits];
    float4 v[kUnrolledSplits];
#pragma unroll
    for (int i = 0; i < kUnrolledSplits; ++i) {
      l[i] = i < n ? lse[i] : -INFINITY;
      v[i] = i < n && lane_in ? *reinterpret_cast<const float4*>(po + static_cast<int64_t>(i) * D)
                              : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kUnrolledSplits; ++i) m = fmaxf(m, l[i]);
    if (m != -INFINITY) {
#pragma unroll
      for (int i = 0; i < kUnrolledSplits; ++i) {
        if (l[i] != -INFINITY) add(l[i], m, v[i]);
      }
    }
  } else {
    float m = -INFINITY;
    for (int i = lane; i < n; i += 32) m = fmaxf(m, lse[i]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (m != -INFINITY) {
      for (int i = 0; i < n; ++i) {
        const float l = lse[i];
        if (l == -INFINITY) continue;
        add(l, m,
            lane_in ? *reinterpret_cast<const float4*>(po + static_cast<int64_t>(i) * D)
                    : make_float4(0.f, 0.f, 0.f, 0.f));
      }
    }
  }
  if (lane_in) {
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
    __nv_bfloat162* o =
        reinterpret_cast<__nv_bfloat162*>(a.out + static_cast<int64_t>(row) * D + lane * 4);
    o[0] = __floats2bfloat162_rn(acc[0] * inv, acc[1] * inv);
    o[1] = __floats2bfloat162_rn(acc[2] * inv, acc[3] * inv);
  }
}

absl::Status Invalid(const char* field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("AttentionCombineParams.", field, " ", why));
}

}  // namespace

absl::Status LaunchAttentionCombine(const AttentionCombineParams& p, cudaStream_t stream) {
  using attention_internal::IsAligned;
  if (p.partial_out == nullptr || !IsAligned(p.partial_out, 16))
    return Invalid("partial_out", "must be non-null and 16-byte aligned");
  if (p.partial_lse == nullptr) return Invalid("partial_lse", "must be non-null");
  if (p.context_lens == nullptr) return Invalid("context_lens", "must be non-null");
  if (p.out == nullptr || !IsAligned(p.out, 4))
    return Invalid("out", "must be non-null and 4-byte aligned");
  if (p.num_seqs < 1) return Invalid("num_seqs", absl::StrCat("= ", p.num_seqs, " must be >= 1"));
  if (p.num_heads < 1)
    return Invalid("num_heads", absl::StrCat("= ", p.num_heads, " must be >= 1"));
  if (p.max_splits < 1)
    return Invalid("max_splits", absl::StrCat("= ", p.max_splits, " must be >= 1"));
  if (p.num_splits < 1 || p.num_splits > p.max_splits)
    return Invalid("num_splits", absl::StrCat("= ", p.num_splits,
                                              " must be in [1, max_splits=", p.max_splits, "]"));
  if (p.min_split_tokens < 1)
    return Invalid("min_split_tokens", absl::StrCat("= ", p.min_split_tokens, " must be >= 1"));
  if (p.block_size < 1)
    return Invalid("block_size", absl::StrCat("= ", p.block_size, " must be >= 1"));
  if (p.max_blocks_per_seq < 1)
    return Invalid("max_blocks_per_seq", absl::StrCat("= ", p.max_blocks_per_seq, " must be >= 1"));
  const int64_t rows = static_cast<int64_t>(p.num_seqs) * p.num_heads;
  if (rows > (int64_t{1} << 30)) return Invalid("num_seqs", "* num_heads is too large");
  if (static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size > INT32_MAX)
    return Invalid("max_blocks_per_seq", "* block_size overflows int32");

  CombineArgs a;
  a.partial_out = p.partial_out;
  a.partial_lse = p.partial_lse;
  a.context_lens = p.context_lens;
  a.out = p.out;
  a.num_rows = static_cast<int32_t>(rows);
  a.num_heads = p.num_heads;
  a.max_splits = p.max_splits;
  a.geo = SplitGeometry{p.num_splits, p.min_split_tokens, p.block_size,
                        p.max_blocks_per_seq * p.block_size};
  const dim3 grid(static_cast<unsigned>((rows + kCombineWarps - 1) / kCombineWarps));
  return attention_internal::DispatchHeadDim(
      p.head_dim, "AttentionCombineParams.head_dim", [&](auto d) -> absl::Status {
        TS_CUDA_RETURN_IF_ERROR(LaunchWithPdl(AttentionCombineKernel<decltype(d)::value>, grid,
                                              dim3(kCombineWarps * 32), 0, stream, p.pdl, a));
        return absl::OkStatus();
      });
}

}  // namespace ts::kernels
