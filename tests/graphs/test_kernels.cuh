// The step the graph tests capture: a few dependent kernels whose output is a known function of
// the bucket and the regime, plus a step counter. Host-includable; kernels live in the .cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ts::graphs::testing {

struct TestStepParams {
  float* out = nullptr;         // [width], this bucket's slice
  int32_t* counter = nullptr;   // [1], incremented once per step
  int32_t width = 0;            // >= 1
  int32_t bucket = 0;           // batch size of the graph being captured
  int32_t splits = 1;           // Regime::attention_num_splits
  int32_t max_context_len = 0;  // Regime::max_context_len
  // Adds a "combine" kernel only when splits > 1: a capture whose topology depends on the regime,
  // which UpdateRegime must refuse.
  bool combine_only_when_split = false;
};

// Enqueues write -> affine -> count (-> combine) on `stream`; returns the launch error, if any.
cudaError_t EnqueueTestStep(const TestStepParams& p, cudaStream_t stream);
// Number of kernel nodes EnqueueTestStep records for these params.
int32_t TestStepNodes(const TestStepParams& p);

// out[i] after one step: write gives bucket*100 + splits*7 + ctx/4 + i, affine multiplies by
// `splits` and adds `bucket`; combine leaves it. Exact in fp32 for the sizes the tests use.
inline float ExpectedTestValue(int32_t bucket, int32_t splits, int32_t max_context_len, int32_t i) {
  const float base = static_cast<float>(bucket) * 100.0f + static_cast<float>(splits) * 7.0f +
                     static_cast<float>(max_context_len) * 0.25f + static_cast<float>(i);
  return base * static_cast<float>(splits) + static_cast<float>(bucket);
}

}  // namespace ts::graphs::testing
