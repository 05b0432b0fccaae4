#include "kernels/skinny_gemm.cuh"

#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/bf16_vec.cuh"
#include "kernels/cuda_check.h"
#include "kernels/pdl.cuh"
#include "kernels/ptx.cuh"

namespace ts::kernels {
namespace {

namespace cg = cooperative_groups;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kWarpRows = 32;                        // W rows per warp: two 16-row MMA tiles
constexpr int kTileRows = kWarps * kWarpRows;        // 256 W rows per CTA
constexpr int kBk = 64;                              // k per pipeline stage
constexpr int kRowBytes = kBk * 2;                   // 128: one stage row, 8 chunks of 16 bytes
constexpr int kWStageBytes = kTileRows * kRowBytes;  // 32 KB
constexpr int kAStageBytes = kSkinnyGemmMaxM * kRowBytes;  // 16 KB
constexpr int kStageBytes = kWStageBytes + kAStageBytes;   // 48 KB
constexpr int kStages = 4;                                 // 3 stages in flight while one is read
constexpr int kRingBytes = kStages * kStageBytes;          // 192 KB
constexpr int kMaxPairs = kSkinnyGemmMaxM / 16;            // 16-row pairs of 8-row MMA n-tiles
constexpr int kMaxNt = 2 * kMaxPairs;                      // 16 n-tiles of 8 A rows
// Largest receive area of the cluster reduction: ceil(8 / s) * s slots of 2 * 16 * 32 float4,
// worst at split_k = 7 (2 * 7 * 16 KB).
constexpr int kMaxSmemBytes = 2 * 7 * 2 * kMaxNt * 32 * 16;
static_assert(kTileRows == kSkinnyGemmTileN && kTileRows / 2 == kSkinnyGemmSiluTileN);
static_assert(kMaxSmemBytes >= kRingBytes && kMaxSmemBytes <= 227 * 1024);

// ---- PTX wrappers ----

// No L2 eviction hint on W's copies: with one (createpolicy evict_first + cp.async
// .L2::cache_hint), ptxas 13.0 emitted no CREATEPOLICY and gave the copies a descriptor register
// nothing wrote; the H200 raised "illegal instruction" at the first W copy (compute-sanitizer,
// SASS LDGSTS ... desc[UR1]). A, which every CTA re-reads, is small enough to stay in L2 anyway.

// d[16 x 8] += a[16 x 16] * b[16 x 8], bf16 in, fp32 accumulate (PTX ISA, mma.m16n8k16 .bf16).
// With g = lane / 4, t = lane % 4, each lane holds
//   a: a0 = (row g, k 2t..2t+1), a1 = (row g + 8, k 2t..), a2 = (row g, k 2t+8..),
//      a3 = (row g + 8, k 2t+8..);
//   b: b0 = (k 2t..2t+1, col g), b1 = (k 2t+8..2t+9, col g);
//   d: d0 = (row g, col 2t), d1 = (row g, col 2t+1), d2 = (row g + 8, col 2t),
//      d3 = (row g + 8, col 2t+1).
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- Shared-memory layout of a stage ----
// Row r (W: 0..255, A: 0..127 after the W part) is 128 bytes = 8 chunks of 16 bytes (8 k each).
// Logical chunk c of row r sits at physical chunk c ^ (r % 8). Both access patterns touch 8
// consecutive rows (r0 = 0 mod 8) at one logical chunk per 8 lanes (cp.async: 8 lanes cover the
// 8 chunks of one row, so they already differ), and c ^ (r % 8) then visits all 8 physical chunks
// = all 32 banks: no conflicts.
__device__ __forceinline__ uint32_t Swizzle(int row, int chunk) {
  return static_cast<uint32_t>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
}

// ---- Epilogue ----

// kStore / kAccumulate of element e = i * n + col.
__device__ __forceinline__ void StoreOutput(const SkinnyGemmParams& p, int64_t e, float v) {
  const bool acc = p.epilogue == SkinnyGemmEpilogue::kAccumulate;
  if (p.c_f32 != nullptr) {
    if (acc) v += p.c_f32[e];
    p.c_f32[e] = v;
  } else {
    // A bf16 Linear rounds its output, then the residual add rounds the sum.
    if (acc) v = RoundBf16(v) + __bfloat162float(p.c[e]);
    p.c[e] = __float2bfloat16_rn(v);
  }
}

// Stores the finished sums of n-tile `nt` of warp `warp`'s rows, as lane (g, t) holds them: lo is
// the first 16-row MMA tile (local W rows 32 warp + g and + 8), hi the second (+ 16), each
// {(row, A row 8 nt + 2t), (row, +1), (row + 8, 2t), (row + 8, +1)} (the d layout). For kSiluMul
// the first tile is 16 gate rows and the second their 16 up rows, so lo[r] and hi[r] are the gate
// and up of one output.
__device__ __forceinline__ void StoreFragment(const SkinnyGemmParams& p, int32_t tile, int warp,
                                              int g, int t, int nt, const float (&lo)[4],
                                              const float (&hi)[4]) {
  const bool swiglu = p.epilogue == SkinnyGemmEpilogue::kSiluMul;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int i = 8 * nt + 2 * t + (r & 1);
    if (i >= p.m) continue;
    const int dr = g + 8 * (r >> 1);
    const int64_t row = static_cast<int64_t>(i) * p.n;
    if (swiglu) {
      const int32_t col = tile * kSkinnyGemmSiluTileN + 16 * warp + dr;
      // gate_proj and up_proj each round their output to bf16 first.
      if (col < p.n)
        p.c[row + col] = __float2bfloat16_rn(SiluMul(RoundBf16(lo[r]), RoundBf16(hi[r])));
    } else {
      const int32_t col = tile * kTileRows + kWarpRows * warp + dr;
      if (col < p.n) StoreOutput(p, row + col, lo[r]);
      if (col + 16 < p.n) StoreOutput(p, row + col + 16, hi[r]);
    }
  }
}

__device__ __forceinline__ void AddTo(float (&v)[4], const float4& x) {
  v[0] += x.x;
  v[1] += x.y;
  v[2] += x.z;
  v[3] += x.w;
}

// Split-K: the cluster's fixed-order reduction of every warp's accumulators, then the epilogue.
// Receive slots in each owner CTA's shared memory (the ring, free once every CTA of the cluster
// has left its main loop): [owned block j][source rank s][mt][nt < nt_active][lane] float4, where
// block j of owner o holds warp j * split_k + o's rows. A warp's store of one (mt, nt) is 32
// lanes x 16 contiguous bytes (coalesced, as distributed shared memory wants).
__device__ __forceinline__ void ClusterReduce(const SkinnyGemmParams& p,
                                              const float (&acc)[2][kMaxNt][4], int nt_active,
                                              unsigned char* smem) {
  cg::cluster_group cluster = cg::this_cluster();
  const int s_count = p.split_k;
  const int rank = static_cast<int>(cluster.block_rank());  // = blockIdx.y, the split
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int slot = 2 * nt_active * 32;  // float4s per (block, source)
  // Every CTA has finished reading its ring (and has started: DSMEM needs both).
  cluster.sync();
  {
    const int owner = warp % s_count, j = warp / s_count;
    float4* dst = cluster.map_shared_rank(reinterpret_cast<float4*>(smem), owner) +
                  (j * s_count + rank) * slot + lane;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kMaxNt; ++nt) {
        if (nt < nt_active) {
          dst[(mt * nt_active + nt) * 32] =
              make_float4(acc[mt][nt][0], acc[mt][nt][1], acc[mt][nt][2], acc[mt][nt][3]);
        }
      }
    }
  }
  // The stores are visible (release / acquire at cluster scope) and nobody touches another CTA's
  // shared memory after this point, so CTAs may exit as soon as they are done below.
  cluster.sync();
  const float4* recv = reinterpret_cast<const float4*>(smem);
  const int owned = (kWarps - rank + s_count - 1) / s_count;  // warps w = rank (mod split_k)
  const int per_block = nt_active * 32;
  for (int q = threadIdx.x; q < owned * per_block; q += kThreads) {
    const int j = q / per_block, e = q % per_block;
    const int nt = e / 32, l = e % 32;
    const float4* src = recv + j * s_count * slot + nt * 32 + l;
    float lo[4] = {0.f, 0.f, 0.f, 0.f}, hi[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s = 0; s < s_count; ++s) {  // rank order: the same sum on every run
      AddTo(lo, src[s * slot]);
      AddTo(hi, src[s * slot + nt_active * 32]);
    }
    StoreFragment(p, blockIdx.x, j * s_count + rank, l >> 2, l & 3, nt, lo, hi);
  }
}

