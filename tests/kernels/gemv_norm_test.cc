// The GEMV's RMSNorm (GemvParams::norm_weight) against transformers' LlamaRMSNorm followed by the
// fp64 product: at m <= 8 the prologue that normalises A in every CTA; at m > 8 the sums of squares
// one GEMV leaves (sumsq_out) and the next one's normalisation from them (a_sumsq), alone and
// chained behind PDL as the decode step runs them. Tolerances as in gemv_test.cc.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels/gemv.cuh"
#include "tests/kernels/gemv_test_util.h"
#include "tests/kernels/kernel_test_util.h"

namespace ts::kernels {
namespace {

using namespace gemv_test;  // NOLINT(build/namespaces): the shared fixtures

TEST(GemvTest, NormPrologueMatchesRmsNormThenGemv) {
  // Llama-1B qkv and gate_up, 8B qkv, odd sizes, and the largest k the shared memory takes at m=8.
  for (const auto& [n, k] : std::vector<std::pair<int, int>>{
           {3072, 2048}, {16384, 2048}, {6144, 4096}, {24, 40}, {1000, 520}, {64, 8192}}) {
    const Weights wt(n, k, n + 5 * k);
    const auto nw = testing::RandomFloats(k, 0.5f, 1.5f, k);
    GuardedBuffer<__nv_bfloat16> dnw(k);
    dnw.Upload(testing::ToBf16(nw));
    for (int m : {1, 3, 8}) {
      ASSERT_TRUE(GemvCanFuseNorm(m, k));
      Problem pr(wt, m, m * 7 + n);
      const std::vector<double> ref =
          Reference(NormalizedA(pr.a, nw, m, k, 1e-5f), wt.w, nullptr, m, n, k);
      for (int split : {0, 1}) {
        SCOPED_TRACE(::testing::Message()
                     << "m=" << m << " n=" << n << " k=" << k << " split_k=" << split);
        GemvParams p = pr.Params(split);
        p.norm_weight = dnw.get();
        p.norm_eps = 1e-5f;
        pr.dc.Poison();
        TS_ASSERT_OK(LaunchGemv(p, nullptr));
        TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
        ExpectGemmCloseBf16(testing::FromBf16(pr.dc.Download()), ref);
        EXPECT_TRUE(pr.dc.GuardsIntact());
      }
    }
  }
}

// Each row's stored values (after the bf16 rounding and the residual add) per group of 32 columns,
// at every split, for both epilogues that may leave them; n that ends inside a group.
TEST(GemvTest, SumSqOutMatchesTheStoredRows) {
  for (const auto& [n, k] : std::vector<std::pair<int, int>>{
           {2048, 2048}, {4096, 4096}, {1000, 520}, {24, 40}, {200, 136}}) {
    const Weights wt(n, k, 3 * n + k);
    for (int m : {9, 12, 16}) {
      if (!Affordable(m, n, k)) continue;
      Problem pr(wt, m, m + 2 * n);
      GuardedBuffer<float> ss(size_t(m) * GemvSumSqGroups(n));
      for (bool accumulate : {false, true}) {
        for (int split : Splits(m, n, k)) {
          SCOPED_TRACE(::testing::Message()
                       << "m=" << m << " n=" << n << " k=" << k << " accumulate=" << accumulate
                       << " split_k=" << split);
          GemvParams p = pr.Params(split, false, accumulate);
          p.sumsq_out = ss.get();
          pr.dc.Upload(testing::ToBf16(pr.c0));
          ss.Poison();
          TS_ASSERT_OK(LaunchGemv(p, nullptr));
          TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
          const std::vector<float> c = testing::FromBf16(pr.dc.Download());
          const std::vector<float> want = RowSumSq(c, m, n), got = ss.Download();
          for (size_t e = 0; e < want.size(); ++e) {
            // 32 fp32 products and sums: a few ulps of the total.
            ASSERT_LE(std::fabs(got[e] - want[e]), 1e-5 * want[e] + 1e-30) << "group " << e;
          }
          ASSERT_TRUE(ss.GuardsIntact());
        }
      }
    }
  }
}

// The decode step's pair at 9-16 rows: a GEMV adds into h and leaves h's sums of squares, the next
// normalises h from them (pdl, captured in a graph and replayed with h and the sums poisoned
// before each replay), against RMSNorm of that h then the fp64 product. Every split of both.
TEST(GemvTest, NormFromTheProducersSumSqMatchesRmsNormThenGemv) {
  cudaStream_t stream;
  TS_ASSERT_CUDA_OK(cudaStreamCreate(&stream));
  // (hidden, n): Llama-1B o -> qkv, 8B o -> qkv, odd sizes.
  for (const auto& [hidden, n] : std::vector<std::pair<int, int>>{
           {2048, 3072}, {4096, 6144}, {520, 1000}, {40, 24}, {136, 200}}) {
    const Weights w1(hidden, hidden, hidden + 1), w2(n, hidden, n + hidden);
    const auto nw = testing::RandomFloats(hidden, 0.5f, 1.5f, hidden + 2);
    GuardedBuffer<__nv_bfloat16> dnw(hidden);
    dnw.Upload(testing::ToBf16(nw));
    for (int m : {9, 16}) {
      if (!Affordable(2 * m, n, hidden)) continue;
      Problem h(w1, m, m * 5 + hidden);  // A of the first GEMV, and h = its C
      GuardedBuffer<float> ss(size_t(m) * GemvSumSqGroups(hidden));
      GuardedBuffer<__nv_bfloat16> out(size_t(m) * n);
      std::vector<float> h_first;  // the first GEMV's output, the same bits every launch
      std::vector<double> ref;
      for (int split : Splits(m, n, hidden)) {
        SCOPED_TRACE(::testing::Message()
                     << "hidden=" << hidden << " n=" << n << " m=" << m << " split_k=" << split);
        GemvParams first = h.Params(ChooseGemvSplitK(m, hidden, hidden, NumSms()), false, true);
        first.sumsq_out = ss.get();
        first.pdl = true;
        GemvParams second;
        second.a = h.dc.get();
        second.w = w2.dw.get();
        second.c = out.get();
        second.m = m;
        second.n = n;
        second.k = hidden;
        second.norm_weight = dnw.get();
        second.norm_eps = 1e-5f;
        second.a_sumsq = ss.get();
        second.split_k = split;
        second.pdl = true;
        cudaGraphExec_t exec = InstantiatePair(first, second, stream);
        ASSERT_NE(exec, nullptr);
        for (int r = 0; r < 2; ++r) {
          h.dc.Upload(testing::ToBf16(h.c0));
          ss.Poison();
          out.Poison();
          TS_ASSERT_CUDA_OK(cudaGraphLaunch(exec, stream));
          TS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
          const std::vector<float> hv = testing::FromBf16(h.dc.Download());
          if (ref.empty()) {
            h_first = hv;
            ref = Reference(NormalizedA(hv, nw, m, hidden, 1e-5f), w2.w, nullptr, m, n, hidden);
          }
          ASSERT_EQ(std::memcmp(hv.data(), h_first.data(), hv.size() * sizeof(float)), 0);
          ExpectGemmCloseBf16(testing::FromBf16(out.Download()), ref);
        }
        cudaGraphExecDestroy(exec);
        EXPECT_TRUE(out.GuardsIntact());
        EXPECT_TRUE(ss.GuardsIntact());
      }
    }
  }
  cudaStreamDestroy(stream);
}

TEST(GemvTest, SumSqParamsAreChecked) {
  const Weights wt(64, 64, 9);
  Problem small(wt, 3, 10), big(wt, 12, 11);
  GuardedBuffer<__nv_bfloat16> nw(64);
  GuardedBuffer<float> ss(size_t(12) * GemvSumSqGroups(64));
  auto with = [&](const Problem& pr, auto&& edit) {
    GemvParams q = pr.Params(1);
    edit(q);
    return LaunchGemv(q, nullptr);
  };
  auto norm = [&](GemvParams& q) {
    q.norm_weight = nw.get();
    q.a_sumsq = ss.get();
  };
  TS_ASSERT_OK(with(big, norm));
  TS_ASSERT_OK(with(big, [&](GemvParams& q) { q.sumsq_out = ss.get(); }));
  TS_ASSERT_OK(with(big, [&](GemvParams& q) {
    q.epilogue = GemvEpilogue::kAccumulate;
    q.sumsq_out = ss.get();
  }));
  // m > 8 normalises only from the sums of squares; m <= 8 neither takes nor leaves them.
  TS_EXPECT_INVALID(with(big, [&](GemvParams& q) { q.norm_weight = nw.get(); }),
                    "gemv.norm_weight");
  TS_EXPECT_INVALID(with(big, [&](GemvParams& q) { q.a_sumsq = ss.get(); }), "gemv.a_sumsq");
  TS_EXPECT_INVALID(with(small, norm), "gemv.a_sumsq");
  TS_EXPECT_INVALID(with(small, [&](GemvParams& q) { q.sumsq_out = ss.get(); }), "gemv.sumsq_out");
  TS_EXPECT_INVALID(with(big,
                         [&](GemvParams& q) {
                           norm(q);
                           q.a_sumsq = reinterpret_cast<const float*>(
                               reinterpret_cast<const char*>(ss.get()) + 2);
                         }),
                    "gemv.a_sumsq");
  TS_EXPECT_INVALID(with(big,
                         [&](GemvParams& q) {
                           q.epilogue = GemvEpilogue::kSiluMul;
                           q.n = 32;
                           q.sumsq_out = ss.get();
                         }),
                    "gemv.sumsq_out");
  TS_EXPECT_INVALID(with(big,
                         [&](GemvParams& q) {
                           q.c = nullptr;
                           q.c_f32 = big.dc32.get();
                           q.sumsq_out = ss.get();
                         }),
                    "gemv.sumsq_out");
  TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(ss.GuardsIntact());
  EXPECT_TRUE(big.dc.GuardsIntact());
}

}  // namespace
}  // namespace ts::kernels
