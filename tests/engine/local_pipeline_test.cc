// The in-process pipeline (LocalPipeline): stages as threads over in-memory queues, the batch in
// micro-batches. On the fixtures, for 2 and 3 stages and 1 to 4 micro-batches, its logits equal
// the whole CPU model's bit for bit while sequences arrive (prefilled in the same batch as others
// decode) and leave (cancelled) mid-run. Built with ThreadSanitizer in CI too.
#include "engine/pipeline/local_pipeline.h"

#include <cstring>
#include <fstream>
#include <map>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/common/test_paths.h"

namespace ts::pipeline {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int32_t kBlock = 16, kBlocksPerSeq = 16;

TEST(SplitMicroBatchesTest, ContiguousBalancedLargerFirst) {
  const auto sizes = [](int32_t n, int32_t m) {
    std::vector<int32_t> out;
    int32_t next = 0;
    for (const MicroBatch& b : SplitMicroBatches(n, m)) {
      EXPECT_EQ(b.first, next);
      next += b.count;
      out.push_back(b.count);
    }
    EXPECT_EQ(next, n);
    return out;
  };
  EXPECT_THAT(sizes(10, 3), ElementsAre(4, 3, 3));
  EXPECT_THAT(sizes(2, 4), ElementsAre(1, 1));  // never an empty micro-batch
  EXPECT_THAT(sizes(5, 1), ElementsAre(5));
  EXPECT_THAT(sizes(5, 0), ElementsAre(5));
  EXPECT_TRUE(SplitMicroBatches(0, 3).empty());
}

std::vector<std::unique_ptr<StageRunner>> Stages(const std::filesystem::path& dir,
                                                 const std::vector<int32_t>& cuts,
                                                 int32_t num_seqs) {
  std::vector<std::unique_ptr<StageRunner>> out;
  int32_t first = 0;
  for (size_t s = 0; s < cuts.size(); ++s) {
    CpuModelOptions o{.num_threads = 1};
    o.stage = {.first_layer = first,
               .num_layers = cuts[s],
               .embedding = s == 0,
               .head = s + 1 == cuts.size()};
    auto m = CpuModel::Load(dir, o);
    EXPECT_TRUE(m.ok()) << m.status();
    out.push_back(
        std::make_unique<CpuStageRunner>(*std::move(m), num_seqs * kBlocksPerSeq, kBlock));
    first += cuts[s];
  }
  return out;
}

// A run where sequences come and go: 0 and 1 start at step 0, 2 and 3 arrive at step 4 (their
// prompts prefilled in the same batch as 0 and 1 decode), 1 leaves after step 9, 4 arrives at
// step 12. Greedy; returns each sequence's tokens and every step's logits.
struct Trace {
  std::map<int, std::vector<int32_t>> tokens;
  std::vector<std::vector<float>> logits;
};
template <typename ForwardFn>
Trace Schedule(const std::vector<std::vector<int32_t>>& prompts, int32_t vocab, ForwardFn forward) {
  std::vector<std::vector<int32_t>> tables(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    for (int32_t b = 0; b < kBlocksPerSeq; ++b) {
      tables[i].push_back(static_cast<int32_t>(i) * kBlocksPerSeq + b);
    }
  }
  const std::map<int, int> arrive = {{0, 0}, {1, 0}, {2, 4}, {3, 4}, {4, 12}};
  const std::map<int, int> leave = {{1, 9}};
  Trace t;
  std::map<int, int32_t> pos, last;
  for (int step = 0; step < 20; ++step) {
    std::vector<SeqChunk> chunks;
    std::vector<int> seqs;
    for (const auto& [s, at] : arrive) {
      if (at > step || (leave.count(s) != 0 && leave.at(s) < step)) continue;
      if (at == step) {
        chunks.push_back({.tokens = prompts[s], .start_pos = 0, .block_table = tables[s]});
      } else {
        chunks.push_back({.tokens = {&last[s], 1}, .start_pos = pos[s], .block_table = tables[s]});
      }
      seqs.push_back(s);
    }
    std::vector<float> logits;
    EXPECT_TRUE(forward(chunks, &logits).ok());
    for (size_t i = 0; i < seqs.size(); ++i) {
      const float* row = logits.data() + i * vocab;
      const int s = seqs[i];
      pos[s] = chunks[i].start_pos + static_cast<int32_t>(chunks[i].tokens.size());
      last[s] = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
      t.tokens[s].push_back(last[s]);
    }
    t.logits.push_back(std::move(logits));
  }
  return t;
}

class LocalPipelineTest : public ::testing::TestWithParam<std::string> {};

TEST_P(LocalPipelineTest, EqualsTheWholeModelWithArrivalsAndCancellations) {
  const auto dir = ::ts::testing::FixtureDir() / GetParam();
  std::ifstream in(dir / "reference.json");
  auto prompts = nlohmann::json::parse(in).at("prompts").get<std::vector<std::vector<int32_t>>>();
  while (prompts.size() < 5) prompts.push_back(prompts[prompts.size() % 2]);
  const int32_t n = static_cast<int32_t>(prompts.size());
  auto whole = CpuModel::Load(dir, {.num_threads = 1});
  ASSERT_TRUE(whole.ok()) << whole.status();
  const int32_t vocab = (*whole)->config().vocab_size, layers = (*whole)->config().num_layers;
  CpuKvPool kv((*whole)->config(), n * kBlocksPerSeq, kBlock);
  const Trace want = Schedule(prompts, vocab, [&](auto chunks, auto* out) {
    return (*whole)->Forward(chunks, kv, LogitsMode::kLastPerChunk, out);
  });
  std::vector<std::vector<int32_t>> splits = {{1, layers - 1}};
  if (layers >= 3) splits.push_back({1, 1, layers - 2});
  for (const auto& cuts : splits) {
    for (int32_t m : {1, 2, 4}) {
      SCOPED_TRACE(::testing::PrintToString(cuts) + " micro-batches " + std::to_string(m));
      LocalPipeline pipeline(Stages(dir, cuts, n));
      const Trace got = Schedule(prompts, vocab, [&](auto chunks, auto* out) {
        return pipeline.Forward(chunks, LogitsMode::kLastPerChunk, m, out);
      });
      EXPECT_EQ(got.tokens, want.tokens);
      ASSERT_EQ(got.logits.size(), want.logits.size());
      for (size_t step = 0; step < want.logits.size(); ++step) {
        ASSERT_EQ(got.logits[step].size(), want.logits[step].size()) << "step " << step;
        EXPECT_EQ(std::memcmp(got.logits[step].data(), want.logits[step].data(),
                              want.logits[step].size() * sizeof(float)),
                  0)
            << "step " << step;
      }
    }
  }
  EXPECT_EQ(want.tokens.at(1).size(), 10u);  // left after step 9
  EXPECT_EQ(want.tokens.at(4).size(), 8u);   // came at step 12
}

INSTANTIATE_TEST_SUITE_P(Fixtures, LocalPipelineTest,
                         ::testing::Values("tiny-gqa-untied", "tiny-mha-tied"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s) c = std::isalnum(c) ? c : '_';
                           return s;
                         });

TEST(LocalPipelineErrorTest, AStageErrorNamesTheStageAndThePipelineStaysUsable) {
  const auto dir = ::ts::testing::FixtureDir() / "tiny-gqa-untied";
  LocalPipeline pipeline(Stages(dir, {1, 2}, 2));
  std::vector<int32_t> table(kBlocksPerSeq);
  for (int32_t b = 0; b < kBlocksPerSeq; ++b) table[b] = b;
  const std::vector<int32_t> good = {1, 2, 3}, bad = {1, 99999};
  std::vector<SeqChunk> chunks = {{.tokens = good, .start_pos = 0, .block_table = table},
                                  {.tokens = bad, .start_pos = 0, .block_table = table}};
  std::vector<float> out;
  const absl::Status s = pipeline.Forward(chunks, LogitsMode::kLastPerChunk, 2, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("stage 0: chunk 0: tokens[1] = 99999"));
  EXPECT_TRUE(out.empty());
  chunks.pop_back();
  EXPECT_TRUE(pipeline.Forward(chunks, LogitsMode::kLastPerChunk, 2, &out).ok());
  EXPECT_FALSE(out.empty());
}

}  // namespace
}  // namespace ts::pipeline
