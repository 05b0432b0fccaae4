#include "kernels/prefill_attention.cuh"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/attention_common.cuh"
#include "kernels/cuda_check.h"
#include "kernels/ptx.cuh"

namespace ts::kernels {
namespace {

using attention_internal::CheckedBlockId;
using attention_internal::Exp2Approx;
using attention_internal::kLog2e;
using attention_internal::MmaBf16;
using attention_internal::PackBf16;
using attention_internal::SafeShift;
using ptx::CpAsync16;
using ptx::CpAsyncCommit;
using ptx::CpAsyncWait;
using ptx::LdMatrixX4;
using ptx::LdMatrixX4Trans;
using ptx::SharedAddress;

// 8 warps x 16 rows: one K/V tile in shared memory serves 128 (token, head) rows, so the L2 -> SM
// traffic per flop is half that of 64-row CTAs (at 300 TFLOP/s, 64-row CTAs would need ~4.7 TB/s
// of L2 bandwidth, 128-row ones ~2.3 TB/s).
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = 16;  // the mma M dimension
constexpr int kRowsPerCta = kWarps * kRowsPerWarp;
constexpr int kKeyTile = 64;  // keys staged in shared memory per step
constexpr int kPad = 8;  // bf16 row padding: keeps ldmatrix and cp.async free of bank conflicts
// Tiles in flight: tile i is computed while i+1 and i+2 load (cp.async), so the L2 latency of a
// tile hides behind two tiles of mma. Three buffers need one barrier per tile: the buffer refilled
// at step i was last read at step i-1, before step i's barrier.
constexpr int kStages = 3;
// CTAs per SM: two at D <= 64 (54 KB of smem and <= 128 registers each, so one CTA's softmax and
// barrier waits overlap the other's mma), one at D = 128 (~220 registers x 256 threads).
template <int D>
constexpr int kMinCtasPerSm = D >= 128 ? 1 : 2;
// What PrefillAttentionSplits fills, without knowing D: two CTAs per SM, one wave at D <= 64 and
// two at D = 128.
constexpr int kCtaSlotsPerSm = 2;

// [kStages][K, V][kKeyTile][D + kPad] bf16.
template <int D>
constexpr size_t SmemBytes() {
  return size_t{kStages} * 2 * kKeyTile * (D + kPad) * sizeof(__nv_bfloat16);
}

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

// Which tile of work a CTA has: (seq, split) from blockIdx.z, and the (row tile, kv head) pair
// from blockIdx.x, y. Row tiles are handed out last first, across the kv heads: under the causal
// mask a tile's work grows with its index, so the longest CTAs start in the first wave and the
// short ones fill the tail (a few percent on a fresh prompt with more CTAs than fit at once).
struct CtaPlace {
  int seq;
  int split;
  int kvh;
  int row_tile;  // rows [row_tile * kRowsPerCta, +kRowsPerCta) of the sequence's (token, head) rows
};

__device__ __forceinline__ CtaPlace Place(const PrefillArgs& a, uint3 cta) {
  const int64_t linear = cta.x + static_cast<int64_t>(gridDim.x) * cta.y;
  return {static_cast<int>(cta.z) / a.num_splits, static_cast<int>(cta.z) % a.num_splits,
          static_cast<int>(linear % a.num_kv_heads),
          static_cast<int>(gridDim.x) - 1 - static_cast<int>(linear / a.num_kv_heads)};
}

// blockIdx and threadIdx through asm volatile, which the compiler cannot merge with the earlier
// reads: the epilogue's indices derived from them are recomputed after the loop rather than kept
// live through it, where at D = 64 all 128 registers that two CTAs per SM leave are needed.
__device__ __forceinline__ uint3 OpaqueCtaId() {
  uint3 c;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(c.x));
  asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(c.y));
  asm volatile("mov.u32 %0, %%ctaid.z;\n" : "=r"(c.z));
  return c;
}

__device__ __forceinline__ int OpaqueTid() {
  int v;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(v));
  return v;
}

