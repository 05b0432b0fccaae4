// Memory-bound "skinny" GEMM for decode batches of 9..128 rows, the same product as
// kernels/gemm.cuh and kernels/gemv.cuh:
//   C[m, n] = A[m, k] * W[n, k]^T, then an epilogue (store, residual add, or SwiGLU of a fused
//   gate_up)
// row-major bf16, W laid out like a Hugging Face Linear weight [out_features, in_features], fp32
// accumulation. At these m the time should still be the time to stream W once from HBM (W bytes /
// 4.3 TB/s); cuBLASLt runs the Llama-8B projections at 1.2-3x that at m = 16-64
// (bench/results/2026-11-29e-h200.md), and kernels/gemv.cu cannot go past 8 rows because it
// re-reads A per 16-row tile.
//
// How ("swap AB", as the GEMV): a CTA of 8 warps owns a tile of 256 W rows (256 output columns;
// kSiluMul: 128 gate rows and their 128 up rows, 128 output columns) and all m rows of A. W rows
// are the M of tensor-core mma.m16n8k16, A's rows its N (m padded to a multiple of 16). Each warp
// owns 32 W rows x all rows of A: 2 x 16 fragments of 16 x 8 fp32 accumulators (128 registers).
// K streams in tiles of 64 through a 4-stage cp.async ring in shared memory (per stage 256 W rows
// and 128 A rows x 128 bytes, XOR-swizzled so cp.async writes and ldmatrix reads are free of bank
// conflicts): 96 KB of W in flight per SM, 3x what 32 GB/s per SM (4.3 TB/s / 132) times ~1 us of
// DRAM latency needs. Each W fragment (ldmatrix.x4) feeds m/8 MMAs and each A fragment 4, so A is
// read once per CTA per K tile (A / W traffic = m / 256 <= 1/2) and W exactly once. Work scales
// with m: fragments of A rows past ceil(m / 16) * 16 are skipped by warp-uniform branches, so one
// kernel instance serves every m in 1..128 (nothing is templated).
//
// Limits, per SM at the roof (~18 W bytes per clock): at m = 128 each W byte costs 6.5 bytes of
// shared-memory traffic (W write + read, A 16 rows read per W row, A write) against 128 B/clock,
// and one MMA per 32 W bytes against mma.sync's ~1.5 clocks per m16n8k16: both ~85% busy, so
// m = 128 is expected below the roof (~75% of it); m <= 64 is memory-bound.
//
// Split-K (split_k > 1): n / 256 tiles fill few of the 132 SMs for the projections with small n
// (8B o/down: 16 tiles), so split_k CTAs share a tile, each streaming a contiguous 1/split_k of
// the K tiles. They form a thread-block cluster (1, split_k, 1) and reduce through distributed
// shared memory: after the main loop each warp stores its fp32 fragments into the shared memory
// of the cluster CTA that owns the warp's 32 rows (owner = warp % split_k), the owner adds the
// split_k copies in rank order and applies the epilogue. Fixed order, so results are bitwise
// reproducible; no workspace, no second kernel, kSiluMul and kAccumulate work split too. The
// reduction costs 256 x m x 4 bytes of SM-to-SM stores per CTA (64 KB at m = 64) after the
// stream; ChooseSkinnyGemmSplitK only splits where the SMs would idle otherwise.
//
// No RMSNorm prologue (GemvParams::norm_weight) yet: the normalisation needs each row's sum of
// squares over all of K before the first MMA, i.e. every CTA reading all of A first (m k 2 bytes,
// 1 MB at m = 128, k = 4096: several us of serial prologue per CTA, and 112 MB of L2 reads for
// 8B gate_up). Where it should come from instead: the preceding residual add (a kAccumulate
// epilogue) emitting per-row sums of squares, then a cheap per-stage normalise of A in shared
// memory here.
//
// Graph-capturable: no allocation, no sync, no host reads. With `pdl` the kernel is launched with
// programmatic stream serialization: each CTA issues the W copies of its first 3 K tiles before
// `griddepcontrol.wait` (A and C are touched only after it). Only valid when the preceding kernels
// do not write W.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace ts::kernels {

