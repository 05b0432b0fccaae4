// How a pipeline splits a Llama checkpoint across stages (one GPU each): contiguous layer ranges
// balanced by weight bytes, the embedding on the first stage, the final norm, lm_head and sampling
// on the last. With tied embeddings the last stage needs the embedding matrix too (as its
// lm_head), so both ends load it. docs/pipeline.md describes the pipeline this plans for.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "models/config.h"

namespace ts::pipeline {

struct StagePlan {
  int32_t stage = 0;
  int32_t first_layer = 0;  // the stage runs layers [first_layer, first_layer + num_layers)
  int32_t num_layers = 0;
  bool has_embedding = false;      // looks up the token embeddings (the first stage)
  bool has_head = false;           // final norm, lm_head and sampling (the last stage)
  int64_t weight_bytes = 0;        // everything the stage loads
  int64_t kv_bytes_per_token = 0;  // K and V of its layers
};

struct StagePlanOptions {
  int32_t num_stages = 1;        // >= 1 and <= the model's layers
  int32_t bytes_per_weight = 2;  // as the stages hold them (bf16 on the GPU)
  int32_t bytes_per_kv = 2;      // the KV cache's element size
};

// The weight bytes of one decoder layer, of the embedding and of the head (final norm + lm_head;
// with tied embeddings lm_head is a copy of the embedding, except on a single stage, which holds
// the matrix once), from the config's shapes.
int64_t LayerWeightBytes(const ModelConfig& config, int32_t bytes_per_weight);
int64_t EmbeddingWeightBytes(const ModelConfig& config, int32_t bytes_per_weight);
int64_t HeadWeightBytes(const ModelConfig& config, int32_t bytes_per_weight);

// Contiguous layer ranges, one per stage, whose largest stage (in weight bytes, the embedding and
// head included) is as small as it can be; every stage gets at least one layer. Of equally good
// splits, the one with fewer layers on later stages (the last one also samples). InvalidArgument
// naming "pipeline_stages" when there are fewer layers than stages or no stage at all.
absl::StatusOr<std::vector<StagePlan>> PlanStages(const ModelConfig& config,
                                                  const StagePlanOptions& options);

// KV blocks of `block_size` tokens that fit in `kv_memory_bytes` for the stage (0 when none).
int64_t KvBlocksFor(const StagePlan& stage, int64_t kv_memory_bytes, int32_t block_size);

// One line per stage, for the startup log: layers, bytes, KV per token and, when
// `device_memory_bytes` > 0, the KV blocks the rest of that memory holds.
std::string DescribePlan(const std::vector<StagePlan>& plan, int64_t device_memory_bytes,
                         int32_t block_size);

}  // namespace ts::pipeline
