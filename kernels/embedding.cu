#include "kernels/embedding.cuh"

#include <cstdint>

#include "common/status.h"
#include "kernels/cuda_check.h"

namespace ts::kernels {
namespace {

constexpr int kThreads = 128;

// grid: (rows, ceil(hidden / 8 / kThreads)). Each thread copies one 16-byte vector.
__global__ void EmbeddingKernel(EmbeddingParams p) {
  const int32_t row = blockIdx.x;
  const int32_t vec = blockIdx.y * kThreads + threadIdx.x;
  if (vec >= p.hidden / 8) return;
  int32_t token = p.tokens[row];
  if (token < 0 || token >= p.vocab) {
    if (vec == 0 && p.error_flag != nullptr) *p.error_flag = 1;
    token = token < 0 ? 0 : p.vocab - 1;
  }
  const uint4* src =
      reinterpret_cast<const uint4*>(p.table + static_cast<int64_t>(token) * p.hidden);
  uint4* dst = reinterpret_cast<uint4*>(p.out + static_cast<int64_t>(row) * p.hidden);
  dst[vec] = __ldg(src + vec);
}

}  // namespace

absl::Status LaunchEmbedding(const EmbeddingParams& p, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(RequireNonNegative("embedding.rows", p.rows));
  if (p.rows == 0) return absl::OkStatus();
  TS_RETURN_IF_ERROR(RequirePositive("embedding.vocab", p.vocab));
  TS_RETURN_IF_ERROR(RequireMultipleOf("embedding.hidden", p.hidden, 8));
  TS_RETURN_IF_ERROR(RequirePointer("embedding.tokens", p.tokens, 4));
  TS_RETURN_IF_ERROR(RequirePointer("embedding.table", p.table));
  TS_RETURN_IF_ERROR(RequirePointer("embedding.out", p.out));
  const dim3 grid(p.rows, (p.hidden / 8 + kThreads - 1) / kThreads);
  EmbeddingKernel<<<grid, kThreads, 0, stream>>>(p);
  TS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace ts::kernels
