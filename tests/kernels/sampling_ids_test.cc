// Every id of a row is read by the sampling kernel's passes, wherever the row's start, a split
// CTA's slice and a warp's range fall against the 16-byte vectors the passes load (ForEachValue
// in kernels/sampling.cu reads the ids before and after whole vectors one at a time). Each row
// has one large logit, at an id next to such a boundary; the greedy rows (the first pass) and the
// sampled rows (temperature 1, top_p 0.5, so the walks keep that id alone) must return it.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/sampling.cuh"
#include "tests/kernels/kernel_test_util.h"
#include "tests/kernels/sampling_test_util.h"

namespace ts::kernels {
namespace {

// Ids within 3 of the boundaries of the ranges a launch with `split` CTAs a row reads: each
// slice's start and end and, in the first two slices and the last, each warp's range (the
// kernel's WarpRange over its 32 warps), plus the warps of the whole row (the walks' ranges). If
// the kernel splits differently, these remain valid cases, only less pointed ones.
std::vector<int32_t> IdsNearBoundaries(int32_t vocab, int32_t split) {
  std::set<int32_t> ids;
  auto around = [&](int64_t b) {
    for (int64_t i = b - 3; i <= b + 3; ++i) {
      if (i >= 0 && i < vocab) ids.insert(static_cast<int32_t>(i));
    }
  };
  auto warps = [&](int32_t lo, int32_t hi) {
    const int32_t range = ((hi - lo + 31) / 32 + 31) / 32 * 32;
    for (int32_t b = lo; b < hi; b += range) around(b);
    around(hi);
  };
  const int32_t per = (vocab + split - 1) / split;
  for (int32_t c = 0; c < split; ++c) {
    const int32_t lo = std::min(vocab, c * per), hi = std::min(vocab, lo + per);
    if (c < 2 || c == split - 1) {
      warps(lo, hi);
    } else {
      around(lo);
    }
  }
  warps(0, vocab);
  return {ids.begin(), ids.end()};
}

// One launch: row r's logits are uniform in [-1, 1) except `hot[r]`, at 40 (so every other weight
// rounds to zero in the walks' fixed point). Even rows greedy, odd rows sampled. Returns the
// tokens.
std::vector<int32_t> Launch(const std::vector<int32_t>& hot, int32_t vocab, int32_t split,
                            uint32_t seed) {
  const int32_t rows = static_cast<int32_t>(hot.size());
  std::vector<float> logits(size_t(rows) * vocab);
  uint32_t x = seed | 1u;  // xorshift32: millions of values a launch, so no <random> distribution
  for (float& l : logits) {
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    l = static_cast<float>(x >> 8) * (2.0f / 16777216.0f) - 1.0f;
  }
  std::vector<SamplingRow> params(rows);
  for (int32_t r = 0; r < rows; ++r) {
    logits[size_t(r) * vocab + hot[r]] = 40.0f;
    if (r % 2 == 1) {
      params[r].temperature = 1.0f;
      params[r].top_p = 0.5f;
      params[r].seed = seed + r;
      params[r].position = 7 + r;
    } else {
      params[r].temperature = 0.0f;
    }
  }
  sampling_test::SamplingBuffers buf(logits, params, rows, vocab);
  const absl::Status st = LaunchSampling(buf.Launch(split), nullptr);
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(buf.tokens.GuardsIntact());
  EXPECT_TRUE(buf.workspace.GuardsIntact());
  return buf.tokens.Download();
}

// One vocab and split a test, so that compute-sanitizer can run them side by side (racecheck
// runs the 128256-token rows hundreds of times slower; tests/gpu/run-bundle.sh, SANITIZE_SHARD).
class SamplingIdsTest : public ::testing::TestWithParam<std::tuple<int32_t, int32_t>> {};

TEST_P(SamplingIdsTest, EveryIdNextToARangeBoundaryIsRead) {
  constexpr int32_t kRowsPerLaunch = 64;
  const auto [vocab, split] = GetParam();
  const std::vector<int32_t> ids = IdsNearBoundaries(vocab, split);
  // Each id twice, greedy and sampled; rows of odd vocab start at every alignment.
  std::vector<int32_t> hot;
  for (int32_t id : ids) hot.insert(hot.end(), {id, id});
  for (size_t first = 0; first < hot.size(); first += kRowsPerLaunch) {
    const std::vector<int32_t> part(hot.begin() + first,
                                    hot.begin() + std::min(hot.size(), first + kRowsPerLaunch));
    const std::vector<int32_t> got = Launch(part, vocab, split, vocab + split + first);
    for (size_t r = 0; r < part.size(); ++r) {
      EXPECT_EQ(got[r], part[r]) << (r % 2 == 0 ? "greedy" : "sampled") << " row " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(VocabsAndSplits, SamplingIdsTest,
                         ::testing::Combine(::testing::Values(7, 1000, 50257, 128256),
                                            ::testing::Values(1, 3, kSamplingMaxSplit)),
                         [](const ::testing::TestParamInfo<std::tuple<int32_t, int32_t>>& info) {
                           return "Vocab" + std::to_string(std::get<0>(info.param)) + "_Split" +
                                  std::to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace ts::kernels