// grid: (tiles, split_k), cluster (1, split_k, 1) when split_k > 1; block 256; dynamic shared
// memory SkinnyGemmSmemBytes(m, split_k). CTA (tile, s) computes W rows of tile `tile` against all
// of A over K tiles [s T / split_k, (s + 1) T / split_k), T = ceil(k / 64).
//
// Loader: thread tid copies chunk c = tid % 8 (k 8c..8c+7 of the stage) of stage rows
// lrow + 32 j, lrow = tid / 8: W rows j = 0..7, A rows j = 0..3 (only rows < 16 ceil(m / 16)).
// Local W row r maps to a row of W: kStore/kAccumulate 256 tile + r; kSiluMul warp block
// wb = r / 32 holds gate rows 128 tile + 16 wb + (r % 32) for r % 32 < 16 and the matching up
// rows n + 128 tile + 16 wb + (r % 32 - 16) above, so each warp's two MMA tiles are 16 gate rows
// and their 16 up rows (the epilogue needs no exchange).
//
// Fragments, per k16 step kk of a stage (logical chunks 2kk, 2kk + 1):
// - W (the MMA's a, 16 x 16 row-major): ldmatrix.x4 with lane l addressing W row
//   32 warp + 16 mt + (l % 16), chunk 2kk + l / 16. Matrices: 0 = rows 0-7 k 0-7, 1 = rows 8-15
//   k 0-7, 2 = rows 0-7 k 8-15, 3 = rows 8-15 k 8-15, so registers 0..3 are exactly a0..a3.
// - A (the MMA's b, k x n "col" = A row-major [n][k]): ldmatrix.x4 with lane l addressing A row
//   16 pair + (l % 8) + 8 (l / 16), chunk 2kk + (l / 8) % 2. Matrices: 0 = A rows 0-7 k 0-7
//   (lane (g, t) gets A row g, k 2t..2t+1 = b0 of n-tile 2 pair), 1 = rows 0-7 k 8-15 (its b1),
//   2 and 3 the same for rows 8-15 (n-tile 2 pair + 1).
// Every fragment row is = lane (mod 8), so the swizzle term is lane % 8 throughout.
__global__ void __launch_bounds__(kThreads, 1) SkinnyGemmKernel(SkinnyGemmParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t smem_base = ptx::SharedAddress(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool swiglu = p.epilogue == SkinnyGemmEpilogue::kSiluMul;
  const int32_t tile = blockIdx.x;
  const int64_t k = p.k;
  const int pairs = (p.m + 15) / 16;
  const int32_t k_tiles = (p.k + kBk - 1) / kBk;
  const int32_t kt_begin = static_cast<int32_t>(int64_t{blockIdx.y} * k_tiles / p.split_k);
  const int32_t kt_end = static_cast<int32_t>(int64_t{blockIdx.y + 1} * k_tiles / p.split_k);
  const int32_t tiles_here = kt_end - kt_begin;

  // ---- Loader geometry ----
  const int c = tid & 7, lrow = tid >> 3;
  int64_t w_row0, w_row_step;
  int32_t w_rows;  // how many of this thread's 8 W rows exist (the rest are zero-filled)
  if (swiglu) {
    const int32_t col0 = tile * kSkinnyGemmSiluTileN + (lrow & 15);
    w_row0 = (lrow < 16 ? 0 : int64_t{p.n}) + col0;
    w_row_step = 16;
    w_rows = col0 < p.n ? (p.n - col0 + 15) / 16 : 0;  // j < w_rows: col0 + 16 j < n
  } else {
    const int32_t row0 = tile * kTileRows + lrow;
    w_row0 = row0;
    w_row_step = kWarpRows;
    w_rows = row0 < p.n ? (p.n - row0 + 31) / 32 : 0;  // j < w_rows: row0 + 32 j < n
  }
  const __nv_bfloat16* w_src = p.w + w_row0 * k + c * 8;
  const int64_t w_src_step = w_row_step * k;
  const __nv_bfloat16* a_src = p.a + lrow * k + c * 8;
  const uint32_t ld_off = Swizzle(lrow, c);  // rows lrow + 32 j share lrow's swizzle

  auto load_w = [&](int32_t kt, int stage) {
    const int64_t kc = static_cast<int64_t>(kt) * kBk;
    const bool k_in = kc + c * 8 < k;
    const uint32_t dst = smem_base + stage * kStageBytes + ld_off;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const bool in = k_in && j < w_rows;
      ptx::CpAsync16(dst + j * 32 * kRowBytes, in ? w_src + j * w_src_step + kc : p.w, in ? 16 : 0);
    }
  };
  auto load_a = [&](int32_t kt, int stage) {
    const int64_t kc = static_cast<int64_t>(kt) * kBk;
    const bool k_in = kc + c * 8 < k;
    const uint32_t dst = smem_base + stage * kStageBytes + kWStageBytes + ld_off;
#pragma unroll
    for (int j = 0; j < kSkinnyGemmMaxM / 32; ++j) {
      const int row = lrow + 32 * j;
      if (row >= pairs * 16) break;  // never read
      const bool in = k_in && row < p.m;
      ptx::CpAsync16(dst + j * 32 * kRowBytes, in ? a_src + j * 32 * k + kc : p.a, in ? 16 : 0);
    }
  };

  // ---- Prologue: stages 0..2. W before the PDL wait, A after; group s = {stage s's A} plus,
  // for group 0, all three stages' W, so "group s done" still means "stage s landed". ----
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < tiles_here) load_w(kt_begin + s, s);
  }
  GridDepWait();  // A (and C, in the epilogue) may still be written by the preceding kernel
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < tiles_here) load_a(kt_begin + s, s);
    ptx::CpAsyncCommit();
  }

  float acc[2][kMaxNt][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int nt = 0; nt < kMaxNt; ++nt) {
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mt][nt][r] = 0.f;
    }
  }
  const uint32_t w_frag = (warp * kWarpRows + (lane & 15)) * kRowBytes;
  const int w_chunk_hi = lane >> 4;
  const uint32_t a_frag = kWStageBytes + ((lane & 7) + ((lane >> 4) << 3)) * kRowBytes;
  const int a_chunk_hi = (lane >> 3) & 1;
  const int sw = lane & 7;

  for (int it = 0; it < tiles_here; ++it) {
    // Stage `it` has landed for this thread; the barrier makes every thread's copies visible and
    // proves every warp is done reading stage it - 1, whose slot the next copies reuse.
    ptx::CpAsyncWait<kStages - 2>();
    __syncthreads();
    const int next = it + kStages - 1;
    if (next < tiles_here) {
      load_w(kt_begin + next, next % kStages);
      load_a(kt_begin + next, next % kStages);
    }
    ptx::CpAsyncCommit();  // possibly empty: keeps one group per iteration for the wait above

    const uint32_t stage = smem_base + (it % kStages) * kStageBytes;
#pragma unroll
    for (int kk = 0; kk < kBk / 16; ++kk) {
      uint32_t wf[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        ptx::LdMatrixX4(wf[mt],
                        stage + w_frag + mt * 16 * kRowBytes + (((2 * kk + w_chunk_hi) ^ sw) << 4));
      }
      // All of this step's A fragments first, then the MMAs: the loads' latency overlaps.
      uint32_t af[kMaxPairs][4];
#pragma unroll
      for (int pr = 0; pr < kMaxPairs; ++pr) {
        if (pr < pairs) {
          ptx::LdMatrixX4(
              af[pr], stage + a_frag + pr * 16 * kRowBytes + (((2 * kk + a_chunk_hi) ^ sw) << 4));
        }
      }
#pragma unroll
      for (int pr = 0; pr < kMaxPairs; ++pr) {
        if (pr < pairs) {
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            Mma16816(acc[mt][2 * pr], wf[mt], af[pr][0], af[pr][1]);
            Mma16816(acc[mt][2 * pr + 1], wf[mt], af[pr][2], af[pr][3]);
          }
        }
      }
    }
  }
  ptx::CpAsyncWait<0>();  // only empty groups can be left; the ring is reused below
  // Our W reads are all issued: the next kernel may launch (it waits for our completion before it
  // reads anything we write).
  GridDepLaunchDependents();

  const int nt_active = 2 * pairs;
  if (p.split_k > 1) {
    ClusterReduce(p, acc, nt_active, smem);
    return;
  }
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < kMaxNt; ++nt) {
    if (nt < nt_active) StoreFragment(p, tile, warp, g, t, nt, acc[0][nt], acc[1][nt]);
  }
}

