#include "kernels/decode_attention.cuh"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/attention_combine.cuh"
#include "kernels/attention_common.cuh"
#include "kernels/bf16_vec.cuh"
#include "kernels/cuda_check.h"
#include "kernels/kv_layout.cuh"
#include "kernels/pdl.cuh"
#include "kernels/ptx.cuh"

namespace ts::kernels {
namespace {

using attention_internal::CheckedBlockId;
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
  // Fused RoPE (DecodeAttentionParams::rope), or qkv = nullptr.
  const __nv_bfloat16* qkv;     // [num_seqs, (num_q_heads + 2 num_kv_heads) * D]
  const float* angles;          // [num_seqs, D / 2, 2] cos, sin
  const int32_t* slot_mapping;  // [num_seqs]
  __nv_bfloat16* k_write;       // k_cache, writable
  __nv_bfloat16* v_write;       // v_cache, writable
  int32_t* slot_error_flag;     // [1] or nullptr: a current token's slot is out of the pool
  __nv_bfloat16* out;           // [num_seqs, num_q_heads, D]; written here at one split
  float* partial_out;           // [num_seqs, num_q_heads, max_splits, D]
  float* partial_lse;           // [num_seqs, num_q_heads, max_splits]
  uint32_t* counters;           // [2]: next tile, CTAs finished
  int32_t* error_flag;          // [1] or nullptr: a table entry within a context is invalid
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
// Chunks each warp has in shared memory: the one it computes and the next, in flight.
constexpr int kStages = 2;

// A CTA's shared memory: each warp's ring of kStages chunks (K rows, then V rows), which the warps'
// merge buffers overlay once the tile's loop is done. Rows are padded by 16 bytes so that the 8
// rows an ldmatrix reads lie in 8 different bank groups (row strides of 2D + 16 bytes).
template <int D>
struct TileSmem {
  static constexpr int kRowBytes = 2 * D + 16;
  static constexpr int kChunkBytes = kChunk * kRowBytes;  // the K (or V) rows of one chunk
  static constexpr int kStageBytes = 2 * kChunkBytes;
  static constexpr int kWarpBytes = kStages * kStageBytes;
  // Accumulators padded to D + 4 floats a head: the stores of the O^T fragments, heads 2t and dims
  // g, then fall in 32 different banks.
  struct Merge {
    float m[kWarps][kHeads];
    float l[kWarps][kHeads];
    float acc[kWarps][kHeads][D + 4];
  };
  static constexpr int kBytes = std::max<int>(kWarps * kWarpBytes, sizeof(Merge));
};

// Fused RoPE on a packed pair of q values: lo holds dims (d, d + 1), hi their partners
// (d + D / 2, d + D / 2 + 1), each element at its own lower address. Rounded as rope_kv rounds.
__device__ __forceinline__ void RotatePacked(uint32_t& lo, uint32_t& hi, RopeCosSin c0,
                                             RopeCosSin c1) {
  const __nv_bfloat162 x1 = *reinterpret_cast<const __nv_bfloat162*>(&lo);
  const __nv_bfloat162 x2 = *reinterpret_cast<const __nv_bfloat162*>(&hi);
  float a1, a2, b1, b2;
  RopeRotate(__bfloat162float(x1.x), __bfloat162float(x2.x), c0, a1, a2);
  RopeRotate(__bfloat162float(x1.y), __bfloat162float(x2.y), c1, b1, b2);
  const __nv_bfloat162 o1 = __floats2bfloat162_rn(a1, b1);
  const __nv_bfloat162 o2 = __floats2bfloat162_rn(a2, b2);
  lo = *reinterpret_cast<const uint32_t*>(&o1);
  hi = *reinterpret_cast<const uint32_t*>(&o2);
}

// One tile: query heads [hc*kHeads, hc*kHeads + nh) of kv head `kvh`'s group, tokens of split
// `split`, on the tensor cores. Each of the CTA's warps takes every fourth 16-key chunk and
// streams it through its own two-stage cp.async ring, so no register holds a byte in flight and
// the next chunk's copy runs while this one is computed. Per chunk it computes S^T = K Q^T (16
// keys x 8 heads), an fp32 online softmax per head (column), and O^T += V^T P^T with P rounded to
// bf16 (as flash attention and the prefill kernel do; the row sums stay fp32); K and V^T come
// from ldmatrix (V^T transposed on the way). The warps' states are merged once at the end.
// With the fused RoPE (a.qkv), `current` ([2, D] in shared memory, 16-byte aligned) is the tile's
// one writing warp's.
template <int D>
__device__ void ProcessTile(const DecodeArgs& a, int seq, int kvh, int hc, int split, char* smem,
                            __nv_bfloat16* current) {
  using L = TileSmem<D>;
  constexpr int KSTEPS = D / 16;                  // k steps of S^T; m tiles of O^T
  constexpr int kPieces = D / 8;                  // 16-byte pieces of a row
  constexpr int kCopies = kChunk * kPieces / 32;  // K pieces (and as many V) a lane copies
  static_assert(kCopies >= 1 && kChunk * kPieces % 32 == 0, "head_dim too small for the copy");
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  auto& sm = *reinterpret_cast<typename L::Merge*>(smem);

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

  const int32_t* bt = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
  const int bs_mask = (1 << a.block_shift) - 1;
  const int64_t head_stride = static_cast<int64_t>(D) << a.block_shift;
  const int64_t block_stride = head_stride * a.num_kv_heads;
  const __nv_bfloat16* kbase = a.k_cache + kvh * head_stride;
  const __nv_bfloat16* vbase = a.v_cache + kvh * head_stride;
  const uint32_t ring = ptx::SharedAddress(smem) + warp * L::kWarpBytes;

  // Lane r < 16 reads the table entry of row r of a chunk (lanes 16-31 repeat rows 0-15), a chunk
  // before the copy that needs it, so the table's latency never stalls a copy. Rows at or past
  // t_end read nothing, not even their entry (padding, kInvalidKvBlock).
  auto lookup = [&](int base) -> int32_t {
    const int tok = base + (lane & 15);
    return tok < t_end ? __ldg(bt + (tok >> a.block_shift)) : 0;
  };
  // The chunk's K and V rows into `stage`, 16 B per cp.async: lane l copies pieces l + 32 i, row
  // (l + 32 i) / kPieces. Rows at or past t_end are zero-filled (src-size 0): masked P times
  // garbage V could be NaN.
  auto copy_chunk = [&](int base, int32_t ids, int stage) {
    const uint32_t dst0 = ring + stage * L::kStageBytes;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int c = lane + 32 * i;
      const int row = c / kPieces;
      const int piece = c % kPieces;
      const int tok = base + row;
      const int32_t id =
          CheckedBlockId(__shfl_sync(0xffffffffu, ids, row), a.num_blocks, a.error_flag);
      const int64_t off = id * block_stride + static_cast<int64_t>(tok & bs_mask) * D + piece * 8;
      const uint32_t dst = dst0 + row * L::kRowBytes + piece * 16;
      const uint32_t bytes = tok < t_end ? 16u : 0u;
      ptx::CpAsync16(dst, kbase + off, bytes);
      ptx::CpAsync16(dst + L::kChunkBytes, vbase + off, bytes);
    }
  };

