// Device-side launch of a GraphCache bucket: a one-thread kernel reads the device table and
// tail-launches the bucket's current exec (cudaGraphLaunch(exec, cudaStreamGraphTailLaunch)),
// optionally re-launching itself for a number of steps. It is the seed of the device loop's
// scheduler (docs/architecture.md, Scheduler kernel) and what proves the cache's execs are
// device-launchable.
//
// Rules this follows (CUDA programming guide, "Device Graph Launch"; docs/gpu-facts.md,
// Device-launchable graphs):
// - a device graph can only be launched from a kernel that itself runs in a graph, so the kernel
//   is captured into a graph of its own, instantiated with cudaGraphInstantiateFlagDeviceLaunch
//   (self-relaunch through cudaGetCurrentGraphExec() needs it to be a device graph), uploaded,
//   and host-launched once;
// - device launches go only into the named streams; a tail launch runs after the launching graph
//   (and earlier tail launches) complete, in enqueue order, so "step, then scheduler again" is
//   two tail launches; a graph may have one pending self-launch and at most 255 tail launches;
// - the launched exec must have been uploaded (GraphCache does) and must not be updated while it
//   runs (GraphCache updates the idle one);
// - the work a host-launched device graph tail-launches completes before later work in the host
//   stream, so an event after TailLauncher::Launch covers every step.
// Needs -rdc=true and cudadevrt (ts_graphs has both).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ts::graphs {

// Written to TailLaunchParams::status: 0 while every launch succeeded; kTailLaunchBadBucket if
// the bucket index was out of range; otherwise the cudaError_t a device-side launch returned.
inline constexpr int32_t kTailLaunchBadBucket = -1;

struct TailLaunchParams {
  const cudaGraphExec_t* table = nullptr;  // [num_buckets], device: GraphCache::device_table()
  int32_t num_buckets = 0;                 // >= 1
  const int32_t* bucket_index = nullptr;   // [1], device: read when the kernel runs
  // [1], device, optional. nullptr: launch the bucket once. Otherwise loop mode: while
  // *remaining_steps > 0, decrement it, tail-launch the bucket, then tail-launch this graph.
  int32_t* remaining_steps = nullptr;
  int32_t* status = nullptr;  // [1], device: see kTailLaunchBadBucket; the caller zeroes it
};

#ifdef __CUDACC__
// For scheduler kernels running in a device graph (one thread): tail-launches the bucket's
// current exec. Returns cudaErrorInvalidValue for an index outside [0, num_buckets).
__device__ inline cudaError_t TailLaunchBucket(const cudaGraphExec_t* table, int32_t num_buckets,
                                               int32_t bucket_index) {
  if (bucket_index < 0 || bucket_index >= num_buckets) return cudaErrorInvalidValue;
  return cudaGraphLaunch(table[bucket_index], cudaStreamGraphTailLaunch);
}
#endif

// Owns the launcher graph: TailLaunchKernel(params) captured alone, instantiated for device
// launch and uploaded. The params (pointers) are baked in; the bucket is read at run time.
class TailLauncher {
 public:
  // Validates params (InvalidArgument naming the field), captures on a private stream, uploads
  // on `stream`.
  static absl::StatusOr<std::unique_ptr<TailLauncher>> Create(const TailLaunchParams& params,
                                                              cudaStream_t stream);
  ~TailLauncher();
  TailLauncher(const TailLauncher&) = delete;
  TailLauncher& operator=(const TailLauncher&) = delete;

  // Host-launches the launcher graph on `stream`. The bucket graph(s) it tail-launches complete
  // before later work on `stream`. Failures of the device-side launches land in params.status.
  absl::Status Launch(cudaStream_t stream);

  cudaGraphExec_t exec() const { return exec_; }

 private:
  explicit TailLauncher(cudaGraphExec_t exec) : exec_(exec) {}
  cudaGraphExec_t exec_;
};

}  // namespace ts::graphs
