// Steps the scheduler over a scripted backend, one iteration at a time, and asserts which requests
// ran, with which bucket, and how many tokens each stream holds after every step.
#include "engine/scheduler.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/engine/mock_backend.h"
#include "tests/engine/stream_reader.h"

namespace ts {
namespace {

using ::ts::testing::DefaultMockToken;
using ::ts::testing::MockBackend;
using ::ts::testing::MockBackendOptions;
using ::ts::testing::StreamReader;
using Ids = std::vector<std::string>;

class SchedulerTest : public ::testing::Test {
 protected:
  void Make(MockBackendOptions mo = {}, EngineOptions eo = {}) {
    auto backend = std::make_unique<MockBackend>(std::move(mo));
    mock_ = backend.get();
    auto s = Scheduler::Create(std::move(eo), std::move(backend));
    ASSERT_TRUE(s.ok()) << s.status();
    sched_ = std::move(*s);
    // The server hands one bucket list to both; the steps must pad to the scheduler's own.
    mock_->set_buckets(sched_->model_info().buckets);
  }

  GenerateRequest Req(std::string id, std::vector<int32_t> prompt, int32_t max_new) {
    GenerateRequest r;
    r.request_id = std::move(id);
    r.prompt = std::move(prompt);
    r.sampling.temperature = 0.0f;
    r.stop.max_new_tokens = max_new;
    return r;
  }

  StreamReader* Submit(GenerateRequest r) {
    auto s = sched_->Submit(std::move(r));
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return nullptr;
    readers_.push_back(std::make_unique<StreamReader>(*s));
    return readers_.back().get();
  }
  StreamReader* Submit(std::string id, std::vector<int32_t> prompt, int32_t max_new) {
    return Submit(Req(std::move(id), std::move(prompt), max_new));
  }

  // Steps until `r` finishes (bounded so a bug fails instead of hanging).
  void StepUntilFinished(StreamReader* r, int max_steps = 200) {
    for (int i = 0; i < max_steps && !r->finished; ++i) {
      sched_->Step();
      r->Pull();
    }
    ASSERT_TRUE(r->finished);
  }

  static std::vector<int32_t> Expected(const std::vector<int32_t>& prompt, int32_t n) {
    std::vector<int32_t> out;
    for (int32_t i = 0; i < n; ++i) out.push_back(DefaultMockToken(prompt, i));
    return out;
  }

