// RequestTimes: when a request was queued, scheduled, got its first token and finished, as the
// stream records them for the server's Timing (docs/serving.md, Timing).
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/scheduler.h"
#include "tests/engine/mock_backend.h"
#include "tests/engine/stream_reader.h"

namespace ts {
namespace {

using Clock = RequestTimes::Clock;
using ::ts::testing::MockBackend;
using ::ts::testing::StreamReader;

constexpr Clock::time_point kUnset{};

// A pause the clock surely shows, so that "not moved" cannot pass by equal timestamps.
void Tick() {
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
}

TEST(RequestStreamTimesTest, EachPointIsSetOnceByItsEvent) {
  const Clock::time_point before = Clock::now();
  RequestStream stream("r", 3);
  const RequestTimes created = stream.times();
  EXPECT_GE(created.submitted, before);
  EXPECT_LE(created.submitted, Clock::now());
  EXPECT_EQ(created.scheduled, kUnset);
  EXPECT_EQ(created.first_token, kUnset);
  EXPECT_EQ(created.finished, kUnset);

  Tick();
  stream.MarkScheduled();
  Tick();
  const Clock::time_point started = Clock::now();
  stream.Append({}, started);  // no token: not the first token's time
  EXPECT_EQ(stream.times().first_token, kUnset);
  EXPECT_EQ(stream.times().prefill_started, kUnset);
  stream.Append(std::vector<int32_t>{7}, started);
  const RequestTimes first = stream.times();
  EXPECT_GT(first.scheduled, created.submitted);
  EXPECT_GT(first.first_token, first.scheduled);
  EXPECT_EQ(first.prefill_started, started);

  Tick();
  stream.Append(std::vector<int32_t>{8, 9}, Clock::now());
  EXPECT_EQ(stream.times().first_token, first.first_token);
  EXPECT_EQ(stream.times().prefill_started, started);
  Tick();
  stream.Finish(FinishReason::kLength, absl::OkStatus());
  const RequestTimes done = stream.times();
  EXPECT_GT(done.finished, first.first_token);
  Tick();
  stream.Finish(FinishReason::kCancelled, absl::OkStatus());  // ignored, like its reason
  EXPECT_EQ(stream.times().finished, done.finished);

  // The consumer's update carries them.
  StreamUpdate update;
  ASSERT_TRUE(stream.Take(&update));
  EXPECT_EQ(update.times.submitted, done.submitted);
  EXPECT_EQ(update.times.scheduled, done.scheduled);
  EXPECT_EQ(update.times.prefill_started, done.prefill_started);
  EXPECT_EQ(update.times.first_token, done.first_token);
  EXPECT_EQ(update.times.finished, done.finished);
}

TEST(RequestStreamTimesTest, TokensAfterTheFinishDoNotSetTheFirstToken) {
  RequestStream stream("r", 1);
  stream.Finish(FinishReason::kCancelled, absl::OkStatus());
  stream.Append(std::vector<int32_t>{5});
  EXPECT_EQ(stream.times().first_token, kUnset);
  EXPECT_NE(stream.times().finished, kUnset);
}

class SchedulerTimesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    EngineOptions eo;
    eo.max_batch = 1;  // the second request queues until the first retires
    auto backend = std::make_unique<MockBackend>(::ts::testing::MockBackendOptions{});
    mock_ = backend.get();
    auto s = Scheduler::Create(std::move(eo), std::move(backend));
    ASSERT_TRUE(s.ok()) << s.status();
    sched_ = std::move(*s);
    mock_->set_buckets(sched_->model_info().buckets);
  }

  std::unique_ptr<StreamReader> Submit(std::string id, int32_t first_prompt_id) {
    GenerateRequest r;
    r.request_id = std::move(id);
    r.prompt = {first_prompt_id, 3};
    r.sampling.temperature = 0.0f;
    r.stop.max_new_tokens = 3;
    auto s = sched_->Submit(std::move(r));
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::make_unique<StreamReader>(*s) : nullptr;
  }

  MockBackend* mock_ = nullptr;
  std::unique_ptr<Scheduler> sched_;
};

TEST_F(SchedulerTimesTest, AQueuedRequestIsScheduledOnlyAfterTheOneAheadFinished) {
  std::unique_ptr<StreamReader> a = Submit("a", 1);
  std::unique_ptr<StreamReader> b = Submit("b", 2);
  ASSERT_TRUE(a && b);
  Tick();
  sched_->Step();  // admits a only
  EXPECT_NE(a->stream->times().scheduled, kUnset);
  EXPECT_EQ(b->stream->times().scheduled, kUnset);
  for (int i = 0; i < 50 && !b->finished; ++i) {
    Tick();
    sched_->Step();
    a->Pull();
    b->Pull();
  }
  ASSERT_TRUE(a->finished && b->finished);
  for (StreamReader* r : {a.get(), b.get()}) {
    const RequestTimes t = r->stream->times();
    SCOPED_TRACE(r->stream->id());
    EXPECT_EQ(r->tokens.size(), 3u);
    // Each phase took at least one Tick: the scheduler steps after a Tick.
    EXPECT_GT(t.scheduled, t.submitted);
    EXPECT_GE(t.first_token, t.scheduled);
    EXPECT_GT(t.finished, t.first_token);
  }
  // b waited for a's slot: scheduled in the step after the one that retired a.
  EXPECT_GT(b->stream->times().scheduled, a->stream->times().finished);
}

// The backend's report of when it began the prompt's prefill is taken with the first tokens, and
// only then; a backend with no report leaves it unset.
TEST_F(SchedulerTimesTest, ThePrefillStartIsTheBackendsReportAtTheFirstToken) {
  std::unique_ptr<StreamReader> a = Submit("a", 1);
  ASSERT_TRUE(a);
  const Clock::time_point reported = Clock::now() + std::chrono::milliseconds(5);
  mock_->set_prefill_started(0, reported);  // a takes slot 0
  sched_->Step();                           // a's prefill, its first tokens drained
  a->Pull();
  ASSERT_FALSE(a->tokens.empty());
  ASSERT_FALSE(a->finished);
  EXPECT_EQ(a->stream->times().prefill_started, reported);
  mock_->set_prefill_started(0, reported + std::chrono::seconds(1));
  for (int i = 0; i < 10 && !a->finished; ++i) {
    sched_->Step();
    a->Pull();
  }
  ASSERT_TRUE(a->finished);
  EXPECT_EQ(a->stream->times().prefill_started, reported) << "moved after the first token";

  // b takes slot 0 again, now with no report.
  std::unique_ptr<StreamReader> b = Submit("b", 2);
  mock_->set_prefill_started(0, kUnset);
  sched_->Step();
  b->Pull();
  ASSERT_FALSE(b->tokens.empty());
  EXPECT_EQ(b->stream->times().prefill_started, kUnset);
}

TEST_F(SchedulerTimesTest, ARequestCancelledInTheQueueIsNeverScheduled) {
  std::unique_ptr<StreamReader> a = Submit("a", 1);
  std::unique_ptr<StreamReader> b = Submit("b", 2);
  ASSERT_TRUE(a && b);
  sched_->Step();
  sched_->Cancel("b");
  sched_->Step();
  b->Pull();
  ASSERT_TRUE(b->finished);
  const RequestTimes t = b->stream->times();
  EXPECT_EQ(t.scheduled, kUnset);
  EXPECT_EQ(t.first_token, kUnset);
  EXPECT_GE(t.finished, t.submitted);
}

}  // namespace
}  // namespace ts
