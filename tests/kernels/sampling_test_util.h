// Helpers of the sampling kernel's tests (sampling_test.cc, sampling_launch_test.cc,
// sampling_ids_test.cc): rows with the reference sampler's inputs, one launch through RunGpu, the
// fp64 evaluation of the pipeline a draw is judged by, and device buffers for a launch.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
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

namespace ts::kernels::sampling_test {

using testing::GuardedBuffer;

inline constexpr float kInf = std::numeric_limits<float>::infinity();

struct RowCase {
  std::vector<float> logits;      // [vocab] what the reference reads
  std::vector<float> gpu_logits;  // [vocab] what the GPU reads, when not empty (before rounding)
  ts::SamplingParams params;
  std::vector<int32_t> prompt, output;
  uint64_t position = 0;
};

// N(0, sigma) logits; rounded to bf16 when `bf16` (as an lm_head writing bf16 would), which makes
// exact ties common.
inline std::vector<float> RandomLogits(int vocab, uint32_t seed, float sigma, bool bf16) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> l(vocab);
  for (float& x : l) x = bf16 ? testing::RoundBf16(d(gen)) : d(gen);
  return l;
}

// Prompt and output histories; the output draws from a small set so counts exceed 1.
inline void RandomHistory(RowCase& c, int vocab, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> any(0, vocab - 1), len(0, 40);
  c.prompt.resize(len(gen));
  for (auto& t : c.prompt) t = any(gen);
  std::vector<int32_t> pool(8);
  for (auto& t : pool) t = any(gen);
  c.output.resize(len(gen));
  for (auto& t : c.output) t = pool[gen() % pool.size()];
}

inline int32_t CpuToken(const RowCase& c) {
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
inline GpuResult RunGpu(const std::vector<RowCase>& rows, int vocab, RunOptions o = {}) {
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

inline ts::SamplingParams Params(float t, int k, float p, float min_p, uint64_t seed) {
  ts::SamplingParams s;
  s.temperature = t;
  s.top_k = k;
  s.top_p = p;
  s.min_p = min_p;
  s.seed = seed;
  return s;
}

inline void AddPenalties(ts::SamplingParams& s) {
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

inline Exact ComputeExact(const RowCase& c) {
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

// How far `token`'s slice [C_{r-1}, C_r) of the fp64 running sums lies from the draw point
// u * S, over S: 0 when it contains it. The kernel's draws sit at 0 up to its 2^-32 fixed point.
inline double DrawDistance(const RowCase& c, int32_t token) {
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
inline bool ExpectSameDraw(const RowCase& c, int32_t gpu, const std::string& where) {
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

// Eight rows with every feature in play, vocab 128256, bf16 logits.
inline std::vector<RowCase> MixedRows(int vocab) {
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

// Device buffers for one launch over rows x vocab logits with every slot's history empty (zero
// counts, an empty prompt mask) and a zeroed workspace, as the engine's arena leaves it; row r
// reads slot r. `Launch` points a launch at them.
struct SamplingBuffers {
  SamplingBuffers(const std::vector<float>& host_logits,
                  const std::vector<SamplingRow>& host_params, int rows, int vocab)
      : rows(rows),
        vocab(vocab),
        logits(host_logits.size()),
        params(host_params.size()),
        slots(rows),
        tokens(rows),
        counts(size_t(rows) * vocab),
        mask(size_t(rows) * ((vocab + 31) / 32)),
        workspace(SamplingWorkspaceBytes(rows, vocab)) {
    logits.Upload(host_logits);
    params.Upload(host_params);
    std::vector<int32_t> ids(rows);
    std::iota(ids.begin(), ids.end(), 0);
    slots.Upload(ids);
    counts.Upload(std::vector<uint32_t>(counts.size(), 0));
    mask.Upload(std::vector<uint32_t>(mask.size(), 0));
    workspace.Upload(std::vector<uint8_t>(workspace.size(), 0));
  }

  SamplingKernelParams Launch(int split) const {
    SamplingKernelParams p;
    p.logits = logits.get();
    p.params = params.get();
    p.row_slots = slots.get();
    p.output_counts = counts.get();
    p.prompt_mask = mask.get();
    p.tokens = tokens.get();
    p.rows = rows;
    p.vocab = vocab;
    p.num_slots = rows;
    p.split = split;
    p.workspace = workspace.get();
    p.workspace_bytes = workspace.size();
    return p;
  }

  const int rows, vocab;
  GuardedBuffer<float> logits;        // [rows, vocab]
  GuardedBuffer<SamplingRow> params;  // [rows]
  GuardedBuffer<int32_t> slots;       // [rows] 0, 1, ...
  GuardedBuffer<int32_t> tokens;      // [rows]
  GuardedBuffer<uint32_t> counts;     // [rows, vocab]
  GuardedBuffer<uint32_t> mask;       // [rows, ceil(vocab / 32)]
  GuardedBuffer<uint8_t> workspace;
};

}  // namespace ts::kernels::sampling_test
