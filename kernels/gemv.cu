#include "kernels/gemv.cuh"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/bf16_vec.cuh"
#include "kernels/cuda_check.h"
#include "kernels/gemv_internal.cuh"
#include "kernels/pdl.cuh"
#include "kernels/rope_kv.cuh"

namespace ts::kernels {
namespace {

using gemv_internal::RopeEpilogue;
using gemv_internal::StoreOutput;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
// One k-step: the 4 threads of an MMA group each load 8 consecutive k (16 bytes) of a row.
constexpr int kStepK = 32;
// k-steps per batch: 8 batches x 2 rows x 16 bytes = 256 bytes of W in flight per thread.
constexpr int kUnroll = 8;
constexpr int kBatchK = kStepK * kUnroll;  // 256 k per warp per batch

// W is streamed once: skip L1 (keeps A's lines there). A quad's load covers half of a 128-byte
// line and its next k-step the other half, so L2 is asked to fetch whole 128-byte lines: the
// second half then hits L2. Measured on the H200 (bench/results/2026-11-29d-h200.md), batch-1
// step: 8B 4.53 ms with 256-byte fetches, 4.34 with 128; 1B 0.99 and 0.97 ms. No hint, or 64
// bytes, was slower than either (8B 4.75-4.80 ms, on a variant of this loop).
__device__ __forceinline__ uint4 LoadStream(const __nv_bfloat16* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
// A is re-read by every CTA: the read-only path, cached in L1. `volatile` keeps it after
// griddepcontrol.wait (the previous kernel may be writing A until then).
__device__ __forceinline__ uint4 LoadCached(const __nv_bfloat16* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// d[16 x 8] += a[16 x 16] * b[16 x 8], bf16 in, fp32 accumulate. Fragments (g = lane / 4,
// t = lane % 4): a = {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)},
// b = {(k 2t..2t+1, col g), (k 2t+8.., col g)}, d = {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}.
__device__ __forceinline__ void Mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Starts copying norm_weight [k] into shared memory w_s (16 bytes per thread per step, bypassing
// registers); NormalizeA waits for it. Issued before griddepcontrol.wait, like the first W batch:
// no kernel of the step writes weights, and the copy takes a DRAM round trip off the prologue's
// critical path (the normalise pass used to load the weights only after two barriers).
__device__ __forceinline__ void StageNormWeight(const GemvParams& p, __nv_bfloat16* w_s) {
  for (int v = threadIdx.x; v < p.k / 8; v += kThreads) {
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(w_s + v * 8));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(p.norm_weight + v * 8)
                 : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// The rows of A the CTA multiplies, normalised into shared memory (LlamaRMSNorm, see the header).
// Row i lives at a_s[i * stride]; all threads take part (two __syncthreads). w_s: norm_weight
// staged by StageNormWeight, or nullptr to read it from global memory.
__device__ void NormalizeA(const GemvParams& p, __nv_bfloat16* a_s, int stride,
                           const __nv_bfloat16* w_s) {
  __shared__ float partial[kWarps][kGemvRegisterMaxM];
  __shared__ float inv_rms[kGemvRegisterMaxM];
  const int vecs = p.k / 8;
  float ss[kGemvRegisterMaxM];
#pragma unroll
  for (int i = 0; i < kGemvRegisterMaxM; ++i) ss[i] = 0.f;
#pragma unroll
  for (int i = 0; i < kGemvRegisterMaxM; ++i) {
    if (i >= p.m) break;
    for (int v = threadIdx.x; v < vecs; v += kThreads) {
      const Bf16x8 x = LoadBf16x8Coherent(p.a + static_cast<int64_t>(i) * p.k + v * 8);
      *reinterpret_cast<Bf16x8*>(a_s + i * stride + v * 8) = x;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float f = __bfloat162float(x.h[j]);
        ss[i] = fmaf(f, f, ss[i]);
      }
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int i = 0; i < kGemvRegisterMaxM; ++i) {
    const float s = WarpSum(ss[i]);
    if (lane == 0) partial[warp][i] = s;
  }
  // This thread's weight copies have landed; the barrier shows everyone's to the whole CTA.
  if (w_s != nullptr) asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
  if (threadIdx.x < kGemvRegisterMaxM) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += partial[w][threadIdx.x];
    inv_rms[threadIdx.x] = rsqrtf(s / p.k + p.norm_eps);
  }
  __syncthreads();
  for (int i = 0; i < p.m; ++i) {
    const float inv = inv_rms[i];
    for (int v = threadIdx.x; v < vecs; v += kThreads) {
      Bf16x8* x = reinterpret_cast<Bf16x8*>(a_s + i * stride + v * 8);
      const Bf16x8 w = w_s != nullptr ? *reinterpret_cast<const Bf16x8*>(w_s + v * 8)
                                      : LoadBf16x8(p.norm_weight + v * 8);
      Bf16x8 o;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        o.h[j] = __float2bfloat16_rn(
            RmsNormScale(__bfloat162float(x->h[j]), inv, __bfloat162float(w.h[j])));
      }
      *x = o;
    }
  }
  __syncthreads();
}

// Row stride of the normalised A in shared memory: k rounded so that consecutive rows start 64
// bytes apart modulo 128, so the two rows a quarter-warp reads with 16-byte loads hit disjoint
// banks.
__host__ __device__ __forceinline__ int NormStride(int k) {
  return k + ((32 - k % 64) + 64) % 64;
}

// Whether norm_weight is staged in shared memory behind A's rows: when both fit the opt-in size
// (every Llama-1B/8B decode shape; not the largest k that the normalised A alone allows).
__host__ __device__ __forceinline__ bool StagesNormWeight(int m, int k) {
  return (static_cast<int64_t>(m) * NormStride(k) + k) * 2 <= kGemvMaxNormSmemBytes;
}

// grid: (min(tiles, resident CTAs), split_k), block: 256; tiles = ceil(n / 16) (kSiluMul:
// ceil(n / 8)). CTA (x, s) computes tiles x, x + gridDim.x, ... over batch range s of K. A tile is
// 16 rows of W: output columns [16 t, 16 t + 16), or for kSiluMul 8 gate rows and their 8 up
// rows, output columns [8 t, 8 t + 8). Warp w takes batches w, w + 8, ... of the range. Looping
// over tiles (rather than one CTA per tile) normalises A once per CTA, not once per tile: at 8B
// gate_up that is 264 times instead of 3584.
//
// Thread (g, t) of a warp loads, per k-step j, 16 bytes of W row g, of W row g + 8 and of A row g
// at k = 32 j + 8 t. The MMA sums over k, so the k-order inside those 8 elements is free: the
// first two 4-byte words feed one MMA as its k {2t, 2t+1} and {2t+8, 2t+9}, the last two a second
// MMA, and W and A agree because both are indexed by t alone. Rows of W past n and rows of A past
// m are clamped to row 0 (loaded, never stored), which keeps the hot loop free of predicates.
//
// kWarpTiles: each warp owns whole tiles (tile = warp * gridDim.x + blockIdx.x, stepping by 8
// gridDim.x) and streams all of K itself, so no tile needs the CTA's barrier and shared-memory
// reduction: thread (g, t) holds the finished sums of W rows g and g + 8 for A rows 2t and 2t + 1
// and stores them directly. Chosen when tiles are plentiful (ChooseGemvWarpTiles; split_k = 1).
template <bool kWarpTiles>
__global__ void __launch_bounds__(kThreads, 2) GemvKernel(GemvParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* a_s = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [m][NormStride(k)]
  const int a_stride = NormStride(p.k);
  const bool norm = p.norm_weight != nullptr;
  // [k] norm_weight, right after A's rows (16-byte aligned: the stride is a multiple of 8).
  __nv_bfloat16* w_s = norm && StagesNormWeight(p.m, p.k) ? a_s + p.m * a_stride : nullptr;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t k = p.k;
  const bool swiglu = p.epilogue == GemvEpilogue::kSiluMul;
  const bool rope = p.epilogue == GemvEpilogue::kRopeKv;
  // kRopeKv: tiles per head, each 8 rows of the first half and the 8 rows head_dim / 2 further.
  const int32_t rope_tiles_per_head = rope ? p.rope.layout.head_dim / 16 : 1;
  const int32_t tile_cols = swiglu ? 8 : kGemvTileN;
  const int32_t tiles = (p.n + tile_cols - 1) / tile_cols;
  const int a_row_index = g < p.m ? g : 0;
  const __nv_bfloat16* a_row = p.a + a_row_index * k + t * 8;
  const __nv_bfloat16* a_row_s = a_s + a_row_index * a_stride + t * 8;

  const int32_t num_batches = (p.k + kBatchK - 1) / kBatchK;
  const int32_t split = blockIdx.y;
  const int32_t b_begin = split * num_batches / p.split_k;
  const int32_t b_end = (split + 1) * num_batches / p.split_k;

  // The W rows of tile `tile` this thread streams: 16 plain, 8 gate + the matching 8 up rows, or
  // 8 rows of a head's first half + their rotation partners (n is a multiple of 16 there).
  const __nv_bfloat16 *w_lo, *w_hi;
  auto set_tile = [&](int32_t tile) {
    int32_t lo_row, hi_row;
    if (rope) {
      const int32_t head = tile / rope_tiles_per_head;
      lo_row = head * p.rope.layout.head_dim + (tile % rope_tiles_per_head) * 8 + g;
      hi_row = lo_row + p.rope.layout.head_dim / 2;
    } else if (swiglu) {
      lo_row = tile * 8 + g;
      hi_row = lo_row < p.n ? p.n + lo_row : 0;
      if (lo_row >= p.n) lo_row = 0;
    } else {
      const int32_t row0 = tile * kGemvTileN;
      lo_row = row0 + g < p.n ? row0 + g : 0;
      hi_row = row0 + g + 8 < p.n ? row0 + g + 8 : 0;
    }
    w_lo = p.w + lo_row * k + t * 8;
    w_hi = p.w + hi_row * k + t * 8;
  };
  uint4 wl[kUnroll], wh[kUnroll];
  auto load_w = [&](int32_t b) {
    const int64_t off = static_cast<int64_t>(b) * kBatchK;
    if (off + kBatchK <= k) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        wl[u] = LoadStream(w_lo + off + u * kStepK);
        wh[u] = LoadStream(w_hi + off + u * kStepK);
      }
    } else {
      // Last batch of a row: 16-byte chunks past k read as zeros (and are never loaded).
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const bool in = off + u * kStepK + t * 8 < k;
        wl[u] = in ? LoadStream(w_lo + off + u * kStepK) : make_uint4(0, 0, 0, 0);
        wh[u] = in ? LoadStream(w_hi + off + u * kStepK) : make_uint4(0, 0, 0, 0);
      }
    }
  };

