// The CPU backend behind the real Engine (threaded), on the committed tiny-gqa-untied fixture:
// greedy streams equal transformers' greedy tokens, seeded sampling is reproducible across runs
// and batch compositions, concurrent requests get their own tokens, and the KV pool comes back.
// The engine tests run in three modes: host-driven (kOneStep), kLoop on a backend without a loop
// thread (Run decodes until idle), and kLoop on the loop thread (cpu_loop_test.cc has the rest).
#include "engine/cpu_backend.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <thread>

#include "engine/engine.h"
#include "nlohmann/json.hpp"
#include "tests/common/safetensors_writer.h"
#include "tests/common/test_paths.h"
#include "tests/engine/gate.h"
#include "tests/engine/stream_reader.h"

namespace ts {
namespace {

using ::ts::testing::Gate;
using ::ts::testing::GatedBackend;
using ::ts::testing::OpenOnExit;
using ::ts::testing::ReadToEnd;
using ::ts::testing::StreamReader;
using ::ts::testing::WaitIdle;

constexpr char kVariant[] = "tiny-gqa-untied";

struct Reference {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::vector<int32_t>> greedy;  // EOS ignored
  std::vector<int32_t> eos_token_ids;        // the model's, as transformers read them
};

Reference LoadReference() {
  std::ifstream f(::ts::testing::FixtureDir() / kVariant / "reference.json");
  EXPECT_TRUE(f.good()) << "missing fixture " << kVariant;
  nlohmann::json j = nlohmann::json::parse(f);
  Reference r;
  r.prompts = j.at("prompts").get<std::vector<std::vector<int32_t>>>();
  r.greedy = j.at("greedy").get<std::vector<std::vector<int32_t>>>();
  r.eos_token_ids = j.at("eos_token_ids").get<std::vector<int32_t>>();
  return r;
}

CpuBackendOptions BackendOptions(int32_t max_slots) {
  CpuBackendOptions o;
  o.model_dir = ::ts::testing::FixtureDir() / kVariant;
  o.max_slots = max_slots;
  o.kv_block_size = 16;
  o.buckets = {1, 2, 4, 8, 16};
  o.num_threads = 2;
  return o;
}

struct Mode {
  const char* name;
  RunMode run_mode;
  bool loop_thread;
};
constexpr Mode kHostDriven = {"HostDriven", RunMode::kOneStep, false};
constexpr Mode kLoopInRun = {"LoopInRun", RunMode::kLoop, false};
constexpr Mode kLoopThread = {"LoopThread", RunMode::kLoop, true};

class CpuEngineFixture : public ::testing::Test {
 protected:
  void SetUp() override { ref_ = LoadReference(); }

  // A fresh CpuBackend on `dir` (the fixture when empty); keeps a raw pointer to inspect it.
  std::unique_ptr<CpuBackend> MakeBackend(int32_t max_slots, std::filesystem::path dir = {}) {
    if (dir.empty()) dir = ::ts::testing::FixtureDir() / kVariant;
    auto model = CpuModel::Load(dir, {.num_threads = 2});
    EXPECT_TRUE(model.ok()) << model.status();
    if (!model.ok()) return nullptr;
    CpuBackendOptions o = BackendOptions(max_slots);
    o.model_dir = dir;
    o.loop_thread = mode_.loop_thread;
    auto backend = CpuBackend::Create(std::move(*model), o);
    EXPECT_TRUE(backend.ok()) << backend.status();
    if (!backend.ok()) return nullptr;
    backend_ = backend->get();
    return std::move(*backend);
  }

  std::unique_ptr<Engine> MakeEngineOver(std::unique_ptr<Backend> backend, int32_t max_slots,
                                         EngineOptions eo = {}) {
    eo.max_batch = max_slots;
    eo.run_mode = mode_.run_mode;
    auto engine = Engine::Create(std::move(eo), std::move(backend));
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? std::move(*engine) : nullptr;
  }

  std::unique_ptr<Engine> MakeEngine(int32_t max_slots, EngineOptions eo = {}) {
    return MakeEngineOver(MakeBackend(max_slots), max_slots, std::move(eo));
  }

