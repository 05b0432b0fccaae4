// Shared harness for the GPU micro-benchmarks: fail-fast checks, and timing of a captured graph's
// replays with CUDA events after warm-up (METHOD.md: events, warm-up, medians; graphs hide the
// launch gaps between the kernels under test).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "absl/status/status.h"

#define BENCH_CUDA(expr)                                                                       \
  do {                                                                                         \
    const cudaError_t e_ = (expr);                                                             \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #expr, cudaGetErrorString(e_), __FILE__, \
                   __LINE__);                                                                  \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

namespace ts::bench {

inline void CheckOk(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

// Captures `enqueue` into one graph, replays it `warmup` times, then times `iters` replays, each
// between two events on `stream`. Returns the replay times in microseconds, sorted ascending.
// `instantiate_flags` and `setup` (called on the exec once, before the replays, e.g. to disable
// nodes) are for benchmarks of the exec itself.
inline std::vector<double> TimeGraphReplays(
    cudaStream_t stream, int warmup, int iters,
    const std::function<absl::Status(cudaStream_t)>& enqueue,
    unsigned long long instantiate_flags = 0,
    const std::function<void(cudaGraphExec_t)>& setup = {}) {
  cudaGraph_t graph;
  BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const absl::Status st = enqueue(stream);
  BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
  CheckOk(st, "launch under capture");
  cudaGraphExec_t exec;
  BENCH_CUDA(cudaGraphInstantiate(&exec, graph, instantiate_flags));
  if (setup) setup(exec);
  for (int i = 0; i < warmup; ++i) BENCH_CUDA(cudaGraphLaunch(exec, stream));
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  std::vector<double> us;
  for (int i = 0; i < iters; ++i) {
    BENCH_CUDA(cudaEventRecord(a, stream));
    BENCH_CUDA(cudaGraphLaunch(exec, stream));
    BENCH_CUDA(cudaEventRecord(b, stream));
    BENCH_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
    us.push_back(ms * 1000.0);
  }
  BENCH_CUDA(cudaEventDestroy(a));
  BENCH_CUDA(cudaEventDestroy(b));
  BENCH_CUDA(cudaGraphExecDestroy(exec));
  BENCH_CUDA(cudaGraphDestroy(graph));
  std::sort(us.begin(), us.end());
  return us;
}

}  // namespace ts::bench
