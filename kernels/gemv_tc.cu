// The m > 8 kernel of the GEMV op (kernels/gemv.cuh), for 9-16 rows: W and A through a cp.async
// ring in shared memory, ldmatrix and mma.sync, split-K reduced inside the kernel across a cluster
// of CTAs; optionally A RMS-normalised in shared memory from the row sums of squares the GEMV
// before left (GemvParams::a_sumsq), and each row's sums of squares of the output left for the
// next (sumsq_out).
//
// Why this shape (Llama-3.1-8B on the H200, 4.3 TB/s over 132 SMs): each SM must take ~16 bytes of
// W per clock. Keeping ~32 KB of W in flight per SM takes registers in the m <= 8 kernel (and at 16
// rows twice as many, which lost to cuBLASLt); here the copies land in shared memory, so 3 stages
// of 16 KB per CTA, 2 CTAs per SM, keep the bytes in flight. Warps split each stage's k in two.
//
// Measured and given up (bench/results/2026-12-02d-h200.md): the same kernel with A padded to 32
// and 64 rows ran the 8B projections at 0.46-0.83x cuBLASLt's speed. Every CTA reads its k range
// of A from L2, m / 128 of the W bytes again (half at m = 64), and the mma.sync issue rate grows
// with m; a wider tile per CTA, TMA multicast of A across a cluster, or wgmma would be needed.
// A wgmma version (both operands read from the ring, A padded to 64 and 128 rows, two CTAs per
// SM) ran them at 0.52-0.76x cuBLASLt's speed (bench/results/2026-12-02e-h200.md) and was cut.
#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_check.h"
#include "kernels/gemv_internal.cuh"
#include "kernels/pdl.cuh"
#include "kernels/ptx.cuh"

