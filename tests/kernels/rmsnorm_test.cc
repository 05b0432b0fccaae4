// LaunchRmsNorm against a CPU reference: the bf16 residual add is bit-exact (same fp32 add, same
// rounding). The normalised output is compared twice:
//   - with an fp32 emulation of transformers' bf16 LlamaRMSNorm (round x * inv_rms to bf16, then
//     weight * that): >= 99% bit-identical, every element within 1 ulp (rsqrtf and the summation
//     order are the only fp32 differences);
//   - with fp64 math: two bf16 roundings of <= 2^-8 relative each, |err| <= |ref| / 120.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/rmsnorm.cuh"
#include "tests/kernels/kernel_test_util.h"

namespace ts::kernels {
namespace {

using testing::GuardedBuffer;
using testing::RoundBf16;

constexpr double kMaxRelErr = 1.0 / 120;

struct Ref {
  std::vector<float> residual;  // bf16 values after the add
  std::vector<double> out;
  std::vector<float> out_hf;  // transformers' bf16 rounding points, fp32 math
};

Ref Reference(const std::vector<float>& x, const std::vector<float>& residual,
              const std::vector<float>& w, int rows, int hidden, float eps, bool add) {
  Ref ref{residual, std::vector<double>(residual.size()), std::vector<float>(residual.size())};
  for (int r = 0; r < rows; ++r) {
    float* res = ref.residual.data() + size_t(r) * hidden;
    double sum_sq = 0;
    for (int i = 0; i < hidden; ++i) {
      if (add) res[i] = RoundBf16(res[i] + x[size_t(r) * hidden + i]);
      sum_sq += double(res[i]) * res[i];
    }
    const double inv = 1.0 / std::sqrt(sum_sq / hidden + eps);
    const float inv_f = static_cast<float>(inv);
    for (int i = 0; i < hidden; ++i) {
      const size_t e = size_t(r) * hidden + i;
      ref.out[e] = res[i] * inv * w[i];
      ref.out_hf[e] = RoundBf16(RoundBf16(w[i]) * RoundBf16(res[i] * inv_f));
    }
  }
  return ref;
}

struct Buffers {
  GuardedBuffer<__nv_bfloat16> x, residual, weight, out;
  Buffers(int rows, int hidden)
      : x(size_t(rows) * hidden),
        residual(size_t(rows) * hidden),
        weight(hidden),
        out(size_t(rows) * hidden) {}
};

void RunCase(int rows, int hidden, bool add, bool out_aliases_x) {
  SCOPED_TRACE(::testing::Message() << "rows=" << rows << " hidden=" << hidden << " add=" << add
                                    << " alias=" << out_aliases_x);
  const uint32_t seed = rows * 7919 + hidden * 31 + add;
  const auto x = testing::RandomFloats(size_t(rows) * hidden, -2, 2, seed);
  const auto residual = testing::RandomFloats(size_t(rows) * hidden, -3, 3, seed + 1);
  const auto w = testing::RandomFloats(hidden, 0.5f, 1.5f, seed + 2);
  const float eps = 1e-5f;
  Buffers b(rows, hidden);
  b.x.Upload(testing::ToBf16(x));
  b.residual.Upload(testing::ToBf16(residual));
  b.weight.Upload(testing::ToBf16(w));
  RmsNormParams p;
  p.x = add ? b.x.get() : nullptr;
  p.residual = b.residual.get();
  p.weight = b.weight.get();
  p.out = out_aliases_x ? b.x.get() : b.out.get();
  p.rows = rows;
  p.hidden = hidden;
  p.eps = eps;
  TS_ASSERT_OK(LaunchRmsNorm(p, nullptr));
  TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());

