// LaunchSiluMul over a shape grid against an fp32 emulation of transformers' bf16 rounding points
// (silu(gate) rounded to bf16, times up, rounded): >= 99% bit-identical and every element within
// 1 ulp (expf against std::exp is the only difference); and against fp64 math: two bf16
// roundings of <= 2^-8 relative each, |err| <= |ref| / 120 per element.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/rmsnorm.cuh"
#include "kernels/silu_mul.cuh"
#include "tests/kernels/kernel_test_util.h"

namespace ts::kernels {
namespace {

using testing::GuardedBuffer;

std::vector<double> Reference(const std::vector<float>& in, int rows, int inter) {
  std::vector<double> out(size_t(rows) * inter);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < inter; ++i) {
      const double g = in[size_t(r) * 2 * inter + i], u = in[size_t(r) * 2 * inter + inter + i];
      out[size_t(r) * inter + i] = g / (1.0 + std::exp(-g)) * u;
    }
  }
  return out;
}

std::vector<float> ReferenceHf(const std::vector<float>& in, int rows, int inter) {
  using testing::RoundBf16;
  std::vector<float> out(size_t(rows) * inter);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < inter; ++i) {
      const float g = in[size_t(r) * 2 * inter + i], u = in[size_t(r) * 2 * inter + inter + i];
      out[size_t(r) * inter + i] = RoundBf16(RoundBf16(g / (1.0f + std::exp(-g))) * u);
    }
  }
  return out;
}

TEST(SiluMulTest, MatchesReferenceOverShapeGrid) {
  for (int inter : {64, 1000, 2048, 4096, 14336}) {
    for (int rows : {1, 3, 17, 64}) {
      SCOPED_TRACE(::testing::Message() << "rows=" << rows << " intermediate=" << inter);
      // Gates over [-12, 12] reach both of silu's tails and the curve between.
      const auto in = testing::RandomFloats(size_t(rows) * 2 * inter, -12, 12, rows * 100 + inter);
      GuardedBuffer<__nv_bfloat16> d_in(in.size()), d_out(size_t(rows) * inter);
      d_in.Upload(testing::ToBf16(in));
      const SiluMulParams p{d_in.get(), d_out.get(), rows, inter};
      TS_ASSERT_OK(LaunchSiluMul(p, nullptr));
      TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
      const auto got = testing::FromBf16(d_out.Download());
      const auto ref = Reference(in, rows, inter);
      EXPECT_LE(testing::RelL2Error(got, ref), 5e-3);
      EXPECT_LE(testing::MaxScaledError(got, ref, 1e-6), 1.0 / 120);
      const testing::Bf16Match m = testing::CompareBf16(got, ReferenceHf(in, rows, inter));
      EXPECT_GE(m.exact_fraction, 0.99);
      EXPECT_LE(m.worst_ulps, 1);
      EXPECT_TRUE(d_out.GuardsIntact());
      EXPECT_TRUE(d_in.GuardsIntact());
    }
  }
}

TEST(SiluMulTest, CapturesInGraph) {
  constexpr int kRows = 17, kInter = 1000;
  const auto in = testing::RandomFloats(kRows * 2 * kInter, -6, 6, 99);
  GuardedBuffer<__nv_bfloat16> d_in(in.size()), d_out(kRows * kInter);
  d_in.Upload(testing::ToBf16(in));
  const SiluMulParams p{d_in.get(), d_out.get(), kRows, kInter};
  cudaStream_t stream;
  TS_ASSERT_CUDA_OK(cudaStreamCreate(&stream));
  EXPECT_TRUE(testing::RunInGraph(stream, [&](cudaStream_t s) { return LaunchSiluMul(p, s); }));
  cudaStreamDestroy(stream);
  EXPECT_LE(testing::MaxScaledError(testing::FromBf16(d_out.Download()),
                                    Reference(in, kRows, kInter), 1e-6),
            1.0 / 120);
}

// With pdl the kernel may start while the one before it runs, and must read its input only after
// griddepcontrol.wait. The one before here is an rmsnorm writing that input, poisoned (NaN) on the
// graph's stream before every replay: the outputs must equal the same graph's without pdl, bit for
// bit.
TEST(SiluMulTest, PdlReadsItsInputOnlyAfterTheWait) {
  constexpr int kRows = 1024, kInter = 8192;
  const size_t n = size_t(kRows) * 2 * kInter;
  GuardedBuffer<__nv_bfloat16> residual(n), weight(2 * kInter), in(n), out(size_t(kRows) * kInter);
  residual.Upload(testing::ToBf16(testing::RandomFloats(n, -2, 2, 31)));
  weight.Upload(testing::ToBf16(testing::RandomFloats(2 * kInter, 0.5f, 1.5f, 32)));
  cudaStream_t stream;
  TS_ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<__nv_bfloat16> want;
  for (bool pdl : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "pdl " << pdl);
    const RmsNormParams norm{.x = nullptr,
                             .residual = residual.get(),
                             .weight = weight.get(),
                             .out = in.get(),
                             .rows = kRows,
                             .hidden = 2 * kInter,
                             .eps = 1e-5f};
    SiluMulParams p{.in = in.get(), .out = out.get(), .rows = kRows, .intermediate = kInter};
    p.pdl = pdl;
    cudaGraph_t graph = nullptr;
    TS_ASSERT_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    absl::Status st = LaunchRmsNorm(norm, stream);
    if (st.ok()) st = LaunchSiluMul(p, stream);
    TS_ASSERT_CUDA_OK(cudaStreamEndCapture(stream, &graph));
    TS_ASSERT_OK(st);
    cudaGraphExec_t exec = nullptr;
    TS_ASSERT_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 10; ++replay) {
      TS_ASSERT_CUDA_OK(cudaMemsetAsync(in.get(), 0xFF, n * sizeof(__nv_bfloat16), stream));
      TS_ASSERT_CUDA_OK(cudaGraphLaunch(exec, stream));
      TS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
      const std::vector<__nv_bfloat16> got = out.Download();
      if (want.empty()) want = got;
      ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(__nv_bfloat16)), 0)
          << "replay " << replay;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
}

TEST(SiluMulTest, RejectsBadParams) {
  GuardedBuffer<__nv_bfloat16> in(2 * 64), out(64);
  const SiluMulParams good{in.get(), out.get(), 1, 64};
  SiluMulParams p = good;
  p.intermediate = 20;
  TS_EXPECT_INVALID(LaunchSiluMul(p, nullptr), "silu_mul.intermediate");
  p = good;
  p.in = nullptr;
  TS_EXPECT_INVALID(LaunchSiluMul(p, nullptr), "silu_mul.in");
  p = good;
  p.out = out.get() + 2;
  TS_EXPECT_INVALID(LaunchSiluMul(p, nullptr), "silu_mul.out");
  p = good;
  p.rows = -1;
  TS_EXPECT_INVALID(LaunchSiluMul(p, nullptr), "silu_mul.rows");
}

}  // namespace
}  // namespace ts::kernels
