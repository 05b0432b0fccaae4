// Scheduler::Create's option checks: bucket lists, max_batch, queue_limit and max_context are
// normalised or refused with the option's name, before any request can arrive.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "engine/scheduler.h"
#include "tests/engine/mock_backend.h"

namespace ts {
namespace {

using ::ts::testing::MockBackend;
using ::ts::testing::MockBackendOptions;

absl::StatusOr<std::unique_ptr<Scheduler>> CreateWith(MockBackendOptions mo, EngineOptions eo) {
  return Scheduler::Create(std::move(eo), std::make_unique<MockBackend>(std::move(mo)));
}

TEST(SchedulerOptions, BucketsAreSortedAndMaxBatchClamped) {
  EngineOptions eo;
  eo.buckets = {8, 1, 4, 2, 4};
  auto s = CreateWith({}, eo);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->model_info().buckets, std::vector<int32_t>({1, 2, 4, 8}));
  EXPECT_EQ((*s)->model_info().max_batch, 8);

  MockBackendOptions small;
  small.max_slots = 16;
  s = CreateWith(small, EngineOptions{});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->model_info().max_batch, 16);
  EXPECT_EQ((*s)->model_info().buckets, std::vector<int32_t>({1, 2, 4, 8, 16}));

  eo = EngineOptions{};
  eo.max_batch = 20;
  s = CreateWith({}, eo);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->model_info().max_batch, 20);
  EXPECT_EQ((*s)->model_info().buckets, std::vector<int32_t>({1, 2, 4, 8, 16, 24}));
  EXPECT_EQ((*s)->model_info().max_context, 256);
  EXPECT_EQ((*s)->model_info().max_new_tokens, 255);
  EXPECT_EQ((*s)->model_info().backend, "mock");
}

TEST(SchedulerOptions, BadOptionsNameTheOption) {
  EngineOptions eo;
  eo.buckets = {1, 0, 4};
  EXPECT_EQ(CreateWith({}, eo).status().code(), absl::StatusCode::kInvalidArgument);
  eo = EngineOptions{};
  eo.max_batch = 0;
  EXPECT_TRUE(absl::StartsWith(CreateWith({}, eo).status().message(), "max_batch"));
  eo = EngineOptions{};
  eo.queue_limit = 0;
  EXPECT_TRUE(absl::StartsWith(CreateWith({}, eo).status().message(), "queue_limit"));
  eo = EngineOptions{};
  eo.max_context = 300;  // model allows 256
  EXPECT_TRUE(absl::StartsWith(CreateWith({}, eo).status().message(), "max_context"));
  // One max-length request must fit the whole KV pool.
  MockBackendOptions mo;
  mo.num_kv_blocks = 8;
  mo.kv_block_size = 4;
  eo = EngineOptions{};
  eo.max_context = 64;
  auto s = CreateWith(mo, eo);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StartsWith(s.status().message(), "max_context")) << s.status();
  eo.max_context = 32;
  EXPECT_TRUE(CreateWith(mo, eo).ok());
}

}  // namespace
}  // namespace ts
