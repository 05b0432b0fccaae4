// Memory-bound small-M GEMM ("GEMV") for decode, the same product as kernels/gemm.cuh:
//   C[m, n] = A[m, k] * W[n, k]^T, then an epilogue (store, residual add, SwiGLU of a fused
//   gate_up, or RoPE + paged K/V write of a fused qkv), optionally with A RMS-normalised first
//   (GemvParams::norm_weight; at m > 8 from the row sums of squares the GEMV that wrote A left)
// row-major bf16, W laid out like a Hugging Face Linear weight [out_features, in_features], fp32
// accumulation. The time is the time to stream W once from HBM; cuBLASLt was measured at 39-56%
// of that roof on the small Llama-1B projections at m <= 8 (docs/gpu-facts.md, cuBLAS at decode
// shapes). Two kernels serve the one op, chosen by m:
//
// m <= kGemvRegisterMaxM (8), the register-streaming kernel. A CTA owns tiles of 16 rows of W
// (16 output columns; it loops over tiles when there are more than fit on the GPU at once) and its
// 8 warps split the K range between them. Each thread streams its rows with 16-byte loads (8
// batches of them in flight, L1 bypassed) and feeds them, with the matching 16 bytes of A,
// straight into tensor-core mma.m16n8k16 (W rows as the MMA's M, the up-to-8 rows of A as its N):
// the k-order inside a thread's 16 bytes is free, so no shuffles or conversions are needed and m =
// 1..8 all cost the same instructions. At 16 rows that design needs twice the registers and lost
// to cuBLASLt (bench/results/2026-12-02b-h200.md), hence the second kernel.
//
// 8 < m <= kGemvMaxM (16), the shared-memory kernel (gemv_tc.cu): a CTA owns a tile of 128 W rows
// and a range of K. W and A stream through a 4-stage cp.async ring in shared memory (no registers
// hold bytes in flight), and ldmatrix feeds mma.m16n8k16 with W as the MMA's M and the rows of A,
// padded to 16, as its N. Above 16 rows cuBLASLt is faster (gemv_tc.cu says why). Split-K is
// reduced inside the kernel: the split_k CTAs of a tile are one thread-block cluster, each keeps
// its fp32 partial in shared memory, and after a cluster barrier each reads all of them through
// distributed shared memory, adds them in split order and runs its share of the epilogue. No
// workspace, no extra node, and the same bits every run.
//
// Split-K (split_k > 1) at m <= 8: when n / 16 CTAs leave most SMs idle, CTAs also split K. Each
// writes its fp32 partial to workspace [split_k, m, n] and a second small kernel adds the split_k
// partials in order and applies the epilogue (deterministic; costs one more kernel node, so
// ChooseGemvSplitK only picks it for large matrices with few CTAs; every Llama-1B/8B projection
// gets split_k = 1 on a 132-SM H200).
//
// Graph-capturable: no allocation, no sync. With `pdl`, the kernel(s) are launched with
// programmatic stream serialization: each CTA issues its first W loads (and, with the norm
// prologue, the copy of norm_weight into shared memory) before `griddepcontrol.wait`, so the
// weight stream starts while the preceding kernel drains (A, C, the sums of squares and the
// workspace are touched only after the wait). Only valid when the preceding kernels write neither W
// nor norm_weight.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/kv_layout.cuh"

