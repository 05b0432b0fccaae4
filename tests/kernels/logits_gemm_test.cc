// The lm_head GEMM (kernels::LogitsGemm, kernels/logits_gemm.cuh: bf16 operands, fp32 accumulation,
// fp32 output through cuBLASLt) against an fp64 reference on the host, at the Llama-3 vocabulary
// and hidden sizes, the decode and prefill row counts, and odd sizes (an n that is not a multiple
// of 4 takes the 4-byte output alignment). The output is poisoned with NaN and guarded, so an
// unwritten or out-of-bounds element fails.
//
// Tolerance: both sides use the same bf16 inputs, so the only difference is the fp32
// accumulation. Its error is bounded by k * 2^-24 * sum_i |a_i w_i| in the worst case and is
// about sqrt(k) * 2^-24 * sum |a_i w_i| in practice; 2e-5 * sum |a_i w_i| sits above the
// practical bound at k = 4096 (3.8e-6) and far below what a wrong layout, a transposed operand or
// a row offset gives (errors of the order of the value itself).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/logits_gemm.cuh"
#include "tests/kernels/kernel_test_util.h"

namespace ts {
namespace {

using kernels::testing::GuardedBuffer;
using kernels::testing::RandomFloats;
using kernels::testing::ToBf16;

struct Shape {
  int32_t m, n, k;
};

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

TEST(LogitsGemmTest, MatchesFp64ReferenceOverAShapeGrid) {
  GuardedBuffer<char> workspace(kWorkspaceBytes);
  auto gemm = kernels::LogitsGemm::Create(workspace.get(), kWorkspaceBytes);
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  cudaStream_t stream;
  TS_ASSERT_CUDA_OK(cudaStreamCreate(&stream));
  const Shape shapes[] = {
      {1, 128256, 2048},   // 1B decode, batch 1
      {4, 128256, 4096},   // 8B decode
      {64, 128256, 2048},  // the prefill head's 64-row groups
      {3, 1001, 64},       // odd n: 4-byte output alignment
      {16, 32000, 512},
  };
  uint32_t seed = 1;
  for (const Shape& s : shapes) {
    SCOPED_TRACE(absl::StrCat("m ", s.m, " n ", s.n, " k ", s.k));
    ASSERT_TRUE((*gemm)->Plan(s.m, s.n, s.k).ok());
    const std::vector<float> a = RandomFloats(size_t(s.m) * s.k, -2.0f, 2.0f, seed++);
    const std::vector<float> w =
        RandomFloats(size_t(s.n) * s.k, -0.05f, 0.05f, seed++, true, 1e-4f);
    GuardedBuffer<__nv_bfloat16> da(a.size()), dw(w.size());
    GuardedBuffer<float> out(size_t(s.m) * s.n);
    da.Upload(ToBf16(a));
    dw.Upload(ToBf16(w));
    const absl::Status st = (*gemm)->Launch(da.get(), dw.get(), out.get(), s.m, s.n, s.k, stream);
    ASSERT_TRUE(st.ok()) << st;
    TS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
    const std::vector<float> got = out.Download();
    EXPECT_TRUE(out.GuardsIntact());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << "element " << i << " unwritten or not finite";
    }
    // Every column of the first and last rows, and random elements everywhere.
    std::vector<std::pair<int32_t, int32_t>> probes;
    for (int32_t c = 0; c < s.n; ++c) {
      probes.push_back({0, c});
      if (s.m > 1) probes.push_back({s.m - 1, c});
    }
    std::mt19937 gen(seed++);
    for (int i = 0; i < 20000; ++i) {
      probes.push_back({static_cast<int32_t>(gen() % s.m), static_cast<int32_t>(gen() % s.n)});
    }
    int64_t bad = 0;
    double worst = 0;
    for (const auto& [r, c] : probes) {
      double ref = 0, mag = 0;
      const float* ar = a.data() + size_t(r) * s.k;
      const float* wr = w.data() + size_t(c) * s.k;
      for (int32_t i = 0; i < s.k; ++i) {
        ref += static_cast<double>(ar[i]) * wr[i];
        mag += std::abs(static_cast<double>(ar[i]) * wr[i]);
      }
      const double err = std::abs(got[size_t(r) * s.n + c] - ref) / mag;
      worst = std::max(worst, err);
      if (err > 2e-5 && bad++ < 5) {
        ADD_FAILURE() << "row " << r << " col " << c << ": got " << got[size_t(r) * s.n + c]
                      << ", fp64 " << ref << " (error " << err << " of sum |a w|)";
      }
    }
    std::printf("m %d n %d k %d: %zu probes, worst error %.2e of sum |a w|\n", s.m, s.n, s.k,
                probes.size(), worst);
    EXPECT_EQ(bad, 0);
  }
  cudaStreamDestroy(stream);
}

TEST(LogitsGemmTest, UnplannedShapeIsRefused) {
  GuardedBuffer<char> workspace(kWorkspaceBytes);
  auto gemm = kernels::LogitsGemm::Create(workspace.get(), kWorkspaceBytes);
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  ASSERT_TRUE((*gemm)->Plan(2, 1024, 256).ok());
  EXPECT_EQ((*gemm)->Launch(nullptr, nullptr, nullptr, 3, 1024, 256, nullptr).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*gemm)->Plan(2, 1024, 250).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ts
