// The request edge: every bad field gets its status code and a message naming the field; good
// requests convert to exactly the native request the engine expects.
#include "server/validate.h"

#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/grpc_status.h"
#include "tests/common/fixture_tokenizer.h"

namespace ts::server {
namespace {

namespace pb = ::tailserve::v1;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr ValidationLimits kLimits{.vocab_size = 311, .max_context = 256, .max_stop_ids = 4};
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// The engine half of the conversion, on a server without a tokenizer.
absl::StatusOr<GenerateRequest> Convert(const pb::GenerateRequest& r, const ValidationLimits& l,
                                        uint64_t seed) {
  absl::StatusOr<ValidatedRequest> v = ValidateAndConvert(r, l, nullptr, seed);
  if (!v.ok()) return v.status();
  return v->engine;
}

pb::GenerateRequest Good() {
  pb::GenerateRequest r;
  for (int id : {1, 17, 310, 0}) r.mutable_prompt_token_ids()->add_ids(id);
  return r;
}

struct BadCase {
  std::string name;
  std::function<void(pb::GenerateRequest*)> mutate;
  absl::StatusCode code;
  std::string field;  // must appear in the message
};

class BadFieldTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadFieldTest, RejectedWithCodeNamingField) {
  const BadCase& c = GetParam();
  pb::GenerateRequest r = Good();
  c.mutate(&r);
  absl::StatusOr<GenerateRequest> got = Convert(r, kLimits, 7);
  ASSERT_FALSE(got.ok()) << c.name;
  EXPECT_EQ(got.status().code(), c.code) << got.status();
  EXPECT_THAT(std::string(got.status().message()), HasSubstr(c.field));
  // The field name leads the message so clients can parse it.
  EXPECT_EQ(std::string(got.status().message()).rfind(c.field, 0), 0u) << got.status();
}

void SetIds(pb::GenerateRequest* r, std::initializer_list<int> ids) {
  r->mutable_prompt_token_ids()->clear_ids();
  for (int id : ids) r->mutable_prompt_token_ids()->add_ids(id);
}

const absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

INSTANTIATE_TEST_SUITE_P(
    Edge, BadFieldTest,
    ::testing::Values(
        BadCase{"no_prompt", [](auto* r) { r->clear_prompt(); }, kInvalid, "prompt_token_ids"},
        BadCase{"empty_prompt", [](auto* r) { SetIds(r, {}); }, kInvalid, "prompt_token_ids"},
        BadCase{"negative_id",
                [](auto* r) {
                  SetIds(r, {1, 2, 3, -1});
                },
                kInvalid, "prompt_token_ids[3]"},
        BadCase{"id_eq_vocab", [](auto* r) { SetIds(r, {311}); }, kInvalid, "prompt_token_ids[0]"},
        BadCase{"prompt_text_without_tokenizer", [](auto* r) { r->set_prompt_text("hello"); },
                absl::StatusCode::kFailedPrecondition, "prompt_text"},
        BadCase{"stop_strings_without_tokenizer",
                [](auto* r) { r->mutable_stop()->add_stop_strings("."); },
                absl::StatusCode::kFailedPrecondition, "stop.stop_strings"},
        BadCase{"prompt_fills_context",
                [](auto* r) {
                  SetIds(r, {});
                  for (int i = 0; i < 256; ++i) r->mutable_prompt_token_ids()->add_ids(5);
                },
                kInvalid, "prompt_token_ids"},
        BadCase{"over_context",
                [](auto* r) { r->mutable_stop()->set_max_new_tokens(253); },  // 4 + 253 > 256
                kInvalid, "stop.max_new_tokens"},
        BadCase{"huge_max_new",
                [](auto* r) {
                  r->mutable_stop()->set_max_new_tokens(std::numeric_limits<int32_t>::max());
                },
                kInvalid, "stop.max_new_tokens"},
        BadCase{"zero_max_new", [](auto* r) { r->mutable_stop()->set_max_new_tokens(0); }, kInvalid,
                "stop.max_new_tokens"},
        BadCase{"neg_min_new", [](auto* r) { r->mutable_stop()->set_min_new_tokens(-1); }, kInvalid,
                "stop.min_new_tokens"},
        BadCase{"min_over_max",
                [](auto* r) {
                  r->mutable_stop()->set_max_new_tokens(8);
                  r->mutable_stop()->set_min_new_tokens(9);
                },
                kInvalid, "stop.min_new_tokens"},
        BadCase{"too_many_stops",
                [](auto* r) {
                  for (int i = 0; i < 5; ++i) r->mutable_stop()->add_stop_token_ids(i);
                },
                kInvalid, "stop.stop_token_ids"},
        BadCase{"bad_stop_id",
                [](auto* r) {
                  r->mutable_stop()->add_stop_token_ids(3);
                  r->mutable_stop()->add_stop_token_ids(400);
                },
                kInvalid, "stop.stop_token_ids[1]"},
        BadCase{"nan_temp", [](auto* r) { r->mutable_sampling()->set_temperature(kNaN); }, kInvalid,
                "sampling.temperature"},
        BadCase{"inf_temp", [](auto* r) { r->mutable_sampling()->set_temperature(kInf); }, kInvalid,
                "sampling.temperature"},
        BadCase{"neg_temp", [](auto* r) { r->mutable_sampling()->set_temperature(-0.5f); },
                kInvalid, "sampling.temperature"},
        BadCase{"top_p_zero", [](auto* r) { r->mutable_sampling()->set_top_p(0.0f); }, kInvalid,
                "sampling.top_p"},
        BadCase{"top_p_over", [](auto* r) { r->mutable_sampling()->set_top_p(1.01f); }, kInvalid,
                "sampling.top_p"},
        BadCase{"top_p_nan", [](auto* r) { r->mutable_sampling()->set_top_p(kNaN); }, kInvalid,
                "sampling.top_p"},
        BadCase{"top_k_neg", [](auto* r) { r->mutable_sampling()->set_top_k(-1); }, kInvalid,
                "sampling.top_k"},
        BadCase{"top_k_over", [](auto* r) { r->mutable_sampling()->set_top_k(312); }, kInvalid,
                "sampling.top_k"},
        BadCase{"min_p_over", [](auto* r) { r->mutable_sampling()->set_min_p(1.5f); }, kInvalid,
                "sampling.min_p"},
        BadCase{"min_p_neg", [](auto* r) { r->mutable_sampling()->set_min_p(-0.1f); }, kInvalid,
                "sampling.min_p"},
        BadCase{"rep_zero", [](auto* r) { r->mutable_sampling()->set_repetition_penalty(0.0f); },
                kInvalid, "sampling.repetition_penalty"},
        BadCase{"rep_nan", [](auto* r) { r->mutable_sampling()->set_repetition_penalty(kNaN); },
                kInvalid, "sampling.repetition_penalty"},
        BadCase{"presence_over", [](auto* r) { r->mutable_sampling()->set_presence_penalty(2.5f); },
                kInvalid, "sampling.presence_penalty"},
        BadCase{"frequency_under",
                [](auto* r) { r->mutable_sampling()->set_frequency_penalty(-2.5f); }, kInvalid,
                "sampling.frequency_penalty"},
        BadCase{"frequency_inf",
                [](auto* r) { r->mutable_sampling()->set_frequency_penalty(kInf); }, kInvalid,
                "sampling.frequency_penalty"},
        BadCase{"long_request_id", [](auto* r) { r->set_request_id(std::string(200, 'x')); },
                kInvalid, "request_id"}),
    [](const ::testing::TestParamInfo<BadCase>& info) { return info.param.name; });

TEST(ValidateTest, DefaultsApplyAndSeedIsDrawn) {
  absl::StatusOr<GenerateRequest> got = Convert(Good(), kLimits, 12345);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_THAT(got->prompt, ElementsAre(1, 17, 310, 0));
  EXPECT_EQ(got->request_id, "");
  EXPECT_EQ(got->sampling.temperature, 1.0f);
  EXPECT_EQ(got->sampling.top_k, 0);
  EXPECT_EQ(got->sampling.top_p, 1.0f);
  EXPECT_EQ(got->sampling.min_p, 0.0f);
  EXPECT_EQ(got->sampling.repetition_penalty, 1.0f);
  EXPECT_EQ(got->sampling.seed, 12345u);
  // Unset: what the context leaves after the 4-token prompt.
  EXPECT_EQ(got->stop.max_new_tokens, kLimits.max_context - 4);
  EXPECT_EQ(got->stop.min_new_tokens, 0);
  EXPECT_FALSE(got->stop.ignore_eos);
  EXPECT_TRUE(got->stop.stop_token_ids.empty());
}

TEST(ValidateTest, UnsetMaxNewTokensIsWhatTheContextLeavesCappedByTheServer) {
  // 250 of 256 positions taken: a fixed default of 16 would be refused under a field the client
  // never set.
  pb::GenerateRequest r;
  for (int i = 0; i < 250; ++i) r.mutable_prompt_token_ids()->add_ids(i % 311);
  absl::StatusOr<GenerateRequest> got = Convert(r, kLimits, 1);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->stop.max_new_tokens, 6);
  // One position left: exactly one token.
  r.mutable_prompt_token_ids()->mutable_ids()->Resize(255, 7);
  got = Convert(r, kLimits, 1);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->stop.max_new_tokens, 1);
  // The server's cap applies to a short prompt.
  ValidationLimits capped = kLimits;
  capped.max_new_tokens = 100;
  r.mutable_prompt_token_ids()->mutable_ids()->Truncate(10);
  got = Convert(r, capped, 1);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->stop.max_new_tokens, 100);
  // A set value is taken as given, and min_new_tokens is checked against the unset default.
  r.mutable_stop()->set_min_new_tokens(101);
  got = Convert(r, capped, 1);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.status().message(), HasSubstr("stop.min_new_tokens"));
  r.mutable_stop()->set_max_new_tokens(120);
  got = Convert(r, capped, 1);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->stop.max_new_tokens, 120);
}

