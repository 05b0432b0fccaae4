// RoPE's inverse frequencies from a checkpoint's config, shared by the CPU reference and the CUDA
// backend (which uploads them for kernels/rope_kv.cuh and the GEMV's RoPE epilogue).
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "models/config.h"

namespace ts {

// inv_freq[i], i < head_dim / 2, exactly as transformers computes it in fp32:
//   default: 1 / rope_theta^(2i / head_dim);
//   llama3:  wavelengths longer than original_max_position_embeddings / low_freq_factor are
//            divided by `factor`, shorter than .../high_freq_factor kept, smoothly blended between.
// InvalidArgument for an odd or non-positive head_dim or llama3 factors that divide by zero.
absl::StatusOr<std::vector<float>> RopeInvFreq(const ModelConfig& config);

}  // namespace ts
