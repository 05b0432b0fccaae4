// A small persistent fork-join pool for the CPU reference model. Threads are started once and
// parked on a condition variable, because a decode step issues ~10 parallel regions per layer and
// spawning threads per region would cost more than the work of a tiny model.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ts {

// Items per range so that each range carries at least ~32K multiply-adds: waking a parked thread
// costs microseconds, more than a tiny model's whole GEMM, so small jobs run inline.
// The result is a multiple of `multiple`.
inline int64_t GrainFor(int64_t work_per_item, int64_t multiple = 1) {
  constexpr int64_t kMinWork = int64_t{1} << 15;
  const int64_t items = (kMinWork + work_per_item - 1) / (work_per_item > 0 ? work_per_item : 1);
  return (items + multiple - 1) / multiple * multiple;
}

class ThreadPool {
 public:
  // num_threads counts the calling thread: 1 runs everything inline. 0 = hardware concurrency.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Splits [0, n) into at most num_threads() contiguous ranges whose boundaries are multiples of
  // `grain` (except the end) and runs fn(begin, end) on each, the caller taking the first range.
  // Returns when all ranges are done. Not reentrant: fn must not call ParallelFor on this pool.
  void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void WorkerLoop(int index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  std::vector<int64_t> bounds_;  // [num_threads+1] range boundaries of the current job
  uint64_t generation_ = 0;      // bumped per job so a worker runs each job exactly once
  int pending_ = 0;              // workers still running the current job
  bool stop_ = false;
};

}  // namespace ts
