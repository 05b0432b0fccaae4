#include "engine/request.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace ts {
namespace {

constexpr size_t kMaxRequestIdBytes = 256;

absl::Status Invalid(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

absl::Status ValidateTokenIds(absl::string_view field, std::span<const int32_t> ids,
                              int32_t vocab_size) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size) {
      return Invalid(
          field, absl::StrCat("id ", ids[i], " at index ", i, " is outside [0, ", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateRequest(const GenerateRequest& request, const RequestLimits& limits) {
  if (request.request_id.size() > kMaxRequestIdBytes) {
    return Invalid("request_id", absl::StrCat("longer than ", kMaxRequestIdBytes, " bytes"));
  }
  if (request.prompt.empty()) return Invalid("prompt_token_ids", "must not be empty");
  if (auto s = ValidateTokenIds("prompt_token_ids", request.prompt, limits.vocab_size); !s.ok()) {
    return s;
  }
  const StopParams& stop = request.stop;
  if (stop.max_new_tokens < 1) {
    return Invalid("stop.max_new_tokens", absl::StrCat("must be >= 1, got ", stop.max_new_tokens));
  }
  if (stop.min_new_tokens < 0 || stop.min_new_tokens > stop.max_new_tokens) {
    return Invalid("stop.min_new_tokens",
                   absl::StrCat("must be in [0, max_new_tokens = ", stop.max_new_tokens, "], got ",
                                stop.min_new_tokens));
  }
  const int64_t context = static_cast<int64_t>(request.prompt.size()) + stop.max_new_tokens;
  if (context > limits.max_context) {
    return Invalid("stop.max_new_tokens",
                   absl::StrCat("prompt (", request.prompt.size(), " tokens) + max_new_tokens (",
                                stop.max_new_tokens, ") = ", context, " exceeds max_context ",
                                limits.max_context));
  }
  if (static_cast<int64_t>(stop.stop_token_ids.size()) > limits.max_stop_ids) {
    return Invalid("stop.stop_token_ids", absl::StrCat("at most ", limits.max_stop_ids,
                                                       " ids, got ", stop.stop_token_ids.size()));
  }
  if (auto s = ValidateTokenIds("stop.stop_token_ids", stop.stop_token_ids, limits.vocab_size);
      !s.ok()) {
    return s;
  }
  if (auto s = ValidateSamplingParams(request.sampling, limits.vocab_size); !s.ok()) {
    // The sampler names its own field (top_p, ...); the server's proto nests it under sampling.
    std::string msg(s.message());
    if (!absl::StartsWith(msg, "sampling.")) msg = absl::StrCat("sampling.", msg);
    return absl::InvalidArgumentError(msg);
  }
  return absl::OkStatus();
}

}  // namespace ts