  const int32_t b_first = kWarpTiles ? b_begin : b_begin + warp;
  const int32_t b_step = kWarpTiles ? 1 : kWarps;
  const int32_t tile_step = kWarpTiles ? gridDim.x * kWarps : gridDim.x;
  // Warp tiles are dealt warp-major (warp w of every CTA before warp w + 1 of any), so that a grid
  // of all resident CTAs spreads them evenly over the SMs.
  int32_t tile = kWarpTiles ? warp * gridDim.x + blockIdx.x : blockIdx.x;
  set_tile(tile < tiles ? tile : 0);
  int32_t b = tile < tiles ? b_first : b_end;
  // The first batch of W is in flight across the wait (and the norm prologue).
  if (b < b_end) load_w(b);
  if (w_s != nullptr) StageNormWeight(p, w_s);
  // A (and C, in the epilogue) may still be written by the preceding kernel until here.
  GridDepWait();
  // Warp tiles end without a CTA-wide point; the trigger only lets the next kernel's CTAs launch
  // (they wait for our completion before reading anything).
  if constexpr (kWarpTiles) GridDepLaunchDependents();
  if (norm) NormalizeA(p, a_s, a_stride, w_s);

  __shared__ float red[kWarps][kGemvRegisterMaxM * kGemvTileN];
  for (; tile < tiles; tile += tile_step) {
    // Two accumulators (first and second half of each 16-byte load) halve the MMA dependency
    // chain.
    float acc0[4] = {0.f, 0.f, 0.f, 0.f};
    float acc1[4] = {0.f, 0.f, 0.f, 0.f};
    while (b < b_end) {
      const int64_t off = static_cast<int64_t>(b) * kBatchK;
      const bool full = off + kBatchK <= k;
      uint4 av[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const bool in = full || off + u * kStepK + t * 8 < k;
        if (!in) {
          av[u] = make_uint4(0, 0, 0, 0);
        } else if (norm) {
          av[u] = *reinterpret_cast<const uint4*>(a_row_s + off + u * kStepK);
        } else {
          av[u] = LoadCached(a_row + off + u * kStepK);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        Mma16816(acc0, wl[u].x, wh[u].x, wl[u].y, wh[u].y, av[u].x, av[u].y);
        Mma16816(acc1, wl[u].z, wh[u].z, wl[u].w, wh[u].w, av[u].z, av[u].w);
      }
      b += b_step;
      if (b < b_end) load_w(b);
    }
    // The next tile's first batch streams while this one is reduced and stored.
    const int32_t cur = tile;
    if (tile + tile_step < tiles) {
      set_tile(tile + tile_step);
      b = b_first;
      if (b < b_end) load_w(b);
    } else if constexpr (!kWarpTiles) {
      // Our W reads are issued: the next kernel may start its own prologue.
      GridDepLaunchDependents();
    }
    if constexpr (kWarpTiles) {
      // d layout: {(row g, A row 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)}.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * t + h;
        const float lo = acc0[h] + acc1[h], hi = acc0[2 + h] + acc1[2 + h];
        if (i >= p.m) continue;
        if (swiglu) {
          const int32_t col = cur * 8 + g;
          if (col < p.n) {
            p.c[static_cast<int64_t>(i) * p.n + col] =
                __float2bfloat16_rn(SiluMul(RoundBf16(lo), RoundBf16(hi)));
          }
        } else if (rope) {
          RopeEpilogue(p, i, cur / rope_tiles_per_head, (cur % rope_tiles_per_head) * 8 + g, lo,
                       hi);
        } else {
          const int32_t col = cur * kGemvTileN + g;
          if (col < p.n) StoreOutput(p, static_cast<int64_t>(i) * p.n + col, lo);
          if (col + 8 < p.n) StoreOutput(p, static_cast<int64_t>(i) * p.n + col + 8, hi);
        }
      }
      continue;
    }

    // Fixed-order sum over the 8 warps. red[warp][i * 16 + r] = partial of row r of the tile.
    red[warp][(2 * t) * kGemvTileN + g] = acc0[0] + acc1[0];
    red[warp][(2 * t + 1) * kGemvTileN + g] = acc0[1] + acc1[1];
    red[warp][(2 * t) * kGemvTileN + g + 8] = acc0[2] + acc1[2];
    red[warp][(2 * t + 1) * kGemvTileN + g + 8] = acc0[3] + acc1[3];
    __syncthreads();
    const int i = threadIdx.x / kGemvTileN, r = threadIdx.x % kGemvTileN;
    if (threadIdx.x < kGemvRegisterMaxM * kGemvTileN && i < p.m) {
      if (swiglu) {
        const int32_t col = cur * 8 + r;
        if (r < 8 && col < p.n) {
          float gate = 0.f, up = 0.f;
#pragma unroll
          for (int w = 0; w < kWarps; ++w) {
            gate += red[w][threadIdx.x];
            up += red[w][threadIdx.x + 8];
          }
          // gate_proj and up_proj each round their output to bf16 first.
          p.c[static_cast<int64_t>(i) * p.n + col] =
              __float2bfloat16_rn(SiluMul(RoundBf16(gate), RoundBf16(up)));
        }
      } else if (rope) {
        if (r < 8) {
          float x1 = 0.f, x2 = 0.f;
#pragma unroll
          for (int w = 0; w < kWarps; ++w) {
            x1 += red[w][threadIdx.x];
            x2 += red[w][threadIdx.x + 8];
          }
          RopeEpilogue(p, i, cur / rope_tiles_per_head, (cur % rope_tiles_per_head) * 8 + r, x1,
                       x2);
        }
      } else {
        const int32_t col = cur * kGemvTileN + r;
        if (col < p.n) {
          float v = 0.f;
#pragma unroll
          for (int w = 0; w < kWarps; ++w) v += red[w][threadIdx.x];
          if (p.split_k > 1) {
            p.workspace[(static_cast<int64_t>(split) * p.m + i) * p.n + col] = v;
          } else {
            StoreOutput(p, static_cast<int64_t>(i) * p.n + col, v);
          }
        }
      }
    }
    __syncthreads();  // red is rewritten by the next tile
  }
}

// grid: ceil(m * n / 256). Adds the split_k partials of one element in split order.
__global__ void __launch_bounds__(256) GemvSplitReduceKernel(GemvParams p) {
  GridDepWait();  // the partials come from the kernel just before
  const int64_t total = static_cast<int64_t>(p.m) * p.n;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (e >= total) return;
  float v = 0.f;
  for (int32_t s = 0; s < p.split_k; ++s) v += p.workspace[s * total + e];
  StoreOutput(p, e, v);
}

absl::Status ValidateRope(const GemvParams& p) {
  const GemvRopeKv& r = p.rope;
  const KvLayout& l = r.layout;
  if (p.c == nullptr || (p.m <= kGemvRegisterMaxM && p.split_k != 1)) {
    return absl::InvalidArgumentError(
        "gemv.epilogue kRopeKv needs a bf16 c, and split_k = 1 at m <= 8");
  }
  TS_RETURN_IF_ERROR(ValidateRopeKvTargets("gemv.rope", l, r.num_q_heads, r.positions,
                                           r.slot_mapping, r.inv_freq, r.k_cache, r.v_cache,
                                           r.error_flag));
  TS_RETURN_IF_ERROR(RequireMultipleOf("gemv.rope.layout.head_dim", l.head_dim, 16));
  const int64_t want = (int64_t{r.num_q_heads} + 2 * int64_t{l.num_kv_heads}) * l.head_dim;
  if (p.n != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gemv.n must be (rope.num_q_heads + 2 rope.layout.num_kv_heads) * head_dim = ", want,
        " for kRopeKv, got ", p.n));
  }
  return absl::OkStatus();
}

