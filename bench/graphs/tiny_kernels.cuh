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
  // Optional, for the device loop's steps: the counter kernel also counts *remaining down and
  // marks *slot_state FINISHED (kernels/postprocess.cuh) when it reaches 0, so the loop exits
  // after exactly that many steps.
  int32_t* remaining = nullptr;   // [1]
  int32_t* slot_state = nullptr;  // [1]
};

// Enqueues the chain on `stream` (graph-capturable); returns the launch error, if any.
cudaError_t EnqueueTinyStep(const TinyStepParams& p, cudaStream_t stream);

}  // namespace ts::graphs::bench
