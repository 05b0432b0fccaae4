#include "kernels/gemv.cuh"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda_check.h"

namespace ts::kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
// One k-step: the 4 threads of an MMA group each load 8 consecutive k (16 bytes) of a row.
constexpr int kStepK = 32;
// k-steps per batch: 8 batches x 2 rows x 16 bytes = 256 bytes of W in flight per thread.
constexpr int kUnroll = 8;
constexpr int kBatchK = kStepK * kUnroll;  // 256 k per warp per batch

// W is streamed once: skip L1 (keeps A's lines there) and ask L2 to fetch 256-byte segments.
__device__ __forceinline__ uint4 LoadStream(const __nv_bfloat16* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
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

// No-ops unless the kernel was launched with programmatic stream serialization.
__device__ __forceinline__ void GridDepWait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void GridDepLaunchDependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
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

// Epilogue for element e = i * n + col of C.
__device__ __forceinline__ void StoreOutput(const GemvParams& p, int64_t e, float v) {
  if (p.c_f32 != nullptr) {
    if (p.accumulate) v += p.c_f32[e];
    p.c_f32[e] = v;
  } else {
    if (p.accumulate) v += __bfloat162float(p.c[e]);
    p.c[e] = __float2bfloat16_rn(v);
  }
}

// grid: (ceil(n / 16), split_k), block: 256. CTA (x, s) computes output columns
// [16x, 16x + 16) over batch range s of K; warp w takes batches w, w + 8, ... of that range.
//
// Thread (g, t) of a warp loads, per k-step j, 16 bytes of W row g, of W row g + 8 and of A row g
// at k = 32 j + 8 t. The MMA sums over k, so the k-order inside those 8 elements is free: the
// first two 4-byte words feed one MMA as its k {2t, 2t+1} and {2t+8, 2t+9}, the last two a second
// MMA, and W and A agree because both are indexed by t alone. Rows of W past n and rows of A past
// m are clamped to row 0 (loaded, never stored), which keeps the hot loop free of predicates.
__global__ void __launch_bounds__(kThreads, 2) GemvKernel(GemvParams p) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int32_t row0 = blockIdx.x * kGemvTileN;
  const int64_t k = p.k;
  const __nv_bfloat16* w_lo = p.w + (row0 + g < p.n ? row0 + g : 0) * k + t * 8;
  const __nv_bfloat16* w_hi = p.w + (row0 + g + 8 < p.n ? row0 + g + 8 : 0) * k + t * 8;
  const __nv_bfloat16* a_row = p.a + (g < p.m ? g : 0) * k + t * 8;

  const int32_t num_batches = (p.k + kBatchK - 1) / kBatchK;
  const int32_t split = blockIdx.y;
  const int32_t b_begin = split * num_batches / p.split_k;
  const int32_t b_end = (split + 1) * num_batches / p.split_k;

  // Two accumulators (first and second half of each 16-byte load) halve the MMA dependency chain.
  float acc0[4] = {0.f, 0.f, 0.f, 0.f};
  float acc1[4] = {0.f, 0.f, 0.f, 0.f};
  bool waited = false;
  for (int32_t b = b_begin + warp; b < b_end; b += kWarps) {
    const int64_t off = static_cast<int64_t>(b) * kBatchK;
    uint4 wl[kUnroll], wh[kUnroll], av[kUnroll];
    const bool full = off + kBatchK <= k;
    if (full) {
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
    // A (and C, in the epilogue) may still be written by the preceding kernel until here.
    if (!waited) {
      GridDepWait();
      waited = true;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const bool in = full || off + u * kStepK + t * 8 < k;
      av[u] = in ? LoadCached(a_row + off + u * kStepK) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      Mma16816(acc0, wl[u].x, wh[u].x, wl[u].y, wh[u].y, av[u].x, av[u].y);
      Mma16816(acc1, wl[u].z, wh[u].z, wl[u].w, wh[u].w, av[u].z, av[u].w);
    }
  }
  if (!waited) GridDepWait();
  // Our W reads are issued: the next kernel may start its own prologue.
  GridDepLaunchDependents();

  // Fixed-order sum over the 8 warps. red[warp][i * 16 + r] = partial of C[i, row0 + r].
  __shared__ float red[kWarps][kGemvMaxM * kGemvTileN];
  red[warp][(2 * t) * kGemvTileN + g] = acc0[0] + acc1[0];
  red[warp][(2 * t + 1) * kGemvTileN + g] = acc0[1] + acc1[1];
  red[warp][(2 * t) * kGemvTileN + g + 8] = acc0[2] + acc1[2];
  red[warp][(2 * t + 1) * kGemvTileN + g + 8] = acc0[3] + acc1[3];
  __syncthreads();
  if (threadIdx.x >= kGemvMaxM * kGemvTileN) return;
  const int i = threadIdx.x / kGemvTileN, r = threadIdx.x % kGemvTileN;
  const int32_t col = row0 + r;
  if (i >= p.m || col >= p.n) return;
  float v = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) v += red[w][threadIdx.x];
  if (p.split_k > 1) {
    p.workspace[(static_cast<int64_t>(split) * p.m + i) * p.n + col] = v;
  } else {
    StoreOutput(p, static_cast<int64_t>(i) * p.n + col, v);
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
  if (p.split_k > 1) {
    TS_RETURN_IF_ERROR(RequirePointer("gemv.workspace", p.workspace, alignof(float)));
    const size_t need = GemvWorkspaceBytes(p.m, p.n, p.split_k);
    if (p.workspace_bytes < need) {
      return absl::InvalidArgumentError(absl::StrCat("gemv.workspace_bytes is ", p.workspace_bytes,
                                                     ", split_k = ", p.split_k, " needs ", need));
    }
  }
  return absl::OkStatus();
}

absl::Status Launch(void (*kernel)(GemvParams), dim3 grid, const GemvParams& p,
                    cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = p.pdl ? 1 : 0;
  TS_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, kernel, p));
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchGemv(const GemvParams& p, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(Validate(p));
  const dim3 grid((p.n + kGemvTileN - 1) / kGemvTileN, p.split_k);
  TS_RETURN_IF_ERROR(Launch(GemvKernel, grid, p, stream));
  if (p.split_k > 1) {
    const int64_t total = static_cast<int64_t>(p.m) * p.n;
    TS_RETURN_IF_ERROR(
        Launch(GemvSplitReduceKernel, dim3(static_cast<uint32_t>((total + 255) / 256)), p, stream));
  }
  return absl::OkStatus();
}

int32_t ChooseGemvSplitK(int32_t m, int32_t n, int32_t k, int32_t num_sms) {
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
  if (split_k <= 1 || m < 1 || n < 1) return 0;
  return static_cast<size_t>(split_k) * m * n * sizeof(float);
}

}  // namespace ts::kernels