  static GenerateRequest Greedy(std::vector<int32_t> prompt, int32_t max_new) {
    GenerateRequest r;
    r.prompt = std::move(prompt);
    r.sampling.temperature = 0.0f;
    r.stop.max_new_tokens = max_new;
    r.stop.ignore_eos = true;  // the reference streams ignore EOS
    return r;
  }
  static GenerateRequest Sampled(std::vector<int32_t> prompt, int32_t max_new, uint64_t seed) {
    GenerateRequest r;
    r.prompt = std::move(prompt);
    r.sampling.temperature = 0.9f;
    r.sampling.top_k = 40;
    r.sampling.top_p = 0.95f;
    r.sampling.repetition_penalty = 1.1f;
    r.sampling.seed = seed;
    r.stop.max_new_tokens = max_new;
    r.stop.ignore_eos = true;
    return r;
  }

  // Submits every request at once (so they share batches), then reads all streams to the end.
  static std::vector<StreamReader> RunAll(Engine& engine, std::vector<GenerateRequest> reqs) {
    std::vector<StreamReader> readers;
    for (auto& r : reqs) {
      auto s = engine.Submit(std::move(r));
      EXPECT_TRUE(s.ok()) << s.status();
      readers.emplace_back(*s);
    }
    for (auto& r : readers) ReadToEnd(&r);
    return readers;
  }

  std::vector<int32_t> RunAlone(GenerateRequest req) {
    auto engine = MakeEngine(1);
    std::vector<StreamReader> out = RunAll(*engine, {std::move(req)});
    EXPECT_TRUE(out[0].status.ok()) << out[0].status;
    return out[0].tokens;
  }

  static std::vector<int32_t> Prefix(const std::vector<int32_t>& v, size_t n) {
    return std::vector<int32_t>(v.begin(), v.begin() + std::min(n, v.size()));
  }

  Mode mode_ = kHostDriven;
  Reference ref_;
  CpuBackend* backend_ = nullptr;
};

class CpuEngineTest : public CpuEngineFixture, public ::testing::WithParamInterface<Mode> {
 protected:
  void SetUp() override {
    mode_ = GetParam();
    CpuEngineFixture::SetUp();
  }
};

INSTANTIATE_TEST_SUITE_P(Modes, CpuEngineTest,
                         ::testing::Values(kHostDriven, kLoopInRun, kLoopThread),
                         [](const ::testing::TestParamInfo<Mode>& info) {
                           return info.param.name;
                         });

// GatedBackend parks the engine thread, which holds decoding back only when host-driven.
using CpuEngineHostDrivenTest = CpuEngineFixture;

TEST_P(CpuEngineTest, GreedyMatchesTransformersAloneAndBatched) {
  ASSERT_EQ(ref_.prompts.size(), 3u);
  const int32_t n = static_cast<int32_t>(ref_.greedy[0].size());
  for (size_t i = 0; i < ref_.prompts.size(); ++i) {
    EXPECT_EQ(RunAlone(Greedy(ref_.prompts[i], n)), ref_.greedy[i]) << "prompt " << i;
  }
  auto engine = MakeEngine(4);
  std::vector<GenerateRequest> reqs;
  for (const auto& p : ref_.prompts) reqs.push_back(Greedy(p, n));
  std::vector<StreamReader> out = RunAll(*engine, std::move(reqs));
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i].tokens, ref_.greedy[i]) << "prompt " << i;
    EXPECT_EQ(out[i].reason, FinishReason::kLength);
    EXPECT_EQ(out[i].prompt_tokens, static_cast<int32_t>(ref_.prompts[i].size()));
    EXPECT_EQ(out[i].completion_tokens, n);
  }
  WaitIdle(*engine);
  const EngineStats st = engine->stats();
  EXPECT_EQ(st.kv_blocks_free, st.kv_blocks_total);
  EXPECT_EQ(st.tokens_generated, static_cast<uint64_t>(3 * n));
  EXPECT_EQ(backend_->num_free_slots(), 4);
}

