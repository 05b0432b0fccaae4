// End to end: text in and text out on the fixture whose tokenizer covers its ids (issue #14,
// item 2). Its weights are random, so the text is too; what is checked is that the text is the
// tokenizer's text of exactly the tokens streamed, that stop strings cut it where they first
// appear (also across tokens), and that bad text gets a status naming the field.
#include <string>
#include <vector>

#include "tests/server/e2e_util.h"

namespace ts::testing {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

pb::TokenizeResponse Tokenize(Server& server, const pb::TokenizeRequest& req,
                              grpc::Status* status) {
  grpc::ClientContext ctx;
  ctx.set_deadline(In(kRpcTimeout));
  pb::TokenizeResponse resp;
  *status = server.stub().Tokenize(&ctx, req, &resp);
  return resp;
}

Tokens Encode(Server& server, const std::string& text) {
  pb::TokenizeRequest req;
  req.set_text(text);
  grpc::Status status;
  pb::TokenizeResponse resp = Tokenize(server, req, &status);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(resp.count(), resp.token_ids_size());
  return Tokens(resp.token_ids().begin(), resp.token_ids().end());
}

std::string Decode(Server& server, const Tokens& ids) {
  pb::TokenizeRequest req;
  req.mutable_token_ids()->mutable_ids()->Add(ids.begin(), ids.end());
  grpc::Status status;
  pb::TokenizeResponse resp = Tokenize(server, req, &status);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return resp.text();
}

pb::GenerateRequest TextGreedy(const std::string& text, int32_t max_new_tokens) {
  pb::GenerateRequest r;
  r.set_prompt_text(text);
  r.mutable_sampling()->set_temperature(0.0f);
  r.mutable_stop()->set_max_new_tokens(max_new_tokens);
  r.mutable_stop()->set_ignore_eos(true);
  return r;
}

bool IsUtf8(const std::string& s) {
  // Round-trips through the server's own decoder would hide a split; check the bytes directly.
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = s[i];
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) >> 6) != 2) return false;
    }
    i += n;
  }
  return true;
}

class TextTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = Server::Launch({}).release(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(server_, nullptr); }
  static Server* server_;
};
Server* TextTest::server_ = nullptr;

TEST_F(TextTest, ModelInfoAnnouncesTheTokenizer) {
  grpc::ClientContext ctx;
  pb::ModelInfo info;
  ASSERT_TRUE(server_->stub().GetModelInfo(&ctx, pb::GetModelInfoRequest(), &info).ok());
  EXPECT_TRUE(info.has_tokenizer());
  EXPECT_EQ(info.max_stop_strings(), 16);
  EXPECT_EQ(info.max_stop_string_bytes(), 256);
}

TEST_F(TextTest, TextPromptStreamsTheTextOfItsTokens) {
  const std::string prompt = "the cat is on the mat and it is there";
  const Tokens ids = Encode(*server_, prompt);
  ASSERT_GT(ids.size(), 3u);
  EXPECT_EQ(ids[0], 1);  // BOS
  const StreamResult text_run = Generate(server_->stub(), TextGreedy(prompt, 40));
  ASSERT_TRUE(text_run.status.ok()) << text_run.status.error_message();
  const StreamResult id_run = Generate(server_->stub(), Greedy(ids, 40));
  ASSERT_TRUE(id_run.status.ok());
  EXPECT_EQ(text_run.tokens, id_run.tokens);
  EXPECT_EQ(text_run.usage.prompt_tokens(), static_cast<int32_t>(ids.size()));
  ASSERT_EQ(text_run.tokens.size(), 40u);
  EXPECT_EQ(text_run.text, Decode(*server_, text_run.tokens));
  // The id-prompt stream carries the same text: text comes with every stream on this server.
  EXPECT_EQ(id_run.text, text_run.text);
  for (const std::string& d : text_run.deltas) EXPECT_TRUE(IsUtf8(d)) << d;
  EXPECT_FALSE(text_run.text.empty());
}

