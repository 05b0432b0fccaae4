// Causal prefill attention over the paged cache against a double-precision CPU reference on the
// same bf16-rounded inputs. Query i of sequence s sits at position start[s] + i and attends to keys
// 0..start[s]+i, all read from the cache.
//
// Tolerance: per (token, head) row, max |got - ref| <= 2e-2 * max |ref|. Besides the bf16 output
// rounding (2^-9), the kernel feeds P to the tensor cores as bf16 (another 2^-9 per weight,
// averaging out over the keys); 2e-2 leaves margin while a wrong mask, position or head moves a row
// by O(max |ref|).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/prefill_attention.cuh"
#include "tests/kernels/attention_test_util.h"

namespace ts::kernels::testing {
namespace {

constexpr double kTol = 2e-2;
constexpr int kBlockSize = 16;

struct PrefillCase {
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
  std::vector<int32_t> q_lens;
  std::vector<int32_t> starts;
};

std::vector<double> Reference(const std::vector<float>& q, const PagedKv& kv,
                              const std::vector<int32_t>& cu, const std::vector<int32_t>& starts,
                              int num_q_heads, float scale) {
  const int d = kv.head_dim;
  const int group = num_q_heads / kv.num_kv_heads;
  std::vector<double> out(q.size(), 0.0);
  std::vector<double> p;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    for (int i = 0; i < cu[s + 1] - cu[s]; ++i) {
      const int n = starts[s] + i + 1;  // keys visible to this query
      p.assign(n, 0.0);
      for (int h = 0; h < num_q_heads; ++h) {
        const int kvh = h / group;
        const size_t row = (static_cast<size_t>(cu[s] + i) * num_q_heads + h) * d;
        double mx = -INFINITY, sum = 0;
        for (int t = 0; t < n; ++t) {
          const float* k = kv.KRow(s, kvh, t);
          double dot = 0;
          for (int e = 0; e < d; ++e) dot += static_cast<double>(q[row + e]) * k[e];
          p[t] = dot * scale;
          mx = std::max(mx, p[t]);
        }
        for (int t = 0; t < n; ++t) sum += (p[t] = std::exp(p[t] - mx));
        for (int t = 0; t < n; ++t) {
          const float* v = kv.VRow(s, kvh, t);
          for (int e = 0; e < d; ++e) out[row + e] += p[t] / sum * v[e];
        }
      }
    }
  }
  return out;
}

class PrefillHarness {
 public:
  PrefillHarness(const PrefillCase& c, uint32_t seed) : c_(c) {
    cu_.push_back(0);
    std::vector<int32_t> cached;
    for (size_t s = 0; s < c.q_lens.size(); ++s) {
      cu_.push_back(cu_.back() + c.q_lens[s]);
      cached.push_back(c.starts[s] + c.q_lens[s]);
    }
    total_ = cu_.back();
    kv_ = MakePagedKv(cached, c.num_kv_heads, kBlockSize, c.head_dim, seed);
    PoisonPastContexts(kv_, cached);  // NaN wherever no query may look
    q_ = HashedValues(static_cast<size_t>(total_) * c.num_q_heads * c.head_dim, seed + 3, 4.f);
    scale_ = 1.f / std::sqrt(static_cast<float>(c.head_dim));
    ref_ = Reference(q_, kv_, cu_, c.starts, c.num_q_heads, scale_);

    dq_ = std::make_unique<GuardedBuffer<__nv_bfloat16>>(q_.size());
    dk_ = std::make_unique<GuardedBuffer<__nv_bfloat16>>(kv_.k.size());
    dv_ = std::make_unique<GuardedBuffer<__nv_bfloat16>>(kv_.v.size());
    dtables_ = std::make_unique<GuardedBuffer<int32_t>>(kv_.tables.size());
    dcu_ = std::make_unique<GuardedBuffer<int32_t>>(cu_.size());
    dstart_ = std::make_unique<GuardedBuffer<int32_t>>(c.starts.size());
    dout_ = std::make_unique<GuardedBuffer<__nv_bfloat16>>(q_.size());
    dflag_ = std::make_unique<GuardedBuffer<int32_t>>(1);
    dflag_->Upload({0});
    dq_->Upload(ToBf16(q_));
    dk_->Upload(ToBf16(kv_.k));
    dv_->Upload(ToBf16(kv_.v));
    dtables_->Upload(kv_.tables);
    dcu_->Upload(cu_);
    dstart_->Upload(c.starts);
  }

  PrefillAttentionParams Params() const {
    PrefillAttentionParams p;
    p.q = dq_->get();
    p.k_cache = dk_->get();
    p.v_cache = dv_->get();
    p.block_tables = dtables_->get();
    p.cu_seqlens = dcu_->get();
    p.start_pos = dstart_->get();
    p.out = dout_->get();
    p.error_flag = dflag_->get();
    p.num_seqs = static_cast<int32_t>(c_.q_lens.size());
    p.total_tokens = total_;
    p.max_q_len = *std::max_element(c_.q_lens.begin(), c_.q_lens.end());
    p.num_q_heads = c_.num_q_heads;
    p.num_kv_heads = c_.num_kv_heads;
    p.head_dim = c_.head_dim;
    p.block_size = kBlockSize;
    p.num_blocks = kv_.num_blocks;
    p.max_blocks_per_seq = kv_.max_blocks_per_seq;
    p.scale = scale_;
    return p;
  }

