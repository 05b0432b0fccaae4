// The CPU backend over a pipeline of stage threads (engine/pipeline/pipeline_forward.h) through
// the Engine: with requests arriving while others decode, and cancels, every stream equals the
// single-stage backend's, for 2 and 3 stages, untied and tied embeddings (the head's matrix on
// both ends), host-driven and with the backend's loop thread; every slot and KV block comes back.
#include "engine/pipeline/pipeline_forward.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "engine/cpu_backend.h"
#include "engine/engine.h"
#include "tests/common/test_paths.h"
#include "tests/engine/stream_reader.h"
#include "tests/engine/waves.h"

namespace ts::testing {
namespace {

constexpr int32_t kSlots = 4;
constexpr int32_t kBlock = 16;
constexpr int32_t kContext = 160;

CpuBackendOptions Options(const std::string& variant, bool loop) {
  CpuBackendOptions o;
  o.model_dir = FixtureDir() / variant;
  o.max_slots = kSlots;
  o.kv_block_size = kBlock;
  o.num_kv_blocks = kSlots * ((kContext + kBlock - 1) / kBlock);
  o.buckets = {1, 2, 4};
  o.num_threads = 1;
  o.loop_thread = loop;
  return o;
}

std::unique_ptr<Engine> MakeEngine(std::unique_ptr<Backend> backend, bool loop) {
  return MakeWaveEngine(std::move(backend), loop, kSlots, kContext);
}

std::unique_ptr<Engine> Whole(const std::string& variant) {
  auto b = CreateCpuBackend(Options(variant, false));
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? MakeEngine(std::move(*b), false) : nullptr;
}

std::unique_ptr<Engine> Pipelined(const std::string& variant, int32_t stages, bool loop) {
  const CpuBackendOptions o = Options(variant, loop);
  auto config = LoadModelConfig(o.model_dir);
  EXPECT_TRUE(config.ok()) << config.status();
  if (!config.ok()) return nullptr;
  auto plan = pipeline::PlanStages(
      *config, {.num_stages = stages, .bytes_per_weight = 4, .bytes_per_kv = 4});
  EXPECT_TRUE(plan.ok()) << plan.status();
  auto blocks = CpuKvBlocks(*config, o);
  EXPECT_TRUE(blocks.ok()) << blocks.status();
  if (!plan.ok() || !blocks.ok()) return nullptr;
  // Two micro-batches: a batch of 2-4 rows really splits, so stages overlap.
  auto forward = pipeline::PipelineForward::Load(o.model_dir, *plan, *blocks, kBlock, 2, 1);
  EXPECT_TRUE(forward.ok()) << forward.status();
  if (!forward.ok()) return nullptr;
  auto b = CpuBackend::Create(*std::move(forward), o);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? MakeEngine(*std::move(b), loop) : nullptr;
}

std::vector<GenerateRequest> Requests(int32_t vocab) {
  return MixedRequests(vocab, 17, "p", 500);
}

using Result = WaveResult;

// RunWaves, then every stream ended OK, and the engine is idle with every KV block free.
std::vector<Result> RunWavesToIdle(Engine& engine, const std::vector<GenerateRequest>& reqs,
                                   const std::vector<int>& cancel) {
  std::vector<Result> out = RunWaves(engine, reqs, cancel);
  for (const Result& r : out) EXPECT_TRUE(r.status.ok()) << r.status;
  WaitIdle(engine);
  EXPECT_EQ(engine.stats().kv_blocks_free, engine.stats().kv_blocks_total);
  return out;
}

class PipelineBackendTest
    : public ::testing::TestWithParam<std::tuple<std::string, int32_t, bool>> {};

TEST_P(PipelineBackendTest, StreamsEqualTheSingleStageBackend) {
  const auto& [variant, stages, loop] = GetParam();
  std::vector<Result> want;
  int32_t vocab = 0;
  {
    auto whole = Whole(variant);
    ASSERT_NE(whole, nullptr);
    vocab = whole->model_info().vocab_size;
    want = RunWavesToIdle(*whole, Requests(vocab), {});
  }
  const std::vector<int> cancel = {5, 8};
  auto piped = Pipelined(variant, stages, loop);
  ASSERT_NE(piped, nullptr);
  const std::vector<GenerateRequest> reqs = Requests(vocab);
  const std::vector<Result> got = RunWavesToIdle(*piped, reqs, cancel);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(reqs[i].request_id);
    EXPECT_EQ(want[i].tokens.size(), static_cast<size_t>(reqs[i].stop.max_new_tokens));
    const bool cancelled = std::count(cancel.begin(), cancel.end(), static_cast<int>(i)) > 0;
    if (cancelled && got[i].reason == FinishReason::kCancelled) {
      ASSERT_LE(got[i].tokens.size(), want[i].tokens.size());
      EXPECT_TRUE(std::equal(got[i].tokens.begin(), got[i].tokens.end(), want[i].tokens.begin()));
      continue;
    }
    EXPECT_EQ(got[i].tokens, want[i].tokens);
    EXPECT_EQ(got[i].reason, want[i].reason);
  }
}

INSTANTIATE_TEST_SUITE_P(StagesAndModes, PipelineBackendTest,
                         ::testing::Values(std::make_tuple("tiny-gqa-untied", 2, false),
                                           std::make_tuple("tiny-gqa-untied", 3, true),
                                           std::make_tuple("tiny-mha-tied", 2, false),
                                           std::make_tuple("tiny-mha-tied", 2, true)),
                         FixtureStagesModeName);

TEST(PipelineForwardTest, RefusesAPlanItCannotRun) {
  const auto dir = FixtureDir() / "tiny-gqa-untied";
  EXPECT_FALSE(pipeline::PipelineForward::Load(dir, {}, 10, kBlock, 1, 1).ok());
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok());
  auto plan = pipeline::PlanStages(*config, {.num_stages = 2});
  ASSERT_TRUE(plan.ok());
  const auto bad = pipeline::PipelineForward::Load(dir, *plan, 10, kBlock, 0, 1);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("micro_batches"), std::string::npos) << bad.status();
  const auto missing = pipeline::PipelineForward::Load("/nonexistent", *plan, 10, kBlock, 1, 1);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("pipeline stage 0"), std::string::npos)
      << missing.status();
}

}  // namespace
}  // namespace ts::testing