  constexpr int kStride = kWarps * kChunk;
  int base = t_begin + warp * kChunk;
  int32_t ids = 0;
  if (base < t_end) copy_chunk(base, lookup(base), 0);
  ptx::CpAsyncCommit();
  if (base + kStride < t_end) ids = lookup(base + kStride);

  // Q^T as B fragments (k = dims, n = heads): head g's dims 16s + 2t, +1 and 16s + 2t + 8, +9;
  // heads past nh are zero. Loaded while the first chunk is in flight.
  const bool rope = a.qkv != nullptr;
  const int64_t qkv_row = static_cast<int64_t>(seq) * (a.num_q_heads + 2 * a.num_kv_heads) * D;
  uint32_t qb[KSTEPS][2];
  {
    const int64_t head = row0 - static_cast<int64_t>(seq) * a.num_q_heads + min(g, nh - 1);
    const __nv_bfloat16* qrow =  // [D], from dim 2t
        (rope ? a.qkv + qkv_row + head * D : a.q + (row0 + min(g, nh - 1)) * D) + 2 * t;
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
      qb[s][0] = g < nh ? __ldg(reinterpret_cast<const uint32_t*>(qrow + 16 * s)) : 0u;
      qb[s][1] = g < nh ? __ldg(reinterpret_cast<const uint32_t*>(qrow + 16 * s + 8)) : 0u;
    }
  }

