// The CPU reference split into pipeline stages (CpuStage): on every fixture and every way to cut
// its layers into 2 or 3 stages, the chained stages give the whole model's logits bit for bit,
// for a batched prefill and for greedy decoding token by token, each stage with a KV pool of its
// own layers only. This is the reference a pipeline of GPUs is held to (docs/pipeline.md).
#include <cstring>
#include <fstream>
#include <vector>

#include "gtest/gtest.h"
#include "models/cpu_model.h"
#include "nlohmann/json.hpp"
#include "tests/common/test_paths.h"

namespace ts {
namespace {

constexpr int32_t kBlock = 16;
constexpr int32_t kBlocksPerSeq = 16;  // 256 positions, the fixtures' max

std::vector<std::vector<int32_t>> Prompts(const std::string& variant) {
  std::ifstream in(testing::FixtureDir() / variant / "reference.json");
  return nlohmann::json::parse(in).at("prompts").get<std::vector<std::vector<int32_t>>>();
}

// One model split at `cuts` (layer counts per stage), each stage with its own KV pool.
struct Pipeline {
  std::vector<std::unique_ptr<CpuModel>> stages;
  std::vector<std::unique_ptr<CpuKvPool>> pools;

  absl::Status Load(const std::filesystem::path& dir, const std::vector<int32_t>& cuts,
                    int32_t num_seqs) {
    int32_t first = 0;
    for (size_t s = 0; s < cuts.size(); ++s) {
      CpuModelOptions o{.num_threads = 2};
      o.stage = {.first_layer = first,
                 .num_layers = cuts[s],
                 .embedding = s == 0,
                 .head = s + 1 == cuts.size()};
      absl::StatusOr<std::unique_ptr<CpuModel>> m = CpuModel::Load(dir, o);
      if (!m.ok()) return m.status();
      ModelConfig kv_config = (*m)->config();
      kv_config.num_layers = (*m)->num_stage_layers();
      pools.push_back(std::make_unique<CpuKvPool>(kv_config, num_seqs * kBlocksPerSeq, kBlock));
      stages.push_back(*std::move(m));
      first += cuts[s];
    }
    return absl::OkStatus();
  }

  // Runs the chunks through every stage; the last one's logits in *logits.
  absl::Status Forward(std::span<const SeqChunk> chunks, LogitsMode mode,
                       std::vector<float>* logits) {
    std::vector<float> hidden;
    for (size_t s = 0; s < stages.size(); ++s) {
      std::vector<float> next;
      const absl::Status st = stages[s]->ForwardStage(chunks, *pools[s], hidden, mode,
                                                      s + 1 == stages.size() ? logits : &next);
      if (!st.ok()) return st;
      hidden = std::move(next);
    }
    return absl::OkStatus();
  }
};

std::vector<std::vector<int32_t>> Tables(int32_t num_seqs) {
  std::vector<std::vector<int32_t>> t(num_seqs);
  for (int32_t i = 0; i < num_seqs; ++i) {
    for (int32_t b = 0; b < kBlocksPerSeq; ++b) t[i].push_back(i * kBlocksPerSeq + b);
  }
  return t;
}

int32_t ArgMax(const float* row, int32_t n) {
  return static_cast<int32_t>(std::max_element(row, row + n) - row);
}

// Prefills every prompt in one batch (all positions' logits), then decodes `steps` greedy tokens
// for all of them together. Returns the prefill logits and the tokens.
struct Generated {
  std::vector<float> prefill_logits;
  std::vector<std::vector<int32_t>> tokens;
};
template <typename ForwardFn>
Generated Generate(const std::vector<std::vector<int32_t>>& prompts, int32_t vocab, int32_t steps,
                   ForwardFn forward) {
  const auto tables = Tables(static_cast<int32_t>(prompts.size()));
  Generated run;
  std::vector<SeqChunk> chunks;
  for (size_t i = 0; i < prompts.size(); ++i) {
    chunks.push_back({.tokens = prompts[i], .start_pos = 0, .block_table = tables[i]});
  }
  EXPECT_TRUE(forward(chunks, LogitsMode::kAll, &run.prefill_logits).ok());
  run.tokens.resize(prompts.size());
  std::vector<int32_t> last(prompts.size());
  size_t row = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    row += prompts[i].size();
    last[i] = ArgMax(&run.prefill_logits[(row - 1) * vocab], vocab);
    run.tokens[i].push_back(last[i]);
  }
  for (int32_t step = 1; step < steps; ++step) {
    chunks.clear();
    for (size_t i = 0; i < prompts.size(); ++i) {
      const int32_t pos = static_cast<int32_t>(prompts[i].size()) + step - 1;
      chunks.push_back({.tokens = {&last[i], 1}, .start_pos = pos, .block_table = tables[i]});
    }
    std::vector<float> logits;
    EXPECT_TRUE(forward(chunks, LogitsMode::kLastPerChunk, &logits).ok());
    for (size_t i = 0; i < prompts.size(); ++i) {
      last[i] = ArgMax(&logits[i * vocab], vocab);
      run.tokens[i].push_back(last[i]);
    }
  }
  return run;
}

class CpuStageTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CpuStageTest, ChainedStagesEqualTheWholeModelBitForBit) {
  const auto dir = testing::FixtureDir() / GetParam();
  const auto prompts = Prompts(GetParam());
  ASSERT_FALSE(prompts.empty());
  constexpr int32_t kSteps = 24;
  auto whole = CpuModel::Load(dir, {.num_threads = 2});
  ASSERT_TRUE(whole.ok()) << whole.status();
  const int32_t vocab = (*whole)->config().vocab_size;
  const int32_t layers = (*whole)->config().num_layers;
  CpuKvPool kv((*whole)->config(), static_cast<int32_t>(prompts.size()) * kBlocksPerSeq, kBlock);
  const Generated want =
      Generate(prompts, vocab, kSteps, [&](auto chunks, LogitsMode mode, auto* out) {
        return (*whole)->Forward(chunks, kv, mode, out);
      });