  MockBackend* mock_ = nullptr;
  std::unique_ptr<Scheduler> sched_;
  std::vector<std::unique_ptr<StreamReader>> readers_;
};

TEST_F(SchedulerTest, SingleRequestGetsOneTokenPerStepThenRetires) {
  Make();
  const std::vector<int32_t> prompt = {5, 6, 7};
  StreamReader* a = Submit("a", prompt, 4);
  EXPECT_EQ(sched_->stats().queued, 1);
  EXPECT_FALSE(sched_->Idle());

  StepTrace t = sched_->Step();
  EXPECT_EQ(t.admitted, Ids({"a"}));
  EXPECT_EQ(t.decoded, Ids({"a"}));
  EXPECT_EQ(t.report.active, 1);
  EXPECT_EQ(t.report.bucket, 1);
  a->Pull();
  EXPECT_EQ(a->tokens, Expected(prompt, 2));  // prefill's token + one decode step
  EXPECT_FALSE(a->finished);
  ASSERT_EQ(mock_->prefills.size(), 1u);
  // (3 + 4) tokens in blocks of 4 -> 2 blocks reserved up front.
  EXPECT_EQ(mock_->prefills[0][0].block_table.size(), 2u);
  EXPECT_EQ(sched_->stats().kv_blocks_free, 1024 - 2);
  EXPECT_EQ(sched_->stats().running, 1);

  t = sched_->Step();
  EXPECT_TRUE(t.admitted.empty());
  a->Pull();
  EXPECT_EQ(a->tokens.size(), 3u);

  t = sched_->Step();
  EXPECT_EQ(t.retired, Ids({"a"}));
  a->Pull();
  EXPECT_EQ(a->tokens, Expected(prompt, 4));
  EXPECT_TRUE(a->finished);
  EXPECT_EQ(a->reason, FinishReason::kLength);
  EXPECT_TRUE(a->status.ok());
  EXPECT_EQ(a->prompt_tokens, 3);
  EXPECT_EQ(a->completion_tokens, 4);
  EXPECT_EQ(mock_->releases, std::vector<SlotId>({0}));

  const EngineStats st = sched_->stats();
  EXPECT_EQ(st.kv_blocks_free, st.kv_blocks_total);
  EXPECT_EQ(st.running, 0);
  EXPECT_EQ(st.steps, 3u);
  EXPECT_EQ(st.tokens_generated, 4u);
  EXPECT_EQ(st.requests_finished, 1u);
  EXPECT_TRUE(sched_->Idle());

  t = sched_->Step();
  EXPECT_FALSE(t.did_work);
  EXPECT_TRUE(t.decoded.empty());
  EXPECT_EQ(mock_->runs.size(), 3u);
}

// Run may hold the engine thread for a whole step (host-driven, the step; the CUDA loop's mixed
// steps, the wait for the step before), so what the rings already hold is streamed before it:
// here the first token Prefill wrote, which the backend's Run must find already delivered.
TEST_F(SchedulerTest, TokensInTheRingsAreStreamedBeforeTheBackendRuns) {
  for (RunMode mode : {RunMode::kOneStep, RunMode::kLoop}) {
    SCOPED_TRACE(mode == RunMode::kLoop ? "loop" : "one step");
    EngineOptions eo;
    eo.run_mode = mode;
    Make({}, eo);
    const std::vector<int32_t> prompt = {5, 6, 7};
    StreamReader* a = Submit("a", prompt, 4);
    ASSERT_NE(a, nullptr);
    std::vector<std::vector<int32_t>> seen;  // a's tokens as each Run began
    mock_->set_on_run([&] {
      a->Pull();
      seen.push_back(a->tokens);
    });
    StepUntilFinished(a);
    ASSERT_FALSE(seen.empty());
    EXPECT_EQ(seen[0], Expected(prompt, 1));  // the prefill's token, before the first decode
    if (mode == RunMode::kOneStep) {
      ASSERT_EQ(seen.size(), 3u);
      EXPECT_EQ(seen[1], Expected(prompt, 2));
      EXPECT_EQ(seen[2], Expected(prompt, 3));
    }
    EXPECT_EQ(a->tokens, Expected(prompt, 4));
    readers_.clear();
  }
}

struct BucketCase {
  int32_t requests;
  int32_t bucket;
};
class SchedulerBucketTest : public SchedulerTest,
                            public ::testing::WithParamInterface<BucketCase> {};

TEST_P(SchedulerBucketTest, ActiveBatchPadsToSmallestBucket) {
  Make();
  std::vector<StreamReader*> rs;
  for (int32_t i = 0; i < GetParam().requests; ++i) {
    rs.push_back(Submit(absl::StrCat("r", i), {i + 1, 3}, 3));
  }
  StepTrace t = sched_->Step();
  EXPECT_EQ(static_cast<int32_t>(t.admitted.size()), GetParam().requests);
  EXPECT_EQ(t.report.active, GetParam().requests);
  EXPECT_EQ(t.report.bucket, GetParam().bucket);
  t = sched_->Step();
  EXPECT_EQ(static_cast<int32_t>(t.retired.size()), GetParam().requests);
  for (int32_t i = 0; i < GetParam().requests; ++i) {
    rs[i]->Pull();
    // Each request gets its own stream, independent of its neighbours.
    EXPECT_EQ(rs[i]->tokens, Expected({i + 1, 3}, 3)) << "request " << i;
    EXPECT_EQ(rs[i]->reason, FinishReason::kLength);
  }
}

INSTANTIATE_TEST_SUITE_P(Buckets, SchedulerBucketTest,
                         ::testing::Values(BucketCase{1, 1}, BucketCase{2, 2}, BucketCase{3, 4},
                                           BucketCase{5, 8}, BucketCase{17, 24}, BucketCase{33, 48},
                                           BucketCase{64, 64}));

// TensorRT-LLM style: requests arrive over several steps and the expected schedule is written
// out by hand, step by step: which requests were admitted, decoded and retired, which slots ran,
// the padded bucket and every stream's token count. The buckets are not powers of two and the
// list is trimmed by max_batch, so a wrong PickBucket (not the smallest bucket >= n) or a wrong
// trim of the list shows up as a wrong bucket.
TEST_F(SchedulerTest, ScheduleIterationByIteration) {
  EngineOptions eo;
  eo.max_batch = 7;
  eo.buckets = {10, 1, 6, 3, 12, 6};  // normalised: sorted, deduplicated, cut after 10 (>= 7)
  Make({}, eo);
  ASSERT_EQ(sched_->model_info().buckets, std::vector<int32_t>({1, 3, 6, 10}));
  ASSERT_EQ(sched_->model_info().max_batch, 7);

  struct Arrival {
    std::string id;
    int32_t max_new;
  };
  struct Iteration {
    std::vector<Arrival> submit;  // submitted before the step, in order
    Ids admitted, decoded, retired;
    std::vector<SlotId> slots;  // slots the backend decoded (finished-at-prefill ones do not run)
    int32_t bucket;
    std::vector<std::pair<std::string, int32_t>> tokens;  // stream token counts after the step
  };
  // Slots are taken lowest-free first; a request with max_new m admitted at step s holds
  // min(m, 2 + step - s) tokens and retires at step s + m - 2 (m = 1: finished by the prefill).
  const std::vector<Iteration> plan = {
      {{{"a", 3}, {"b", 5}, {"c", 2}},
       {"a", "b", "c"},
       {"a", "b", "c"},
       {"c"},
       {0, 1, 2},
       3,
       {{"a", 2}, {"b", 2}, {"c", 2}}},
      // max_batch 7: a, b and five newcomers; i waits. f (m = 1) finishes in the prefill, and
      // the drain before the backend runs sees that, so f is not among the decoded.
      {{{"d", 4}, {"e", 6}, {"f", 1}, {"g", 3}, {"h", 3}, {"i", 2}},
       {"d", "e", "f", "g", "h"},
       {"a", "b", "d", "e", "g", "h"},
       {"a", "f"},
       {0, 1, 2, 3, 5, 6},
       6,
       {{"a", 3}, {"b", 3}, {"d", 2}, {"e", 2}, {"f", 1}, {"g", 2}, {"h", 2}, {"i", 0}}},
      // i and l take the slots of a and f: seven decode, padded to 10.
      {{{"l", 2}},
       {"i", "l"},
       {"b", "d", "e", "g", "h", "i", "l"},
       {"g", "h", "i", "l"},
       {0, 1, 2, 3, 4, 5, 6},
       10,
       {{"b", 4}, {"d", 3}, {"e", 3}, {"g", 3}, {"h", 3}, {"i", 2}, {"l", 2}}},
      {{{"j", 3}, {"k", 2}},
       {"j", "k"},
       {"b", "d", "e", "j", "k"},
       {"b", "d", "k"},
       {0, 1, 2, 3, 4},
       6,
       {{"b", 5}, {"d", 4}, {"e", 4}, {"j", 2}, {"k", 2}}},
      {{}, {}, {"e", "j"}, {"j"}, {0, 3}, 3, {{"e", 5}, {"j", 3}}},
      {{}, {}, {"e"}, {"e"}, {3}, 1, {{"e", 6}}},
  };

  std::map<std::string, StreamReader*> streams;
  std::map<std::string, std::vector<int32_t>> prompts;
  for (size_t step = 0; step < plan.size(); ++step) {
    const Iteration& want = plan[step];
    SCOPED_TRACE(absl::StrCat("step ", step + 1));
    for (const Arrival& a : want.submit) {
      prompts[a.id] = {static_cast<int32_t>(streams.size()) + 11, 4};
      streams[a.id] = Submit(a.id, prompts[a.id], a.max_new);
      ASSERT_NE(streams[a.id], nullptr);
    }
    const size_t runs_before = mock_->runs.size();
    const StepTrace t = sched_->Step();
    EXPECT_EQ(t.admitted, want.admitted);
    EXPECT_EQ(t.decoded, want.decoded);
    EXPECT_EQ(t.retired, want.retired);
    EXPECT_EQ(t.report.active, static_cast<int32_t>(want.slots.size()));
    EXPECT_EQ(t.report.bucket, want.bucket);
    ASSERT_EQ(mock_->runs.size(), runs_before + 1);
    EXPECT_EQ(mock_->runs.back().active, want.slots);
    EXPECT_EQ(mock_->runs.back().bucket, want.bucket);
    for (const auto& [id, n] : want.tokens) {
      StreamReader* r = streams.at(id);
      r->Pull();
      EXPECT_EQ(r->tokens, Expected(prompts[id], n)) << id;
    }
  }
  EXPECT_TRUE(sched_->Idle());
  const StepTrace last = sched_->Step();
  EXPECT_FALSE(last.did_work);
  for (const auto& [id, r] : streams) {
    EXPECT_TRUE(r->finished) << id;
    EXPECT_EQ(r->reason, FinishReason::kLength) << id;
  }
  EXPECT_EQ(sched_->stats().kv_blocks_free, sched_->stats().kv_blocks_total);
}

TEST_F(SchedulerTest, BucketShrinksAsRequestsFinish) {
  Make();
  StreamReader* a = Submit("a", {1}, 2);
  StreamReader* b = Submit("b", {2}, 3);
  StreamReader* c = Submit("c", {3}, 5);
  StepTrace t = sched_->Step();
  EXPECT_EQ(t.report.bucket, 4);
  EXPECT_EQ(t.retired, Ids({"a"}));
  t = sched_->Step();
  EXPECT_EQ(t.decoded, Ids({"b", "c"}));
  EXPECT_EQ(t.report.bucket, 2);
  EXPECT_EQ(t.retired, Ids({"b"}));
  t = sched_->Step();
  EXPECT_EQ(t.decoded, Ids({"c"}));
  EXPECT_EQ(t.report.bucket, 1);
  t = sched_->Step();
  EXPECT_EQ(t.retired, Ids({"c"}));
  for (auto* r : {a, b, c}) r->Pull();
  EXPECT_EQ(a->tokens.size(), 2u);
  EXPECT_EQ(b->tokens.size(), 3u);
  EXPECT_EQ(c->tokens, Expected({3}, 5));
}

TEST_F(SchedulerTest, MaxBatchLimitsConcurrency) {
  EngineOptions eo;
  eo.max_batch = 2;
  Make({}, eo);
  EXPECT_EQ(sched_->model_info().max_batch, 2);
  StreamReader* a = Submit("a", {1}, 2);
  StreamReader* b = Submit("b", {2}, 4);
  StreamReader* c = Submit("c", {3}, 2);

  StepTrace t = sched_->Step();
  EXPECT_EQ(t.admitted, Ids({"a", "b"}));
  EXPECT_EQ(t.retired, Ids({"a"}));
  EXPECT_EQ(sched_->stats().queued, 1);
  c->Pull();
  EXPECT_TRUE(c->tokens.empty());

  t = sched_->Step();  // a's slot is free again: c joins b
  EXPECT_EQ(t.admitted, Ids({"c"}));
  EXPECT_EQ(t.decoded, Ids({"b", "c"}));
  EXPECT_EQ(t.retired, Ids({"c"}));
  // c reuses a's slot.
  EXPECT_EQ(mock_->prefills[1][0].slot, mock_->prefills[0][0].slot);

  t = sched_->Step();
  EXPECT_EQ(t.retired, Ids({"b"}));
  for (auto* r : {a, b, c}) r->Pull();
  EXPECT_EQ(b->tokens, Expected({2}, 4));
  EXPECT_EQ(c->tokens, Expected({3}, 2));
  for (const auto& run : mock_->runs) EXPECT_LE(run.active.size(), 2u);
}

TEST_F(SchedulerTest, AdmissionWaitsForKvBlocksUntilARequestRetires) {
  MockBackendOptions mo;
  mo.kv_block_size = 4;
  mo.num_kv_blocks = 8;
  mo.max_position_embeddings = 32;
  Make(mo);
  StreamReader* a = Submit("a", {1, 2, 3, 4}, 12);  // 16 tokens: 4 blocks
  StreamReader* b = Submit("b", {5, 6, 7, 8}, 3);   // 7 tokens: 2 blocks
  StreamReader* c = Submit("c", {9, 9, 9, 9}, 12);  // 4 blocks: does not fit next to a and b

  StepTrace t = sched_->Step();
  EXPECT_EQ(t.admitted, Ids({"a", "b"}));
  EXPECT_EQ(sched_->stats().kv_blocks_free, 2);
  EXPECT_EQ(sched_->stats().queued, 1);

  t = sched_->Step();
  EXPECT_TRUE(t.admitted.empty());
  EXPECT_EQ(t.retired, Ids({"b"}));
  EXPECT_EQ(sched_->stats().kv_blocks_free, 4);

  t = sched_->Step();
  EXPECT_EQ(t.admitted, Ids({"c"}));
  EXPECT_EQ(mock_->prefills[0][0].block_table, std::vector<int32_t>({0, 1, 2, 3}));
  EXPECT_EQ(mock_->prefills[0][1].block_table, std::vector<int32_t>({4, 5}));
  EXPECT_EQ(mock_->prefills[1][0].block_table, std::vector<int32_t>({4, 5, 6, 7}));
  EXPECT_EQ(sched_->stats().kv_blocks_free, 0);

  StepUntilFinished(c);
  a->Pull();
  b->Pull();
  EXPECT_TRUE(a->finished);
  EXPECT_EQ(a->tokens, Expected({1, 2, 3, 4}, 12));
  EXPECT_EQ(b->tokens, Expected({5, 6, 7, 8}, 3));
  EXPECT_EQ(c->tokens, Expected({9, 9, 9, 9}, 12));
  EXPECT_EQ(sched_->stats().kv_blocks_free, 8);
}

TEST_F(SchedulerTest, FullQueueIsResourceExhaustedAtOnce) {
  EngineOptions eo;
  eo.queue_limit = 2;
  eo.max_batch = 1;
  Make({}, eo);
  Submit("a", {1}, 5);
  Submit("b", {2}, 5);
  auto c = sched_->Submit(Req("c", {3}, 5));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted) << c.status();
  // The rejected id is not held: it can be submitted once there is room.
  sched_->Step();  // admits a; the queue has room again
  EXPECT_EQ(sched_->stats().queued, 1);
  EXPECT_NE(Submit("c", {3}, 5), nullptr);
  EXPECT_EQ(sched_->Submit(Req("d", {4}, 5)).status().code(), absl::StatusCode::kResourceExhausted);
}

// --- stop conditions ---------------------------------------------------------------------------

constexpr int32_t kEos = 2;  // MockBackendOptions' default eos_token_ids

int32_t EosFromIndex2(std::span<const int32_t> prompt, int32_t index) {
  return index >= 2 ? kEos : DefaultMockToken(prompt, index);
}

TEST_F(SchedulerTest, EosFinishesAndIsEmitted) {
  Make();
  mock_->set_script(EosFromIndex2);
  StreamReader* a = Submit("a", {4}, 10);
  StepUntilFinished(a);
  EXPECT_EQ(a->reason, FinishReason::kEos);
  const std::vector<int32_t> prompt = {4};
  EXPECT_EQ(a->tokens,
            std::vector<int32_t>({DefaultMockToken(prompt, 0), DefaultMockToken(prompt, 1), kEos}));
}

TEST_F(SchedulerTest, MinNewTokensSuppressesEos) {
  Make();
  mock_->set_script(EosFromIndex2);
  GenerateRequest r = Req("a", {4}, 10);
  r.stop.min_new_tokens = 3;
  StreamReader* a = Submit(std::move(r));
  StepUntilFinished(a);
  EXPECT_EQ(a->reason, FinishReason::kEos);
  // EOS at index 2 is ignored; the one at index 3 counts.
  ASSERT_EQ(a->tokens.size(), 4u);
  EXPECT_EQ(a->tokens[2], kEos);
  EXPECT_EQ(a->tokens[3], kEos);
}

TEST_F(SchedulerTest, StopTokenFinishes) {
  Make();
  const std::vector<int32_t> prompt = {8};
  ASSERT_NE(DefaultMockToken(prompt, 0), DefaultMockToken(prompt, 1));
  GenerateRequest r = Req("a", prompt, 10);
  r.stop.stop_token_ids = {DefaultMockToken(prompt, 1)};
  StreamReader* a = Submit(std::move(r));
  StepUntilFinished(a);
  EXPECT_EQ(a->reason, FinishReason::kStopToken);
  EXPECT_EQ(a->tokens, Expected(prompt, 2));
}

TEST_F(SchedulerTest, IgnoreEosRunsToMaxNewTokens) {
  Make();
  mock_->set_script(EosFromIndex2);
  GenerateRequest r = Req("a", {4}, 6);
  r.stop.ignore_eos = true;
  StreamReader* a = Submit(std::move(r));
  StepUntilFinished(a);
  EXPECT_EQ(a->reason, FinishReason::kLength);
  EXPECT_EQ(a->tokens.size(), 6u);
  EXPECT_EQ(a->tokens.back(), kEos);
}

TEST_F(SchedulerTest, OneNewTokenFinishesInPrefill) {
  Make();
  StreamReader* a = Submit("a", {4}, 1);
  StepTrace t = sched_->Step();
  EXPECT_EQ(t.admitted, Ids({"a"}));
  EXPECT_EQ(t.report.active, 0);  // finished at prefill: nothing left to decode
  EXPECT_EQ(t.retired, Ids({"a"}));
  a->Pull();
  EXPECT_EQ(a->tokens, Expected({4}, 1));
  EXPECT_EQ(a->reason, FinishReason::kLength);
  EXPECT_EQ(sched_->stats().steps, 0u);
}

// The prefill streams the first token before the step ends; a client that reads it and asks for
// stats must see the request's KV blocks taken, not the previous step's numbers.
TEST_F(SchedulerTest, StatsShowTheBlocksOfAnAdmittedRequestBeforeTheStepEnds) {
  Make();
  EngineStats during;
  mock_->set_on_prefill([&] { during = sched_->stats(); });
  Submit("a", {1, 2, 3}, 20);
  sched_->Step();
  EXPECT_EQ(during.running, 1);
  EXPECT_GT(during.kv_blocks_total, 0);
  EXPECT_LT(during.kv_blocks_free, during.kv_blocks_total);
  EXPECT_EQ(during.kv_blocks_free, sched_->stats().kv_blocks_free);
}

// --- cancellation ------------------------------------------------------------------------------

TEST_F(SchedulerTest, CancelQueuedRequestNeverReachesTheBackend) {
  EngineOptions eo;
  eo.max_batch = 1;
  Make({}, eo);
  StreamReader* a = Submit("a", {1}, 10);
  StreamReader* b = Submit("b", {2}, 10);
  sched_->Step();
  sched_->Cancel("b");
  sched_->Cancel("b");     // idempotent
  sched_->Cancel("nope");  // unknown ids are ignored
  StepTrace t = sched_->Step();
  EXPECT_TRUE(t.admitted.empty());
  b->Pull();
  EXPECT_TRUE(b->finished);
  EXPECT_EQ(b->reason, FinishReason::kCancelled);
  EXPECT_TRUE(b->status.ok());
  EXPECT_TRUE(b->tokens.empty());
  EXPECT_EQ(sched_->stats().queued, 0);
  StepUntilFinished(a);
  for (const auto& p : mock_->prefills) {
    for (const auto& s : p) EXPECT_EQ(s.prompt, std::vector<int32_t>({1}));
  }
}

TEST_F(SchedulerTest, CancelRunningFreesSlotAndBlocksWithinOneStep) {
  Make();
  StreamReader* a = Submit("a", {1}, 50);
  StreamReader* b = Submit("b", {2}, 50);
  sched_->Step();
  a->Pull();
  ASSERT_EQ(a->tokens.size(), 2u);
  const SlotId a_slot = sched_->FindRunning("a")->slot;
  const int32_t per_request = static_cast<int32_t>(mock_->prefills[0][0].block_table.size());
  EXPECT_EQ(sched_->stats().kv_blocks_free, 1024 - 2 * per_request);

  sched_->Cancel("a");
  StepTrace t = sched_->Step();
  EXPECT_EQ(t.retired, Ids({"a"}));
  EXPECT_EQ(mock_->cancels, std::vector<SlotId>({a_slot}));
  EXPECT_TRUE(mock_->slot_free(a_slot));
  EXPECT_EQ(sched_->stats().kv_blocks_free, 1024 - per_request);
  EXPECT_EQ(sched_->FindRunning("a"), nullptr);
  a->Pull();
  EXPECT_TRUE(a->finished);
  EXPECT_EQ(a->reason, FinishReason::kCancelled);
  EXPECT_TRUE(a->status.ok());
  EXPECT_EQ(a->tokens.size(), 2u);  // the cancel step adds no token
  b->Pull();
  EXPECT_EQ(b->tokens, Expected({2}, 3));
  EXPECT_FALSE(b->finished);
  // The id is free again once retired.
  EXPECT_NE(Submit("a", {3}, 2), nullptr);
}

TEST_F(SchedulerTest, SlowReaderIsCancelledWithoutStallingOthers) {
  EngineOptions eo;
  eo.stream_buffer_tokens = 3;
  Make({}, eo);
  StreamReader* slow = Submit("slow", {1}, 50);
  StreamReader* fast = Submit("fast", {2}, 8);
  for (int step = 1; step <= 3; ++step) {
    sched_->Step();
    fast->Pull();
  }
  // After step 3 the slow stream holds 4 unread tokens > 3: the cancel is on its way.
  const SlotId slow_slot = sched_->FindRunning("slow")->slot;
  EXPECT_EQ(mock_->cancels, std::vector<SlotId>({slow_slot}));
  StepTrace t = sched_->Step();
  EXPECT_EQ(t.retired, Ids({"slow"}));
  slow->Pull();
  EXPECT_TRUE(slow->finished);
  EXPECT_EQ(slow->reason, FinishReason::kCancelled);
  EXPECT_EQ(slow->status.code(), absl::StatusCode::kResourceExhausted) << slow->status;
  EXPECT_NE(slow->status.message().find("too slow"), std::string::npos);
  EXPECT_EQ(slow->tokens, Expected({1}, 4));
  StepUntilFinished(fast);
  EXPECT_EQ(fast->reason, FinishReason::kLength);
  EXPECT_EQ(fast->tokens, Expected({2}, 8));
}

TEST_F(SchedulerTest, DrainRejectsNewRequestsAndFinishesRunningOnes) {
  Make();
  StreamReader* a = Submit("a", {1}, 5);
  sched_->Step();
  sched_->BeginDrain();
  auto b = sched_->Submit(Req("b", {2}, 5));
  EXPECT_EQ(b.status().code(), absl::StatusCode::kUnavailable) << b.status();
  StepUntilFinished(a);
  EXPECT_EQ(a->reason, FinishReason::kLength);
  EXPECT_EQ(a->tokens, Expected({1}, 5));
  EXPECT_TRUE(sched_->Idle());
}

TEST_F(SchedulerTest, RingOverrunFailsTheRequestAndStillFreesIt) {
  MockBackendOptions mo;
  mo.ring_capacity = 4;
  mo.tokens_per_run = 6;  // one Run writes more than the ring holds
  Make(mo);
  StreamReader* a = Submit("a", {1}, 50);
  sched_->Step();
  for (int i = 0; i < 3 && !a->finished; ++i) {
    sched_->Step();
    a->Pull();
  }
  a->Pull();
  ASSERT_TRUE(a->finished);
  EXPECT_EQ(a->reason, FinishReason::kError);
  EXPECT_EQ(a->status.code(), absl::StatusCode::kInternal);
  EXPECT_NE(a->status.message().find("overrun"), std::string::npos) << a->status;
  EXPECT_EQ(mock_->releases.size(), 1u);
  EXPECT_EQ(sched_->stats().kv_blocks_free, 1024);
  EXPECT_TRUE(sched_->Idle());
}

// The recovery DrainOne documents: the tokens read before the gap stay in the stream, nothing
// from after the gap reaches the client, the slot is cancelled and, once its FINISHED mark shows
// up behind the gap, the request ends INTERNAL and its slot and blocks are freed. Its neighbour,
// whose ring never overflows, is untouched.
TEST_F(SchedulerTest, RingOverrunMidStreamKeepsTheTokensBeforeTheGap) {
  MockBackendOptions mo;
  mo.ring_capacity = 4;
  Make(mo);
  const std::vector<int32_t> victim_prompt = {7}, neighbour_prompt = {8};
  // The victim's third Run writes 6 entries into its 4-entry ring before the engine drains.
  mock_->set_burst([](std::span<const int32_t> prompt, int32_t generated) {
    return prompt[0] == 7 && generated == 2 ? 6 : 1;
  });
  StreamReader* victim = Submit("victim", victim_prompt, 50);
  StreamReader* neighbour = Submit("neighbour", neighbour_prompt, 6);
  sched_->Step();  // prefill + one token each: seqs 1, 2
  victim->Pull();
  ASSERT_EQ(victim->tokens, Expected(victim_prompt, 2));
  const SlotId slot = sched_->FindRunning("victim")->slot;

  StepTrace t = sched_->Step();  // the victim writes seqs 3..8; seq 3's entry now holds seq 7
  EXPECT_EQ(mock_->cancels, std::vector<SlotId>({slot}));
  EXPECT_TRUE(t.retired.empty());
  victim->Pull();
  EXPECT_EQ(victim->tokens, Expected(victim_prompt, 2)) << "tokens after the gap leaked";
  EXPECT_FALSE(victim->finished);  // its FINISHED mark comes with the cancel, next step

  t = sched_->Step();
  EXPECT_EQ(t.retired, Ids({"victim"}));
  victim->Pull();
  ASSERT_TRUE(victim->finished);
  EXPECT_EQ(victim->reason, FinishReason::kError);
  EXPECT_EQ(victim->status.code(), absl::StatusCode::kInternal);
  EXPECT_NE(victim->status.message().find("token ring overrun"), std::string::npos)
      << victim->status;
  EXPECT_NE(victim->status.message().find("expected seq 3"), std::string::npos) << victim->status;
  EXPECT_EQ(victim->tokens, Expected(victim_prompt, 2));
  EXPECT_EQ(victim->completion_tokens, 2);
  EXPECT_EQ(mock_->releases, std::vector<SlotId>({slot}));

  StepUntilFinished(neighbour);
  EXPECT_EQ(neighbour->reason, FinishReason::kLength);
  EXPECT_TRUE(neighbour->status.ok());
  EXPECT_EQ(neighbour->tokens, Expected(neighbour_prompt, 6));
  EXPECT_EQ(mock_->cancels.size(), 1u);
  EXPECT_EQ(sched_->stats().kv_blocks_free, sched_->stats().kv_blocks_total);
  EXPECT_TRUE(sched_->Idle());
}

// When the lapped burst already holds the request's last token, the resynchronised drain sees
// the FINISHED mark at once: the request ends INTERNAL (not "length") in the same step, without
// waiting for the cancel, and the slot is freed.
TEST_F(SchedulerTest, RingOverrunThatFinishesInTheBurstEndsInternalAtOnce) {
  MockBackendOptions mo;
  mo.ring_capacity = 4;
  Make(mo);
  const std::vector<int32_t> prompt = {5};
  mock_->set_burst(
      [](std::span<const int32_t>, int32_t generated) { return generated == 2 ? 100 : 1; });
  StreamReader* a = Submit("a", prompt, 8);
  sched_->Step();
  StepTrace t = sched_->Step();  // seqs 3..8, seq 8 FINISHED (length); seq 3's entry holds 7
  EXPECT_EQ(t.retired, Ids({"a"}));
  a->Pull();
  ASSERT_TRUE(a->finished);
  EXPECT_EQ(a->reason, FinishReason::kError);
  EXPECT_EQ(a->status.code(), absl::StatusCode::kInternal);
  EXPECT_NE(a->status.message().find("token ring overrun"), std::string::npos) << a->status;
  EXPECT_EQ(a->tokens, Expected(prompt, 2));
  EXPECT_EQ(mock_->releases.size(), 1u);
  EXPECT_EQ(sched_->stats().kv_blocks_free, sched_->stats().kv_blocks_total);
  EXPECT_EQ(sched_->stats().tokens_generated, 2u);
  EXPECT_TRUE(sched_->Idle());
}

TEST_F(SchedulerTest, RequestIdsAreAssignedAndDuplicatesRejected) {
  Make();
  StreamReader* x = Submit("x", {1}, 2);
  auto dup = sched_->Submit(Req("x", {1}, 2));
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_NE(dup.status().message().find("request_id"), std::string::npos);
  StreamReader* taken = Submit("req-2", {1}, 2);
  StreamReader* g1 = Submit("", {1}, 2);
  StreamReader* g2 = Submit("", {1}, 2);
  EXPECT_FALSE(g1->stream->id().empty());
  EXPECT_NE(g1->stream->id(), g2->stream->id());
  EXPECT_NE(g1->stream->id(), taken->stream->id());
  EXPECT_NE(g2->stream->id(), taken->stream->id());
  StepUntilFinished(x);
  EXPECT_NE(Submit("x", {1}, 2), nullptr);
}

TEST_F(SchedulerTest, BackendFailureEndsEveryRequestWithInternal) {
  EngineOptions eo;
  eo.max_batch = 1;
  Make({}, eo);
  StreamReader* a = Submit("a", {1}, 10);
  StreamReader* b = Submit("b", {2}, 10);
  sched_->Step();
  mock_->fail_next_run(absl::InternalError("device lost"));
  sched_->Step();
  for (auto* r : {a, b}) {
    r->Pull();
    ASSERT_TRUE(r->finished);
    EXPECT_EQ(r->reason, FinishReason::kError);
    EXPECT_EQ(r->status.code(), absl::StatusCode::kInternal);
    EXPECT_NE(r->status.message().find("device lost"), std::string::npos);
  }
  EXPECT_FALSE(sched_->health().ok());
  EXPECT_EQ(sched_->Submit(Req("c", {1}, 2)).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(sched_->Idle());
}

TEST_F(SchedulerTest, AbortAllEndsQueuedAndRunningStreams) {
  EngineOptions eo;
  eo.max_batch = 1;
  Make({}, eo);
  StreamReader* a = Submit("a", {1}, 10);
  StreamReader* b = Submit("b", {2}, 10);
  sched_->Step();
  sched_->AbortAll(absl::UnavailableError("engine stopped"));
  for (auto* r : {a, b}) {
    r->Pull();
    ASSERT_TRUE(r->finished);
    EXPECT_EQ(r->reason, FinishReason::kCancelled);
    EXPECT_EQ(r->status.code(), absl::StatusCode::kUnavailable);
  }
  EXPECT_FALSE(sched_->WaitForWork());  // stopped: the engine thread would exit
  EXPECT_EQ(sched_->Submit(Req("c", {1}, 2)).status().code(), absl::StatusCode::kUnavailable);
}

// --- validation --------------------------------------------------------------------------------

struct InvalidCase {
  const char* name;
  std::function<void(GenerateRequest*)> mutate;
  const char* field;
};

class SchedulerValidationTest : public SchedulerTest,
                                public ::testing::WithParamInterface<InvalidCase> {};

TEST_P(SchedulerValidationTest, NamesTheField) {
  Make();  // vocab 100, max_context 256, max_stop_ids 16
  GenerateRequest r = Req("", {1, 2, 3}, 8);
  ASSERT_TRUE(ValidateRequest(r, RequestLimits{100, 256, 16}).ok());
  GetParam().mutate(&r);
  auto s = sched_->Submit(std::move(r));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(s.status().message(), GetParam().field)) << s.status();
  EXPECT_EQ(sched_->stats().queued, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Fields, SchedulerValidationTest,
    ::testing::Values(
        InvalidCase{"EmptyPrompt", [](GenerateRequest* r) { r->prompt.clear(); },
                    "prompt_token_ids"},
        InvalidCase{"PromptIdTooLarge", [](GenerateRequest* r) { r->prompt[1] = 100; },
                    "prompt_token_ids"},
        InvalidCase{"PromptIdNegative", [](GenerateRequest* r) { r->prompt[0] = -1; },
                    "prompt_token_ids"},
        InvalidCase{"ZeroMaxNew", [](GenerateRequest* r) { r->stop.max_new_tokens = 0; },
                    "stop.max_new_tokens"},
        InvalidCase{"BeyondContext",
                    [](GenerateRequest* r) {
                      r->prompt.assign(200, 1);
                      r->stop.max_new_tokens = 57;
                    },
                    "stop.max_new_tokens"},
        InvalidCase{"MinAboveMax", [](GenerateRequest* r) { r->stop.min_new_tokens = 9; },
                    "stop.min_new_tokens"},
        InvalidCase{"TooManyStopIds",
                    [](GenerateRequest* r) { r->stop.stop_token_ids.assign(17, 5); },
                    "stop.stop_token_ids"},
        InvalidCase{"StopIdOutOfVocab",
                    [](GenerateRequest* r) {
                      r->stop.stop_token_ids = {3, 100};
                    },
                    "stop.stop_token_ids"},
        InvalidCase{"NegativeTemperature", [](GenerateRequest* r) { r->sampling.temperature = -1; },
                    "sampling.temperature"},
        InvalidCase{"ZeroTopP", [](GenerateRequest* r) { r->sampling.top_p = 0.0f; },
                    "sampling.top_p"},
        InvalidCase{"TopKAboveVocab", [](GenerateRequest* r) { r->sampling.top_k = 101; },
                    "sampling.top_k"},
        InvalidCase{"LongRequestId",
                    [](GenerateRequest* r) { r->request_id = std::string(300, 'x'); },
                    "request_id"}),
    [](const ::testing::TestParamInfo<InvalidCase>& info) { return info.param.name; });

TEST_F(SchedulerTest, ExactlyMaxContextIsAccepted) {
  Make();
  GenerateRequest r = Req("a", std::vector<int32_t>(200, 1), 56);  // 256 = max_context
  EXPECT_NE(Submit(std::move(r)), nullptr);
}

}  // namespace
}  // namespace ts