  // Fused RoPE, while the first chunk is in flight: the angles come with q (a table the step's
  // prepare kernel wrote once for every layer; computing them here cost more than the rope_kv
  // node saved, bench/results/2026-12-05c-h100-h200.md), and each lane rotates its q fragments. The
  // warp that will copy the chunk holding the current token (ctx - 1), in the tile that holds it,
  // also does rope_kv's work for this kv head: it writes the rotated k and v to the cache for later
  // steps and keeps them in `current`, which it puts over that token's row of the chunk once the
  // chunk has landed, so no load waits on the store.
  bool inject = false;
  if (rope) {
    // A row's angles as float4s: the (cos, sin) pairs of dims 2i and 2i + 1.
    const float4* ang = reinterpret_cast<const float4*>(a.angles + static_cast<int64_t>(seq) * D);
    // Lane (g, t) rotates dims d = 16 s + 8 r + 2 t and d + 1 of the first half with their
    // partners d + D / 2: the same register KSTEPS / 2 k steps on for D >= 32, the +8 register
    // of the same step for D = 16.
    constexpr int kLoSteps = D >= 32 ? KSTEPS / 2 : 1;
    constexpr int kRegs = D >= 32 ? 2 : 1;
    float4 qa[kLoSteps][kRegs];
#pragma unroll
    for (int s = 0; s < kLoSteps; ++s) {
#pragma unroll
      for (int r = 0; r < kRegs; ++r) qa[s][r] = __ldg(ang + 8 * s + 4 * r + t);
    }
    constexpr int kItems = D / 16;  // 8 rotation pairs (two 16-byte vectors) an item
    const bool writer = t_end == ctx && warp == ((ctx - 1 - t_begin) / kChunk) % kWarps;
    const int32_t slot = writer ? a.slot_mapping[seq] : kNoKvWrite;
    const bool slot_ok = KvSlotInPool(slot, a.num_blocks, 1 << a.block_shift);
    if (writer && !slot_ok && slot != kNoKvWrite && lane == 0 && a.slot_error_flag != nullptr)
      *a.slot_error_flag = 1;
    inject = writer && slot_ok;
    // Lane i < D / 8 moves one item: k's first (rotated), then v's (copied).
    const bool is_v = lane >= kItems;
    const int i0 = (lane % kItems) * 8;
    Bf16x8 lo, hi;
    float4 ka[4];
    if (inject && lane < 2 * kItems) {
      const __nv_bfloat16* src =
          a.qkv + qkv_row + (a.num_q_heads + (is_v ? a.num_kv_heads : 0) + kvh) * D + i0;
      lo = LoadBf16x8(src);
      hi = LoadBf16x8(src + D / 2);
#pragma unroll
      for (int j = 0; j < 4; ++j) ka[j] = is_v ? float4{} : __ldg(ang + i0 / 2 + j);
    }
#pragma unroll
    for (int s = 0; s < kLoSteps; ++s) {
#pragma unroll
      for (int r = 0; r < kRegs; ++r) {
        const float4 c = qa[s][r];
        RotatePacked(qb[s][r], D >= 32 ? qb[s + KSTEPS / 2][r] : qb[0][1], {c.x, c.y}, {c.z, c.w});
      }
    }
    if (inject && lane < 2 * kItems) {
      if (!is_v) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float4 c = ka[j / 2];
          const RopeCosSin cs = j % 2 == 0 ? RopeCosSin{c.x, c.y} : RopeCosSin{c.z, c.w};
          float o1, o2;
          RopeRotate(__bfloat162float(lo.h[j]), __bfloat162float(hi.h[j]), cs, o1, o2);
          lo.h[j] = __float2bfloat16_rn(o1);
          hi.h[j] = __float2bfloat16_rn(o2);
        }
      }
      const KvLayout l{a.num_blocks, a.num_kv_heads, 1 << a.block_shift, D};
      __nv_bfloat16* dst = (is_v ? a.v_write : a.k_write) +
                           KvOffset(l, slot >> a.block_shift, kvh, slot & bs_mask) + i0;
      StoreBf16x8(dst, lo);
      StoreBf16x8(dst + D / 2, hi);
      __nv_bfloat16* keep = current + (is_v ? D : 0) + i0;
      StoreBf16x8(keep, lo);
      StoreBf16x8(keep + D / 2, hi);
    }
    __syncwarp();  // `current` is complete before any lane puts it into the chunk
  }

  float m[2] = {-INFINITY, -INFINITY};  // heads 2t, 2t+1
  float l[2] = {0.f, 0.f};              // this lane's keys only; summed over g at the end
  float acc[KSTEPS][4];                 // O^T m-tile j: dims 16j + g (0, 1), 16j + g + 8 (2, 3)