TEST(ValidateTest, EveryFieldConverts) {
  pb::GenerateRequest r = Good();
  r.set_request_id("req-7");
  pb::SamplingParams* s = r.mutable_sampling();
  s->set_temperature(0.8f);
  s->set_top_k(40);
  s->set_top_p(0.9f);
  s->set_min_p(0.05f);
  s->set_repetition_penalty(1.1f);
  s->set_presence_penalty(-0.5f);
  s->set_frequency_penalty(0.25f);
  s->set_seed(42);
  pb::StopParams* st = r.mutable_stop();
  st->set_max_new_tokens(252);  // 4 + 252 == max_context exactly: allowed
  st->set_min_new_tokens(3);
  st->add_stop_token_ids(2);
  st->add_stop_token_ids(310);
  st->set_ignore_eos(true);
  absl::StatusOr<GenerateRequest> got = Convert(r, kLimits, 999);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->request_id, "req-7");
  EXPECT_EQ(got->sampling.temperature, 0.8f);
  EXPECT_EQ(got->sampling.top_k, 40);
  EXPECT_EQ(got->sampling.top_p, 0.9f);
  EXPECT_EQ(got->sampling.min_p, 0.05f);
  EXPECT_EQ(got->sampling.repetition_penalty, 1.1f);
  EXPECT_EQ(got->sampling.presence_penalty, -0.5f);
  EXPECT_EQ(got->sampling.frequency_penalty, 0.25f);
  EXPECT_EQ(got->sampling.seed, 42u);  // explicit seed wins over the drawn one
  EXPECT_EQ(got->stop.max_new_tokens, 252);
  EXPECT_EQ(got->stop.min_new_tokens, 3);
  EXPECT_THAT(got->stop.stop_token_ids, ElementsAre(2, 310));
  EXPECT_TRUE(got->stop.ignore_eos);
}

