// Internal to the GEMV op (kernels/gemv.cuh): what its three kernels share, the epilogue of one
// output value, the m > 8 kernels' tile epilogue and launchers. Only kernels/gemv*.cu include it.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/bf16_vec.cuh"
#include "kernels/cuda_check.h"
#include "kernels/gemv.cuh"
#include "kernels/kv_layout.cuh"
#include "kernels/rope_kv.cuh"

namespace ts::kernels::gemv_internal {

namespace cg = cooperative_groups;

// Epilogue for element e = i * n + col of C (kStore / kAccumulate); returns the value stored.
__device__ __forceinline__ float StoreOutput(const GemvParams& p, int64_t e, float v) {
  const bool acc = p.epilogue == GemvEpilogue::kAccumulate;
  if (p.c_f32 != nullptr) {
    if (acc) v += p.c_f32[e];
    p.c_f32[e] = v;
    return v;
  }
  // A bf16 Linear rounds its output, then the residual add rounds the sum.
  if (acc) v = RoundBf16(v) + __bfloat162float(p.c[e]);
  const __nv_bfloat16 b = __float2bfloat16_rn(v);
  p.c[e] = b;
  return __bfloat162float(b);
}

// kRopeKv output of row i of A, pair (d, d + head_dim / 2) of head `head`, from the fp32 sums x1
// (row d of the head) and x2 (row d + head_dim / 2).
__device__ __forceinline__ void RopeEpilogue(const GemvParams& p, int i, int32_t head, int32_t d,
                                             float x1, float x2) {
  const GemvRopeKv& r = p.rope;
  const KvLayout& l = r.layout;
  x1 = RoundBf16(x1);  // the q/k/v Linear's bf16 output
  x2 = RoundBf16(x2);
  const int32_t hq = r.num_q_heads, hkv = l.num_kv_heads, half = l.head_dim / 2;
  if (head < hq + hkv) RopeRotate(x1, x2, RopeAngle(r.positions[i], r.inv_freq[d]), x1, x2);
  __nv_bfloat16* dst;
  if (head < hq) {
    dst = p.c + (static_cast<int64_t>(i) * hq + head) * l.head_dim;
  } else {
    const int32_t slot = r.slot_mapping[i];
    if (slot < 0 ||
        static_cast<int64_t>(slot) >= static_cast<int64_t>(l.num_blocks) * l.block_size) {
      if (slot != kNoKvWrite && r.error_flag != nullptr) *r.error_flag = 1;
      return;
    }
    const bool is_k = head < hq + hkv;
    dst = (is_k ? r.k_cache : r.v_cache) +
          KvOffset(l, slot / l.block_size, head - hq - (is_k ? 0 : hkv), slot % l.block_size);
  }
  dst[d] = __float2bfloat16_rn(x1);
  dst[d + half] = __float2bfloat16_rn(x2);
}

// W rows per tile of the m > 8 kernels (kSiluMul: 64 gate rows and their 64 up rows), and the
// row stride, in floats, of the fp32 result tile they leave in shared memory.
inline constexpr int kTileRows = kGemvTcTileN;
inline constexpr int kCsStride = kTileRows + 4;

// The end of both m > 8 kernels (gemv_tc.cu, gemv_wgmma.cu), run by every thread of the CTA
// (kThreads, a multiple of 32) once its fp32 partial sits in shared memory: cs[i * kCsStride + j]
// = the sum for A row i and local W row j over this CTA's k range. Reduces the tile's split-K
// cluster through distributed shared memory and applies p.epilogue (and sumsq_out).
template <int kThreads>
__device__ __forceinline__ void TileEpilogue(const GemvParams& p, float* cs, int tile, int split) {
  const int m = p.m, tid = threadIdx.x, lane = tid & 31;
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

// Tiles of kTileRows W rows (kSiluMul: kTileRows / 2 output columns) covering n.
int32_t GemvTcTiles(int32_t n, GemvEpilogue epilogue);

// Launches a kernel of the m > 8 tile grid: (tiles, split_k) CTAs of `threads`, a tile's splits
// one cluster, with PDL when p.pdl. `args` is what the kernel takes (p itself, or p with more).
template <typename Args>
absl::Status LaunchTileGrid(void (*kernel)(Args), const Args& args, const GemvParams& p,
                            int threads, int smem, cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim =
      dim3(static_cast<uint32_t>(GemvTcTiles(p.n, p.epilogue)), static_cast<uint32_t>(p.split_k));
  cfg.blockDim = dim3(static_cast<uint32_t>(threads));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
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
  TS_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, kernel, args));
  return absl::OkStatus();
}

// The m > 8 kernels: 9-16 rows, mma.sync (gemv_tc.cu), and 17-32 rows, TMA and wgmma
// (gemv_wgmma.cu). LaunchGemv has validated `p` except for what only these kernels need, which
// ValidateTcSplit checks: split_k against the cluster size and the k range, kRopeKv's head_dim.
absl::Status ValidateTcSplit(const GemvParams& p);
absl::Status LaunchGemvTc(const GemvParams& p, cudaStream_t stream);
absl::Status LaunchGemvWgmma(const GemvParams& p, cudaStream_t stream);
// Splits that bring the tiles up to whole waves of ctas_per_sm CTAs on every SM, each split
// keeping >= 2 stages of k, at most kGemvTcMaxSplitK; per kernel, with its own CTAs per SM.
int32_t ChooseTcSplitK(int32_t m, int32_t n, int32_t k, int32_t num_sms, GemvEpilogue epilogue,
                       int32_t ctas_per_sm);
int32_t ChooseGemvTcSplitK(int32_t m, int32_t n, int32_t k, int32_t num_sms, GemvEpilogue epilogue);
int32_t ChooseGemvWgmmaSplitK(int32_t m, int32_t n, int32_t k, int32_t num_sms,
                              GemvEpilogue epilogue);

}  // namespace ts::kernels::gemv_internal
