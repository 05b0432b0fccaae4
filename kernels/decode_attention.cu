#include "kernels/decode_attention.cuh"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/attention_combine.cuh"
#include "kernels/attention_common.cuh"
#include "kernels/cuda_check.h"
#include "kernels/pdl.cuh"

namespace ts::kernels {
namespace {

using attention_internal::CheckedBlock;
using attention_internal::ClampedContext;
using attention_internal::kLog2e;
using attention_internal::MmaBf16;
using attention_internal::NumActiveSplits;
using attention_internal::PackBf16;
using attention_internal::SafeShift;
using attention_internal::SplitGeometry;
using attention_internal::SplitTokens;
using attention_internal::TransposeBf16x8x8;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr size_t kCounterBytes = kDecodeAttentionCounterBytes;
// The work queue keeps a prefix sum over sequences in shared memory.
constexpr int kMaxWorkQueueSeqs = 4096;

struct DecodeArgs {
  const __nv_bfloat16* q;        // [num_seqs, num_q_heads, D]
  const __nv_bfloat16* k_cache;  // [num_blocks, num_kv_heads, block_size, D]
  const __nv_bfloat16* v_cache;  // [num_blocks, num_kv_heads, block_size, D]
  const int32_t* block_tables;   // [num_seqs, max_blocks_per_seq]
  const int32_t* context_lens;   // [num_seqs]
  __nv_bfloat16* out;            // [num_seqs, num_q_heads, D]; written here at one split
  float* partial_out;            // [num_seqs, num_q_heads, max_splits, D]
  float* partial_lse;            // [num_seqs, num_q_heads, max_splits]
  uint32_t* counters;            // [2]: next tile, CTAs finished
  int32_t* error_flag;           // [1] or nullptr: a table entry within a context is invalid
  int32_t num_blocks;
  int32_t num_seqs;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t group_size;   // query heads per kv head
  int32_t head_chunks;  // ceil(group_size / kHeads): tiles per kv head
  int32_t max_blocks_per_seq;
  int32_t block_shift;  // log2(block_size)
  int32_t max_splits;
  int32_t tiles_per_claim;
  int32_t work_queue;  // 0: static split (tile from blockIdx), 1: persistent work queue
  float scale_log2;    // scale * log2(e): scores live in the log2 domain
  SplitGeometry geo;
};

// Query heads per tile: the n dimension of the mma. Larger GQA groups take several tiles.
constexpr int kHeads = 8;
// Keys per warp step: the m dimension of S^T = K Q^T and the k dimension of O^T += V^T P^T.
constexpr int kChunk = 16;

template <int D>
struct MergeSmem {
  float m[kWarps][kHeads];
  float l[kWarps][kHeads];
  float acc[kWarps][kHeads][D];
};

// Loads kWords 32-bit words of one row for this lane from element `off` of `row`: one or two
// words in a single load, otherwise 16-byte pieces kStride elements apart. Zeros when !valid
// (nothing is read).
template <int kWords, int kStride>
__device__ __forceinline__ void LoadWords(const __nv_bfloat16* row, int off, bool valid,
                                          uint32_t (&w)[kWords]) {
  if constexpr (kWords == 1) {
    w[0] = valid ? __ldg(reinterpret_cast<const uint32_t*>(row + off)) : 0u;
  } else if constexpr (kWords == 2) {
    const uint2 v = valid ? __ldg(reinterpret_cast<const uint2*>(row + off)) : make_uint2(0, 0);
    w[0] = v.x;
    w[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < kWords / 4; ++i) {
      const uint4 v = valid ? __ldg(reinterpret_cast<const uint4*>(row + kStride * i + off))
                            : make_uint4(0, 0, 0, 0);
      w[4 * i] = v.x;
      w[4 * i + 1] = v.y;
      w[4 * i + 2] = v.z;
      w[4 * i + 3] = v.w;
    }
  }
}

// Dot products are invariant under any permutation of the head dimension applied to both q and k,
// so each lane reads contiguous K (and q) pieces instead of the mma's column pairs. Lane t of a
// quad holds D/4 of a row's dims as D/8 words; word 2s feeds mma k-step s at columns 2t, 2t+1 and
// word 2s+1 at columns 2t+8, 2t+9. For D >= 64 the quad's four lanes read 64 contiguous bytes per
// load: 16-byte piece i of lane t covers dims [32i + 8t, 32i + 8t + 8).
template <int D>
__device__ __forceinline__ void LoadKRow(const __nv_bfloat16* row, int t, bool valid,
                                         uint32_t (&w)[D / 8]) {
  LoadWords<D / 8, 32>(row, (D == 16 ? 4 : 8) * t, valid, w);
}

// O^T's rows are output dims, also permuted: lane group g owns D/8 contiguous dims of every V row
// and of the output, as D/16 words; word j holds the dims of O^T m-tile j at rows g (low half) and
// g + 8 (high half). For D >= 64, 16-byte piece i of group g covers dims [64i + 8g, 64i + 8g + 8).
template <int D>
__host__ __device__ __forceinline__ int VDim(int g, int j) {
  if constexpr (D == 16) {
    return 2 * g;
  } else {
    return 64 * (j / 4) + 8 * g + 2 * (j % 4);
  }
}

template <int D>
__device__ __forceinline__ void LoadVRow(const __nv_bfloat16* row, int g, bool valid,
                                         uint32_t (&w)[D / 16]) {
  LoadWords<D / 16, 64>(row, (D == 16 ? 2 : 8) * g, valid, w);
}

// One tile: query heads [hc*kHeads, hc*kHeads + nh) of kv head `kvh`'s group, tokens of split
// `split`, on the tensor cores. Per 16-key chunk a warp computes S^T = K Q^T (16 keys x 8 heads),
// an fp32 online softmax per head (column), and O^T += V^T P^T with P rounded to bf16 (as flash
// attention and the prefill kernel do; the row sums stay fp32). The CTA's four warps take
// alternate chunks, and their states are merged once at the end.
template <int D>
__device__ void ProcessTile(const DecodeArgs& a, int seq, int kvh, int hc, int split,
                            MergeSmem<D>& sm) {
  constexpr int KSTEPS = D / 16;  // k steps of S^T; m tiles of O^T
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;

  const int ctx = ClampedContext(a.geo, a.context_lens[seq]);
  const int per = SplitTokens(a.geo, ctx);
  const int t_begin = split * per;
  const int t_end = min(ctx, t_begin + per);
  const int h_first = hc * kHeads;
  const int nh = min(kHeads, a.group_size - h_first);
  const int64_t row0 = static_cast<int64_t>(seq) * a.num_q_heads + kvh * a.group_size + h_first;
  if (t_begin >= t_end) {         // CTA-uniform: nothing to attend to in this split
    if (a.geo.num_splits == 1) {  // the only split of an empty sequence: its output is zero
      for (int i = threadIdx.x; i < nh * D; i += kThreads) a.out[row0 * D + i] = 0.f;
      return;
    }
    if (threadIdx.x < nh) a.partial_lse[(row0 + threadIdx.x) * a.max_splits + split] = -INFINITY;
    return;
  }

  // Q^T as B fragments: head g's dims in the K permutation; heads past nh are zero.
  uint32_t qb[D / 8];
  LoadKRow<D>(a.q + (row0 + min(g, nh - 1)) * D, t, g < nh, qb);

  const int32_t* bt = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
  const int bs_mask = (1 << a.block_shift) - 1;
  const int64_t head_stride = static_cast<int64_t>(D) << a.block_shift;
  const int64_t block_stride = head_stride * a.num_kv_heads;
  const __nv_bfloat16* kbase = a.k_cache + kvh * head_stride;
  const __nv_bfloat16* vbase = a.v_cache + kvh * head_stride;
  // Rows this lane loads: K rows g and g+8 (its S^T rows), V rows 2t, 2t+1, 2t+8, 2t+9 (its
  // columns of the P^T fragment).
  const int krow[2] = {g, g + 8};
  const int vrow[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};

  float m[2] = {-INFINITY, -INFINITY};  // heads 2t, 2t+1
  float l[2] = {0.f, 0.f};              // this lane's keys only; summed over g at the end
  float acc[KSTEPS][4];
#pragma unroll
  for (int j = 0; j < KSTEPS; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  // Block ids are looked up a chunk ahead so the K/V loads never wait on the block table; rows
  // past t_end read nothing, not even their table entry (padding, kInvalidKvBlock).
  auto block_of = [&](int tok) -> int32_t {
    return tok < t_end ? CheckedBlock(bt, tok >> a.block_shift, a.num_blocks, a.error_flag) : 0;
  };
  auto row_at = [&](int32_t blk, int tok) -> int64_t {
    return static_cast<int64_t>(blk) * block_stride + static_cast<int64_t>(tok & bs_mask) * D;
  };
  constexpr int kStride = kWarps * kChunk;
  int base = t_begin + warp * kChunk;
  int32_t kblk[2], vblk[4];
#pragma unroll
  for (int r = 0; r < 2; ++r) kblk[r] = block_of(base + krow[r]);
#pragma unroll
  for (int r = 0; r < 4; ++r) vblk[r] = block_of(base + vrow[r]);

  // Each warp keeps one chunk's loads in flight; occupancy (four CTAs per SM) hides the latency.
  // Loading the next chunk during this one's compute needs ~40 more registers and three CTAs per
  // SM, which measured slower at 64 sequences of 256 tokens (34.5 against 29.0 us).
  for (; base < t_end; base += kStride) {
    uint32_t kw[2][D / 8];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int tok = base + krow[r];
      LoadKRow<D>(kbase + row_at(kblk[r], tok), t, tok < t_end, kw[r]);
    }
    uint32_t vw[4][D / 16];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int tok = base + vrow[r];
      LoadVRow<D>(vbase + row_at(vblk[r], tok), g, tok < t_end, vw[r]);
    }
    const int next = base + kStride;
#pragma unroll
    for (int r = 0; r < 2; ++r) kblk[r] = block_of(next + krow[r]);
#pragma unroll
    for (int r = 0; r < 4; ++r) vblk[r] = block_of(next + vrow[r]);

    // c[0..1]: key g, heads 2t, 2t+1; c[2..3]: key g + 8.
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
      const uint32_t ka[4] = {kw[0][2 * s], kw[1][2 * s], kw[0][2 * s + 1], kw[1][2 * s + 1]};
      MmaBf16(c, ka, qb[2 * s], qb[2 * s + 1]);
    }
    const bool valid_lo = base + g < t_end;
    const bool valid_hi = base + g + 8 < t_end;
    c[0] = valid_lo ? c[0] * a.scale_log2 : -INFINITY;
    c[1] = valid_lo ? c[1] * a.scale_log2 : -INFINITY;
    c[2] = valid_hi ? c[2] * a.scale_log2 : -INFINITY;
    c[3] = valid_hi ? c[3] * a.scale_log2 : -INFINITY;

    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = fmaxf(c[h], c[h + 2]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      mx = fmaxf(mx, m[h]);
      const float shift = SafeShift(mx);
      alpha[h] = exp2f(m[h] - shift);
      m[h] = mx;
      c[h] = exp2f(c[h] - shift);
      c[h + 2] = exp2f(c[h + 2] - shift);
      l[h] = l[h] * alpha[h] + c[h] + c[h + 2];
    }
    // P^T as the B fragment: the transposes of keys 0-7 and of keys 8-15.
    const uint32_t pb0 = TransposeBf16x8x8(PackBf16(c[0], c[1]));
    const uint32_t pb1 = TransposeBf16x8x8(PackBf16(c[2], c[3]));
#pragma unroll
    for (int j = 0; j < KSTEPS; ++j) {
      acc[j][0] *= alpha[0];
      acc[j][1] *= alpha[1];
      acc[j][2] *= alpha[0];
      acc[j][3] *= alpha[1];
      // V^T as the A fragment: row (dim) g from the low halves, row g + 8 from the high halves.
      const uint32_t va[4] = {
          __byte_perm(vw[0][j], vw[1][j], 0x5410), __byte_perm(vw[0][j], vw[1][j], 0x7632),
          __byte_perm(vw[2][j], vw[3][j], 0x5410), __byte_perm(vw[2][j], vw[3][j], 0x7632)};
      MmaBf16(acc[j], va, pb0, pb1);
    }
  }