TEST(ValidateTest, GreedyAndEdgeValuesAccepted) {
  pb::GenerateRequest r = Good();
  r.mutable_sampling()->set_temperature(0.0f);
  r.mutable_sampling()->set_top_k(311);  // == vocab
  r.mutable_sampling()->set_top_p(1.0f);
  r.mutable_sampling()->set_min_p(1.0f);
  r.mutable_sampling()->set_presence_penalty(2.0f);
  r.mutable_sampling()->set_frequency_penalty(-2.0f);
  r.mutable_sampling()->set_seed(0);  // set to zero is still "set"
  for (int i = 0; i < 4; ++i) r.mutable_stop()->add_stop_token_ids(i);  // == cap
  absl::StatusOr<GenerateRequest> got = Convert(r, kLimits, 5);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->sampling.greedy());
  EXPECT_EQ(got->sampling.top_k, 311);
  EXPECT_EQ(got->sampling.seed, 0u);
  EXPECT_EQ(got->stop.stop_token_ids.size(), 4u);
}

TEST(GrpcStatusTest, CodesAndMessagesCarryOver) {
  const grpc::Status s = ToGrpcStatus(absl::InvalidArgumentError("sampling.top_p: bad"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "sampling.top_p: bad");
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_EQ(ToGrpcCode(absl::StatusCode::kResourceExhausted), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(ToGrpcCode(absl::StatusCode::kUnavailable), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(ToGrpcCode(absl::StatusCode::kUnimplemented), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(ToGrpcCode(absl::StatusCode::kAlreadyExists), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(ToGrpcCode(absl::StatusCode::kInternal), grpc::StatusCode::INTERNAL);
  EXPECT_EQ(ToGrpcCode(absl::StatusCode::kCancelled), grpc::StatusCode::CANCELLED);
}

// Text fields, on the fixture whose tokenizer covers its 311 ids.
class TextValidateTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { tok_ = testing::FixtureTokenizer(); }
  void SetUp() override { ASSERT_NE(tok_, nullptr); }
  static absl::StatusOr<ValidatedRequest> Validate(const pb::GenerateRequest& r) {
    return ValidateAndConvert(r, kLimits, tok_, 3);
  }
  static void ExpectRejected(const pb::GenerateRequest& r, absl::string_view field) {
    absl::StatusOr<ValidatedRequest> got = Validate(r);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), kInvalid) << got.status();
    EXPECT_EQ(std::string(got.status().message()).rfind(std::string(field), 0), 0u) << got.status();
  }
  static const Tokenizer* tok_;
};
const Tokenizer* TextValidateTest::tok_ = nullptr;

TEST_F(TextValidateTest, PromptTextIsEncodedWithBosUnlessTurnedOff) {
  pb::GenerateRequest r;
  r.set_prompt_text("the cat is on it");
  absl::StatusOr<ValidatedRequest> got = Validate(r);
  ASSERT_TRUE(got.ok()) << got.status();
  absl::StatusOr<std::vector<int32_t>> want = tok_->Encode("the cat is on it", true);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(got->engine.prompt, *want);
  ASSERT_FALSE(got->engine.prompt.empty());
  EXPECT_EQ(got->engine.prompt[0], 1);        // BOS, from the post-processor
  EXPECT_LT(got->engine.prompt.size(), 17u);  // merges apply: fewer ids than bytes + BOS
  // The unset max_new_tokens is what the context leaves after the encoded prompt.
  EXPECT_EQ(got->engine.stop.max_new_tokens,
            kLimits.max_context - static_cast<int32_t>(want->size()));

  r.mutable_text()->set_add_special_tokens(false);
  got = Validate(r);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->engine.prompt, std::vector<int32_t>(want->begin() + 1, want->end()));
}

TEST_F(TextValidateTest, InvalidUtf8IsRefusedNamingTheFieldAndTheByte) {
  pb::GenerateRequest r;
  r.set_prompt_text(std::string("ok \xC3\x28", 5));  // a lead byte followed by ASCII
  absl::StatusOr<ValidatedRequest> got = Validate(r);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), kInvalid);
  EXPECT_EQ(got.status().message(), "prompt_text: not valid UTF-8 (byte 3)");

  r = Good();
  r.mutable_stop()->add_stop_strings("fine");
  r.mutable_stop()->add_stop_strings(std::string("\xFF", 1));
  ExpectRejected(r, "stop.stop_strings[1]: not valid UTF-8 (byte 0)");
}

