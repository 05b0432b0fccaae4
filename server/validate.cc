#include "server/validate.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "models/sampling.h"

namespace ts::server {
namespace {

namespace pb = ::tailserve::v1;

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

absl::Status CheckPrompt(const pb::GenerateRequest& r, const ValidationLimits& limits) {
  switch (r.prompt_case()) {
    case pb::GenerateRequest::kPromptText:
      return absl::UnimplementedError(
          "prompt_text: this server has no tokenizer yet; send prompt_token_ids");
    case pb::GenerateRequest::PROMPT_NOT_SET:
      return Invalid("prompt_token_ids", "the prompt is empty (set prompt_token_ids)");
    case pb::GenerateRequest::kPromptTokenIds:
      break;
  }
  const auto& ids = r.prompt_token_ids().ids();
  if (ids.empty()) return Invalid("prompt_token_ids", "the prompt is empty");
  if (ids.size() >= limits.max_context) {
    return Invalid("prompt_token_ids",
                   absl::StrCat(ids.size(), " tokens leave no room for a new token within the ",
                                "max context of ", limits.max_context));
  }
  for (int i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= limits.vocab_size) {
      return Invalid(absl::StrCat("prompt_token_ids[", i, "]"),
                     absl::StrCat("token id ", ids[i], " is outside [0, ", limits.vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

// `ok` is the range test written so that NaN fails it.
absl::Status CheckFloat(absl::string_view field, float v, bool ok, absl::string_view want) {
  if (ok && std::isfinite(v)) return absl::OkStatus();
  return Invalid(absl::StrCat("sampling.", field), absl::StrCat("must be ", want, ", got ", v));
}

absl::StatusOr<SamplingParams> ConvertSampling(const pb::SamplingParams& s,
                                               const ValidationLimits& limits,
                                               uint64_t drawn_seed) {
  SamplingParams p;
  if (s.has_temperature()) p.temperature = s.temperature();
  if (s.has_top_k()) p.top_k = s.top_k();
  if (s.has_top_p()) p.top_p = s.top_p();
  if (s.has_min_p()) p.min_p = s.min_p();
  if (s.has_repetition_penalty()) p.repetition_penalty = s.repetition_penalty();
  if (s.has_presence_penalty()) p.presence_penalty = s.presence_penalty();
  if (s.has_frequency_penalty()) p.frequency_penalty = s.frequency_penalty();
  p.seed = s.has_seed() ? s.seed() : drawn_seed;

  TS_RETURN_IF_ERROR(CheckFloat("temperature", p.temperature, p.temperature >= 0.0f,
                                "finite and >= 0 (0 = greedy)"));
  if (p.top_k < 0 || p.top_k > limits.vocab_size) {
    return Invalid("sampling.top_k", absl::StrCat("must be in [0, ", limits.vocab_size,
                                                  "] (0 = off), got ", p.top_k));
  }
  TS_RETURN_IF_ERROR(CheckFloat("top_p", p.top_p, p.top_p > 0.0f && p.top_p <= 1.0f, "in (0, 1]"));
  TS_RETURN_IF_ERROR(CheckFloat("min_p", p.min_p, p.min_p >= 0.0f && p.min_p <= 1.0f, "in [0, 1]"));
  TS_RETURN_IF_ERROR(CheckFloat("repetition_penalty", p.repetition_penalty,
                                p.repetition_penalty > 0.0f && p.repetition_penalty <= 10.0f,
                                "in (0, 10]"));
  TS_RETURN_IF_ERROR(CheckFloat("presence_penalty", p.presence_penalty,
                                p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f,
                                "in [-2, 2]"));
  TS_RETURN_IF_ERROR(CheckFloat("frequency_penalty", p.frequency_penalty,
                                p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f,
                                "in [-2, 2]"));
  // The sampler's own check is the contract the engine relies on; running it here too keeps the
  // edge from ever accepting what the engine would refuse.
  TS_RETURN_IF_ERROR(ValidateSamplingParams(p, limits.vocab_size));
  return p;
}

absl::StatusOr<StopParams> ConvertStop(const pb::StopParams& s, int32_t prompt_len,
                                       const ValidationLimits& limits) {
  StopParams p;
  if (s.has_max_new_tokens()) {
    p.max_new_tokens = s.max_new_tokens();
  } else {
    // CheckPrompt left at least one position.
    p.max_new_tokens = limits.max_context - prompt_len;
    if (limits.max_new_tokens > 0)
      p.max_new_tokens = std::min(p.max_new_tokens, limits.max_new_tokens);
  }
  p.min_new_tokens = s.min_new_tokens();
  p.ignore_eos = s.ignore_eos();
  if (p.max_new_tokens < 1) {
    return Invalid("stop.max_new_tokens", absl::StrCat("must be >= 1, got ", p.max_new_tokens));
  }
  // 64-bit sum: a huge max_new_tokens must not wrap around into range.
  if (static_cast<int64_t>(prompt_len) + p.max_new_tokens > limits.max_context) {
    return Invalid(
        "stop.max_new_tokens",
        absl::StrCat("prompt_token_ids (", prompt_len, ") + stop.max_new_tokens (",
                     p.max_new_tokens, ") exceeds the max context of ", limits.max_context));
  }
  if (p.min_new_tokens < 0 || p.min_new_tokens > p.max_new_tokens) {
    return Invalid("stop.min_new_tokens",
                   absl::StrCat("must be in [0, stop.max_new_tokens = ", p.max_new_tokens,
                                "], got ", p.min_new_tokens));
  }
  if (s.stop_token_ids_size() > limits.max_stop_ids) {
    return Invalid(
        "stop.stop_token_ids",
        absl::StrCat(s.stop_token_ids_size(), " ids exceed the cap of ", limits.max_stop_ids));
  }
  for (int i = 0; i < s.stop_token_ids_size(); ++i) {
    const int32_t id = s.stop_token_ids(i);
    if (id < 0 || id >= limits.vocab_size) {
      return Invalid(absl::StrCat("stop.stop_token_ids[", i, "]"),
                     absl::StrCat("token id ", id, " is outside [0, ", limits.vocab_size, ")"));
    }
    p.stop_token_ids.push_back(id);
  }
  return p;
}

}  // namespace

absl::StatusOr<GenerateRequest> ValidateAndConvert(const pb::GenerateRequest& request,
                                                   const ValidationLimits& limits,
                                                   uint64_t drawn_seed) {
  if (request.request_id().size() > static_cast<size_t>(limits.max_request_id_chars)) {
    return Invalid("request_id",
                   absl::StrCat("longer than ", limits.max_request_id_chars, " characters"));
  }
  TS_RETURN_IF_ERROR(CheckPrompt(request, limits));
  GenerateRequest out;
  out.request_id = request.request_id();
  out.prompt.assign(request.prompt_token_ids().ids().begin(),
                    request.prompt_token_ids().ids().end());
  TS_ASSIGN_OR_RETURN(out.sampling, ConvertSampling(request.sampling(), limits, drawn_seed));
  TS_ASSIGN_OR_RETURN(out.stop,
                      ConvertStop(request.stop(), static_cast<int32_t>(out.prompt.size()), limits));
  return out;
}

}  // namespace ts::server
