// The CPU backend's loop thread (CpuBackendOptions::loop_thread), the stand-in for the GPU's
// device-resident loop, on the committed tiny-gqa-untied fixture: streams equal the host-driven
// ones while requests arrive and are cancelled beside the running loop, rings lap many times, a
// random soak leaves every slot and KV block free, Pause stops at a step boundary and Run resumes,
// Poll counts steps, and a lapped ring ends only its own request. Where a test needs an exact token
// count it parks the loop at a known step through the backend's step hook; every wait is on a
// condition with a deadline, never on timing.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <functional>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "engine/cpu_backend.h"
#include "engine/engine.h"
#include "engine/scheduler.h"
#include "nlohmann/json.hpp"
#include "tests/common/eventually.h"
#include "tests/common/test_paths.h"
#include "tests/engine/gate.h"
#include "tests/engine/stream_reader.h"

namespace ts {
namespace {

using ::ts::testing::Eventually;
using ::ts::testing::Gate;
using ::ts::testing::GatedBackend;
using ::ts::testing::kWaitTimeout;
using ::ts::testing::OpenOnExit;
using ::ts::testing::ReadAtLeast;
using ::ts::testing::ReadToEnd;
using ::ts::testing::StreamReader;
using ::ts::testing::WaitIdle;
using Clock = std::chrono::steady_clock;

constexpr char kVariant[] = "tiny-gqa-untied";

struct Reference {
  std::vector<std::vector<int32_t>> prompts;  // 1, 7 and 23 tokens
  std::vector<std::vector<int32_t>> greedy;   // transformers' greedy continuations, EOS ignored
};

Reference LoadReference() {
  std::ifstream f(::ts::testing::FixtureDir() / kVariant / "reference.json");
  EXPECT_TRUE(f.good()) << "missing fixture " << kVariant;
  nlohmann::json j = nlohmann::json::parse(f);
  Reference r;
  r.prompts = j.at("prompts").get<std::vector<std::vector<int32_t>>>();
  r.greedy = j.at("greedy").get<std::vector<std::vector<int32_t>>>();
  return r;
}

std::unique_ptr<CpuBackend> MakeBackend(int32_t max_slots, bool loop_thread,
                                        uint32_t ring_capacity = 1024, int32_t num_kv_blocks = 0) {
  const std::filesystem::path dir = ::ts::testing::FixtureDir() / kVariant;
  auto model = CpuModel::Load(dir, {.num_threads = 2});
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return nullptr;
  CpuBackendOptions o;
  o.model_dir = dir;
  o.max_slots = max_slots;
  o.kv_block_size = 16;
  o.num_kv_blocks = num_kv_blocks;
  o.buckets = {1, 2, 4, 8, 16};
  o.num_threads = 2;
  o.ring_capacity = ring_capacity;
  o.loop_thread = loop_thread;
  auto backend = CpuBackend::Create(std::move(*model), o);
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? std::move(*backend) : nullptr;
}

std::unique_ptr<Engine> MakeEngine(std::unique_ptr<Backend> backend, RunMode mode,
                                   int32_t max_batch) {
  EngineOptions eo;
  eo.run_mode = mode;
  eo.max_batch = max_batch;
  auto engine = Engine::Create(std::move(eo), std::move(backend));
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(*engine) : nullptr;
}

GenerateRequest Greedy(std::vector<int32_t> prompt, int32_t max_new) {
  GenerateRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0.0f;
  r.stop.max_new_tokens = max_new;
  r.stop.ignore_eos = true;
  return r;
}

GenerateRequest Sampled(std::vector<int32_t> prompt, int32_t max_new, uint64_t seed) {
  GenerateRequest r = Greedy(std::move(prompt), max_new);
  r.sampling.temperature = 0.9f;
  r.sampling.top_k = 40;
  r.sampling.top_p = 0.95f;
  r.sampling.repetition_penalty = 1.1f;
  r.sampling.seed = seed;
  return r;
}

std::vector<int32_t> Prefix(const std::vector<int32_t>& v, size_t n) {
  return std::vector<int32_t>(v.begin(), v.begin() + std::min(n, v.size()));
}

// Every request run to its end on a host-driven engine, all at once: rows never depend on their
// batch neighbours, so these are the streams any schedule must give.
std::vector<StreamReader> HostDriven(const std::vector<GenerateRequest>& reqs) {
  std::vector<StreamReader> out;
  auto engine = MakeEngine(MakeBackend(16, false), RunMode::kOneStep, 16);
  if (engine == nullptr) return out;
  for (const GenerateRequest& r : reqs) {
    auto s = engine->Submit(r);
    EXPECT_TRUE(s.ok()) << s.status();
    out.emplace_back(s.ok() ? *s : nullptr);
  }
  for (StreamReader& r : out) {
    if (r.stream != nullptr) ReadToEnd(&r);
  }
  return out;
}

// Forwards to a real backend and lets the test wait until the engine thread's Cancel for a slot
// has reached it (the backend's cancel flag is set when WaitForCancel returns).
class CancelWatch : public Backend {
 public:
  explicit CancelWatch(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
  const BackendInfo& info() const override { return inner_->info(); }
  absl::Status Prefill(std::span<const SlotInit> slots) override { return inner_->Prefill(slots); }
  absl::Status Run(RunMode mode) override { return inner_->Run(mode); }
  absl::Status Pause() override { return inner_->Pause(); }
  absl::StatusOr<LoopStatus> Poll() override { return inner_->Poll(); }
  void Cancel(SlotId slot) override {
    inner_->Cancel(slot);
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_.insert(slot);
    cv_.notify_all();
  }
  const TokenRing& Ring(SlotId slot) const override { return inner_->Ring(slot); }
  void Release(SlotId slot) override { inner_->Release(slot); }
  StepReport last_step() const override { return inner_->last_step(); }
  std::chrono::steady_clock::time_point PrefillStarted(SlotId slot) const override {
    return inner_->PrefillStarted(slot);
  }

  bool WaitForCancel(SlotId slot) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kWaitTimeout, [&] { return cancelled_.count(slot) > 0; });
  }