  // Sum l over the lanes that hold the other keys (g); m is already uniform over g.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 4);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 8);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 16);
  }
#pragma unroll
  for (int j = 0; j < KSTEPS; ++j) {
    const int d = VDim<D>(g, j);
    sm.acc[warp][2 * t][d] = acc[j][0];
    sm.acc[warp][2 * t + 1][d] = acc[j][1];
    sm.acc[warp][2 * t][d + 1] = acc[j][2];
    sm.acc[warp][2 * t + 1][d + 1] = acc[j][3];
  }
  if (g == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sm.m[warp][2 * t + h] = m[h];
      sm.l[warp][2 * t + h] = l[h];
    }
  }
  __syncthreads();
  // Merge the warps and write this split's normalised output and log2-sum-exp. With one split per
  // sequence this is the final output (the value the combine would compute, with a weight of
  // exactly 1), written here; the combine kernel then skips the row, or is not launched at all
  // (no_combine).
  for (int idx = threadIdx.x; idx < nh * D; idx += kThreads) {
    const int h = idx / D;
    const int d = idx % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sm.m[w][h]);
    const float shift = SafeShift(mx);
    float lsum = 0.f, osum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wgt = exp2f(sm.m[w][h] - shift);
      lsum += sm.l[w][h] * wgt;
      osum += sm.acc[w][h][d] * wgt;
    }
    const float o = lsum > 0.f ? osum / lsum : 0.f;
    if (a.geo.num_splits == 1) {
      a.out[(row0 + h) * D + d] = __float2bfloat16_rn(o);
      continue;
    }
    const int64_t slot = (row0 + h) * a.max_splits + split;
    a.partial_out[slot * D + d] = o;
    if (d == 0) a.partial_lse[slot] = lsum > 0.f ? mx + log2f(lsum) : -INFINITY;
  }
  __syncthreads();  // the shared merge buffers are reused by the CTA's next tile
}