TEST_F(TextTest, TokenizeGoesBothWaysAndNamesBadInput) {
  pb::TokenizeRequest req;
  req.set_text("it is the end");
  req.mutable_params()->set_add_special_tokens(false);
  grpc::Status status;
  pb::TokenizeResponse resp = Tokenize(*server_, req, &status);
  ASSERT_TRUE(status.ok());
  const Tokens plain(resp.token_ids().begin(), resp.token_ids().end());
  Tokens with_bos = Encode(*server_, "it is the end");
  ASSERT_EQ(with_bos.size(), plain.size() + 1);
  EXPECT_EQ(Tokens(with_bos.begin() + 1, with_bos.end()), plain);
  EXPECT_EQ(Decode(*server_, with_bos), "it is the end");  // BOS skipped by default

  pb::TokenizeRequest keep;
  keep.mutable_token_ids()->mutable_ids()->Add(with_bos.begin(), with_bos.end());
  keep.mutable_params()->set_skip_special_tokens(false);
  resp = Tokenize(*server_, keep, &status);
  EXPECT_EQ(resp.text(), "<|begin_of_text|>it is the end");

  pb::TokenizeRequest bad;
  bad.set_text(std::string("ab\xE2\x82", 4));  // a truncated euro sign
  Tokenize(*server_, bad, &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "text: not valid UTF-8 (byte 2)");

  bad.Clear();
  bad.mutable_token_ids()->add_ids(5);
  bad.mutable_token_ids()->add_ids(311);
  Tokenize(*server_, bad, &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("token_ids[1]"));
}

TEST_F(TextTest, InvalidUtf8PromptIsRefusedNamingTheField) {
  pb::GenerateRequest r = TextGreedy(std::string("hello \xC0\xAF", 8), 4);  // overlong '/'
  const StreamResult got = Generate(server_->stub(), r);
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(got.status.error_message(), "prompt_text: not valid UTF-8 (byte 6)");
  EXPECT_TRUE(got.tokens.empty());
}

// Where the stream's text has a stop string spanning tokens k-1 and k, with no replacement
// character in it (a half-decoded character would not be in the streamed text yet).
struct StopPick {
  std::string stop;
  size_t tokens = 0;   // the first prefix of the tokens whose text holds the stop string
  std::string before;  // the text in front of its first occurrence
};

std::optional<StopPick> PickSpanningStop(Server& server, const Tokens& tokens,
                                         const std::string& text, size_t from) {
  std::vector<size_t> end(tokens.size() + 1, std::string::npos);
  for (size_t k = 0; k <= tokens.size(); ++k) {
    const std::string t = Decode(server, Tokens(tokens.begin(), tokens.begin() + k));
    if (text.compare(0, t.size(), t) == 0) end[k] = t.size();
  }
  for (size_t k = std::max<size_t>(from, 2); k < tokens.size(); ++k) {
    if (end[k - 2] == std::string::npos || end[k] == std::string::npos) continue;
    if (end[k - 1] == std::string::npos || end[k - 1] <= end[k - 2] || end[k] <= end[k - 1])
      continue;
    const std::string stop = text.substr(end[k - 2], end[k] - end[k - 2]);
    if (stop.find(kReplacement) != std::string::npos) continue;
    StopPick pick;
    pick.stop = stop;
    pick.before = text.substr(0, text.find(stop));
    for (size_t j = 1; j <= tokens.size(); ++j) {
      if (Decode(server, Tokens(tokens.begin(), tokens.begin() + j)).find(stop) !=
          std::string::npos) {
        pick.tokens = j;
        break;
      }
    }
    return pick;
  }
  return std::nullopt;
}

TEST_F(TextTest, AStopStringSpanningTokensEndsTheStreamBeforeIt) {
  const std::string prompt = "and then the cat sat";
  const StreamResult full = Generate(server_->stub(), TextGreedy(prompt, 48));
  ASSERT_TRUE(full.status.ok());
  const std::optional<StopPick> pick = PickSpanningStop(*server_, full.tokens, full.text, 8);
  ASSERT_TRUE(pick.has_value()) << "no ASCII-ish pair of tokens in: " << full.text;

  pb::GenerateRequest r = TextGreedy(prompt, 48);
  r.mutable_stop()->add_stop_strings(pick->stop);
  const StreamResult got = Generate(server_->stub(), r);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.finish, pb::FINISH_REASON_STOP_STRING);
  EXPECT_EQ(got.matched_stop, pick->stop);
  EXPECT_EQ(got.text, pick->before);
  EXPECT_EQ(got.text.find(pick->stop), std::string::npos);
  EXPECT_EQ(got.tokens, Prefix(full.tokens, pick->tokens));
  EXPECT_EQ(got.usage.completion_tokens(), static_cast<int32_t>(pick->tokens));
  // The engine's request was cancelled with the stream: its slot and blocks are free again.
  server_->WaitSettled();
}

