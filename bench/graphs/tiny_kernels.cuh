// The step tailserve-graph-bench captures: a chain of tiny one-block kernels plus a step counter,
// so a graph of N nodes costs about N launch latencies and nothing else. Host-includable.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ts::graphs::bench {

inline constexpr int32_t kTinyWidth = 128;  // one block of 128 threads per kernel

struct TinyStepParams {
  float* buf = nullptr;        // [kTinyWidth], random non-zero values
  int32_t* counter = nullptr;  // [1], +1 per step: proves how many steps ran
  int32_t nodes = 0;           // >= 1: nodes - 1 tiny kernels, then the counter
  float shift = 0.0f;          // regime-dependent argument of every tiny kernel
};

// Enqueues the chain on `stream` (graph-capturable); returns the launch error, if any.
cudaError_t EnqueueTinyStep(const TinyStepParams& p, cudaStream_t stream);

}  // namespace ts::graphs::bench
