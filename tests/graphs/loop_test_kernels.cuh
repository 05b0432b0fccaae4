// A stand-in for a decode step, for the device loop tests: one kernel that logs the row list it
// was given (bucket, then every row's slot) and "decodes" each ACTIVE slot's row by counting its
// remaining steps down and its generated count up, finishing the slot at zero as the
// postprocess kernel would.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/postprocess.cuh"

namespace ts::graphs::testing {

struct SimStepParams {
  const int32_t* row_slots = nullptr;  // [bucket] the row list the scheduler wrote
  kernels::SlotRow* slots = nullptr;   // [num_slots]
  int32_t* remaining = nullptr;        // [num_slots] steps left per slot
  int32_t* log = nullptr;              // [max_steps, 1 + max_bucket]
  int32_t* log_count = nullptr;        // [1] steps logged
  int32_t bucket = 0;
  int32_t max_bucket = 0;
  int32_t max_steps = 0;
};

cudaError_t EnqueueSimStep(const SimStepParams& p, cudaStream_t stream);

}  // namespace ts::graphs::testing