// Number of work-queue tiles (chunks) of sequence s.
__device__ __forceinline__ int SeqChunks(const DecodeArgs& a, int s) {
  const int ctx = ClampedContext(a.geo, a.context_lens[s]);
  return ctx > 0 ? NumActiveSplits(a.geo, ctx) : 0;
}

// s_prefix[s] = chunks of sequences before s, s_prefix[num_seqs] = total. Each thread scans a
// contiguous run of sequences, then the run totals are scanned across the block.
__device__ void ChunkPrefixSum(const DecodeArgs& a, int32_t* s_prefix) {
  __shared__ int32_t warp_total[kWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int per_thread = (a.num_seqs + kThreads - 1) / kThreads;
  const int lo = threadIdx.x * per_thread;
  const int hi = min(a.num_seqs, lo + per_thread);
  int local = 0;
  for (int s = lo; s < hi; ++s) local += SeqChunks(a, s);
  int incl = local;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += y;
  }
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  int warp_prefix = 0;
  for (int w = 0; w < warp; ++w) warp_prefix += warp_total[w];
  int running = warp_prefix + incl - local;
  for (int s = lo; s < hi; ++s) {
    s_prefix[s] = running;
    running += SeqChunks(a, s);
  }
  if (threadIdx.x == kThreads - 1) s_prefix[a.num_seqs] = warp_prefix + incl;
  __syncthreads();
}

