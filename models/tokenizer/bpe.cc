#include "models/tokenizer/bpe.h"

#include <cstdio>
#include <queue>

#include "absl/strings/str_cat.h"
#include "models/tokenizer/utf8.h"
#include "nlohmann/json.hpp"

namespace ts {
namespace {

// Merges come as "a b" strings (older files) or ["a", "b"] pairs (tokenizers >= 0.20).
absl::StatusOr<std::pair<std::string, std::string>> ParseMerge(const nlohmann::json& m) {
  if (m.is_string()) {
    const std::string s = m.get<std::string>();
    const size_t sp = s.find(' ');
    if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: bad merge \"", s, "\""));
    }
    return std::pair{s.substr(0, sp), s.substr(sp + 1)};
  }
  if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
    return std::pair{m[0].get<std::string>(), m[1].get<std::string>()};
  }
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: bad merge ", m.dump()));
}

}  // namespace

absl::StatusOr<Bpe> Bpe::FromJson(const nlohmann::json& model) {
  if (model.value("type", "") != "BPE") {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: model type \"",
                                                   model.value("type", ""), "\" (supported: BPE)"));
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix", "dropout"}) {
    if (model.contains(key) && !model[key].is_null()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer.json: BPE ", key, " not supported"));
    }
  }
  Bpe bpe;
  if (!model.contains("vocab") || !model["vocab"].is_object()) {
    return absl::InvalidArgumentError("tokenizer.json: BPE model has no vocab object");
  }
  for (const auto& [token, id_json] : model["vocab"].items()) {
    const int32_t id = id_json.get<int32_t>();
    if (id < 0) return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: id ", id));
    bpe.vocab_.emplace(token, id);
    if (static_cast<size_t>(id) >= bpe.id_to_token_.size()) bpe.id_to_token_.resize(id + 1);
    bpe.id_to_token_[id] = token;
  }
  int32_t rank = 0;
  for (const auto& m : model.value("merges", nlohmann::json::array())) {
    auto pair = ParseMerge(m);
    if (!pair.ok()) return pair.status();
    const auto a = bpe.vocab_.find(pair->first);
    const auto b = bpe.vocab_.find(pair->second);
    const auto merged = bpe.vocab_.find(pair->first + pair->second);
    if (a == bpe.vocab_.end() || b == bpe.vocab_.end() || merged == bpe.vocab_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer.json: merge ", m.dump(), " names a token not in the vocab"));
    }
    // A repeated pair keeps its first (lowest) rank, as Hugging Face's loader does.
    bpe.merges_.try_emplace(PairKey(a->second, b->second), Merge{rank, merged->second});
    ++rank;
  }
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    const auto it = bpe.vocab_.find(model["unk_token"].get<std::string>());
    if (it == bpe.vocab_.end()) {
      return absl::InvalidArgumentError("tokenizer.json: unk_token is not in the vocab");
    }
    bpe.unk_id_ = it->second;
  }
  bpe.byte_fallback_ = model.value("byte_fallback", false);
  bpe.fuse_unk_ = model.value("fuse_unk", false);
  bpe.ignore_merges_ = model.value("ignore_merges", false);
  return bpe;
}

// One symbol per character; a character missing from the vocab becomes its <0xNN> byte tokens
// (byte_fallback) or unk (runs fused with fuse_unk), in the order Hugging Face adds them.
void Bpe::InitialSymbols(std::string_view word, std::vector<int32_t>* symbols) const {
  int32_t pending_unk = -1;  // an unk not yet added, so that fuse_unk can extend it
  for (size_t i = 0; i < word.size();) {
    size_t n = utf8::SequenceLength(word, i);
    if (n == 0) n = 1;  // callers pass valid UTF-8; this only keeps the scan finite
    const std::string ch(word.substr(i, n));
    i += n;
    if (const auto it = vocab_.find(ch); it != vocab_.end()) {
      if (pending_unk >= 0) symbols->push_back(pending_unk);
      pending_unk = -1;
      symbols->push_back(it->second);
      continue;
    }
    if (byte_fallback_) {
      std::vector<int32_t> bytes;
      for (const unsigned char b : ch) {
        char name[8];
        std::snprintf(name, sizeof(name), "<0x%02X>", b);
        const auto it = vocab_.find(name);
        if (it == vocab_.end()) break;
        bytes.push_back(it->second);
      }
      if (bytes.size() == ch.size()) {
        symbols->insert(symbols->end(), bytes.begin(), bytes.end());
        continue;
      }
    }
    if (unk_id_) {
      if (pending_unk >= 0 && !fuse_unk_) symbols->push_back(pending_unk);
      pending_unk = *unk_id_;
    }
  }
  if (pending_unk >= 0) symbols->push_back(pending_unk);
}

void Bpe::EncodeWord(std::string_view word, std::vector<int32_t>* out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (const auto it = vocab_.find(std::string(word)); it != vocab_.end()) {
      out->push_back(it->second);
      return;
    }
  }
  std::vector<int32_t> ids;
  InitialSymbols(word, &ids);
  const int n = static_cast<int>(ids.size());
  // A doubly linked list over the symbols; a merged-away symbol gets id -1.
  std::vector<int> prev(n), next(n);
  for (int i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Candidate {
    int32_t rank;
    int pos;
    int32_t new_id;
    // Lowest rank first, then leftmost: Hugging Face's order, which decides ties.
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  auto push = [&](int pos) {
    if (pos < 0 || next[pos] < 0) return;
    const auto it = merges_.find(PairKey(ids[pos], ids[next[pos]]));
    if (it != merges_.end()) queue.push({it->second.rank, pos, it->second.new_id});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    if (ids[top.pos] < 0 || next[top.pos] < 0) continue;
    const int right = next[top.pos];
    const auto it = merges_.find(PairKey(ids[top.pos], ids[right]));
    if (it == merges_.end() || it->second.new_id != top.new_id) continue;  // stale entry
    ids[top.pos] = top.new_id;
    ids[right] = -1;
    next[top.pos] = next[right];
    if (next[right] >= 0) prev[next[right]] = top.pos;
    push(prev[top.pos]);
    push(top.pos);
  }
  for (int i = 0; i >= 0 && i < n; i = next[i]) out->push_back(ids[i]);
}

const std::string* Bpe::IdToToken(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size() || id_to_token_[id].empty()) {
    return nullptr;
  }
  return &id_to_token_[id];
}

std::optional<int32_t> Bpe::TokenToId(std::string_view token) const {
  const auto it = vocab_.find(std::string(token));
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

}  // namespace ts
