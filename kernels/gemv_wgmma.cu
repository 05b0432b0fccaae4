// The 17-128-row kernel of the GEMV op (kernels/gemv.cuh): W and A stream through a ring in shared
// memory by TMA, a producer warp keeps the ring full, and two consumer warpgroups multiply each
// stage with wgmma; split-K is reduced inside the kernel across a cluster of CTAs, and the
// epilogues are the 9-16-row kernel's (gemv_internal.cuh, TileEpilogue).
//
// Why this shape. The product is memory-bound (2 m flops per W byte: at m = 128 still far under
// the tensor cores' rate), so the kernel's job is to keep W's bytes moving at the HBM roof:
// ~32 GB/s per SM on the H200, ~50 KB in flight per SM at ~1.5 us of loaded latency. The two
// kernels measured and cut before this one (bench/gemv/README.md) lost to cuBLASLt above 16 rows
// because every thread both issued cp.async copies and multiplied: a stage's copies waited for
// the whole CTA's barrier after the previous stage, so each CTA kept too few bytes in flight, and
// the mma.sync issue rate grew with m. Here one thread issues three TMA copies per stage (W's two
// 64-row boxes and A's box) as soon as the consumers free a slot, and the consumers only wait,
// issue four wgmma and release the slot.
//
// Measured on the H200 (bench/results/2026-12-05-h200.md): right over the whole test grid and in
// the decode step, but slower than cuBLASLt: in the step, 8B at 24-32 rows level, at 64 rows
// 2.8% and at 128 rows 19% slower, 1B 3-19% slower. Alone, 8B qkv / o / down at 64 rows took
// 20.2 / 15.0 / 40.8 us against cuBLASLt's 16.3 / 11.6 / 35.4, at 38-54% of DRAM bandwidth
// (ncu). Cut from the decode path in the commit after this one; kept in history for the next try.
//
// Swap-AB: W's 128 tile rows are the MMA's M (two m64 halves, one per consumer warpgroup) and the
// m rows of A, padded to kN (32, 64 or 128), its N; both read K-major from the 128-byte-swizzled
// boxes TMA writes (kernels/wgmma.cuh). TMA zero-fills A's rows past m, W's rows past the matrix
// and k past its end, so partial tiles need no special case.
#include <algorithm>
#include <cstdint>

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
constexpr int kThreads = (kConsumerWarps + 1) * 32;
constexpr int kStageK = 64;  // k per stage: 128 bytes of each row, one swizzle atom
constexpr int kRowBytes = kStageK * 2;
constexpr int kBoxRows = kTileRows / 2;  // W rows per TMA box and per consumer warpgroup
constexpr int kWStageBytes = kTileRows * kRowBytes;  // 16 KB
constexpr int kSmemAlign = 1024;  // the 128-byte swizzle's period (8 rows of 128 bytes)

// One instance per padding of A, kN rows (the MMA's N), of 3 stages: up to 64 rows three CTAs
// fit an SM (60 and 72 KB), at 128 rows two (97 KB). Three CTAs leave room for whole clusters
// (ChooseGemvWgmmaSplitK) and for the next kernel's first CTAs under PDL.
template <int kN_, int kStages_, int kMinCtas_>
struct Wg {
  static constexpr int kN = kN_;
  static constexpr int kStages = kStages_;
  static constexpr int kMinCtas = kMinCtas_;  // CTAs an SM (registers and shared memory allow)
  static constexpr int kABytes = kN * kRowBytes;
  static constexpr int kStageBytes = kWStageBytes + kABytes;  // a multiple of 1024
  static constexpr int kSmemBytes = std::max(kStages * kStageBytes, kN* kCsStride * 4) + kSmemAlign;
  static_assert(kMinCtas * (kSmemBytes + 1024) <= 228 * 1024, "CTAs an SM (H100/H200)");
};

