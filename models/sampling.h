// Reference sampler (fp32, CPU). The CUDA sampling kernel implements the same pipeline and the same
// RNG (common/philox.h), so a seeded stream depends only on (seed, position):
//   penalties -> temperature (0 = greedy) -> top-k -> top-p -> min-p -> draw with
//   u = UniformFromSeed(seed, position).
// Penalties follow vLLM: repetition over prompt + output (logit > 0 divided, < 0 multiplied);
// presence and frequency over the output only (logit -= presence + frequency * count).
// Greedy ties break to the lowest token id.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"

namespace ts {

struct SamplingParams {
  float temperature = 1.0f;  // 0 = greedy
  int32_t top_k = 0;         // 0 = off
  float top_p = 1.0f;        // (0, 1]; 1 = off
  float min_p = 0.0f;        // [0, 1]; 0 = off
  float repetition_penalty = 1.0f;  // > 0; 1 = off
  float presence_penalty = 0.0f;    // [-2, 2]
  float frequency_penalty = 0.0f;   // [-2, 2]
  uint64_t seed = 0;
  bool greedy() const { return temperature == 0.0f; }
};

// Checks ranges; the error names the field. vocab_size bounds top_k.
absl::Status ValidateSamplingParams(const SamplingParams& p, int32_t vocab_size);

// Applies the penalties in place. logits: [vocab].
void ApplyPenalties(std::span<float> logits, const SamplingParams& p,
                    std::span<const int32_t> prompt, std::span<const int32_t> output);

// Picks one token from already-penalised logits. `position` is the absolute position of the token
// being sampled (prompt length + tokens generated so far). logits: [vocab], may be modified.
int32_t SampleFromLogits(std::span<float> logits, const SamplingParams& p, uint64_t position);

// ApplyPenalties then SampleFromLogits.
int32_t SampleToken(std::span<float> logits, const SamplingParams& p,
                    std::span<const int32_t> prompt, std::span<const int32_t> output);

}  // namespace ts
