// Llama-family model configuration, parsed from a Hugging Face checkpoint directory.
// Accepts both config.json dialects: transformers 5.x (`rope_parameters`, `dtype`) and the one
// published with Llama 3.x checkpoints (top-level `rope_theta`, `rope_scaling`, `torch_dtype`).
// Options we do not implement (sliding window, unknown rope types, biases, ...) are refused with
// an error naming the key: we never compute a model wrongly.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace ts {

enum class DType : uint8_t { kF32, kF16, kBF16 };
std::string_view DTypeName(DType t);
size_t DTypeSize(DType t);

enum class RopeType : uint8_t { kDefault, kLlama3 };

struct RopeScaling {
  RopeType type = RopeType::kDefault;
  // llama3 only.
  float factor = 1.0f;
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;
  int original_max_position_embeddings = 8192;
};

struct ModelConfig {
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;  // == num_heads for MHA
  int head_dim = 0;      // explicit `head_dim`, else hidden_size / num_heads
  int vocab_size = 0;
  int max_position_embeddings = 0;
  float rms_norm_eps = 1e-6f;  // transformers' LlamaConfig default when the key is absent
  float rope_theta = 10000.0f;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  // The declared `dtype`/`torch_dtype`; float32 when absent, as transformers assumes. Tensors carry
  // their own dtype, so this is a hint for what to compute in, not a promise about the files.
  DType dtype = DType::kF32;
  // Unions of config.json and generation_config.json, first-seen order, no duplicates.
  std::vector<int32_t> bos_token_ids;
  std::vector<int32_t> eos_token_ids;
};

// Parses config.json text. `source` names the file in error messages. head_dim may differ from
// hidden_size / num_heads only when config.json states it (q_proj is [num_heads*head_dim, hidden]).
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text,
                                             std::string_view source = "config.json");
// Merges generation_config.json (bos/eos ids, which may be a single id or a list).
absl::Status MergeGenerationConfig(std::string_view json_text, ModelConfig* config,
                                   std::string_view source = "generation_config.json");
// Reads <dir>/config.json and, when present, <dir>/generation_config.json.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::filesystem::path& dir);

}  // namespace ts
