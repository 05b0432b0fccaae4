// The pipeline's stage plan against a brute force over every split, on real Llama shapes and on
// random small ones: contiguous, complete, at least one layer a stage, the smallest largest stage.
#include "engine/pipeline/stage_plan.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/llama_shapes.h"

namespace ts::pipeline {
namespace {

using ::testing::HasSubstr;

// Every way to cut n layers into s non-empty contiguous ranges: the smallest largest stage.
int64_t BruteForceBest(const ModelConfig& c, int32_t s, int32_t bytes) {
  const int64_t layer = LayerWeightBytes(c, bytes), emb = EmbeddingWeightBytes(c, bytes),
                head = HeadWeightBytes(c, bytes);
  int64_t best = std::numeric_limits<int64_t>::max();
  std::vector<int32_t> parts;
  std::function<void(int32_t)> go = [&](int32_t left) {
    const int32_t k = static_cast<int32_t>(parts.size());
    if (k == s - 1) {
      if (left < 1) return;
      parts.push_back(left);
      int64_t worst = 0;
      for (int32_t i = 0; i < s; ++i) {
        const int64_t end = c.tie_word_embeddings && s == 1 ? int64_t{bytes} * c.hidden_size : head;
        worst = std::max(worst, layer * parts[i] + (i == 0 ? emb : 0) + (i == s - 1 ? end : 0));
      }
      best = std::min(best, worst);
      parts.pop_back();
      return;
    }
    for (int32_t take = 1; take <= left - (s - 1 - k); ++take) {
      parts.push_back(take);
      go(left - take);
      parts.pop_back();
    }
  };
  go(c.num_layers);
  return best;
}

void ExpectWellFormed(const ModelConfig& c, const std::vector<StagePlan>& plan, int32_t s) {
  ASSERT_EQ(plan.size(), static_cast<size_t>(s));
  int32_t next = 0;
  for (int32_t i = 0; i < s; ++i) {
    EXPECT_EQ(plan[i].stage, i);
    EXPECT_EQ(plan[i].first_layer, next);
    EXPECT_GE(plan[i].num_layers, 1);
    EXPECT_EQ(plan[i].has_embedding, i == 0);
    EXPECT_EQ(plan[i].has_head, i == s - 1);
    next += plan[i].num_layers;
  }
  EXPECT_EQ(next, c.num_layers);
}

int64_t Largest(const std::vector<StagePlan>& plan) {
  int64_t m = 0;
  for (const StagePlan& p : plan) m = std::max(m, p.weight_bytes);
  return m;
}

TEST(StagePlanTest, Llama8bOnTwoStagesSplitsInHalfAndAccountsForEveryByte) {
  const ModelConfig c = Llama8bShape();
  absl::StatusOr<std::vector<StagePlan>> plan = PlanStages(c, {.num_stages = 2});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ExpectWellFormed(c, *plan, 2);
  EXPECT_EQ((*plan)[0].num_layers, 16);
  // Untied: the bytes add up to the checkpoint's bf16 size, 8.03 B parameters.
  const int64_t total = (*plan)[0].weight_bytes + (*plan)[1].weight_bytes;
  EXPECT_EQ(total,
            2 * (32 * LayerWeightBytes(c, 1) + EmbeddingWeightBytes(c, 1) + HeadWeightBytes(c, 1)));
  EXPECT_EQ(total / 2, 8030261248);  // Llama-3.1-8B's parameter count
  // K and V of 16 layers, 8 kv heads of 128, bf16.
  EXPECT_EQ((*plan)[1].kv_bytes_per_token, 16 * 2 * 8 * 128 * 2);
}

TEST(StagePlanTest, TiedEmbeddingsAreHeldByBothEnds) {
  const ModelConfig c = Llama1bShape();
  absl::StatusOr<std::vector<StagePlan>> plan = PlanStages(c, {.num_stages = 2});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ExpectWellFormed(c, *plan, 2);
  const int64_t emb = EmbeddingWeightBytes(c, 2);
  // Each end carries the 128256 x 2048 matrix: as the embedding, and as lm_head.
  EXPECT_GE((*plan)[0].weight_bytes, emb);
  EXPECT_GE((*plan)[1].weight_bytes, emb);
  EXPECT_EQ((*plan)[0].num_layers, 8);
  // One stage holds the matrix once: the tied lm_head is the embedding.
  absl::StatusOr<std::vector<StagePlan>> one = PlanStages(c, {.num_stages = 1});
  ASSERT_TRUE(one.ok());
  EXPECT_EQ((*one)[0].weight_bytes, 16 * LayerWeightBytes(c, 2) + emb + 2 * c.hidden_size);
}

TEST(StagePlanTest, MatchesTheBruteForceOnRandomShapes) {
  std::mt19937 rng(5);
  int uneven = 0;
  for (int trial = 0; trial < 300; ++trial) {
    ModelConfig c;
    c.hidden_size = 64 * (1 + rng() % 8);
    c.intermediate_size = 64 * (1 + rng() % 24);
    c.num_heads = 1 << (rng() % 4);
    c.num_kv_heads = std::max(1, c.num_heads >> (rng() % 3));
    c.head_dim = 16 << (rng() % 3);
    c.vocab_size = 1000 + static_cast<int>(rng() % 200000);  // the embedding may outweigh layers
    c.num_layers = 1 + static_cast<int>(rng() % 12);
    c.tie_word_embeddings = rng() % 2 == 0;
    const int32_t s = 1 + static_cast<int32_t>(rng() % std::min(4, c.num_layers));
    absl::StatusOr<std::vector<StagePlan>> plan = PlanStages(c, {.num_stages = s});
    ASSERT_TRUE(plan.ok()) << plan.status();
    ExpectWellFormed(c, *plan, s);
    EXPECT_EQ(Largest(*plan), BruteForceBest(c, s, 2)) << "trial " << trial;
    uneven += s > 1 && (*plan)[0].num_layers != (*plan)[s - 1].num_layers;
  }
  EXPECT_GT(uneven, 20);  // the embedding and head do push layers around
}

TEST(StagePlanTest, UnevenLayerCountsFavourEarlierStagesOnTies) {
  ModelConfig c = Llama8bShape();
  c.num_layers = 31;
  absl::StatusOr<std::vector<StagePlan>> plan = PlanStages(c, {.num_stages = 2});
  ASSERT_TRUE(plan.ok());
  // 16 + 15 and 15 + 16 cost the same; the last stage, which also samples, gets the 15.
  EXPECT_EQ((*plan)[0].num_layers, 16);
  EXPECT_EQ((*plan)[1].num_layers, 15);
  plan = PlanStages(Llama8bShape(), {.num_stages = 3});
  ASSERT_TRUE(plan.ok());
  // The middle stage carries neither embedding nor head, so it takes the most layers.
  EXPECT_GT((*plan)[1].num_layers, (*plan)[0].num_layers);
  EXPECT_EQ((*plan)[0].num_layers + (*plan)[1].num_layers + (*plan)[2].num_layers, 32);
}

TEST(StagePlanTest, FewerLayersThanStagesIsAClearError) {
  ModelConfig c = Llama8bShape();
  c.num_layers = 3;
  absl::StatusOr<std::vector<StagePlan>> plan = PlanStages(c, {.num_stages = 4});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(plan.status().message()),
              HasSubstr("pipeline_stages: 4 stages for a model of 3 layers"));
  EXPECT_FALSE(PlanStages(c, {.num_stages = 0}).ok());
}

TEST(StagePlanTest, DescribesLayersBytesAndKvBlocks) {
  const ModelConfig c = Llama8bShape();
  absl::StatusOr<std::vector<StagePlan>> plan = PlanStages(c, {.num_stages = 2});
  ASSERT_TRUE(plan.ok());
  const int64_t memory = int64_t{20} << 30;
  const std::string text = DescribePlan(*plan, memory, 16);
  EXPECT_THAT(text, HasSubstr("stage 0: layers 0-15 (16), embedding, weights 7.48 GiB"));
  EXPECT_THAT(text, HasSubstr("stage 1: layers 16-31 (16), head"));
  const int64_t blocks = KvBlocksFor((*plan)[0], memory - (*plan)[0].weight_bytes, 16);
  EXPECT_EQ(blocks, (memory - (*plan)[0].weight_bytes) / (16 * (*plan)[0].kv_bytes_per_token));
  EXPECT_THAT(text, HasSubstr(absl::StrCat(blocks, " KV blocks of 16 tokens")));
  EXPECT_EQ(KvBlocksFor((*plan)[0], -5, 16), 0);
}

}  // namespace
}  // namespace ts::pipeline
