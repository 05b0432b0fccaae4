// What tailserve-bench times steps with besides CUDA events: the device timestamps the backend's
// kernels write at every step (kernels/step_stamps.cuh), and busy host threads that load the CPUs
// the way a serving host's gRPC streams and tokenizers do.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/status.h"
#include "kernels/cuda_check.h"
#include "kernels/step_stamps.cuh"

namespace ts::bench {

// Busy threads, one spinning loop each, for as long as it lives.
class HostLoad {
 public:
  explicit HostLoad(int32_t per_core) {
    const int32_t n = per_core * static_cast<int32_t>(std::thread::hardware_concurrency());
    for (int32_t i = 0; i < n; ++i) {
      threads_.emplace_back([this] {
        volatile uint64_t x = 0;
        while (!stop_.load(std::memory_order_relaxed)) x = x + 1;
      });
    }
  }
  ~HostLoad() {
    stop_.store(true);
    for (auto& t : threads_) t.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

// The device StepStamps the backend's kernels write, and its arrays.
class Stamps {
 public:
  static absl::StatusOr<std::unique_ptr<Stamps>> Create(uint32_t capacity) {
    auto s = std::unique_ptr<Stamps>(new Stamps());
    s->capacity_ = capacity;
    TS_CUDA_RETURN_IF_ERROR(cudaMalloc(&s->dev_, sizeof(kernels::StepStamps)));
    TS_CUDA_RETURN_IF_ERROR(cudaMalloc(&s->start_, capacity * sizeof(unsigned long long)));
    TS_CUDA_RETURN_IF_ERROR(cudaMalloc(&s->gap_, capacity * sizeof(unsigned long long)));
    TS_CUDA_RETURN_IF_ERROR(cudaMalloc(&s->launch_, capacity * sizeof(unsigned long long)));
    TS_RETURN_IF_ERROR(s->Reset());
    return s;
  }
  ~Stamps() {
    cudaFree(dev_);
    cudaFree(start_);
    cudaFree(gap_);
    cudaFree(launch_);
  }
  kernels::StepStamps* device() const { return dev_; }
  absl::Status Reset() {
    const kernels::StepStamps h{
        .capacity = capacity_, .start_ns = start_, .gap_ns = gap_, .launch_ns = launch_};
    TS_CUDA_RETURN_IF_ERROR(cudaMemcpy(dev_, &h, sizeof(h), cudaMemcpyHostToDevice));
    return absl::OkStatus();
  }
  // Step periods (ms, start to next start) and idle gaps (us) of the stamped steps, and the part
  // of each gap from the device loop's tail-launch call to the step's start (us; none for
  // host-launched steps).
  absl::Status Read(std::vector<double>* period_ms, std::vector<double>* gap_us,
                    std::vector<double>* launch_us) const {
    kernels::StepStamps h;
    TS_CUDA_RETURN_IF_ERROR(cudaMemcpy(&h, dev_, sizeof(h), cudaMemcpyDeviceToHost));
    const uint32_t n = std::min(h.count, capacity_);
    std::vector<unsigned long long> start(n), gap(n), launch(n);
    TS_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(start.data(), start_, n * sizeof(start[0]), cudaMemcpyDeviceToHost));
    TS_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(gap.data(), gap_, n * sizeof(gap[0]), cudaMemcpyDeviceToHost));
    TS_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(launch.data(), launch_, n * sizeof(launch[0]), cudaMemcpyDeviceToHost));
    for (uint32_t i = 0; i < n; ++i) {
      gap_us->push_back(gap[i] * 1e-3);
      if (launch[i] != 0) launch_us->push_back(launch[i] * 1e-3);
      if (i > 0) period_ms->push_back((start[i] - start[i - 1]) * 1e-6);
    }
    return absl::OkStatus();
  }

 private:
  Stamps() = default;
  uint32_t capacity_ = 0;
  kernels::StepStamps* dev_ = nullptr;
  unsigned long long* start_ = nullptr;
  unsigned long long* gap_ = nullptr;
  unsigned long long* launch_ = nullptr;
};

}  // namespace ts::bench