absl::Status Validate(const SkinnyGemmParams& p) {
  if (p.m < 1 || p.m > kSkinnyGemmMaxM) {
    return absl::InvalidArgumentError(
        absl::StrCat("skinny_gemm.m must be in [1, ", kSkinnyGemmMaxM, "], got ", p.m));
  }
  TS_RETURN_IF_ERROR(RequirePositive("skinny_gemm.n", p.n));
  TS_RETURN_IF_ERROR(RequireMultipleOf("skinny_gemm.k", p.k, 8));
  TS_RETURN_IF_ERROR(RequirePointer("skinny_gemm.a", p.a, 16));
  TS_RETURN_IF_ERROR(RequirePointer("skinny_gemm.w", p.w, 16));
  if ((p.c == nullptr) == (p.c_f32 == nullptr)) {
    return absl::InvalidArgumentError(
        "skinny_gemm.c: set exactly one of c (bf16) and c_f32 (fp32)");
  }
  if (p.c != nullptr) {
    TS_RETURN_IF_ERROR(RequirePointer("skinny_gemm.c", p.c, alignof(__nv_bfloat16)));
  }
  if (p.c_f32 != nullptr) {
    TS_RETURN_IF_ERROR(RequirePointer("skinny_gemm.c_f32", p.c_f32, alignof(float)));
  }
  if (p.split_k < 1 || p.split_k > kSkinnyGemmMaxSplitK) {
    return absl::InvalidArgumentError(absl::StrCat("skinny_gemm.split_k must be in [1, ",
                                                   kSkinnyGemmMaxSplitK, "], got ", p.split_k));
  }
  if (p.epilogue != SkinnyGemmEpilogue::kStore && p.epilogue != SkinnyGemmEpilogue::kAccumulate &&
      p.epilogue != SkinnyGemmEpilogue::kSiluMul) {
    return absl::InvalidArgumentError("skinny_gemm.epilogue is not a SkinnyGemmEpilogue");
  }
  if (p.epilogue == SkinnyGemmEpilogue::kSiluMul && p.c == nullptr) {
    return absl::InvalidArgumentError("skinny_gemm.epilogue kSiluMul needs a bf16 c");
  }
  return absl::OkStatus();
}

}  // namespace

