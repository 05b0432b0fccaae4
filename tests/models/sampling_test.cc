#include "models/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/philox.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ts {
namespace {

using ::testing::HasSubstr;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

SamplingParams Greedy() {
  SamplingParams p;
  p.temperature = 0.0f;
  return p;
}

int32_t Draw(std::vector<float> logits, const SamplingParams& p, uint64_t position) {
  return SampleFromLogits(logits, p, position);
}

// Frequencies of each token over n draws at positions 0..n-1 (seed fixed per params).
std::vector<double> Frequencies(const std::vector<float>& logits, const SamplingParams& p, int n) {
  std::vector<double> f(logits.size(), 0.0);
  for (int i = 0; i < n; ++i) f[Draw(logits, p, static_cast<uint64_t>(i))] += 1.0;
  for (double& x : f) x /= n;
  return f;
}

// Draws are deterministic, so a 5-sigma band cannot flake; it still catches a wrong distribution.
void ExpectDistribution(const std::vector<double>& freq, const std::vector<double>& want, int n) {
  ASSERT_EQ(freq.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const double sigma = std::sqrt(want[i] * (1.0 - want[i]) / n);
    if (want[i] == 0.0) {
      EXPECT_EQ(freq[i], 0.0) << "token " << i << " must never be drawn";
    } else {
      EXPECT_NEAR(freq[i], want[i], 5.0 * sigma + 1e-9) << "token " << i;
    }
  }
}

// Logits for a target distribution, placed at scrambled ids so rank order != id order.
// probs[r] is the probability of rank r; ids[r] the token holding it.
std::vector<float> LogitsFor(const std::vector<double>& probs, const std::vector<int>& ids) {
  std::vector<float> logits(probs.size());
  for (size_t r = 0; r < probs.size(); ++r) logits[ids[r]] = static_cast<float>(std::log(probs[r]));
  return logits;
}

const std::vector<double> kProbs = {0.4, 0.3, 0.2, 0.1};
const std::vector<int> kIds = {2, 0, 3, 1};

// Expected per-token probabilities when ranks [0, keep) survive and are renormalised.
std::vector<double> KeptPrefix(int keep) {
  double total = 0.0;
  for (int r = 0; r < keep; ++r) total += kProbs[r];
  std::vector<double> want(kProbs.size(), 0.0);
  for (int r = 0; r < keep; ++r) want[kIds[r]] = kProbs[r] / total;
  return want;
}

constexpr int kDraws = 40000;

TEST(SamplingTest, GreedyPicksArgmax) {
  EXPECT_EQ(Draw({0.1f, 3.0f, -1.0f, 2.0f}, Greedy(), 0), 1);
  EXPECT_EQ(Draw({-5.0f, -3.0f, -4.0f}, Greedy(), 0), 1);
}

TEST(SamplingTest, GreedyTieBreaksToLowestId) {
  EXPECT_EQ(Draw({1.0f, 5.0f, 5.0f, 2.0f}, Greedy(), 0), 1);
  EXPECT_EQ(Draw({7.0f, 7.0f, 7.0f}, Greedy(), 3), 0);
}

TEST(SamplingTest, GreedyIgnoresNaNAndSeed) {
  EXPECT_EQ(Draw({kNaN, 1.0f, 0.0f}, Greedy(), 0), 1);
  EXPECT_EQ(Draw({-kInf, -kInf, -kInf}, Greedy(), 0), 0);
  SamplingParams p = Greedy();
  for (uint64_t seed = 0; seed < 20; ++seed) {
    p.seed = seed;
    EXPECT_EQ(Draw({0.5f, 0.2f, 0.9f, 0.89f}, p, seed * 7), 2);
  }
}

TEST(SamplingTest, TemperatureAloneMatchesSoftmax) {
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, 0.5f};
  SamplingParams p;
  p.temperature = 0.7f;
  p.seed = 11;
  std::vector<double> want(4);
  double z = 0.0;
  for (int i = 0; i < 4; ++i) z += want[i] = std::exp(logits[i] / 0.7);
  for (double& w : want) w /= z;
  ExpectDistribution(Frequencies(logits, p, kDraws), want, kDraws);
}

