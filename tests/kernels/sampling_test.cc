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
//  - penalties move the result exactly as the reference's do; update_counts counts the draw;
//    counts are uint32 (past 65535 they still penalise, and they saturate instead of wrapping);
//  - the production combination, bf16-rounded fp32 logits with a split first pass, matches the
//    reference on the rounded logits.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/philox.h"
#include "engine/cuda/sampling_row.h"
#include "kernels/sampling.cuh"
#include "models/sampling.h"
#include "tests/kernels/kernel_test_util.h"

namespace ts::kernels {
namespace {

using testing::GuardedBuffer;

constexpr float kInf = std::numeric_limits<float>::infinity();

struct RowCase {
  std::vector<float> logits;      // [vocab] what the reference reads
  std::vector<float> gpu_logits;  // [vocab] what the GPU reads, when not empty (before rounding)
  ts::SamplingParams params;
  std::vector<int32_t> prompt, output;
  uint64_t position = 0;
};

// N(0, sigma) logits; rounded to bf16 when `bf16` (as an lm_head writing bf16 would), which makes
// exact ties common.
std::vector<float> RandomLogits(int vocab, uint32_t seed, float sigma, bool bf16) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> l(vocab);
  for (float& x : l) x = bf16 ? testing::RoundBf16(d(gen)) : d(gen);
  return l;
}

// Prompt and output histories; the output draws from a small set so counts exceed 1.
void RandomHistory(RowCase& c, int vocab, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> any(0, vocab - 1), len(0, 40);
  c.prompt.resize(len(gen));
  for (auto& t : c.prompt) t = any(gen);
  std::vector<int32_t> pool(8);
  for (auto& t : pool) t = any(gen);
  c.output.resize(len(gen));
  for (auto& t : c.output) t = pool[gen() % pool.size()];
}

int32_t CpuToken(const RowCase& c) {
  std::vector<float> l = c.logits;
  ts::ApplyPenalties(l, c.params, c.prompt, c.output);
  return ts::SampleFromLogits(l, c.params, c.position);
}

struct GpuResult {
  std::vector<int32_t> tokens;
  std::vector<uint32_t> counts;  // [num_slots, vocab] after the launch
  int32_t flag = 0;
};

struct RunOptions {
  std::vector<int32_t> slots;  // [rows]; empty = a shuffled permutation of rows
  int num_slots = 0;           // 0 = rows
  bool params_by_slot = false;
  bool update_counts = false;
  bool round_logits_to_bf16 = false;
  int split = 1;  // CTAs per row
  // {slot, token, count} written over the histories' counts (values no history could reach).
  std::vector<std::array<uint32_t, 3>> set_counts;
};

// One launch over `rows`. Slots not used by any row get random histories, so a kernel reading
// the wrong slot gets different penalties. A second launch on the same workspace (counts as
// before the first, another split) must give the same tokens: every launch leaves the workspace
// ready, and a row's passes give the same result however many CTAs share them.
GpuResult RunGpu(const std::vector<RowCase>& rows, int vocab, RunOptions o = {}) {
  const int n = static_cast<int>(rows.size());
  if (o.num_slots == 0) o.num_slots = n;
  if (o.slots.empty()) {
    o.slots.resize(n);
    std::iota(o.slots.begin(), o.slots.end(), 0);
    std::shuffle(o.slots.begin(), o.slots.end(), std::mt19937(n * 31 + vocab));
  }
  const int words = (vocab + 31) / 32;
  std::vector<float> logits(size_t(n) * vocab);
  std::vector<SamplingRow> params(o.params_by_slot ? o.num_slots : n);
  std::vector<uint32_t> counts(size_t(o.num_slots) * vocab);
  std::vector<uint32_t> mask(size_t(o.num_slots) * words);
  std::mt19937 junk(12345);
  for (auto& c : counts) c = junk() % 3;
  for (auto& m : mask) m = junk();
  std::vector<char> reset(o.num_slots, 0);
  for (int r = 0; r < n; ++r) {
    const RowCase& c = rows[r];
    const std::vector<float>& l = c.gpu_logits.empty() ? c.logits : c.gpu_logits;
    std::copy(l.begin(), l.end(), logits.begin() + size_t(r) * vocab);
    const int s = o.slots[r];
    if (s < 0 || s >= o.num_slots) continue;
    params[o.params_by_slot ? s : r] = ToSamplingRow(c.params, c.position);
    if (!reset[s]) {  // rows may share a slot when they only read it
      reset[s] = 1;
      std::fill_n(counts.begin() + size_t(s) * vocab, vocab, 0);
      std::fill_n(mask.begin() + size_t(s) * words, words, 0u);
      for (int32_t t : c.output) ++counts[size_t(s) * vocab + t];
      for (int32_t t : c.prompt) mask[size_t(s) * words + t / 32] |= 1u << (t % 32);
    }
  }
  for (const auto& [slot, token, count] : o.set_counts)
    counts[size_t(slot) * vocab + token] = count;
  GuardedBuffer<float> d_logits(logits.size());
  GuardedBuffer<SamplingRow> d_params(params.size());
  GuardedBuffer<int32_t> d_slots(n), d_tokens(n), d_flag(1);
  GuardedBuffer<uint32_t> d_counts(counts.size());
  GuardedBuffer<uint32_t> d_mask(mask.size());
  d_logits.Upload(logits);
  d_params.Upload(params);
  d_slots.Upload(o.slots);
  d_counts.Upload(counts);
  d_mask.Upload(mask);
  d_flag.Upload({0});
  SamplingKernelParams p;
  p.logits = d_logits.get();
  p.params = d_params.get();
  p.row_slots = d_slots.get();
  p.output_counts = d_counts.get();
  p.prompt_mask = d_mask.get();
  p.tokens = d_tokens.get();
  p.error_flag = d_flag.get();
  p.rows = n;
  p.vocab = vocab;
  p.num_slots = o.num_slots;
  p.params_by_slot = o.params_by_slot;
  p.update_counts = o.update_counts;
  p.round_logits_to_bf16 = o.round_logits_to_bf16;
  // Zero, as the engine's arena memset leaves it.
  GuardedBuffer<uint8_t> d_ws(SamplingWorkspaceBytes(n, vocab));
  d_ws.Upload(std::vector<uint8_t>(d_ws.size(), 0));
  p.split = o.split;
  p.workspace = d_ws.get();
  p.workspace_bytes = d_ws.size();
  GpuResult res;
  const absl::Status st = LaunchSampling(p, nullptr);
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  res.tokens = d_tokens.Download();
  res.counts = d_counts.Download();
  res.flag = d_flag.Download()[0];
  for (int32_t t : res.tokens) EXPECT_TRUE(t >= 0 && t < vocab) << "token " << t;
  d_counts.Upload(counts);
  d_tokens.Poison();
  p.split = o.split == 1 ? 6 : 1;  // and tokens do not depend on the split
  EXPECT_TRUE(LaunchSampling(p, nullptr).ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(d_tokens.Download(), res.tokens) << "a second launch on the workspace differs";
  EXPECT_TRUE(d_ws.GuardsIntact());
  EXPECT_TRUE(d_tokens.GuardsIntact());
  EXPECT_TRUE(d_counts.GuardsIntact());
  EXPECT_TRUE(d_logits.GuardsIntact());
  return res;
}

ts::SamplingParams Params(float t, int k, float p, float min_p, uint64_t seed) {
  ts::SamplingParams s;
  s.temperature = t;
  s.top_k = k;
  s.top_p = p;
  s.min_p = min_p;
  s.seed = seed;
  return s;
}

void AddPenalties(ts::SamplingParams& s) {
  s.repetition_penalty = 1.3f;
  s.presence_penalty = 0.5f;
  s.frequency_penalty = 0.25f;
}

// The pipeline of models/sampling.h with fp32 scores (as both implementations form them) and
// fp64 weights and sums: the kept ranks and their running sums.
struct Exact {
  std::vector<int> order;   // rank -> id, by (score desc, id asc)
  std::vector<int> rank;    // id -> rank
  std::vector<double> w;    // [top-k ranks] exp(s_r - s_0)
  std::vector<double> cum;  // [kept] running sums of w
  double total = 0;         // sum of the kept w
};

Exact ComputeExact(const RowCase& c) {
  std::vector<float> l = c.logits;
  ts::ApplyPenalties(l, c.params, c.prompt, c.output);
  const int vocab = static_cast<int>(l.size());
  std::vector<float> s(vocab);
  for (int i = 0; i < vocab; ++i) {
    const float x = l[i] / c.params.temperature;
    s[i] = std::isnan(x) ? -kInf : std::min(x, std::numeric_limits<float>::max());
  }
  Exact e;
  e.order.resize(vocab);
  std::iota(e.order.begin(), e.order.end(), 0);
  std::stable_sort(e.order.begin(), e.order.end(), [&](int a, int b) { return s[a] > s[b]; });
  e.rank.resize(vocab);
  for (int r = 0; r < vocab; ++r) e.rank[e.order[r]] = r;
  const int k = c.params.top_k > 0 && c.params.top_k < vocab ? c.params.top_k : vocab;
  double w_total = 0;
  for (int r = 0; r < k; ++r) {
    e.w.push_back(std::exp(double(s[e.order[r]]) - s[e.order[0]]));
    w_total += e.w.back();
  }
  int kept = k;
  if (c.params.top_p < 1.0f) {
    double run = 0;
    for (int r = 0; r < k; ++r) {
      run += e.w[r];
      if (run >= double(c.params.top_p) * w_total) {
        kept = r + 1;
        break;
      }
    }
  }
  if (c.params.min_p > 0.0f) {
    int m = 1;
    while (m < kept && e.w[m] >= c.params.min_p) ++m;
    kept = m;
  }
  for (int r = 0; r < kept; ++r) e.cum.push_back(e.total += e.w[r]);
  return e;
}

// Probabilities after all filters, [vocab].
std::vector<double> ExpectedProbs(const RowCase& c) {
  const Exact e = ComputeExact(c);
  std::vector<double> prob(e.order.size(), 0.0);
  for (size_t r = 0; r < e.cum.size(); ++r) prob[e.order[r]] = e.w[r] / e.total;
  return prob;
}

// How far `token`'s slice [C_{r-1}, C_r) of the fp64 running sums lies from the draw point
// u * S, over S: 0 when it contains it. The kernel's draws sit at 0 up to its 2^-32 fixed point.
double DrawDistance(const RowCase& c, int32_t token) {
  const Exact e = ComputeExact(c);
  const double target = double(UniformFromSeed(c.params.seed, c.position)) * e.total;
  const size_t r = e.rank[token];
  const double lo = r == 0 ? 0.0 : r <= e.cum.size() ? e.cum[r - 1] : e.total;
  const double hi = r < e.cum.size() ? e.cum[r] : lo;
  const double d = target < lo ? lo - target : target >= hi ? target - hi : 0.0;
  return d / e.total;
}

// Greedy (and top-k 1) must match the reference exactly; a draw must sit at the draw point, and
// where the reference disagrees its token must be within its fp32 rounding of the point.
// Returns whether the reference token differs.
bool ExpectSameDraw(const RowCase& c, int32_t gpu, const std::string& where) {
  const int32_t cpu = CpuToken(c);
  if (c.params.temperature == 0.0f || c.params.top_k == 1) {
    EXPECT_EQ(gpu, cpu) << where;
    return false;
  }
  EXPECT_LE(DrawDistance(c, gpu), 1e-4) << where << ": gpu token " << gpu;
  if (gpu == cpu) return false;
  EXPECT_LE(DrawDistance(c, cpu), 1e-3) << where << ": cpu token " << cpu << " gpu " << gpu;
  return true;
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

// Eight rows with every feature in play, vocab 128256, bf16 logits.
std::vector<RowCase> MixedRows(int vocab) {
  std::vector<RowCase> rows(8);
  const ts::SamplingParams kinds[] = {
      Params(0.0f, 0, 1.0f, 0.0f, 1),    Params(1.0f, 50, 1.0f, 0.0f, 2),
      Params(0.8f, 0, 0.9f, 0.0f, 3),    Params(1.0f, 0, 1.0f, 0.1f, 4),
      Params(0.7f, 40, 0.95f, 0.05f, 5), Params(1.2f, 0, 1.0f, 0.0f, 6),
      Params(1.0f, 1000, 0.8f, 0.0f, 7), Params(0.0f, 0, 1.0f, 0.0f, 8)};
  for (int r = 0; r < 8; ++r) {
    rows[r].logits = RandomLogits(vocab, 500 + r, 2.5f, true);
    rows[r].params = kinds[r];
    if (r >= 5) AddPenalties(rows[r].params);
    rows[r].position = 1000 * r + 17;
    RandomHistory(rows[r], vocab, 900 + r);
  }
  return rows;
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

// TS_EMPIRICAL_DRAWS lowers the draws for compute-sanitizer's racecheck, under which 8 launches
// of 20000 rows outlast any timeout (> 540 s on the H200); the tolerance follows the count.
int EmpiricalDraws() {
  const char* v = std::getenv("TS_EMPIRICAL_DRAWS");
  return v != nullptr && std::atoi(v) > 0 ? std::atoi(v) : 20000;
}

TEST(SamplingTest, EmpiricalDistributionMatchesFilters) {
  constexpr int kVocab = 16;
  const int kDraws = EmpiricalDraws();
  // Ties at 1.5 (ids 1, 2) and at 0.7 (ids 4, 5, 6) put top-k cuts inside groups of equals.
  const std::vector<float> logits = {2.0f, 1.5f,  1.5f,  1.0f,  0.7f,  0.7f,  0.7f,  0.3f,
                                     0.0f, -0.5f, -1.0f, -1.0f, -2.0f, -3.0f, -5.0f, -kInf};
  struct Config {
    const char* name;
    ts::SamplingParams p;
    bool penalties;
  };
  std::vector<Config> configs = {
      {"plain", Params(1.0f, 0, 1.0f, 0.0f, 0), false},
      {"top_k=5 (cut at the first of 3 ties)", Params(0.7f, 5, 1.0f, 0.0f, 0), false},
      {"top_k=6 (cut at the second of 3 ties)", Params(0.7f, 6, 1.0f, 0.0f, 0), false},
      {"top_k=2 (cut inside a pair)", Params(1.0f, 2, 1.0f, 0.0f, 0), false},
      {"top_p=0.8", Params(1.0f, 0, 0.8f, 0.0f, 0), false},
      {"min_p=0.3", Params(1.2f, 0, 1.0f, 0.3f, 0), false},
      {"all filters", Params(0.9f, 12, 0.95f, 0.05f, 0), false},
      {"penalties", Params(1.0f, 0, 1.0f, 0.0f, 0), true},
  };
  for (const Config& cfg : configs) {
    SCOPED_TRACE(cfg.name);
    RowCase base;
    base.logits = logits;
    base.params = cfg.p;
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
}

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

TEST(SamplingTest, UpdateCountsIncrementsTheDrawnToken) {
  constexpr int kVocab = 5000;
  const auto rows = MixedRows(kVocab);
  RunOptions o;
  o.slots = {3, 0, 6, 1, 7, 2, 4, 5};
  o.num_slots = 8;
  const auto before = RunGpu(rows, kVocab, o);  // counts unchanged: update_counts off
  o.update_counts = true;
  const auto after = RunGpu(rows, kVocab, o);
  EXPECT_EQ(after.tokens, before.tokens);
  for (int r = 0; r < 8; ++r) {
    for (int t = 0; t < kVocab; ++t) {
      const size_t i = size_t(o.slots[r]) * kVocab + t;
      ASSERT_EQ(after.counts[i], before.counts[i] + (t == after.tokens[r] ? 1 : 0))
          << "row " << r << " token " << t;
    }
  }
}

TEST(SamplingTest, BadSlotIsFlaggedNotFatal) {
  constexpr int kVocab = 300;
  auto rows = MixedRows(kVocab);
  rows.resize(2);
  RunOptions o;
  o.slots = {1, 9};  // 9 is outside the pool
  o.num_slots = 2;
  const auto res = RunGpu(rows, kVocab, o);
  EXPECT_EQ(res.flag, 1);
  EXPECT_EQ(res.tokens[0], CpuToken(rows[0]));
}

// A row's CTAs wait for each other between passes. Two launches at once (as the engine's decode
// and prefill heads run) with more CTAs than the GPU holds, half its SMs' worth of split each:
// both must finish (a hang fails by the test's timeout), with the tokens of one launch alone.
TEST(SamplingTest, ConcurrentLaunchesWithMoreCtasThanTheGpuHoldsFinish) {
  constexpr int kVocab = 128256, kRows = 8;
  int num_sms = 0;
  TS_ASSERT_CUDA_OK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
  const int split = std::max(1, std::min(kSamplingMaxSplit, num_sms / 2));
  const auto rows = MixedRows(kVocab);
  std::vector<float> logits;
  std::vector<SamplingRow> params;
  for (const RowCase& c : rows) {
    logits.insert(logits.end(), c.logits.begin(), c.logits.end());
    ts::SamplingParams sp = c.params;
    sp.repetition_penalty = 1.0f, sp.presence_penalty = 0.0f, sp.frequency_penalty = 0.0f;
    params.push_back(ToSamplingRow(sp, c.position));
  }
  GuardedBuffer<float> d_logits(logits.size());
  GuardedBuffer<SamplingRow> d_params(kRows);
  GuardedBuffer<int32_t> d_slots(kRows), d_tokens_a(kRows), d_tokens_b(kRows);
  GuardedBuffer<uint32_t> d_counts(size_t(kRows) * kVocab);
  GuardedBuffer<uint32_t> d_mask(size_t(kRows) * ((kVocab + 31) / 32));
  GuardedBuffer<uint8_t> d_ws_a(SamplingWorkspaceBytes(kRows, kVocab));
  GuardedBuffer<uint8_t> d_ws_b(SamplingWorkspaceBytes(kRows, kVocab));
  d_logits.Upload(logits);
  d_params.Upload(params);
  d_slots.Upload({0, 1, 2, 3, 4, 5, 6, 7});
  d_counts.Upload(std::vector<uint32_t>(d_counts.size(), 0));
  d_mask.Upload(std::vector<uint32_t>(d_mask.size(), 0));
  d_ws_a.Upload(std::vector<uint8_t>(d_ws_a.size(), 0));
  d_ws_b.Upload(std::vector<uint8_t>(d_ws_b.size(), 0));
  SamplingKernelParams p;
  p.logits = d_logits.get();
  p.params = d_params.get();
  p.row_slots = d_slots.get();
  p.output_counts = d_counts.get();
  p.prompt_mask = d_mask.get();
  p.rows = kRows;
  p.vocab = kVocab;
  p.num_slots = kRows;
  p.split = split;
  cudaStream_t sa, sb;
  TS_ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking));
  TS_ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking));
  for (int rep = 0; rep < 20; ++rep) {
    SamplingKernelParams a = p, b = p;
    a.tokens = d_tokens_a.get(), a.workspace = d_ws_a.get(), a.workspace_bytes = d_ws_a.size();
    b.tokens = d_tokens_b.get(), b.workspace = d_ws_b.get(), b.workspace_bytes = d_ws_b.size();
    ASSERT_TRUE(LaunchSampling(a, sa).ok());
    ASSERT_TRUE(LaunchSampling(b, sb).ok());
  }
  TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
  cudaStreamDestroy(sa);
  cudaStreamDestroy(sb);
  const auto a = d_tokens_a.Download(), b = d_tokens_b.Download();
  EXPECT_EQ(a, b);
  RunOptions alone;
  alone.slots = {0, 1, 2, 3, 4, 5, 6, 7};
  alone.split = split;
  std::vector<RowCase> plain = rows;
  for (RowCase& c : plain) {
    c.prompt.clear(), c.output.clear();
    c.params.repetition_penalty = 1.0f, c.params.presence_penalty = 0.0f;
    c.params.frequency_penalty = 0.0f;
  }
  EXPECT_EQ(RunGpu(plain, kVocab, alone).tokens, a);
}

TEST(SamplingTest, CapturesInGraph) {
  constexpr int kVocab = 4096, kRows = 3;
  const auto rows = MixedRows(kVocab);
  std::vector<float> logits;
  std::vector<SamplingRow> params;
  for (int r = 0; r < kRows; ++r) {
    logits.insert(logits.end(), rows[r].logits.begin(), rows[r].logits.end());
    ts::SamplingParams sp = rows[r].params;
    sp.repetition_penalty = 1.0f, sp.presence_penalty = 0.0f, sp.frequency_penalty = 0.0f;
    params.push_back(ToSamplingRow(sp, rows[r].position));
  }
  GuardedBuffer<float> d_logits(logits.size());
  GuardedBuffer<SamplingRow> d_params(kRows);
  GuardedBuffer<int32_t> d_slots(kRows), d_tokens(kRows);
  GuardedBuffer<uint32_t> d_counts(size_t(kRows) * kVocab);
  GuardedBuffer<uint32_t> d_mask(size_t(kRows) * kVocab / 32);
  d_logits.Upload(logits);
  d_params.Upload(params);
  d_slots.Upload({0, 1, 2});
  d_counts.Upload(std::vector<uint32_t>(d_counts.size(), 0));
  d_mask.Upload(std::vector<uint32_t>(d_mask.size(), 0));
  SamplingKernelParams p;
  p.logits = d_logits.get();
  p.params = d_params.get();
  p.row_slots = d_slots.get();
  p.output_counts = d_counts.get();
  p.prompt_mask = d_mask.get();
  p.tokens = d_tokens.get();
  p.rows = kRows;
  p.vocab = kVocab;
  p.num_slots = kRows;
  GuardedBuffer<uint8_t> d_ws(SamplingWorkspaceBytes(kRows, kVocab));
  d_ws.Upload(std::vector<uint8_t>(d_ws.size(), 0));
  p.workspace = d_ws.get();
  p.workspace_bytes = d_ws.size();
  p.split = 4;
  cudaStream_t stream;
  TS_ASSERT_CUDA_OK(cudaStreamCreate(&stream));
  EXPECT_TRUE(testing::RunInGraph(stream, [&](cudaStream_t s) { return LaunchSampling(p, s); }));
  cudaStreamDestroy(stream);
  const auto tokens = d_tokens.Download();
  for (int r = 0; r < kRows; ++r) {
    RowCase c = rows[r];
    c.prompt.clear();
    c.output.clear();
    ExpectSameDraw(c, tokens[r], "row " + std::to_string(r));
  }
}

TEST(SamplingTest, RejectsBadParams) {
  GuardedBuffer<float> logits(64);
  GuardedBuffer<SamplingRow> params(1);
  GuardedBuffer<int32_t> slots(1), tokens(1);
  GuardedBuffer<uint32_t> counts(64);
  GuardedBuffer<uint32_t> mask(2);
  SamplingKernelParams good;
  good.logits = logits.get();
  good.params = params.get();
  good.row_slots = slots.get();
  good.output_counts = counts.get();
  good.prompt_mask = mask.get();
  good.tokens = tokens.get();
  good.rows = 1;
  good.vocab = 64;
  good.num_slots = 1;
  GuardedBuffer<uint8_t> ws(SamplingWorkspaceBytes(2, 64));
  good.workspace = ws.get();
  good.workspace_bytes = SamplingWorkspaceBytes(1, 64);
  SamplingKernelParams p = good;
  p.vocab = 0;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.vocab");
  p = good;
  p.vocab = kSamplingMaxVocab + 1;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.vocab");
  p = good;
  p.num_slots = 0;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.num_slots");
  p = good;
  p.logits = nullptr;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.logits");
  p = good;
  p.tokens = nullptr;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.tokens");
  p = good;
  p.prompt_mask = nullptr;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.prompt_mask");
  p = good;
  p.rows = -2;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.rows");
  p = good;
  p.split = kSamplingMaxSplit + 1;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.split");
  p = good;
  p.workspace = nullptr;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.workspace");
  p = good;
  p.workspace = ws.get() + 16;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.workspace");
  p = good;
  p.rows = 2;  // the workspace holds one row's state
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.workspace_bytes");
  TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(tokens.GuardsIntact());
}

}  // namespace
}  // namespace ts::kernels