  const Ref ref = Reference(x, residual, w, rows, hidden, eps, add);
  const auto got_res = testing::FromBf16(b.residual.Download());
  for (size_t i = 0; i < got_res.size(); ++i) {
    ASSERT_EQ(got_res[i], ref.residual[i]) << "residual element " << i;
  }
  const auto got = testing::FromBf16((out_aliases_x ? b.x : b.out).Download());
  EXPECT_LE(testing::RelL2Error(got, ref.out), 5e-3);
  EXPECT_LE(testing::MaxScaledError(got, ref.out, 1e-6), kMaxRelErr);
  const testing::Bf16Match m = testing::CompareBf16(got, ref.out_hf);
  EXPECT_GE(m.exact_fraction, 0.99);
  EXPECT_LE(m.worst_ulps, 1);
  EXPECT_TRUE(b.x.GuardsIntact());
  EXPECT_TRUE(b.residual.GuardsIntact());
  EXPECT_TRUE(b.out.GuardsIntact());
  if (!out_aliases_x) {
    b.out.Poison();  // next launch must write every element again
  }
}

TEST(RmsNormTest, FusedAddMatchesReferenceOverShapeGrid) {
  for (int hidden : {64, 1000, 2048, 4096, 8192}) {
    for (int rows : {1, 3, 17, 64}) RunCase(rows, hidden, /*add=*/true, /*out_aliases_x=*/false);
  }
}

TEST(RmsNormTest, NormOnlyMatchesReference) {
  for (int hidden : {64, 1000, 4096}) {
    for (int rows : {1, 17}) RunCase(rows, hidden, /*add=*/false, /*out_aliases_x=*/false);
  }
}

TEST(RmsNormTest, OutMayAliasX) {
  RunCase(17, 2048, /*add=*/true, /*out_aliases_x=*/true);
}

TEST(RmsNormTest, LargestHidden) {
  RunCase(3, kRmsNormMaxHidden, true, false);
}

TEST(RmsNormTest, CapturesInGraph) {
  constexpr int kRows = 3, kHidden = 4096;
  const auto x = testing::RandomFloats(kRows * kHidden, -2, 2, 5);
  const auto residual = testing::RandomFloats(kRows * kHidden, -2, 2, 6);
  const auto w = testing::RandomFloats(kHidden, 0.5f, 1.5f, 8);
  Buffers b(kRows, kHidden);
  b.x.Upload(testing::ToBf16(x));
  b.residual.Upload(testing::ToBf16(residual));
  b.weight.Upload(testing::ToBf16(w));
  const RmsNormParams p{b.x.get(), b.residual.get(), b.weight.get(), b.out.get(),
                        kRows,     kHidden,          1e-6f};
  cudaStream_t stream;
  TS_ASSERT_CUDA_OK(cudaStreamCreate(&stream));
  EXPECT_TRUE(testing::RunInGraph(stream, [&](cudaStream_t s) { return LaunchRmsNorm(p, s); }));
  cudaStreamDestroy(stream);
  const Ref ref = Reference(x, residual, w, kRows, kHidden, 1e-6f, true);
  EXPECT_LE(testing::MaxScaledError(testing::FromBf16(b.out.Download()), ref.out, 1e-6),
            kMaxRelErr);
}

// With pdl the kernel may start while the one before it runs, and must read x and residual only
// after griddepcontrol.wait. Here the one before is a large rmsnorm that writes this one's x; x is
// poisoned (NaN) on the graph's stream before every replay, so a read before the wait shows as a
// wrong output. The outputs must equal the same graph's without pdl, bit for bit.
TEST(RmsNormTest, PdlReadsItsInputsOnlyAfterTheWait) {
  constexpr int kRows = 8192, kHidden = 4096;  // several waves of CTAs
  const size_t n = size_t(kRows) * kHidden;
  GuardedBuffer<__nv_bfloat16> x0(n), res0(n), w0(kHidden), mid(n), res1(n), w1(kHidden), out(n);
  x0.Upload(testing::ToBf16(testing::RandomFloats(n, -2, 2, 21)));
  const std::vector<__nv_bfloat16> residual0 = testing::ToBf16(testing::RandomFloats(n, -2, 2, 22));
  const std::vector<__nv_bfloat16> residual1 = testing::ToBf16(testing::RandomFloats(n, -2, 2, 23));
  w0.Upload(testing::ToBf16(testing::RandomFloats(kHidden, 0.5f, 1.5f, 24)));
  w1.Upload(testing::ToBf16(testing::RandomFloats(kHidden, 0.5f, 1.5f, 25)));
  cudaStream_t stream;
  TS_ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<__nv_bfloat16> want;
  for (bool pdl : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "pdl " << pdl);
    const RmsNormParams first{.x = x0.get(),
                              .residual = res0.get(),
                              .weight = w0.get(),
                              .out = mid.get(),
                              .rows = kRows,
                              .hidden = kHidden,
                              .eps = 1e-5f};
    RmsNormParams second{.x = mid.get(),
                         .residual = res1.get(),
                         .weight = w1.get(),
                         .out = out.get(),
                         .rows = kRows,
                         .hidden = kHidden,
                         .eps = 1e-5f};
    second.pdl = pdl;
    cudaGraph_t graph = nullptr;
    TS_ASSERT_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    absl::Status st = LaunchRmsNorm(first, stream);
    if (st.ok()) st = LaunchRmsNorm(second, stream);
    TS_ASSERT_CUDA_OK(cudaStreamEndCapture(stream, &graph));
    TS_ASSERT_OK(st);
    cudaGraphExec_t exec = nullptr;
    TS_ASSERT_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 10; ++replay) {
      // Both residuals are updated in place, so each replay starts from the same ones.
      TS_ASSERT_CUDA_OK(cudaMemcpyAsync(res0.get(), residual0.data(), n * sizeof(__nv_bfloat16),
                                        cudaMemcpyHostToDevice, stream));
      TS_ASSERT_CUDA_OK(cudaMemcpyAsync(res1.get(), residual1.data(), n * sizeof(__nv_bfloat16),
                                        cudaMemcpyHostToDevice, stream));
      TS_ASSERT_CUDA_OK(cudaMemsetAsync(mid.get(), 0xFF, n * sizeof(__nv_bfloat16), stream));
      TS_ASSERT_CUDA_OK(cudaGraphLaunch(exec, stream));
      TS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
      const std::vector<__nv_bfloat16> got = out.Download();
      if (want.empty()) want = got;
      ASSERT_EQ(std::memcmp(got.data(), want.data(), n * sizeof(__nv_bfloat16)), 0)
          << "replay " << replay;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
}

TEST(RmsNormTest, RejectsBadParams) {
  Buffers b(2, 64);
  const RmsNormParams good{b.x.get(), b.residual.get(), b.weight.get(), b.out.get(), 2, 64, 1e-6f};
  RmsNormParams p = good;
  p.hidden = 60;
  TS_EXPECT_INVALID(LaunchRmsNorm(p, nullptr), "rmsnorm.hidden");
  p = good;
  p.hidden = kRmsNormMaxHidden + 8;
  TS_EXPECT_INVALID(LaunchRmsNorm(p, nullptr), "rmsnorm.hidden");
  p = good;
  p.eps = 0.0f;
  TS_EXPECT_INVALID(LaunchRmsNorm(p, nullptr), "rmsnorm.eps");
  p = good;
  p.eps = std::nanf("");
  TS_EXPECT_INVALID(LaunchRmsNorm(p, nullptr), "rmsnorm.eps");
  p = good;
  p.out = p.residual;
  TS_EXPECT_INVALID(LaunchRmsNorm(p, nullptr), "rmsnorm.out");
  p = good;
  p.weight = nullptr;
  TS_EXPECT_INVALID(LaunchRmsNorm(p, nullptr), "rmsnorm.weight");
  p = good;
  p.x = b.x.get() + 4;  // 8 bytes off
  TS_EXPECT_INVALID(LaunchRmsNorm(p, nullptr), "rmsnorm.x");
  p = good;
  p.rows = -3;
  TS_EXPECT_INVALID(LaunchRmsNorm(p, nullptr), "rmsnorm.rows");
}

}  // namespace
}  // namespace ts::kernels
