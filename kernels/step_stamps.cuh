// Device timestamps of decode steps, for benchmarks (tailserve-bench --modes): the step's first
// kernel (the prepare kernel) stamps its start and the time since the previous step's last kernel
// (the postprocess) ended, which is the GPU's idle gap between two steps whatever launched them:
// a host graph launch after a sync, or the device loop's scheduler kernel and tail launch. The
// device loop's scheduler also stamps the moment it calls the tail launch, which splits its gap
// into the scheduler's own work and the launch plus the graph boundary. The benchmark allocates and
// zeroes one StepStamps in device memory and hands its address to the backend; production passes
// nullptr and the kernels skip all of it.
#pragma once

#include <cstdint>

namespace ts::kernels {

struct StepStamps {
  unsigned long long last_end_ns = 0;      // postprocess end of the newest step; 0 before the first
  unsigned long long last_launch_ns = 0;   // the device loop's newest tail-launch call; 0: none
  unsigned int count = 0;                  // steps stamped (the first step has no gap: not counted)
  unsigned int capacity = 0;               // entries of the arrays; stamps wrap around
  unsigned long long* start_ns = nullptr;  // [capacity] %globaltimer at a step's first kernel
  unsigned long long* gap_ns = nullptr;    // [capacity] that minus the previous step's end
  // [capacity] the step's start minus the tail-launch call that launched it, 0 where no device
  // loop launched it (host-driven steps)
  unsigned long long* launch_ns = nullptr;
};

#ifdef __CUDACC__
__device__ inline unsigned long long GlobalTimerNs() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One thread, at the start of a step's first kernel.
__device__ inline void StampStepStart(StepStamps* s) {
  const unsigned long long now = GlobalTimerNs();
  const unsigned long long last = *static_cast<volatile unsigned long long*>(&s->last_end_ns);
  const unsigned long long launch = *static_cast<volatile unsigned long long*>(&s->last_launch_ns);
  if (last == 0 || s->capacity == 0) return;
  const unsigned int i = s->count++ % s->capacity;
  s->start_ns[i] = now;
  s->gap_ns[i] = now > last ? now - last : 0;
  s->launch_ns[i] = launch > last && now > launch ? now - launch : 0;
}

// One thread of the device loop's scheduler, just before its tail launch.
__device__ inline void StampStepLaunch(StepStamps* s) {
  *static_cast<volatile unsigned long long*>(&s->last_launch_ns) = GlobalTimerNs();
}

// One thread, after every thread of the step's last kernel (block 0) has done its work.
__device__ inline void StampStepEnd(StepStamps* s) {
  *static_cast<volatile unsigned long long*>(&s->last_end_ns) = GlobalTimerNs();
}
#endif

}  // namespace ts::kernels
