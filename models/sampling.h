// Reference sampler (fp32, CPU). The CUDA sampling kernel implements the same pipeline and the same
// RNG (common/philox.h), so a seeded stream depends only on (seed, position), never on the batch.
//
// Pipeline, all arithmetic in fp32, V = vocab size:
//  1. Penalties (vLLM semantics), ApplyPenalties:
//     - repetition: every distinct token id in prompt ∪ output gets l = l / r if l > 0, else l * r;
//     - presence/frequency, over the output only: l -= presence + frequency * count(id in output)
//       for every id with count > 0.
//     Ids outside [0, V) in prompt/output are ignored (they are rejected at the request edge).
//  2. temperature == 0 (greedy): return the argmax; ties break to the lowest token id; NaN never
//     wins; all -inf/NaN returns token 0. Filters and the RNG are not used.
//  3. temperature: s_i = l_i / temperature, then NaN -> -inf and +inf -> FLT_MAX.
//  4. Order: sort ids by (s desc, id asc). Everything below walks this order, rank 0 first.
//     If s of rank 0 is -inf, return rank 0.
//  5. top-k (k > 0): keep ranks [0, k).
//  6. weights: w_r = exp(s_r - s_0) over the kept ranks (so w_0 = 1 is the max).
//     W = sum of w_r in rank order (sequential fp32 sum).
//  7. top-p (p < 1): keep the smallest prefix [0, n) whose running sum of w, in rank order, is
//     >= p * W. With p == 1 nothing is dropped.
//  8. min-p (m > 0): keep the ranks with w_r >= m (i.e. prob >= m * prob_max); a prefix because
//     w is non-increasing in rank. Rank 0 always stays.
//  9. draw: u = UniformFromSeed(seed, position) in [0, 1); S = sum of kept w in rank order;
//     target = u * S; return the first rank r whose running sum c_r (c_r = w_0 + ... + w_r)
//     is > target. If rounding leaves none, return the last kept rank with w > 0.
// Since step 6 is shift-invariant and steps 7-9 compare ratios only, renormalising between the
// filters (as vLLM does) gives the same distribution up to rounding.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"

namespace ts {

struct SamplingParams {
  float temperature = 1.0f;         // 0 = greedy
  int32_t top_k = 0;                // 0 = off
  float top_p = 1.0f;               // (0, 1]; 1 = off
  float min_p = 0.0f;               // [0, 1]; 0 = off
  float repetition_penalty = 1.0f;  // > 0; 1 = off
  float presence_penalty = 0.0f;    // [-2, 2]
  float frequency_penalty = 0.0f;   // [-2, 2]
  uint64_t seed = 0;
  bool greedy() const { return temperature == 0.0f; }
};

// Checks ranges; the error is InvalidArgument and names the field ("sampling.top_p", ...):
// temperature finite and >= 0; top_k in [0, vocab_size]; top_p in (0, 1]; min_p in [0, 1];
// repetition_penalty finite, in (0, 10]; presence/frequency_penalty in [-2, 2].
absl::Status ValidateSamplingParams(const SamplingParams& p, int32_t vocab_size);

// Step 1 above, in place. logits: [vocab]; prompt: [prompt_len]; output: [generated so far].
void ApplyPenalties(std::span<float> logits, const SamplingParams& p,
                    std::span<const int32_t> prompt, std::span<const int32_t> output);

// Steps 2-9 on already-penalised logits. `position` is the absolute position of the token being
// sampled (prompt length + tokens generated so far). logits: [vocab], may be modified.
// Expects validated params (ValidateSamplingParams); never reads out of bounds regardless.
int32_t SampleFromLogits(std::span<float> logits, const SamplingParams& p, uint64_t position);

// ApplyPenalties then SampleFromLogits at position = prompt.size() + output.size().
int32_t SampleToken(std::span<float> logits, const SamplingParams& p,
                    std::span<const int32_t> prompt, std::span<const int32_t> output);

}  // namespace ts