 private:
  std::unique_ptr<Backend> inner_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::set<SlotId> cancelled_;
};

// A fixed number of streams whose notifiers wake one condition variable, so that any thread (the
// loop's step hook, the test) can wait on what the engine has streamed.
class StreamWatch {
 public:
  explicit StreamWatch(size_t expected) : expected_(expected), wake_(std::make_shared<Wake>()) {}

  void Add(std::shared_ptr<RequestStream> s) {
    {
      std::lock_guard<std::mutex> lock(wake_->mu);
      streams_.push_back(s);
    }
    s->SetNotifier([wake = wake_] {
      std::lock_guard<std::mutex> lock(wake->mu);
      wake->cv.notify_all();
    });
    wake_->cv.notify_all();
  }
  // Until every expected stream is added and the engine has streamed all but `slack` of the
  // `produced()` tokens.
  bool WaitStreamed(const std::function<int64_t()>& produced, int64_t slack) {
    return Wait([&] {
      int64_t streamed = 0;
      for (const auto& s : streams_) streamed += s->completion_tokens();
      return produced() - streamed <= slack;
    });
  }
  bool WaitAllFinished() {
    return Wait([&] {
      return std::all_of(streams_.begin(), streams_.end(),
                         [](const auto& s) { return s->finished(); });
    });
  }

 private:
  struct Wake {
    std::mutex mu;
    std::condition_variable cv;
  };
  bool Wait(const std::function<bool()>& done) {
    std::unique_lock<std::mutex> lock(wake_->mu);
    return wake_->cv.wait_for(lock, kWaitTimeout,
                              [&] { return streams_.size() == expected_ && done(); });
  }
  const size_t expected_;
  std::shared_ptr<Wake> wake_;  // shared with the notifiers, which the streams keep
  std::vector<std::shared_ptr<RequestStream>> streams_;
};

// Everything in a ring from seq 1 (the ring must hold the whole request).
std::vector<RingEntry> ReadRing(const TokenRing& ring) {
  uint32_t next = 1;
  std::vector<RingEntry> entries;
  EXPECT_TRUE(ring.Drain(&next, &entries));
  return entries;
}

bool RingFinished(const TokenRing& ring) {
  const std::vector<RingEntry> e = ReadRing(ring);
  return !e.empty() && (e.back().flags & kRingFinished) != 0;
}

// Direct-drive inputs: slot i owns KV blocks [16 i, 16 i + 16), a whole 256-token context.
struct Inits {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::vector<int32_t>> tables;
  std::vector<SlotInit> inits;

