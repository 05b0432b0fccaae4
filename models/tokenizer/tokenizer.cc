#include "models/tokenizer/tokenizer.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "models/tokenizer/tokenizer_impl.h"
#include "models/tokenizer/utf8.h"
#include "nlohmann/json.hpp"

namespace ts {
namespace {

using nlohmann::json;

// A missing file is an empty object: both configs are optional.
absl::StatusOr<json> ReadJsonIfPresent(const std::filesystem::path& path) {
  if (!std::filesystem::exists(path)) return json::object();
  std::ifstream in(path);
  const json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": not a JSON object"));
  }
  return j;
}

// tokenizer_config.json names tokens as a string or as {"content": ...}.
std::optional<std::string> TokenName(const json& config, const char* key) {
  if (!config.contains(key)) return std::nullopt;
  const json& v = config[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) {
    return v["content"].get<std::string>();
  }
  return std::nullopt;
}

std::vector<int32_t> IdList(const json& v) {
  std::vector<int32_t> out;
  if (v.is_number_integer()) out.push_back(v.get<int32_t>());
  if (v.is_array()) {
    for (const auto& e : v) {
      if (e.is_number_integer()) out.push_back(e.get<int32_t>());
    }
  }
  return out;
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<TokenizerImpl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

absl::StatusOr<Tokenizer> Tokenizer::Load(const std::string& dir) {
  const std::filesystem::path d(dir);
  absl::StatusOr<std::unique_ptr<TokenizerImpl>> impl;
  if (std::filesystem::exists(d / "tokenizer.json")) {
    impl = LoadHfTokenizerJson((d / "tokenizer.json").string());
  } else if (std::filesystem::exists(d / "tokenizer.model")) {
    impl = LoadSentencePieceModel((d / "tokenizer.model").string());
  } else {
    return absl::NotFoundError(absl::StrCat(dir, ": neither tokenizer.json nor tokenizer.model"));
  }
  if (!impl.ok()) return impl.status();
  Tokenizer tok(std::move(*impl));

  auto tok_config = ReadJsonIfPresent(d / "tokenizer_config.json");
  if (!tok_config.ok()) return tok_config.status();
  auto gen_config = ReadJsonIfPresent(d / "generation_config.json");
  if (!gen_config.ok()) return gen_config.status();
  // generation_config.json is what generation stops on, so it wins; tokenizer_config.json names
  // tokens by text; the file's own ids (SentencePiece) come last.
  auto by_name = [&](const char* key) -> std::optional<int32_t> {
    const auto name = TokenName(*tok_config, key);
    return name ? tok.impl_->TokenToId(*name) : std::nullopt;
  };
  if (const auto ids = IdList(gen_config->value("bos_token_id", json())); !ids.empty()) {
    tok.bos_id_ = ids[0];
  } else if (const auto id = by_name("bos_token")) {
    tok.bos_id_ = id;
  } else {
    tok.bos_id_ = tok.impl_->DefaultBos();
  }
  tok.eos_ids_ = IdList(gen_config->value("eos_token_id", json()));
  if (tok.eos_ids_.empty()) {
    if (const auto id = by_name("eos_token")) {
      tok.eos_ids_.push_back(*id);
    } else if (const auto def = tok.impl_->DefaultEos()) {
      tok.eos_ids_.push_back(*def);
    }
  }
  // LlamaTokenizer's add_bos_token defaults to true; a tokenizer.json's post-processor rules.
  const bool is_sp = !std::filesystem::exists(d / "tokenizer.json");
  tok.add_bos_ = tok_config->value("add_bos_token", is_sp) && !tok.impl_->HasPostProcessor();
  return tok;
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(std::string_view text,
                                                       bool add_special) const {
  if (!utf8::IsValid(text)) return absl::InvalidArgumentError("text is not valid UTF-8");
  auto ids = impl_->Encode(text, add_special);
  if (ids.ok() && add_special && add_bos_ && bos_id_) ids->insert(ids->begin(), *bos_id_);
  return ids;
}

std::string Tokenizer::Decode(std::span<const int32_t> ids, DecodeOptions options) const {
  return impl_->Decode(ids, options.skip_special_tokens);
}

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  return impl_->TokenToId(token);
}

int32_t Tokenizer::vocab_size() const {
  return impl_->VocabSize();
}

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, DecodeOptions options)
    : impl_(tokenizer.impl_.get()), options_(options) {}

std::string StreamDecoder::Next(int32_t id) {
  std::string bytes = impl_->TokenBytes(id, options_.skip_special_tokens);
  if (at_start_ && !bytes.empty()) {
    // The decoder strips one space from the start of the whole text, not of each token.
    if (impl_->StripsLeadingSpace() && bytes[0] == ' ') bytes.erase(0, 1);
    at_start_ = false;
  }
  pending_ += bytes;
  const size_t keep = utf8::IncompleteTail(pending_);
  std::string out = utf8::Lossy(std::string_view(pending_).substr(0, pending_.size() - keep));
  pending_.erase(0, pending_.size() - keep);
  return out;
}

std::string StreamDecoder::Flush() {
  std::string out = utf8::Lossy(pending_);
  pending_.clear();
  return out;
}

}  // namespace ts