// Row `r` of the sequence's (token, head in group) rows as a row of q and out.
__device__ __forceinline__ int64_t QueryRow(const PrefillArgs& a, const CtaPlace& at, int q_begin,
                                            int r) {
  return static_cast<int64_t>(q_begin + r / a.group_size) * a.num_q_heads + at.kvh * a.group_size +
         r % a.group_size;
}

// Rows are (token, query head in group) pairs flattened as token * group_size + head, so GQA
// heads of one token share the K/V tile. mma fragment ownership (PTX m16n8k16), lane = 4g + t:
//   A (16x16, row): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..);
//   B (16x8, col):  b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g);
//   C (16x8):       c0, c1 = (g, 2t..2t+1), c2, c3 = (g+8, 2t..2t+1).
// ldmatrix.x4: lane l gives the address of row l % 8 of matrix l / 8 and gets, in register i,
// matrix i's (row l / 4, cols 2(l % 4), +1); with .trans, (rows 2(l % 4), +1, col l / 4).
//   S = Q K^T, B[k = d][n = key] = K[key][d]: b0 is K row `key` at d 2t..2t+1, a plain ldmatrix
//     of K rows. Matrices (keys 16p + 0..7, d 16kk + 0..7), (16p + 0..7, 16kk + 8..15),
//     (16p + 8..15, 16kk), (16p + 8..15, 16kk + 8) give b0, b1 of n tile 2p, then of 2p + 1: lane l
//     reads key 16p + (l & 7) + 8 (l >> 4) at d 16kk + 8 ((l >> 3) & 1).
//   O += P V, B[k = key][n = d] = V[key][d]: b0 is column d of V rows 2t, 2t+1, ldmatrix.trans of
//     V rows. Matrices (keys 16k + 0..7, d 16p + 0..7), (16k + 8..15, 16p), (16k, 16p + 8),
//     (16k + 8, 16p + 8) give b0, b1 of n tile 2p, then of 2p + 1: lane l reads key 16k + (l & 15)
//     at d 16p + 8 (l >> 4).
// Row strides of (D + 8) bf16 (144 B, 272 B, 48 B) put the 8 rows of one matrix in 8 distinct
// 16-byte bank groups.
template <int D>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm<D>)
    PrefillAttentionKernel(PrefillArgs a) {
  constexpr int KSTEPS = D / 16;      // k steps of QK^T
  constexpr int NT_S = kKeyTile / 8;  // n tiles of S
  constexpr int NT_O = D / 8;         // n tiles of O
  constexpr int CHUNKS = D / 8;       // 16-byte pieces per K/V row
  constexpr int LD = D + kPad;        // bf16 per shared-memory row
  constexpr uint32_t kRowBytes = LD * sizeof(__nv_bfloat16);
  constexpr uint32_t kTileBytes = kKeyTile * kRowBytes;                  // one K or V tile
  constexpr uint32_t kStageBytes = 2 * kTileBytes;                       // K then V
  constexpr int kLoads = (kKeyTile * CHUNKS + kThreads - 1) / kThreads;  // 16-B copies per thread
  extern __shared__ __align__(16) unsigned char smem_raw[];  // [kStages][2][kKeyTile][LD] bf16
  const uint32_t smem = SharedAddress(smem_raw);

  const CtaPlace at = Place(a, blockIdx);
  const int seq = at.seq;
  const int kvh = at.kvh;
  const int q_begin = a.cu_seqlens[seq];
  const int q_len = min(a.cu_seqlens[seq + 1], a.total_tokens) - q_begin;
  const int start = a.start_pos != nullptr ? a.start_pos[seq] : 0;
  const int num_rows = q_len * a.group_size;
  const int row_begin = at.row_tile * kRowsPerCta;
  if (q_len <= 0 || q_begin < 0 || start < 0 || row_begin >= num_rows) return;
  const int last_tok = min(num_rows - 1, row_begin + kRowsPerCta - 1) / a.group_size;
  const int kv_end = min(start + last_tok + 1, a.max_context);
  // This split's keys: equal ranges of whole key tiles over the sequence's keys (those of its last
  // query), the same for every CTA of the sequence so each row's partials tile its keys.
  const int seq_keys = min(start + q_len, a.max_context);
  const int tiles_per_split =
      ((seq_keys + kKeyTile - 1) / kKeyTile + a.num_splits - 1) / a.num_splits;
  const int kv_begin = at.split * tiles_per_split * kKeyTile;
  const int kv_stop = min(kv_end, kv_begin + tiles_per_split * kKeyTile);

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int warp_row0 = row_begin + warp * kRowsPerWarp;
  const bool warp_active = warp_row0 < num_rows;
  const int warp_max_pos =
      warp_active ? start + min(num_rows - 1, warp_row0 + kRowsPerWarp - 1) / a.group_size : -1;
  // Keys up to here are visible to all the warp's rows: tiles that end there need no mask.
  const int warp_unmasked = min(start + warp_row0 / a.group_size, kv_end - 1);

  // The last key each of this thread's rows (g and g+8) sees, its query position capped by
  // kv_end; -1 for a row past num_rows: every key is masked, nothing is written.
  int last_key[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = warp_row0 + g + 8 * i;
    last_key[i] = r < num_rows ? min(start + r / a.group_size, kv_end - 1) : -1;
  }

  const int32_t* bt =  // [max_blocks_per_seq]
      a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
  const int bs_mask = (1 << a.block_shift) - 1;
  const int64_t head_stride = static_cast<int64_t>(D) << a.block_shift;
  const int64_t block_stride = head_stride * a.num_kv_heads;
  // This thread's rows of a tile are j = (threadIdx.x + i * kThreads) / CHUNKS, i < kLoads, at
  // piece threadIdx.x % CHUNKS. Their table entries are read one step before the copies that use
  // them (and checked there), so the table's L2 latency hides behind a tile of mma instead of
  // stalling every warp right after the barrier. Entries of keys at or past kv_end are never read
  // (they may be padding); block 0 stands in.
  int32_t blk[kLoads];
  auto lookup = [&](int kt) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int c = threadIdx.x + i * kThreads;
      if (kKeyTile * CHUNKS % kThreads != 0 && c >= kKeyTile * CHUNKS) break;
      const int key = kt + c / CHUNKS;
      blk[i] = key < kv_end ? __ldg(bt + (key >> a.block_shift)) : 0;
    }
  };
  // Keys [kt, kt + kKeyTile) into stage `stage` with the ids from lookup(kt), 16 B per cp.async;
  // keys at or past kv_end are zero-filled (src-size 0): masked P times garbage V could be NaN.
  auto copy_tile = [&](int kt, int stage) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int c = threadIdx.x + i * kThreads;
      if (kKeyTile * CHUNKS % kThreads != 0 && c >= kKeyTile * CHUNKS) break;
      const int j = c / CHUNKS;
      const int piece = c % CHUNKS;
      const int key = kt + j;
      const int32_t id = CheckedBlockId(blk[i], a.num_blocks, a.error_flag);
      const int64_t off = id * block_stride + kvh * head_stride +
                          static_cast<int64_t>(key & bs_mask) * D + piece * 8;
      const uint32_t dst = smem + stage * kStageBytes + j * kRowBytes + piece * 16;
      const uint32_t bytes = key < kv_end ? 16 : 0;
      CpAsync16(dst, a.k_cache + off, bytes);
      CpAsync16(dst + kTileBytes, a.v_cache + off, bytes);
    }
  };
  // Issued before the Q loads so the first tiles are in flight while Q arrives.
  if (kv_begin < kv_stop) {
    lookup(kv_begin);
    copy_tile(kv_begin, 0);
  }
  CpAsyncCommit();
  if (kv_begin + kKeyTile < kv_stop) {
    lookup(kv_begin + kKeyTile);
    copy_tile(kv_begin + kKeyTile, 1);
  }
  CpAsyncCommit();
  if (kv_begin + 2 * kKeyTile < kv_stop) lookup(kv_begin + 2 * kKeyTile);

  uint32_t qa[KSTEPS][4];
