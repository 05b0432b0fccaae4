#include "kernels/prefill_attention.cuh"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/attention_common.cuh"
#include "kernels/cuda_check.h"

namespace ts::kernels {
namespace {

using attention_internal::CheckedBlock;
using attention_internal::kLog2e;
using attention_internal::MmaBf16;
using attention_internal::PackBf16;
using attention_internal::SafeShift;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = 16;  // the mma M dimension
constexpr int kRowsPerCta = kWarps * kRowsPerWarp;
constexpr int kKeyTile = 64;  // keys staged in shared memory per step
constexpr int kPad = 8;       // bf16 row padding: keeps fragment loads free of bank conflicts

struct PrefillArgs {
  const __nv_bfloat16* q;        // [total_tokens, num_q_heads, D]
  const __nv_bfloat16* k_cache;  // [num_blocks, num_kv_heads, block_size, D]
  const __nv_bfloat16* v_cache;  // [num_blocks, num_kv_heads, block_size, D]
  const int32_t* block_tables;   // [num_seqs, max_blocks_per_seq]
  const int32_t* cu_seqlens;     // [num_seqs + 1]
  const int32_t* start_pos;      // [num_seqs] or nullptr
  __nv_bfloat16* out;            // [total_tokens, num_q_heads, D]
  int32_t* error_flag;           // [1] or nullptr: a table entry read is invalid
  int32_t num_blocks;
  int32_t total_tokens;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t group_size;
  int32_t block_shift;
  int32_t max_blocks_per_seq;
  int32_t max_context;  // max_blocks_per_seq * block_size
  float scale_log2;
  int32_t num_splits;  // blockIdx.z = seq * num_splits + split
  float* partial_out;  // [total_tokens * num_q_heads, num_splits, D] when num_splits > 1
  float* partial_lse;  // [total_tokens * num_q_heads, num_splits]
};

// Rows are (token, query head in group) pairs flattened as token * group_size + head, so GQA
// heads of one token share the K/V tile. mma fragment ownership (PTX m16n8k16): lane = 4*g + t
// holds rows g and g+8 of its warp's 16 rows, and columns 2t, 2t+1 of every 8-wide n tile.
template <int D>
__global__ void __launch_bounds__(kThreads) PrefillAttentionKernel(PrefillArgs a) {
  constexpr int KSTEPS = D / 16;      // k steps of QK^T
  constexpr int NT_S = kKeyTile / 8;  // n tiles of S
  constexpr int NT_O = D / 8;         // n tiles of O
  constexpr int CHUNKS = D / 8;       // 16-byte pieces per K/V row
  __shared__ __align__(16) __nv_bfloat16 sk[kKeyTile][D + kPad];
  __shared__ __align__(16) __nv_bfloat16 sv[kKeyTile][D + kPad];

  const int seq = static_cast<int>(blockIdx.z) / a.num_splits;
  const int split = static_cast<int>(blockIdx.z) % a.num_splits;
  const int kvh = blockIdx.y;
  const int q_begin = a.cu_seqlens[seq];
  const int q_len = min(a.cu_seqlens[seq + 1], a.total_tokens) - q_begin;
  const int start = a.start_pos != nullptr ? a.start_pos[seq] : 0;
  const int num_rows = q_len * a.group_size;
  const int row_begin = blockIdx.x * kRowsPerCta;
  if (q_len <= 0 || q_begin < 0 || start < 0 || row_begin >= num_rows) return;
  const int last_tok = min(num_rows - 1, row_begin + kRowsPerCta - 1) / a.group_size;
  const int kv_end = min(start + last_tok + 1, a.max_context);
  // This split's keys: equal ranges of whole key tiles over the sequence's keys (those of its last
  // query), the same for every CTA of the sequence so each row's partials tile its keys.
  const int seq_keys = min(start + q_len, a.max_context);
  const int tiles_per_split =
      ((seq_keys + kKeyTile - 1) / kKeyTile + a.num_splits - 1) / a.num_splits;
  const int kv_begin = split * tiles_per_split * kKeyTile;
  const int kv_stop = min(kv_end, kv_begin + tiles_per_split * kKeyTile);

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int warp_row0 = row_begin + warp * kRowsPerWarp;
  const bool warp_active = warp_row0 < num_rows;
  const int warp_max_pos =
      warp_active ? start + min(num_rows - 1, warp_row0 + kRowsPerWarp - 1) / a.group_size : -1;

  // This thread's two rows (g and g+8): query position and q/out row offset.
  int pos[2];
  int64_t row_off[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = warp_row0 + g + 8 * i;
    const bool valid = r < num_rows;
    const int tok = valid ? r / a.group_size : 0;
    const int head = kvh * a.group_size + (valid ? r % a.group_size : 0);
    pos[i] = valid ? start + tok : -1;  // -1: every key is masked, nothing is written
    row_off[i] = (static_cast<int64_t>(q_begin + tok) * a.num_q_heads + head) * D;
  }

  uint32_t qa[KSTEPS][4];
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = i & 1;  // a0: row g, a1: row g+8, a2: row g, a3: row g+8
      const int col = kk * 16 + 2 * t + (i >> 1) * 8;
      qa[kk][i] = pos[row] >= 0 ? *reinterpret_cast<const uint32_t*>(a.q + row_off[row] + col) : 0u;
    }
  }

