// A compiled PCRE2 pattern (UTF + Unicode properties, as Hugging Face's Oniguruma patterns need:
// lookahead, \p{L}, \p{N}).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace ts {

class Regex {
 public:
  // literal: match `pattern` as plain text (tokenizer.json's {"String": ...} patterns).
  static absl::StatusOr<Regex> Compile(const std::string& pattern, bool literal);
  // [begin, end) byte ranges of the successive non-overlapping matches in valid UTF-8 `text`.
  std::vector<std::pair<size_t, size_t>> FindAll(std::string_view text) const;

 private:
  struct Code;
  std::shared_ptr<const Code> code_;  // shared: a compiled pattern is immutable
};

}  // namespace ts