TEST_P(CpuEngineTest, SeededSamplingRepeatsAcrossRunsAndBatchCompositions) {
  const GenerateRequest target = Sampled(ref_.prompts[1], 24, 1234);
  const std::vector<int32_t> first = RunAlone(target);
  const std::vector<int32_t> second = RunAlone(target);
  ASSERT_EQ(first.size(), 24u);
  EXPECT_EQ(first, second);
  // It really samples: the seeded stream leaves the greedy path.
  EXPECT_NE(first, Prefix(ref_.greedy[1], 24));
  // Another seed gives another stream.
  EXPECT_NE(RunAlone(Sampled(ref_.prompts[1], 24, 99)), first);

  // The same request with three neighbours (different prompts, seeds and lengths) in the batch.
  auto engine = MakeEngine(4);
  std::vector<GenerateRequest> reqs = {Sampled(ref_.prompts[0], 30, 7), target,
                                       Greedy(ref_.prompts[2], 10),
                                       Sampled(ref_.prompts[1], 5, 1234 + 1)};
  std::vector<StreamReader> out = RunAll(*engine, std::move(reqs));
  EXPECT_EQ(out[1].tokens, first);
  EXPECT_EQ(out[2].tokens, Prefix(ref_.greedy[2], 10));
}

TEST_P(CpuEngineTest, SixteenConcurrentClientsGetTheirOwnTokens) {
  // Expected streams: greedy ones from the reference, sampled ones from a run alone.
  std::vector<GenerateRequest> reqs;
  std::vector<std::vector<int32_t>> expected;
  for (int i = 0; i < 16; ++i) {
    const auto& prompt = ref_.prompts[i % 3];
    const int32_t max_new = 8 + i;
    if (i % 2 == 0) {
      reqs.push_back(Greedy(prompt, max_new));
      expected.push_back(Prefix(ref_.greedy[i % 3], max_new));
    } else {
      reqs.push_back(Sampled(prompt, max_new, 1000 + i));
      expected.push_back(RunAlone(reqs.back()));
    }
  }
  for (int32_t slots : {16, 4}) {  // 4 slots: requests queue and reuse slots and KV blocks
    auto engine = MakeEngine(slots);
    std::vector<StreamReader> out(16, StreamReader(nullptr));
    std::vector<std::thread> clients;
    for (int i = 0; i < 16; ++i) {
      clients.emplace_back([&, i] {
        auto s = engine->Submit(reqs[i]);
        ASSERT_TRUE(s.ok()) << s.status();
        out[i] = StreamReader(*s);
        ReadToEnd(&out[i]);
      });
    }
    for (auto& t : clients) t.join();
    for (int i = 0; i < 16; ++i) {
      EXPECT_EQ(out[i].tokens, expected[i]) << "request " << i << " with " << slots << " slots";
      EXPECT_EQ(out[i].reason, FinishReason::kLength);
    }
    WaitIdle(*engine);
    const EngineStats st = engine->stats();
    EXPECT_EQ(st.kv_blocks_free, st.kv_blocks_total);
    EXPECT_EQ(st.requests_finished, 16u);
    EXPECT_EQ(backend_->num_free_slots(), slots);
  }
}

TEST_P(CpuEngineTest, StopRulesOnTheRealModel) {
  const std::vector<int32_t>& stream = ref_.greedy[0];
  // The first token that occurs again later in the reference stream.
  size_t first_at = 0;
  while (first_at < stream.size() &&
         std::find(stream.begin() + first_at + 1, stream.end(), stream[first_at]) == stream.end()) {
    ++first_at;
  }
  ASSERT_LT(first_at, stream.size()) << "the reference stream has no repeated token";
  const int32_t stop_id = stream[first_at];
  auto engine = MakeEngine(4);

  GenerateRequest stop = Greedy(ref_.prompts[0], 32);
  stop.stop.stop_token_ids = {stop_id};
  GenerateRequest late = stop;  // ignores stop ids until index first_at + 1
  late.stop.min_new_tokens = static_cast<int32_t>(first_at) + 1;
  std::vector<StreamReader> out = RunAll(*engine, {stop, late});

  EXPECT_EQ(out[0].reason, FinishReason::kStopToken);
  EXPECT_EQ(out[0].tokens, Prefix(stream, first_at + 1));
  const auto again =
      std::find(stream.begin() + first_at + 1, stream.end(), stop_id) - stream.begin();
  ASSERT_LT(static_cast<size_t>(again), stream.size());
  EXPECT_EQ(out[1].reason, FinishReason::kStopToken);
  EXPECT_EQ(out[1].tokens, Prefix(stream, again + 1));
}

