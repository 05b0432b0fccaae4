// tokenizer.json as the Hugging Face `tokenizers` library reads it, for the components Llama-style
// checkpoints use. Anything else is an InvalidArgument naming the component, never a silent guess.
#include <algorithm>
#include <cctype>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "models/tokenizer/bpe.h"
#include "models/tokenizer/regex.h"
#include "models/tokenizer/tokenizer_impl.h"
#include "models/tokenizer/utf8.h"
#include "nlohmann/json.hpp"

namespace ts {
namespace {

using nlohmann::json;

// GPT-2's split, used by a ByteLevel pre-tokenizer with use_regex.
constexpr const char* kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100 onwards, so
// every byte is one visible character.
struct ByteTable {
  std::string byte_to_char[256];
  std::unordered_map<std::string, unsigned char> char_to_byte;
  ByteTable() {
    uint32_t extra = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      utf8::AppendCodepoint(printable ? b : extra++, &byte_to_char[b]);
      char_to_byte.emplace(byte_to_char[b], static_cast<unsigned char>(b));
    }
  }
};
const ByteTable& Bytes() {
  static const ByteTable table;
  return table;
}

// A token's bytes under the ByteLevel decoder: a token with a character outside the table (an
// added token, say) is taken as its own UTF-8, as Hugging Face does.
std::string ByteLevelDecode(const std::string& token) {
  std::string out;
  for (size_t i = 0; i < token.size();) {
    const size_t n = std::max<size_t>(1, utf8::SequenceLength(token, i));
    const auto it = Bytes().char_to_byte.find(token.substr(i, n));
    if (it == Bytes().char_to_byte.end()) return token;
    out.push_back(static_cast<char>(it->second));
    i += n;
  }
  return out;
}

std::optional<unsigned char> ByteToken(const std::string& t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return std::nullopt;
  unsigned v = 0;
  for (int i = 3; i < 5; ++i) {
    const char c = t[i];
    if (!std::isxdigit(static_cast<unsigned char>(c))) return std::nullopt;
    v = v * 16 +
        (std::isdigit(static_cast<unsigned char>(c)) ? c - '0' : (std::toupper(c) - 'A' + 10));
  }
  return static_cast<unsigned char>(v);
}

absl::StatusOr<std::string> StringPattern(const json& p, const char* where) {
  if (p.is_object() && p.contains("String")) return p["String"].get<std::string>();
  return absl::InvalidArgumentError(
      absl::StrCat("tokenizer.json: ", where, " pattern must be a String"));
}

struct AddedToken {
  std::string content;
  int32_t id;
  bool special, lstrip, rstrip, single_word;
};

struct NormalizeStep {
  enum Kind { kPrepend, kReplace } kind;
  std::string a, b;  // prepend: a; replace: a -> b
};

struct PreTokenizeStep {
  enum Kind { kSplit, kByteLevel } kind;
  std::optional<Regex> regex;  // kSplit's pattern, or kByteLevel's GPT-2 split when use_regex
};

struct DecodeStep {
  enum Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip } kind;
  std::string a, b;  // replace: a -> b; strip: a is the character
  int start = 0, stop = 0;
};

bool IsWordByte(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
}
bool IsSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

class HfTokenizer final : public TokenizerImpl {
 public:
  absl::Status Parse(const json& j);

  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                              bool add_special) const override;
  std::string Decode(std::span<const int32_t> ids, bool skip_special) const override;
  std::string TokenBytes(int32_t id, bool skip_special) const override;
  bool StripsLeadingSpace() const override { return strips_leading_space_; }
  std::optional<int32_t> TokenToId(std::string_view token) const override;
  int32_t VocabSize() const override { return vocab_size_; }
  bool HasPostProcessor() const override { return has_post_processor_; }

 private:
  absl::Status ParseNormalizer(const json& n);
  absl::Status ParsePreTokenizer(const json& p);
  absl::Status ParseDecoder(const json& d);
  absl::Status ParsePostProcessor(const json& p);
  const std::string* IdToToken(int32_t id, bool skip_special) const;
  void EncodeSegment(std::string_view text, std::vector<int32_t>* out) const;
  // The earliest (then longest) added token match at or after `from`: [begin, end) with any
  // lstrip/rstrip whitespace included, and the token.
  bool FindAdded(std::string_view text, size_t from, size_t* begin, size_t* end,
                 const AddedToken** tok) const;

  Bpe bpe_;
  std::vector<AddedToken> added_;
  std::unordered_map<int32_t, size_t> added_by_id_;  // id -> index in added_
  std::vector<NormalizeStep> normalizer_;
  std::vector<PreTokenizeStep> pre_tokenizer_;
  std::vector<DecodeStep> decoder_;
  bool has_decoder_ = false;
  bool strips_leading_space_ = false;
  bool has_post_processor_ = false;
  std::vector<int32_t> prefix_, suffix_;  // what TemplateProcessing's single puts around $A
  int32_t vocab_size_ = 0;
};

