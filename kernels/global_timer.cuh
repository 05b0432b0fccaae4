// Reads %globaltimer, the GPU's nanosecond clock that the postprocess kernel checks request
// deadlines against, so the host can map its own clock onto it (CudaBackend::CalibrateClock).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace ts::kernels {

struct ReadGlobalTimerParams {
  uint64_t* out = nullptr;  // [1] device: %globaltimer when the kernel ran
};

// One thread; enqueued on `stream`.
absl::Status LaunchReadGlobalTimer(ReadGlobalTimerParams p, cudaStream_t stream);

}  // namespace ts::kernels
