// The memory roof every benchmark states its times against: device-to-device copy bandwidth
// (bytes read + written per second) measured in the same run. A fixed figure would be one card's:
// the H200 copies at ~4.2-4.3 TB/s, the H100 at ~3.0 (docs/gpu-facts.md, Bandwidth roof), and a
// kernel's share of its roof on one is not its share on the other.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace ts::bench {

// Median of ten timed 2 GiB copies (after two untimed) between two buffers of non-zero bytes, on
// the current device's legacy stream; GB/s counts the read and the write. A benchmark without its
// roof has nothing to report, so a CUDA error ends the process, as BENCH_CUDA does.
inline double MeasureCopyBandwidthGbps() {
  auto check = [](cudaError_t e, const char* what) {
    if (e == cudaSuccess) return;
    std::fprintf(stderr, "copy bandwidth: %s failed: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  };
  const size_t bytes = size_t{2} << 30;
  void* a = nullptr;
  void* b = nullptr;
  check(cudaMalloc(&a, bytes), "cudaMalloc");
  check(cudaMalloc(&b, bytes), "cudaMalloc");
  check(cudaMemset(a, 1, bytes), "cudaMemset");  // never time on zeros
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "cudaEventCreate");
  check(cudaEventCreate(&e1), "cudaEventCreate");
  std::vector<double> gbps;
  for (int rep = 0; rep < 12; ++rep) {
    check(cudaEventRecord(e0), "cudaEventRecord");
    check(cudaMemcpyAsync(rep % 2 ? a : b, rep % 2 ? b : a, bytes, cudaMemcpyDeviceToDevice),
          "cudaMemcpyAsync");
    check(cudaEventRecord(e1), "cudaEventRecord");
    check(cudaEventSynchronize(e1), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
    if (rep >= 2) gbps.push_back(2.0 * bytes / (ms * 1e-3) / 1e9);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  check(cudaFree(a), "cudaFree");
  check(cudaFree(b), "cudaFree");
  std::nth_element(gbps.begin(), gbps.begin() + gbps.size() / 2, gbps.end());
  return gbps[gbps.size() / 2];
}

}  // namespace ts::bench
