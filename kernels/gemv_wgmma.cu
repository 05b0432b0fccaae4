// The 17-32-row kernel of the GEMV op (kernels/gemv.cuh): W and A stream through a ring in shared
// memory by TMA, a producer warp keeps the ring full, and two consumer warpgroups multiply each
// stage with wgmma; split-K is reduced inside the kernel across a cluster of CTAs, and the
// epilogues are the 9-16-row kernel's (gemv_internal.cuh, TileEpilogue).
//
// Why this shape. The product is memory-bound (2 m flops per W byte), so the kernel's job is to
// keep W's bytes moving at the HBM roof: ~32 GB/s per SM on the H200, ~50 KB in flight per SM at
// ~1.5 us of loaded latency. Two earlier kernels (bench/gemv/README.md) lost to cuBLASLt above 16
// rows because every thread both issued cp.async copies and multiplied, so each CTA kept too few
// bytes in flight. Here one thread issues three TMA copies per stage (W's two 64-row boxes and
// A's box) as soon as the consumers free a slot, and the consumers only wait, issue four wgmma
// and release the slot.
//
// Persistent. A first version (4297f6c, bench/results/2026-12-05-h200.md) gave each tile's split-K
// cluster CTAs of its own, two or three an SM: every CTA paid a pipeline fill and a cluster
// reduction for 8-13 stages, and its clusters did not all fit at once. cuBLASLt itself runs about
// one CTA an SM with whole k. So here one CTA an SM holds the deepest ring that fits (8 stages),
// each cluster walks rounds of tiles, and the producer streams the next tile while the consumers
// reduce the last. The split is priced per round (ChooseGemvPersistentSplitK). Measured on an
// H100 (bench/results/2026-12-05b-h100.md) it beats or ties cuBLASLt on most Llama projections at
// 24-32 rows, where the nodes it fuses (rope_kv, silu_mul) pay the rest; at 64 and 128 rows A,
// which every CTA re-reads from L2 (m / 128 of the W bytes again), made it 1.1-1.9x cuBLASLt's
// time, so those rows stay on cuBLASLt.
//
// Swap-AB: W's 128 tile rows are the MMA's M (two m64 halves, one per consumer warpgroup) and the
// m rows of A, padded to 32, its N; both read K-major from the 128-byte-swizzled boxes TMA writes
// (kernels/wgmma.cuh). TMA zero-fills A's rows past m, W's rows past the matrix and k past its
// end, so partial tiles need no special case.
#include <algorithm>
#include <cstdint>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda_check.h"
#include "kernels/gemv_internal.cuh"
#include "kernels/pdl.cuh"
#include "kernels/ptx.cuh"
#include "kernels/tma.cuh"
#include "kernels/wgmma.cuh"

namespace ts::kernels::gemv_internal {
namespace {

constexpr int kConsumerWarps = 8;  // two warpgroups
constexpr int kConsumerThreads = kConsumerWarps * 32;
constexpr int kThreads = kConsumerThreads + 32;  // and the producer warp
constexpr int kStageK = 64;  // k per stage: 128 bytes of each row, one swizzle atom
constexpr int kRowBytes = kStageK * 2;
constexpr int kBoxRows = kTileRows / 2;  // W rows per TMA box and per consumer warpgroup
constexpr int kWStageBytes = kTileRows * kRowBytes;  // 16 KB
constexpr int kSmemAlign = 1024;      // the 128-byte swizzle's period (8 rows of 128 bytes)
constexpr int kSmemMax = 227 * 1024;  // an H100/H200 CTA's dynamic shared memory

// A padded to kN rows (the MMA's N). One CTA an SM: the ring is as deep as shared memory allows
// beside the fp32 result tile, which has its own space because the producer keeps filling the
// ring with the next tile while the consumers reduce this one.
template <int kN_, int kStages_>
struct Wg {
  static constexpr int kN = kN_;
  static constexpr int kStages = kStages_;
  static constexpr int kABytes = kN * kRowBytes;
  static constexpr int kStageBytes = kWStageBytes + kABytes;  // a multiple of 1024
  static constexpr int kRingBytes = kStages * kStageBytes;
  static constexpr int kSmemBytes = kRingBytes + kN * kCsStride * 4 + kSmemAlign;
  static_assert(kSmemBytes <= kSmemMax, "one CTA an SM");
};
using Wg32 = Wg<32, 8>;  // 177 KB

// The kernel's parameters: the GEMV's and the two tensor maps (kernel parameters are where TMA
// reads them from: __grid_constant__).
struct WgArgs {
  GemvParams p;
  CUtensorMap w_map;  // W [rows, k], boxes of kBoxRows x kStageK
  CUtensorMap a_map;  // A [m, k], boxes of kN x kStageK
  int32_t tiles;      // GemvTcTiles(n, epilogue)
};

__device__ __forceinline__ void ConsumerBarrier() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerThreads) : "memory");
}

