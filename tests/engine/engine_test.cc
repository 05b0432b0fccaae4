// The threaded Engine over the scripted backend: many client threads, cancellation from another
// thread, slow readers, drain, shutdown and backend failure. Waits are on stream notifications or
// bounded polls of Idle(); nothing asserts on timing.
#include "engine/engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "tests/engine/gate.h"
#include "tests/engine/mock_backend.h"
#include "tests/engine/stream_reader.h"

namespace ts {
namespace {

using ::ts::testing::DefaultMockToken;
using ::ts::testing::Gate;
using ::ts::testing::MockBackend;
using ::ts::testing::MockBackendOptions;
using ::ts::testing::ReadToEnd;
using ::ts::testing::StreamReader;
using ::ts::testing::WaitIdle;

GenerateRequest Req(std::vector<int32_t> prompt, int32_t max_new, std::string id = "") {
  GenerateRequest r;
  r.request_id = std::move(id);
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0.0f;
  r.stop.max_new_tokens = max_new;
  return r;
}

std::vector<int32_t> Expected(const std::vector<int32_t>& prompt, int32_t n) {
  std::vector<int32_t> out;
  for (int32_t i = 0; i < n; ++i) out.push_back(DefaultMockToken(prompt, i));
  return out;
}

std::unique_ptr<Engine> MakeEngine(EngineOptions eo = {}, MockBackendOptions mo = {},
                                   MockBackend** mock = nullptr,
                                   MockBackend::Script script = nullptr) {
  auto backend = std::make_unique<MockBackend>(std::move(mo));
  if (script) backend->set_script(std::move(script));
  if (mock) *mock = backend.get();
  auto engine = Engine::Create(std::move(eo), std::move(backend));
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(*engine) : nullptr;
}

TEST(Engine, ManyClientThreadsEachGetTheirOwnStream) {
  EngineOptions eo;
  eo.max_batch = 8;
  auto engine = MakeEngine(eo);
  constexpr int kThreads = 8;
  constexpr int kPerThread = 4;
  std::atomic<int> bad{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < kThreads; ++t) {
    clients.emplace_back([&, t] {
      for (int k = 0; k < kPerThread; ++k) {
        const std::vector<int32_t> prompt = {t + 1, k + 1, 9};
        const int32_t max_new = 5 + (t * kPerThread + k) % 23;
        auto s = engine->Submit(Req(prompt, max_new));
        if (!s.ok()) {
          ++bad;
          continue;
        }
        StreamReader r(*s);
        ReadToEnd(&r);
        if (r.tokens != Expected(prompt, max_new) || r.reason != FinishReason::kLength ||
            !r.status.ok()) {
          ++bad;
        }
      }
    });
  }
  for (auto& c : clients) c.join();
  EXPECT_EQ(bad.load(), 0);
  WaitIdle(*engine);
  const EngineStats st = engine->stats();
  EXPECT_EQ(st.requests_finished, static_cast<uint64_t>(kThreads * kPerThread));
  EXPECT_EQ(st.kv_blocks_free, st.kv_blocks_total);
  EXPECT_EQ(st.queued, 0);
  EXPECT_EQ(st.running, 0);
}

// The backend's loop counters reach EngineStats as Poll reported them.
TEST(Engine, StatsCarryTheBackendsLoopCounters) {
  MockBackendOptions mo;
  mo.loop_counters = {
      .launches = 7, .mixed_steps = 3, .regime_changes_on_device = 5, .regime_changes_by_exit = 2};
  auto engine = MakeEngine({}, mo);
  EXPECT_EQ(engine->stats().loop_launches, 0u);  // nothing polled yet
  auto s = engine->Submit(Req({4, 5}, 6));
  ASSERT_TRUE(s.ok()) << s.status();
  StreamReader r(*s);
  ReadToEnd(&r);
  WaitIdle(*engine);
  const EngineStats st = engine->stats();
  EXPECT_EQ(st.steps, 5u);  // six tokens: the prefill's, then one a step
  EXPECT_EQ(st.loop_launches, 7u);
  EXPECT_EQ(st.mixed_steps, 3u);
  EXPECT_EQ(st.regime_changes_on_device, 5u);
  EXPECT_EQ(st.regime_changes_by_exit, 2u);
}

TEST(Engine, CancelFromAnotherThreadFreesTheRequest) {
  auto gate = std::make_shared<Gate>();
  MockBackend* mock = nullptr;
  auto engine = MakeEngine({}, {}, &mock, [gate](std::span<const int32_t> p, int32_t i) {
    if (i == 3) gate->Wait();
    return DefaultMockToken(p, i);
  });
  ::ts::testing::OpenOnExit open_on_exit(gate);
  auto s = engine->Submit(Req({4}, 200, "victim"));
  ASSERT_TRUE(s.ok());
  StreamReader r(*s);
  // The engine thread is parked in the step that samples index 3; the cancel goes in from
  // another thread while it is there, so it takes effect in the next step, before index 4.
  ASSERT_TRUE(gate->WaitUntilHeld());
  std::thread canceller([&] { engine->Cancel("victim"); });
  canceller.join();
  gate->Open();
  ReadToEnd(&r);
  EXPECT_EQ(r.reason, FinishReason::kCancelled);
  EXPECT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.tokens, Expected({4}, 4));
  WaitIdle(*engine);
  EXPECT_EQ(engine->stats().kv_blocks_free, engine->stats().kv_blocks_total);
  EXPECT_EQ(mock->releases.size(), 1u);
  EXPECT_EQ(mock->cancels.size(), 1u);
}

TEST(Engine, SlowReaderIsCutOffAtTheBufferLimit) {
  EngineOptions eo;
  eo.stream_buffer_tokens = 8;
  auto engine = MakeEngine(eo);
  auto s = engine->Submit(Req({3}, 200));
  ASSERT_TRUE(s.ok());
  // Do not read: just wait (bounded) for the engine to give up on this stream.
  const auto deadline = std::chrono::steady_clock::now() + ::ts::testing::kStreamTimeout;
  while (!(*s)->finished() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  ASSERT_TRUE((*s)->finished());
  StreamReader r(*s);
  r.Pull();
  EXPECT_EQ(r.reason, FinishReason::kCancelled);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kResourceExhausted) << r.status;
  // One token per step: the cancel goes out once 9 > 8 tokens are unread.
  EXPECT_EQ(r.tokens, Expected({3}, 9));
  EXPECT_EQ(r.updates, 1);  // everything coalesced into one update
  WaitIdle(*engine);
  EXPECT_EQ(engine->stats().kv_blocks_free, engine->stats().kv_blocks_total);
}

TEST(Engine, DrainRejectsNewWorkAndLetsRunningFinish) {
  auto gate = std::make_shared<Gate>();
  auto engine = MakeEngine({}, {}, nullptr, [gate](std::span<const int32_t> p, int32_t i) {
    if (i == 2) gate->Wait();
    return DefaultMockToken(p, i);
  });
  auto s = engine->Submit(Req({5}, 20));
  ASSERT_TRUE(s.ok());
  engine->BeginDrain();
  EXPECT_EQ(engine->Submit(Req({6}, 20)).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(engine->Idle());
  gate->Open();
  StreamReader r(*s);
  ReadToEnd(&r);
  EXPECT_EQ(r.reason, FinishReason::kLength);
  EXPECT_EQ(r.tokens, Expected({5}, 20));
  WaitIdle(*engine);
}

TEST(Engine, ShutdownEndsQueuedAndRunningStreamsWithUnavailable) {
  auto gate = std::make_shared<Gate>();
  EngineOptions eo;
  eo.max_batch = 1;
  auto engine = MakeEngine(eo, {}, nullptr, [gate](std::span<const int32_t> p, int32_t i) {
    if (i == 2) gate->Wait();
    return DefaultMockToken(p, i);
  });
  auto a = engine->Submit(Req({1}, 200));
  auto b = engine->Submit(Req({2}, 200));
  ASSERT_TRUE(a.ok() && b.ok());
  // With the engine thread parked inside a step, the destructor cannot get past joining it, so
  // this thread may keep calling Submit until Stop shows as UNAVAILABLE. Requests that slip in
  // before that are aborted like the others.
  gate->WaitUntilHeld();
  Engine* engine_ptr = engine.get();
  std::thread destroyer([&] { engine.reset(); });
  std::vector<std::shared_ptr<RequestStream>> streams = {*a, *b};
  bool stopped = false;
  for (int i = 0; i < 100000 && !stopped; ++i) {
    auto extra = engine_ptr->Submit(Req({3}, 5));
    if (extra.ok()) {
      streams.push_back(*extra);
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    } else {
      EXPECT_EQ(extra.status().code(), absl::StatusCode::kUnavailable);
      stopped = true;
    }
  }
  EXPECT_TRUE(stopped);
  gate->Open();
  destroyer.join();
  for (const auto& s : streams) {
    StreamReader r(s);
    r.Pull();
    ASSERT_TRUE(r.finished);
    EXPECT_EQ(r.reason, FinishReason::kCancelled);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kUnavailable) << r.status;
  }
}

TEST(Engine, BackendFailureMakesTheEngineUnhealthy) {
  MockBackend* mock = nullptr;
  auto backend = std::make_unique<MockBackend>();
  mock = backend.get();
  mock->fail_next_run(absl::InternalError("sticky device error"));
  auto engine = Engine::Create({}, std::move(backend));
  ASSERT_TRUE(engine.ok());
  EXPECT_TRUE((*engine)->health().ok());
  auto s = (*engine)->Submit(Req({1}, 10));
  ASSERT_TRUE(s.ok());
  StreamReader r(*s);
  ReadToEnd(&r);
  EXPECT_EQ(r.reason, FinishReason::kError);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInternal);
  EXPECT_NE(r.status.message().find("sticky device error"), std::string::npos);
  EXPECT_FALSE((*engine)->health().ok());
  EXPECT_EQ((*engine)->Submit(Req({1}, 10)).status().code(), absl::StatusCode::kUnavailable);
}