  // Sampled when seed != 0, else greedy; EOS ignored, so each runs to max_new.
  // Into slot `slot`, or slot i for the i-th Add when negative.
  void Add(const std::vector<int32_t>& prompt, int32_t max_new, uint64_t seed = 0,
           SlotId slot = -1) {
    if (slot < 0) slot = static_cast<SlotId>(inits.size());
    prompts.push_back(prompt);
    tables.emplace_back();
    for (int32_t b = 0; b < 16; ++b) tables.back().push_back(slot * 16 + b);
    SlotInit in;
    in.slot = slot;
    in.sampling.temperature = seed != 0 ? 0.9f : 0.0f;
    in.sampling.seed = seed;
    in.stop.max_new_tokens = max_new;
    in.stop.ignore_eos = true;
    inits.push_back(in);
  }
  // The spans, once every Add is done (the vectors no longer move).
  std::span<const SlotInit> Get(size_t from, size_t count) {
    for (size_t i = 0; i < inits.size(); ++i) {
      inits[i].prompt = prompts[i];
      inits[i].block_table = tables[i];
    }
    return std::span<const SlotInit>(inits).subspan(from, count);
  }
};

LoopStatus PollOk(Backend& b) {
  absl::StatusOr<LoopStatus> s = b.Poll();
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : LoopStatus{};
}

// --- through the engine -------------------------------------------------------------------------

// Request 0 is cancelled while the loop is parked before step kHoldAt + 1, so its count is exact;
// requests 1..6 arrive while it decodes, 5 is cancelled at whatever point it has reached, and
// 7..9 arrive after the cancels. Four slots, so requests also queue and reuse slots and blocks.
TEST(CpuLoop, StreamsEqualHostDrivenWithArrivalsAndCancels) {
  const Reference ref = LoadReference();
  constexpr uint64_t kHoldAt = 12;
  constexpr size_t kDoomed = 5;
  const std::vector<GenerateRequest> reqs = {
      Greedy(ref.prompts[2], 200),     Greedy(ref.prompts[0], 32),
      Sampled(ref.prompts[1], 40, 5),  Greedy(ref.prompts[1], 20),
      Sampled(ref.prompts[2], 60, 11), Sampled(ref.prompts[1], 150, 77),
      Sampled(ref.prompts[0], 25, 3),  Greedy(ref.prompts[2], 30),
      Sampled(ref.prompts[0], 45, 21), Sampled(ref.prompts[1], 12, 8)};
  const std::vector<StreamReader> want = HostDriven(reqs);
  ASSERT_EQ(want.size(), reqs.size());
  ASSERT_EQ(want[1].tokens, ref.greedy[0]);  // the host-driven side matches transformers

  auto gate = std::make_shared<Gate>();
  std::unique_ptr<CpuBackend> cpu = MakeBackend(4, true);
  ASSERT_NE(cpu, nullptr);
  CpuBackend* backend = cpu.get();
  cpu->set_step_hook([gate](uint64_t steps) {
    if (steps == kHoldAt) gate->Wait();
  });
  auto watch_owner = std::make_unique<CancelWatch>(std::move(cpu));
  CancelWatch* watch = watch_owner.get();
  auto engine = MakeEngine(std::move(watch_owner), RunMode::kLoop, 4);
  ASSERT_NE(engine, nullptr);
  OpenOnExit open_on_exit(gate);

  std::vector<StreamReader> out(reqs.size(), StreamReader(nullptr));
  auto submit = [&](size_t i) {
    auto s = engine->Submit(reqs[i]);
    ASSERT_TRUE(s.ok()) << s.status();
    out[i] = StreamReader(*s);
  };
  submit(0);
  ReadAtLeast(&out[0], 2);
  for (size_t i = 1; i <= 6; ++i) submit(i);
  // Request 0 was prefilled alone (into slot 0, the first free one) and decoded in every step
  // since, so it now holds kHoldAt + 1 tokens. The cancels are processed in order, so once slot
  // 0's has reached the backend, request kDoomed's has been handled too (in its slot or queued).
  ASSERT_TRUE(gate->WaitUntilHeld());
  engine->Cancel(out[kDoomed].stream->id());
  engine->Cancel(out[0].stream->id());
  ASSERT_TRUE(watch->WaitForCancel(0));
  gate->Open();
  ReadAtLeast(&out[1], 10);
  for (size_t i = 7; i < reqs.size(); ++i) submit(i);
  for (StreamReader& r : out) ReadToEnd(&r);

  for (size_t i = 0; i < out.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "request " << i);
    EXPECT_TRUE(out[i].status.ok()) << out[i].status;
    if (i == 0) {
      EXPECT_EQ(out[i].reason, FinishReason::kCancelled);
      EXPECT_EQ(out[i].tokens, Prefix(want[i].tokens, kHoldAt + 1));
    } else if (i == kDoomed) {
      EXPECT_EQ(out[i].reason, FinishReason::kCancelled);
      EXPECT_LE(out[i].tokens.size(), kHoldAt);  // it joined after request 0
      EXPECT_EQ(out[i].tokens, Prefix(want[i].tokens, out[i].tokens.size()));
    } else {
      EXPECT_EQ(out[i].reason, FinishReason::kLength);
      EXPECT_EQ(out[i].tokens, want[i].tokens);
    }
  }
  WaitIdle(*engine);
  const EngineStats st = engine->stats();
  EXPECT_EQ(st.kv_blocks_free, st.kv_blocks_total);
  EXPECT_EQ(st.requests_finished, reqs.size());
  EXPECT_GT(st.steps, kHoldAt);
  EXPECT_EQ(backend->num_free_slots(), 4);
  EXPECT_TRUE(engine->health().ok()) << engine->health();
}

