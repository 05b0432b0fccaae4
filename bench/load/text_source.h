// The text path's setup (tailserve-load --prompts_file / --prompt_text): read the prompts, count
// each distinct prompt's tokens (and each reply's, when replies set output lengths) with the
// server's Tokenize before the run starts, so that counting does not perturb the timing, and fit
// them to the server's limits (text_prompts.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/load/client.h"
#include "bench/load/options.h"
#include "bench/load/workload.h"
#include "nlohmann/json.hpp"
#include "tailserve/v1/generation.pb.h"

namespace ts::load {

struct TextSource {
  std::shared_ptr<const TextPromptSet> prompts;
  nlohmann::json facts;            // summary.json's run.prompts
  std::vector<std::string> notes;  // printed before the run: what was skipped or capped
};

// InvalidArgument for a bad file or prompt (naming the flag); FailedPrecondition when the server
// has no tokenizer or no prompt fits; Unavailable when Tokenize cannot be reached.
absl::StatusOr<TextSource> LoadTextSource(LoadClient& client, const LoadOptions& options,
                                          const tailserve::v1::ModelInfo& info);

// Tokenize's count of each text, a few calls in flight at once. labels[i] names texts[i] in
// errors.
absl::StatusOr<std::vector<int32_t>> CountTokens(LoadClient& client,
                                                 const std::vector<std::string>& texts,
                                                 const std::vector<std::string>& labels,
                                                 bool add_special_tokens);

}  // namespace ts::load