// grid: (split_k, clusters), block kThreads, dynamic smem Cfg::kSmemBytes, a cluster of split_k
// CTAs along x. A persistent grid: cluster c multiplies tiles c, c + clusters, ... and its CTA of
// rank r always the same k range, stages [r * stages / split_k, (r + 1) * stages / split_k).
//
// Ring protocol, over the CTA's stages g = round * per_tile + j counted across its tiles: slot s =
// g % kStages; full[s] completes when the producer's arrival and the stage's TMA bytes have landed
// (phase g / kStages); empty[s] when all 8 consumer warps have released it, once their wgmma of
// the stage has completed. The producer runs up to kStages stages ahead, across tile boundaries,
// so the reduction and epilogue of one tile overlap the copies of the next.
//
// Split-K: each tile's partials are reduced across the cluster through distributed shared memory
// (TileEpilogue, two cluster barriers a tile). Every thread of the cluster must arrive at those,
// the producer warp too; it joins a tile's pair before it would wait for a slot that only the
// next tile's consumption frees, so it never blocks the consumers it waits for.
template <typename Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    GemvWgmmaKernel(const __grid_constant__ WgArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kN = Cfg::kN;
  constexpr int kStages = Cfg::kStages;
  constexpr int kStageBytes = Cfg::kStageBytes;
  const GemvParams& p = args.p;
  extern __shared__ unsigned char smem_raw[];
  // Every CTA pads by the same amount, so distributed shared memory maps rank to rank.
  unsigned char* smem =
      smem_raw + (kSmemAlign - ptx::SharedAddress(smem_raw) % kSmemAlign) % kSmemAlign;
  float* cs = reinterpret_cast<float*>(smem + Cfg::kRingBytes);
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int split = blockIdx.x, nsplit = p.split_k;
  const int first_tile = blockIdx.y, clusters = gridDim.y;
  const int rounds = (args.tiles - first_tile + clusters - 1) / clusters;  // >= 1 (launcher)
  const int stages_total = (p.k + kStageK - 1) / kStageK;
  const int s_begin = split * stages_total / nsplit;
  const int per_tile = (split + 1) * stages_total / nsplit - s_begin;  // >= 1 (validated)
  const int total = rounds * per_tile;
  const uint32_t base = ptx::SharedAddress(smem);
  auto w_slot = [&](int s) { return base + s * kStageBytes; };
  auto a_slot = [&](int s) { return w_slot(s) + kWStageBytes; };
  auto full_bar = [&](int s) { return ptx::SharedAddress(&full[s]); };
  auto empty_bar = [&](int s) { return ptx::SharedAddress(&empty[s]); };

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      tma::MbarrierInit(full_bar(s), 1);
      tma::MbarrierInit(empty_bar(s), kConsumerWarps);
    }
    tma::FenceMbarrierInit();
  }
  __syncthreads();

  if (warp == kConsumerWarps) {
    // The producer. W does not depend on the kernel before: the first stages' W is requested
    // before the PDL wait, A (the previous kernel's output) after it.
    const bool silu = p.epilogue == GemvEpilogue::kSiluMul;
    auto load = [&](int g, bool w, bool a) {
      const int s = g % kStages, tile = first_tile + g / per_tile * clusters;
      const int32_t x = (s_begin + g % per_tile) * kStageK;
      if (w) {
        // The tile's two W boxes; kSiluMul pairs gate rows [64 t, 64 t + 64) with the up rows n
        // further, so output column 64 t + j is made from local rows j and j + 64 in one CTA.
        const int32_t row0 = tile * (silu ? kBoxRows : kTileRows);
        const int32_t row1 = silu ? p.n + row0 : row0 + kBoxRows;
        tma::ArriveExpectTx(full_bar(s), kStageBytes);
        tma::Load2d(w_slot(s), &args.w_map, x, row0, full_bar(s));
        tma::Load2d(w_slot(s) + kBoxRows * kRowBytes, &args.w_map, x, row1, full_bar(s));
      }
      if (a) tma::Load2d(a_slot(s), &args.a_map, x, 0, full_bar(s));
    };
    const int first = total < kStages ? total : kStages;
    if (lane == 0) {
      tma::PrefetchTensorMap(&args.w_map);
      tma::PrefetchTensorMap(&args.a_map);
      for (int g = 0; g < first; ++g) load(g, true, false);
    }
    __syncwarp();
    GridDepWait();
    if (lane == 0) {
      for (int g = 0; g < first; ++g) load(g, false, true);
    }
    int joined = 0;  // rounds whose two cluster barriers the producer has passed
    auto join = [&] {
      __syncwarp();
      cg::this_cluster().sync();
      cg::this_cluster().sync();
      ++joined;
    };
    for (int g = first; g < total; ++g) {
      // Slot g % kStages is freed by stage g - kStages: past round `joined`, only once the
      // consumers have been through round `joined`'s barriers.
      while (nsplit > 1 && g - kStages >= (joined + 1) * per_tile) join();
      if (lane == 0) {
        tma::Wait(empty_bar(g % kStages), (g / kStages + 1) & 1);
        load(g, true, true);
      }
    }
    GridDepLaunchDependents();  // every W byte has been requested
    while (nsplit > 1 && joined < rounds) join();
    return;
  }

  // The consumers read nothing the kernel before wrote until the epilogue, but wait here so
  // that no thread triggers its dependents before waiting (the chain rule, kernels/pdl.cuh).
  GridDepWait();
  const int wg = warp >> 2;
  float acc[kN / 2];
  int g = 0;
  for (int round = 0; round < rounds; ++round) {
    const int tile = first_tile + round * clusters;
#pragma unroll
    for (int j = 0; j < kN / 2; ++j) acc[j] = 0.f;
    for (int j = 0; j < per_tile; ++j, ++g) {
      const int s = g % kStages;
      tma::Wait(full_bar(s), (g / kStages) & 1);
      const uint32_t ws = w_slot(s) + wg * kBoxRows * kRowBytes, as = a_slot(s);
      wgmma::WgmmaFence();
#pragma unroll
      for (int ks = 0; ks < kStageK / 16; ++ks) {
        wgmma::WgmmaBf16<kN>(acc, wgmma::DescSw128(ws + 32 * ks), wgmma::DescSw128(as + 32 * ks));
      }
      wgmma::WgmmaCommit();
      // The slot is free as soon as its MMAs are done.
      wgmma::WgmmaWait<0>();
      if (lane == 0) tma::Arrive(empty_bar(s));
    }
    if (round == rounds - 1) GridDepLaunchDependents();

    // cs[i * kCsStride + r] = sum for A row i and local W row r. The accumulator of warp w (lane =
    // 4 g + t): W rows 64 (w / 4) + 16 (w % 4) + g (+ 8) by A rows 8 j + 2 t (+ 1). The last
    // tile's epilogue (or the cluster's second barrier) is over, so cs is free.
    const int gq = lane >> 2, t4 = lane & 3;
    const int r0 = kBoxRows * wg + 16 * (warp & 3) + gq;
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        cs[(8 * j + 2 * t4 + (e & 1)) * kCsStride + r0 + 8 * (e >> 1)] = acc[4 * j + e];
      }
    }
    if (nsplit == 1) ConsumerBarrier();  // else the epilogue's first cluster barrier
    TileEpilogue<kConsumerThreads>(p, cs, tile, split);
    if (nsplit == 1) ConsumerBarrier();  // else its second: no one reads cs any more
  }
