// Text <-> token ids for Hugging Face checkpoints: tokenizer.json (byte-level BPE as in Llama-3,
// or SentencePiece-style BPE with byte fallback as in Llama-2) or a SentencePiece tokenizer.model.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace ts {

class TokenizerImpl;

struct DecodeOptions {
  bool skip_special_tokens = false;  // drop special added tokens (BOS, EOS, ...) from the text
};

class Tokenizer {
 public:
  // Reads dir/tokenizer.json, or else dir/tokenizer.model, plus tokenizer_config.json and
  // generation_config.json (when present) for BOS/EOS.
  static absl::StatusOr<Tokenizer> Load(const std::string& dir);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Special tokens in the text are matched first, as Hugging Face does. add_special adds what the
  // checkpoint's post-processor (or add_bos_token) adds, e.g. BOS. Invalid UTF-8: InvalidArgument.
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text, bool add_special) const;
  // Bytes that are not valid UTF-8 come out as U+FFFD, as Hugging Face decodes them.
  std::string Decode(std::span<const int32_t> ids, DecodeOptions options = {}) const;

  std::optional<int32_t> TokenToId(std::string_view token) const;
  int32_t vocab_size() const;
  std::optional<int32_t> bos_id() const { return bos_id_; }
  const std::vector<int32_t>& eos_ids() const { return eos_ids_; }

 private:
  friend class StreamDecoder;
  explicit Tokenizer(std::unique_ptr<TokenizerImpl> impl);

  std::unique_ptr<TokenizerImpl> impl_;
  std::optional<int32_t> bos_id_;
  std::vector<int32_t> eos_ids_;
  bool add_bos_ = false;  // add_special prepends BOS (when the file has no post-processor)
};

// Turns a stream of generated ids into text deltas. A delta never ends inside a UTF-8 character:
// bytes of an incomplete character are held until the token that completes it.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, DecodeOptions options = {});
  // The text that became complete with this token; empty while a character is still partial.
  std::string Next(int32_t id);
  // Whatever is still held, incomplete characters as U+FFFD. Call at the end of the stream.
  std::string Flush();

 private:
  const TokenizerImpl* impl_;  // not owned; the Tokenizer outlives the decoder
  DecodeOptions options_;
  std::string pending_;   // raw bytes not yet emitted
  bool at_start_ = true;  // no byte emitted or held yet (for decoders that strip a leading space)
};

}  // namespace ts