TEST(SamplingTest, TopKAloneKeepsKBest) {
  SamplingParams p;
  p.top_k = 2;
  p.seed = 5;
  ExpectDistribution(Frequencies(LogitsFor(kProbs, kIds), p, kDraws), KeptPrefix(2), kDraws);
  p.top_k = 1;
  ExpectDistribution(Frequencies(LogitsFor(kProbs, kIds), p, 200), KeptPrefix(1), 200);
}

TEST(SamplingTest, TopPAloneKeepsSmallestPrefixReachingP) {
  SamplingParams p;
  p.seed = 6;
  p.top_p = 0.65f;  // 0.4 < 0.65 <= 0.7: two ranks
  ExpectDistribution(Frequencies(LogitsFor(kProbs, kIds), p, kDraws), KeptPrefix(2), kDraws);
  p.top_p = 0.85f;  // 0.7 < 0.85 <= 0.9: three ranks
  ExpectDistribution(Frequencies(LogitsFor(kProbs, kIds), p, kDraws), KeptPrefix(3), kDraws);
  p.top_p = 0.1f;  // rank 0 alone already reaches it
  ExpectDistribution(Frequencies(LogitsFor(kProbs, kIds), p, 200), KeptPrefix(1), 200);
}

TEST(SamplingTest, MinPAloneKeepsTokensAboveFractionOfMax) {
  SamplingParams p;
  p.seed = 7;
  p.min_p = 0.45f;  // threshold 0.18: keeps 0.4, 0.3, 0.2
  ExpectDistribution(Frequencies(LogitsFor(kProbs, kIds), p, kDraws), KeptPrefix(3), kDraws);
  p.min_p = 0.8f;  // threshold 0.32: keeps 0.4 only
  ExpectDistribution(Frequencies(LogitsFor(kProbs, kIds), p, 200), KeptPrefix(1), 200);
}

TEST(SamplingTest, TopPAppliesAfterTopK) {
  // After top-k = 2 the kept mass is (0.571, 0.429); top-p 0.5 then keeps rank 0 only. Applied the
  // other way round, top-p 0.5 on the full distribution would keep two ranks.
  SamplingParams p;
  p.seed = 8;
  p.top_k = 2;
  p.top_p = 0.5f;
  ExpectDistribution(Frequencies(LogitsFor(kProbs, kIds), p, 500), KeptPrefix(1), 500);
}

TEST(SamplingTest, TemperatureAppliesBeforeFilters) {
  // At temperature 0.5 the probabilities become proportional to p^2: (16, 9, 4, 1) / 30, so
  // min-p 0.3 (threshold 4.8/30) keeps two ranks where it would keep three at temperature 1.
  SamplingParams p;
  p.seed = 9;
  p.temperature = 0.5f;
  p.min_p = 0.3f;
  std::vector<double> want(4, 0.0);
  want[kIds[0]] = 16.0 / 25.0;
  want[kIds[1]] = 9.0 / 25.0;
  ExpectDistribution(Frequencies(LogitsFor(kProbs, kIds), p, kDraws), want, kDraws);
}

TEST(SamplingTest, DrawIsInverseCdfInRankOrder) {
  // Pins the draw the CUDA kernel must reproduce: walk ranks, first running sum > u * S.
  const std::vector<float> logits = LogitsFor(kProbs, kIds);
  SamplingParams p;
  p.seed = 0x1234567890abcdefull;
  int checked = 0;
  for (uint64_t pos = 0; pos < 2000; ++pos) {
    const double u = UniformFromSeed(p.seed, pos);
    double running = 0.0;
    int want = -1;
    bool near_edge = false;
    for (int r = 0; r < 4; ++r) {
      running += kProbs[r];
      near_edge |= std::abs(running - u) < 1e-5;
      if (want < 0 && running > u) want = kIds[r];
    }
    if (near_edge) continue;
    ++checked;
    ASSERT_EQ(Draw(logits, p, pos), want) << "position " << pos << " u " << u;
  }
  EXPECT_GT(checked, 1900);
}