#else
  __trap();  // wgmma needs sm_90a (CMAKE_CUDA_ARCHITECTURES 90a, the top-level default)
#endif
}

// Clusters of `split_k` CTAs that fit the GPU at once (one CTA an SM), from the
// driver's occupancy query, cached: a host query, legal during capture, but not free.
template <typename Cfg>
absl::StatusOr<int32_t> MaxClusters(int32_t split_k) {
  static std::mutex mu;
  static int32_t cached[kGemvTcMaxSplitK + 1] = {};
  std::lock_guard<std::mutex> lock(mu);
  if (cached[split_k] > 0) return cached[split_k];
  constexpr int smem = Cfg::kSmemBytes;
  // Function attributes, not stream operations: legal while a graph is being captured.
  TS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(GemvWgmmaKernel<Cfg>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  TS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(GemvWgmmaKernel<Cfg>,
                                               cudaFuncAttributePreferredSharedMemoryCarveout,
                                               cudaSharedmemCarveoutMaxShared));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<uint32_t>(split_k), 1);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim = {static_cast<unsigned>(split_k), 1, 1};
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  TS_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveClusters(&clusters, GemvWgmmaKernel<Cfg>, &cfg));
  if (clusters < 1) {
    return absl::InternalError(absl::StrCat("gemv: no cluster of ", split_k,
                                            " CTAs of the 17-32-row kernel fits this GPU"));
  }
  cached[split_k] = clusters;
  return clusters;
}