absl::Status HfTokenizer::Parse(const json& j) {
  auto bpe = Bpe::FromJson(j.value("model", json::object()));
  if (!bpe.ok()) return bpe.status();
  bpe_ = std::move(*bpe);
  vocab_size_ = bpe_.size();
  for (const auto& t : j.value("added_tokens", json::array())) {
    added_.push_back({t.at("content").get<std::string>(), t.at("id").get<int32_t>(),
                      t.value("special", false), t.value("lstrip", false), t.value("rstrip", false),
                      t.value("single_word", false)});
    if (added_.back().content.empty() || !utf8::IsValid(added_.back().content)) {
      return absl::InvalidArgumentError("tokenizer.json: an added token is empty or not UTF-8");
    }
    added_by_id_[added_.back().id] = added_.size() - 1;
    vocab_size_ = std::max(vocab_size_, added_.back().id + 1);
  }
  if (auto s = ParseNormalizer(j.value("normalizer", json())); !s.ok()) return s;
  if (auto s = ParsePreTokenizer(j.value("pre_tokenizer", json())); !s.ok()) return s;
  if (auto s = ParseDecoder(j.value("decoder", json())); !s.ok()) return s;
  return ParsePostProcessor(j.value("post_processor", json()));
}

absl::Status HfTokenizer::ParseNormalizer(const json& n) {
  if (n.is_null()) return absl::OkStatus();
  const std::string type = n.value("type", "");
  if (type == "Sequence") {
    for (const auto& s : n.at("normalizers")) {
      if (auto st = ParseNormalizer(s); !st.ok()) return st;
    }
    return absl::OkStatus();
  }
  if (type == "Prepend") {
    normalizer_.push_back({NormalizeStep::kPrepend, n.at("prepend").get<std::string>(), ""});
    return absl::OkStatus();
  }
  if (type == "Replace") {
    auto pattern = StringPattern(n.at("pattern"), "Replace normalizer");
    if (!pattern.ok()) return pattern.status();
    normalizer_.push_back({NormalizeStep::kReplace, *pattern, n.at("content").get<std::string>()});
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: normalizer \"", type,
                                                 "\" not supported (supported: Prepend, Replace)"));
}

absl::Status HfTokenizer::ParsePreTokenizer(const json& p) {
  if (p.is_null()) return absl::OkStatus();
  const std::string type = p.value("type", "");
  if (type == "Sequence") {
    for (const auto& s : p.at("pretokenizers")) {
      if (auto st = ParsePreTokenizer(s); !st.ok()) return st;
    }
    return absl::OkStatus();
  }
  if (type == "Split") {
    if (p.value("behavior", "") != "Isolated" || p.value("invert", false)) {
      return absl::InvalidArgumentError(
          "tokenizer.json: Split pre-tokenizer supports behavior Isolated, invert false");
    }
    const json& pat = p.at("pattern");
    const bool literal = pat.contains("String");
    auto re = Regex::Compile(pat.at(literal ? "String" : "Regex").get<std::string>(), literal);
    if (!re.ok()) return re.status();
    pre_tokenizer_.push_back({PreTokenizeStep::kSplit, std::move(*re)});
    return absl::OkStatus();
  }
  if (type == "ByteLevel") {
    if (p.value("add_prefix_space", false)) {
      return absl::InvalidArgumentError(
          "tokenizer.json: ByteLevel pre-tokenizer with add_prefix_space not supported");
    }
    std::optional<Regex> re;
    if (p.value("use_regex", true)) {
      auto r = Regex::Compile(kGpt2Regex, false);
      if (!r.ok()) return r.status();
      re = std::move(*r);
    }
    pre_tokenizer_.push_back({PreTokenizeStep::kByteLevel, std::move(re)});
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: pre-tokenizer \"", type,
                                                 "\" not supported (supported: Split, ByteLevel)"));
}

