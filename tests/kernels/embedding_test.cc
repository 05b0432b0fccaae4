// LaunchEmbedding against a CPU gather: bit-exact rows over a shape grid, guards untouched,
// out-of-range ids clamped and flagged, bad params rejected, capturable in a graph.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/embedding.cuh"
#include "tests/kernels/kernel_test_util.h"

namespace ts::kernels {
namespace {

using testing::GuardedBuffer;

using testing::RandomTokens;

// Row r of `out` must equal row tokens[r] of `table` bit for bit (a copy has no rounding).
void ExpectRowsEqual(const std::vector<__nv_bfloat16>& out, const std::vector<__nv_bfloat16>& table,
                     const std::vector<int32_t>& ids, int hidden) {
  for (size_t r = 0; r < ids.size(); ++r) {
    ASSERT_EQ(0, std::memcmp(out.data() + r * hidden, table.data() + size_t(ids[r]) * hidden,
                             hidden * sizeof(__nv_bfloat16)))
        << "row " << r << " token " << ids[r];
  }
}

TEST(EmbeddingTest, MatchesGatherOverShapeGrid) {
  constexpr int kVocab = 517;
  for (int hidden : {64, 1000, 2048, 4096}) {
    const auto table =
        testing::ToBf16(testing::RandomFloats(size_t(kVocab) * hidden, -1, 1, hidden));
    GuardedBuffer<__nv_bfloat16> d_table(table.size());
    d_table.Upload(table);
    for (int rows : {1, 3, 17, 64}) {
      SCOPED_TRACE(::testing::Message() << "rows=" << rows << " hidden=" << hidden);
      const auto tokens = RandomTokens(rows, kVocab, rows * 131 + hidden);
      GuardedBuffer<int32_t> d_tokens(rows), d_flag(1);
      GuardedBuffer<__nv_bfloat16> d_out(size_t(rows) * hidden);
      d_tokens.Upload(tokens);
      d_flag.Upload({0});
      EmbeddingParams p;
      p.tokens = d_tokens.get();
      p.table = d_table.get();
      p.out = d_out.get();
      p.error_flag = d_flag.get();
      p.rows = rows;
      p.hidden = hidden;
      p.vocab = kVocab;
      TS_ASSERT_OK(LaunchEmbedding(p, nullptr));
      TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
      ExpectRowsEqual(d_out.Download(), table, tokens, hidden);
      EXPECT_EQ(d_flag.Download()[0], 0);
      EXPECT_TRUE(d_out.GuardsIntact());
      EXPECT_TRUE(d_table.GuardsIntact());
    }
  }
}

TEST(EmbeddingTest, OutOfRangeTokensAreClampedAndFlagged) {
  constexpr int kVocab = 100, kHidden = 64;
  const auto table = testing::ToBf16(testing::RandomFloats(kVocab * kHidden, -1, 1, 7));
  const std::vector<int32_t> tokens = {-5, kVocab, 3, kVocab + 1000};
  GuardedBuffer<__nv_bfloat16> d_table(table.size()), d_out(tokens.size() * kHidden);
  GuardedBuffer<int32_t> d_tokens(tokens.size()), d_flag(1);
  d_table.Upload(table);
  d_tokens.Upload(tokens);
  d_flag.Upload({0});
  EmbeddingParams p{
      d_tokens.get(), d_table.get(), d_out.get(), d_flag.get(), static_cast<int32_t>(tokens.size()),
      kHidden,        kVocab};
  TS_ASSERT_OK(LaunchEmbedding(p, nullptr));
  TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
  ExpectRowsEqual(d_out.Download(), table, {0, kVocab - 1, 3, kVocab - 1}, kHidden);
  EXPECT_EQ(d_flag.Download()[0], 1);
  EXPECT_TRUE(d_out.GuardsIntact());
  EXPECT_TRUE(d_table.GuardsIntact());
}

TEST(EmbeddingTest, CapturesInGraph) {
  constexpr int kVocab = 64, kHidden = 2048, kRows = 17;
  const auto table = testing::ToBf16(testing::RandomFloats(kVocab * kHidden, -1, 1, 3));
  const auto tokens = RandomTokens(kRows, kVocab, 11);
  GuardedBuffer<__nv_bfloat16> d_table(table.size()), d_out(kRows * kHidden);
  GuardedBuffer<int32_t> d_tokens(kRows);
  d_table.Upload(table);
  d_tokens.Upload(tokens);
  EmbeddingParams p{d_tokens.get(), d_table.get(), d_out.get(), nullptr, kRows, kHidden, kVocab};
  cudaStream_t stream;
  TS_ASSERT_CUDA_OK(cudaStreamCreate(&stream));
  EXPECT_TRUE(testing::RunInGraph(stream, [&](cudaStream_t s) { return LaunchEmbedding(p, s); }));
  cudaStreamDestroy(stream);
  ExpectRowsEqual(d_out.Download(), table, tokens, kHidden);
}

TEST(EmbeddingTest, RejectsBadParams) {
  GuardedBuffer<__nv_bfloat16> table(64 * 64), out(64);
  GuardedBuffer<int32_t> tokens(1);
  const EmbeddingParams good{tokens.get(), table.get(), out.get(), nullptr, 1, 64, 64};
  EmbeddingParams p = good;
  p.hidden = 12;
  TS_EXPECT_INVALID(LaunchEmbedding(p, nullptr), "embedding.hidden");
  p = good;
  p.vocab = 0;
  TS_EXPECT_INVALID(LaunchEmbedding(p, nullptr), "embedding.vocab");
  p = good;
  p.rows = -1;
  TS_EXPECT_INVALID(LaunchEmbedding(p, nullptr), "embedding.rows");
  p = good;
  p.table = nullptr;
  TS_EXPECT_INVALID(LaunchEmbedding(p, nullptr), "embedding.table");
  p = good;
  p.out = out.get() + 1;  // 2 bytes off: 16-byte vectors would fault
  TS_EXPECT_INVALID(LaunchEmbedding(p, nullptr), "embedding.out");
  p = good;
  p.tokens = nullptr;
  TS_EXPECT_INVALID(LaunchEmbedding(p, nullptr), "embedding.tokens");
  TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(out.GuardsIntact());
}

}  // namespace
}  // namespace ts::kernels
