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

using attention_internal::ClampedContext;
using attention_internal::kLog2e;
using attention_internal::NumActiveSplits;
using attention_internal::SplitGeometry;
using attention_internal::SplitTokens;

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
  float* partial_out;            // [num_seqs, num_q_heads, max_splits, D]
  float* partial_lse;            // [num_seqs, num_q_heads, max_splits]
  uint32_t* counters;            // [2]: next tile, CTAs finished
  int32_t num_seqs;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t group_size;   // query heads per kv head
  int32_t head_chunks;  // ceil(group_size / GMAX): tiles per kv head
  int32_t max_blocks_per_seq;
  int32_t block_shift;  // log2(block_size)
  int32_t max_splits;
  int32_t tiles_per_claim;
  int32_t work_queue;  // 0: static split (tile from blockIdx), 1: persistent work queue
  float scale_log2;    // scale * log2(e): scores live in the log2 domain
  SplitGeometry geo;
};

template <int D, int GMAX>
struct MergeSmem {
  float m[kWarps][GMAX];
  float l[kWarps][GMAX];
  float acc[kWarps][GMAX][D];
};

__device__ __forceinline__ void Bf16x8ToFloat(const uint4& raw, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

// Safe max for the exponent shift: an all -inf row shifts by 0 so 2^(-inf - 0) = 0, never NaN.
__device__ __forceinline__ float SafeShift(float m) {
  return m == -INFINITY ? 0.f : m;
}

// One tile: query heads [hc*GMAX, hc*GMAX + nh) of kv head `kvh`'s group, tokens of split `split`.
// Thread layout: TPK = D/8 consecutive lanes share one key (16 bytes each); a warp holds 32/TPK
// keys, the CTA NG keys, and each thread keeps U keys' K and V loads in flight per step. Every
// key group keeps its own online-softmax state; the states are merged once at the end.
template <int D, int GMAX>
__device__ void ProcessTile(const DecodeArgs& a, int seq, int kvh, int hc, int split,
                            MergeSmem<D, GMAX>& sm) {
  constexpr int TPK = D / 8;
  constexpr int KPW = 32 / TPK;
  constexpr int NG = kWarps * KPW;
  constexpr int U = GMAX >= 8 ? 2 : 4;
  constexpr int STEP = NG * U;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane % TPK;
  const int gid = warp * KPW + lane / TPK;

  const int ctx = ClampedContext(a.geo, a.context_lens[seq]);
  const int per = SplitTokens(a.geo, ctx);
  const int t_begin = split * per;
  const int t_end = min(ctx, t_begin + per);
  const int h_first = hc * GMAX;
  const int nh = min(GMAX, a.group_size - h_first);
  const int64_t row0 = static_cast<int64_t>(seq) * a.num_q_heads + kvh * a.group_size + h_first;
  if (t_begin >= t_end) {  // CTA-uniform: nothing to attend to in this split
    if (threadIdx.x < nh) a.partial_lse[(row0 + threadIdx.x) * a.max_splits + split] = -INFINITY;
    return;
  }

  float qf[GMAX][8];
#pragma unroll
  for (int h = 0; h < GMAX; ++h) {
    if (h < nh) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(a.q + (row0 + h) * D + sub * 8));
      Bf16x8ToFloat(raw, qf[h]);
#pragma unroll
      for (int i = 0; i < 8; ++i) qf[h][i] *= a.scale_log2;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) qf[h][i] = 0.f;
    }
  }

  const int32_t* bt = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
  const int bs_mask = (1 << a.block_shift) - 1;
  const int64_t head_stride = static_cast<int64_t>(D) << a.block_shift;
  const int64_t block_stride = head_stride * a.num_kv_heads;
  const __nv_bfloat16* kbase = a.k_cache + kvh * head_stride + sub * 8;
  const __nv_bfloat16* vbase = a.v_cache + kvh * head_stride + sub * 8;

  float m[GMAX], l[GMAX], acc[GMAX][8];