absl::Status Validate(const GemvParams& p) {
  if (p.m < 1 || p.m > kGemvMaxM) {
    return absl::InvalidArgumentError(
        absl::StrCat("gemv.m must be in [1, ", kGemvMaxM, "] (use Gemm above), got ", p.m));
  }
  TS_RETURN_IF_ERROR(RequirePositive("gemv.n", p.n));
  TS_RETURN_IF_ERROR(RequireMultipleOf("gemv.k", p.k, 8));
  TS_RETURN_IF_ERROR(RequirePointer("gemv.a", p.a, 16));
  TS_RETURN_IF_ERROR(RequirePointer("gemv.w", p.w, 16));
  if ((p.c == nullptr) == (p.c_f32 == nullptr)) {
    return absl::InvalidArgumentError("gemv.c: set exactly one of c (bf16) and c_f32 (fp32)");
  }
  if (p.c != nullptr) TS_RETURN_IF_ERROR(RequirePointer("gemv.c", p.c, alignof(__nv_bfloat16)));
  if (p.c_f32 != nullptr) TS_RETURN_IF_ERROR(RequirePointer("gemv.c_f32", p.c_f32, alignof(float)));
  if (p.split_k < 1 || p.split_k > kGemvMaxSplitK) {
    return absl::InvalidArgumentError(
        absl::StrCat("gemv.split_k must be in [1, ", kGemvMaxSplitK, "], got ", p.split_k));
  }
  if (p.epilogue != GemvEpilogue::kStore && p.epilogue != GemvEpilogue::kAccumulate &&
      p.epilogue != GemvEpilogue::kSiluMul && p.epilogue != GemvEpilogue::kRopeKv) {
    return absl::InvalidArgumentError("gemv.epilogue is not a GemvEpilogue");
  }
  if (p.epilogue == GemvEpilogue::kRopeKv) TS_RETURN_IF_ERROR(ValidateRope(p));
  if (p.warp_tiles != GemvWarpTiles::kAuto && p.warp_tiles != GemvWarpTiles::kNever &&
      p.warp_tiles != GemvWarpTiles::kAlways) {
    return absl::InvalidArgumentError("gemv.warp_tiles is not a GemvWarpTiles");
  }
  if (p.warp_tiles == GemvWarpTiles::kAlways && p.split_k != 1) {
    return absl::InvalidArgumentError("gemv.warp_tiles kAlways needs split_k = 1");
  }
  if (p.epilogue == GemvEpilogue::kSiluMul &&
      (p.c == nullptr || (p.m <= kGemvRegisterMaxM && p.split_k != 1))) {
    return absl::InvalidArgumentError(
        "gemv.epilogue kSiluMul needs a bf16 c, and split_k = 1 at m <= 8");
  }
  const bool tc = p.m > kGemvRegisterMaxM;
  if (p.a_sumsq != nullptr) {
    TS_RETURN_IF_ERROR(RequirePointer("gemv.a_sumsq", p.a_sumsq, alignof(float)));
    if (!tc || p.norm_weight == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("gemv.a_sumsq needs m > ", kGemvRegisterMaxM, " and norm_weight"));
    }
  }
  if (p.sumsq_out != nullptr) {
    TS_RETURN_IF_ERROR(RequirePointer("gemv.sumsq_out", p.sumsq_out, alignof(float)));
    if (!tc || p.c == nullptr ||
        (p.epilogue != GemvEpilogue::kStore && p.epilogue != GemvEpilogue::kAccumulate)) {
      return absl::InvalidArgumentError(absl::StrCat("gemv.sumsq_out needs m > ", kGemvRegisterMaxM,
                                                     ", a bf16 c and kStore or kAccumulate"));
    }
  }
  if (p.norm_weight != nullptr) {
    TS_RETURN_IF_ERROR(RequirePointer("gemv.norm_weight", p.norm_weight, 16));
    if (tc && p.a_sumsq == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("gemv.norm_weight at m > ", kGemvRegisterMaxM,
                       " needs a_sumsq (or normalise with rmsnorm), got m = ", p.m));
    }
    if (!tc && !GemvCanFuseNorm(p.m, p.k)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gemv.norm_weight: m = ", p.m, ", k = ", p.k, " needs more than ", kGemvMaxNormSmemBytes,
          " bytes of shared memory; normalise with rmsnorm instead"));
    }
    if (!tc && p.split_k != 1) {
      return absl::InvalidArgumentError("gemv.norm_weight needs split_k = 1 at m <= 8");
    }
    if (!(p.norm_eps > 0.0f)) {
      return absl::InvalidArgumentError(
          absl::StrCat("gemv.norm_eps must be > 0, got ", p.norm_eps));
    }
  }
  if (p.split_k > 1 && p.m <= kGemvRegisterMaxM) {
    TS_RETURN_IF_ERROR(RequirePointer("gemv.workspace", p.workspace, alignof(float)));
    const size_t need = GemvWorkspaceBytes(p.m, p.n, p.split_k);
    if (p.workspace_bytes < need) {
      return absl::InvalidArgumentError(absl::StrCat("gemv.workspace_bytes is ", p.workspace_bytes,
                                                     ", split_k = ", p.split_k, " needs ", need));
    }
  }
  return absl::OkStatus();
}