namespace ts::kernels::gemv_internal {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kTileRows = kGemvTcTileN;  // W rows per tile
constexpr int kStageK = 64;              // k per stage: 128 bytes of each row
constexpr int kStages = 4;
constexpr int kRowBytes = kStageK * 2;
constexpr int kWStageBytes = kTileRows * kRowBytes;  // 16 KB
constexpr int kCsStride = kTileRows + 4;             // floats per row of the fp32 result tile
constexpr int kCtasPerSm = 2;

// A's rows padded to 16 (the MMA's N, two 8-row halves). 32 and 64 rows (two and four such
// blocks) were built and measured slower than cuBLASLt (see the header).
constexpr int kMTiles = 1;
constexpr int kStageBytes = kWStageBytes + 16 * kMTiles * kRowBytes;
constexpr int kSmemBytes = std::max(kStages * kStageBytes, 16 * kMTiles * kCsStride * 4);
// With the norm (GemvParams::a_sumsq): the W slots back to back, then kStages + 1 blocks of A,
// each followed by its stage's 64 norm weights. A stage's A lands one iteration earlier than its
// W and is normalised in place, hence the extra block. Three CTAs must still fit an SM: with
// two, 8B qkv's 48 clusters of 5 took more than one wave (1.4x slower).
constexpr int kABlockBytes = 16 * kMTiles * kRowBytes + kRowBytes;
constexpr int kNormSmemBytes = kStages * kWStageBytes + (kStages + 1) * kABlockBytes;
static_assert(3 * (kNormSmemBytes + 1024) <= 228 * 1024, "three CTAs an SM (H100/H200)");

// Byte offset of 16-byte chunk c of row r in a [rows][128 B] block: chunks XOR-swizzled by row,
// so the 8 rows an ldmatrix phase reads at one logical chunk sit in 8 different bank groups.
__device__ __forceinline__ uint32_t Swizzle(int r, int c) {
  return static_cast<uint32_t>(r * kRowBytes + ((c ^ (r & 7)) << 4));
}

// Local row r of tile `tile` -> row of W, or -1 past the end. kSiluMul pairs gate rows [64 t, 64 t
// + 64) (local 0-63) with the up rows n further (local 64-127), so output column 64 t + j is made
// from local rows j and j + 64 in one CTA.
__device__ __forceinline__ int64_t WRow(const GemvParams& p, int tile, int r) {
  if (p.epilogue == GemvEpilogue::kSiluMul) {
    const int64_t col = int64_t{tile} * (kTileRows / 2) + (r % (kTileRows / 2));
    if (col >= p.n) return -1;
    return r < kTileRows / 2 ? col : p.n + col;
  }
  const int64_t row = int64_t{tile} * kTileRows + r;
  return row < p.n ? row : -1;
}

// LlamaRMSNorm (RmsNormScale's two roundings) of a bf16 pair x by its norm weights w and the
// row's 1 / rms, in 6 instructions: the fp32 products rounded as a pair, then a bf16x2 multiply
// (a product of two bf16 values is exact in fp32, so rounding it once is what RmsNormScale does).
__device__ __forceinline__ uint32_t NormPair(uint32_t x, uint32_t w, float inv_rms) {
  const __nv_bfloat162 y = __floats2bfloat162_rn(__uint_as_float(x << 16) * inv_rms,
                                                 __uint_as_float(x & 0xffff0000u) * inv_rms);
  const __nv_bfloat162 o = __hmul2(y, *reinterpret_cast<const __nv_bfloat162*>(&w));
  return *reinterpret_cast<const uint32_t*>(&o);
}

// grid: (tiles, split_k), block 256, dynamic smem kSmemBytes (kNorm: kNormSmemBytes). CTA
// (tile, s) multiplies W rows of `tile` by A over stages [s * stages / split_k, (s + 1) * stages /
// split_k) of k.
//
// Warp w owns W rows [32 (w % 4), 32 (w % 4) + 32) of the tile (two 16-row MMA A operands) and
// k16 steps {2 (w / 4), 2 (w / 4) + 1} of each 64-k stage; its 2 x 2 accumulators cover all
// rows of A. The two k halves are added in a fixed order through shared memory at the end.
//
// kNorm: A is RMS-normalised in shared memory, in place and once per CTA, one iteration before
// its use: A(s + 1) is copied with W(s), so the wait that completes W(s) also completes it, and
// the barrier of iteration s + 1 shows the normalised values. (Normalising the MMA fragments
// instead, which 4 warps share, made 8B gate_up 1.6x slower, bench/results/2026-12-04-h200.md.)
// The rows' 1 / rms come from a_sumsq, so no CTA reads more of A than its own k range.
template <bool kNorm>
__global__ void __launch_bounds__(kThreads, kCtasPerSm) GemvTcKernel(GemvParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wn = warp & 3, wk = warp >> 2;
  const int tile = blockIdx.x, split = blockIdx.y;
  const int stages_total = (p.k + kStageK - 1) / kStageK;
  const int s_begin = split * stages_total / p.split_k;
  const int s_count = (split + 1) * stages_total / p.split_k - s_begin;
  const uint32_t smem_base = ptx::SharedAddress(smem);
  auto w_slot = [&](int i) { return smem_base + i * (kNorm ? kWStageBytes : kStageBytes); };
  auto a_slot = [&](int stage) {  // A of a stage
    return kNorm ? smem_base + kStages * kWStageBytes + (stage % (kStages + 1)) * kABlockBytes
                 : w_slot(stage % kStages) + kWStageBytes;
  };

  // This thread's W copies: chunk tid % 8 of local rows tid / 8 + 32 j (a warp reads 4 whole
  // 128-byte row segments).
  const int chunk = tid & 7;
  // The 4 rows' first copy (nullptr past n), computed once: the row arithmetic per stage made a
  // large share of the loop's instructions.
  const __nv_bfloat16* w_src[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t row = WRow(p, tile, tid / 8 + 32 * j);
    w_src[j] = row >= 0 ? p.w + row * p.k + int64_t{s_begin} * kStageK + chunk * 8 : nullptr;
  }
  auto load_w = [&](int i) {  // stage i of this CTA's range into slot i % kStages
    const bool k_in = int64_t{s_begin + i} * kStageK + chunk * 8 < p.k;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool in = k_in && w_src[j] != nullptr;
      ptx::CpAsync16(w_slot(i % kStages) + Swizzle(tid / 8 + 32 * j, chunk),
                     in ? w_src[j] + i * kStageK : p.w, in ? 16 : 0);
    }
  };
  // Stage i of A (kNorm: with its norm weights behind it). Rows past m and k past the end are
  // zero-filled.
  auto load_a = [&](int i) {
    if (i >= s_count) return;
    const int64_t k0 = int64_t{s_begin + i} * kStageK;
    for (int e = tid; e < 16 * kMTiles * 8; e += kThreads) {
      const int r = e >> 3, c = e & 7;
      const bool in = r < p.m && k0 + c * 8 < p.k;
      ptx::CpAsync16(a_slot(i) + Swizzle(r, c), in ? p.a + r * int64_t{p.k} + k0 + c * 8 : p.a,
                     in ? 16 : 0);
    }
    if (kNorm && tid < 8) {
      const bool in = k0 + tid * 8 < p.k;
      ptx::CpAsync16(a_slot(i) + 16 * kMTiles * kRowBytes + tid * 16,
                     in ? p.norm_weight + k0 + tid * 8 : p.norm_weight, in ? 16 : 0);
    }
  };
  // kNorm: this thread normalises 4 values of each stage, row ar at k 4 ac..4 ac + 3.
  const int ar = tid >> 4, ac = tid & 15;
  float inv = 0.f;  // row ar's 1 / rms (0 past m)
  auto normalise_a = [&](int i) {
    if (i >= s_count) return;
    // In place: each thread reads and writes only its own 8 bytes.
    const uint32_t at = a_slot(i) + Swizzle(ar, ac >> 1) + (ac & 1) * 8;
    uint32_t x0, x1, w0, w1;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(x0), "=r"(x1) : "r"(at) : "memory");
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];"
                 : "=r"(w0), "=r"(w1)
                 : "r"(a_slot(i) + 16 * kMTiles * kRowBytes + ac * 8)
                 : "memory");
    asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(at), "r"(NormPair(x0, w0, inv)),
                 "r"(NormPair(x1, w1, inv))
                 : "memory");
  };

  // W does not depend on the kernel before: its first stages stream across the wait (one group).
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < s_count) load_w(i);
  }
  ptx::CpAsyncCommit();
  GridDepWait();
  if constexpr (kNorm) {
    // Groups: A 0 and 1, then A 2, A 3, and in the loop W(i + 3) with A(i + 4), so that the wait
    // of iteration i completes W(i) and A(i + 1).
    load_a(0);
    load_a(1);
    ptx::CpAsyncCommit();
    load_a(2);
    ptx::CpAsyncCommit();
    load_a(3);
    ptx::CpAsyncCommit();
    // Row ar's sum of squares: its 16 threads (half a warp) each add every 16th group, all loads
    // in flight at once, then a fixed shuffle tree adds their sums.
    const int groups = GemvSumSqGroups(p.k);
    float ss = 0.f;
    if (ar < p.m) {
      const float* row = p.a_sumsq + ar * groups;
#pragma unroll 8
      for (int c = ac; c < groups; c += 16) ss += __ldcg(row + c);
    }
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    inv = ar < p.m ? rsqrtf(ss / p.k + p.norm_eps) : 0.f;
    ptx::CpAsyncWait<kStages - 2>();  // W 0-2, A 0 and 1
    __syncthreads();
    normalise_a(0);  // shown by the loop's first barrier
  } else {
    for (int i = 0; i < kStages - 1; ++i) {
      load_a(i);
      ptx::CpAsyncCommit();
    }
  }

  float acc[2][2 * kMTiles][4] = {};
  const int q = lane >> 3, r8 = lane & 7;
  for (int i = 0; i < s_count; ++i) {
    // Stage i's W and A groups are complete once at most kStages - 2 newer ones are pending.
    ptx::CpAsyncWait<kStages - 2>();
    __syncthreads();  // everyone's copies visible; slot (i - 1) % kStages is free again
    if (i + kStages - 1 < s_count) load_w(i + kStages - 1);
    load_a(i + kStages - 1 + (kNorm ? 1 : 0));
    ptx::CpAsyncCommit();
    // A(i + 1), complete since the wait, normalised for the next iteration.
    if constexpr (kNorm) normalise_a(i + 1);
    const uint32_t ws = w_slot(i % kStages), as = a_slot(i);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int ks = 2 * wk + h;  // k16 step in the stage: chunks 2 ks, 2 ks + 1
      uint32_t wf[2][4];
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        // A operand: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (0-7, k 8-15), (8-15, 8-15).
        const int row = 32 * wn + 16 * t + (q & 1) * 8 + r8;
        ptx::LdMatrixX4(wf[t], ws + Swizzle(row, 2 * ks + (q >> 1)));
      }
