// Text prompts from a user's file (tailserve-load --prompts_file). The file is JSON (an array) or
// JSONL (one value a line); each entry is a string or an object in one of the shapes datasets
// use:
//   "plain text"
//   {"prompt": "..."}  or  {"text": "..."}
//   {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}, ...]}
//   {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
// ShareGPT's conversations and OpenAI's messages give their first human/user turn as the prompt
// (sent as raw text: no chat template) and the reply after it, whose token count benchmarks use as
// the output length (vLLM's benchmark_serving does). Other keys are ignored.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ts::load {

struct FilePrompt {
  std::string text;
  // The turn that answered the prompt (conversations and messages only).
  std::optional<std::string> reply{};
  int64_t entry = 0;  // 0-based position among the file's entries, skipped ones included
  int64_t line = 0;   // 1-based line where the entry starts
};

// Entries that are well-formed but hold no prompt (an empty conversation, no human turn, an
// empty string). Real datasets have some, so they are counted, not fatal.
struct SkippedEntries {
  std::string reason;
  int64_t count = 0;
  std::string first;  // "path:line" of the first one
};

struct PromptFile {
  std::vector<FilePrompt> prompts;
  std::vector<SkippedEntries> skipped;
  int64_t entries = 0;  // prompts + skipped
};

// Errors are InvalidArgument "path:line: problem". A file with no usable prompt is an error too.
absl::StatusOr<PromptFile> ParsePromptFile(absl::string_view content, absl::string_view path);
absl::StatusOr<PromptFile> ReadPromptFile(const std::string& path);

}  // namespace ts::load