// Largest s in [0, num_seqs) with s_prefix[s] <= chunk (skips sequences with no chunks).
__device__ __forceinline__ int FindSeq(const int32_t* s_prefix, int num_seqs, int chunk) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (s_prefix[mid] <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// One kernel serves both modes so each head_dim is a single template instance with a single
// inlined copy of the tile loop.
template <int D>
__global__ void __launch_bounds__(kThreads, 4) DecodeAttentionKernel(DecodeArgs a) {
  __shared__ MergeSmem<D> sm;
  __shared__ int32_t s_claim;
  extern __shared__ int32_t s_prefix[];  // work queue: [num_seqs + 1]
  // q, the cache and the context lengths come from earlier kernels (kernels/pdl.cuh).
  GridDepWait();
  GridDepLaunchDependents();
  const int tiles_per_chunk = a.num_kv_heads * a.head_chunks;
  int total = 0;
  if (a.work_queue) {
    ChunkPrefixSum(a, s_prefix);
    total = s_prefix[a.num_seqs] * tiles_per_chunk;
  }
  for (int round = 0;; ++round) {
    int first = 0, last = 1;
    if (a.work_queue) {
      if (threadIdx.x == 0)
        s_claim = static_cast<int>(atomicAdd(&a.counters[0], a.tiles_per_claim));
      __syncthreads();
      first = s_claim;
      __syncthreads();  // everyone has read s_claim before thread 0 may overwrite it
      if (first >= total) break;
      last = min(total, first + a.tiles_per_claim);
    } else if (round > 0) {
      break;
    }
    for (int t = first; t < last; ++t) {
      int seq, kv_slot, split;
      if (a.work_queue) {
        const int chunk = t / tiles_per_chunk;
        kv_slot = t - chunk * tiles_per_chunk;
        seq = FindSeq(s_prefix, a.num_seqs, chunk);
        split = chunk - s_prefix[seq];
      } else {
        seq = blockIdx.z;
        kv_slot = blockIdx.y;
        split = blockIdx.x;
      }
      ProcessTile<D>(a, seq, kv_slot / a.head_chunks, kv_slot % a.head_chunks, split, sm);
    }
  }
  // Every CTA has made its final claim before it counts itself done, so the last one to finish may
  // reset both counters for the next launch (or graph replay) without racing anyone.
  if (a.work_queue && threadIdx.x == 0) {
    const uint32_t done = atomicAdd(&a.counters[1], 1u);
    if (done == gridDim.x - 1) {
      atomicExch(&a.counters[0], 0u);
      atomicExch(&a.counters[1], 0u);
    }
  }
}

absl::Status Invalid(const char* field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("DecodeAttentionParams.", field, " ", why));
}