#pragma unroll
      for (int j = 0; j < kMTiles; ++j) {
        // B operands of A rows 16 j..16 j + 7 (regs 0, 1) and 16 j + 8.. (regs 2, 3).
        uint32_t af[4];
        ptx::LdMatrixX4(af, as + Swizzle(16 * j + (q >> 1) * 8 + r8, 2 * ks + (q & 1)));
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          ptx::MmaBf16(acc[t][2 * j], wf[t], af[0], af[1]);
          ptx::MmaBf16(acc[t][2 * j + 1], wf[t], af[2], af[3]);
        }
      }
    }
  }
  // Our W reads are done: the next kernel may start its prologue (it waits for our completion
  // before reading anything we write).
  GridDepLaunchDependents();
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();  // the ring is reused for the result tile

  // cs[i * kCsStride + r] = sum for A row i and local W row r. C fragment: W rows g, g + 8 (the
  // MMA's M) by A rows 2t, 2t + 1 (its N).
  float* cs = reinterpret_cast<float*>(smem);
  const int g = lane >> 2, t4 = lane & 3;
  for (int half = 0; half < 2; ++half) {
    if (wk == half) {
#pragma unroll
      for (int t = 0; t < 2; ++t) {
#pragma unroll
        for (int nt = 0; nt < 2 * kMTiles; ++nt) {
          const int r = 32 * wn + 16 * t + g, i = 8 * nt + 2 * t4;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float* dst = cs + (i + (e & 1)) * kCsStride + r + (e >> 1) * 8;
            *dst = half == 0 ? acc[t][nt][e] : *dst + acc[t][nt][e];
          }
        }
      }
    }
    __syncthreads();
  }

  const int m = p.m;
  // The tile's value at (A row i, local W row j). Split-K: the split_k CTAs of a tile form one
  // cluster (grid y); each reads every CTA's partial through distributed shared memory and adds
  // them in split order, so any CTA computes the same bits, and the epilogue work is shared out.
  cg::cluster_group cluster = cg::this_cluster();
  const int nsplit = p.split_k;
  const float* parts[kGemvTcMaxSplitK];
  if (nsplit > 1) {
    cluster.sync();  // every partial is in its CTA's shared memory
#pragma unroll
    for (int r = 0; r < kGemvTcMaxSplitK; ++r) {
      parts[r] = r < nsplit ? cluster.map_shared_rank(cs, r) : cs;
    }
  }
  auto value = [&](int i, int j) {
    if (nsplit == 1) return cs[i * kCsStride + j];
    float v = parts[0][i * kCsStride + j];
#pragma unroll
    for (int r = 1; r < kGemvTcMaxSplitK; ++r) {
      if (r < nsplit) v += parts[r][i * kCsStride + j];
    }
    return v;
  };
  const int first = split * kThreads + tid, step = nsplit * kThreads;

  // Epilogue over the finished fp32 tile; consecutive threads take consecutive columns.
  if (p.epilogue == GemvEpilogue::kSiluMul) {
    constexpr int kHalf = kTileRows / 2;
    for (int e = first; e < m * kHalf; e += step) {
      const int i = e / kHalf, j = e % kHalf;
      const int64_t col = int64_t{tile} * kHalf + j;
      if (col >= p.n) continue;
      // gate_proj and up_proj each round their output to bf16 first.
      p.c[i * int64_t{p.n} + col] =
          __float2bfloat16_rn(SiluMul(RoundBf16(value(i, j)), RoundBf16(value(i, j + kHalf))));
    }
  } else if (p.epilogue == GemvEpilogue::kRopeKv) {
    const int hd = p.rope.layout.head_dim, half = hd / 2;
    const int64_t row0 = int64_t{tile} * kTileRows;
    for (int e = first; e < m * kTileRows / 2; e += step) {
      const int i = e / (kTileRows / 2), pair = e % (kTileRows / 2);
      const int lh = pair / half, d = pair % half;  // head of the tile, dimension
      if (row0 + lh * hd >= p.n) continue;
      const int j = lh * hd + d;
      RopeEpilogue(p, i, static_cast<int32_t>(row0 / hd) + lh, d, value(i, j), value(i, j + half));
    }
  } else {
    const int groups = GemvSumSqGroups(p.n);
    for (int e = first; e < m * kTileRows; e += step) {
      const int i = e / kTileRows, j = e % kTileRows;
      const int64_t col = int64_t{tile} * kTileRows + j;
      const float v = col < p.n ? StoreOutput(p, i * int64_t{p.n} + col, value(i, j)) : 0.f;
      if (p.sumsq_out != nullptr) {
        // e advances in whole warps, so a warp holds one row's group of 32 columns.
        const float ss = WarpSum(v * v);
        if (lane == 0 && col < p.n) p.sumsq_out[i * groups + col / kGemvSumSqGroup] = ss;
      }
    }
  }
  // No CTA may leave while another still reads its shared memory.
  if (nsplit > 1) cluster.sync();
}