inline constexpr int32_t kSkinnyGemmMaxM = 128;       // rows of A one launch handles
inline constexpr int32_t kSkinnyGemmMaxSplitK = 8;    // the portable cluster size
inline constexpr int32_t kSkinnyGemmTileN = 256;      // W rows (output columns) per CTA
inline constexpr int32_t kSkinnyGemmSiluTileN = 128;  // kSiluMul: output columns per CTA

// What the kernel does with each output value v = (A W^T)[i, col] (fp32, summed over all of K).
enum class SkinnyGemmEpilogue : int32_t {
  kStore,  // C = v (bf16: one rounding)
  // C = C + v. bf16 C: bf16(C + bf16(v)), as transformers' bf16 Linear then residual add;
  // fp32 C: one fp32 add.
  kAccumulate,
  // SwiGLU on a fused gate_up weight: W has 2n rows, gate rows [0, n) then up rows [n, 2n), and
  // C[i, col] = bf16(bf16(silu(bf16(gate))) * bf16(up)) (transformers' bf16 LlamaMLP). bf16 C.
  kSiluMul,
};

struct SkinnyGemmParams {
  const __nv_bfloat16* a = nullptr;  // [m, k] row-major, 16-byte aligned; written by no one here
  const __nv_bfloat16* w = nullptr;  // [n, k] row-major (kSiluMul: [2n, k]), 16-byte aligned
  // Exactly one output: bf16 `c` or fp32 `c_f32`, [m, n] row-major, read first by kAccumulate.
  // Must not overlap a or w.
  __nv_bfloat16* c = nullptr;  // [m, n]
  float* c_f32 = nullptr;      // [m, n]
  int32_t m = 0;               // 1..kSkinnyGemmMaxM (m <= 8: kernels/gemv.cuh is faster)
  int32_t n = 0;               // >= 1, any value (kSiluMul: the intermediate size)
  int32_t k = 0;               // positive multiple of 8 (16-byte copies)
  SkinnyGemmEpilogue epilogue = SkinnyGemmEpilogue::kStore;
  // 1..kSkinnyGemmMaxSplitK: CTAs (one cluster) per tile, each summing 1/split_k of K. Any value
  // gives the same result up to fp32 summation order; each value is bitwise reproducible.
  int32_t split_k = 1;
  bool pdl = false;  // programmatic dependent launch (see the header comment)
};

// Validates params (InvalidArgument naming the field, e.g. "skinny_gemm.k"; nothing touches the
// GPU before that) and enqueues one kernel on `stream`.
absl::Status LaunchSkinnyGemm(const SkinnyGemmParams& p, cudaStream_t stream);

// Host heuristic for split_k: as many splits as keep tiles * split_k <= num_sms (one wave of one
// CTA per SM; tiles = ceil(n / 256), kSiluMul ceil(n / 128)), at most kSkinnyGemmMaxSplitK and at
// most one per 4 K tiles of 64; 1 when the tiles alone fill more than half the SMs. On a 132-SM
// H200: 8B qkv 5, o and down 8, gate_up 1 (112 tiles); 1B qkv, o and down 8, gate_up 2. `m` does
// not change the choice today (the reduction grows with m, but idle SMs cost more); it is an
// argument so that a measured m dependence can be added without a new signature.
int32_t ChooseSkinnyGemmSplitK(int32_t m, int32_t n, int32_t k, SkinnyGemmEpilogue epilogue,
                               int32_t num_sms);

// Tiles (CTAs per split) for n output columns: ceil(n / 256), kSiluMul ceil(n / 128).
int32_t SkinnyGemmTiles(int32_t n, SkinnyGemmEpilogue epilogue);

// Dynamic shared memory one CTA of a launch with this m and split_k takes (the 192 KB ring, or
// the cluster reduction's receive slots where they are larger: at most 224 KB, split_k = 7 at
// m > 112).
size_t SkinnyGemmSmemBytes(int32_t m, int32_t split_k);

// How many clusters of split_k CTAs (for this m) the current device keeps resident at once
// (cudaOccupancyMaxActiveClusters; split_k = 1: resident CTAs). A launch with more tiles than this
// runs in waves: correct, but slower. For the benchmark and for tuning the heuristic.
absl::Status SkinnyGemmResidentClusters(int32_t m, int32_t split_k, int32_t* clusters);

}  // namespace ts::kernels