#pragma unroll
  for (int h = 0; h < GMAX; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[h][i] = 0.f;
  }

  // Block ids for the next step are fetched one step ahead so the K/V loads never wait on them.
  int blk_next[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int tok = t_begin + u * NG + gid;
    blk_next[u] = tok < t_end ? __ldg(bt + (tok >> a.block_shift)) : 0;
  }

  for (int base = t_begin; base < t_end; base += STEP) {
    uint4 kr[U], vr[U];
    bool valid[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tok = base + u * NG + gid;
      valid[u] = tok < t_end;
      const int64_t off = blk_next[u] * block_stride + static_cast<int64_t>(tok & bs_mask) * D;
      kr[u] =
          valid[u] ? __ldg(reinterpret_cast<const uint4*>(kbase + off)) : make_uint4(0, 0, 0, 0);
      vr[u] =
          valid[u] ? __ldg(reinterpret_cast<const uint4*>(vbase + off)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tok = base + STEP + u * NG + gid;
      blk_next[u] = tok < t_end ? __ldg(bt + (tok >> a.block_shift)) : 0;
    }

    float s[GMAX][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[8];
      Bf16x8ToFloat(kr[u], kf);
#pragma unroll
      for (int h = 0; h < GMAX; ++h) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) dot = fmaf(qf[h][i], kf[i], dot);
        s[h][u] = dot;
      }
    }
#pragma unroll
    for (int off = TPK / 2; off > 0; off >>= 1) {
#pragma unroll
      for (int h = 0; h < GMAX; ++h) {
#pragma unroll
        for (int u = 0; u < U; ++u) s[h][u] += __shfl_xor_sync(0xffffffffu, s[h][u], off);
      }
    }

    float p[GMAX][U];
#pragma unroll
    for (int h = 0; h < GMAX; ++h) {
      float mx = m[h];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (!valid[u]) s[h][u] = -INFINITY;
        mx = fmaxf(mx, s[h][u]);
      }
      const float shift = SafeShift(mx);
      const float alpha = exp2f(m[h] - shift);
      float psum = 0.f;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        p[h][u] = exp2f(s[h][u] - shift);
        psum += p[h][u];
      }
      l[h] = l[h] * alpha + psum;
      m[h] = mx;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[h][i] *= alpha;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[8];
      Bf16x8ToFloat(vr[u], vf);
#pragma unroll
      for (int h = 0; h < GMAX; ++h) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[h][i] = fmaf(p[h][u], vf[i], acc[h][i]);
      }
    }
  }

  // Merge the key groups of a warp (lanes that differ above the TPK bits hold the same dims).
#pragma unroll
  for (int off = TPK; off < 32; off <<= 1) {
#pragma unroll
    for (int h = 0; h < GMAX; ++h) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[h], off);
      const float lo = __shfl_xor_sync(0xffffffffu, l[h], off);
      const float mx = fmaxf(m[h], mo);
      const float shift = SafeShift(mx);
      const float a1 = exp2f(m[h] - shift);
      const float a2 = exp2f(mo - shift);
      l[h] = l[h] * a1 + lo * a2;
      m[h] = mx;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float other = __shfl_xor_sync(0xffffffffu, acc[h][i], off);
        acc[h][i] = acc[h][i] * a1 + other * a2;
      }
    }
  }
  if (lane < TPK) {
#pragma unroll
    for (int h = 0; h < GMAX; ++h) {
#pragma unroll
      for (int i = 0; i < 8; ++i) sm.acc[warp][h][sub * 8 + i] = acc[h][i];
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < GMAX; ++h) {
      sm.m[warp][h] = m[h];
      sm.l[warp][h] = l[h];
    }
  }
  __syncthreads();
  // Merge the warps and write this split's normalised output and log2-sum-exp.
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
    const int64_t slot = (row0 + h) * a.max_splits + split;
    a.partial_out[slot * D + d] = lsum > 0.f ? osum / lsum : 0.f;
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

// One kernel serves both modes so each (D, GMAX) pair is a single template instance with a single
// inlined copy of the tile loop.
template <int D, int GMAX>
__global__ void __launch_bounds__(kThreads) DecodeAttentionKernel(DecodeArgs a) {
  __shared__ MergeSmem<D, GMAX> sm;
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
      ProcessTile<D, GMAX>(a, seq, kv_slot / a.head_chunks, kv_slot % a.head_chunks, split, sm);
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
    return absl::OkStatus();
  }
  if (p.mode != DecodeAttentionMode::kWorkQueue) return Invalid("mode", "is not a known mode");
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

