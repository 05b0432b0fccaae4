// The configs of two real checkpoints, as their config.json gives them, for benchmarks and tests
// that need a real shape without the checkpoint: Llama-3.2-1B (tied embeddings) and Llama-3.1-8B.
#pragma once

#include "models/config.h"

namespace ts {

inline ModelConfig Llama3Shape(bool eight_b) {
  ModelConfig c;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.vocab_size = 128256;
  c.max_position_embeddings = 131072;
  c.rms_norm_eps = 1e-5f;
  c.rope_theta = 500000.0f;
  c.rope_scaling.type = RopeType::kLlama3;
  c.rope_scaling.low_freq_factor = 1.0f;
  c.rope_scaling.high_freq_factor = 4.0f;
  c.rope_scaling.original_max_position_embeddings = 8192;
  c.dtype = DType::kBF16;
  c.bos_token_ids = {128000};
  c.eos_token_ids = {128001, 128008, 128009};
  if (!eight_b) {
    c.hidden_size = 2048;
    c.intermediate_size = 8192;
    c.num_layers = 16;
    c.head_dim = 64;
    c.tie_word_embeddings = true;
    c.rope_scaling.factor = 32.0f;
  } else {
    c.hidden_size = 4096;
    c.intermediate_size = 14336;
    c.num_layers = 32;
    c.head_dim = 128;
    c.tie_word_embeddings = false;
    c.rope_scaling.factor = 8.0f;
  }
  return c;
}
inline ModelConfig Llama1bShape() {
  return Llama3Shape(false);
}
inline ModelConfig Llama8bShape() {
  return Llama3Shape(true);
}

}  // namespace ts
