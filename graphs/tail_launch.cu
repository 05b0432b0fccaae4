#include "graphs/tail_launch.cuh"

#include "absl/strings/str_cat.h"
#include "graphs/device_graph.h"
#include "kernels/cuda_check.h"

namespace ts::graphs {
namespace {

__device__ void RecordFailure(int32_t* status, int32_t code) {
  if (*status == 0) *status = code;  // keep the first failure
}

// One thread. Both launches go to the tail-launch stream, so they run after this graph ends, in
// order: the bucket's step, then this scheduler again (which decides whether to go on).
__global__ void TailLaunchKernel(TailLaunchParams p) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  if (p.remaining_steps != nullptr) {
    if (*p.remaining_steps <= 0) return;
    --*p.remaining_steps;
  }
  const int32_t b = *p.bucket_index;
  if (b < 0 || b >= p.num_buckets) {
    RecordFailure(p.status, kTailLaunchBadBucket);
    return;
  }
  cudaError_t err = TailLaunchBucket(p.table, p.num_buckets, b);
  if (err != cudaSuccess) {
    RecordFailure(p.status, static_cast<int32_t>(err));
    return;
  }
  if (p.remaining_steps != nullptr && *p.remaining_steps > 0) {
    // Null outside a device graph, and the launch then fails: the status shows it.
    err = cudaGraphLaunch(cudaGetCurrentGraphExec(), cudaStreamGraphTailLaunch);
    if (err != cudaSuccess) RecordFailure(p.status, static_cast<int32_t>(err));
  }
}

absl::Status Validate(const TailLaunchParams& p) {
  if (p.table == nullptr) return absl::InvalidArgumentError("tail_launch.table is null");
  if (p.num_buckets < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tail_launch.num_buckets must be >= 1, got ", p.num_buckets));
  }
  if (p.bucket_index == nullptr) {
    return absl::InvalidArgumentError("tail_launch.bucket_index is null");
  }
  if (p.status == nullptr) return absl::InvalidArgumentError("tail_launch.status is null");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TailLauncher>> TailLauncher::Create(const TailLaunchParams& params,
                                                                   cudaStream_t stream) {
  if (absl::Status s = Validate(params); !s.ok()) return s;
  absl::StatusOr<cudaGraphExec_t> exec = CaptureForDeviceLaunch([&](cudaStream_t s) {
    TailLaunchKernel<<<1, 1, 0, s>>>(params);
    return cudaGetLastError();
  });
  if (!exec.ok()) return exec.status();
  std::unique_ptr<TailLauncher> launcher(new TailLauncher(*exec));
  TS_CUDA_RETURN_IF_ERROR(cudaGraphUpload(launcher->exec_, stream));
  return launcher;
}

TailLauncher::~TailLauncher() {
  if (exec_ != nullptr) (void)cudaGraphExecDestroy(exec_);
}

absl::Status TailLauncher::Launch(cudaStream_t stream) {
  TS_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec_, stream));
  return absl::OkStatus();
}

}  // namespace ts::graphs
