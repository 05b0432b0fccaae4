// Length distributions and synthetic prompts.
#include "bench/load/workload.h"

#include <set>

#include "gtest/gtest.h"

namespace ts::load {
namespace {

LengthDist Parse(const char* spec) {
  auto d = ParseLengthDist(spec, "--x");
  EXPECT_TRUE(d.ok()) << spec << ": " << d.status();
  return d.ok() ? *d : LengthDist{};
}

TEST(LengthDistTest, ParsesEveryForm) {
  EXPECT_EQ(Parse("17").kind, LengthDist::Kind::kFixed);
  EXPECT_EQ(Parse("17").a, 17);
  EXPECT_EQ(Parse("fixed:9").a, 9);
  const LengthDist u = Parse("uniform:4:12");
  EXPECT_EQ(u.kind, LengthDist::Kind::kUniform);
  EXPECT_EQ(u.a, 4);
  EXPECT_EQ(u.b, 12);
  EXPECT_EQ(u.MaxOrUnbounded(), 12);
  EXPECT_EQ(u.ToString(), "uniform:4:12");
  const LengthDist n = Parse("normal:100:12.5");
  EXPECT_EQ(n.kind, LengthDist::Kind::kNormal);
  EXPECT_EQ(n.b, 12.5);
  EXPECT_EQ(n.MaxOrUnbounded(), -1);
}

TEST(LengthDistTest, RejectsBadSpecsNamingTheFlag) {
  for (const char* bad :
       {"", "0", "fixed:0", "fixed:2.5", "fixed", "uniform:5", "uniform:9:3", "uniform:0:3",
        "normal:0:1", "normal:10:-1", "poisson:3", "fixed:abc", "uniform:1:1e12", "fixed:inf"}) {
    const auto d = ParseLengthDist(bad, "--input_dist");
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(d.status().message().find("--input_dist"), std::string::npos) << bad;
  }
}

TEST(LengthDistTest, UniformCoversItsRangeAndNothingElse) {
  const LengthDist u = Parse("uniform:3:7");
  std::set<int32_t> seen;
  for (int i = 0; i < 1000; ++i) {
    const int32_t v = SampleLength(u, (i + 0.5) / 1000.0, 0.0, 1 << 20);
    ASSERT_GE(v, 3);
    ASSERT_LE(v, 7);
    seen.insert(v);
  }
  EXPECT_EQ(seen.size(), 5u);
}

TEST(LengthDistTest, NormalIsCentredAndClamped) {
  const LengthDist n = Parse("normal:50:10");
  WorkloadOptions o{.seed = 4, .input = n, .output = Parse("fixed:1"), .vocab_size = 10};
  double sum = 0;
  constexpr int kN = 20000;
  for (int i = 0; i < kN; ++i)
    sum += MakeRequestSpec(o, static_cast<uint64_t>(i)).prompt_ids.size();
  EXPECT_NEAR(sum / kN, 50, 0.5);
  // A wide distribution is clamped to [1, cap].
  const LengthDist wide = Parse("normal:5:100");
  for (int i = 0; i < 100; ++i) {
    const int32_t v = SampleLength(wide, (i + 0.5) / 100.0, 0.3, 20);
    EXPECT_GE(v, 1);
    EXPECT_LE(v, 20);
  }
}

TEST(WorkloadTest, RequestsArePureFunctionsOfSeedAndIndex) {
  const WorkloadOptions o{
      .seed = 11, .input = Parse("uniform:8:40"), .output = Parse("uniform:2:9"), .vocab_size = 37};
  std::set<int32_t> ids, lengths;
  for (uint64_t i = 0; i < 200; ++i) {
    const RequestSpec a = MakeRequestSpec(o, i);
    const RequestSpec b = MakeRequestSpec(o, i);
    ASSERT_EQ(a.prompt_ids, b.prompt_ids);
    ASSERT_EQ(a.output_len, b.output_len);
    ASSERT_EQ(a.sampling_seed, b.sampling_seed);
    ASSERT_GE(a.prompt_ids.size(), 8u);
    ASSERT_LE(a.prompt_ids.size(), 40u);
    ASSERT_GE(a.output_len, 2);
    ASSERT_LE(a.output_len, 9);
    for (int32_t id : a.prompt_ids) {
      ASSERT_GE(id, 0);
      ASSERT_LT(id, 37);
      ids.insert(id);
    }
    lengths.insert(a.output_len);
  }
  EXPECT_EQ(ids.size(), 37u);  // every id below the vocab gets drawn
  EXPECT_EQ(lengths.size(), 8u);
  WorkloadOptions other = o;
  other.seed = 12;
  EXPECT_NE(MakeRequestSpec(o, 0).prompt_ids, MakeRequestSpec(other, 0).prompt_ids);
  EXPECT_NE(MakeRequestSpec(o, 0).sampling_seed, MakeRequestSpec(o, 1).sampling_seed);
}

TEST(WorkloadTest, LengthsAreCappedByServerLimits) {
  const WorkloadOptions o{.seed = 1,
                          .input = Parse("normal:60:30"),
                          .output = Parse("normal:30:30"),
                          .vocab_size = 5,
                          .max_context = 64,
                          .max_new_tokens = 16};
  for (uint64_t i = 0; i < 500; ++i) {
    const RequestSpec s = MakeRequestSpec(o, i);
    ASSERT_LE(s.output_len, 16);
    ASSERT_GE(s.output_len, 1);
    ASSERT_GE(s.prompt_ids.size(), 1u);
    ASSERT_LE(static_cast<int32_t>(s.prompt_ids.size()) + s.output_len, 64);
  }
}

TEST(WorkloadTest, CheckWorkloadFitsRejectsImpossibleFixedLengths) {
  WorkloadOptions o{.input = Parse("fixed:50"),
                    .output = Parse("fixed:20"),
                    .vocab_size = 100,
                    .max_context = 64,
                    .max_new_tokens = 32};
  EXPECT_EQ(CheckWorkloadFits(o).code(), absl::StatusCode::kInvalidArgument);
  o.input = Parse("fixed:44");
  EXPECT_TRUE(CheckWorkloadFits(o).ok());
  o.output = Parse("uniform:1:33");
  o.input = Parse("fixed:1");
  EXPECT_EQ(CheckWorkloadFits(o).code(), absl::StatusCode::kInvalidArgument);
  o.output = Parse("normal:10:50");  // unbounded: clamped per draw instead
  EXPECT_TRUE(CheckWorkloadFits(o).ok());
  o.vocab_size = 0;
  EXPECT_EQ(CheckWorkloadFits(o).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace ts::load
