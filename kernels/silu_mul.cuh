// SwiGLU activation: out = silu(gate) * up, with gate and up side by side in one row as a fused
// gate_up GEMM writes them. Rounded as transformers' bf16 LlamaMLP: silu(gate) in fp32, rounded
// to bf16, times up, rounded again.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace ts::kernels {

struct SiluMulParams {
  const __nv_bfloat16* in = nullptr;  // [rows, 2 * intermediate]: gate | up
  __nv_bfloat16* out = nullptr;       // [rows, intermediate]; must not overlap `in`
  int32_t rows = 0;                   // >= 0; 0 launches nothing
  int32_t intermediate = 0;           // multiple of 8 (16-byte vectors)
  // Programmatic dependent launch (kernels/pdl.cuh): may start while the kernel before it (the
  // gate_up GEMM) drains, and waits for it before reading `in` or writing `out`.
  bool pdl = false;
};

// Validates params (InvalidArgument naming the field) and enqueues the kernel on `stream`.
// Graph-capturable: no allocation, no sync.
absl::Status LaunchSiluMul(const SiluMulParams& p, cudaStream_t stream);

}  // namespace ts::kernels