namespace ts::kernels {

inline constexpr int32_t kGemvMaxM = 16;         // rows of A one launch handles
inline constexpr int32_t kGemvRegisterMaxM = 8;  // rows the register-streaming kernel takes
inline constexpr int32_t kGemvMaxSplitK = 64;    // upper bound on split_k
inline constexpr int32_t kGemvTileN = 16;        // W rows per tile at m <= 8 (kSiluMul: 8 + 8)
inline constexpr int32_t kGemvTcTileN = 128;     // W rows per tile at m > 8 (kSiluMul: 64 + 64)
inline constexpr int32_t kGemvTcMaxSplitK = 8;   // at m > 8: CTAs in a cluster (portable size)
// Shared memory for the normalised A (m rows of k + 32 bf16; the pad staggers the rows' banks):
// hidden sizes up to 8192 at m = 8 (one CTA per SM there; two up to 4096).
inline constexpr int32_t kGemvMaxNormSmemBytes = 8 * (8192 + 32) * 2;

// What the kernel does with each output value v = (A W^T)[i, col] (fp32).
enum class GemvEpilogue : int32_t {
  kStore,  // C = v (bf16: one rounding)
  // C = C + v. bf16 C: bf16(C + bf16(v)), as transformers' bf16 Linear then residual add;
  // fp32 C: one fp32 add.
  kAccumulate,
  // SwiGLU on a fused gate_up weight: W has 2n rows, gate rows [0, n) then up rows [n, 2n), and
  // C[i, col] = bf16(bf16(silu(bf16(gate))) * bf16(up)) (transformers' bf16 LlamaMLP). bf16 C;
  // split_k = 1 at m <= 8.
  kSiluMul,
  // RoPE and the paged K/V write of kernels/rope_kv.cuh on a fused QKV weight (q heads, then k
  // heads, then v heads; n = (num_q_heads + 2 num_kv_heads) head_dim): a tile holds 8 rows of a
  // head's first half and their rotation partners, so each output pair is rotated where it is
  // summed. Rotated q goes to c ([m, num_q_heads head_dim]), rotated k and plain v to the cache at
  // each row's slot; nothing else is written. Rounds as LaunchRopeKv after a kStore GEMV: the
  // Linear output, cos/sin, each product and each sum. bf16 c; split_k = 1 at m <= 8, and head_dim
  // dividing kGemvTcTileN at m > 8 (a tile holds whole heads). Saves the rope_kv graph node and
  // its read of the qkv buffer in the decode step.
  kRopeKv,
};

// What kRopeKv needs beyond the GEMV (the fields of RopeKvParams it shares).
struct GemvRopeKv {
  const int32_t* positions = nullptr;     // [m] absolute position of each row
  const int32_t* slot_mapping = nullptr;  // [m] KvSlotFor; kNoKvWrite = no K/V write
  const float* inv_freq = nullptr;        // [head_dim / 2], models/rope.h
  __nv_bfloat16* k_cache = nullptr;       // [num_blocks][num_kv_heads][block_size][head_dim]
  __nv_bfloat16* v_cache = nullptr;       // [num_blocks][num_kv_heads][block_size][head_dim]
  // [1], optional: set to 1 when a slot lies outside [kNoKvWrite, num_blocks * block_size) (that
  // row's K/V are not written).
  int32_t* error_flag = nullptr;
  KvLayout layout{};  // head_dim a multiple of 16
  int32_t num_q_heads = 0;
};

// Whether each warp streams whole tiles itself (no CTA barrier per tile) or the CTA's 8 warps
// split each tile's K and reduce through shared memory.
enum class GemvWarpTiles : int32_t {
  kAuto,  // ChooseGemvWarpTiles on the device's resident CTA count
  kNever,
  kAlways,  // tests
};

struct GemvParams {
  const __nv_bfloat16* a = nullptr;  // [m, k] row-major, 16-byte aligned; written by no one here
  const __nv_bfloat16* w = nullptr;  // [n, k] row-major (kSiluMul: [2n, k]), 16-byte aligned
  // Exactly one output: bf16 `c` or fp32 `c_f32`, [m, n] row-major, read first by kAccumulate.
  // Must not overlap a, w or workspace.
  __nv_bfloat16* c = nullptr;  // [m, n]
  float* c_f32 = nullptr;      // [m, n]
  int32_t m = 0;               // 1..kGemvMaxM
  int32_t n = 0;               // >= 1, any value
  int32_t k = 0;               // positive multiple of 8 (16-byte loads)
  GemvEpilogue epilogue = GemvEpilogue::kStore;
  // Optional, [k]: RMSNorm folded into the kernel, with LlamaRMSNorm's bf16 rounding: a' =
  // bf16(norm_weight * bf16(a * rsqrt(mean(a^2) + norm_eps))), multiplied instead of A. Replaces
  // a separate rmsnorm kernel (a graph node).
  //   m <= 8: each CTA normalises all of A into shared memory first. Needs m * (k + 8) * 2 <=
  //   kGemvMaxNormSmemBytes, split_k = 1 and no a_sumsq.
  //   m > 8: needs a_sumsq; each CTA normalises its own k range of A in shared memory, a stage
  //   ahead of the MMA, so it reads no more of A than without the norm.
  const __nv_bfloat16* norm_weight = nullptr;
  float norm_eps = 1e-5f;  // > 0 when norm_weight is set
  // [m, GemvSumSqGroups(k)], m > 8 with norm_weight: the sums of squares of A's rows, per group of
  // 32 columns, as the GEMV that wrote A left them in its sumsq_out. Added in a fixed order.
  const float* a_sumsq = nullptr;
  // [m, GemvSumSqGroups(n)], optional, m > 8 with kStore or kAccumulate into a bf16 c: the sum of
  // squares of each row's stored values (after rounding) per group of 32 columns, each written by
  // one warp in a fixed order (the same bits every run). The next GEMV normalises C through
  // a_sumsq without a pass of its own over all of C.
  float* sumsq_out = nullptr;
  // 1..kGemvMaxSplitK; 1 = no split. At m > 8 at most kGemvTcMaxSplitK and the k range's
  // 64-wide stages.
  int32_t split_k = 1;
  float* workspace = nullptr;  // [split_k, m, n] fp32 partials; m <= 8 with split_k > 1 only
  size_t workspace_bytes = 0;  // >= GemvWorkspaceBytes(m, n, split_k)
  bool pdl = false;            // programmatic dependent launch (see the header comment)
  GemvRopeKv rope{};           // kRopeKv only
  GemvWarpTiles warp_tiles = GemvWarpTiles::kAuto;  // m <= 8 only, and only with split_k = 1
};

// True when LaunchGemv accepts norm_weight without a_sumsq for this (m, k).
bool GemvCanFuseNorm(int32_t m, int32_t k);
// Groups of 32 columns in a row of n values: the second extent of sumsq_out and a_sumsq.
inline constexpr int32_t kGemvSumSqGroup = 32;
__host__ __device__ inline constexpr int32_t GemvSumSqGroups(int32_t n) {
  return (n + kGemvSumSqGroup - 1) / kGemvSumSqGroup;
}
// Host heuristic: true when the norm prologue is faster than a separate rmsnorm kernel before the
// GEMV, m * k <= kGemvNormPrologueMaxElems. Every CTA normalises all of A itself before its first
// multiply, so the prologue's cost grows with m * k while the node it saves costs a fixed launch.
// Measured in decode steps on the H200 (bench/results/2026-12-03-h200.md): fused, 1B (k 2048) at
// m = 1 and 2 was 4.3% and 1.6% faster and 8B (k 4096) at m = 1 level; at m * k = 8192 and above
// the separate node won, by up to 10% of the 8B step at m = 8.
inline constexpr int64_t kGemvNormPrologueMaxElems = 4096;
bool GemvNormProloguePays(int32_t m, int32_t k);

// Validates params (InvalidArgument naming the field, e.g. "gemv.k") and enqueues one kernel
// (split_k == 1, or any m > 8, whose split-K is reduced in the kernel) or two (m <= 8, split_k > 1)
// on `stream`.
absl::Status LaunchGemv(const GemvParams& p, cudaStream_t stream);

// Host heuristic. m <= 8: 1 unless the n / 16 CTAs would fill less than half of the `num_sms`
// SMs and the matrix is large enough (>= 8 MiB) that the extra reduce kernel (~2 us node) pays
// off; then enough splits for about one full wave, keeping >= 2048 k per split. m > 8: splits
// that bring the tiles up to whole waves of the two CTAs per SM that fit, each keeping >= 2
// stages of k, at most kGemvTcMaxSplitK.
int32_t ChooseGemvSplitK(int32_t m, int32_t n, int32_t k, int32_t num_sms,
                         GemvEpilogue epilogue = GemvEpilogue::kStore);

// Host heuristic for GemvWarpTiles::kAuto: true when the tiles fill at least 3/4 of the resident
// warps (8 per CTA), i.e. when whole tiles per warp still keep the GPU busy: on a 132-SM H200
// (264 resident CTAs) that is Llama-8B's gate_up (1792 tiles) and larger.
bool ChooseGemvWarpTiles(int32_t tiles, int32_t resident_ctas);

// Bytes of fp32 workspace LaunchGemv needs for (m, n, split_k): 0 when split_k <= 1 or m > 8.
size_t GemvWorkspaceBytes(int32_t m, int32_t n, int32_t split_k);

}  // namespace ts::kernels
