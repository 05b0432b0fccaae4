// Fills a bf16 buffer with counter-based uniform values (common/philox.h): the random weights of
// benchmarks and tests, generated on the device so no multi-GiB upload is needed. The same seed
// gives the same values on any launch geometry.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace ts::kernels {

struct FillUniformParams {
  __nv_bfloat16* out = nullptr;  // [n]
  size_t n = 0;                  // 0 launches nothing
  uint64_t seed = 0;
  float lo = 0.f;  // out[i] = bf16(lo + (hi - lo) * UniformFromSeed(seed, i)), in [lo, hi]
  float hi = 1.f;
};

absl::Status LaunchFillUniform(FillUniformParams p, cudaStream_t stream);

}  // namespace ts::kernels
