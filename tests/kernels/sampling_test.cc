// LaunchSampling against the CPU reference sampler (models/sampling.h):
//  - greedy is exact (bf16-derived logits, so ties at the max are common; NaN/inf rows);
//  - seeded draws land where an fp64 evaluation of the pipeline puts u * S (DrawDistance); the
//    reference's token may differ only where its sequential fp32 sums cannot resolve the draw
//    (flat distributions over 128K tokens: its rounding there is the size of one weight), and
//    then it must be within 1e-3 * S of it too; small vocabularies agree token for token;
//  - a row's token does not depend on the other rows of the launch, nor on the run;
//  - over many seeds, token frequencies on a small vocab match the probabilities after
//    top-k/top-p/min-p (computed here in fp64) within 4.5 sigma, and filtered-out tokens never
//    appear;
//  - penalties move the result exactly as the reference's do; counts are uint32 (past 65535 they
//    still penalise, and they saturate instead of wrapping);
//  - the production combination, bf16-rounded fp32 logits with a split first pass, matches the
//    reference on the rounded logits.
// How a launch behaves (counts it updates, bad slots, concurrent launches, graphs, bad params):
// sampling_launch_test.cc.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "tests/common/sanitizer.h"
#include "tests/kernels/sampling_test_util.h"

namespace ts::kernels {
namespace {

using namespace sampling_test;

// Probabilities after all filters, [vocab].
std::vector<double> ExpectedProbs(const RowCase& c) {
  const Exact e = ComputeExact(c);
  std::vector<double> prob(e.order.size(), 0.0);
  for (size_t r = 0; r < e.cum.size(); ++r) prob[e.order[r]] = e.w[r] / e.total;
  return prob;
}

TEST(SamplingTest, GreedyMatchesCpuExactly) {
  for (int vocab : {1, 7, 1000, 32000, 128256}) {
    for (int n : {1, 3, 17, 64}) {
      SCOPED_TRACE(::testing::Message() << "vocab=" << vocab << " rows=" << n);
      std::vector<RowCase> rows(n);
      for (int r = 0; r < n; ++r) {
        RowCase& c = rows[r];
        c.logits = RandomLogits(vocab, vocab + r, 3.0f, /*bf16=*/true);
        c.params = Params(0.0f, 0, 1.0f, 0.0f, r);
        c.position = 100 + r;
        RandomHistory(c, vocab, r * 7 + vocab);
        if (r % 2 == 1) AddPenalties(c.params);
        if (r % 4 == 2 && vocab > 4) {  // a tie at the max: the lowest id wins
          const float mx = *std::max_element(c.logits.begin(), c.logits.end());
          c.logits[vocab - 1] = c.logits[vocab / 2] = c.logits[vocab / 3] = mx + 1.0f;
        }
        if (r % 8 == 3 && vocab > 4) {  // NaN never wins; +inf does
          c.logits[0] = std::nanf("");
          c.logits[vocab - 2] = kInf;
        }
        if (r % 16 == 5) std::fill(c.logits.begin(), c.logits.end(), -kInf);  // token 0
      }
      for (int split : {1, 5, kSamplingMaxSplit}) {
        RunOptions o;
        o.split = split;
        const auto gpu = RunGpu(rows, vocab, o);
        for (int r = 0; r < n; ++r) {
          EXPECT_EQ(gpu.tokens[r], CpuToken(rows[r])) << "row " << r << " split " << split;
        }
      }
    }
  }
}

// A bf16 model's logits: values that differ only below bf16 precision are one value, so the
// greedy tie goes to the lowest id (as torch.argmax over transformers' bf16 logits), while the
// same fp32 logits without rounding pick the larger one.
TEST(SamplingTest, RoundsLogitsToBf16WhenAsked) {
  constexpr int kVocab = 1000;
  RowCase c;
  c.logits = RandomLogits(kVocab, 77, 3.0f, /*bf16=*/true);
  c.params = Params(0.0f, 0, 1.0f, 0.0f, 1);
  const float top = testing::RoundBf16(*std::max_element(c.logits.begin(), c.logits.end()) + 1);
  c.logits[300] = top;
  c.logits[700] = top * (1.0f + 1.0f / 1024);  // rounds back to `top` in bf16
  ASSERT_EQ(testing::RoundBf16(c.logits[700]), top);
  RunOptions rounded;
  rounded.round_logits_to_bf16 = true;
  EXPECT_EQ(RunGpu({c}, kVocab).tokens[0], 700);
  EXPECT_EQ(RunGpu({c}, kVocab, rounded).tokens[0], 300);
  // Sampling reads the rounded values too: with top-k 2 over two equal bf16 logits the draw
  // lands on either of them, never elsewhere.
  c.params = Params(1.0f, 2, 1.0f, 0.0f, 5);
  const int32_t t = RunGpu({c}, kVocab, rounded).tokens[0];
  EXPECT_TRUE(t == 300 || t == 700) << t;
}

TEST(SamplingTest, SeededDrawsAgreeWithCpu) {
  int total = 0, mismatches = 0;
  for (int vocab : {7, 1000, 32000, 128256}) {
    for (bool bf16 : {false, true}) {
      std::vector<RowCase> rows(64);
      std::mt19937 gen(vocab + bf16);
      for (int r = 0; r < 64; ++r) {
        RowCase& c = rows[r];
        c.logits = RandomLogits(vocab, vocab * 3 + r + bf16, 3.0f, bf16);
        const float temps[] = {0.3f, 0.7f, 1.0f, 1.5f};
        const int ks[] = {0, 0, 1, 5, 50, vocab / 2};
        const float ps[] = {1.0f, 1.0f, 0.9f, 0.5f};
        const float min_ps[] = {0.0f, 0.0f, 0.05f};
        c.params = Params(temps[gen() % 4], ks[gen() % 6], ps[gen() % 4], min_ps[gen() % 3],
                          gen() | (uint64_t(gen()) << 32));
        c.position = gen() % 100000;
        RandomHistory(c, vocab, r + vocab);
        if (r % 3 == 0) AddPenalties(c.params);
      }
      RunOptions o;
      o.split = bf16 ? 4 : 32;
      const auto gpu = RunGpu(rows, vocab, o);
      for (int r = 0; r < 64; ++r) {
        ++total;
        const bool differs =
            ExpectSameDraw(rows[r], gpu.tokens[r],
                           "vocab=" + std::to_string(vocab) + " bf16=" + std::to_string(bf16) +
                               " row " + std::to_string(r));
        mismatches += differs;
        if (vocab <= 16) {
          EXPECT_FALSE(differs) << "small vocab, row " << r;
        }
      }
    }
  }
  RecordProperty("cpu_token_differs", mismatches);
  std::printf("seeded draws: reference token differs in %d of %d (all within its rounding)\n",
              mismatches, total);
}

// A walk completes from the elements of its level-0 bin (a quarter octave of scores), gathered
// into a list of up to 32,768; a row whose scores all share one bin overflows it, and the walk
// completes from the whole row instead. Scores in [4, 5): one bin. In bf16 they are 32 values,
// so every cut also falls inside a group of thousands of ties.
TEST(SamplingTest, DrawsWhenOneBinHoldsTheWholeRow) {
  constexpr int kVocab = 128256;
  for (bool bf16 : {false, true}) {
    std::mt19937 gen(bf16 ? 11 : 12);
    std::uniform_real_distribution<float> d(4.0f, 5.0f);
    std::vector<RowCase> rows(12);
    for (int r = 0; r < 12; ++r) {
      RowCase& c = rows[r];
      c.logits.resize(kVocab);
      for (float& l : c.logits) l = bf16 ? testing::RoundBf16(d(gen)) : d(gen);
      const int ks[] = {0, 20000, 0, 100000};
      const float ps[] = {1.0f, 1.0f, 0.9f, 0.6f};
      c.params = Params(1.0f, ks[r % 4], ps[r % 4], r % 3 == 2 ? 0.8f : 0.0f,
                        gen() | (uint64_t(gen()) << 32));
      c.position = gen() % 100000;
    }
    for (int split : {1, 32}) {
      RunOptions o;
      o.split = split;
      const auto gpu = RunGpu(rows, kVocab, o);
      for (int r = 0; r < 12; ++r) {
        ExpectSameDraw(rows[r], gpu.tokens[r],
                       "bf16=" + std::to_string(bf16) + " split=" + std::to_string(split) +
                           " row " + std::to_string(r));
      }
    }
  }
}

std::vector<float> RoundedToBf16(const std::vector<float>& v) {
  std::vector<float> out(v.size());
  std::transform(v.begin(), v.end(), out.begin(), testing::RoundBf16);
  return out;
}

// The production combination (EnqueueSampleAndPost in engine/cuda/cuda_model_forward.cc): fp32
// lm_head logits read rounded to bf16, the passes split over num_sms / rows CTAs (1..32),
// padding rows sampling greedily from a scratch slot past the live ones, penalties and seeds.
// The reference samples the same logits rounded to bf16 on the host. Every row's max is a bf16
// near-tie between two ids in different slices (the higher id larger in fp32): with the
// rounding the lower id ranks first, without it the higher one, so a lost rounding or a bad
// merge of the slices picks another token.
TEST(SamplingTest, Bf16RoundingWithSplitsMatchesCpuOnRoundedLogits) {
  int num_sms = 0;
  TS_ASSERT_CUDA_OK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
  int total = 0, mismatches = 0;
  for (int vocab : {32000, 50257, 128256}) {
    for (int rows : {1, 3, 8, 24, 64}) {
      const int live = rows - rows / 5;  // the rest are a bucket's padding rows
      std::mt19937 gen(vocab + rows);
      RunOptions o;
      o.num_slots = live + 1;  // as count_rows(): the last slot is the padding rows' scratch
      o.round_logits_to_bf16 = true;
      o.slots.resize(live);
      std::iota(o.slots.begin(), o.slots.end(), 0);
      std::shuffle(o.slots.begin(), o.slots.end(), gen);
      o.slots.resize(rows, live);
      std::vector<RowCase> cases(rows);
      std::vector<int32_t> lo(rows), hi(rows);
      for (int r = 0; r < rows; ++r) {
        RowCase& c = cases[r];
        c.gpu_logits = RandomLogits(vocab, vocab * 7 + r, 3.0f, /*bf16=*/false);
        lo[r] = int32_t(gen() % (vocab / 4));
        hi[r] = vocab - 1 - int32_t(gen() % (vocab / 4));
        const float top =
            testing::RoundBf16(*std::max_element(c.gpu_logits.begin(), c.gpu_logits.end()) + 1.0f);
        c.gpu_logits[lo[r]] = top;
        c.gpu_logits[hi[r]] = top * (1.0f + 1.0f / 1024);
        ASSERT_EQ(testing::RoundBf16(c.gpu_logits[hi[r]]), top);
        c.logits = RoundedToBf16(c.gpu_logits);
        c.position = gen() % 100000;
        c.params = Params(0.0f, 0, 1.0f, 0.0f, 0);  // a padding row's params
        if (r >= live) continue;
        RandomHistory(c, vocab, vocab + 13 * r);
        for (auto* h : {&c.prompt, &c.output}) {  // the tie stays unpenalised
          std::erase_if(*h, [&](int32_t t) { return t == lo[r] || t == hi[r]; });
        }
        const float temps[] = {0.5f, 0.8f, 1.0f, 1.3f};
        const int ks[] = {0, 0, 40, 1000};
        const float ps[] = {1.0f, 0.95f, 0.8f};
        const float min_ps[] = {0.0f, 0.0f, 0.02f};
        if (r % 3 != 0) {
          c.params = Params(temps[gen() % 4], ks[gen() % 4], ps[gen() % 3], min_ps[gen() % 3],
                            gen() | (uint64_t(gen()) << 32));
        }
        if (r % 4 != 3) AddPenalties(c.params);
        if (r % 4 == 1 && r % 3 != 0) {  // negative ones raise the repeated tokens
          c.params.presence_penalty = -0.4f;
          c.params.frequency_penalty = -0.1f;
        }
      }
      std::vector<int> splits = {
          std::clamp(num_sms / rows, 1, std::max(1, std::min(kSamplingMaxSplit, num_sms / 2))), 3,
          kSamplingMaxSplit};
      for (int split : splits) {
        o.split = split;
        const auto gpu = RunGpu(cases, vocab, o);
        for (int r = 0; r < rows; ++r) {
          ++total;
          mismatches +=
              ExpectSameDraw(cases[r], gpu.tokens[r],
                             "vocab=" + std::to_string(vocab) + " rows=" + std::to_string(rows) +
                                 " split=" + std::to_string(split) + " row " + std::to_string(r) +
                                 (r >= live ? " (padding)" : ""));
        }
      }
      // The same launch reading fp32 picks the higher id of each greedy row's tie: the data can
      // tell a rounded read from an unrounded one.
      o.split = splits[0];
      o.round_logits_to_bf16 = false;
      const auto raw = RunGpu(cases, vocab, o);
      for (int r = 0; r < rows; ++r) {
        if (cases[r].params.temperature != 0.0f) continue;
        EXPECT_EQ(raw.tokens[r], hi[r]) << "unrounded, vocab=" << vocab << " row " << r;
        EXPECT_EQ(CpuToken(cases[r]), lo[r]) << "reference, vocab=" << vocab << " row " << r;
      }
    }
  }
  std::printf("bf16 + split draws: reference token differs in %d of %d (all within its rounding)\n",
              mismatches, total);
}

// Counts past 65535 (a long generation repeating one token) penalise by their full value, as the
// reference's int counts do. 100 - 0.001 * 70000 = 30 < 33: B wins; a count saturated at 65535
// (100 - 65.5) or wrapped in 16 bits (70000 - 65536) would leave A the winner.
TEST(SamplingTest, CountsAbove65535KeepPenalizing) {
  constexpr int kVocab = 1000, kA = 321, kB = 654;
  RowCase c;
  c.gpu_logits = RandomLogits(kVocab, 9, 1.0f, /*bf16=*/false);
  c.gpu_logits[kA] = 100.0f;
  c.gpu_logits[kB] = 33.0f;
  c.logits = RoundedToBf16(c.gpu_logits);
  c.params = Params(0.0f, 0, 1.0f, 0.0f, 0);
  c.params.frequency_penalty = 0.001f;
  c.output.assign(70000, kA);
  c.position = 70010;
  ASSERT_EQ(CpuToken(c), kB);
  RowCase saturated = c;
  saturated.output.assign(65535, kA);
  ASSERT_EQ(CpuToken(saturated), kA) << "the data must separate 65535 from 70000";
  RowCase sampled = c;
  sampled.params.temperature = 2.0f;  // 15 vs 16.5: both tokens keep mass
  sampled.params.seed = 77;
  RunOptions o;
  o.slots = {1, 0};
  o.num_slots = 2;
  o.split = 4;
  o.round_logits_to_bf16 = true;
  const auto gpu = RunGpu({c, sampled}, kVocab, o);
  EXPECT_EQ(gpu.tokens[0], kB);
  ExpectSameDraw(sampled, gpu.tokens[1], "sampled");
  for (uint64_t seed = 0; seed < 64; ++seed) {  // and A's share of the draws is the reference's
    sampled.params.seed = seed;
    ExpectSameDraw(sampled, RunGpu({c, sampled}, kVocab, o).tokens[1],
                   "seed " + std::to_string(seed));
  }
}

// update_counts past the old uint16 limit, and saturating at UINT32_MAX instead of wrapping.
TEST(SamplingTest, UpdateCountsCrossesUint16AndSaturates) {
  constexpr int kVocab = 777;
  const uint32_t start[] = {65535u, UINT32_MAX - 1, UINT32_MAX};
  const uint32_t want[] = {65536u, UINT32_MAX, UINT32_MAX};
  std::vector<RowCase> rows(3);
  RunOptions o;
  o.update_counts = true;
  o.slots = {2, 0, 1};
  o.num_slots = 3;
  std::vector<int32_t> top(3);
  for (int r = 0; r < 3; ++r) {
    rows[r].logits = RandomLogits(kVocab, 40 + r, 2.0f, true);
    rows[r].params = Params(0.0f, 0, 1.0f, 0.0f, 0);
    top[r] = CpuToken(rows[r]);
    o.set_counts.push_back({uint32_t(o.slots[r]), uint32_t(top[r]), start[r]});
  }
  const auto gpu = RunGpu(rows, kVocab, o);
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(gpu.tokens[r], top[r]) << "row " << r;
    const uint32_t* counts = gpu.counts.data() + size_t(o.slots[r]) * kVocab;
    EXPECT_EQ(counts[top[r]], want[r]) << "row " << r << " from " << start[r];
    EXPECT_EQ(std::count(counts, counts + kVocab, 0u), kVocab - 1) << "row " << r;
  }
}

TEST(SamplingTest, RowTokenIsIndependentOfBatchAndRun) {
  constexpr int kVocab = 128256;
  const auto rows = MixedRows(kVocab);
  RunOptions o;
  o.slots = {5, 2, 7, 0, 3, 6, 1, 4};
  o.num_slots = 8;
  const auto batch = RunGpu(rows, kVocab, o);
  const auto again = RunGpu(rows, kVocab, o);
  EXPECT_EQ(batch.tokens, again.tokens);
  for (int r = 0; r < 8; ++r) {
    RunOptions alone;
    alone.slots = {r};
    alone.num_slots = 8;
    EXPECT_EQ(RunGpu({rows[r]}, kVocab, alone).tokens[0], batch.tokens[r]) << "row " << r;
    ExpectSameDraw(rows[r], batch.tokens[r], "row " + std::to_string(r));
  }
}

TEST(SamplingTest, ParamsBySlotMatchesParamsByRow) {
  constexpr int kVocab = 32000;
  const auto rows = MixedRows(kVocab);
  RunOptions o;
  o.slots = {9, 2, 7, 0, 3, 11, 1, 4};
  o.num_slots = 12;
  const auto by_row = RunGpu(rows, kVocab, o);
  o.params_by_slot = true;
  EXPECT_EQ(RunGpu(rows, kVocab, o).tokens, by_row.tokens);
}

// Fewer draws under compute-sanitizer: racecheck runs the launches of 20000 rows for longer than a
// device call (> 540 s on the H200 and the H100), and 1000 rows reach the same filter paths; the
// tolerance follows the count.
int EmpiricalDraws() {
  return ts::testing::UnderComputeSanitizer() ? 1000 : 20000;
}

struct FilterCase {
  const char* name;  // the test's name suffix
  ts::SamplingParams params;
  bool penalties;
};
void PrintTo(const FilterCase& c, std::ostream* os) {
  *os << c.name;
}

// One filter a test, so that compute-sanitizer can run them side by side: racecheck took more
// than 520 s over all eight at 1000 draws on an H100 (tests/gpu/run-bundle.sh, SANITIZE_SHARD).
class EmpiricalDistributionTest : public ::testing::TestWithParam<FilterCase> {};

TEST_P(EmpiricalDistributionTest, MatchesFilters) {
  constexpr int kVocab = 16;
  const int kDraws = EmpiricalDraws();
  // Ties at 1.5 (ids 1, 2) and at 0.7 (ids 4, 5, 6) put top-k cuts inside groups of equals.
  const std::vector<float> logits = {2.0f, 1.5f,  1.5f,  1.0f,  0.7f,  0.7f,  0.7f,  0.3f,
                                     0.0f, -0.5f, -1.0f, -1.0f, -2.0f, -3.0f, -5.0f, -kInf};
  const FilterCase& cfg = GetParam();
  RowCase base;
  base.logits = logits;
  base.params = cfg.params;
  base.position = 4242;
  if (cfg.penalties) {
    AddPenalties(base.params);
    base.prompt = {0, 9};
    base.output = {1, 1, 3};
  }
  std::vector<RowCase> rows(kDraws, base);
  for (int i = 0; i < kDraws; ++i) rows[i].params.seed = 1000003ull * i + 7;
  RunOptions o;
  o.slots.assign(kDraws, 0);  // all rows read one slot's history
  o.num_slots = 1;
  const auto gpu = RunGpu(rows, kVocab, o);
  const auto prob = ExpectedProbs(base);
  std::vector<int> hist(kVocab, 0);
  int agree = 0;
  for (int i = 0; i < kDraws; ++i) {
    ++hist[gpu.tokens[i]];
    agree += gpu.tokens[i] == CpuToken(rows[i]);
  }
  EXPECT_EQ(agree, kDraws) << "GPU and CPU tokens differ for some seeds";
  for (int t = 0; t < kVocab; ++t) {
    const double f = double(hist[t]) / kDraws, p = prob[t];
    if (p == 0) {
      EXPECT_EQ(hist[t], 0) << "filtered-out token " << t << " was drawn";
    } else {
      EXPECT_NEAR(f, p, 4.5 * std::sqrt(p * (1 - p) / kDraws) + 1e-4) << "token " << t;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Filters, EmpiricalDistributionTest,
    ::testing::Values(FilterCase{"Plain", Params(1.0f, 0, 1.0f, 0.0f, 0), false},
                      // top_k=5 and 6 cut at the first and the second of the three 0.7 ties
                      FilterCase{"TopK5", Params(0.7f, 5, 1.0f, 0.0f, 0), false},
                      FilterCase{"TopK6", Params(0.7f, 6, 1.0f, 0.0f, 0), false},
                      // top_k=2 cuts inside the 1.5 pair
                      FilterCase{"TopK2", Params(1.0f, 2, 1.0f, 0.0f, 0), false},
                      FilterCase{"TopP08", Params(1.0f, 0, 0.8f, 0.0f, 0), false},
                      FilterCase{"MinP03", Params(1.2f, 0, 1.0f, 0.3f, 0), false},
                      FilterCase{"AllFilters", Params(0.9f, 12, 0.95f, 0.05f, 0), false},
                      FilterCase{"Penalties", Params(1.0f, 0, 1.0f, 0.0f, 0), true}),
    [](const ::testing::TestParamInfo<FilterCase>& info) { return info.param.name; });

TEST(SamplingTest, PenaltiesMoveTheResultLikeTheReference) {
  constexpr int kVocab = 1000;
  RowCase c;
  c.logits = RandomLogits(kVocab, 3, 1.0f, true);
  const int32_t top =
      int32_t(std::max_element(c.logits.begin(), c.logits.end()) - c.logits.begin());
  c.logits[top] = 5.0f;  // clear winner, positive
  c.params = Params(0.0f, 0, 1.0f, 0.0f, 0);
  c.position = 10;
  const int32_t plain = RunGpu({c}, kVocab).tokens[0];
  ASSERT_EQ(plain, top);

  RowCase rep = c;  // the winner in the prompt, divided by 10
  rep.prompt = {top, 17};
  rep.params.repetition_penalty = 10.0f;
  RowCase freq = c;  // the winner generated 3 times: 5 - (0.5 + 3 * 2) < 0
  freq.output = {top, top, top, 4};
  freq.params.presence_penalty = 0.5f;
  freq.params.frequency_penalty = 2.0f;
  RowCase neg = c;  // negative logits are multiplied: the penalised one sinks further
  for (float& l : neg.logits) l = -std::fabs(l) - 0.5f;
  neg.logits[top] = -0.25f;
  neg.output = {top};
  neg.params.repetition_penalty = 4.0f;
  for (const RowCase& pc : {rep, freq, neg}) {
    const int32_t gpu = RunGpu({pc}, kVocab).tokens[0];
    EXPECT_EQ(gpu, CpuToken(pc));
    EXPECT_NE(gpu, top);
  }
  // Sampled: the penalised winner loses its mass in both implementations alike.
  std::vector<RowCase> rows;
  for (int i = 0; i < 200; ++i) {
    RowCase s = freq;
    s.params.temperature = 0.8f;
    s.params.seed = i;
    rows.push_back(s);
  }
  RunOptions o;
  o.slots.assign(rows.size(), 0);
  o.num_slots = 1;
  const auto gpu = RunGpu(rows, kVocab, o);
  for (size_t i = 0; i < rows.size(); ++i) {
    ExpectSameDraw(rows[i], gpu.tokens[i], "seed " + std::to_string(i));
    EXPECT_NE(gpu.tokens[i], top);
  }
}

}  // namespace
}  // namespace ts::kernels
