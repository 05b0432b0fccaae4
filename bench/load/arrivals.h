// Open-loop arrival process: a seeded Poisson process of intended send times. The load client
// measures every latency from these intended times, so a server (or client) that falls behind
// shows up as latency instead of silently lowering the offered rate (coordinated omission).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace ts::load {

struct ArrivalOptions {
  double rate_per_s = 1.0;  // > 0; +inf sends every request at time 0 (a burst)
  uint64_t seed = 0;
};

// Exponential inter-arrival gap in seconds for a uniform draw u in [0, 1).
double ExponentialGap(double rate_per_s, double u01);

class PoissonArrivals {
 public:
  static absl::StatusOr<PoissonArrivals> Create(const ArrivalOptions& options);

  // Intended send time of the next request, in seconds since the run started. The first request
  // is at 0 (the run starts with a send, not with an idle gap); request i > 0 follows request i-1
  // by ExponentialGap(rate, Uniform01(seed, i, kArrival)). Never decreases.
  double Next();
  int64_t count() const { return next_index_; }

 private:
  explicit PoissonArrivals(const ArrivalOptions& options) : options_(options) {}

  ArrivalOptions options_;
  int64_t next_index_ = 0;
  double last_s_ = 0.0;
};

// The first n intended send times of a fresh process (test and planning helper).
absl::StatusOr<std::vector<double>> IntendedTimes(const ArrivalOptions& options, int64_t n);

}  // namespace ts::load