// Rings carry no backpressure (a reader a lap behind loses its request, engine/README.md), so the
// step hook holds the loop until the engine has streamed all but a few of each request's tokens:
// an 8-entry ring then wraps a dozen times while the loop writes it and the engine reads it.
TEST(CpuLoop, GenerationsLongerThanTheRingStreamEveryTokenInOrder) {
  const Reference ref = LoadReference();
  constexpr uint32_t kRing = 8;
  const std::vector<GenerateRequest> reqs = {Greedy(ref.prompts[0], 100),
                                             Sampled(ref.prompts[1], 100, 42)};
  const std::vector<StreamReader> want = HostDriven(reqs);
  ASSERT_EQ(want.size(), reqs.size());
  ASSERT_EQ(Prefix(want[0].tokens, ref.greedy[0].size()), ref.greedy[0]);

  auto watch = std::make_shared<StreamWatch>(reqs.size());
  std::unique_ptr<CpuBackend> cpu = MakeBackend(2, true, kRing);
  ASSERT_NE(cpu, nullptr);
  const CpuBackend* backend = cpu.get();
  // The hook runs on the loop thread, which wrote the rings: with at most kRing - 3 entries
  // unread before a step, the step's one entry per slot leaves kRing - 2.
  cpu->set_step_hook([watch, backend](uint64_t steps) {
    auto produced = [backend] {
      return int64_t{backend->Ring(0).LatestSeq()} + backend->Ring(1).LatestSeq();
    };
    EXPECT_TRUE(watch->WaitStreamed(produced, kRing - 3)) << "at step " << steps;
  });
  auto engine = MakeEngine(std::move(cpu), RunMode::kLoop, 2);
  ASSERT_NE(engine, nullptr);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const GenerateRequest& r : reqs) {
    auto s = engine->Submit(r);
    ASSERT_TRUE(s.ok()) << s.status();
    streams.push_back(*s);
    watch->Add(*s);
  }
  ASSERT_TRUE(watch->WaitAllFinished());
  for (size_t i = 0; i < streams.size(); ++i) {
    StreamReader r(streams[i]);
    r.Pull();
    EXPECT_TRUE(r.finished) << "request " << i;
    EXPECT_TRUE(r.status.ok()) << r.status;
    EXPECT_EQ(r.reason, FinishReason::kLength) << "request " << i;
    EXPECT_EQ(r.tokens, want[i].tokens) << "request " << i;
    EXPECT_EQ(r.completion_tokens, 100);
  }
  WaitIdle(*engine);
  EXPECT_EQ(engine->stats().kv_blocks_free, engine->stats().kv_blocks_total);
}

// The engine thread is parked as its Prefill returns, before its first drain, while the loop runs
// two laps past seq 1: the request ends with INTERNAL, its slot and blocks come back, and the next
// request is unaffected. (Parked at its first Run instead, it would drain once before the gate,
// and under ThreadSanitizer the loop had then written seq 1-3.)
TEST(CpuLoop, ARingLappedWhileTheEngineIsAwayEndsOnlyThatRequest) {
  const Reference ref = LoadReference();
  constexpr uint32_t kRing = 4;
  auto lapped = std::make_shared<Gate>();  // opened by the loop, waited on by the test
  auto held = std::make_shared<Gate>();
  std::unique_ptr<CpuBackend> cpu = MakeBackend(2, true, kRing);
  ASSERT_NE(cpu, nullptr);
  CpuBackend* backend = cpu.get();
  cpu->set_step_hook([lapped](uint64_t steps) {
    if (steps == 2 * kRing) lapped->Open();
  });
  auto engine = MakeEngine(std::make_unique<GatedBackend>(std::move(cpu), 1, held,
                                                          GatedBackend::HoldPoint::kAfterPrefill),
                           RunMode::kLoop, 2);
  ASSERT_NE(engine, nullptr);
  OpenOnExit open_on_exit(held);
  auto s = engine->Submit(Greedy(ref.prompts[0], 100));
  ASSERT_TRUE(s.ok()) << s.status();
  StreamReader r(*s);
  ASSERT_TRUE(held->WaitUntilHeld());  // prefilled, not yet drained
  ASSERT_TRUE(lapped->Wait());
  held->Open();
  ReadToEnd(&r);
  EXPECT_EQ(r.reason, FinishReason::kError);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInternal) << r.status;
  EXPECT_NE(r.status.message().find("token ring overrun"), std::string::npos) << r.status;
  EXPECT_NE(r.status.message().find("expected seq 1)"), std::string::npos) << r.status;
  // Seq 1 was gone before the first drain, so nothing before the gap is kept, and nothing the
  // loop pushed after the resynchronisation either (the scheduler drops a broken stream's
  // tokens in every later drain too).
  EXPECT_EQ(r.tokens.size(), 0u);
  WaitIdle(*engine);
  EXPECT_EQ(engine->stats().kv_blocks_free, engine->stats().kv_blocks_total);
  EXPECT_EQ(backend->num_free_slots(), 2);
  EXPECT_TRUE(engine->health().ok()) << engine->health();

  // Three tokens fit the ring whatever the loop's pace.
  auto next = engine->Submit(Greedy(ref.prompts[0], 3));
  ASSERT_TRUE(next.ok()) << next.status();
  StreamReader n(*next);
  ReadToEnd(&n);
  EXPECT_EQ(n.reason, FinishReason::kLength);
  EXPECT_EQ(n.tokens, Prefix(ref.greedy[0], 3));
}

