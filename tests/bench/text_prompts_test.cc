// The text path's pure parts: fitting prompts to the server's limits, the seeded order, and the
// requests MakeRequestSpec builds from them.
#include "bench/load/text_prompts.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>

#include "gtest/gtest.h"

namespace ts::load {
namespace {

constexpr LengthDist kFixed8 = {LengthDist::Kind::kFixed, 8, 0};

std::vector<TextPrompt> Prompts(const std::vector<std::pair<int32_t, int32_t>>& tokens_replies) {
  std::vector<TextPrompt> out;
  for (size_t i = 0; i < tokens_replies.size(); ++i) {
    out.push_back({.text = "prompt " + std::to_string(i),
                   .input_tokens = tokens_replies[i].first,
                   .reply_tokens = tokens_replies[i].second,
                   .entry = static_cast<int64_t>(10 + i)});
  }
  return out;
}

std::vector<int64_t> Entries(const TextPromptSet& set) {
  std::vector<int64_t> out;
  for (const TextPrompt& p : set.prompts) out.push_back(p.entry);
  return out;
}

TEST(FitTextPromptsTest, SkipsWhatCannotFitAndCapsLongReplies) {
  // max_context 32, max_new_tokens 10. Output 8 from the distribution where there is no reply.
  const TextFitOptions o{
      .output = kFixed8, .output_from_reply = true, .max_context = 32, .max_new_tokens = 10};
  TextFitReport report;
  auto set = FitTextPrompts(Prompts({{24, -1},   // 24 + 8 = 32: fits
                                     {25, -1},   // 25 + 8: too long
                                     {0, -1},    // no tokens
                                     {20, 12},   // reply capped to 10: 30 fits
                                     {23, 10},   // 23 + 10 = 33: too long
                                     {5, 0},     // an empty reply still asks for one token
                                     {31, 1}}),  // 31 + 1 = 32: fits
                            o, &report);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(Entries(*set), (std::vector<int64_t>{10, 13, 15, 16}));
  EXPECT_EQ(set->prompts[1].reply_tokens, 10);
  EXPECT_EQ(set->prompts[2].reply_tokens, 1);
  EXPECT_EQ(set->prompts[0].reply_tokens, -1);
  EXPECT_EQ(report.candidates, 7);
  EXPECT_EQ(report.too_long, 2);
  EXPECT_EQ(report.first_too_long_entry, 11);
  EXPECT_EQ(report.first_too_long_tokens, 25);
  EXPECT_EQ(report.no_tokens, 1);
  EXPECT_EQ(report.replies_used, 3);
  EXPECT_EQ(report.replies_capped, 1);
}

TEST(FitTextPromptsTest, WithoutReplyLengthsTheDistributionDecides) {
  TextFitOptions o{.output = {LengthDist::Kind::kUniform, 2, 12},
                   .output_from_reply = false,
                   .max_context = 32,
                   .max_new_tokens = 16};
  TextFitReport report;
  // The uniform's largest draw (12) must fit; replies are ignored.
  auto set = FitTextPrompts(Prompts({{20, 1}, {21, 1}, {4, 30}}), o, &report);
  ASSERT_TRUE(set.ok());
  EXPECT_EQ(Entries(*set), (std::vector<int64_t>{10, 12}));
  EXPECT_EQ(report.replies_used, 0);
  EXPECT_FALSE(set->output_from_reply);
  // normal: is clamped per draw, so only one output token has to fit.
  o.output = {LengthDist::Kind::kNormal, 50, 10};
  set = FitTextPrompts(Prompts({{31, -1}, {32, -1}}), o, &report);
  ASSERT_TRUE(set.ok());
  EXPECT_EQ(Entries(*set), (std::vector<int64_t>{10}));
  // No limit from the server: nothing is too long.
  o.max_context = 0;
  set = FitTextPrompts(Prompts({{5000, -1}}), o, &report);
  ASSERT_TRUE(set.ok());
  EXPECT_EQ(set->prompts.size(), 1u);
}

TEST(FitTextPromptsTest, NothingFittingIsAnError) {
  TextFitReport report;
  const auto set =
      FitTextPrompts(Prompts({{40, -1}, {0, -1}}), {.output = kFixed8, .max_context = 32}, &report);
  EXPECT_EQ(set.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(set.status().message().find("of 2 prompts, 1 need more than max_context 32"),
            std::string::npos)
      << set.status();
}

TEST(FitTextPromptsTest, TheOrderIsASeededPermutationOrTheFileOrder) {
  std::vector<std::pair<int32_t, int32_t>> many(50, {3, -1});
  TextFitReport report;
  TextFitOptions o{.seed = 1, .output = kFixed8};
  const auto a = FitTextPrompts(Prompts(many), o, &report);
  const auto again = FitTextPrompts(Prompts(many), o, &report);
  o.seed = 2;
  const auto other = FitTextPrompts(Prompts(many), o, &report);
  o.shuffle = false;
  const auto in_order = FitTextPrompts(Prompts(many), o, &report);
  ASSERT_TRUE(a.ok() && again.ok() && other.ok() && in_order.ok());
  std::vector<uint32_t> sorted = a->order;
  std::sort(sorted.begin(), sorted.end());
  std::vector<uint32_t> iota(50);
  std::iota(iota.begin(), iota.end(), 0u);
  EXPECT_EQ(sorted, iota);  // every prompt exactly once
  EXPECT_NE(a->order, iota);
  EXPECT_EQ(a->order, again->order);
  EXPECT_NE(a->order, other->order);
  EXPECT_EQ(in_order->order, iota);
}

TEST(TextWorkloadTest, RequestsTakeTheirPromptAndFitTheContext) {
  TextFitReport report;
  auto set = FitTextPrompts(Prompts({{4, -1}, {20, 6}, {9, -1}}),
                            {.seed = 3,
                             .output = {LengthDist::Kind::kNormal, 20, 8},
                             .output_from_reply = true,
                             .max_context = 30,
                             .max_new_tokens = 16},
                            &report);
  ASSERT_TRUE(set.ok());
  WorkloadOptions o{.seed = 3,
                    .output = {LengthDist::Kind::kNormal, 20, 8},
                    .vocab_size = 0,  // unused on the text path
                    .max_context = 30,
                    .max_new_tokens = 16,
                    .text = std::make_shared<const TextPromptSet>(*set)};
  EXPECT_TRUE(CheckWorkloadFits(o).ok()) << CheckWorkloadFits(o);
  std::map<int64_t, int> uses;
  std::set<int32_t> drawn;
  for (uint64_t i = 0; i < 300; ++i) {
    const RequestSpec spec = MakeRequestSpec(o, i);
    const TextPrompt& want = set->prompts[set->order[i % 3]];
    ASSERT_EQ(spec.prompt_text, want.text);
    ASSERT_TRUE(spec.prompt_ids.empty());
    ASSERT_EQ(spec.input_len, want.input_tokens);
    ASSERT_EQ(spec.prompt_entry, want.entry);
    ASSERT_LE(spec.input_len + spec.output_len, 30);
    ASSERT_GE(spec.output_len, 1);
    ASSERT_LE(spec.output_len, 16);
    if (want.entry == 11) {
      ASSERT_EQ(spec.output_len, 6);  // its reply
    } else {
      drawn.insert(spec.output_len);
    }
    const RequestSpec again = MakeRequestSpec(o, i);
    ASSERT_EQ(again.output_len, spec.output_len);
    ASSERT_EQ(again.sampling_seed, spec.sampling_seed);
    ++uses[spec.prompt_entry];
  }
  EXPECT_GT(drawn.size(), 3u);  // lengths of the others come from the distribution
  EXPECT_EQ(uses.size(), 3u);
  for (const auto& [entry, n] : uses) EXPECT_EQ(n, 100) << entry;
  // The output check still applies on the text path; the input distribution does not.
  o.output = {LengthDist::Kind::kFixed, 17, 0};
  EXPECT_EQ(CheckWorkloadFits(o).code(), absl::StatusCode::kInvalidArgument);
  o.output = kFixed8;
  o.input = {LengthDist::Kind::kFixed, 1000, 0};
  EXPECT_TRUE(CheckWorkloadFits(o).ok());
}

}  // namespace
}  // namespace ts::load