TEST_F(TextTest, StopsInTheFirstTokenAndSeveralAtOnce) {
  const std::string prompt = "it is there";
  const StreamResult full = Generate(server_->stub(), TextGreedy(prompt, 48));
  ASSERT_TRUE(full.status.ok());
  ASSERT_FALSE(full.tokens.empty());
  const std::string first = Decode(*server_, Prefix(full.tokens, 1));
  if (!first.empty() && first.find(kReplacement) == std::string::npos &&
      full.text.rfind(first, 0) == 0) {
    pb::GenerateRequest r = TextGreedy(prompt, 48);
    r.mutable_stop()->add_stop_strings(first);
    const StreamResult got = Generate(server_->stub(), r);
    EXPECT_EQ(got.finish, pb::FINISH_REASON_STOP_STRING);
    EXPECT_EQ(got.text, "");
    EXPECT_EQ(got.tokens, Prefix(full.tokens, 1));
  } else {
    ADD_FAILURE() << "the first token's text is not a whole character: pick another prompt";
  }

  // Two stop strings: the one that completes first wins, whatever their order in the request.
  const std::optional<StopPick> early = PickSpanningStop(*server_, full.tokens, full.text, 4);
  ASSERT_TRUE(early.has_value());
  const std::optional<StopPick> late =
      PickSpanningStop(*server_, full.tokens, full.text, early->tokens + 3);
  ASSERT_TRUE(late.has_value());
  if (late->tokens > early->tokens) {
    pb::GenerateRequest r = TextGreedy(prompt, 48);
    r.mutable_stop()->add_stop_strings(late->stop);
    r.mutable_stop()->add_stop_strings(early->stop);
    r.mutable_stop()->add_stop_strings("\xE2\x82\xAC\xE2\x82\xAC never");
    const StreamResult got = Generate(server_->stub(), r);
    EXPECT_EQ(got.matched_stop, early->stop);
    EXPECT_EQ(got.text, early->before);
    EXPECT_EQ(got.tokens, Prefix(full.tokens, early->tokens));
  } else {
    ADD_FAILURE() << "the later stop string occurs earlier too: pick another prompt";
  }
  server_->WaitSettled();
}

TEST_F(TextTest, StopStringCapsAreEnforcedAtTheEdge) {
  pb::GenerateRequest r = TextGreedy("it", 4);
  for (int i = 0; i < 17; ++i) r.mutable_stop()->add_stop_strings("x");
  StreamResult got = Generate(server_->stub(), r);
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(got.status.error_message(), HasSubstr("stop.stop_strings"));
  r = TextGreedy("it", 4);
  r.mutable_stop()->add_stop_strings(std::string(257, 'y'));
  got = Generate(server_->stub(), r);
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(got.status.error_message(), HasSubstr("stop.stop_strings[0]"));
}

TEST(TextWithoutTokenizerTest, TextIsRefusedAsAPrecondition) {
  std::unique_ptr<Server> server = Server::Launch({"--tokenizer_dir=none"});
  ASSERT_NE(server, nullptr);
  grpc::ClientContext ctx;
  pb::ModelInfo info;
  ASSERT_TRUE(server->stub().GetModelInfo(&ctx, pb::GetModelInfoRequest(), &info).ok());
  EXPECT_FALSE(info.has_tokenizer());
  const StreamResult got = Generate(server->stub(), TextGreedy("hello", 4));
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(got.status.error_message(), HasSubstr("prompt_text"));
  pb::TokenizeRequest req;
  req.set_text("hello");
  grpc::Status status;
  Tokenize(*server, req, &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  // Ids still work, and their stream carries no text.
  const StreamResult ids = Generate(server->stub(), Greedy({1, 15, 27}, 4));
  ASSERT_TRUE(ids.status.ok());
  EXPECT_EQ(ids.tokens.size(), 4u);
  EXPECT_EQ(ids.text, "");
}

}  // namespace
}  // namespace ts::testing