absl::Status HfTokenizer::ParseDecoder(const json& d) {
  if (d.is_null()) return absl::OkStatus();
  has_decoder_ = true;
  const std::string type = d.value("type", "");
  if (type == "Sequence") {
    for (const auto& s : d.at("decoders")) {
      if (auto st = ParseDecoder(s); !st.ok()) return st;
    }
    return absl::OkStatus();
  }
  DecodeStep step{};
  if (type == "ByteLevel") {
    step.kind = DecodeStep::kByteLevel;
  } else if (type == "Replace") {
    auto pattern = StringPattern(d.at("pattern"), "Replace decoder");
    if (!pattern.ok()) return pattern.status();
    step = {DecodeStep::kReplace, *pattern, d.at("content").get<std::string>()};
  } else if (type == "ByteFallback") {
    step.kind = DecodeStep::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = DecodeStep::kFuse;
  } else if (type == "Strip") {
    step = {DecodeStep::kStrip, d.at("content").get<std::string>(), "", d.value("start", 0),
            d.value("stop", 0)};
    if (step.start > 1 || step.stop != 0) {
      return absl::InvalidArgumentError(
          "tokenizer.json: Strip decoder supports start <= 1, stop 0");
    }
    strips_leading_space_ = step.a == " " && step.start == 1;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "tokenizer.json: decoder \"", type,
        "\" not supported (supported: ByteLevel, Replace, ByteFallback, Fuse, Strip)"));
  }
  decoder_.push_back(step);
  return absl::OkStatus();
}

absl::Status HfTokenizer::ParsePostProcessor(const json& p) {
  if (p.is_null()) return absl::OkStatus();
  const std::string type = p.value("type", "");
  if (type == "Sequence") {
    for (const auto& s : p.at("processors")) {
      if (auto st = ParsePostProcessor(s); !st.ok()) return st;
    }
    return absl::OkStatus();
  }
  if (type == "ByteLevel") return absl::OkStatus();  // only moves offsets; the ids stay
  if (type != "TemplateProcessing") {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer.json: post-processor \"", type, "\" not supported"));
  }
  has_post_processor_ = true;
  bool seen_sequence = false;
  for (const auto& piece : p.at("single")) {
    if (piece.contains("Sequence")) {
      seen_sequence = true;
      continue;
    }
    const std::string name = piece.at("SpecialToken").at("id").get<std::string>();
    const json& special = p.at("special_tokens");
    if (!special.contains(name)) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: template names \"", name,
                                                     "\" but special_tokens does not"));
    }
    auto& dst = seen_sequence ? suffix_ : prefix_;
    for (const auto& id : special[name].at("ids")) dst.push_back(id.get<int32_t>());
  }
  return absl::OkStatus();
}

bool HfTokenizer::FindAdded(std::string_view text, size_t from, size_t* begin, size_t* end,
                            const AddedToken** tok) const {
  for (size_t i = from; i < text.size(); ++i) {
    const AddedToken* best = nullptr;
    for (const AddedToken& t : added_) {
      if (text.compare(i, t.content.size(), t.content) != 0) continue;
      if (best != nullptr && best->content.size() >= t.content.size()) continue;
      const size_t e = i + t.content.size();
      if (t.single_word &&
          ((i > 0 && IsWordByte(text[i - 1])) || (e < text.size() && IsWordByte(text[e])))) {
        continue;
      }
      best = &t;
    }
    if (best == nullptr) continue;
    size_t b = i, e = i + best->content.size();
    if (best->lstrip) {
      while (b > from && IsSpace(text[b - 1])) --b;
    }
    if (best->rstrip) {
      while (e < text.size() && IsSpace(text[e])) ++e;
    }
    *begin = b;
    *end = e;
    *tok = best;
    return true;
  }
  return false;
}

void HfTokenizer::EncodeSegment(std::string_view text, std::vector<int32_t>* out) const {
  std::string normalized(text);
  for (const NormalizeStep& n : normalizer_) {
    if (n.kind == NormalizeStep::kPrepend) {
      if (!normalized.empty()) normalized.insert(0, n.a);
    } else {
      normalized = absl::StrReplaceAll(normalized, {{n.a, n.b}});
    }
  }
  std::vector<std::string> pieces{normalized};
  for (const PreTokenizeStep& step : pre_tokenizer_) {
    std::vector<std::string> next;
    for (const std::string& piece : pieces) {
      if (!step.regex) {
        next.push_back(piece);
        continue;
      }
      // Isolated: each match is a piece, and so is each gap between matches.
      size_t at = 0;
      for (const auto& [b, e] : step.regex->FindAll(piece)) {
        if (b > at) next.push_back(piece.substr(at, b - at));
        next.push_back(piece.substr(b, e - b));
        at = e;
      }
      if (at < piece.size()) next.push_back(piece.substr(at));
    }
    if (step.kind == PreTokenizeStep::kByteLevel) {
      for (std::string& piece : next) {
        std::string mapped;
        for (const unsigned char c : piece) mapped += Bytes().byte_to_char[c];
        piece = std::move(mapped);
      }
    }
    pieces = std::move(next);
  }
  for (const std::string& word : pieces) bpe_.EncodeWord(word, out);
}

