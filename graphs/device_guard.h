// Makes one device current for a scope and restores the caller's device after it. The CUDA
// runtime's current device is per host thread: an object that owns memory, streams and graphs
// on device N must set N on whatever thread calls it (the engine thread, a gRPC thread, a
// test's std::thread), not only on the thread that created it.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/statusor.h"
#include "kernels/cuda_check.h"

namespace ts::graphs {

class DeviceGuard {
 public:
  static absl::StatusOr<DeviceGuard> Set(int device) {
    int previous = 0;
    TS_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous));
    if (previous != device) TS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    return DeviceGuard(previous, previous != device);
  }
  // For destructors, which cannot report: errors are ignored (the calls that follow fail and
  // are ignored too).
  static DeviceGuard SetOrIgnore(int device) {
    int previous = 0;
    if (cudaGetDevice(&previous) != cudaSuccess) return DeviceGuard(0, false);
    if (previous == device) return DeviceGuard(previous, false);
    return DeviceGuard(previous, cudaSetDevice(device) == cudaSuccess);
  }
  DeviceGuard(DeviceGuard&& o) noexcept : previous_(o.previous_), restore_(o.restore_) {
    o.restore_ = false;
  }
  DeviceGuard& operator=(DeviceGuard&&) = delete;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (restore_) (void)cudaSetDevice(previous_);
  }

 private:
  DeviceGuard(int previous, bool restore) : previous_(previous), restore_(restore) {}
  int previous_;
  bool restore_;
};

}  // namespace ts::graphs