absl::Status ValidateShape(const DecodeAttentionParams& p) {
  using attention_internal::IsAligned;
  if (p.q == nullptr || !IsAligned(p.q, 16)) return Invalid("q", "must be non-null, 16-B aligned");
  if (p.k_cache == nullptr || !IsAligned(p.k_cache, 16))
    return Invalid("k_cache", "must be non-null, 16-B aligned");
  if (p.v_cache == nullptr || !IsAligned(p.v_cache, 16))
    return Invalid("v_cache", "must be non-null, 16-B aligned");
  if (p.block_tables == nullptr) return Invalid("block_tables", "must be non-null");
  if (p.context_lens == nullptr) return Invalid("context_lens", "must be non-null");
  if (p.out == nullptr || !IsAligned(p.out, 4)) return Invalid("out", "must be non-null, aligned");
  if (p.num_seqs < 1 || p.num_seqs > 65535)
    return Invalid("num_seqs", absl::StrCat("= ", p.num_seqs, " must be in [1, 65535]"));
  if (p.num_kv_heads < 1)
    return Invalid("num_kv_heads", absl::StrCat("= ", p.num_kv_heads, " must be >= 1"));
  if (p.num_q_heads < 1 || p.num_q_heads % p.num_kv_heads != 0)
    return Invalid("num_q_heads",
                   absl::StrCat("= ", p.num_q_heads,
                                " must be a positive multiple of num_kv_heads = ", p.num_kv_heads));
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
  if (p.max_splits < 1 || p.max_splits > 4096)
    return Invalid("max_splits", absl::StrCat("= ", p.max_splits, " must be in [1, 4096]"));
  return absl::OkStatus();
}

