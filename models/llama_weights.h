// Binds a checkpoint's tensors to the Llama layout and checks every shape against the config.
// Both backends start from this: the CPU reference upcasts, the CUDA backend copies bf16 to the GPU.
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

// Fails with the tensor's name for a missing tensor, a wrong shape, or an unexpected bias tensor.
absl::StatusOr<LlamaTensors> BindLlamaTensors(const Checkpoint& ckpt, const ModelConfig& config);

}  // namespace ts
