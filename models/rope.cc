#include "models/rope.h"

#include <cmath>
#include <numbers>

#include "absl/strings/str_cat.h"

namespace ts {

absl::StatusOr<std::vector<float>> RopeInvFreq(const ModelConfig& config) {
  const int dim = config.head_dim;
  if (dim <= 0 || dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.head_dim must be positive and even, got ", dim));
  }
  if (!(config.rope_theta > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.rope_theta must be > 0, got ", config.rope_theta));
  }
  // transformers: 1.0 / (base ** (arange(0, dim, 2).float() / dim)), every step in fp32.
  std::vector<float> inv(dim / 2);
  for (int i = 0; i < dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    inv[i] = 1.0f / std::pow(config.rope_theta, exponent);
  }
  const RopeScaling& s = config.rope_scaling;
  if (s.type == RopeType::kDefault) return inv;

  // _compute_llama3_parameters, op for op in fp32 (python scalars meet fp32 tensors as fp32).
  if (!(s.factor > 0.0f) || !(s.low_freq_factor > 0.0f) || !(s.high_freq_factor > 0.0f) ||
      s.high_freq_factor == s.low_freq_factor || s.original_max_position_embeddings <= 0) {
    return absl::InvalidArgumentError(
        "config.rope_scaling: llama3 needs factor > 0, low_freq_factor > 0, high_freq_factor > 0 "
        "and != low_freq_factor, original_max_position_embeddings > 0");
  }
  const float old_context = static_cast<float>(s.original_max_position_embeddings);
  const float low_freq_wavelen = static_cast<float>(
      static_cast<double>(s.original_max_position_embeddings) / s.low_freq_factor);
  const float high_freq_wavelen = static_cast<float>(
      static_cast<double>(s.original_max_position_embeddings) / s.high_freq_factor);
  const float two_pi = static_cast<float>(2.0 * std::numbers::pi);
  const float freq_range = static_cast<float>(static_cast<double>(s.high_freq_factor) -
                                              static_cast<double>(s.low_freq_factor));
  for (float& f : inv) {
    const float wavelen = two_pi / f;
    const float scaled = wavelen > low_freq_wavelen ? f / s.factor : f;
    const float smooth = (old_context / wavelen - s.low_freq_factor) / freq_range;
    const float smoothed = (1.0f - smooth) * scaled / s.factor + smooth * scaled;
    const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
    f = medium ? smoothed : scaled;
  }
  return inv;
}

}  // namespace ts