absl::Status ValidateMode(const DecodeAttentionParams& p) {
  if (p.mode == DecodeAttentionMode::kStaticSplit) {
    if (p.num_splits < 1 || p.num_splits > p.max_splits || p.num_splits > 65535)
      return Invalid(
          "num_splits",
          absl::StrCat("= ", p.num_splits, " must be in [1, max_splits = ", p.max_splits, "]"));
    if (p.no_combine && p.num_splits != 1)
      return Invalid("no_combine", absl::StrCat("needs num_splits = 1, not ", p.num_splits));
    return absl::OkStatus();
  }
  if (p.mode != DecodeAttentionMode::kWorkQueue) return Invalid("mode", "is not a known mode");
  if (p.no_combine) return Invalid("no_combine", "needs mode kStaticSplit");
  if (p.num_seqs > kMaxWorkQueueSeqs)
    return Invalid("num_seqs", absl::StrCat("= ", p.num_seqs, " exceeds the work queue's limit of ",
                                            kMaxWorkQueueSeqs));
  if (p.chunk_tokens < 1)
    return Invalid("chunk_tokens", absl::StrCat("= ", p.chunk_tokens, " must be >= 1"));
  if (p.persistent_ctas < 1 || p.persistent_ctas > 65535)
    return Invalid("persistent_ctas",
                   absl::StrCat("= ", p.persistent_ctas, " must be in [1, 65535]"));
  if (p.tiles_per_claim < 1 || p.tiles_per_claim > 64)
    return Invalid("tiles_per_claim", absl::StrCat("= ", p.tiles_per_claim, " must be in [1, 64]"));
  const int64_t tiles =
      static_cast<int64_t>(p.num_seqs) * p.max_splits * p.num_q_heads + p.persistent_ctas * 64;
  if (tiles >= (int64_t{1} << 31))
    return Invalid("max_splits", "* num_seqs * num_q_heads overflows the tile counter");
  return absl::OkStatus();
}

template <int D>
absl::Status LaunchSplitKernel(const DecodeAttentionParams& p, const DecodeArgs& a,
                               cudaStream_t stream) {
  const bool queue = p.mode == DecodeAttentionMode::kWorkQueue;
  const dim3 grid = queue ? dim3(p.persistent_ctas)
                          : dim3(p.num_splits, p.num_kv_heads * a.head_chunks, p.num_seqs);
  const size_t smem = queue ? (p.num_seqs + 1) * sizeof(int32_t) : 0;
  TS_CUDA_RETURN_IF_ERROR(
      LaunchWithPdl(DecodeAttentionKernel<D>, grid, dim3(kThreads), smem, stream, p.pdl, a));
  TS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace

size_t DecodeAttentionWorkspaceBytes(int32_t num_seqs, int32_t num_q_heads, int32_t head_dim,
                                     int32_t max_splits) {
  const size_t slots = static_cast<size_t>(std::max(num_seqs, 0)) * std::max(num_q_heads, 0) *
                       std::max(max_splits, 0);
  const size_t lse_bytes = (slots * sizeof(float) + 255) / 256 * 256;
  return kCounterBytes + lse_bytes + slots * std::max(head_dim, 0) * sizeof(float);
}

absl::Status ResetDecodeAttentionWorkspace(void* workspace, size_t workspace_bytes,
                                           cudaStream_t stream) {
  if (workspace == nullptr || workspace_bytes < kCounterBytes)
    return absl::InvalidArgumentError("ResetDecodeAttentionWorkspace: workspace is too small");
  TS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(workspace, 0, kCounterBytes, stream));
  return absl::OkStatus();
}

