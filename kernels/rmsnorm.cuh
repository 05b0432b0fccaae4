// Fused residual add + RMSNorm, one CTA per row, 16-byte vectors, the row held in registers:
//   if x != nullptr:  residual = bf16(residual + x)        (in place)
//   out = bf16(weight * bf16(residual * rsqrt(mean(residual^2) + eps)))
// Rounded where transformers' LlamaRMSNorm rounds in a bf16 model: the residual stream is bf16
// (each add rounded), the sum of squares and the scaling are fp32, the normalised value is
// rounded to bf16 before the weight multiply and the product again.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace ts::kernels {

struct RmsNormParams {
  // [rows, hidden], optional: the sublayer output added into the residual first. May alias `out`
  // (each element is read before the same thread writes it); must not alias `residual`.
  const __nv_bfloat16* x = nullptr;
  __nv_bfloat16* residual = nullptr;      // [rows, hidden], updated in place when x != nullptr
  const __nv_bfloat16* weight = nullptr;  // [hidden]
  __nv_bfloat16* out = nullptr;           // [rows, hidden]; must not alias `residual`
  int32_t rows = 0;                       // >= 0; 0 launches nothing
  int32_t hidden = 0;                     // multiple of 8, <= kRmsNormMaxHidden
  float eps = 1e-6f;                      // > 0
  // Programmatic dependent launch (kernels/pdl.cuh): the kernel may start while the one before it
  // drains. It prefetches its weight row first (nothing in a step writes weights) and waits
  // before it touches x, residual or out.
  bool pdl = false;
};

inline constexpr int32_t kRmsNormMaxHidden = 32768;

// Validates params (InvalidArgument naming the field) and enqueues the kernel on `stream`.
// Graph-capturable: no allocation, no sync.
absl::Status LaunchRmsNorm(const RmsNormParams& p, cudaStream_t stream);

}  // namespace ts::kernels
