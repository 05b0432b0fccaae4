// Binds a checkpoint's tensors to the Llama layout and checks every shape against the config.
// Both backends start from this: the CPU reference upcasts, the CUDA backend copies bf16 to the
// GPU. Tensor names are Hugging Face's (model.layers.{i}.self_attn.q_proj.weight, ...).
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "models/checkpoint.h"
#include "models/config.h"

namespace ts {

struct LlamaLayerTensors {
  const TensorView* attn_norm;  // [hidden]
  const TensorView* q_proj;     // [num_heads*head_dim, hidden]
  const TensorView* k_proj;     // [num_kv_heads*head_dim, hidden]
  const TensorView* v_proj;     // [num_kv_heads*head_dim, hidden]
  const TensorView* o_proj;     // [hidden, num_heads*head_dim]
  const TensorView* mlp_norm;   // [hidden]
  const TensorView* gate_proj;  // [intermediate, hidden]
  const TensorView* up_proj;    // [intermediate, hidden]
  const TensorView* down_proj;  // [hidden, intermediate]
};

struct LlamaTensors {
  const TensorView* embed;       // [vocab, hidden]
  const TensorView* final_norm;  // [hidden]
  const TensorView* lm_head;     // [vocab, hidden]; == embed when tied
  std::vector<LlamaLayerTensors> layers;
};

// Fails with the tensor's name for a missing tensor, a wrong shape, or an unexpected tensor (any
// bias, a layer index >= num_layers, anything else Llama does not use): a tensor we silently
// ignored would mean computing a different model. rotary_emb.inv_freq buffers are skipped.
// lm_head.weight is required unless config.tie_word_embeddings. The result points into `ckpt`.
// Every bound tensor is then scanned: a NaN or Inf weight is refused, naming the tensor (it would
// otherwise load and serve garbage while health says SERVING).
absl::StatusOr<LlamaTensors> BindLlamaTensors(const Checkpoint& ckpt, const ModelConfig& config);

// INVALID_ARGUMENT naming the first tensor (in `tensors` order) that holds a NaN or an Inf, and
// the element. Reads the raw bf16/f16/f32 bits on up to `num_threads` threads (0 = all hardware
// threads): a memory-bound pass, a few seconds for a 16 GB checkpoint.
absl::Status CheckTensorsFinite(const std::vector<const TensorView*>& tensors, int num_threads = 0);

}  // namespace ts