TEST(Engine, ModelInfoAndEdgeErrors) {
  MockBackendOptions mo;
  mo.max_slots = 16;
  EngineOptions eo;
  eo.max_context = 128;
  eo.max_stop_ids = 4;
  auto engine = MakeEngine(eo, mo);
  const ModelInfo m = engine->model_info();
  EXPECT_EQ(m.vocab_size, 100);
  EXPECT_EQ(m.max_context, 128);
  EXPECT_EQ(m.max_new_tokens, 127);
  EXPECT_EQ(m.eos_token_ids, std::vector<int32_t>({2}));
  EXPECT_EQ(m.max_batch, 16);
  EXPECT_EQ(m.max_stop_ids, 4);
  EXPECT_EQ(m.buckets, std::vector<int32_t>({1, 2, 4, 8, 16}));
  EXPECT_EQ(m.backend, "mock");

  GenerateRequest r = Req({1, 2}, 127);
  EXPECT_EQ(engine->Submit(r).status().code(), absl::StatusCode::kInvalidArgument);
  r.stop.max_new_tokens = 126;
  r.stop.stop_token_ids = {3, 4, 5, 6, 7};
  auto s = engine->Submit(r);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("stop.stop_token_ids"), std::string::npos);
  r.stop.stop_token_ids.pop_back();
  EXPECT_TRUE(engine->Submit(r).ok());
}

TEST(Engine, CreateRejectsANullBackend) {
  EXPECT_EQ(Engine::Create({}, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ts