// Random arrivals from three client threads, with cancels right after submission (still queued),
// after a random number of tokens, or none, over a small KV pool, through the Scheduler on a
// driver thread like the Engine's.
TEST(CpuLoop, SoakOfArrivalsAndCancelsLeavesEverySlotAndBlockFree) {
  const Reference ref = LoadReference();
  constexpr int kClients = 3;
  constexpr int kPerClient = 12;
  constexpr int kBatch = 3;  // a client's requests in flight together
  constexpr int32_t kSlots = 4;
  constexpr int32_t kBlocks = 20;  // 320 tokens: four long requests do not fit together
  enum Action { kRead, kCancelQueued, kCancelLater };
  struct Job {
    Action action;
    size_t cancel_after = 0;
  };
  std::mt19937 rng(20240611);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<GenerateRequest> reqs;
  std::vector<Job> jobs;
  for (int i = 0; i < kClients * kPerClient; ++i) {
    std::vector<int32_t> prompt;
    if (uniform(0, 1) == 0) {
      prompt = ref.prompts[uniform(0, 2)];
    } else {
      for (int t = uniform(1, 30); t > 0; --t) prompt.push_back(uniform(0, 310));
    }
    const int32_t max_new = uniform(1, 64);
    reqs.push_back(uniform(0, 1) == 0 ? Greedy(prompt, max_new)
                                      : Sampled(prompt, max_new, 1 + uniform(0, 1 << 20)));
    reqs.back().stop.ignore_eos = uniform(0, 1) == 0;
    const int a = uniform(0, 99);
    jobs.push_back(Job{.action = a < 50   ? kRead
                                 : a < 65 ? kCancelQueued
                                          : kCancelLater,
                       .cancel_after = static_cast<size_t>(uniform(0, max_new - 1))});
  }
  const std::vector<StreamReader> want = HostDriven(reqs);
  ASSERT_EQ(want.size(), reqs.size());

  std::unique_ptr<CpuBackend> cpu = MakeBackend(kSlots, true, 1024, kBlocks);
  ASSERT_NE(cpu, nullptr);
  CpuBackend* backend = cpu.get();
  EngineOptions eo;
  eo.run_mode = RunMode::kLoop;
  eo.max_batch = kSlots;
  auto created = Scheduler::Create(eo, std::move(cpu));
  ASSERT_TRUE(created.ok()) << created.status();
  Scheduler& sched = **created;
  std::thread driver([&] {
    while (sched.WaitForWork()) sched.Step();
  });

  std::vector<StreamReader> out(reqs.size(), StreamReader(nullptr));
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      for (int k = 0; k < kPerClient; k += kBatch) {
        const size_t first = static_cast<size_t>(c * kPerClient + k);
        for (size_t i = first; i < first + kBatch; ++i) {
          auto s = sched.Submit(reqs[i]);
          ASSERT_TRUE(s.ok()) << s.status();
          out[i] = StreamReader(*s);
          if (jobs[i].action == kCancelQueued) sched.Cancel((*s)->id());
        }
        for (size_t i = first; i < first + kBatch; ++i) {
          if (jobs[i].action == kCancelLater) {
            ReadAtLeast(&out[i], jobs[i].cancel_after);
            sched.Cancel(out[i].stream->id());
          }
          ReadToEnd(&out[i]);
        }
      }
    });
  }
  for (std::thread& t : clients) t.join();
  EXPECT_TRUE(Eventually([&] { return sched.Idle(); }));
  sched.Stop();
  driver.join();

  for (size_t i = 0; i < out.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "request " << i << ", action " << jobs[i].action);
    ASSERT_TRUE(out[i].finished);
    EXPECT_TRUE(out[i].status.ok()) << out[i].status;
    if (out[i].reason == FinishReason::kCancelled) {
      EXPECT_NE(jobs[i].action, kRead);
      EXPECT_LT(out[i].tokens.size(), want[i].tokens.size());
      EXPECT_EQ(out[i].tokens, Prefix(want[i].tokens, out[i].tokens.size()));
    } else {
      EXPECT_EQ(out[i].reason, want[i].reason);
      EXPECT_EQ(out[i].tokens, want[i].tokens);
    }
  }
  // This thread owns the scheduler now that the driver is gone.
  EXPECT_EQ(sched.kv_blocks_free(), kBlocks);
  EXPECT_EQ(backend->num_free_slots(), kSlots);
  const EngineStats st = sched.stats();
  EXPECT_EQ(st.requests_finished, reqs.size());
  EXPECT_EQ(st.running, 0);
  EXPECT_EQ(st.queued, 0);
  EXPECT_TRUE(sched.health().ok()) << sched.health();
  EXPECT_FALSE(PollOk(sched.mutable_backend()).running);
}

