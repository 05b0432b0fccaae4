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

class ThreadPool {
 public:
  // Waking a parked thread costs microseconds, more than a tiny model's whole GEMM, so a range
  // should carry at least this many multiply-adds (see Grain).
  static constexpr int64_t kDefaultMinWork = int64_t{1} << 15;

  // num_threads counts the calling thread: 1 runs everything inline. 0 = hardware concurrency.
  // min_work <= 0 means kDefaultMinWork; 1 splits every job (tests use it to exercise threading).
  explicit ThreadPool(int num_threads, int64_t min_work = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Items per range so that each range carries at least min_work units when one item costs
  // `work_per_item`; a multiple of `multiple`. Pass it as ParallelFor's grain.
  int64_t Grain(int64_t work_per_item, int64_t multiple = 1) const {
    const int64_t per = work_per_item > 0 ? work_per_item : 1;
    const int64_t items = (min_work_ + per - 1) / per;
    return (items + multiple - 1) / multiple * multiple;
  }

  // Splits [0, n) into at most num_threads() contiguous ranges whose boundaries are multiples of
  // `grain` (except the end) and runs fn(begin, end) on each, the caller taking the first range.
  // Returns when all ranges are done. Not reentrant: fn must not call ParallelFor on this pool.
  void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void WorkerLoop(int index);

  int64_t min_work_;
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
