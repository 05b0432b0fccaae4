// The text path's prompts made ready for a run: each prompt's output length fitted to the server's
// limits, prompts that cannot fit dropped, and the order requests take them in. Pure: the token
// counts come from the caller (the server's Tokenize, text_source.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/load/workload.h"

namespace ts::load {

struct TextFitOptions {
  uint64_t seed = 0;
  bool shuffle = true;             // false: requests take the prompts in file order
  LengthDist output;               // output length of prompts without a reply
  bool output_from_reply = false;  // a prompt's reply_tokens is its output length
  int32_t max_context = 0;         // 0 = no limit
  int32_t max_new_tokens = 0;      // 0 = no limit
};

// What fitting dropped or changed, for the notes printed before the run and summary.json.
struct TextFitReport {
  int64_t candidates = 0;
  int64_t too_long = 0;               // prompt + output over max_context: skipped
  int64_t first_too_long_entry = -1;  // TextPrompt::entry of the first of them
  int32_t first_too_long_tokens = 0;  // and its prompt tokens
  int64_t no_tokens = 0;              // tokenized to nothing: skipped
  int64_t replies_used = 0;           // kept prompts whose output length is their reply's
  int64_t replies_capped = 0;         // of those, replies longer than max_new_tokens: capped
};

// Too-long prompts are skipped, not truncated: a cut prompt is another prompt, and its length
// would no longer be the dataset's (vLLM's benchmark filters too-long ShareGPT samples too).
// A prompt fits when prompt + output <= max_context, the output being its reply's length, or the
// largest length `output` can draw (or 1 for normal:, whose draws are clamped per request).
// FailedPrecondition when no prompt fits.
absl::StatusOr<TextPromptSet> FitTextPrompts(std::vector<TextPrompt> candidates,
                                             const TextFitOptions& options, TextFitReport* report);

}  // namespace ts::load
