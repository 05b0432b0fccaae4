#include "models/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/philox.h"

namespace ts {
namespace {

constexpr float kMaxRepetitionPenalty = 10.0f;

absl::Status FieldError(const char* field, const std::string& want, double got) {
  return absl::InvalidArgumentError(
      absl::StrCat("sampling.", field, " must be ", want, ", got ", got));
}

bool InRange(float v, float lo, float hi) {
  return v >= lo && v <= hi;
}  // false for NaN

// NaN -> -inf and +inf -> the largest float, so exp(s - s_max) below is never NaN.
float Sanitize(float s) {
  if (std::isnan(s)) return -std::numeric_limits<float>::infinity();
  return std::min(s, std::numeric_limits<float>::max());
}

int32_t Argmax(std::span<const float> logits) {
  int32_t best = 0;
  float best_value = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < logits.size(); ++i) {
    // Strict > keeps the lowest id on ties and never picks NaN.
    if (logits[i] > best_value) {
      best_value = logits[i];
      best = static_cast<int32_t>(i);
    }
  }
  return best;
}

}  // namespace

absl::Status ValidateSamplingParams(const SamplingParams& p, int32_t vocab_size) {
  if (!std::isfinite(p.temperature) || p.temperature < 0.0f) {
    return FieldError("temperature", "finite and >= 0", p.temperature);
  }
  if (p.top_k < 0 || p.top_k > vocab_size) {
    return FieldError("top_k", absl::StrCat("in [0, ", vocab_size, "] (0 = off)"), p.top_k);
  }
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) return FieldError("top_p", "in (0, 1]", p.top_p);
  if (!InRange(p.min_p, 0.0f, 1.0f)) return FieldError("min_p", "in [0, 1]", p.min_p);
  if (!(p.repetition_penalty > 0.0f && p.repetition_penalty <= kMaxRepetitionPenalty)) {
    return FieldError("repetition_penalty", "in (0, 10]", p.repetition_penalty);
  }
  if (!InRange(p.presence_penalty, -2.0f, 2.0f)) {
    return FieldError("presence_penalty", "in [-2, 2]", p.presence_penalty);
  }
  if (!InRange(p.frequency_penalty, -2.0f, 2.0f)) {
    return FieldError("frequency_penalty", "in [-2, 2]", p.frequency_penalty);
  }
  return absl::OkStatus();
}

void ApplyPenalties(std::span<float> logits, const SamplingParams& p,
                    std::span<const int32_t> prompt, std::span<const int32_t> output) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  auto in_vocab = [vocab](int32_t id) { return id >= 0 && id < vocab; };
  if (p.repetition_penalty != 1.0f) {
    // A token seen twice is penalised once, so mark first and apply after.
    std::vector<int32_t> seen;
    seen.reserve(prompt.size() + output.size());
    for (std::span<const int32_t> s : {prompt, output}) {
      for (int32_t id : s) {
        if (in_vocab(id)) seen.push_back(id);
      }
    }
    std::sort(seen.begin(), seen.end());
    seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    for (int32_t id : seen) {
      float& l = logits[id];
      l = l > 0.0f ? l / p.repetition_penalty : l * p.repetition_penalty;
    }
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    std::unordered_map<int32_t, int32_t> counts;
    for (int32_t id : output) {
      if (in_vocab(id)) ++counts[id];
    }
    for (const auto& [id, count] : counts) {
      logits[id] -= p.presence_penalty + p.frequency_penalty * static_cast<float>(count);
    }
  }
}

int32_t SampleFromLogits(std::span<float> logits, const SamplingParams& p, uint64_t position) {
  if (logits.empty()) return 0;
  if (p.greedy()) return Argmax(logits);

  const int32_t vocab = static_cast<int32_t>(logits.size());
  for (float& l : logits) l = Sanitize(l / p.temperature);

  // Rank order: (s desc, id asc). Only the first k ranks are ever needed when top-k is on.
  std::vector<int32_t> order(vocab);
  for (int32_t i = 0; i < vocab; ++i) order[i] = i;
  auto by_rank = [&logits](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  const int32_t k = (p.top_k > 0 && p.top_k < vocab) ? p.top_k : vocab;
  if (k < vocab) {
    std::partial_sort(order.begin(), order.begin() + k, order.end(), by_rank);
  } else {
    std::sort(order.begin(), order.end(), by_rank);
  }
  const float s0 = logits[order[0]];
  if (s0 == -std::numeric_limits<float>::infinity()) return order[0];

  // w[r] = exp(s_r - s_0), so the max has weight exactly 1.
  std::vector<float> w(k);
  float total = 0.0f;
  for (int32_t r = 0; r < k; ++r) {
    w[r] = std::exp(logits[order[r]] - s0);
    total += w[r];
  }

  int32_t kept = k;
  if (p.top_p < 1.0f) {
    const float threshold = p.top_p * total;
    float running = 0.0f;
    for (int32_t r = 0; r < k; ++r) {
      running += w[r];
      if (running >= threshold) {
        kept = r + 1;
        break;
      }
    }
  }
  if (p.min_p > 0.0f) {
    int32_t n = 1;
    while (n < kept && w[n] >= p.min_p) ++n;
    kept = n;
  }

  float kept_total = 0.0f;
  for (int32_t r = 0; r < kept; ++r) kept_total += w[r];
  const float target = UniformFromSeed(p.seed, position) * kept_total;
  float running = 0.0f;
  int32_t last_positive = 0;
  for (int32_t r = 0; r < kept; ++r) {
    running += w[r];
    if (w[r] > 0.0f) last_positive = r;
    if (running > target) return order[r];
  }
  return order[last_positive];
}

int32_t SampleToken(std::span<float> logits, const SamplingParams& p,
                    std::span<const int32_t> prompt, std::span<const int32_t> output) {
  ApplyPenalties(logits, p, prompt, output);
  return SampleFromLogits(logits, p, prompt.size() + output.size());
}

}  // namespace ts