template <typename Cfg>
absl::Status LaunchWg(const GemvParams& p, cudaStream_t stream) {
  constexpr int kN = Cfg::kN;
  WgArgs args{};
  args.p = p;
  args.tiles = GemvTcTiles(p.n, p.epilogue);
  const int64_t w_rows = p.epilogue == GemvEpilogue::kSiluMul ? 2 * int64_t{p.n} : p.n;
  TS_ASSIGN_OR_RETURN(args.w_map, tma::EncodeBf16RowsSw128(p.w, w_rows, p.k, kBoxRows));
  TS_ASSIGN_OR_RETURN(args.a_map, tma::EncodeBf16RowsSw128(p.a, p.m, p.k, kN));
  TS_ASSIGN_OR_RETURN(const int32_t max_clusters, MaxClusters<Cfg>(p.split_k));
  const int32_t clusters = std::min(args.tiles, max_clusters);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<uint32_t>(p.split_k), static_cast<uint32_t>(clusters));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = Cfg::kSmemBytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (p.pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  attr[n].id = cudaLaunchAttributeClusterDimension;
  attr[n++].val.clusterDim = {static_cast<unsigned>(p.split_k), 1, 1};
  cfg.attrs = attr;
  cfg.numAttrs = n;
  TS_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, GemvWgmmaKernel<Cfg>, args));
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchGemvWgmma(const GemvParams& p, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(ValidateTcSplit(p));
  return LaunchWg<Wg32>(p, stream);
}

int32_t ChooseGemvWgmmaSplitK(int32_t m, int32_t n, int32_t k, int32_t num_sms,
                              GemvEpilogue epilogue) {
  if (m < 1 || n < 1 || k < 8 || num_sms < 1) return 1;
  int32_t fit[kGemvTcMaxSplitK + 1] = {};
  for (int32_t split = 1; split <= kGemvTcMaxSplitK; ++split) {
    const absl::StatusOr<int32_t> clusters = MaxClusters<Wg32>(split);
    fit[split] = clusters.ok() ? *clusters : 0;
  }
  return ChooseGemvPersistentSplitK(GemvTcTiles(n, epilogue), (k + kStageK - 1) / kStageK, fit,
                                    num_sms);
}

}  // namespace ts::kernels::gemv_internal

namespace ts::kernels {

int32_t ChooseGemvPersistentSplitK(int64_t tiles, int64_t stages, const int32_t* fit,
                                   int32_t num_sms) {
  if (tiles < 1 || stages < 1 || num_sms < 1) return 1;
  constexpr int64_t kReduceStages = 2;  // a tile's cluster reduction, in stages, per CTA
  int32_t best = 1;
  int64_t best_cost = -1;
  for (int32_t split = 1; split <= kGemvTcMaxSplitK && split <= stages; ++split) {
    const int64_t clusters = std::min<int64_t>(fit[split], num_sms / split);
    if (clusters < 1) continue;
    const int64_t rounds = (tiles + clusters - 1) / clusters;
    const int64_t cost =
        rounds * ((stages + split - 1) / split + (split > 1 ? kReduceStages * split : 0));
    if (best_cost < 0 || cost < best_cost) {
      best_cost = cost;
      best = split;
    }
  }
  return best;
}

}  // namespace ts::kernels