#pragma unroll
  for (int row = 0; row < 2; ++row) {  // a0, a2: row g; a1, a3: row g+8
    // [D], from column 2t.
    const __nv_bfloat16* qr = a.q + QueryRow(a, at, q_begin, warp_row0 + g + 8 * row) * D + 2 * t;
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        qa[kk][row + 2 * half] =
            last_key[row] >= 0 ? *reinterpret_cast<const uint32_t*>(qr + kk * 16 + half * 8) : 0u;
      }
    }
  }

  float o[NT_O][4];
#pragma unroll
  for (int n = 0; n < NT_O; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};

  // This lane's ldmatrix row addresses within a stage (the mapping above).
  const uint32_t k_lane = ((lane & 7) + ((lane >> 4) << 3)) * kRowBytes + ((lane >> 3) & 1) * 16;
  const uint32_t v_lane = kTileBytes + (lane & 15) * kRowBytes + (lane >> 4) * 16;

  int stage = 0;
  for (int kt = kv_begin; kt < kv_stop; kt += kKeyTile) {  // tile i = (kt - kv_begin) / kKeyTile
    CpAsyncWait<1>();  // this thread's copies of tile i have landed (tile i+1 may be in flight)
    __syncthreads();   // everyone's have, and every warp is done with tile i-1's buffer
    static_assert(kStages == 3, "the prologue loads two tiles; step i refills stage (i + 2) % 3");
    if (kt + 2 * kKeyTile < kv_stop) copy_tile(kt + 2 * kKeyTile, stage == 0 ? 2 : stage - 1);
    CpAsyncCommit();  // possibly empty: keeps "all but the newest group" meaning tile i+1
    if (kt + 3 * kKeyTile < kv_stop) lookup(kt + 3 * kKeyTile);
    const uint32_t ks = smem + stage * kStageBytes;
    stage = stage == kStages - 1 ? 0 : stage + 1;
    if (kt > warp_max_pos) continue;  // causal: every key of this tile is in the warp's future

    float s[NT_S][4];
#pragma unroll
    for (int n = 0; n < NT_S; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
      for (int p = 0; p < NT_S / 2; ++p) {
        uint32_t b[4];
        LdMatrixX4(b, ks + k_lane + p * 16 * kRowBytes + kk * 32);
        MmaBf16(s[2 * p], qa[kk], b[0], b[1]);
        MmaBf16(s[2 * p + 1], qa[kk], b[2], b[3]);
      }
    }

    // Scale, mask, online softmax; c[0..1] belong to row g, c[2..3] to row g+8. A tile wholly at
    // or before the warp's first position (and inside kv_end) needs no mask, which saves a compare
    // and a select per score: rows past num_rows get finite junk there (q = 0), never written.
    if (kt + kKeyTile - 1 <= warp_unmasked) {
#pragma unroll
      for (int n = 0; n < NT_S; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] *= a.scale_log2;
      }
    } else {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // Keys past `last` are masked, counted from this lane's first key of the tile.
        const int last = last_key[r] - kt - 2 * t;
#pragma unroll
        for (int n = 0; n < NT_S; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& v = s[n][2 * r + e];
            v = n * 8 + e <= last ? v * a.scale_log2 : -INFINITY;
          }
        }
      }
    }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = m[r];