TEST(SamplingTest, RepetitionPenaltyDividesPositiveMultipliesNegative) {
  std::vector<float> logits = {2.0f, -2.0f, 1.0f, 0.5f, 3.0f};
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  const std::vector<int32_t> prompt = {0, 4, 4};
  const std::vector<int32_t> output = {1, 1, 99, -3};  // out-of-range ids are ignored
  ApplyPenalties(logits, p, prompt, output);
  EXPECT_FLOAT_EQ(logits[0], 1.0f);
  EXPECT_FLOAT_EQ(logits[1], -4.0f);  // seen twice, penalised once
  EXPECT_FLOAT_EQ(logits[2], 1.0f);
  EXPECT_FLOAT_EQ(logits[3], 0.5f);
  EXPECT_FLOAT_EQ(logits[4], 1.5f);
}

TEST(SamplingTest, PresenceAndFrequencyCountOutputOnly) {
  std::vector<float> logits = {2.0f, -2.0f, 1.0f, 0.5f};
  SamplingParams p;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  const std::vector<int32_t> prompt = {0, 2};
  const std::vector<int32_t> output = {1, 1, 3, 1};
  ApplyPenalties(logits, p, prompt, output);
  EXPECT_FLOAT_EQ(logits[0], 2.0f);
  EXPECT_FLOAT_EQ(logits[1], -2.0f - 0.5f - 0.25f * 3);
  EXPECT_FLOAT_EQ(logits[2], 1.0f);
  EXPECT_FLOAT_EQ(logits[3], 0.5f - 0.5f - 0.25f);
}

TEST(SamplingTest, SampleTokenAppliesPenaltiesAtNextPosition) {
  // Token 0 wins greedily until the repetition penalty pushes it below token 1.
  SamplingParams p = Greedy();
  p.repetition_penalty = 4.0f;
  std::vector<float> logits = {3.0f, 1.0f, 0.0f};
  const std::vector<int32_t> prompt = {0};
  EXPECT_EQ(SampleToken(logits, p, prompt, {}), 1);

  // Sampled: position = prompt + output length.
  SamplingParams s;
  s.seed = 42;
  const std::vector<int32_t> prompt3 = {5, 6, 7};
  const std::vector<int32_t> output2 = {8, 9};
  for (int trial = 0; trial < 50; ++trial) {
    s.seed = 42 + trial;
    std::vector<float> a(10, 0.0f), b(10, 0.0f);
    EXPECT_EQ(SampleToken(a, s, prompt3, output2), SampleFromLogits(b, s, 5));
  }
}

// Philox4x32-10 known-answer vectors from Random123's kat_vectors (counter, key -> output).
TEST(SamplingTest, PhiloxMatchesRandom123KnownAnswers) {
  struct Kat {
    Philox4x32 ctr;
    uint32_t k0, k1;
    Philox4x32 want;
  };
  const Kat kats[] = {
      {{{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}}},
      {{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}},
       0xffffffffu,
       0xffffffffu,
       {{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}}},
      {{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}},
       0xa4093822u,
       0x299f31d0u,
       {{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}}},
  };
  for (const Kat& k : kats) {
    const Philox4x32 got = Philox4x32_10(k.ctr, k.k0, k.k1);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(got.v[i], k.want.v[i]) << "word " << i;
  }
  // UniformFromSeed: key = seed, counter = (position lo, position hi, stream, 0), top 24 bits.
  const uint64_t seed = 0x299f31d0a4093822ull, pos = 0x85a308d3243f6a88ull;
  const Philox4x32 raw =
      Philox4x32_10({{0x243f6a88u, 0x85a308d3u, 7u, 0u}}, 0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(UniformFromSeed(seed, pos, 7), static_cast<float>(raw.v[0] >> 8) / 16777216.0f);
  EXPECT_EQ(UniformFromSeed(0, 0), static_cast<float>(0x6627e8d5u >> 8) / 16777216.0f);
}

