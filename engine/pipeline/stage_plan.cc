#include "engine/pipeline/stage_plan.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ts::pipeline {
namespace {

// Weight bytes of `stage` when it runs `layers` layers (the embedding goes with stage 0, the head
// with stage num_stages - 1; with one stage, both).
struct StageCost {
  int64_t layer, embedding, head;
  int64_t final_norm;  // what the head adds where the stage already holds a tied embedding
  bool tied;
  int32_t num_stages;
  int64_t operator()(int32_t stage, int32_t layers) const {
    int64_t bytes = layer * layers;
    if (stage == 0) bytes += embedding;
    if (stage == num_stages - 1) bytes += tied && stage == 0 ? final_norm : head;
    return bytes;
  }
};

}  // namespace

int64_t LayerWeightBytes(const ModelConfig& c, int32_t bytes_per_weight) {
  const int64_t h = c.hidden_size, q = int64_t{c.num_heads} * c.head_dim;
  const int64_t kv = int64_t{c.num_kv_heads} * c.head_dim, inter = c.intermediate_size;
  const int64_t params = h * q + 2 * h * kv + q * h  // q, k, v, o
                         + 3 * h * inter             // gate, up, down
                         + 2 * h;                    // the two RMSNorms
  return params * bytes_per_weight;
}

int64_t EmbeddingWeightBytes(const ModelConfig& c, int32_t bytes_per_weight) {
  return int64_t{c.vocab_size} * c.hidden_size * bytes_per_weight;
}

int64_t HeadWeightBytes(const ModelConfig& c, int32_t bytes_per_weight) {
  // Tied: the last stage holds its own copy of the embedding matrix as lm_head.
  return (int64_t{c.vocab_size} * c.hidden_size + c.hidden_size) * bytes_per_weight;
}

absl::StatusOr<std::vector<StagePlan>> PlanStages(const ModelConfig& config,
                                                  const StagePlanOptions& options) {
  const int32_t s = options.num_stages, n = config.num_layers;
  if (s < 1) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline_stages: must be >= 1, got ", s));
  }
  if (n < s) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline_stages: ", s, " stages for a model of ", n,
                     " layers; every stage needs at least one layer"));
  }
  if (options.bytes_per_weight < 1 || options.bytes_per_kv < 1) {
    return absl::InvalidArgumentError("pipeline: bytes_per_weight and bytes_per_kv must be >= 1");
  }
  const StageCost cost{LayerWeightBytes(config, options.bytes_per_weight),
                       EmbeddingWeightBytes(config, options.bytes_per_weight),
                       HeadWeightBytes(config, options.bytes_per_weight),
                       int64_t{config.hidden_size} * options.bytes_per_weight,
                       config.tie_word_embeddings,
                       s};
  // best[k][i]: the smallest largest-stage cost of stages 0..k-1 running layers [0, i).
  // Layers are all alike, so only counts matter; O(s * n^2) is nothing at n <= a few hundred.
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<int64_t>> best(s + 1, std::vector<int64_t>(n + 1, kInf));
  std::vector<std::vector<int32_t>> cut(s + 1, std::vector<int32_t>(n + 1, 0));
  best[0][0] = 0;
  for (int32_t k = 1; k <= s; ++k) {
    for (int32_t i = k; i <= n - (s - k); ++i) {
      // Stage k-1 takes layers [j, i); scanning j downwards with `<` keeps the largest j among
      // equals: the fewest layers on this stage, the most on the earlier ones.
      for (int32_t j = i - 1; j >= k - 1; --j) {
        if (best[k - 1][j] == kInf) continue;
        const int64_t c = std::max(best[k - 1][j], cost(k - 1, i - j));
        if (c < best[k][i]) best[k][i] = c, cut[k][i] = j;
      }
    }
  }
  std::vector<StagePlan> plan(s);
  int32_t end = n;
  for (int32_t k = s; k >= 1; --k) {
    const int32_t begin = cut[k][end];
    StagePlan& p = plan[k - 1];
    p.stage = k - 1;
    p.first_layer = begin;
    p.num_layers = end - begin;
    p.has_embedding = k == 1;
    p.has_head = k == s;
    p.weight_bytes = cost(k - 1, p.num_layers);
    p.kv_bytes_per_token =
        int64_t{p.num_layers} * 2 * config.num_kv_heads * config.head_dim * options.bytes_per_kv;
    end = begin;
  }
  return plan;
}

int64_t KvBlocksFor(const StagePlan& stage, int64_t kv_memory_bytes, int32_t block_size) {
  const int64_t per_block = stage.kv_bytes_per_token * block_size;
  if (per_block <= 0 || kv_memory_bytes <= 0) return 0;
  return kv_memory_bytes / per_block;
}

std::string DescribePlan(const std::vector<StagePlan>& plan, int64_t device_memory_bytes,
                         int32_t block_size) {
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  std::string out;
  for (const StagePlan& p : plan) {
    absl::StrAppendFormat(&out,
                          "stage %d: layers %d-%d (%d)%s%s, weights %.2f GiB, KV %lld B/token",
                          p.stage, p.first_layer, p.first_layer + p.num_layers - 1, p.num_layers,
                          p.has_embedding ? ", embedding" : "", p.has_head ? ", head" : "",
                          p.weight_bytes / kGiB, static_cast<long long>(p.kv_bytes_per_token));
    if (device_memory_bytes > 0) {
      const int64_t blocks = KvBlocksFor(p, device_memory_bytes - p.weight_bytes, block_size);
      absl::StrAppendFormat(&out, ", %lld KV blocks of %d tokens", static_cast<long long>(blocks),
                            block_size);
    }
    out += "\n";
  }
  return out;
}

}  // namespace ts::pipeline
