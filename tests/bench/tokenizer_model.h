// Model directories for the text end-to-end tests: a fixture checkpoint (linked) beside a small
// byte-level BPE tokenizer.json whose vocab fills the fixture's vocab_size, or without any.
//
// Ids: 0 <unk>, 1 <s> (BOS), 2 </s> (EOS), as the fixture's generation_config.json names them;
// 3..130 the 128 ASCII bytes; the rest merges of ASCII text. Every token is ASCII, so whatever
// the random-weight model generates is valid UTF-8: a stop string cut from it is whole
// characters, and equal texts do not hinge on where U+FFFD replacements fall. (The fixture's own
// tokenizer.json has all 256 bytes; ~40% of random ids are bytes >= 0x80.) A post-processor adds
// BOS, as Llama-3's does.
#pragma once

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace ts::test {

// GPT-2's bytes_to_unicode for ASCII: printable bytes stand for themselves, the others for
// U+0100 + their rank among the non-printable bytes (0..32 -> U+0100.., 127 -> U+0121).
inline std::string ByteLevelChar(int b) {
  if (b >= '!' && b <= '~') return std::string(1, static_cast<char>(b));
  const int cp = 256 + (b <= 32 ? b : 33);  // b == 127 is the 34th non-printable byte
  return {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
}

inline nlohmann::json TinyTokenizerJson(int vocab_size) {
  using nlohmann::json;
  json vocab = json::object();
  std::set<std::string> have;
  int next = 0;
  auto add = [&](const std::string& token) {
    vocab[token] = next++;
    have.insert(token);
  };
  for (const char* special : {"<unk>", "<s>", "</s>"}) add(special);
  for (int b = 0; b < 128; ++b) add(ByteLevelChar(b));
  // Merges, left to right through these words (Ġ is the space), then letter pairs to fill up.
  json merges = json::array();
  auto merge = [&](const std::string& a, const std::string& b) {
    if (next >= vocab_size || have.count(a + b) || !have.count(a) || !have.count(b)) return;
    merges.push_back({a, b});
    add(a + b);
  };
  const std::string space = ByteLevelChar(' ');
  for (const char* word :
       {"the", "in", "beginning", "and", "of",   "to", "a",  "is", "was",  "it",
        "for", "on", "with",      "he",  "that", "be", "at", "by", "this", "from"}) {
    for (const std::string& w : {space + word, std::string(word)}) {
      // Byte-level symbols: Ġ is two bytes, every other character one.
      std::vector<std::string> symbols;
      for (size_t i = 0; i < w.size();) {
        const size_t n = (static_cast<unsigned char>(w[i]) & 0x80) ? 2 : 1;
        symbols.push_back(w.substr(i, n));
        i += n;
      }
      std::string piece = symbols[0];
      for (size_t i = 1; i < symbols.size(); ++i) {
        merge(piece, symbols[i]);
        piece += symbols[i];
      }
    }
  }
  for (char a = 'a'; a <= 'z' && next < vocab_size; ++a) {
    for (char b = 'a'; b <= 'z' && next < vocab_size; ++b)
      merge(std::string(1, a), std::string(1, b));
  }
  json added = json::array();
  for (int id = 0; id < 3; ++id) {
    added.push_back({{"id", id},
                     {"content", id == 0   ? "<unk>"
                                 : id == 1 ? "<s>"
                                           : "</s>"},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  return {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "ByteLevel"},
        {"add_prefix_space", false},
        {"trim_offsets", true},
        {"use_regex", true}}},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
        {"pair", json::array({{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder",
       {{"type", "ByteLevel"},
        {"add_prefix_space", true},
        {"trim_offsets", true},
        {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", merges}}},
  };
}

// Makes dir a model directory of the fixture's checkpoint alone (links), without its tokenizer
// files. Returns an error message, or "" on success.
inline std::string LinkCheckpoint(const std::filesystem::path& fixture,
                                  const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  for (const char* name : {"config.json", "generation_config.json", "model.safetensors"}) {
    fs::create_symlink(fs::absolute(fixture / name), dir / name, ec);
    if (ec) return "cannot link " + (dir / name).string() + ": " + ec.message();
  }
  return "";
}

// LinkCheckpoint, plus the ASCII tokenizer.json above sized to the fixture's vocab_size.
inline std::string MakeTokenizerModelDir(const std::filesystem::path& fixture,
                                         const std::filesystem::path& dir) {
  std::ifstream config_file(fixture / "config.json");
  const nlohmann::json config = nlohmann::json::parse(config_file, nullptr, false);
  if (config.is_discarded() || !config.contains("vocab_size")) {
    return (fixture / "config.json").string() + " has no vocab_size";
  }
  if (std::string e = LinkCheckpoint(fixture, dir); !e.empty()) return e;
  const nlohmann::json tok = TinyTokenizerJson(config["vocab_size"].get<int>());
  if (tok["model"]["vocab"].size() != config["vocab_size"].get<size_t>()) {
    return "the tokenizer's vocab does not fill vocab_size";
  }
  std::ofstream(dir / "tokenizer.json") << tok.dump(1);
  return "";
}

}  // namespace ts::test
