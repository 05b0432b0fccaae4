// The request edge: checks a tailserve.v1.GenerateRequest field by field and converts it to the
// engine's native ts::GenerateRequest. Nothing reaches the engine without passing through here, and
// every error names the offending field by its proto name ("sampling.top_p",
// "prompt_token_ids[3]", ...), so clients can fix the request without reading server logs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "models/tokenizer/tokenizer.h"
#include "tailserve/v1/generation.pb.h"

namespace ts::server {

// What the loaded model and engine allow; filled from Engine::model_info().
struct ValidationLimits {
  int32_t vocab_size = 0;
  int32_t max_context = 0;  // prompt + max_new_tokens
  // Cap on an unset stop.max_new_tokens (ModelInfo.max_new_tokens); 0 = what the context leaves.
  int32_t max_new_tokens = 0;
  int32_t max_stop_ids = 0;  // cap on stop.stop_token_ids
  int32_t max_request_id_chars = 128;
  int32_t max_stop_strings = 16;        // cap on stop.stop_strings
  int32_t max_stop_string_bytes = 256;  // cap on each stop string (it bounds the held-back text)
};

// How a stream's ids become its response text (unused without a tokenizer).
struct TextSpec {
  DecodeOptions decode;
  std::vector<std::string> stop_strings;  // valid UTF-8, non-empty
};

struct ValidatedRequest {
  GenerateRequest engine;
  TextSpec text;
};

// Unset fields take the defaults documented in generation.proto. An unset stop.max_new_tokens is
// what the context leaves after the prompt, capped by ValidationLimits::max_new_tokens: a fixed
// default could exceed what is left and be refused under a field the client never set.
// Pure: the same inputs always give the same result. `drawn_seed` is used when sampling.seed is
// unset (the caller draws it, so this function stays deterministic and testable).
// `tokenizer` (null when the model has none) encodes prompt_text.
// Errors: INVALID_ARGUMENT naming the field (invalid UTF-8 too); FAILED_PRECONDITION for
// prompt_text or stop_strings without a tokenizer.
// INVALID_ARGUMENT "field: not valid UTF-8 (byte N)" unless `text` is valid UTF-8: the check every
// text field a client sends gets, so that its error says where the encoding breaks.
absl::Status CheckUtf8(absl::string_view field, std::string_view text);

absl::StatusOr<ValidatedRequest> ValidateAndConvert(const tailserve::v1::GenerateRequest& request,
                                                    const ValidationLimits& limits,
                                                    const Tokenizer* tokenizer,
                                                    uint64_t drawn_seed);

}  // namespace ts::server
