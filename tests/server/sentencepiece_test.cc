// A SentencePiece tokenizer.model inside a process that links libprotobuf, as the server does.
// Debian's libsentencepiece exports a bundled protobuf-lite; linked directly, this binary crashed
// in its static initialisers before main (models/tokenizer/sp_backend.h). Encodings must equal
// the sentencepiece Python package's (the fixture step writes them).
#include <fstream>

#include "gtest/gtest.h"
#include "models/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tailserve/v1/generation.pb.h"
#include "tests/common/test_paths.h"

namespace ts {
namespace {

TEST(SentencePieceInServerTest, EncodesLikeSentencePieceBesideProtobuf) {
  // Touch protobuf first so that its runtime is live in this process, not merely linked.
  tailserve::v1::GenerateRequest request;
  request.set_prompt_text("hello");
  ASSERT_FALSE(request.SerializeAsString().empty());

  const auto dir = testing::BinaryDir() / "tests/models/tokenizer_fixtures/sentencepiece-model";
  absl::StatusOr<Tokenizer> tok = Tokenizer::Load(dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  std::ifstream in(dir / "expected.json");
  ASSERT_TRUE(in) << dir;
  const nlohmann::json expected = nlohmann::json::parse(in);
  int checked = 0;
  for (const auto& c : expected["cases"]) {
    absl::StatusOr<std::vector<int32_t>> ids = tok->Encode(c["text"].get<std::string>(), false);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(*ids, c["ids"].get<std::vector<int32_t>>()) << c["text"];
    checked += !ids->empty();
  }
  EXPECT_GT(checked, 100);
}

}  // namespace
}  // namespace ts
