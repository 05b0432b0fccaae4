// The seam between Tokenizer and its two kinds of files. Internal to ts_tokenizer.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace ts {

class TokenizerImpl {
 public:
  virtual ~TokenizerImpl() = default;
  virtual absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                                      bool add_special) const = 0;
  virtual std::string Decode(std::span<const int32_t> ids, bool skip_special) const = 0;
  // The raw bytes one token adds to the decoded text (not necessarily whole UTF-8 characters),
  // which is what streaming needs; empty for a skipped special token.
  virtual std::string TokenBytes(int32_t id, bool skip_special) const = 0;
  // True when the decoder drops one leading space of the whole text (SentencePiece's dummy prefix).
  virtual bool StripsLeadingSpace() const = 0;
  virtual std::optional<int32_t> TokenToId(std::string_view token) const = 0;
  virtual int32_t VocabSize() const = 0;
  // True when Encode(add_special) adds the file's own specials (a post-processor); otherwise
  // Tokenizer adds BOS where the config asks for it.
  virtual bool HasPostProcessor() const { return false; }
  // Ids the file itself names, used where the configs name none.
  virtual std::optional<int32_t> DefaultBos() const { return std::nullopt; }
  virtual std::optional<int32_t> DefaultEos() const { return std::nullopt; }
};

absl::StatusOr<std::unique_ptr<TokenizerImpl>> LoadHfTokenizerJson(const std::string& path);
absl::StatusOr<std::unique_ptr<TokenizerImpl>> LoadSentencePieceModel(const std::string& path);

}  // namespace ts