size_t NormSmemBytes(int32_t m, int32_t k) {
  return static_cast<size_t>(m) * static_cast<size_t>(NormStride(k)) * sizeof(__nv_bfloat16);
}

absl::Status Launch(void (*kernel)(GemvParams), dim3 grid, const GemvParams& p, size_t smem,
                    cudaStream_t stream) {
  TS_CUDA_RETURN_IF_ERROR(LaunchWithPdl(kernel, grid, dim3(kThreads), smem, stream, p.pdl, p));
  return absl::OkStatus();
}

}  // namespace

bool GemvCanFuseNorm(int32_t m, int32_t k) {
  return m >= 1 && m <= kGemvRegisterMaxM && k >= 8 && k % 8 == 0 &&
         NormSmemBytes(m, k) <= static_cast<size_t>(kGemvMaxNormSmemBytes);
}

bool GemvNormProloguePays(int32_t m, int32_t k) {
  return GemvCanFuseNorm(m, k) && int64_t{m} * k <= kGemvNormPrologueMaxElems;
}

absl::Status LaunchGemv(const GemvParams& p, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(Validate(p));
  if (p.m > kGemvRegisterMaxM) return gemv_internal::LaunchGemvTc(p, stream);
  const size_t smem =
      p.norm_weight == nullptr
          ? 0
          : NormSmemBytes(p.m, p.k) + (StagesNormWeight(p.m, p.k) ? size_t{2} * p.k : 0);
  if (smem > 48 * 1024) {
    // Opt in beyond the default 48 KB on the current device (a function attribute, not a stream
    // operation: legal while a graph is being captured).
    for (auto* kernel : {GemvKernel<false>, GemvKernel<true>}) {
      TS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kGemvMaxNormSmemBytes));
    }
  }
  const int32_t tile = p.epilogue == GemvEpilogue::kSiluMul ? 8 : kGemvTileN;
  const int32_t tiles = (p.n + tile - 1) / tile;
  // No more CTAs than fit at once (each loops over tiles); host queries only, capture-safe.
  int device = 0, sms = 0, per_sm = 0;
  TS_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  TS_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  TS_CUDA_RETURN_IF_ERROR(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, GemvKernel<false>, kThreads, smem));
  const int32_t resident = std::max(1, sms * per_sm);
  const bool warp_tiles =
      p.split_k == 1 &&
      (p.warp_tiles == GemvWarpTiles::kAlways ||
       (p.warp_tiles == GemvWarpTiles::kAuto && ChooseGemvWarpTiles(tiles, resident)));
  if (warp_tiles) {
    // Every resident CTA, each with a share of the tiles: 8B's gate_up (1792 tiles) in 224 CTAs of
    // 8 busy warps left 40 of the 264 CTA slots empty, and its SMs with two CTAs set the time.
    const int32_t ctas = std::min(resident, tiles);
    return Launch(GemvKernel<true>, dim3(ctas), p, smem, stream);
  }
  const dim3 grid(std::min(tiles, resident), p.split_k);
  TS_RETURN_IF_ERROR(Launch(GemvKernel<false>, grid, p, smem, stream));
  if (p.split_k > 1) {
    const int64_t total = static_cast<int64_t>(p.m) * p.n;
    TS_RETURN_IF_ERROR(Launch(GemvSplitReduceKernel,
                              dim3(static_cast<uint32_t>((total + 255) / 256)), p, 0, stream));
  }
  return absl::OkStatus();
}

