// The BPE model of a Hugging Face tokenizer.json: vocab, ranked merges, byte fallback.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"

namespace ts {

class Bpe {
 public:
  // model: the "model" object of tokenizer.json (type "BPE").
  static absl::StatusOr<Bpe> FromJson(const nlohmann::json& model);

  // Appends the ids of one pre-tokenized word (already byte-level mapped where that applies).
  void EncodeWord(std::string_view word, std::vector<int32_t>* out) const;

  const std::string* IdToToken(int32_t id) const;
  std::optional<int32_t> TokenToId(std::string_view token) const;
  int32_t size() const { return static_cast<int32_t>(id_to_token_.size()); }

 private:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  static uint64_t PairKey(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  void InitialSymbols(std::string_view word, std::vector<int32_t>* symbols) const;

  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> id_to_token_;        // [max id + 1]; "" where the vocab has a gap
  std::unordered_map<uint64_t, Merge> merges_;  // (left id, right id) -> rank and merged id
  std::optional<int32_t> unk_id_;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
};

}  // namespace ts