  std::vector<std::vector<int32_t>> splits;
  for (int32_t a = 1; a < layers; ++a) splits.push_back({a, layers - a});
  if (layers >= 3) splits.push_back({1, 1, layers - 2});
  ASSERT_FALSE(splits.empty());
  for (const auto& cuts : splits) {
    SCOPED_TRACE(::testing::PrintToString(cuts));
    Pipeline p;
    ASSERT_TRUE(p.Load(dir, cuts, static_cast<int32_t>(prompts.size())).ok());
    const Generated got = Generate(
        prompts, vocab, kSteps,
        [&](auto chunks, LogitsMode mode, auto* out) { return p.Forward(chunks, mode, out); });
    ASSERT_EQ(got.prefill_logits.size(), want.prefill_logits.size());
    EXPECT_EQ(std::memcmp(got.prefill_logits.data(), want.prefill_logits.data(),
                          want.prefill_logits.size() * sizeof(float)),
              0);
    EXPECT_EQ(got.tokens, want.tokens);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CpuStageTest,
                         ::testing::Values("tiny-mha-tied", "tiny-gqa-untied", "tiny-llama3-rope",
                                           "tiny-oldstyle-sharded"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n) c = std::isalnum(c) ? c : '_';
                           return n;
                         });

TEST(CpuStageTest, StagesLoadOnlyTheirOwnTensorsAndCheckTheirInputs) {
  const auto dir = testing::FixtureDir() / "tiny-gqa-untied";  // 3 layers, untied
  auto whole = CpuModel::Load(dir, {.num_threads = 1});
  ASSERT_TRUE(whole.ok());
  CpuModelOptions middle{.num_threads = 1};
  middle.stage = {.first_layer = 1, .num_layers = 1, .embedding = false, .head = false};
  auto mid = CpuModel::Load(dir, middle);
  ASSERT_TRUE(mid.ok()) << mid.status();
  // One layer of three and neither the embedding nor lm_head: well under a third of the bytes.
  EXPECT_LT((*mid)->weight_bytes() * 3, (*whole)->weight_bytes());
  EXPECT_EQ((*mid)->num_stage_layers(), 1);

  ModelConfig kv_config = (*mid)->config();
  kv_config.num_layers = 1;
  CpuKvPool kv(kv_config, kBlocksPerSeq, kBlock);
  const std::vector<int32_t> tokens = {1, 2, 3}, table = Tables(1)[0];
  const SeqChunk chunk{.tokens = tokens, .start_pos = 0, .block_table = table};
  std::vector<float> out;
  const std::vector<float> short_hidden(2 * (*mid)->config().hidden_size, 0.5f);
  EXPECT_EQ((*mid)->ForwardStage({&chunk, 1}, kv, short_hidden, LogitsMode::kAll, &out).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*mid)->Forward({&chunk, 1}, kv, LogitsMode::kAll, &out).code(),
            absl::StatusCode::kFailedPrecondition);
  CpuKvPool whole_kv((*mid)->config(), kBlocksPerSeq, kBlock);  // all 3 layers: the wrong pool
  const std::vector<float> hidden(3 * (*mid)->config().hidden_size, 0.5f);
  EXPECT_EQ((*mid)->ForwardStage({&chunk, 1}, whole_kv, hidden, LogitsMode::kAll, &out).code(),
            absl::StatusCode::kInvalidArgument);
  CpuModelOptions bad{.num_threads = 1};
  bad.stage = {.first_layer = 2, .num_layers = 2};
  EXPECT_EQ(CpuModel::Load(dir, bad).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ts
