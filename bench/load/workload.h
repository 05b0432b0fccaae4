// The requests of a run: by default synthetic ones (prompt and output lengths drawn from a
// distribution, prompt ids drawn uniformly below the server's vocab_size), or text prompts from
// the user (text_prompts.h). Request i is a pure function of (seed, i) and the prompts.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ts::load {

struct LengthDist {
  enum class Kind { kFixed, kUniform, kNormal };
  Kind kind = Kind::kFixed;
  // fixed: a = n. uniform: integers in [a, b]. normal: mean a, standard deviation b, rounded and
  // clamped to [1, cap] at draw time.
  double a = 1;
  double b = 0;

  // The spec string this parses from, e.g. "uniform:32:128".
  std::string ToString() const;
  // Largest length a draw can produce before clamping; normal has no bound (returns -1).
  int64_t MaxOrUnbounded() const;
};

// Parses "N", "fixed:N", "uniform:MIN:MAX" or "normal:MEAN:STD". `field` names the flag in errors.
absl::StatusOr<LengthDist> ParseLengthDist(absl::string_view spec, absl::string_view field);

// One draw from `dist` given two uniforms in [0, 1); the result is in [1, cap].
int32_t SampleLength(const LengthDist& dist, double u0, double u1, int32_t cap);

struct TextPrompt {
  std::string text;
  int32_t input_tokens = 0;   // the server's Tokenize count, with the run's add_special_tokens
  int32_t reply_tokens = -1;  // the dataset reply's count, capped to max_new_tokens; -1 = none
  int64_t entry = 0;          // the prompt's entry in its file (results.jsonl's prompt_entry)
};

struct TextPromptSet {
  std::vector<TextPrompt> prompts;  // each fits the server's limits (FitTextPrompts)
  std::vector<uint32_t> order;      // request i uses prompts[order[i % prompts.size()]]
  bool output_from_reply = false;   // a prompt's reply_tokens (>= 0) is its output length
};

struct WorkloadOptions {
  uint64_t seed = 0;
  LengthDist input{};          // random path only
  LengthDist output;           // text path: for prompts without a reply, or all of them
  int32_t vocab_size = 0;      // prompt ids are drawn from [0, vocab_size)
  int32_t max_context = 0;     // prompt + output must fit; 0 = no limit
  int32_t max_new_tokens = 0;  // output cap; 0 = no limit
  // Set: the text path. Shared, because every phase copies its WorkloadOptions.
  std::shared_ptr<const TextPromptSet> text{};
};

struct RequestSpec {
  std::vector<int32_t> prompt_ids;  // random path: [input_len], each in [0, vocab_size)
  std::string prompt_text;          // text path (prompt_ids is empty)
  int32_t input_len = 0;            // prompt tokens: prompt_ids.size(), or the text's count
  int64_t prompt_entry = -1;        // text path: TextPrompt::entry
  int32_t output_len = 0;           // pinned with ignore_eos
  uint64_t sampling_seed = 0;
};

// Rejects fixed/uniform lengths that cannot fit the server's limits, before any request is sent.
// On the text path only the output length is checked here; FitTextPrompts fits each prompt.
absl::Status CheckWorkloadFits(const WorkloadOptions& options);

// Request `index` of the workload. Random path: the output length is drawn first and capped by
// max_new_tokens and max_context - 1; the prompt is then capped so that prompt + output <=
// max_context. Text path: the prompt is text->order[index % size]; the output length is its
// reply's (output_from_reply) or drawn, capped so that prompt + output <= max_context.
RequestSpec MakeRequestSpec(const WorkloadOptions& options, uint64_t index);

}  // namespace ts::load