TEST(SamplingTest, SameSeedAndPositionIsDeterministic) {
  const std::vector<float> logits = {0.3f, 0.1f, 0.2f, 0.25f, 0.15f, 0.0f, 0.05f, 0.12f};
  SamplingParams p;
  p.seed = 77;
  // Each draw is the inverse CDF of softmax(logits), in double here, at u(seed, position).
  std::vector<int> rank(logits.size());
  for (size_t i = 0; i < rank.size(); ++i) rank[i] = static_cast<int>(i);
  std::sort(rank.begin(), rank.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  double z = 0.0;
  for (float l : logits) z += std::exp(static_cast<double>(l));
  int checked = 0;
  for (uint64_t pos = 0; pos < 100; ++pos) {
    const double u = UniformFromSeed(p.seed, pos);
    double running = 0.0;
    int want = -1;
    bool near_edge = false;
    for (int r : rank) {
      running += std::exp(static_cast<double>(logits[r])) / z;
      near_edge |= std::abs(running - u) < 1e-5;
      if (want < 0 && running > u) want = r;
    }
    if (near_edge) continue;
    ++checked;
    EXPECT_EQ(Draw(logits, p, pos), want) << "position " << pos << " u " << u;
  }
  EXPECT_GT(checked, 95);

  SamplingParams q = p;
  q.seed = 78;
  int differ = 0;
  for (uint64_t pos = 0; pos < 100; ++pos) differ += Draw(logits, p, pos) != Draw(logits, q, pos);
  EXPECT_GT(differ, 10);
  std::vector<int> counts(logits.size(), 0);
  for (uint64_t pos = 0; pos < 100; ++pos) ++counts[Draw(logits, p, pos)];
  for (size_t i = 0; i < counts.size(); ++i) EXPECT_GT(counts[i], 0) << "token " << i;
}

TEST(SamplingTest, NaNLogitIsNeverSampled) {
  SamplingParams p;
  p.seed = 3;
  for (uint64_t pos = 0; pos < 500; ++pos) EXPECT_NE(Draw({0.0f, kNaN, 0.0f}, p, pos), 1);
}

absl::Status Check(void (*mutate)(SamplingParams&)) {
  SamplingParams p;
  mutate(p);
  return ValidateSamplingParams(p, 100);
}

void ExpectRejected(void (*mutate)(SamplingParams&), const std::string& field) {
  const absl::Status s = Check(mutate);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
  EXPECT_THAT(std::string(s.message()), HasSubstr(field));
}

TEST(SamplingTest, ValidationNamesTheField) {
  EXPECT_TRUE(Check([](SamplingParams&) {}).ok());
  EXPECT_TRUE(Check([](SamplingParams& p) {
                p.temperature = 0.0f;
                p.top_k = 100;
                p.top_p = 1.0f;
                p.min_p = 1.0f;
                p.repetition_penalty = 10.0f;
                p.presence_penalty = -2.0f;
                p.frequency_penalty = 2.0f;
              }).ok());
  ExpectRejected([](SamplingParams& p) { p.temperature = -0.1f; }, "sampling.temperature");
  ExpectRejected([](SamplingParams& p) { p.temperature = kNaN; }, "sampling.temperature");
  ExpectRejected([](SamplingParams& p) { p.temperature = kInf; }, "sampling.temperature");
  ExpectRejected([](SamplingParams& p) { p.top_k = -1; }, "sampling.top_k");
  ExpectRejected([](SamplingParams& p) { p.top_k = 101; }, "sampling.top_k");
  ExpectRejected([](SamplingParams& p) { p.top_p = 0.0f; }, "sampling.top_p");
  ExpectRejected([](SamplingParams& p) { p.top_p = 1.01f; }, "sampling.top_p");
  ExpectRejected([](SamplingParams& p) { p.top_p = kNaN; }, "sampling.top_p");
  ExpectRejected([](SamplingParams& p) { p.min_p = -0.01f; }, "sampling.min_p");
  ExpectRejected([](SamplingParams& p) { p.min_p = kNaN; }, "sampling.min_p");
  ExpectRejected([](SamplingParams& p) { p.repetition_penalty = 0.0f; },
                 "sampling.repetition_penalty");
  ExpectRejected([](SamplingParams& p) { p.repetition_penalty = kInf; },
                 "sampling.repetition_penalty");
  ExpectRejected([](SamplingParams& p) { p.repetition_penalty = 10.5f; },
                 "sampling.repetition_penalty");
  ExpectRejected([](SamplingParams& p) { p.presence_penalty = 2.5f; }, "sampling.presence_penalty");
  ExpectRejected([](SamplingParams& p) { p.presence_penalty = kNaN; }, "sampling.presence_penalty");
  ExpectRejected([](SamplingParams& p) { p.frequency_penalty = -2.5f; },
                 "sampling.frequency_penalty");
}

}  // namespace
}  // namespace ts