int GroupTile(int group_size) {
  return group_size == 1 ? 1 : (group_size <= 4 ? 4 : 8);
}

template <int D>
absl::Status LaunchSplitKernel(const DecodeAttentionParams& p, const DecodeArgs& a,
                               cudaStream_t stream) {
  const int gmax = GroupTile(a.group_size);
  const bool queue = p.mode == DecodeAttentionMode::kWorkQueue;
  const dim3 grid = queue ? dim3(p.persistent_ctas)
                          : dim3(p.num_splits, p.num_kv_heads * a.head_chunks, p.num_seqs);
  const size_t smem = queue ? (p.num_seqs + 1) * sizeof(int32_t) : 0;
  switch (gmax) {
    case 1:
      TS_CUDA_RETURN_IF_ERROR(
          LaunchWithPdl(DecodeAttentionKernel<D, 1>, grid, dim3(kThreads), smem, stream, p.pdl, a));
      break;
    case 4:
      TS_CUDA_RETURN_IF_ERROR(
          LaunchWithPdl(DecodeAttentionKernel<D, 4>, grid, dim3(kThreads), smem, stream, p.pdl, a));
      break;
    default:
      TS_CUDA_RETURN_IF_ERROR(
          LaunchWithPdl(DecodeAttentionKernel<D, 8>, grid, dim3(kThreads), smem, stream, p.pdl, a));
      break;
  }
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
  const int gmax = GroupTile(num_q_heads / num_kv_heads);
  int blocks = 0;
  TS_RETURN_IF_ERROR(attention_internal::DispatchHeadDim(
      head_dim, "DecodeAttentionCtasPerSm head_dim", [&](auto d) -> absl::Status {
        constexpr int D = decltype(d)::value;
        const void* fn = gmax == 1   ? reinterpret_cast<const void*>(DecodeAttentionKernel<D, 1>)
                         : gmax == 4 ? reinterpret_cast<const void*>(DecodeAttentionKernel<D, 4>)
                                     : reinterpret_cast<const void*>(DecodeAttentionKernel<D, 8>);
        TS_CUDA_RETURN_IF_ERROR(
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fn, kThreads, 0));
        return absl::OkStatus();
      }));
  return std::max(blocks, 1);
}

namespace {
int32_t CtasPerSm(const SplitChoiceInputs& in) {
  return in.ctas_per_sm > 0 ? in.ctas_per_sm : 3;
}
}  // namespace

int32_t ChooseNumSplits(const SplitChoiceInputs& in) {
  const int group = in.num_kv_heads > 0 ? std::max(1, in.num_q_heads / in.num_kv_heads) : 1;
  const int64_t tiles_per_split = static_cast<int64_t>(std::max(in.num_seqs, 1)) *
                                  std::max(in.num_kv_heads, 1) * ((group + 7) / 8);
  const int64_t want_tiles = static_cast<int64_t>(std::max(in.num_sms, 1)) * CtasPerSm(in) * 2;
  const int64_t ctx = std::max(in.max_context_len, 1);
  const int64_t sms = std::max(in.num_sms, 1);
  int64_t splits = (want_tiles + tiles_per_split - 1) / tiles_per_split;
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
  const int gmax = GroupTile(a.group_size);
  a.head_chunks = (a.group_size + gmax - 1) / gmax;
  a.max_blocks_per_seq = p.max_blocks_per_seq;
  a.block_shift = attention_internal::Log2Exact(p.block_size);
  a.max_splits = p.max_splits;
  a.tiles_per_claim = p.tiles_per_claim;
  a.work_queue = queue ? 1 : 0;
  a.scale_log2 = p.scale * kLog2e;
  const int32_t chunk =
      queue ? (p.chunk_tokens + p.block_size - 1) / p.block_size * p.block_size : 1;
  a.geo = SplitGeometry{queue ? p.max_splits : p.num_splits, chunk, p.block_size,
                        p.max_blocks_per_seq * p.block_size};

  TS_RETURN_IF_ERROR(attention_internal::DispatchHeadDim(
      p.head_dim, "DecodeAttentionParams.head_dim",
      [&](auto d) { return LaunchSplitKernel<decltype(d)::value>(p, a, stream); }));

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
