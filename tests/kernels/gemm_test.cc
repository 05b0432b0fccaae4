// Gemm (cuBLASLt bf16, fp32 accumulate) against an fp64 CPU product of the same bf16 inputs, over
// M in {1, 3, 17, 64} x (N, K) from tiny to 8B-sized. Tolerance: the output's bf16 rounding,
// |err| <= 2^-8 |ref| + 1e-3 rms(ref) per element (the rms term absorbs fp32 accumulation error
// on outputs that cancel to near zero), and ||err|| / ||ref|| <= 5e-3.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels/gemm.cuh"
#include "tests/kernels/kernel_test_util.h"

namespace ts::kernels {
namespace {

using testing::ExpectGemmCloseBf16;
using testing::GuardedBuffer;

std::vector<double> Reference(const std::vector<float>& a, const std::vector<float>& w,
                              const std::vector<float>* c0, int m, int n, int k) {
  std::vector<double> c(size_t(m) * n);
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double acc = c0 ? (*c0)[size_t(i) * n + j] : 0.0;
      const float* ar = a.data() + size_t(i) * k;
      const float* wr = w.data() + size_t(j) * k;
      for (int t = 0; t < k; ++t) acc += double(ar[t]) * wr[t];
      c[size_t(i) * n + j] = acc;
    }
  }
  return c;
}

struct Problem {
  int m, n, k;
  std::vector<float> a, w, c0;
  GuardedBuffer<__nv_bfloat16> da, dw, dc;
  Problem(int m_, int n_, int k_, uint32_t seed)
      : m(m_),
        n(n_),
        k(k_),
        a(testing::RandomFloats(size_t(m) * k, -1, 1, seed)),
        w(testing::RandomFloats(size_t(n) * k, -1, 1, seed + 1)),
        c0(testing::RandomFloats(size_t(m) * n, -4, 4, seed + 2)),
        da(a.size()),
        dw(w.size()),
        dc(c0.size()) {
    da.Upload(testing::ToBf16(a));
    dw.Upload(testing::ToBf16(w));
  }
  GemmParams Params(bool accumulate) const {
    return GemmParams{da.get(), dw.get(), dc.get(), m, n, k, accumulate};
  }
};

std::unique_ptr<Gemm> MakeGemm() {
  auto g = Gemm::Create();
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? std::move(*g) : nullptr;
}

TEST(GemmTest, MatchesReferenceOverShapeGrid) {
  auto gemm = MakeGemm();
  ASSERT_NE(gemm, nullptr);
  // (N, K): tiny, odd multiples of 8 both ways, and Llama-3-8B's o_proj / a q-slice.
  const std::vector<std::pair<int, int>> nk = {{64, 64}, {1000, 2048}, {2048, 1000}, {4096, 4096}};
  for (const auto& [n, k] : nk) {
    for (int m : {1, 3, 17, 64}) {
      SCOPED_TRACE(::testing::Message() << "m=" << m << " n=" << n << " k=" << k);
      TS_ASSERT_OK(gemm->Plan(GemmShape{m, n, k}));
      Problem pr(m, n, k, m * 17 + n + k);
      TS_ASSERT_OK(gemm->Launch(pr.Params(false), nullptr));
      TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
      ExpectGemmCloseBf16(testing::FromBf16(pr.dc.Download()),
                          Reference(pr.a, pr.w, nullptr, m, n, k));
      EXPECT_TRUE(pr.dc.GuardsIntact());
    }
  }
}

TEST(GemmTest, AccumulateAddsIntoC) {
  auto gemm = MakeGemm();
  ASSERT_NE(gemm, nullptr);
  for (int m : {1, 17}) {
    Problem pr(m, 2048, 1000, 77 + m);
    TS_ASSERT_OK(gemm->Plan(GemmShape{m, 2048, 1000}));
    pr.dc.Upload(testing::ToBf16(pr.c0));
    TS_ASSERT_OK(gemm->Launch(pr.Params(true), nullptr));
    TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<double> product = Reference(pr.a, pr.w, nullptr, m, 2048, 1000);
    ExpectGemmCloseBf16(testing::FromBf16(pr.dc.Download()),
                        Reference(pr.a, pr.w, &pr.c0, m, 2048, 1000), &product);
    EXPECT_TRUE(pr.dc.GuardsIntact());
  }
}

TEST(GemmTest, CapturesInGraphAndIsDeterministic) {
  auto gemm = MakeGemm();
  ASSERT_NE(gemm, nullptr);
  Problem pr(17, 4096, 4096, 5);
  TS_ASSERT_OK(gemm->Plan(GemmShape{17, 4096, 4096}));
  cudaStream_t stream;
  TS_ASSERT_CUDA_OK(cudaStreamCreate(&stream));
  const GemmParams p = pr.Params(false);
  EXPECT_TRUE(testing::RunInGraph(stream, [&](cudaStream_t s) { return gemm->Launch(p, s); }));
  const auto first = pr.dc.Download();
  ExpectGemmCloseBf16(testing::FromBf16(first), Reference(pr.a, pr.w, nullptr, 17, 4096, 4096));
  pr.dc.Poison();
  TS_ASSERT_OK(gemm->Launch(p, stream));
  TS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
  const auto second = pr.dc.Download();
  EXPECT_EQ(0, std::memcmp(first.data(), second.data(), first.size() * sizeof(first[0])));
  cudaStreamDestroy(stream);
}

TEST(GemmTest, RejectsBadParamsAndUnplannedShapes) {
  auto gemm = MakeGemm();
  ASSERT_NE(gemm, nullptr);
  TS_EXPECT_INVALID(gemm->Plan(GemmShape{1, 12, 64}), "gemm.n");
  TS_EXPECT_INVALID(gemm->Plan(GemmShape{1, 64, 60}), "gemm.k");
  TS_EXPECT_INVALID(gemm->Plan(GemmShape{0, 64, 64}), "gemm.m");
  Problem pr(3, 64, 64, 9);
  GemmParams p = pr.Params(false);
  const absl::Status unplanned = gemm->Launch(p, nullptr);
  EXPECT_EQ(unplanned.code(), absl::StatusCode::kFailedPrecondition) << unplanned;
  TS_ASSERT_OK(gemm->Plan(GemmShape{3, 64, 64}));
  EXPECT_TRUE(gemm->IsPlanned(GemmShape{3, 64, 64}));
  p.a = nullptr;
  TS_EXPECT_INVALID(gemm->Launch(p, nullptr), "gemm.a");
  p = pr.Params(false);
  p.w = pr.dw.get() + 4;
  TS_EXPECT_INVALID(gemm->Launch(p, nullptr), "gemm.w");
  p = pr.Params(false);
  p.n = 60;
  TS_EXPECT_INVALID(gemm->Launch(p, nullptr), "gemm.n");
  TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(pr.dc.GuardsIntact());
}

}  // namespace
}  // namespace ts::kernels