// The kernel's parameters: the GEMV's and the two tensor maps (kernel parameters are where TMA
// reads them from: __grid_constant__).
struct WgArgs {
  GemvParams p;
  CUtensorMap w_map;  // W [rows, k], boxes of kBoxRows x kStageK
  CUtensorMap a_map;  // A [m, k], boxes of kN x kStageK
};

int32_t PaddedRows(int32_t m) {
  return m <= 32 ? 32 : m <= 64 ? 64 : 128;
}

// grid: (tiles, split_k), block kThreads, dynamic smem Cfg::kSmemBytes. CTA (tile, s)
// multiplies the W rows of `tile` by A over stages [s * stages / split_k, (s + 1) * stages /
// split_k) of k.
//
// Ring protocol, slot s = stage i % kStages: full[s] completes when the producer's arrival and the
// stage's TMA bytes have landed (phase i / kStages); empty[s] when all 8 consumer warps have
// released it, once their wgmma of the stage has completed.
template <typename Cfg>
__global__ void __launch_bounds__(kThreads, Cfg::kMinCtas)
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
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int tile = blockIdx.x, split = blockIdx.y;
  const int stages_total = (p.k + kStageK - 1) / kStageK;
  const int s_begin = split * stages_total / p.split_k;
  const int s_count = (split + 1) * stages_total / p.split_k - s_begin;  // >= 1 (validated)
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

  float acc[kN / 2];
  if (warp == kConsumerWarps) {
    // The producer. W does not depend on the kernel before: the first stages' W is requested
    // before the PDL wait, A (the previous kernel's output) after it.
    if (lane == 0) {
      tma::PrefetchTensorMap(&args.w_map);
      tma::PrefetchTensorMap(&args.a_map);
      // The tile's two W boxes; kSiluMul pairs gate rows [64 t, 64 t + 64) with the up rows n
      // further, so output column 64 t + j is made from local rows j and j + 64 in one CTA.
      const bool silu = p.epilogue == GemvEpilogue::kSiluMul;
      const int32_t row0 = tile * (silu ? kBoxRows : kTileRows);
      const int32_t row1 = silu ? p.n + row0 : row0 + kBoxRows;
      auto load_w = [&](int i) {
        const int s = i % kStages;
        const int32_t x = (s_begin + i) * kStageK;
        tma::ArriveExpectTx(full_bar(s), kStageBytes);
        tma::Load2d(w_slot(s), &args.w_map, x, row0, full_bar(s));
        tma::Load2d(w_slot(s) + kBoxRows * kRowBytes, &args.w_map, x, row1, full_bar(s));
      };
      auto load_a = [&](int i) {
        const int s = i % kStages;
        tma::Load2d(a_slot(s), &args.a_map, (s_begin + i) * kStageK, 0, full_bar(s));
      };
      const int first = s_count < kStages ? s_count : kStages;
      for (int i = 0; i < first; ++i) load_w(i);
      GridDepWait();
      for (int i = 0; i < first; ++i) load_a(i);
      for (int i = kStages; i < s_count; ++i) {
        // Stage i - kStages, the slot's last use, has been released (its phase i / kStages - 1).
        tma::Wait(empty_bar(i % kStages), (i / kStages + 1) & 1);
        load_w(i);
        load_a(i);
      }
    }
    __syncwarp();
  } else {
    // The consumers read nothing the kernel before wrote until the epilogue, but wait here so
    // that no thread triggers its dependents before waiting (the chain rule, kernels/pdl.cuh).
    GridDepWait();
    const int wg = warp >> 2;
#pragma unroll
    for (int j = 0; j < kN / 2; ++j) acc[j] = 0.f;
    for (int i = 0; i < s_count; ++i) {
      const int s = i % kStages;
      tma::Wait(full_bar(s), (i / kStages) & 1);
      const uint32_t ws = w_slot(s) + wg * kBoxRows * kRowBytes, as = a_slot(s);
      wgmma::WgmmaFence();
#pragma unroll
      for (int ks = 0; ks < kStageK / 16; ++ks) {
        wgmma::WgmmaBf16<kN>(acc, wgmma::DescSw128(ws + 32 * ks), wgmma::DescSw128(as + 32 * ks));
      }
      wgmma::WgmmaCommit();
      // The slot is free as soon as its MMAs are done (a few hundred cycles against a stage's
      // ~1 us of streaming): holding it until the next stage lands kept one stage fewer in flight.
      wgmma::WgmmaWait<0>();
      if (lane == 0) tma::Arrive(empty_bar(s));
    }
  }
  // Every W byte has landed: the next kernel may start its prologue (it waits for our completion
  // before reading anything we write).
  GridDepLaunchDependents();
  __syncthreads();  // the ring is reused for the result tile

  // cs[i * kCsStride + r] = sum for A row i and local W row r. The accumulator of warp w (lane =
  // 4 g + t): W rows 64 (w / 4) + 16 (w % 4) + g (+ 8) by A rows 8 j + 2 t (+ 1).
  float* cs = reinterpret_cast<float*>(smem);
  if (warp < kConsumerWarps) {
    const int g = lane >> 2, t4 = lane & 3;
    const int r0 = kBoxRows * (warp >> 2) + 16 * (warp & 3) + g;
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        cs[(8 * j + 2 * t4 + (e & 1)) * kCsStride + r0 + 8 * (e >> 1)] = acc[4 * j + e];
      }
    }
  }
  __syncthreads();
  TileEpilogue<kThreads>(p, cs, tile, split);
