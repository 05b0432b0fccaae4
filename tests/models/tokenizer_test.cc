// ts_tokenizer against Hugging Face `tokenizers` and SentencePiece: the expectations come from
// make_tokenizer_fixtures.py, which the ctest fixture models_tokenizer_fixtures runs first.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "models/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"

namespace ts {
namespace {

using nlohmann::json;

std::filesystem::path FixtureDir(const std::string& name) {
  const char* bin = std::getenv("TS_BINARY_DIR");
  return std::filesystem::path(bin ? bin : ".") / "tests/models/tokenizer_fixtures" / name;
}

json Expected(const std::string& name) {
  const auto path = FixtureDir(name) / "expected.json";
  std::ifstream in(path);
  if (!in) {
    ADD_FAILURE() << path << " missing: run the ctest fixture models_tokenizer_fixtures "
                  << "(ctest -R models_tokenizer) so make_tokenizer_fixtures.py writes it";
    return json::object();
  }
  return json::parse(in);
}

Tokenizer LoadOrDie(const std::string& name) {
  auto tok = Tokenizer::Load(FixtureDir(name).string());
  EXPECT_TRUE(tok.ok()) << tok.status();
  if (!tok.ok()) std::abort();
  return std::move(*tok);
}

std::string Show(const std::vector<int32_t>& ids) {
  std::string s;
  for (const int32_t id : ids) s += std::to_string(id) + " ";
  return s;
}

// Independent of the library's own UTF-8 code: a boundary at byte `at` splits a character iff
// the byte there is a continuation byte.
bool SplitsCharacter(const std::string& text, size_t at) {
  return at < text.size() && (static_cast<unsigned char>(text[at]) & 0xC0) == 0x80;
}

class HfTokenizerJson : public ::testing::TestWithParam<const char*> {};

TEST_P(HfTokenizerJson, EncodeAndDecodeEqualHuggingFace) {
  const Tokenizer tok = LoadOrDie(GetParam());
  const json exp = Expected(GetParam());
  ASSERT_GE(exp.value("cases", json::array()).size(), 500u);
  int failures = 0;
  for (const auto& c : exp["cases"]) {
    const std::string text = c["text"];
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    const auto ids_special = c["ids_special"].get<std::vector<int32_t>>();
    auto ours = tok.Encode(text, /*add_special=*/false);
    ASSERT_TRUE(ours.ok()) << ours.status();
    auto ours_special = tok.Encode(text, /*add_special=*/true);
    ASSERT_TRUE(ours_special.ok()) << ours_special.status();
    const std::string dec = tok.Decode(ids);
    const std::string dec_skip = tok.Decode(ids, {.skip_special_tokens = true});
    const bool ok = *ours == ids && *ours_special == ids_special && dec == c["decode"] &&
                    dec_skip == c["decode_skip"];
    if (!ok && ++failures <= 5) {
      ADD_FAILURE() << "text " << json(text).dump() << "\n  hf  ids " << Show(ids) << "\n  our ids "
                    << Show(*ours) << "\n  hf  special " << Show(ids_special) << "\n  our special "
                    << Show(*ours_special) << "\n  hf  decode " << c["decode"].dump()
                    << "\n  our decode " << json(dec).dump() << "\n  hf  skip "
                    << c["decode_skip"].dump() << "\n  our skip " << json(dec_skip).dump();
    }
  }
  EXPECT_EQ(failures, 0) << "of " << exp["cases"].size() << " corpus strings";
}

TEST_P(HfTokenizerJson, DecodeOfArbitraryIdsEqualsHuggingFace) {
  // Random ids often end inside a character or hold stray bytes: both become U+FFFD as in HF.
  const Tokenizer tok = LoadOrDie(GetParam());
  const json exp = Expected(GetParam());
  ASSERT_GE(exp.value("decodes", json::array()).size(), 100u);
  int failures = 0, replaced = 0;
  for (const auto& d : exp["decodes"]) {
    const auto ids = d["ids"].get<std::vector<int32_t>>();
    const std::string dec = tok.Decode(ids);
    const std::string dec_skip = tok.Decode(ids, {.skip_special_tokens = true});
    replaced += dec.find("\xEF\xBF\xBD") != std::string::npos;
    if ((dec != d["decode"] || dec_skip != d["decode_skip"]) && ++failures <= 5) {
      ADD_FAILURE() << "ids " << Show(ids) << "\n  hf  " << d["decode"].dump() << " / "
                    << d["decode_skip"].dump() << "\n  our " << json(dec).dump() << " / "
                    << json(dec_skip).dump();
    }
  }
  EXPECT_EQ(failures, 0);
  EXPECT_GT(replaced, 0) << "no random sequence exercised the U+FFFD path";
}

TEST_P(HfTokenizerJson, StreamingNeverSplitsACharacterAndEqualsDecode) {
  const Tokenizer tok = LoadOrDie(GetParam());
  const json exp = Expected(GetParam());
  int held = 0;  // tokens whose bytes were held back: the corpus must exercise that path
  for (const auto& c : exp["cases"]) {
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    for (const bool skip : {false, true}) {
      const std::string want = tok.Decode(ids, {.skip_special_tokens = skip});
      ASSERT_EQ(want, c[skip ? "decode_skip" : "decode"]) << json(c["text"]).dump();
      StreamDecoder stream(tok, {.skip_special_tokens = skip});
      std::string got;
      for (size_t i = 0; i < ids.size(); ++i) {
        const std::string delta = stream.Next(ids[i]);
        got += delta;
        held += delta.empty();
        ASSERT_FALSE(SplitsCharacter(want, got.size()))
            << json(c["text"]).dump() << ": after token " << i << " (id " << ids[i]
            << ") the stream ends inside a character; so far " << json(got).dump();
        ASSERT_EQ(got, want.substr(0, got.size())) << json(c["text"]).dump();
      }
      got += stream.Flush();
      EXPECT_EQ(got, want) << json(c["text"]).dump();
    }
  }
  EXPECT_GT(held, 0);
}

TEST_P(HfTokenizerJson, SpecialTokensEncodeToTheirIdsAndConfigsNameBosEos) {
  const Tokenizer tok = LoadOrDie(GetParam());
  const json exp = Expected(GetParam());
  ASSERT_FALSE(exp["specials"].empty());
  for (const auto& [name, id] : exp["specials"].items()) {
    auto ids = tok.Encode(name, /*add_special=*/false);
    ASSERT_TRUE(ids.ok());
    EXPECT_EQ(*ids, std::vector<int32_t>{id.get<int32_t>()}) << name;
    EXPECT_EQ(tok.TokenToId(name), id.get<int32_t>()) << name;
    // Between words too: the token is matched before any pre-tokenization splits its text.
    ids = tok.Encode("the" + name + "the", false);
    ASSERT_TRUE(ids.ok());
    ASSERT_EQ(ids->size(), 3u) << name << ": " << Show(*ids);
    EXPECT_EQ((*ids)[1], id.get<int32_t>()) << name;
  }
  ASSERT_TRUE(tok.bos_id().has_value());
  EXPECT_EQ(*tok.bos_id(), exp["bos_id"].get<int32_t>());
  EXPECT_EQ(tok.eos_ids(), exp["eos_ids"].get<std::vector<int32_t>>());
}

TEST_P(HfTokenizerJson, InvalidUtf8IsRefused) {
  const Tokenizer tok = LoadOrDie(GetParam());
  for (const std::string bad : {"ab\xC3", "\xFF", "x\xED\xA0\x80y", "\xC0\xAF"}) {
    const auto ids = tok.Encode(bad, false);
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument)
        << "byte length " << bad.size();
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HfTokenizerJson,
                         ::testing::Values("bytelevel-llama3", "bytelevel-llama3-string-merges",
                                           "sentencepiece-bpe"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& ch : n) ch = std::isalnum(ch) ? ch : '_';
                           return n;
                         });

TEST(ByteLevelTokenizer, RoundTripsEveryCorpusString) {
  const Tokenizer tok = LoadOrDie("bytelevel-llama3");
  const json exp = Expected("bytelevel-llama3");
  ASSERT_GE(exp["cases"].size(), 500u);
  for (const auto& c : exp["cases"]) {
    const std::string text = c["text"];
    const auto ids = tok.Encode(text, /*add_special=*/false);
    ASSERT_TRUE(ids.ok());
    EXPECT_EQ(tok.Decode(*ids), text);
    const auto with_bos = tok.Encode(text, /*add_special=*/true);
    ASSERT_TRUE(with_bos.ok());
    EXPECT_EQ(tok.Decode(*with_bos), "<|begin_of_text|>" + text);
  }
}

TEST(SentencePieceModel, EncodeAndDecodeEqualSentencePiece) {
  const Tokenizer tok = LoadOrDie("sentencepiece-model");
  const json exp = Expected("sentencepiece-model");
  ASSERT_GE(exp.value("cases", json::array()).size(), 500u);
  EXPECT_EQ(tok.bos_id(), exp["bos_id"].get<int32_t>());
  EXPECT_EQ(tok.eos_ids(), exp["eos_ids"].get<std::vector<int32_t>>());
  int failures = 0, held = 0;
  for (const auto& c : exp["cases"]) {
    const std::string text = c["text"];
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    const auto ours = tok.Encode(text, false);
    const auto ours_special = tok.Encode(text, true);
    ASSERT_TRUE(ours.ok() && ours_special.ok());
    const std::string dec = tok.Decode(ids);
    if ((*ours != ids || *ours_special != c["ids_special"].get<std::vector<int32_t>>() ||
         dec != c["decode"]) &&
        ++failures <= 5) {
      ADD_FAILURE() << json(text).dump() << "\n  sp  " << Show(ids) << "\n  our " << Show(*ours)
                    << "\n  sp  decode " << c["decode"].dump() << "\n  our decode "
                    << json(dec).dump();
    }
    StreamDecoder stream(tok);
    std::string got;
    for (const int32_t id : ids) {
      const std::string delta = stream.Next(id);
      held += delta.empty();
      got += delta;
      ASSERT_FALSE(SplitsCharacter(dec, got.size())) << json(text).dump();
    }
    EXPECT_EQ(got + stream.Flush(), dec) << json(text).dump();
  }
  EXPECT_EQ(failures, 0);
  EXPECT_GT(held, 0);
}

TEST(TokenizerLoad, MissingFilesAreNotFound) {
  const auto tok = Tokenizer::Load(FixtureDir("no-such-dir").string());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kNotFound) << tok.status();
}

}  // namespace
}  // namespace ts