  void Check() const {
    EXPECT_TRUE(RowsClose(FromBf16(dout_->Download()), ref_, c_.head_dim, kTol));
    EXPECT_TRUE(dout_->GuardsIntact());
    EXPECT_EQ(Flag(), 0) << "a block-table entry a query attends to was flagged invalid";
  }

  int32_t Flag() const { return dflag_->Download()[0]; }
  std::vector<float> Output() const { return FromBf16(dout_->Download()); }
  const std::vector<double>& ref() const { return ref_; }
  const std::vector<int32_t>& cu() const { return cu_; }

  // Overwrites table entry `block` of sequence `seq` on the device only.
  void SetDeviceTableEntry(int seq, int block, int32_t id) const {
    std::vector<int32_t> t = kv_.tables;
    t[static_cast<size_t>(seq) * kv_.max_blocks_per_seq + block] = id;
    dtables_->Upload(t);
  }

  void Run(int32_t num_splits = 1) const {
    dout_->Poison();
    PrefillAttentionParams p = Params();
    std::unique_ptr<GuardedBuffer<float>> partial_out, partial_lse;
    if (num_splits > 1) {
      // Poisoned: a partial the merge reads without the kernel having written it shows as NaN.
      const size_t rows = static_cast<size_t>(total_) * c_.num_q_heads * num_splits;
      partial_out = std::make_unique<GuardedBuffer<float>>(rows * c_.head_dim);
      partial_lse = std::make_unique<GuardedBuffer<float>>(rows);
      partial_out->Poison();
      partial_lse->Poison();
      p.num_splits = num_splits;
      p.partial_out = partial_out->get();
      p.partial_lse = partial_lse->get();
    }
    ASSERT_TRUE(LaunchPrefillAttention(p, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    Check();
    if (partial_out != nullptr) {
      EXPECT_TRUE(partial_out->GuardsIntact());
      EXPECT_TRUE(partial_lse->GuardsIntact());
    }
  }

  void Poison() const { dout_->Poison(); }

 private:
  PrefillCase c_;
  std::vector<int32_t> cu_;
  int32_t total_ = 0;
  PagedKv kv_;
  std::vector<float> q_;
  float scale_ = 0;
  std::vector<double> ref_;
  std::unique_ptr<GuardedBuffer<__nv_bfloat16>> dq_, dk_, dv_, dout_;
  std::unique_ptr<GuardedBuffer<int32_t>> dtables_, dcu_, dstart_, dflag_;
};

struct Heads {
  int q;
  int kv;
};

class PrefillAttentionGridTest : public ::testing::TestWithParam<std::tuple<Heads, int>> {};

TEST_P(PrefillAttentionGridTest, RaggedChunksWithCachedPrefix) {
  const auto [heads, d] = GetParam();
  // Lengths 1..100 around the 16-token block and the 64-row CTA tile; starts include 0, values
  // inside a block and a long cached prefix (several key tiles before the chunk).
  const PrefillCase c{
      heads.q, heads.kv, d, {1, 17, 64, 100, 33, 2, 65, 16}, {0, 5, 100, 0, 1000, 15, 16, 240}};
  const PrefillHarness h(c, 31 * d + heads.q);
  h.Run();
}

INSTANTIATE_TEST_SUITE_P(Shapes, PrefillAttentionGridTest,
                         ::testing::Combine(::testing::Values(Heads{4, 4}, Heads{8, 2},
                                                              Heads{32, 8}, Heads{6, 2}),
                                            ::testing::Values(16, 64, 128)),
                         [](const ::testing::TestParamInfo<std::tuple<Heads, int>>& info) {
                           const Heads h = std::get<0>(info.param);
                           return absl::StrCat("Hq", h.q, "_Hkv", h.kv, "_D",
                                               std::get<1>(info.param));
                         });

// Key splits: short chunks after long prefixes (the chunked prefill beside running streams), a
// split count that leaves some splits with no key of a row (a query early in a fresh prompt) and
// one that leaves whole splits empty for a short sequence beside a long one.
class PrefillAttentionSplitTest : public ::testing::TestWithParam<std::tuple<Heads, int, int32_t>> {
};

TEST_P(PrefillAttentionSplitTest, SplitKeysGiveTheUnsplitResult) {
  const auto [heads, d, splits] = GetParam();
  const PrefillCase c{heads.q, heads.kv, d, {64, 1, 30, 5}, {3000, 0, 700, 4}};
  const PrefillHarness h(c, 7 * d + heads.q + splits);
  h.Run(splits);
}

INSTANTIATE_TEST_SUITE_P(Shapes, PrefillAttentionSplitTest,
                         ::testing::Combine(::testing::Values(Heads{32, 8}, Heads{8, 2}),
                                            ::testing::Values(64, 128),
                                            ::testing::Values(2, 5, 16)),
                         [](const ::testing::TestParamInfo<std::tuple<Heads, int, int32_t>>& info) {
                           const Heads h = std::get<0>(info.param);
                           return absl::StrCat("Hq", h.q, "_Hkv", h.kv, "_D",
                                               std::get<1>(info.param), "_S",
                                               std::get<2>(info.param));
                         });

TEST(PrefillAttentionTest, RejectsSplitsWithoutPartials) {
  const PrefillHarness h({8, 2, 64, {40}, {500}}, 13);
  PrefillAttentionParams p = h.Params();
  p.num_splits = 4;
  TS_EXPECT_INVALID(LaunchPrefillAttention(p, nullptr), "partial_out");
  p.num_splits = 0;
  TS_EXPECT_INVALID(LaunchPrefillAttention(p, nullptr), "num_splits");
}

TEST(PrefillAttentionTest, LongChunkAfterLongPrefix) {
  const PrefillHarness h({32, 8, 128, {300, 7}, {200, 0}}, 77);
  h.Run();
}

// The engine's chunked-prefill path: a 256-token chunk after a prefix of many key tiles, split as
// PrefillAttentionSplits chooses for an H100/H200 (132 SMs) and the engine's partials.
TEST(PrefillAttentionTest, ChunkAfterLongPrefixAtTheChosenSplit) {
  for (const int d : {64, 128}) {
    SCOPED_TRACE(absl::StrCat("D ", d));
    const PrefillCase c{8, 2, d, {256}, {3000}};
    const int32_t splits = PrefillAttentionSplits(256, 256, 1, 8, 2, 3256, 132, 2048);
    ASSERT_GT(splits, 1);
    const PrefillHarness h(c, 41 + d);
    h.Run(splits);
  }
}

// A fresh prompt of many 128-row tiles and 64-key tiles: the diagonal tile at every offset, the
// unmasked tiles before it, and the longest row tiles launched first.
TEST(PrefillAttentionTest, LongFreshPrompt) {
  const PrefillHarness h({8, 2, 64, {1000, 37}, {0, 0}}, 23);
  h.Run();
}

TEST(PrefillAttentionTest, NullStartMeansFreshPrompt) {
  const PrefillCase c{8, 2, 64, {40, 3}, {0, 0}};
  const PrefillHarness h(c, 12);
  PrefillAttentionParams p = h.Params();
  p.start_pos = nullptr;
  h.Poison();
  ASSERT_TRUE(LaunchPrefillAttention(p, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  h.Check();
}

TEST(PrefillAttentionTest, CapturesIntoAGraph) {
  const PrefillHarness h({32, 8, 64, {50, 9, 1}, {3, 0, 70}}, 5);
  h.Poison();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  EXPECT_TRUE(
      RunInGraph(stream, [&](cudaStream_t s) { return LaunchPrefillAttention(h.Params(), s); }));
  h.Check();
  cudaStreamDestroy(stream);
}

// An invalid id inside sequence 0's cached prefix (an engine off-by-one): flagged, in bounds (the
// launch and the sync succeed), and sequence 1's rows unaffected. Sequence 0's are not checked.
TEST(PrefillAttentionTest, InvalidBlockWithinAPrefixIsFlagged) {
  const PrefillCase c{8, 2, 64, {20, 5}, {100, 0}};
  const PrefillHarness h(c, 17);
  for (const int32_t bad : {kInvalidKvBlock, int32_t{-1}}) {
    SCOPED_TRACE(absl::StrCat("id ", bad));
    h.SetDeviceTableEntry(0, 2, bad);
    h.Poison();
    ASSERT_TRUE(LaunchPrefillAttention(h.Params(), nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(h.Flag(), 1);
    const size_t row = static_cast<size_t>(c.num_q_heads) * c.head_dim;
    const std::vector<float> out = h.Output();
    const std::vector<float> rest(out.begin() + h.cu()[1] * row, out.end());
    const std::vector<double> ref(h.ref().begin() + h.cu()[1] * row, h.ref().end());
    EXPECT_TRUE(RowsClose(rest, ref, c.head_dim, kTol));
  }
}

TEST(PrefillAttentionTest, RejectsUnsupportedHeadDim) {
  const PrefillHarness h({8, 2, 64, {4}, {0}}, 1);
  PrefillAttentionParams p = h.Params();
  p.head_dim = 80;
  TS_EXPECT_INVALID(LaunchPrefillAttention(p, nullptr), "head_dim");
  p.head_dim = 64;
  p.block_size = 24;
  TS_EXPECT_INVALID(LaunchPrefillAttention(p, nullptr), "block_size");
}

}  // namespace
}  // namespace ts::kernels::testing