#else
  __trap();  // wgmma needs sm_90a (CMAKE_CUDA_ARCHITECTURES 90a, the top-level default)
#endif
}

template <typename Cfg>
absl::Status LaunchWg(const GemvParams& p, cudaStream_t stream) {
  constexpr int kN = Cfg::kN;
  WgArgs args{};
  args.p = p;
  const int64_t w_rows = p.epilogue == GemvEpilogue::kSiluMul ? 2 * int64_t{p.n} : p.n;
  TS_ASSIGN_OR_RETURN(args.w_map, tma::EncodeBf16RowsSw128(p.w, w_rows, p.k, kBoxRows));
  TS_ASSIGN_OR_RETURN(args.a_map, tma::EncodeBf16RowsSw128(p.a, p.m, p.k, kN));
  constexpr int smem = Cfg::kSmemBytes;
  // Function attributes, not stream operations: legal while a graph is being captured. Two CTAs
  // an SM need the largest shared-memory carveout, which the driver does not pick by itself.
  TS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(GemvWgmmaKernel<Cfg>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  TS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(GemvWgmmaKernel<Cfg>,
                                               cudaFuncAttributePreferredSharedMemoryCarveout,
                                               cudaSharedmemCarveoutMaxShared));
  return LaunchTileGrid(GemvWgmmaKernel<Cfg>, args, p, kThreads, smem, stream);
}

}  // namespace

absl::Status LaunchGemvWgmma(const GemvParams& p, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(ValidateTcSplit(p));
  switch (PaddedRows(p.m)) {
    case 32:
      return LaunchWg<Wg<32, 3, 3>>(p, stream);
    case 64:
      return LaunchWg<Wg<64, 3, 3>>(p, stream);
    default:
      return LaunchWg<Wg<128, 3, 2>>(p, stream);
  }
}

int32_t ChooseGemvWgmmaSplitK(int32_t m, int32_t n, int32_t k, int32_t num_sms,
                              GemvEpilogue epilogue) {
  // Planned for one CTA an SM fewer than fit, so that a tile's cluster always finds room: with
  // two CTAs of the 64-row instance an SM, only 30 clusters of 8 fit at once on the H200, and 8B
  // o and down (32 clusters) ran a second wave (bench/results/2026-12-05-h200.md).
  return ChooseTcSplitK(m, n, k, num_sms, epilogue, PaddedRows(m) == 128 ? 1 : 2);
}

}  // namespace ts::kernels::gemv_internal