#pragma unroll
  for (int j = 0; j < KSTEPS; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  // ldmatrix row addresses of this lane within a stage. K as the A fragment of S^T: matrix i =
  // keys 8 (i & 1) + 0..7 at dims 8 (i >> 1) + 0..7 of a k step. V^T as the A fragment of O^T,
  // transposed: matrix i = keys 8 (i >> 1) + 0..7 at dims 8 (i & 1) + 0..7 of an m tile.
  const uint32_t k_lane = ((lane & 7) + ((lane >> 3) & 1) * 8) * L::kRowBytes + (lane >> 4) * 16;
  const uint32_t v_lane =
      L::kChunkBytes + ((lane & 7) + (lane >> 4) * 8) * L::kRowBytes + ((lane >> 3) & 1) * 16;

  int stage = 0;
  for (; base < t_end; base += kStride) {
    const int next = base + kStride;
    if (next < t_end) {
      copy_chunk(next, ids, stage ^ 1);
      if (next + kStride < t_end) ids = lookup(next + kStride);
    }
    ptx::CpAsyncCommit();   // possibly empty: "all but the newest group" is then this chunk
    ptx::CpAsyncWait<1>();  // this lane's copies of the chunk have landed
    __syncwarp();           // and every lane's
    const uint32_t st = ring + stage * L::kStageBytes;
    // The chunk of the current token (fused RoPE): t_end is ctx in the tile that injects.
    if (inject && base + kChunk >= t_end) {
      char* row =
          smem + warp * L::kWarpBytes + stage * L::kStageBytes + (t_end - 1 - base) * L::kRowBytes;
      for (int c = lane; c < D / 4; c += 32) {  // 16-byte pieces: K's row, then V's
        const int piece = c % (D / 8);
        const bool v_row = c >= D / 8;
        *reinterpret_cast<uint4*>(row + (v_row ? L::kChunkBytes : 0) + piece * 16) =
            *reinterpret_cast<const uint4*>(current + (v_row ? D : 0) + piece * 8);
      }
      __syncwarp();
    }

    // c[0..1]: key g, heads 2t, 2t+1; c[2..3]: key g + 8.
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
      uint32_t ka[4];
      ptx::LdMatrixX4(ka, st + k_lane + s * 32);
      MmaBf16(c, ka, qb[s][0], qb[s][1]);
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
      uint32_t va[4];
      ptx::LdMatrixX4Trans(va, st + v_lane + j * 32);
      MmaBf16(acc[j], va, pb0, pb1);
    }
    __syncwarp();  // every lane is done with this stage before the next step refills it
    stage ^= 1;
  }

  // Sum l over the lanes that hold the other keys (g); m is already uniform over g.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 4);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 8);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 16);
  }
  __syncthreads();  // the merge buffers overlay the other warps' rings