absl::StatusOr<int32_t> DecodeAttentionCtasPerSm(int32_t head_dim, int32_t num_q_heads,
                                                 int32_t num_kv_heads) {
  if (num_kv_heads < 1 || num_q_heads < 1 || num_q_heads % num_kv_heads != 0)
    return absl::InvalidArgumentError(
        "DecodeAttentionCtasPerSm: num_q_heads must be a positive "
        "multiple of num_kv_heads");
  int blocks = 0;
  TS_RETURN_IF_ERROR(attention_internal::DispatchHeadDim(
      head_dim, "DecodeAttentionCtasPerSm head_dim", [&](auto d) -> absl::Status {
        TS_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &blocks, DecodeAttentionKernel<decltype(d)::value>, kThreads, 0));
        return absl::OkStatus();
      }));
  return std::max(blocks, 1);
}

namespace {
int32_t CtasPerSm(const SplitChoiceInputs& in) {
  return in.ctas_per_sm > 0 ? in.ctas_per_sm : 3;
}
}  // namespace

constexpr int64_t kMaxSplitTokens = 1024;

int32_t ChooseNumSplits(const SplitChoiceInputs& in) {
  const int group = in.num_kv_heads > 0 ? std::max(1, in.num_q_heads / in.num_kv_heads) : 1;
  const int64_t tiles_per_split = static_cast<int64_t>(std::max(in.num_seqs, 1)) *
                                  std::max(in.num_kv_heads, 1) * ((group + 7) / 8);
  // At most one wave of resident CTAs. A second wave only adds each split's fixed cost (the
  // warps' merge, the partial writes, the combine): measured on the H200 with 64 sequences of 256
  // tokens (8B shape), 1 split took 29.0 us, 2 splits 34.5 and 4 splits 43.2.
  const int64_t one_wave = static_cast<int64_t>(std::max(in.num_sms, 1)) * CtasPerSm(in);
  const int64_t ctx = std::max(in.max_context_len, 1);
  const int64_t sms = std::max(in.num_sms, 1);
  // But no split longer than kMaxSplitTokens: the choice only knows the longest context, and in a
  // ragged batch the longest sequences' tiles would finish long after everyone else's (32
  // sequences of 100-4000 tokens, 8B shape: 1 split 140.9 us, 5 splits 88.5).
  int64_t splits = std::max<int64_t>(1, one_wave / tiles_per_split);
  splits = std::max<int64_t>(splits, (ctx + kMaxSplitTokens - 1) / kMaxSplitTokens);
  splits = std::min<int64_t>(splits, (ctx + 127) / 128);
  if (splits * tiles_per_split < sms) {
    // Latency-bound: measured at batch 1 (H200, 128-384 tokens) 64-token splits beat 128 by 20-30
    // us per step; at batch 8, where 128-token splits fill the SMs, shorter ones lost.
    const int64_t floor_tokens = in.min_split_tokens > 0 ? in.min_split_tokens : 64;
    splits = std::max(splits, std::min((sms + tiles_per_split - 1) / tiles_per_split,
                                       (ctx + floor_tokens - 1) / floor_tokens));
  }
  return static_cast<int32_t>(std::clamp<int64_t>(splits, 1, std::max(in.max_splits, 1)));
}

WorkQueueConfig ChooseWorkQueueConfig(const SplitChoiceInputs& in, int32_t block_size) {
  WorkQueueConfig c;
  c.persistent_ctas = std::max(in.num_sms, 1) * CtasPerSm(in);
  const int group = in.num_kv_heads > 0 ? std::max(1, in.num_q_heads / in.num_kv_heads) : 1;
  // Aim for ~8 tiles per CTA assuming half the batch's maximum as the mean context.
  const int64_t tokens = static_cast<int64_t>(std::max(in.num_seqs, 1)) *
                         std::max(in.num_kv_heads, 1) * ((group + 7) / 8) *
                         std::max(in.max_context_len / 2, 1);
  int64_t chunk = tokens / (static_cast<int64_t>(c.persistent_ctas) * 8);
  chunk = std::clamp<int64_t>(chunk, 64, 512);
  const int64_t bs = std::max(block_size, 1);
  c.chunk_tokens = static_cast<int32_t>((chunk + bs - 1) / bs * bs);
  c.tiles_per_claim = 1;
  return c;
}