  float o[NT_O][4];
#pragma unroll
  for (int n = 0; n < NT_O; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};

  const int32_t* bt = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
  const int bs_mask = (1 << a.block_shift) - 1;
  const int64_t head_stride = static_cast<int64_t>(D) << a.block_shift;
  const int64_t block_stride = head_stride * a.num_kv_heads;

  for (int kt = kv_begin; kt < kv_stop; kt += kKeyTile) {
    __syncthreads();  // the previous tile is no longer read
    for (int c = threadIdx.x; c < kKeyTile * CHUNKS; c += kThreads) {
      const int j = c / CHUNKS;
      const int piece = c % CHUNKS;
      const int key = kt + j;
      uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
      if (key < kv_end) {  // zero fill past the end: masked P times garbage V could be NaN
        const int32_t blk = CheckedBlock(bt, key >> a.block_shift, a.num_blocks, a.error_flag);
        const int64_t off = blk * block_stride + kvh * head_stride +
                            static_cast<int64_t>(key & bs_mask) * D + piece * 8;
        kv = __ldg(reinterpret_cast<const uint4*>(a.k_cache + off));
        vv = __ldg(reinterpret_cast<const uint4*>(a.v_cache + off));
      }
      *reinterpret_cast<uint4*>(&sk[j][piece * 8]) = kv;
      *reinterpret_cast<uint4*>(&sv[j][piece * 8]) = vv;
    }
    __syncthreads();
    if (kt > warp_max_pos) continue;  // causal: every key of this tile is in the warp's future

    float s[NT_S][4];
#pragma unroll
    for (int n = 0; n < NT_S; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(&sk[n * 8 + g][kk * 16 + 2 * t]);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(&sk[n * 8 + g][kk * 16 + 8 + 2 * t]);
        MmaBf16(s[n], qa[kk], b0, b1);
      }
    }

    // Scale, mask, online softmax; c[0..1] belong to row g, c[2..3] to row g+8.
    float alpha[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = m[i];
#pragma unroll
      for (int n = 0; n < NT_S; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = kt + n * 8 + 2 * t + e;
          float& v = s[n][2 * i + e];
          v = key <= pos[i] && key < kv_end ? v * a.scale_log2 : -INFINITY;
          mx = fmaxf(mx, v);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float shift = SafeShift(mx);
      alpha[i] = exp2f(m[i] - shift);
      m[i] = mx;
      float psum = 0.f;
#pragma unroll
      for (int n = 0; n < NT_S; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& v = s[n][2 * i + e];
          v = exp2f(v - shift);
          psum += v;
        }
      }
      l[i] = l[i] * alpha[i] + psum;  // per-thread partial; the quad is summed at the end
    }
#pragma unroll
    for (int n = 0; n < NT_O; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }

