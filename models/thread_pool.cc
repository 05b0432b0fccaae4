#include "models/thread_pool.h"

#include <algorithm>

namespace ts {

ThreadPool::ThreadPool(int num_threads, int64_t min_work)
    : min_work_(min_work > 0 ? min_work : kDefaultMinWork) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::thread::hardware_concurrency());
  num_threads = std::max(num_threads, 1);
  bounds_.assign(num_threads + 1, 0);
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  while (true) {
    const std::function<void(int64_t, int64_t)>* job;
    int64_t begin, end;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      begin = bounds_[index];
      end = bounds_[index + 1];
    }
    if (begin < end) (*job)(begin, end);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain,
                             const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t units = (n + grain - 1) / grain;
  const int parts = static_cast<int>(std::min<int64_t>(num_threads(), units));
  if (parts <= 1) {
    fn(0, n);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int threads = num_threads();
    for (int i = 0; i <= threads; ++i) {
      const int64_t u = units * std::min(i, parts) / parts;
      bounds_[i] = std::min(n, u * grain);
    }
    job_ = &fn;
    pending_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  work_cv_.notify_all();
  fn(bounds_[0], bounds_[1]);
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
}

}  // namespace ts
