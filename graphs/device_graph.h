// One kernel captured alone into a graph instantiated for device launch: what the device-side
// launchers (graphs/tail_launch.cuh, graphs/device_loop.cuh) run as, since a device graph can be
// launched only from a kernel that itself runs in a device graph.
#pragma once

#include <cuda_runtime.h>

#include <functional>

#include "absl/status/statusor.h"

namespace ts::graphs {

// Captures what `enqueue` launches on a private stream (thread-local capture mode) and
// instantiates it with cudaGraphInstantiateFlagDeviceLaunch. `enqueue` returns its launch error.
// The caller owns the exec (cudaGraphExecDestroy) and uploads it before the first launch.
absl::StatusOr<cudaGraphExec_t> CaptureForDeviceLaunch(
    const std::function<cudaError_t(cudaStream_t)>& enqueue);

}  // namespace ts::graphs
