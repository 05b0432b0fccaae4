// GraphCache's checks that run before any GPU work: option validation (InvalidArgument naming the
// field), bucket lookup, and calls made before Build. Runs without a GPU.
#include <gtest/gtest.h>

#include <string>

#include "graphs/graph_cache.h"

namespace ts::graphs {
namespace {

CaptureFn NoopCapture() {
  return [](const CaptureContext&, cudaStream_t) { return absl::OkStatus(); };
}

GraphCacheOptions Valid() {
  GraphCacheOptions opt;
  opt.buckets = {1, 8, 32};
  opt.capture = NoopCapture();
  opt.log_progress = false;
  return opt;
}

void ExpectInvalid(GraphCacheOptions opt, const std::string& field) {
  GraphCache cache(std::move(opt));
  const absl::Status s = cache.Build(/*stream=*/nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find(field), std::string::npos)
      << "message does not name " << field << ": " << s;
  EXPECT_FALSE(cache.built());
}

TEST(GraphCacheOptionsTest, RejectsBadOptionsNamingTheField) {
  GraphCacheOptions o = Valid();
  o.buckets.clear();
  ExpectInvalid(o, "graph_cache.buckets");
  o = Valid();
  o.buckets = {0, 4};
  ExpectInvalid(o, "graph_cache.buckets[0]");
  o = Valid();
  o.buckets = {1, 8, 8};
  ExpectInvalid(o, "strictly increasing");
  o = Valid();
  o.buckets = {4, 2};
  ExpectInvalid(o, "strictly increasing");
  o = Valid();
  o.capture = nullptr;
  ExpectInvalid(o, "graph_cache.capture");
  o = Valid();
  o.device = -1;
  ExpectInvalid(o, "graph_cache.device");
  o = Valid();
  o.initial_regime.attention_num_splits = 0;
  ExpectInvalid(o, "graph_cache.initial_regime");
  o = Valid();
  o.initial_regime.max_context_len = -5;
  ExpectInvalid(o, "graph_cache.initial_regime");
}

TEST(GraphCacheOptionsTest, BucketIndexForPicksTheSmallestBucketThatHolds) {
  GraphCache cache(Valid());
  EXPECT_EQ(*cache.BucketIndexFor(1), 0);
  EXPECT_EQ(*cache.BucketIndexFor(2), 1);
  EXPECT_EQ(*cache.BucketIndexFor(8), 1);
  EXPECT_EQ(*cache.BucketIndexFor(9), 2);
  EXPECT_EQ(*cache.BucketIndexFor(32), 2);
  EXPECT_EQ(cache.BucketIndexFor(33).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(cache.BucketIndexFor(0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(GraphCacheOptionsTest, CallsBeforeBuildFailCleanly) {
  GraphCache cache(Valid());
  EXPECT_FALSE(cache.built());
  EXPECT_EQ(cache.Launch(0, nullptr).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache.UpdateRegime(Regime{}, nullptr).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache.device_table(), nullptr);
  EXPECT_EQ(cache.current_exec(2), nullptr);
  EXPECT_EQ(cache.num_buckets(), 3);
  EXPECT_EQ(cache.regime(), Regime{});
  EXPECT_EQ(RegimeDebugString(Regime{.attention_num_splits = 4, .max_context_len = 512}),
            "attention_num_splits=4 max_context_len=512");
}

}  // namespace
}  // namespace ts::graphs