int32_t SkinnyGemmTiles(int32_t n, SkinnyGemmEpilogue epilogue) {
  const int32_t cols =
      epilogue == SkinnyGemmEpilogue::kSiluMul ? kSkinnyGemmSiluTileN : kSkinnyGemmTileN;
  return n < 1 ? 0 : (n + cols - 1) / cols;
}

size_t SkinnyGemmSmemBytes(int32_t m, int32_t split_k) {
  if (split_k <= 1) return kRingBytes;
  const size_t nt_active = 2 * static_cast<size_t>((std::clamp(m, 1, kSkinnyGemmMaxM) + 15) / 16);
  const size_t s = static_cast<size_t>(std::min(split_k, kSkinnyGemmMaxSplitK));
  const size_t blocks = (kWarps + s - 1) / s;  // the most warps one owner receives
  return std::max<size_t>(kRingBytes, blocks * s * 2 * nt_active * 32 * sizeof(float4));
}

int32_t ChooseSkinnyGemmSplitK(int32_t m, int32_t n, int32_t k, SkinnyGemmEpilogue epilogue,
                               int32_t num_sms) {
  if (m < 1 || n < 1 || k < 8 || num_sms < 1) return 1;
  const int32_t tiles = SkinnyGemmTiles(n, epilogue);
  const int32_t k_tiles = (k + kBk - 1) / kBk;
  // One wave of one CTA per SM; every split keeps >= 4 K tiles (the ring's depth).
  const int32_t split = std::min({num_sms / tiles, kSkinnyGemmMaxSplitK, k_tiles / 4});
  return std::max(1, split);
}