absl::Status LaunchTiles(const GemvParams& p, cudaStream_t stream) {
  const bool norm = p.norm_weight != nullptr;
  const int smem = norm ? kNormSmemBytes : kSmemBytes;
  auto* kernel = norm ? GemvTcKernel<true> : GemvTcKernel<false>;
  // A function attribute, not a stream operation: legal while a graph is being captured.
  TS_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim =
      dim3(static_cast<uint32_t>(GemvTcTiles(p.n, p.epilogue)), static_cast<uint32_t>(p.split_k));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (p.pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (p.split_k > 1) {  // a tile's splits are one cluster
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n++].val.clusterDim = {1, static_cast<unsigned>(p.split_k), 1};
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  TS_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, kernel, p));
  return absl::OkStatus();
}

}  // namespace

int32_t GemvTcTiles(int32_t n, GemvEpilogue epilogue) {
  const int32_t cols = epilogue == GemvEpilogue::kSiluMul ? kTileRows / 2 : kTileRows;
  return (n + cols - 1) / cols;
}

absl::Status LaunchGemvTc(const GemvParams& p, cudaStream_t stream) {
  const int32_t stages = (p.k + kStageK - 1) / kStageK;
  if (p.split_k > kGemvTcMaxSplitK) {
    return absl::InvalidArgumentError(absl::StrCat("gemv.split_k must be <= ", kGemvTcMaxSplitK,
                                                   " at m > 8 (a cluster), got ", p.split_k));
  }
  if (p.split_k > stages) {
    return absl::InvalidArgumentError(absl::StrCat("gemv.split_k is ", p.split_k, " but k = ", p.k,
                                                   " has only ", stages, " stages of ", kStageK));
  }
  if (p.epilogue == GemvEpilogue::kRopeKv && kTileRows % p.rope.layout.head_dim != 0) {
    return absl::InvalidArgumentError(absl::StrCat("gemv.rope.layout.head_dim must divide ",
                                                   kTileRows, " at m > 8, got ",
                                                   p.rope.layout.head_dim));
  }
  return LaunchTiles(p, stream);
}

int32_t ChooseGemvTcSplitK(int32_t m, int32_t n, int32_t k, int32_t num_sms,
                           GemvEpilogue epilogue) {
  if (m < 1 || n < 1 || k < 8 || num_sms < 1) return 1;
  const int64_t tiles = GemvTcTiles(n, epilogue);
  const int64_t resident = int64_t{kCtasPerSm} * num_sms;
  const int64_t want = resident / tiles;                 // whole waves only
  const int64_t most = (k + kStageK - 1) / kStageK / 2;  // >= 2 stages per split
  return static_cast<int32_t>(
      std::max<int64_t>(1, std::min<int64_t>({want, most, int64_t{kGemvTcMaxSplitK}})));
}

}  // namespace ts::kernels::gemv_internal