#pragma unroll
  for (int j = 0; j < KSTEPS; ++j) {
    const int d = 16 * j + g;
    sm.acc[warp][2 * t][d] = acc[j][0];
    sm.acc[warp][2 * t + 1][d] = acc[j][1];
    sm.acc[warp][2 * t][d + 8] = acc[j][2];
    sm.acc[warp][2 * t + 1][d + 8] = acc[j][3];
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
// At D = 128 shared memory holds an SM to three CTAs, so registers need not be capped for four.
template <int D>
__global__ void __launch_bounds__(kThreads, D == 128 ? 3 : 4) DecodeAttentionKernel(DecodeArgs a) {
  // [TileSmem<D>::kBytes: the warps' rings, then the merge], then for the work queue
  // [num_seqs + 1] int32 of the chunk prefix sum.
  extern __shared__ __align__(16) char smem[];
  int32_t* s_prefix = reinterpret_cast<int32_t*>(smem + TileSmem<D>::kBytes);
  __shared__ int32_t s_claim;
  // The fused RoPE's current token, rotated k then v (one warp of a tile writes and reads it).
  __shared__ __align__(16) __nv_bfloat16 s_current[2 * D];
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
      ProcessTile<D>(a, seq, kv_slot / a.head_chunks, kv_slot % a.head_chunks, split, smem,
                     s_current);
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
  if ((p.q == nullptr) == (p.rope.qkv == nullptr))
    return Invalid("q", "or rope.qkv must be set, not both");
  if (p.q != nullptr && !IsAligned(p.q, 16)) return Invalid("q", "must be 16-B aligned");
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

// The fused RoPE's fields, once ValidateShape has passed.
absl::Status ValidateRope(const DecodeAttentionParams& p) {
  using attention_internal::IsAligned;
  const DecodeAttentionRope& r = p.rope;
  if (r.qkv == nullptr) return absl::OkStatus();
  if (!IsAligned(r.qkv, 16)) return Invalid("rope.qkv", "must be 16-B aligned");
  if (r.angles == nullptr || !IsAligned(r.angles, 16))
    return Invalid("rope.angles", "must be non-null, 16-B aligned");
  if (r.slot_mapping == nullptr || !IsAligned(r.slot_mapping, 4))
    return Invalid("rope.slot_mapping", "must be non-null, 4-B aligned");
  if (r.k_cache != p.k_cache || r.v_cache != p.v_cache)
    return Invalid("rope.k_cache", "and rope.v_cache must be k_cache and v_cache");
  if (r.error_flag != nullptr && !IsAligned(r.error_flag, 4))
    return Invalid("rope.error_flag", "must be 4-B aligned");
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

// Above the default 48 KB of dynamic shared memory at D = 128 (and with a long work-queue prefix
// sum), and all of the SM's L1 as shared memory so that three CTAs fit: the K/V copies bypass L1.
// Function attributes: legal during capture.
template <int D>
absl::Status SetSmemAttributes() {
  TS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      DecodeAttentionKernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(TileSmem<D>::kBytes + (kMaxWorkQueueSeqs + 1) * sizeof(int32_t))));
  TS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(DecodeAttentionKernel<D>,
                                               cudaFuncAttributePreferredSharedMemoryCarveout,
                                               cudaSharedmemCarveoutMaxShared));
  return absl::OkStatus();
}

template <int D>
absl::Status LaunchSplitKernel(const DecodeAttentionParams& p, const DecodeArgs& a,
                               cudaStream_t stream) {
  const bool queue = p.mode == DecodeAttentionMode::kWorkQueue;
  const dim3 grid = queue ? dim3(p.persistent_ctas)
                          : dim3(p.num_splits, p.num_kv_heads * a.head_chunks, p.num_seqs);
  const size_t smem = TileSmem<D>::kBytes + (queue ? (p.num_seqs + 1) * sizeof(int32_t) : 0);
  TS_RETURN_IF_ERROR(SetSmemAttributes<D>());
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
        constexpr int D = decltype(d)::value;
        TS_RETURN_IF_ERROR(SetSmemAttributes<D>());
        // The static split's shared memory: the one mode the engine captures.
        TS_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &blocks, DecodeAttentionKernel<D>, kThreads, TileSmem<D>::kBytes));
        return absl::OkStatus();
      }));
  return std::max(blocks, 1);
}

absl::Status LaunchDecodeAttention(const DecodeAttentionParams& p, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(ValidateShape(p));
  TS_RETURN_IF_ERROR(ValidateMode(p));
  TS_RETURN_IF_ERROR(ValidateRope(p));
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
  a.qkv = p.rope.qkv;
  a.angles = p.rope.angles;
  a.slot_mapping = p.rope.slot_mapping;
  a.k_write = p.rope.k_cache;
  a.v_write = p.rope.v_cache;
  a.slot_error_flag = p.rope.error_flag;
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
