// Token embedding lookup: out[r] = table[tokens[r]], one 16-byte vector per thread.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace ts::kernels {

struct EmbeddingParams {
  const int32_t* tokens = nullptr;       // [rows]
  const __nv_bfloat16* table = nullptr;  // [vocab, hidden], 16-byte aligned
  __nv_bfloat16* out = nullptr;          // [rows, hidden], 16-byte aligned
  // [1], optional. Tokens are validated at the request edge, so an id outside [0, vocab) is a
  // bug upstream: the row reads the clamped id (never out of bounds) and the kernel stores 1 here
  // for the host to check after the step. Never cleared by the kernel.
  int32_t* error_flag = nullptr;
  int32_t rows = 0;    // >= 0; 0 launches nothing
  int32_t hidden = 0;  // multiple of 8 (16-byte vectors)
  int32_t vocab = 0;   // > 0
};

// Validates params (InvalidArgument naming the field) and enqueues the kernel on `stream`.
// Graph-capturable: no allocation, no sync.
absl::Status LaunchEmbedding(const EmbeddingParams& p, cudaStream_t stream);

}  // namespace ts::kernels