TEST_F(TextValidateTest, TooLongTextPromptNamesPromptText) {
  pb::GenerateRequest r;
  std::string text;
  for (int i = 0; i < 300; ++i) text += " zq";  // no merges: 2 ids per repeat
  r.set_prompt_text(text);
  ExpectRejected(r, "prompt_text");
  r.set_prompt_text("the end");
  r.mutable_stop()->set_max_new_tokens(kLimits.max_context);
  ExpectRejected(r, "stop.max_new_tokens");
  absl::StatusOr<ValidatedRequest> got = Validate(r);
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("prompt_text ("));
}

TEST_F(TextValidateTest, StopStringsAreCappedInNumberAndLength) {
  pb::GenerateRequest r = Good();
  for (int i = 0; i < kLimits.max_stop_strings; ++i) r.mutable_stop()->add_stop_strings("x");
  ASSERT_TRUE(Validate(r).ok());
  r.mutable_stop()->add_stop_strings("x");
  ExpectRejected(r, "stop.stop_strings: 17 strings exceed the cap of 16");

  r = Good();
  r.mutable_stop()->add_stop_strings(std::string(kLimits.max_stop_string_bytes, 'a'));
  ASSERT_TRUE(Validate(r).ok());
  r.mutable_stop()->add_stop_strings(std::string(kLimits.max_stop_string_bytes + 1, 'a'));
  ExpectRejected(r, "stop.stop_strings[1]: 257 bytes exceed the cap of 256");

  r = Good();
  r.mutable_stop()->add_stop_strings("");
  ExpectRejected(r, "stop.stop_strings[0]: is empty");
}

TEST_F(TextValidateTest, TextSpecCarriesStopsAndSkipSpecial) {
  pb::GenerateRequest r = Good();
  r.mutable_stop()->add_stop_strings("\n\n");
  r.mutable_stop()->add_stop_strings("é");
  absl::StatusOr<ValidatedRequest> got = Validate(r);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_THAT(got->text.stop_strings, ElementsAre("\n\n", "é"));
  EXPECT_TRUE(got->text.decode.skip_special_tokens);  // the default
  r.mutable_text()->set_skip_special_tokens(false);
  got = Validate(r);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_FALSE(got->text.decode.skip_special_tokens);
}

}  // namespace
}  // namespace ts::server