// Index of the first token of `stream` at or after `from` that is one of `ids`; stream.size()
// when there is none.
size_t FirstOf(const std::vector<int32_t>& stream, const std::vector<int32_t>& ids,
               size_t from = 0) {
  for (size_t j = from; j < stream.size(); ++j) {
    if (std::find(ids.begin(), ids.end(), stream[j]) != ids.end()) return j;
  }
  return stream.size();
}

TEST_P(CpuEngineTest, EosEndsTheStreamOnTheRealModel) {
  // A prompt whose transformers continuation holds one of the model's EOS ids.
  ASSERT_FALSE(ref_.eos_token_ids.empty());
  auto eos_index = [&](size_t i) { return FirstOf(ref_.greedy[i], ref_.eos_token_ids); };
  size_t p = 0;
  while (p < ref_.greedy.size() && (eos_index(p) == 0 || eos_index(p) == ref_.greedy[p].size())) {
    ++p;
  }
  ASSERT_LT(p, ref_.greedy.size()) << "no reference continuation holds an EOS id";
  const std::vector<int32_t>& stream = ref_.greedy[p];
  const size_t eos_at = FirstOf(stream, ref_.eos_token_ids);
  ASSERT_GT(eos_at, 0u);
  const int32_t n = static_cast<int32_t>(stream.size());

  auto engine = MakeEngine(4);
  EXPECT_EQ(engine->model_info().eos_token_ids, ref_.eos_token_ids);
  GenerateRequest eos = Greedy(ref_.prompts[p], n);
  eos.stop.ignore_eos = false;
  // min_new_tokens past the EOS: it no longer counts, the next one (if any) does.
  GenerateRequest late = eos;
  late.stop.min_new_tokens = static_cast<int32_t>(eos_at) + 1;
  const size_t late_at = FirstOf(stream, ref_.eos_token_ids, eos_at + 1);
  // ignore_eos runs through it to max_new_tokens.
  GenerateRequest ignored = Greedy(ref_.prompts[p], n);
  std::vector<StreamReader> out = RunAll(*engine, {eos, late, ignored});

  EXPECT_EQ(out[0].reason, FinishReason::kEos) << "prompt " << p << ", EOS at " << eos_at;
  EXPECT_TRUE(out[0].status.ok()) << out[0].status;
  EXPECT_EQ(out[0].tokens, Prefix(stream, eos_at + 1));
  EXPECT_EQ(out[0].completion_tokens, static_cast<int32_t>(eos_at) + 1);
  EXPECT_EQ(out[1].reason, late_at < stream.size() ? FinishReason::kEos : FinishReason::kLength);
  EXPECT_EQ(out[1].tokens, Prefix(stream, late_at + 1));
  EXPECT_EQ(out[2].reason, FinishReason::kLength);
  EXPECT_EQ(out[2].tokens, stream);
  WaitIdle(*engine);
  EXPECT_EQ(engine->stats().kv_blocks_free, engine->stats().kv_blocks_total);
}

