#include "bench/load/arrivals.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "bench/load/random.h"

namespace ts::load {

double ExponentialGap(double rate_per_s, double u01) {
  if (std::isinf(rate_per_s)) return 0.0;
  // 1 - u is in (0, 1], so the log is finite.
  return -std::log1p(-u01) / rate_per_s;
}

absl::StatusOr<PoissonArrivals> PoissonArrivals::Create(const ArrivalOptions& options) {
  if (!(options.rate_per_s > 0.0) || std::isnan(options.rate_per_s)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rate: must be > 0 requests/s (or inf), got ", options.rate_per_s));
  }
  return PoissonArrivals(options);
}

double PoissonArrivals::Next() {
  const int64_t i = next_index_++;
  if (i > 0) {
    last_s_ += ExponentialGap(options_.rate_per_s,
                              Uniform01(options_.seed, static_cast<uint64_t>(i), Stream::kArrival));
  }
  return last_s_;
}

absl::StatusOr<std::vector<double>> IntendedTimes(const ArrivalOptions& options, int64_t n) {
  auto arrivals = PoissonArrivals::Create(options);
  if (!arrivals.ok()) return arrivals.status();
  std::vector<double> times;
  times.reserve(static_cast<size_t>(std::max<int64_t>(n, 0)));
  for (int64_t i = 0; i < n; ++i) times.push_back(arrivals->Next());
  return times;
}

}  // namespace ts::load
