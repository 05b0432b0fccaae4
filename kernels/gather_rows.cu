#include "kernels/gather_rows.cuh"

#include "common/status.h"
#include "kernels/cuda_check.h"

namespace ts::kernels {
namespace {

constexpr int kThreads = 128;

__global__ void GatherRowsKernel(GatherRowsParams p) {
  const int32_t i = blockIdx.x;
  const uint4* s =
      reinterpret_cast<const uint4*>(p.src + static_cast<int64_t>(p.src_rows[i]) * p.width);
  uint4* d = reinterpret_cast<uint4*>(p.dst + static_cast<int64_t>(p.dst_rows[i]) * p.width);
  for (int32_t v = threadIdx.x; v < p.width / 8; v += blockDim.x) d[v] = s[v];
}

}  // namespace

absl::Status LaunchGatherRows(GatherRowsParams p, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(RequireNonNegative("gather.n", p.n));
  if (p.n == 0) return absl::OkStatus();
  TS_RETURN_IF_ERROR(RequirePositive("gather.width", p.width));
  TS_RETURN_IF_ERROR(RequireMultipleOf("gather.width", p.width, 8));
  TS_RETURN_IF_ERROR(RequirePointer("gather.src", p.src, 16));
  TS_RETURN_IF_ERROR(RequirePointer("gather.dst", p.dst, 16));
  TS_RETURN_IF_ERROR(RequirePointer("gather.src_rows", p.src_rows, 4));
  TS_RETURN_IF_ERROR(RequirePointer("gather.dst_rows", p.dst_rows, 4));
  GatherRowsKernel<<<p.n, kThreads, 0, stream>>>(p);
  TS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace ts::kernels