// Llama-3 style: generation_config.json lists several EOS ids, and any of them ends a stream. The
// fixture is copied with one more EOS id, taken from a reference continuation, so that two
// prompts in one batch end on two different ids.
TEST_P(CpuEngineTest, AnyOfSeveralEosIdsEndsTheStream) {
  ASSERT_EQ(ref_.greedy.size(), 3u);
  const std::vector<int32_t>& model_eos = ref_.eos_token_ids;
  // The prompt that ends on the model's own EOS, and another whose stream has none.
  size_t own = 0, other = 0;
  while (own < 3 && FirstOf(ref_.greedy[own], model_eos) == ref_.greedy[own].size()) ++own;
  while (other < 3 && FirstOf(ref_.greedy[other], model_eos) != ref_.greedy[other].size()) {
    ++other;
  }
  ASSERT_LT(own, 3u);
  ASSERT_LT(other, 3u);
  const size_t own_at = FirstOf(ref_.greedy[own], model_eos);
  // The extra id: the first token of `other`'s stream from index 3 on that occurs neither
  // earlier in that stream nor in `own`'s stream before its EOS.
  const std::vector<int32_t>& os = ref_.greedy[other];
  size_t extra_at = 3;
  auto usable = [&](size_t j) {
    const std::vector<int32_t> id = {os[j]};
    return FirstOf(os, id) == j && FirstOf(Prefix(ref_.greedy[own], own_at), id) == own_at &&
           FirstOf(model_eos, id) == model_eos.size();
  };
  while (extra_at < os.size() && !usable(extra_at)) ++extra_at;
  ASSERT_LT(extra_at, os.size());
  const int32_t extra = os[extra_at];

  ::ts::testing::TempDir dir("ts_cpu_eos");
  ASSERT_FALSE(dir.path().empty());
  const std::filesystem::path src = ::ts::testing::FixtureDir() / kVariant;
  for (const char* f : {"config.json", "model.safetensors"}) {
    std::filesystem::copy_file(src / f, dir / f);
  }
  nlohmann::json gen = {{"bos_token_id", 1}, {"eos_token_id", {extra}}};
  for (int32_t id : model_eos) gen["eos_token_id"].push_back(id);
  std::ofstream(dir / "generation_config.json") << gen.dump();

  auto engine = MakeEngineOver(MakeBackend(4, dir.path()), 4);
  ASSERT_NE(engine, nullptr);
  std::vector<int32_t> all_eos = engine->model_info().eos_token_ids;
  std::sort(all_eos.begin(), all_eos.end());
  std::vector<int32_t> want_eos = model_eos;
  want_eos.push_back(extra);
  std::sort(want_eos.begin(), want_eos.end());
  ASSERT_EQ(all_eos, want_eos);

  std::vector<GenerateRequest> reqs;
  for (size_t i = 0; i < 3; ++i) {
    reqs.push_back(Greedy(ref_.prompts[i], static_cast<int32_t>(ref_.greedy[i].size())));
    reqs.back().stop.ignore_eos = false;
  }
  std::vector<StreamReader> out = RunAll(*engine, std::move(reqs));
  ASSERT_EQ(FirstOf(ref_.greedy[own], want_eos), own_at);
  ASSERT_EQ(FirstOf(os, want_eos), extra_at);
  EXPECT_EQ(out[own].reason, FinishReason::kEos);
  EXPECT_EQ(out[own].tokens, Prefix(ref_.greedy[own], own_at + 1));
  EXPECT_EQ(out[other].reason, FinishReason::kEos) << "extra EOS id " << extra;
  EXPECT_EQ(out[other].tokens, Prefix(os, extra_at + 1));
  for (size_t i = 0; i < 3; ++i) {
    const size_t at = FirstOf(ref_.greedy[i], want_eos);
    EXPECT_EQ(out[i].reason,
              at < ref_.greedy[i].size() ? FinishReason::kEos : FinishReason::kLength)
        << "prompt " << i;
    EXPECT_EQ(out[i].tokens, Prefix(ref_.greedy[i], at + 1)) << "prompt " << i;
  }
}

// The engine thread is parked at the start of decode step kHoldAt while the test cancels, so the
// cancel lands at a known token count whatever the load: the held step still decodes (its cancel
// check ran before the gate), and the next step sees the cancel before sampling.
TEST_F(CpuEngineHostDrivenTest, CancelFreesTheSlotAndBlocks) {
  constexpr int kHoldAt = 5;
  auto gate = std::make_shared<Gate>();
  auto engine = MakeEngineOver(std::make_unique<GatedBackend>(MakeBackend(2), kHoldAt, gate), 2);
  ASSERT_NE(engine, nullptr);
  OpenOnExit open_on_exit(gate);
  auto s = engine->Submit(Greedy(ref_.prompts[2], 200));
  ASSERT_TRUE(s.ok()) << s.status();
  StreamReader r(*s);
  ASSERT_TRUE(gate->WaitUntilHeld());
  engine->Cancel((*s)->id());
  gate->Open();
  ReadToEnd(&r);
  EXPECT_EQ(r.reason, FinishReason::kCancelled);
  EXPECT_TRUE(r.status.ok()) << r.status;
  // Prefill's token, kHoldAt - 1 steps before the gate, the held step; the cancel adds none.
  EXPECT_EQ(r.tokens, Prefix(ref_.greedy[2], kHoldAt + 1));
  WaitIdle(*engine);
  const EngineStats st = engine->stats();
  EXPECT_EQ(st.kv_blocks_free, st.kv_blocks_total);
  EXPECT_EQ(backend_->num_free_slots(), 2);
}