absl::Status SkinnyGemmResidentClusters(int32_t m, int32_t split_k, int32_t* clusters) {
  if (split_k < 1 || split_k > kSkinnyGemmMaxSplitK) {
    return absl::InvalidArgumentError(
        absl::StrCat("skinny_gemm.split_k must be in [1, ", kSkinnyGemmMaxSplitK, "]"));
  }
  TS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      SkinnyGemmKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmemBytes));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(1, split_k);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = SkinnyGemmSmemBytes(m, split_k);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = static_cast<unsigned>(split_k);
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int count = 0;
  TS_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveClusters(&count, SkinnyGemmKernel, &cfg));
  *clusters = count;
  return absl::OkStatus();
}

absl::Status LaunchSkinnyGemm(const SkinnyGemmParams& p, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(Validate(p));
  // Beyond the default 48 KB; a function attribute, not a stream operation (legal while a graph
  // is captured). Always the largest size, so a later launch never lowers it under a graph node.
  TS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      SkinnyGemmKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmemBytes));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(SkinnyGemmTiles(p.n, p.epilogue)),
                     static_cast<unsigned>(p.split_k));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = SkinnyGemmSmemBytes(p.m, p.split_k);
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned num_attrs = 0;
  if (p.split_k > 1) {
    attr[num_attrs].id = cudaLaunchAttributeClusterDimension;
    attr[num_attrs].val.clusterDim.x = 1;
    attr[num_attrs].val.clusterDim.y = static_cast<unsigned>(p.split_k);
    attr[num_attrs].val.clusterDim.z = 1;
    ++num_attrs;
  }
  if (p.pdl) {
    attr[num_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[num_attrs].val.programmaticStreamSerializationAllowed = 1;
    ++num_attrs;
  }
  cfg.attrs = attr;
  cfg.numAttrs = num_attrs;
  TS_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, SkinnyGemmKernel, p));
  return absl::OkStatus();
}

}  // namespace ts::kernels