// --- the backend on its own ---------------------------------------------------------------------

TEST(CpuLoop, PrefillValidatesAtOnceAndRunModesAreChecked) {
  const Reference ref = LoadReference();
  std::unique_ptr<CpuBackend> b = MakeBackend(4, true);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->Run(RunMode::kOneStep).code(), absl::StatusCode::kFailedPrecondition);
  Inits in;
  in.Add(ref.prompts[0], 200);
  in.Add(ref.prompts[1], 4);
  in.Add(ref.prompts[2], 6, 0, /*slot=*/0);
  std::span<const SlotInit> inits = in.Get(0, 3);
  SlotInit bad = inits[1];
  bad.block_table = {};
  EXPECT_EQ(b->Prefill({&bad, 1}).code(), absl::StatusCode::kInvalidArgument);
  const SlotInit twice[] = {inits[1], inits[1]};
  EXPECT_EQ(b->Prefill(twice).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(b->Pause().ok());  // nothing decodes: returns at once
  // Paused, the prefill stays handed over, and the slot is no longer FREE.
  ASSERT_TRUE(b->Prefill(inits.subspan(0, 1)).ok());
  EXPECT_EQ(b->num_free_slots(), 3);
  EXPECT_EQ(b->Prefill(inits.subspan(0, 1)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(b->Ring(0).LatestSeq(), 0u);
  ASSERT_TRUE(b->Run(RunMode::kLoop).ok());
  ASSERT_TRUE(b->Prefill(inits.subspan(1, 1)).ok());
  ASSERT_TRUE(Eventually([&] { return RingFinished(b->Ring(0)) && RingFinished(b->Ring(1)); }));
  EXPECT_EQ(ReadRing(b->Ring(0)).size(), 200u);
  EXPECT_EQ(ReadRing(b->Ring(1)).size(), 4u);
  b->Release(0);
  b->Release(1);
  EXPECT_EQ(b->num_free_slots(), 4);
  // A released slot takes a new request, its ring reset before Prefill returns (paused here, so
  // the loop cannot have touched it).
  ASSERT_TRUE(b->Pause().ok());
  ASSERT_TRUE(b->Prefill(inits.subspan(2, 1)).ok());
  EXPECT_EQ(b->Ring(0).LatestSeq(), 0u);
  ASSERT_TRUE(b->Run(RunMode::kLoop).ok());
  ASSERT_TRUE(Eventually([&] { return RingFinished(b->Ring(0)); }));
  EXPECT_EQ(ReadRing(b->Ring(0)).size(), 6u);
}

TEST(CpuLoop, PauseStopsAtAStepBoundaryAndRunResumes) {
  const Reference ref = LoadReference();
  constexpr uint64_t kHoldAt = 5;
  constexpr uint64_t kLong0 = 230, kLong1 = 240, kLate = 100;
  Inits in;
  in.Add(ref.prompts[0], kLong0);
  in.Add(ref.prompts[1], kLong1, 9);
  in.Add(ref.prompts[2], kLate);
  std::span<const SlotInit> inits = in.Get(0, 3);

  // The hook parks the loop at the boundary before step kHoldAt + 1 and lets that step go on only
  // once Pause has been asked for (Poll stops reporting running), so a step is in progress when
  // Pause is called. Poll may be called from the loop thread: it only takes the backend's mutex.
  auto parked = std::make_shared<Gate>();  // opened by the hook, waited on by the test
  std::atomic<bool> released{false};
  std::unique_ptr<CpuBackend> b = MakeBackend(4, true);
  ASSERT_NE(b, nullptr);
  CpuBackend* raw = b.get();
  b->set_step_hook([parked, raw, &released](uint64_t steps) {
    if (steps != kHoldAt) return;
    parked->Open();
    EXPECT_TRUE(Eventually([raw] { return !PollOk(*raw).running; }));
    released = true;
  });
  ASSERT_TRUE(b->Prefill(inits.subspan(0, 2)).ok());
  ASSERT_TRUE(b->Run(RunMode::kLoop).ok());
  ASSERT_TRUE(parked->Wait());
  const LoopStatus held = PollOk(*b);
  EXPECT_TRUE(held.running);
  EXPECT_EQ(held.steps, kHoldAt);
  // Pause returns once the step in progress is done, and starts no other.
  ASSERT_TRUE(b->Pause().ok());
  EXPECT_TRUE(released.load());
  const LoopStatus at = PollOk(*b);
  EXPECT_FALSE(at.running);
  EXPECT_EQ(at.steps, kHoldAt + 1);
  // Both slots joined at the first boundary, so each holds its prefill's token and one per step.
  EXPECT_EQ(b->Ring(0).LatestSeq(), kHoldAt + 2);
  EXPECT_EQ(b->Ring(1).LatestSeq(), kHoldAt + 2);
  // Paused, a new prefill waits with its ring reset. "Nothing happens" has no condition to wait
  // for, so look for a while: a running loop would do many steps in that time.
  ASSERT_TRUE(b->Prefill(inits.subspan(2, 1)).ok());
  const uint32_t seq0 = b->Ring(0).LatestSeq(), seq1 = b->Ring(1).LatestSeq();
  const auto look = Clock::now() + std::chrono::milliseconds(30);
  while (Clock::now() < look) {
    const LoopStatus now = PollOk(*b);
    ASSERT_EQ(now.steps, at.steps);
    ASSERT_FALSE(now.running);
    ASSERT_EQ(b->Ring(0).LatestSeq(), seq0);
    ASSERT_EQ(b->Ring(1).LatestSeq(), seq1);
    ASSERT_EQ(b->Ring(2).LatestSeq(), 0u);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(b->Pause().ok());  // already paused: returns at once

  ASSERT_TRUE(b->Run(RunMode::kLoop).ok());
  ASSERT_TRUE(Eventually([&] {
    return RingFinished(b->Ring(0)) && RingFinished(b->Ring(1)) && RingFinished(b->Ring(2));
  }));
  // Slot 2 joined at the first boundary after the resume, so its kLate - 1 steps start there.
  const LoopStatus end = PollOk(*b);
  EXPECT_FALSE(end.running);
  EXPECT_EQ(end.steps, std::max(kLong1 - 1, at.steps + kLate - 1));

  // The same three requests host-driven give the same rings.
  std::unique_ptr<CpuBackend> host = MakeBackend(4, false);
  ASSERT_NE(host, nullptr);
  ASSERT_TRUE(host->Prefill(inits).ok());
  ASSERT_TRUE(host->Run(RunMode::kLoop).ok());
  for (SlotId s = 0; s < 3; ++s) {
    const std::vector<RingEntry> got = ReadRing(b->Ring(s)), exp = ReadRing(host->Ring(s));
    ASSERT_EQ(got.size(), exp.size()) << "slot " << s;
    ASSERT_EQ(got.size(), static_cast<size_t>(inits[s].stop.max_new_tokens)) << "slot " << s;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].token, exp[i].token) << "slot " << s << " index " << i;
      EXPECT_EQ(got[i].flags, exp[i].flags) << "slot " << s << " index " << i;
    }
  }
}