    // O += P V: S's accumulator layout for keys [16k, 16k+16) is exactly P's A fragment.
#pragma unroll
    for (int k = 0; k < kKeyTile / 16; ++k) {
      const uint32_t pa[4] = {
          PackBf16(s[2 * k][0], s[2 * k][1]), PackBf16(s[2 * k][2], s[2 * k][3]),
          PackBf16(s[2 * k + 1][0], s[2 * k + 1][1]), PackBf16(s[2 * k + 1][2], s[2 * k + 1][3])};
      const int k0 = k * 16 + 2 * t;
#pragma unroll
      for (int n = 0; n < NT_O; ++n) {
        const int col = n * 8 + g;
        const uint32_t b0 = PackBf16(sv[k0][col], sv[k0 + 1][col]);
        const uint32_t b1 = PackBf16(sv[k0 + 8][col], sv[k0 + 9][col]);
        MmaBf16(o[n], pa, b0, b1);
      }
    }
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (pos[i] < 0) continue;
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    if (a.num_splits > 1) {
      // row_off / D is the (token, head) row; a split that saw none of the row's keys says so
      // with -inf, and the merge skips it.
      const int64_t prow = row_off[i] / D * a.num_splits + split;
      float* po = a.partial_out + prow * D;
#pragma unroll
      for (int n = 0; n < NT_O; ++n) {
        *reinterpret_cast<float2*>(po + n * 8 + 2 * t) =
            make_float2(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
      }
      if (t == 0) a.partial_lse[prow] = l[i] > 0.f ? m[i] + log2f(l[i]) : -INFINITY;
      continue;
    }
#pragma unroll
    for (int n = 0; n < NT_O; ++n) {
      *reinterpret_cast<__nv_bfloat162*>(a.out + row_off[i] + n * 8 + 2 * t) =
          __floats2bfloat162_rn(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
    }
  }
}

// One warp per (token, head) row: the partials weighted by 2^(lse - max lse), in split order.
template <int D>
__global__ void PrefillCombineKernel(const float* __restrict__ partial_out,
                                     const float* __restrict__ partial_lse,
                                     __nv_bfloat16* __restrict__ out, int64_t rows,
                                     int32_t num_splits) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const float* lse = partial_lse + row * num_splits;
  float mx = -INFINITY;
  for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, lse[s]);
  constexpr int kPer = (D + 31) / 32;
  float acc[kPer] = {};
  float wsum = 0.f;
  for (int s = 0; s < num_splits; ++s) {
    if (lse[s] == -INFINITY) continue;  // its partial was never written
    const float w = exp2f(lse[s] - mx);
    wsum += w;
    const float* po = partial_out + (row * num_splits + s) * D;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int e = lane + 32 * j;
      if (e < D) acc[j] += w * po[e];
    }
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int e = lane + 32 * j;
    if (e < D) out[row * D + e] = __float2bfloat16_rn(acc[j] * inv);
  }
}

absl::Status Invalid(const char* field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("PrefillAttentionParams.", field, " ", why));
}

absl::Status Validate(const PrefillAttentionParams& p) {
  using attention_internal::IsAligned;
  if (p.q == nullptr || !IsAligned(p.q, 4)) return Invalid("q", "must be non-null, 4-B aligned");
  if (p.k_cache == nullptr || !IsAligned(p.k_cache, 16))
    return Invalid("k_cache", "must be non-null, 16-B aligned");
  if (p.v_cache == nullptr || !IsAligned(p.v_cache, 16))
    return Invalid("v_cache", "must be non-null, 16-B aligned");
  if (p.block_tables == nullptr) return Invalid("block_tables", "must be non-null");
  if (p.cu_seqlens == nullptr) return Invalid("cu_seqlens", "must be non-null");
  if (p.out == nullptr || !IsAligned(p.out, 4))
    return Invalid("out", "must be non-null, 4-B aligned");
  if (p.num_seqs < 1 || p.num_seqs > 65535)
    return Invalid("num_seqs", absl::StrCat("= ", p.num_seqs, " must be in [1, 65535]"));
  if (p.total_tokens < 1)
    return Invalid("total_tokens", absl::StrCat("= ", p.total_tokens, " must be >= 1"));
  if (p.max_q_len < 1 || p.max_q_len > p.total_tokens)
    return Invalid(
        "max_q_len",
        absl::StrCat("= ", p.max_q_len, " must be in [1, total_tokens = ", p.total_tokens, "]"));
  if (p.num_kv_heads < 1 || p.num_kv_heads > 65535)
    return Invalid("num_kv_heads", absl::StrCat("= ", p.num_kv_heads, " must be in [1, 65535]"));
  if (p.num_q_heads < 1 || p.num_q_heads % p.num_kv_heads != 0)
    return Invalid("num_q_heads",
                   absl::StrCat("= ", p.num_q_heads,
                                " must be a positive multiple of num_kv_heads = ", p.num_kv_heads));
  if (static_cast<int64_t>(p.max_q_len) * (p.num_q_heads / p.num_kv_heads) > INT32_MAX / 2)
    return Invalid("max_q_len", "* group size is too large");
  if (!attention_internal::IsPowerOfTwo(p.block_size))
    return Invalid("block_size", absl::StrCat("= ", p.block_size, " must be a power of two"));
  if (p.num_blocks < 1)
    return Invalid("num_blocks", absl::StrCat("= ", p.num_blocks, " must be >= 1"));
  if (p.max_blocks_per_seq < 1 ||
      static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size > (int64_t{1} << 30))
    return Invalid("max_blocks_per_seq", absl::StrCat("= ", p.max_blocks_per_seq,
                                                      " must be >= 1 and * block_size <= 2^30"));
  if (!std::isfinite(p.scale)) return Invalid("scale", "must be finite");
  if (p.error_flag != nullptr && !IsAligned(p.error_flag, 4))
    return Invalid("error_flag", "must be 4-B aligned");
  if (p.num_splits < 1 || static_cast<int64_t>(p.num_seqs) * p.num_splits > 65535)
    return Invalid("num_splits", absl::StrCat("= ", p.num_splits,
                                              " must be >= 1 with num_seqs * num_splits <= 65535"));
  if (p.num_splits > 1 && (p.partial_out == nullptr || !IsAligned(p.partial_out, 16) ||
                           p.partial_lse == nullptr || !IsAligned(p.partial_lse, 4)))
    return Invalid("partial_out",
                   "and partial_lse must be non-null and aligned with num_splits > 1");
  return absl::OkStatus();
}

