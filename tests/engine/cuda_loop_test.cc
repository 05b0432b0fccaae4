// The device-resident loop (issue #13, docs/device-loop.md) against the host-driven mode, both
// through the Engine: the same requests give the same tokens with arrivals while others decode,
// cancellations and finishes at any step; a generation far longer than the ring streams every
// token in order, and every attention regime change, growing or shrinking, is made on the device
// with no loop exit; a soak of more than 10,000 steps ends with every slot free and the KV pool
// full; a pause stops every ring at a step boundary, and a cancel then ends its stream at the
// very next step without touching the other stream's tokens.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "engine/cuda/cuda_backend.h"
#include "engine/engine.h"
#include "tests/common/test_paths.h"
#include "tests/engine/cuda_test_driver.h"
#include "tests/engine/default_model_reference.h"
#include "tests/engine/script_driver.h"
#include "tests/engine/stream_reader.h"

namespace ts::testing {
namespace {

constexpr int32_t kFixtureContext = 256;

CudaBackendOptions Options(const std::filesystem::path& dir, bool loop, int32_t max_context,
                           uint32_t ring_capacity) {
  CudaBackendOptions o;
  o.model_dir = dir;
  o.max_slots = 8;
  o.kv_block_size = 16;
  o.gpu_memory_fraction = 0.3;
  o.buckets = {1, 2, 4, 8};
  o.max_context = max_context;
  o.prefill_chunk_tokens = 64;  // several chunks per prefill, run beside the loop
  o.ring_capacity = ring_capacity;
  o.device_loop = loop;
  o.log_progress = false;
  return o;
}

// `backend`, when given, is set to the engine's backend (owned by the engine).
std::unique_ptr<Engine> MakeEngine(const std::filesystem::path& dir, bool loop,
                                   int32_t max_context = kFixtureContext,
                                   uint32_t ring_capacity = 64, CudaBackend** backend = nullptr) {
  auto b = CudaBackend::Create(Options(dir, loop, max_context, ring_capacity));
  EXPECT_TRUE(b.ok()) << b.status();
  if (!b.ok()) return nullptr;
  if (backend != nullptr) *backend = b->get();
  EngineOptions e;
  e.max_batch = 8;
  e.buckets = {1, 2, 4, 8};
  e.max_context = max_context;
  e.run_mode = loop ? RunMode::kLoop : RunMode::kOneStep;
  auto engine = Engine::Create(e, std::move(*b));
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(*engine) : nullptr;
}

std::filesystem::path Fixture() {
  return FixtureDir() / "tiny-gqa-untied";
}

// Submits the requests in three waves, each once the previous wave's first stream has tokens, so
// new prompts are prefilled while others decode; cancels the ids in `cancel` once the last wave
// streams.
std::vector<Outcome> RunScenario(Engine& engine, const std::vector<GenerateRequest>& reqs,
                                 const std::vector<int>& cancel) {
  std::vector<std::unique_ptr<StreamReader>> readers(reqs.size());
  const size_t wave = (reqs.size() + 2) / 3;
  auto wait_tokens = [&](size_t i, size_t n) {
    const auto deadline = std::chrono::steady_clock::now() + kStreamTimeout;
    while (readers[i]->tokens.size() < n && !readers[i]->finished &&
           std::chrono::steady_clock::now() < deadline) {
      if (readers[i]->Pull() == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  };
  for (size_t first = 0; first < reqs.size(); first += wave) {
    for (size_t i = first; i < std::min(reqs.size(), first + wave); ++i) {
      auto s = engine.Submit(reqs[i]);
      EXPECT_TRUE(s.ok()) << s.status();
      if (!s.ok()) return {};
      readers[i] = std::make_unique<StreamReader>(*s);
    }
    wait_tokens(first, 3);
  }
  for (int i : cancel) engine.Cancel(reqs[i].request_id);
  std::vector<Outcome> out;
  for (auto& r : readers) {
    ReadToEnd(r.get());
    out.push_back(Outcome{r->tokens, r->reason, r->status});
  }
  WaitIdle(engine);
  return out;
}

// Through the Engine, arrivals and cancels land wherever the loop happens to be: every stream
// must end as its request says (the exact tokens are the scripted test's job below, since the
// batch a row decodes in sets its attention split count, and so its last bits).
TEST(DeviceLoopTest, EngineStreamsEndAsTheirRequestsSayWithArrivalsAndCancels) {
  const int32_t vocab = 311;  // tiny-gqa-untied
  const std::vector<GenerateRequest> reqs = RandomRequests(18, 7, vocab);
  const std::vector<int> cancel = {4, 13};
  auto dev = MakeEngine(Fixture(), /*loop=*/true);
  ASSERT_NE(dev, nullptr);
  ASSERT_EQ(dev->model_info().vocab_size, vocab);
  const std::vector<Outcome> loop = RunScenario(*dev, reqs, cancel);
  ASSERT_EQ(loop.size(), reqs.size());
  EXPECT_GT(dev->stats().steps, 100u);
  for (size_t i = 0; i < reqs.size(); ++i) {
    SCOPED_TRACE("request " + reqs[i].request_id);
    const GenerateRequest& r = reqs[i];
    EXPECT_TRUE(loop[i].status.ok()) << loop[i].status;
    ASSERT_LE(loop[i].tokens.size(), static_cast<size_t>(r.stop.max_new_tokens));
    const bool cancelled = std::count(cancel.begin(), cancel.end(), static_cast<int>(i)) > 0;
    if (cancelled && loop[i].reason == FinishReason::kCancelled) continue;
    ASSERT_FALSE(loop[i].tokens.empty());
    const int32_t last = loop[i].tokens.back();
    const bool stop_hit =
        std::count(r.stop.stop_token_ids.begin(), r.stop.stop_token_ids.end(), last) > 0;
    if (loop[i].reason == FinishReason::kStopToken) {
      EXPECT_TRUE(stop_hit);
    } else {
      EXPECT_EQ(loop[i].reason, FinishReason::kLength);
      EXPECT_EQ(loop[i].tokens.size(), static_cast<size_t>(r.stop.max_new_tokens));
    }
    // No earlier token was a stop id (it would have ended the stream there).
    for (size_t t = 0; t + 1 < loop[i].tokens.size(); ++t) {
      EXPECT_EQ(
          std::count(r.stop.stop_token_ids.begin(), r.stop.stop_token_ids.end(), loop[i].tokens[t]),
          0)
          << "token " << t;
    }
  }
  EXPECT_EQ(dev->stats().kv_blocks_free, dev->stats().kv_blocks_total);
}

// The device loop, paused at random moments to let requests arrive and cancels land; the host-
// driven backend then replays the same events at the same step counts. With the same batch at
// every step, every token of every stream must agree, cancelled ones included, across attention
// regime changes (contexts cross 128).
TEST(DeviceLoopTest, SameTokensAsHostDrivenForTheSameEventsAtTheSameSteps) {
  std::vector<GenerateRequest> reqs = RandomRequests(16, 21, 311);
  for (GenerateRequest& r : reqs) r.stop.max_new_tokens = 1 + r.stop.max_new_tokens % 150;
  std::vector<Event> events;
  std::vector<Outcome> loop_out, host_out;
  {
    auto made = CudaBackend::Create(Options(Fixture(), true, kFixtureContext, 256));
    ASSERT_TRUE(made.ok()) << made.status();
    CudaBackend& b = **made;
    ScriptDriver d(b, reqs, kFixtureContext);
    std::mt19937 rng(5);
    int arrived = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (d.finished() < static_cast<int>(reqs.size()) &&
           std::chrono::steady_clock::now() < deadline) {
      ASSERT_TRUE(b.Run(RunMode::kLoop).ok());
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 1500));
      ASSERT_TRUE(b.Pause().ok());
      const uint64_t steps = b.Poll()->steps;
      d.Drain();
      const SlotId free = d.FreeSlot();
      if (arrived < static_cast<int>(reqs.size()) && free >= 0 && rng() % 3 != 0) {
        events.push_back(Event{.at_step = steps, .request = arrived, .slot = free});
        d.Arrive(arrived++, free);
        // The slot joins at the next boundary, as a host-driven Prefill's does.
        ASSERT_TRUE(b.WaitForPrefills().ok());
      }
      if (rng() % 7 == 0) {
        for (int r = 0; r < arrived; ++r) {
          if (d.Running(r) && rng() % 2 == 0) {
            events.push_back(Event{.at_step = steps, .cancel = true, .request = r});
            d.Cancel(r);
            break;
          }
        }
      }
    }
    d.Drain();
    ASSERT_EQ(d.finished(), static_cast<int>(reqs.size()));
    loop_out = d.out();
  }
  {
    auto made = CudaBackend::Create(Options(Fixture(), false, kFixtureContext, 256));
    ASSERT_TRUE(made.ok()) << made.status();
    CudaBackend& b = **made;
    ScriptDriver d(b, reqs, kFixtureContext);
    size_t e = 0;
    for (int iter = 0; iter < 100000 && d.finished() < static_cast<int>(reqs.size()); ++iter) {
      const uint64_t steps = b.Poll()->steps;
      for (; e < events.size() && events[e].at_step == steps; ++e) {
        if (events[e].cancel) {
          d.Cancel(events[e].request);
        } else {
          d.Arrive(events[e].request, events[e].slot);
          d.Drain();  // the first token
        }
      }
      ASSERT_TRUE(e == events.size() || events[e].at_step > steps);
      ASSERT_TRUE(b.Run(RunMode::kOneStep).ok());
      d.Drain();
    }
    ASSERT_EQ(e, events.size());
    host_out = d.out();
  }
  int cancelled = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    SCOPED_TRACE("request " + reqs[i].request_id);
    EXPECT_EQ(loop_out[i].tokens, host_out[i].tokens);
    EXPECT_EQ(loop_out[i].reason, host_out[i].reason);
    cancelled += loop_out[i].reason == FinishReason::kCancelled;
  }
  std::printf("scripted: %zu events, %d streams cancelled\n", events.size(), cancelled);
}

TEST(DeviceLoopTest, GenerationFarLongerThanTheRingStreamsInOrder) {
  // 1,800 tokens through a 64-entry ring: the engine drains while the loop runs.
  const std::vector<DefaultCase> cases = LoadDefaultReference("bf16");
  ASSERT_FALSE(cases.empty());
  GenerateRequest r;
  r.prompt = cases[0].prompt_ids;
  r.stop.max_new_tokens = 1800;
  r.stop.ignore_eos = true;
  r.sampling.temperature = 0.0f;
  std::vector<int32_t> host_tokens, loop_tokens;
  CudaBackend::RegimeChanges changes;
  EngineStats loop_stats;
  for (bool loop : {false, true}) {
    CudaBackend* backend = nullptr;
    auto engine = MakeEngine(DefaultModelDir(), loop, 2048, 64, &backend);
    ASSERT_NE(engine, nullptr);
    auto s = engine->Submit(r);
    ASSERT_TRUE(s.ok()) << s.status();
    StreamReader reader(*s);
    ReadToEnd(&reader);
    EXPECT_TRUE(reader.status.ok()) << reader.status;
    EXPECT_EQ(reader.reason, FinishReason::kLength);
    (loop ? loop_tokens : host_tokens) = reader.tokens;
    if (loop) {
      changes = backend->regime_changes();
      WaitIdle(*engine);
      loop_stats = engine->stats();
    }
  }
  EXPECT_EQ(host_tokens.size(), 1800u);
  // One stream, so the same batch at every step in both modes: the same tokens, through the
  // attention regime changes at contexts 128, 256, 512 and 1024.
  EXPECT_EQ(loop_tokens, host_tokens);
  // Nothing pauses this loop, and each next regime is prepared 64 steps before the longest context
  // reaches its bound, so the scheduler switches at every bound by itself: the loop never exits
  // for one (docs/device-loop.md, The attention regime).
  const int32_t first = static_cast<int32_t>(r.prompt.size()) + 1;  // context of the first step
  const int32_t last = static_cast<int32_t>(r.prompt.size()) + 1799;
  int32_t bounds = 0;
  for (int32_t b = 128; b < 2048; b *= 2) bounds += first <= b && b < last;
  ASSERT_GE(bounds, 3) << "the reference prompt no longer crosses the regime bounds";
  std::printf("regime changes: %d on the device, %d loop exits, %d offers withdrawn\n",
              changes.on_device, changes.exits, changes.withdrawn);
  EXPECT_EQ(changes.exits, 0);
  EXPECT_EQ(changes.on_device, bounds);
  // The engine's stats carry the loop's counters (Backend::Poll).
  EXPECT_EQ(loop_stats.regime_changes_on_device, static_cast<uint64_t>(bounds));
  EXPECT_EQ(loop_stats.regime_changes_by_exit, 0u);
  EXPECT_GE(loop_stats.loop_launches, 1u);
}

// A long stream takes the regime to 1024 (window (256, 1024]); a short one joins late and is
// below 256 when the long one ends, which shrinks the regime to 256 at that step. The host
// prepares the shrink while both run, first for the short stream's context then (once it passes
// 128) for 256, withdrawing the first offer; the loop makes every change, the shrink included,
// by itself, and both streams' tokens equal the host-driven mode's for the same arrival step.
TEST(DeviceLoopTest, AShrinkWhenTheLongStreamEndsIsMadeOnTheDevice) {
  const std::vector<DefaultCase> cases = LoadDefaultReference("bf16");
  ASSERT_FALSE(cases.empty());
  const int32_t p = static_cast<int32_t>(cases[0].prompt_ids.size());
  ASSERT_LT(p, 100);
  std::vector<GenerateRequest> reqs(2);
  for (GenerateRequest& r : reqs) {
    r.prompt = cases[0].prompt_ids;
    r.stop.ignore_eos = true;
    r.sampling.temperature = 0.0f;
  }
  // The long stream's step g has context p + g: its last step is 899, and step 900 is the first
  // without it. The short one, arriving after step `arrival`, has context p + g - arrival, which
  // at step 900 lies in (128, 256] for arrival in [p + 644, p + 772).
  reqs[0].stop.max_new_tokens = 900;
  reqs[1].stop.max_new_tokens = 257 - p;  // its last context is 256
  const uint64_t earliest = static_cast<uint64_t>(p) + 644;
  std::vector<Event> events;
  std::vector<Outcome> loop_out, host_out;
  CudaBackend::RegimeChanges changes;
  {
    auto made = CudaBackend::Create(Options(DefaultModelDir(), true, 2048, 1024));
    ASSERT_TRUE(made.ok()) << made.status();
    CudaBackend& b = **made;
    ScriptDriver d(b, reqs, 2048);
    events.push_back(Event{.at_step = 0, .request = 0, .slot = 0});
    d.Arrive(0, 0);
    bool joined = false;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (d.finished() < 2 && std::chrono::steady_clock::now() < deadline) {
      ASSERT_TRUE(b.Run(RunMode::kLoop).ok());
      d.Drain();
      if (!joined && b.Poll()->steps >= earliest) {
        ASSERT_TRUE(b.Pause().ok());
        const uint64_t steps = b.Poll()->steps;
        ASSERT_LT(steps, static_cast<uint64_t>(p) + 740) << "paused too late for the scenario";
        d.Drain();
        events.push_back(Event{.at_step = steps, .request = 1, .slot = 1});
        d.Arrive(1, 1);
        ASSERT_TRUE(b.WaitForPrefills().ok());
        joined = true;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    ASSERT_EQ(d.finished(), 2);
    loop_out = d.out();
    changes = b.regime_changes();
  }
  {
    auto made = CudaBackend::Create(Options(DefaultModelDir(), false, 2048, 1024));
    ASSERT_TRUE(made.ok()) << made.status();
    CudaBackend& b = **made;
    ScriptDriver d(b, reqs, 2048);
    size_t e = 0;
    for (int iter = 0; iter < 10000 && d.finished() < 2; ++iter) {
      const uint64_t steps = b.Poll()->steps;
      for (; e < events.size() && events[e].at_step == steps; ++e) {
        d.Arrive(events[e].request, events[e].slot);
        d.Drain();  // the first token
      }
      ASSERT_TRUE(b.Run(RunMode::kOneStep).ok());
      d.Drain();
    }
    ASSERT_EQ(e, events.size());
    host_out = d.out();
  }
  for (size_t i = 0; i < reqs.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(loop_out[i].tokens.size(), static_cast<size_t>(reqs[i].stop.max_new_tokens));
    EXPECT_EQ(loop_out[i].tokens, host_out[i].tokens);
    EXPECT_EQ(loop_out[i].reason, FinishReason::kLength);
  }
  std::printf(
      "shrink: the short stream joined after step %llu; regime changes: %d on the device, "
      "%d loop exits, %d offers withdrawn\n",
      static_cast<unsigned long long>(events.back().at_step), changes.on_device, changes.exits,
      changes.withdrawn);
  // Grows past 128, 256 and 512, then the shrink from 1024 to 256: none by an exit.
  EXPECT_EQ(changes.exits, 0);
  EXPECT_EQ(changes.on_device, 4);
}

TEST(DeviceLoopTest, SoakEndsWithEverySlotFreeAndThePoolFull) {
  auto engine = MakeEngine(Fixture(), /*loop=*/true);
  ASSERT_NE(engine, nullptr);
  const EngineStats start = engine->stats();
  std::mt19937 rng(11);
  std::vector<std::unique_ptr<StreamReader>> live;
  std::vector<int32_t> max_new;
  int submitted = 0, cancelled = 0, finished_ok = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(240);
  while (engine->stats().steps < 10000 && std::chrono::steady_clock::now() < deadline) {
    // Keep more requests in flight than slots, so admission queues and slots are reused.
    while (live.size() < 14) {
      std::vector<GenerateRequest> one = RandomRequests(1, 100 + submitted, 256);
      one[0].request_id = "soak-" + std::to_string(submitted++);
      one[0].stop.stop_token_ids.clear();
      auto s = engine->Submit(one[0]);
      ASSERT_TRUE(s.ok()) << s.status();
      live.push_back(std::make_unique<StreamReader>(*s));
      max_new.push_back(one[0].stop.max_new_tokens);
      if (std::uniform_int_distribution<int>(0, 9)(rng) == 0) {
        engine->Cancel(one[0].request_id);
        ++cancelled;
      }
    }
    for (size_t i = 0; i < live.size();) {
      live[i]->Pull();
      if (!live[i]->finished) {
        ++i;
        continue;
      }
      EXPECT_TRUE(live[i]->status.ok()) << live[i]->status;
      if (live[i]->reason == FinishReason::kLength) {
        EXPECT_EQ(static_cast<int32_t>(live[i]->tokens.size()), max_new[i]);
        ++finished_ok;
      } else {
        EXPECT_EQ(live[i]->reason, FinishReason::kCancelled);
        EXPECT_LE(static_cast<int32_t>(live[i]->tokens.size()), max_new[i]);
      }
      live.erase(live.begin() + i);
      max_new.erase(max_new.begin() + i);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  for (auto& r : live) ReadToEnd(r.get());
  WaitIdle(*engine);
  const EngineStats end = engine->stats();
  std::printf("soak: %llu steps, %d requests (%d cancelled), %d finished by length\n",
              static_cast<unsigned long long>(end.steps - start.steps), submitted, cancelled,
              finished_ok);
  EXPECT_GE(end.steps, 10000u);
  EXPECT_EQ(end.running, 0);
  EXPECT_EQ(end.queued, 0);
  EXPECT_EQ(end.kv_blocks_free, end.kv_blocks_total);
  EXPECT_GT(finished_ok, 50);
  EXPECT_TRUE(engine->health().ok()) << engine->health();
}

// Drains slot `slot`'s ring into *got from *next_seq on.
void DrainInto(const CudaBackend& b, SlotId slot, uint32_t* next_seq, std::vector<RingEntry>* got) {
  ASSERT_TRUE(b.Ring(slot).Drain(next_seq, got));
}

// Two streams; the loop is paused at a step boundary once a has 20 records; then a is ended
// by a cancel, or by its deadline passing while the loop is paused; the next step must end it
// with a finish-only record, and b's tokens must be those of b decoding alone, host-driven.
void PauseThenEndTheFirstStream(FinishReason how) {
  const std::filesystem::path dir = Fixture();
  const std::vector<int32_t> prompt_a = {5, 17, 42, 99, 7, 3, 250, 11};
  const std::vector<int32_t> prompt_b = {9, 8, 77, 21, 200, 13};
  const int32_t n = 200;
  // Host-driven reference for b, alone.
  std::vector<int32_t> want_b;
  {
    auto host = CudaBackend::Create(Options(dir, false, kFixtureContext, 64));
    ASSERT_TRUE(host.ok()) << host.status();
    want_b = RunTogether(**host, {GreedyRequest(prompt_b, n)}, kFixtureContext)[0].tokens;
    ASSERT_EQ(want_b.size(), static_cast<size_t>(n));
  }
  auto made = CudaBackend::Create(Options(dir, true, kFixtureContext, 256));
  ASSERT_TRUE(made.ok()) << made.status();
  CudaBackend& b = **made;
  const std::vector<int32_t> blocks_a = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};
  const std::vector<int32_t> blocks_b = {20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33};
  std::vector<SlotInit> inits(2);
  inits[0] = SlotInit{.slot = 0, .prompt = prompt_a, .block_table = blocks_a};
  inits[1] = SlotInit{.slot = 1, .prompt = prompt_b, .block_table = blocks_b};
  for (SlotInit& in : inits) {
    in.stop.max_new_tokens = n;
    in.stop.ignore_eos = true;
    in.sampling.temperature = 0.0f;  // greedy, as the reference
  }
  // Far enough out for 20 of a's records (well under a millisecond of fixture steps each).
  const auto a_deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  if (how == FinishReason::kDeadline) inits[0].stop.deadline = a_deadline;
  ASSERT_TRUE(b.Prefill(inits).ok());
  uint32_t next_a = 1, next_b = 1;
  std::vector<RingEntry> got_a, got_b;
  // Run(kLoop) until a has 20 records: the first calls may find the prefill still running.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (got_a.size() < 20 && std::chrono::steady_clock::now() < deadline) {
    ASSERT_TRUE(b.Run(RunMode::kLoop).ok());
    DrainInto(b, 0, &next_a, &got_a);
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  ASSERT_GE(got_a.size(), 20u);
  ASSERT_TRUE(b.Pause().ok());
  auto st = b.Poll();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_FALSE(st->running);
  const uint64_t steps_at_pause = st->steps;
  DrainInto(b, 0, &next_a, &got_a);
  DrainInto(b, 1, &next_b, &got_b);
  const size_t a_at_pause = got_a.size(), b_at_pause = got_b.size();
  ASSERT_LT(a_at_pause, static_cast<size_t>(n));
  // Paused at a boundary: both slots decoded the same number of steps after the prefill, and
  // nothing moves.
  EXPECT_EQ(a_at_pause, b_at_pause);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  DrainInto(b, 0, &next_a, &got_a);
  DrainInto(b, 1, &next_b, &got_b);
  EXPECT_EQ(got_a.size(), a_at_pause);
  EXPECT_EQ(got_b.size(), b_at_pause);
  EXPECT_EQ(b.Poll()->steps, steps_at_pause);

  if (how == FinishReason::kCancelled) {
    b.Cancel(0);
  } else {
    ASSERT_LT(std::chrono::steady_clock::now(), a_deadline) << "a's deadline passed too early";
    std::this_thread::sleep_until(a_deadline + std::chrono::milliseconds(5));
  }
  while ((got_b.empty() || !(got_b.back().flags & kRingFinished)) &&
         std::chrono::steady_clock::now() < deadline) {
    ASSERT_TRUE(b.Run(RunMode::kLoop).ok());
    DrainInto(b, 0, &next_a, &got_a);
    DrainInto(b, 1, &next_b, &got_b);
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  // Exactly one record after the pause for a: the finish-only record of the next step.
  ASSERT_EQ(got_a.size(), a_at_pause + 1);
  EXPECT_EQ(got_a.back().token, -1);
  EXPECT_EQ(RingReason(got_a.back().flags), how);
  std::vector<int32_t> tokens_b;
  for (const RingEntry& e : got_b) tokens_b.push_back(e.token);
  EXPECT_EQ(tokens_b, want_b);
  EXPECT_EQ(RingReason(got_b.back().flags), FinishReason::kLength);
  ASSERT_TRUE(b.Run(RunMode::kLoop).ok());
  EXPECT_EQ(b.num_active(), 0);
  EXPECT_GE(b.Poll()->steps, steps_at_pause + (n - b_at_pause));
}

TEST(DeviceLoopTest, PauseStopsAtAStepBoundaryAndACancelEndsTheStreamAtTheNextStep) {
  PauseThenEndTheFirstStream(FinishReason::kCancelled);
}

TEST(DeviceLoopTest, ADeadlinePassedDuringAPauseEndsTheStreamAtTheNextStep) {
  PauseThenEndTheFirstStream(FinishReason::kDeadline);
}

}  // namespace
}  // namespace ts::testing