// A deadline ends its stream at the first step at or after it, with DEADLINE_EXCEEDED and the
// tokens decoded before it; the other stream is untouched. The step hook holds the step after the
// third until the deadline has passed, so the count is exact in both modes. A request whose
// deadline passed before it was admitted ends without a prefill.
TEST(CpuLoop, ADeadlineEndsItsStreamAtTheNextStepInBothModes) {
  const Reference ref = LoadReference();
  for (const bool loop : {false, true}) {
    SCOPED_TRACE(loop ? "loop" : "host-driven");
    std::unique_ptr<CpuBackend> b = MakeBackend(4, loop);
    ASSERT_NE(b, nullptr);
    const auto deadline = Clock::now() + std::chrono::milliseconds(200);
    b->set_step_hook([deadline](uint64_t steps) {
      if (steps == 3) std::this_thread::sleep_until(deadline + std::chrono::milliseconds(1));
    });
    auto engine = MakeEngine(std::move(b), loop ? RunMode::kLoop : RunMode::kOneStep, 4);
    ASSERT_NE(engine, nullptr);
    GenerateRequest a = Greedy(ref.prompts[1], 40);
    a.stop.deadline = deadline;
    const GenerateRequest other = Greedy(ref.prompts[2], 12);
    auto sa = engine->Submit(a);
    auto so = engine->Submit(other);
    ASSERT_TRUE(sa.ok() && so.ok());
    StreamReader ra(*sa), ro(*so);
    ReadToEnd(&ra);
    ReadToEnd(&ro);
    EXPECT_EQ(ra.reason, FinishReason::kDeadline);
    EXPECT_EQ(ra.status.code(), absl::StatusCode::kDeadlineExceeded) << ra.status;
    // The prefill's token and one per step before the held one.
    EXPECT_EQ(ra.tokens, Prefix(ref.greedy[1], 4));
    EXPECT_EQ(ro.reason, FinishReason::kLength);
    EXPECT_EQ(ro.tokens, Prefix(ref.greedy[2], 12));

    GenerateRequest late = Greedy(ref.prompts[0], 5);
    late.stop.deadline = Clock::now() - std::chrono::milliseconds(1);
    auto sl = engine->Submit(late);
    ASSERT_TRUE(sl.ok());
    StreamReader rl(*sl);
    ReadToEnd(&rl);
    EXPECT_EQ(rl.reason, FinishReason::kDeadline);
    EXPECT_EQ(rl.status.code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_TRUE(rl.tokens.empty());
    WaitIdle(*engine);
    EXPECT_EQ(engine->stats().kv_blocks_free, engine->stats().kv_blocks_total);
  }
}

TEST(CpuLoop, PollCountsStepsThatDecodedARowAndTheLoopsStarts) {
  const Reference ref = LoadReference();
  Inits in;
  in.Add(ref.prompts[0], 3);
  in.Add(ref.prompts[1], 5);
  in.Add(ref.prompts[2], 10);
  std::span<const SlotInit> inits = in.Get(0, 3);

  // Host-driven: each Run(kOneStep) that decodes a row is one step.
  std::unique_ptr<CpuBackend> host = MakeBackend(4, false);
  ASSERT_NE(host, nullptr);
  EXPECT_EQ(PollOk(*host).steps, 0u);
  ASSERT_TRUE(host->Prefill(inits.subspan(0, 2)).ok());
  ASSERT_TRUE(host->Run(RunMode::kOneStep).ok());
  EXPECT_EQ(host->last_step().active, 2);
  EXPECT_EQ(PollOk(*host).steps, 1u);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(host->Run(RunMode::kOneStep).ok());
  EXPECT_EQ(PollOk(*host).steps, 4u);  // max_new 5: the prefill's token and four steps
  ASSERT_TRUE(host->Run(RunMode::kOneStep).ok());
  EXPECT_EQ(host->last_step().active, 0);
  EXPECT_EQ(PollOk(*host).steps, 4u);
  // A step that only finishes a cancelled slot decodes no row.
  ASSERT_TRUE(host->Prefill(inits.subspan(2, 1)).ok());
  host->Cancel(2);
  ASSERT_TRUE(host->Run(RunMode::kOneStep).ok());
  EXPECT_EQ(PollOk(*host).steps, 4u);
  EXPECT_FALSE(PollOk(*host).running);
  EXPECT_EQ(PollOk(*host).launches, 0u);  // no loop
  ASSERT_EQ(ReadRing(host->Ring(2)).size(), 2u);

  // Loop thread, parked at step kHoldAt: running, with the count so far.
  constexpr uint64_t kHoldAt = 3;
  auto gate = std::make_shared<Gate>();
  std::unique_ptr<CpuBackend> b = MakeBackend(4, true);
  ASSERT_NE(b, nullptr);
  b->set_step_hook([gate](uint64_t steps) {
    if (steps == kHoldAt) gate->Wait();
  });
  OpenOnExit open_on_exit(gate);
  ASSERT_TRUE(b->Prefill(inits.subspan(2, 1)).ok());
  ASSERT_TRUE(b->Run(RunMode::kLoop).ok());
  ASSERT_TRUE(gate->WaitUntilHeld());
  LoopStatus st = PollOk(*b);
  EXPECT_EQ(st.steps, kHoldAt);
  EXPECT_TRUE(st.running);
  EXPECT_EQ(st.launches, 1u);  // started with the backend; Run(kLoop) found it running
  gate->Open();
  // A step is counted before its tokens reach the rings, so once FINISHED shows the count is final.
  ASSERT_TRUE(Eventually([&] { return RingFinished(b->Ring(2)); }));
  st = PollOk(*b);
  EXPECT_EQ(st.steps, 9u);
  EXPECT_FALSE(st.running);
  // Cancelled before the loop takes its prefill: one token, the finish-only entry, no step.
  ASSERT_TRUE(b->Pause().ok());
  ASSERT_TRUE(b->Prefill(inits.subspan(0, 1)).ok());
  b->Cancel(0);
  ASSERT_TRUE(b->Run(RunMode::kLoop).ok());
  ASSERT_TRUE(Eventually([&] { return RingFinished(b->Ring(0)); }));
  const std::vector<RingEntry> cancelled = ReadRing(b->Ring(0));
  ASSERT_EQ(cancelled.size(), 2u);
  EXPECT_EQ(cancelled[1].token, -1);
  EXPECT_EQ(RingReason(cancelled[1].flags), FinishReason::kCancelled);
  EXPECT_EQ(PollOk(*b).steps, 9u);
  EXPECT_EQ(PollOk(*b).launches, 2u);  // the Run after the Pause started it again
  ASSERT_TRUE(b->Run(RunMode::kLoop).ok());
  EXPECT_EQ(PollOk(*b).launches, 2u);
}

}  // namespace
}  // namespace ts