bool ChooseGemvWarpTiles(int32_t tiles, int32_t resident_ctas) {
  return tiles >= 1 && resident_ctas >= 1 &&
         int64_t{tiles} * 4 >= int64_t{resident_ctas} * kWarps * 3;
}

int32_t ChooseGemvSplitK(int32_t m, int32_t n, int32_t k, int32_t num_sms, GemvEpilogue epilogue) {
  if (m > kGemvRegisterMaxM) return gemv_internal::ChooseGemvTcSplitK(m, n, k, num_sms, epilogue);
  if (m < 1 || n < 1 || k < 8 || num_sms < 1) return 1;
  const int64_t ctas = (static_cast<int64_t>(n) + kGemvTileN - 1) / kGemvTileN;
  // 8 warps x 8 KB in flight per CTA: half the SMs busy already stream near the roof.
  if (2 * ctas > num_sms) return 1;
  if (static_cast<int64_t>(n) * k * 2 < (int64_t{8} << 20)) return 1;
  const int64_t want = (num_sms + ctas - 1) / ctas;  // about one full wave
  const int64_t most = k / (kWarps * kBatchK);       // every warp keeps >= one batch
  return static_cast<int32_t>(
      std::max<int64_t>(1, std::min<int64_t>({want, most, int64_t{kGemvMaxSplitK}})));
}

size_t GemvWorkspaceBytes(int32_t m, int32_t n, int32_t split_k) {
  if (split_k <= 1 || m < 1 || n < 1 || m > kGemvRegisterMaxM) return 0;
  return static_cast<size_t>(split_k) * m * n * sizeof(float);
}

}  // namespace ts::kernels