constexpr size_t kAlign = 256;
size_t AlignUp(size_t v) {
  return (v + kAlign - 1) / kAlign * kAlign;
}

}  // namespace

int32_t PrefillAttentionSplits(int32_t total_tokens, int32_t max_q_len, int32_t num_seqs,
                               int32_t num_q_heads, int32_t num_kv_heads, int32_t max_kv_len,
                               int32_t num_sms, int32_t max_split_rows) {
  if (total_tokens < 1 || num_kv_heads < 1 || num_sms < 1) return 1;
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t ctas = (static_cast<int64_t>(max_q_len) * group + kRowsPerCta - 1) / kRowsPerCta *
                       num_kv_heads * num_seqs;
  const int64_t want = (2 * static_cast<int64_t>(num_sms) + ctas - 1) / ctas;
  const int64_t by_keys = (static_cast<int64_t>(max_kv_len) + kKeyTile - 1) / kKeyTile / 4;
  const int64_t by_room = max_split_rows / total_tokens;
  const int64_t splits = std::min<int64_t>({want, by_keys, by_room, 16, 65535 / num_seqs});
  return static_cast<int32_t>(std::max<int64_t>(splits, 1));
}

size_t PrefillAttentionLseOffset(int32_t max_split_rows, int32_t num_q_heads, int32_t head_dim) {
  return AlignUp(static_cast<size_t>(max_split_rows) * num_q_heads * head_dim * sizeof(float));
}

size_t PrefillAttentionWorkspaceBytes(int32_t max_split_rows, int32_t num_q_heads,
                                      int32_t head_dim) {
  return PrefillAttentionLseOffset(max_split_rows, num_q_heads, head_dim) +
         AlignUp(static_cast<size_t>(max_split_rows) * num_q_heads * sizeof(float));
}

absl::Status LaunchPrefillAttention(const PrefillAttentionParams& p, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(Validate(p));
  PrefillArgs a;
  a.q = p.q;
  a.k_cache = p.k_cache;
  a.v_cache = p.v_cache;
  a.block_tables = p.block_tables;
  a.cu_seqlens = p.cu_seqlens;
  a.start_pos = p.start_pos;
  a.out = p.out;
  a.error_flag = p.error_flag;
  a.num_blocks = p.num_blocks;
  a.total_tokens = p.total_tokens;
  a.num_q_heads = p.num_q_heads;
  a.num_kv_heads = p.num_kv_heads;
  a.group_size = p.num_q_heads / p.num_kv_heads;
  a.block_shift = attention_internal::Log2Exact(p.block_size);
  a.max_blocks_per_seq = p.max_blocks_per_seq;
  a.max_context = p.max_blocks_per_seq * p.block_size;
  a.scale_log2 = p.scale * kLog2e;
  a.num_splits = p.num_splits;
  a.partial_out = p.partial_out;
  a.partial_lse = p.partial_lse;
  const int64_t rows = static_cast<int64_t>(p.max_q_len) * a.group_size;
  const dim3 grid(static_cast<unsigned>((rows + kRowsPerCta - 1) / kRowsPerCta), p.num_kv_heads,
                  p.num_seqs * p.num_splits);
  return attention_internal::DispatchHeadDim(
      p.head_dim, "PrefillAttentionParams.head_dim", [&](auto d) -> absl::Status {
        constexpr int D = decltype(d)::value;
        PrefillAttentionKernel<D><<<grid, kThreads, 0, stream>>>(a);
        TS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
        if (p.num_splits == 1) return absl::OkStatus();
        const int64_t out_rows = static_cast<int64_t>(p.total_tokens) * p.num_q_heads;
        constexpr int kRowsPerBlock = 8;  // warps
        PrefillCombineKernel<D>
            <<<static_cast<unsigned>((out_rows + kRowsPerBlock - 1) / kRowsPerBlock),
               kRowsPerBlock * 32, 0, stream>>>(p.partial_out, p.partial_lse, p.out, out_rows,
                                                p.num_splits);
        TS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
        return absl::OkStatus();
      });
}

}  // namespace ts::kernels