absl::Status LaunchDecodeAttention(const DecodeAttentionParams& p, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(ValidateShape(p));
  TS_RETURN_IF_ERROR(ValidateMode(p));
  const size_t need =
      DecodeAttentionWorkspaceBytes(p.num_seqs, p.num_q_heads, p.head_dim, p.max_splits);
  if (p.workspace == nullptr || !attention_internal::IsAligned(p.workspace, 256))
    return Invalid("workspace", "must be non-null and 256-B aligned");
  if (p.workspace_bytes < need)
    return Invalid("workspace_bytes", absl::StrCat("= ", p.workspace_bytes, " is below the ", need,
                                                   " bytes this shape needs"));

  const bool queue = p.mode == DecodeAttentionMode::kWorkQueue;
  DecodeArgs a;
  a.q = p.q;
  a.k_cache = p.k_cache;
  a.v_cache = p.v_cache;
  a.block_tables = p.block_tables;
  a.context_lens = p.context_lens;
  a.error_flag = p.error_flag;
  a.num_blocks = p.num_blocks;
  const size_t slots = static_cast<size_t>(p.num_seqs) * p.num_q_heads * p.max_splits;
  char* ws = static_cast<char*>(p.workspace);
  a.counters = reinterpret_cast<uint32_t*>(ws);
  a.partial_lse = reinterpret_cast<float*>(ws + kCounterBytes);
  a.partial_out =
      reinterpret_cast<float*>(ws + kCounterBytes + (slots * sizeof(float) + 255) / 256 * 256);
  a.num_seqs = p.num_seqs;
  a.num_q_heads = p.num_q_heads;
  a.num_kv_heads = p.num_kv_heads;
  a.group_size = p.num_q_heads / p.num_kv_heads;
  a.head_chunks = (a.group_size + kHeads - 1) / kHeads;
  a.max_blocks_per_seq = p.max_blocks_per_seq;
  a.block_shift = attention_internal::Log2Exact(p.block_size);
  a.max_splits = p.max_splits;
  a.tiles_per_claim = p.tiles_per_claim;
  a.work_queue = queue ? 1 : 0;
  a.out = p.out;
  a.scale_log2 = p.scale * kLog2e;
  const int32_t chunk =
      queue ? (p.chunk_tokens + p.block_size - 1) / p.block_size * p.block_size : 1;
  a.geo = SplitGeometry{queue ? p.max_splits : p.num_splits, chunk, p.block_size,
                        p.max_blocks_per_seq * p.block_size};

  TS_RETURN_IF_ERROR(attention_internal::DispatchHeadDim(
      p.head_dim, "DecodeAttentionParams.head_dim",
      [&](auto d) { return LaunchSplitKernel<decltype(d)::value>(p, a, stream); }));
  if (p.no_combine) return absl::OkStatus();

  AttentionCombineParams c;
  c.partial_out = a.partial_out;
  c.partial_lse = a.partial_lse;
  c.context_lens = p.context_lens;
  c.out = p.out;
  c.num_seqs = p.num_seqs;
  c.num_heads = p.num_q_heads;
  c.head_dim = p.head_dim;
  c.max_splits = p.max_splits;
  c.num_splits = a.geo.num_splits;
  c.min_split_tokens = a.geo.min_split_tokens;
  c.block_size = p.block_size;
  c.max_blocks_per_seq = p.max_blocks_per_seq;
  c.pdl = p.pdl;
  return LaunchAttentionCombine(c, stream);
}

}  // namespace ts::kernels
