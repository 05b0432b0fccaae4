// The open-loop Poisson schedule: seeded, monotone, and exponential with mean 1 / rate.
#include "bench/load/arrivals.h"

#include <cmath>
#include <limits>
#include <vector>

#include "bench/load/random.h"
#include "gtest/gtest.h"

namespace ts::load {
namespace {

std::vector<double> Times(double rate, uint64_t seed, int64_t n) {
  auto times = IntendedTimes({.rate_per_s = rate, .seed = seed}, n);
  EXPECT_TRUE(times.ok()) << times.status();
  return times.ok() ? *times : std::vector<double>{};
}

TEST(ArrivalsTest, SameSeedRepeatsDifferentSeedDiffers) {
  const std::vector<double> a = Times(20, 7, 1000);
  const std::vector<double> b = Times(20, 7, 1000);
  const std::vector<double> c = Times(20, 8, 1000);
  EXPECT_EQ(a, b);
  ASSERT_EQ(a.size(), c.size());
  int64_t same = 0;
  for (size_t i = 1; i < a.size(); ++i) same += a[i] == c[i];
  EXPECT_EQ(same, 0);
}

TEST(ArrivalsTest, StartsAtZeroAndNeverDecreases) {
  const std::vector<double> t = Times(1000, 3, 20000);
  ASSERT_EQ(t.size(), 20000u);
  EXPECT_EQ(t[0], 0.0);
  for (size_t i = 1; i < t.size(); ++i) ASSERT_GE(t[i], t[i - 1]) << "at " << i;
  EXPECT_GT(t.back(), 0.0);
}

TEST(ArrivalsTest, GapsAreExponentialWithMeanOneOverRate) {
  constexpr double kRate = 50;
  constexpr int64_t kN = 200000;
  const std::vector<double> t = Times(kRate, 12345, kN + 1);
  double sum = 0, sum_sq = 0;
  int64_t below_mean = 0;
  for (int64_t i = 1; i <= kN; ++i) {
    const double gap = t[i] - t[i - 1];
    sum += gap;
    sum_sq += gap * gap;
    below_mean += gap < 1.0 / kRate;
  }
  const double mean = sum / kN;
  // Standard error of the mean is (1/rate) / sqrt(n) = 0.22%; allow 1%.
  EXPECT_NEAR(mean, 1.0 / kRate, 0.01 / kRate);
  // Exponential: variance = mean^2, and P(gap < mean) = 1 - 1/e.
  const double var = sum_sq / kN - mean * mean;
  EXPECT_NEAR(var, 1.0 / (kRate * kRate), 0.03 / (kRate * kRate));
  EXPECT_NEAR(static_cast<double>(below_mean) / kN, 1.0 - std::exp(-1.0), 0.005);
}

TEST(ArrivalsTest, ExponentialGapInvertsTheCdf) {
  EXPECT_DOUBLE_EQ(ExponentialGap(4, 0.0), 0.0);
  EXPECT_NEAR(ExponentialGap(2, 1.0 - std::exp(-1.0)), 0.5, 1e-12);
  EXPECT_NEAR(ExponentialGap(10, 0.5), std::log(2.0) / 10, 1e-12);
  EXPECT_TRUE(std::isfinite(ExponentialGap(1, std::nextafter(1.0, 0.0))));
}

TEST(ArrivalsTest, InfiniteRateIsABurst) {
  const std::vector<double> t = Times(std::numeric_limits<double>::infinity(), 1, 50);
  ASSERT_EQ(t.size(), 50u);
  for (double v : t) EXPECT_EQ(v, 0.0);
}

TEST(ArrivalsTest, RejectsNonPositiveRate) {
  for (double rate : {0.0, -1.0, std::nan("")}) {
    const auto a = PoissonArrivals::Create({.rate_per_s = rate, .seed = 0});
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument) << rate;
  }
}

TEST(RandomTest, Uniform01IsInRangeAndCentred) {
  double sum = 0;
  double lo = 1, hi = 0;
  constexpr int kN = 100000;
  for (int i = 0; i < kN; ++i) {
    const double u = Uniform01(99, static_cast<uint64_t>(i), Stream::kArrival);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    lo = std::min(lo, u);
    hi = std::max(hi, u);
  }
  EXPECT_NEAR(sum / kN, 0.5, 0.005);
  EXPECT_LT(lo, 1e-3);
  EXPECT_GT(hi, 1 - 1e-3);
  // Streams are independent draws, not copies.
  EXPECT_NE(Uniform01(99, 5, Stream::kArrival), Uniform01(99, 5, Stream::kInputLen));
}

}  // namespace
}  // namespace ts::load