absl::StatusOr<std::vector<int32_t>> HfTokenizer::Encode(std::string_view text,
                                                         bool add_special) const {
  std::vector<int32_t> out;
  if (add_special) out = prefix_;
  size_t at = 0, b = 0, e = 0;
  const AddedToken* tok = nullptr;
  while (FindAdded(text, at, &b, &e, &tok)) {
    EncodeSegment(text.substr(at, b - at), &out);
    out.push_back(tok->id);
    at = e;
  }
  EncodeSegment(text.substr(at), &out);
  if (add_special) out.insert(out.end(), suffix_.begin(), suffix_.end());
  return out;
}

const std::string* HfTokenizer::IdToToken(int32_t id, bool skip_special) const {
  if (const auto it = added_by_id_.find(id); it != added_by_id_.end()) {
    const AddedToken& t = added_[it->second];
    return skip_special && t.special ? nullptr : &t.content;
  }
  return bpe_.IdToToken(id);  // an unknown id decodes to nothing, as in Hugging Face
}

std::string HfTokenizer::Decode(std::span<const int32_t> ids, bool skip_special) const {
  std::vector<std::string> tokens;
  for (const int32_t id : ids) {
    if (const std::string* t = IdToToken(id, skip_special)) tokens.push_back(*t);
  }
  if (!has_decoder_) {
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) absl::StrAppend(&out, i ? " " : "", tokens[i]);
    return out;
  }
  for (const DecodeStep& step : decoder_) {
    switch (step.kind) {
      case DecodeStep::kByteLevel: {
        std::string bytes;
        for (const std::string& t : tokens) bytes += ByteLevelDecode(t);
        tokens = {utf8::Lossy(bytes)};
        break;
      }
      case DecodeStep::kReplace:
        for (std::string& t : tokens) t = absl::StrReplaceAll(t, {{step.a, step.b}});
        break;
      case DecodeStep::kByteFallback: {
        // A run of <0xNN> tokens becomes its text when valid UTF-8, else one U+FFFD per token.
        std::vector<std::string> next;
        std::string run;
        size_t run_tokens = 0;
        auto flush = [&] {
          if (run_tokens == 0) return;
          if (utf8::IsValid(run)) {
            next.push_back(run);
          } else {
            for (size_t i = 0; i < run_tokens; ++i) next.emplace_back(utf8::kReplacement);
          }
          run.clear();
          run_tokens = 0;
        };
        for (std::string& t : tokens) {
          if (const auto b = ByteToken(t)) {
            run.push_back(static_cast<char>(*b));
            ++run_tokens;
          } else {
            flush();
            next.push_back(std::move(t));
          }
        }
        flush();
        tokens = std::move(next);
        break;
      }
      case DecodeStep::kFuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        tokens = {all};
        break;
      }
      case DecodeStep::kStrip:
        for (std::string& t : tokens) {
          if (step.start > 0 && t.compare(0, step.a.size(), step.a) == 0) t.erase(0, step.a.size());
        }
        break;
    }
  }
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

std::string HfTokenizer::TokenBytes(int32_t id, bool skip_special) const {
  const std::string* t = IdToToken(id, skip_special);
  if (t == nullptr) return "";
  if (!has_decoder_) return *t;
  std::string s = *t;
  for (const DecodeStep& step : decoder_) {
    if (step.kind == DecodeStep::kByteLevel) {
      s = ByteLevelDecode(s);
    } else if (step.kind == DecodeStep::kReplace) {
      s = absl::StrReplaceAll(s, {{step.a, step.b}});
    } else if (step.kind == DecodeStep::kByteFallback) {
      if (const auto b = ByteToken(s)) s = std::string(1, static_cast<char>(*b));
    }
    // Fuse joins and Strip acts on the whole text's start (StripsLeadingSpace): not per token.
  }
  return s;
}

std::optional<int32_t> HfTokenizer::TokenToId(std::string_view token) const {
  for (const AddedToken& t : added_) {
    if (t.content == token) return t.id;
  }
  return bpe_.TokenToId(token);
}

}  // namespace

absl::StatusOr<std::unique_ptr<TokenizerImpl>> LoadHfTokenizerJson(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  const json j = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  }
  auto tok = std::make_unique<HfTokenizer>();
  try {
    if (auto s = tok->Parse(j); !s.ok()) return s;
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", e.what()));
  }
  return tok;
}

}  // namespace ts