// --- the backend on its own ---------------------------------------------------------------------

TEST(CpuBackend, ReportsBucketsAndRejectsBadPrefill) {
  auto backend = CreateCpuBackend(BackendOptions(8));
  ASSERT_TRUE(backend.ok()) << backend.status();
  Backend& b = **backend;
  EXPECT_STREQ(b.info().name, "cpu");
  EXPECT_EQ(b.info().model.vocab_size, 311);
  EXPECT_EQ(b.info().num_kv_blocks, 8 * 256 / 16);

  const std::vector<int32_t> prompt = {1, 7, 130};
  std::vector<std::vector<int32_t>> tables = {{0}, {1}, {2}};
  std::vector<SlotInit> inits;
  for (int i = 0; i < 3; ++i) {
    inits.push_back(SlotInit{.slot = i, .prompt = prompt, .block_table = tables[i]});
    inits.back().stop.max_new_tokens = 4;
    inits.back().sampling.temperature = 0.0f;
  }
  SlotInit bad = inits[0];
  bad.slot = 5;
  bad.block_table = {};
  EXPECT_EQ(b.Prefill({&bad, 1}).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(b.Prefill(inits).ok());
  ASSERT_TRUE(b.Run(RunMode::kOneStep).ok());
  EXPECT_EQ(b.last_step().active, 3);
  EXPECT_EQ(b.last_step().bucket, 4);
  // Slot 0 again while ACTIVE is refused.
  EXPECT_FALSE(b.Prefill({&inits[0], 1}).ok());
  b.Cancel(1);
  ASSERT_TRUE(b.Run(RunMode::kOneStep).ok());
  EXPECT_EQ(b.last_step().active, 2);
  EXPECT_EQ(b.last_step().bucket, 2);

  // Slot 1's ring: two tokens, then one finish-only cancelled entry.
  uint32_t next = 1;
  std::vector<RingEntry> entries;
  ASSERT_TRUE(b.Ring(1).Drain(&next, &entries));
  ASSERT_EQ(entries.size(), 3u);
  EXPECT_EQ(entries[2].token, -1);
  EXPECT_EQ(RingReason(entries[2].flags), FinishReason::kCancelled);
  // Slot 0's three tokens are identical to slot 2's: same prompt, greedy, own KV blocks.
  std::vector<RingEntry> e0, e2;
  uint32_t n0 = 1, n2 = 1;
  ASSERT_TRUE(b.Ring(0).Drain(&n0, &e0));
  ASSERT_TRUE(b.Ring(2).Drain(&n2, &e2));
  ASSERT_EQ(e0.size(), 3u);
  ASSERT_EQ(e2.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(e0[i].token, e2[i].token);
  // kLoop without a loop thread decodes until idle: one more token each reaches max_new_tokens = 4.
  ASSERT_TRUE(b.Run(RunMode::kLoop).ok());
  ASSERT_TRUE(b.Ring(0).Drain(&n0, &e0));
  ASSERT_EQ(e0.size(), 4u);
  EXPECT_EQ(RingReason(e0[3].flags), FinishReason::kLength);
  for (SlotId s : {0, 1, 2}) b.Release(s);
  EXPECT_TRUE(b.Prefill({&inits[0], 1}).ok());
}

TEST(CpuBackend, BadOptionsAreRefused) {
  CpuBackendOptions o = BackendOptions(32);  // buckets end at 16
  EXPECT_EQ(CreateCpuBackend(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = BackendOptions(4);
  o.kv_block_size = 0;
  EXPECT_EQ(CreateCpuBackend(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = BackendOptions(4);
  o.num_kv_blocks = 100;
  o.max_kv_bytes = 99 * 2 * 4 * 3 * 2 * 16 * 16;  // the fixture's KV bytes for 99 blocks
  auto s = CreateCpuBackend(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted) << s.status();
  EXPECT_NE(s.status().message().find("99 fit"), std::string::npos) << s.status();
  o.num_kv_blocks = 99;
  EXPECT_TRUE(CreateCpuBackend(o).ok());
  o = BackendOptions(4);
  o.model_dir = ::ts::testing::FixtureDir() / "no-such-model";
  EXPECT_FALSE(CreateCpuBackend(o).ok());
}

}  // namespace
}  // namespace ts