#pragma unroll
      for (int n = 0; n < NT_S; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float shift = SafeShift(mx);
      alpha[r] = Exp2Approx(m[r] - shift);
      m[r] = mx;
      float psum = 0.f;
#pragma unroll
      for (int n = 0; n < NT_S; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& v = s[n][2 * r + e];
          v = Exp2Approx(v - shift);
          psum += v;
        }
      }
      l[r] = l[r] * alpha[r] + psum;  // per-thread partial; the quad is summed at the end
    }
#pragma unroll
    for (int n = 0; n < NT_O; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }

    // O += P V: S's accumulator layout for keys [16k, 16k+16) is exactly P's A fragment.
    const uint32_t vs = ks + v_lane;
#pragma unroll
    for (int k = 0; k < kKeyTile / 16; ++k) {
      const uint32_t pa[4] = {
          PackBf16(s[2 * k][0], s[2 * k][1]), PackBf16(s[2 * k][2], s[2 * k][3]),
          PackBf16(s[2 * k + 1][0], s[2 * k + 1][1]), PackBf16(s[2 * k + 1][2], s[2 * k + 1][3])};
#pragma unroll
      for (int p = 0; p < NT_O / 2; ++p) {
        uint32_t b[4];
        LdMatrixX4Trans(b, vs + k * 16 * kRowBytes + p * 32);
        MmaBf16(o[2 * p], pa, b[0], b[1]);
        MmaBf16(o[2 * p + 1], pa, b[2], b[3]);
      }
    }
  }
  // No copy is in flight here: only tiles below kv_stop are issued, and the last was waited for
  // in the last step.

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
  const CtaPlace at_end = Place(a, OpaqueCtaId());
  const int q_begin_end = __ldg(a.cu_seqlens + at_end.seq);
  const int tid = OpaqueTid();
  const int row0_end =
      at_end.row_tile * kRowsPerCta + (tid >> 5) * kRowsPerWarp + ((tid & 31) >> 2);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (last_key[i] < 0) continue;
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    const int64_t row = QueryRow(a, at_end, q_begin_end, row0_end + 8 * i);
    if (a.num_splits > 1) {
      // A split that saw none of the row's keys says so with -inf, and the merge skips it.
      const int64_t prow = row * a.num_splits + at_end.split;
      float* po = a.partial_out + prow * D;  // [D]
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
      *reinterpret_cast<__nv_bfloat162*>(a.out + row * D + n * 8 + 2 * t) =
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
  if (total_tokens < 1 || num_kv_heads < 1 || num_sms < 1 || num_seqs < 1) return 1;
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t ctas = (static_cast<int64_t>(max_q_len) * group + kRowsPerCta - 1) / kRowsPerCta *
                       num_kv_heads * num_seqs;
  const int64_t slots = static_cast<int64_t>(kCtaSlotsPerSm) * num_sms;
  if (ctas >= slots) return 1;
  const int64_t by_keys = (static_cast<int64_t>(max_kv_len) + kKeyTile - 1) / kKeyTile / 4;
  const int64_t by_room = max_split_rows / total_tokens;
  const int64_t cap = std::min<int64_t>({by_keys, by_room, 16, 65535 / num_seqs});
  // CTAs of one chunk do about equal work, so with s splits the kernel takes about
  // waves(s) / s of the unsplit CTA's time, waves(s) = ceil(ctas * s / slots): the fewest splits
  // with the least of that. A split past one full wave only pays when it fills the last one
  // better (64 CTAs on 264 slots: 4 splits fill 97%, 5 need two waves for 1.25x the work of one).
  int64_t best = 1, best_waves = 1;
  for (int64_t s = 2; s <= cap; ++s) {
    const int64_t waves = (ctas * s + slots - 1) / slots;
    if (s * best_waves > best * waves) {  // s / waves > best / best_waves
      best = s;
      best_waves = waves;
    }
  }
  return static_cast<int32_t>(best);
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
        // Above the default 48 KB at D >= 64, and all of the SM's L1 as shared memory so two CTAs
        // fit at D = 64 (the K/V copies bypass L1). Function attributes: legal during capture.
        TS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(PrefillAttentionKernel<D>,
                                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                     static_cast<int>(SmemBytes<D>())));
        TS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(PrefillAttentionKernel<D>,
                                                     cudaFuncAttributePreferredSharedMemoryCarveout,
                                                     cudaSharedmemCarveoutMaxShared));
        PrefillAttentionKernel<D><<<grid, kThreads, SmemBytes<D>(), stream>>>(a);
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
