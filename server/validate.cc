#include "server/validate.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "models/sampling.h"
#include "models/tokenizer/utf8.h"

namespace ts::server {
namespace {

namespace pb = ::tailserve::v1;

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

}  // namespace

absl::Status CheckUtf8(absl::string_view field, std::string_view text) {
  if (const size_t at = utf8::ValidPrefix(text); at < text.size()) {
    return Invalid(field, absl::StrCat("not valid UTF-8 (byte ", at, ")"));
  }
  return absl::OkStatus();
}

namespace {

absl::Status NeedTokenizer(const Tokenizer* tokenizer, absl::string_view field) {
  if (tokenizer != nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      field,
      ": this model has no tokenizer (no tokenizer.json or tokenizer.model beside it); "
      "send prompt_token_ids"));
}

bool AddSpecialTokens(const pb::GenerateRequest& r) {
  return !r.text().has_add_special_tokens() || r.text().add_special_tokens();
}

// The prompt as ids: given, or the tokenizer's encoding of prompt_text. `field` names it in later
// errors.
absl::StatusOr<std::vector<int32_t>> PromptIds(const pb::GenerateRequest& r,
                                               const Tokenizer* tokenizer, std::string* field) {
  switch (r.prompt_case()) {
    case pb::GenerateRequest::kPromptText: {
      *field = "prompt_text";
      TS_RETURN_IF_ERROR(NeedTokenizer(tokenizer, "prompt_text"));
      TS_RETURN_IF_ERROR(CheckUtf8("prompt_text", r.prompt_text()));
      absl::StatusOr<std::vector<int32_t>> ids =
          tokenizer->Encode(r.prompt_text(), AddSpecialTokens(r));
      if (!ids.ok()) return Invalid("prompt_text", ids.status().message());
      return ids;
    }
    case pb::GenerateRequest::PROMPT_NOT_SET:
      return Invalid("prompt_token_ids",
                     "the prompt is empty (set prompt_token_ids or prompt_text)");
    case pb::GenerateRequest::kPromptTokenIds:
      break;
  }
  *field = "prompt_token_ids";
  return std::vector<int32_t>(r.prompt_token_ids().ids().begin(), r.prompt_token_ids().ids().end());
}

absl::Status CheckPrompt(const std::vector<int32_t>& ids, const std::string& field,
                         const ValidationLimits& limits) {
  if (ids.empty()) return Invalid(field, "the prompt is empty");
  if (ids.size() >= static_cast<size_t>(limits.max_context)) {
    return Invalid(field, absl::StrCat(ids.size(), " tokens leave no room for a new token within ",
                                       "the max context of ", limits.max_context));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= limits.vocab_size) {
      // An encoded prompt_text is always in range: the server checked the tokenizer's vocab
      // against the model's at startup.
      return Invalid(absl::StrCat(field, "[", i, "]"),
                     absl::StrCat("token id ", ids[i], " is outside [0, ", limits.vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TextSpec> ConvertText(const pb::GenerateRequest& r, const ValidationLimits& limits,
                                     const Tokenizer* tokenizer) {
  TextSpec text;
  text.decode.skip_special_tokens =
      !r.text().has_skip_special_tokens() || r.text().skip_special_tokens();
  const auto& stops = r.stop().stop_strings();
  if (stops.empty()) return text;
  TS_RETURN_IF_ERROR(NeedTokenizer(tokenizer, "stop.stop_strings"));
  if (stops.size() > limits.max_stop_strings) {
    return Invalid("stop.stop_strings", absl::StrCat(stops.size(), " strings exceed the cap of ",
                                                     limits.max_stop_strings));
  }
  for (int i = 0; i < stops.size(); ++i) {
    const std::string field = absl::StrCat("stop.stop_strings[", i, "]");
    if (stops[i].empty()) return Invalid(field, "is empty");
    if (stops[i].size() > static_cast<size_t>(limits.max_stop_string_bytes)) {
      return Invalid(field, absl::StrCat(stops[i].size(), " bytes exceed the cap of ",
                                         limits.max_stop_string_bytes));
    }
    TS_RETURN_IF_ERROR(CheckUtf8(field, stops[i]));
    text.stop_strings.push_back(stops[i]);
  }
  return text;
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
                                       const std::string& prompt_field,
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
        absl::StrCat(prompt_field, " (", prompt_len, " tokens) + stop.max_new_tokens (",
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

absl::StatusOr<ValidatedRequest> ValidateAndConvert(const pb::GenerateRequest& request,
                                                    const ValidationLimits& limits,
                                                    const Tokenizer* tokenizer,
                                                    uint64_t drawn_seed) {
  if (request.request_id().size() > static_cast<size_t>(limits.max_request_id_chars)) {
    return Invalid("request_id",
                   absl::StrCat("longer than ", limits.max_request_id_chars, " characters"));
  }
  ValidatedRequest out;
  std::string prompt_field;
  TS_ASSIGN_OR_RETURN(out.engine.prompt, PromptIds(request, tokenizer, &prompt_field));
  TS_RETURN_IF_ERROR(CheckPrompt(out.engine.prompt, prompt_field, limits));
  out.engine.request_id = request.request_id();
  TS_ASSIGN_OR_RETURN(out.engine.sampling, ConvertSampling(request.sampling(), limits, drawn_seed));
  TS_ASSIGN_OR_RETURN(out.engine.stop,
                      ConvertStop(request.stop(), static_cast<int32_t>(out.engine.prompt.size()),
                                  prompt_field, limits));
  TS_ASSIGN_OR_RETURN(out.text, ConvertText(request, limits, tokenizer));
  return out;
}

}  // namespace ts::server
