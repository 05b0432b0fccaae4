// LaunchSkinnyGemm (tensor-core GEMM for 9..128 rows, split-K through a cluster) against an fp64
// CPU product of the same bf16 inputs, over m in {9, 16, 24, 33, 64, 100, 128} x (n, k) from tiny
// and odd (n % 256 != 0, k % 64 != 0, k < 64) to Llama-1B/8B projections x split_k forced off (1),
// the heuristic's choice, and forced on (3, and 1..8 on the odd shapes, where some splits get no K
// tile at all). Tolerances as in gemv_test.cc: bf16 output |err| <= 2^-8 |ref| + 1e-3 rms(ref)
// per element and ||err|| / ||ref|| <= 5e-3; fp32 output |err| <= 1e-5 sum_t |a_t w_t| and
// ||err|| / ||ref|| <= 1e-4. Outputs start poisoned (NaN) inside guard bytes; data is random and
// never zero.
//
// The parameter and heuristic tests at the top touch no GPU (validation comes before any CUDA
// call): CMake also builds this file with TS_SKINNY_GEMM_HOST_ONLY as
// kernels_skinny_gemm_params_test, which runs them on machines without one.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kernels/skinny_gemm.cuh"
#include "tests/kernels/kernel_test_util.h"

namespace ts::kernels {
namespace {

// ---- Host-only: parameter validation and the split heuristic ----

template <typename T>
T* Fake(uintptr_t addr) {
  return reinterpret_cast<T*>(addr);  // never dereferenced: validation fails first
}

SkinnyGemmParams FakeParams() {
  SkinnyGemmParams p;
  p.a = Fake<const __nv_bfloat16>(0x10000);
  p.w = Fake<const __nv_bfloat16>(0x20000);
  p.c = Fake<__nv_bfloat16>(0x30000);
  p.m = 33;
  p.n = 1000;
  p.k = 520;
  p.split_k = 3;
  return p;
}

TEST(SkinnyGemmParamsTest, RejectsEachBadField) {
  auto with = [](auto&& edit) {
    SkinnyGemmParams p = FakeParams();
    edit(p);
    return LaunchSkinnyGemm(p, nullptr);
  };
  using P = SkinnyGemmParams;
  TS_EXPECT_INVALID(with([](P& p) { p.m = 0; }), "skinny_gemm.m");
  TS_EXPECT_INVALID(with([](P& p) { p.m = kSkinnyGemmMaxM + 1; }), "skinny_gemm.m");
  TS_EXPECT_INVALID(with([](P& p) { p.n = 0; }), "skinny_gemm.n");
  TS_EXPECT_INVALID(with([](P& p) { p.n = -3; }), "skinny_gemm.n");
  TS_EXPECT_INVALID(with([](P& p) { p.k = 0; }), "skinny_gemm.k");
  TS_EXPECT_INVALID(with([](P& p) { p.k = 60; }), "skinny_gemm.k");
  TS_EXPECT_INVALID(with([](P& p) { p.a = nullptr; }), "skinny_gemm.a");
  TS_EXPECT_INVALID(with([](P& p) { p.a = Fake<const __nv_bfloat16>(0x10008); }), "skinny_gemm.a");
  TS_EXPECT_INVALID(with([](P& p) { p.w = nullptr; }), "skinny_gemm.w");
  TS_EXPECT_INVALID(with([](P& p) { p.w = Fake<const __nv_bfloat16>(0x20004); }), "skinny_gemm.w");
  TS_EXPECT_INVALID(with([](P& p) { p.c = nullptr; }), "skinny_gemm.c");
  TS_EXPECT_INVALID(with([](P& p) { p.c_f32 = Fake<float>(0x40000); }), "skinny_gemm.c");
  TS_EXPECT_INVALID(with([](P& p) { p.c = Fake<__nv_bfloat16>(0x30001); }), "skinny_gemm.c");
  TS_EXPECT_INVALID(with([](P& p) {
                      p.c = nullptr;
                      p.c_f32 = Fake<float>(0x40002);
                    }),
                    "skinny_gemm.c_f32");
  TS_EXPECT_INVALID(with([](P& p) { p.split_k = 0; }), "skinny_gemm.split_k");
  TS_EXPECT_INVALID(with([](P& p) { p.split_k = kSkinnyGemmMaxSplitK + 1; }),
                    "skinny_gemm.split_k");
  TS_EXPECT_INVALID(with([](P& p) { p.epilogue = static_cast<SkinnyGemmEpilogue>(7); }),
                    "skinny_gemm.epilogue");
  TS_EXPECT_INVALID(with([](P& p) {
                      p.epilogue = SkinnyGemmEpilogue::kSiluMul;
                      p.c = nullptr;
                      p.c_f32 = Fake<float>(0x40000);
                    }),
                    "skinny_gemm.epilogue");
}

TEST(SkinnyGemmParamsTest, SplitHeuristicAndGeometry) {
  constexpr auto kStore = SkinnyGemmEpilogue::kStore;
  constexpr auto kSilu = SkinnyGemmEpilogue::kSiluMul;
  // Llama-3.1-8B on a 132-SM H200: qkv 24 tiles -> 5 splits (120 CTAs), o and down 16 tiles -> 8,
  // gate_up 112 tiles (plain 28672 rows or SwiGLU over 14336 columns) -> 1.
  for (int m : {9, 16, 64, 128}) {
    EXPECT_EQ(ChooseSkinnyGemmSplitK(m, 6144, 4096, kStore, 132), 5);
    EXPECT_EQ(ChooseSkinnyGemmSplitK(m, 4096, 4096, kStore, 132), 8);
    EXPECT_EQ(ChooseSkinnyGemmSplitK(m, 4096, 14336, kStore, 132), 8);
    EXPECT_EQ(ChooseSkinnyGemmSplitK(m, 28672, 4096, kStore, 132), 1);
    EXPECT_EQ(ChooseSkinnyGemmSplitK(m, 14336, 4096, kSilu, 132), 1);
  }
  // Llama-3.2-1B: qkv 12 tiles and o / down 8 -> 8 (the cluster limit), gate_up 64 -> 2.
  EXPECT_EQ(ChooseSkinnyGemmSplitK(16, 3072, 2048, kStore, 132), 8);
  EXPECT_EQ(ChooseSkinnyGemmSplitK(16, 2048, 2048, kStore, 132), 8);
  EXPECT_EQ(ChooseSkinnyGemmSplitK(16, 2048, 8192, kStore, 132), 8);
  EXPECT_EQ(ChooseSkinnyGemmSplitK(16, 16384, 2048, kStore, 132), 2);
  EXPECT_EQ(ChooseSkinnyGemmSplitK(16, 8192, 2048, kSilu, 132), 2);
  // Each split keeps >= 4 K tiles of 64: k = 520 has 9, so 2; k = 40 has 1, so none.
  EXPECT_EQ(ChooseSkinnyGemmSplitK(16, 1000, 520, kStore, 132), 2);
  EXPECT_EQ(ChooseSkinnyGemmSplitK(16, 24, 40, kStore, 132), 1);
  EXPECT_EQ(ChooseSkinnyGemmSplitK(0, 4096, 4096, kStore, 132), 1);
  EXPECT_EQ(ChooseSkinnyGemmSplitK(16, 4096, 4096, kStore, 0), 1);

  EXPECT_EQ(SkinnyGemmTiles(256, kStore), 1);
  EXPECT_EQ(SkinnyGemmTiles(257, kStore), 2);
  EXPECT_EQ(SkinnyGemmTiles(128, kSilu), 1);
  EXPECT_EQ(SkinnyGemmTiles(129, kSilu), 2);
  EXPECT_EQ(SkinnyGemmTiles(0, kStore), 0);
  // The 4 x 48 KB ring, or the reduction's receive slots where larger (split 7 at m > 112:
  // 2 owned warps x 7 sources x 16 KB).
  EXPECT_EQ(SkinnyGemmSmemBytes(128, 1), size_t{192} << 10);
  EXPECT_EQ(SkinnyGemmSmemBytes(16, 8), size_t{192} << 10);
  EXPECT_EQ(SkinnyGemmSmemBytes(128, 8), size_t{192} << 10);
  EXPECT_EQ(SkinnyGemmSmemBytes(128, 7), size_t{224} << 10);
  EXPECT_EQ(SkinnyGemmSmemBytes(112, 7), size_t{196} << 10);
}

#ifndef TS_SKINNY_GEMM_HOST_ONLY

using testing::ExpectGemmCloseBf16;
using testing::ExpectGemmCloseF32;
using testing::ExpectReplaysEqual;
using testing::GuardedBuffer;

int NumSms() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  return sms > 0 ? sms : 132;
}

// fn(j) for j in [0, n) on all cores: the fp64 reference is the slow part of this test.
template <typename Fn>
void ParallelFor(int n, Fn&& fn) {
  const int threads = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 32u));
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w) {
    pool.emplace_back([&, w] {
      for (int j = w; j < n; j += threads) fn(j);
    });
  }
  for (std::thread& t : pool) t.join();
}

// One weight and a kSkinnyGemmMaxM-row A with their fp64 product: a launch with m rows uses A's
// first m rows, so its expected output is the first m rows of `ref`.
struct Problem {
  int n, k;                        // W is [n, k] (for kSiluMul tests n = 2 x intermediate)
  std::vector<float> w, a;         // [n, k], [128, k], bf16-exact
  std::vector<double> ref, abs_s;  // [128, n]: A W^T and sum_t |a_t w_t|
  GuardedBuffer<__nv_bfloat16> dw;
  Problem(int n_, int k_, uint32_t seed)
      : n(n_),
        k(k_),
        w(testing::RandomFloats(size_t(n) * k, -1, 1, seed)),
        a(testing::RandomFloats(size_t(kSkinnyGemmMaxM) * k, -1, 1, seed + 1)),
        ref(size_t(kSkinnyGemmMaxM) * n),
        abs_s(ref.size()),
        dw(w.size()) {
    dw.Upload(testing::ToBf16(w));
    ParallelFor(n, [&](int j) {
      const float* wr = w.data() + size_t(j) * k;
      for (int i = 0; i < kSkinnyGemmMaxM; ++i) {
        const float* ar = a.data() + size_t(i) * k;
        double s[4] = {0, 0, 0, 0}, as = 0;
        for (int t = 0; t < k; t += 4) {
          for (int u = 0; u < 4 && t + u < k; ++u) {
            const double prod = double(ar[t + u]) * wr[t + u];
            s[u] += prod;
            as += std::fabs(prod);
          }
        }
        ref[size_t(i) * n + j] = s[0] + s[1] + s[2] + s[3];
        abs_s[size_t(i) * n + j] = as;
      }
    });
  }
  std::vector<double> Rows(const std::vector<double>& v, int m) const {
    return std::vector<double>(v.begin(), v.begin() + size_t(m) * n);
  }
};

// A's first m rows on the device (exactly m rows inside guards: a read past them would fetch the
// guard bytes and show) and poisoned outputs.
struct Buffers {
  int m;
  GuardedBuffer<__nv_bfloat16> da, dc;
  GuardedBuffer<float> dc32;
  Buffers(const Problem& pr, int m_, int out_cols)
      : m(m_), da(size_t(m) * pr.k), dc(size_t(m) * out_cols), dc32(size_t(m) * out_cols) {
    da.Upload(testing::ToBf16(std::vector<float>(pr.a.begin(), pr.a.begin() + size_t(m) * pr.k)));
  }
  SkinnyGemmParams Params(const Problem& pr, int split_k, bool fp32 = false,
                          SkinnyGemmEpilogue e = SkinnyGemmEpilogue::kStore) const {
    SkinnyGemmParams p;
    p.a = da.get();
    p.w = pr.dw.get();
    if (fp32) {
      p.c_f32 = dc32.get();
    } else {
      p.c = dc.get();
    }
    p.m = m;
    p.n = e == SkinnyGemmEpilogue::kSiluMul ? pr.n / 2 : pr.n;
    p.k = pr.k;
    p.epilogue = e;
    p.split_k = split_k;
    return p;
  }
};

// Forced off, the heuristic's choice, forced on.
std::vector<int> Splits(int m, int n, int k, SkinnyGemmEpilogue e) {
  std::vector<int> s = {1, ChooseSkinnyGemmSplitK(m, n, k, e, NumSms()), 3};
  std::sort(s.begin(), s.end());
  s.erase(std::unique(s.begin(), s.end()), s.end());
  return s;
}

const std::vector<int> kMs = {9, 16, 24, 33, 64, 100, 128};

TEST(SkinnyGemmTest, Bf16OutputMatchesReferenceOverShapeGrid) {
  // Tiny and odd (a partial tile, k < 64, k % 64 = 8, n = 257 puts one row in a second tile),
  // Llama-3.2-1B qkv, o, gate_up (unfused, 2 x 8192 rows), down, Llama-3.1-8B qkv (split 5), o,
  // down.
  const std::vector<std::pair<int, int>> shapes = {
      {24, 40},      {1000, 520},  {257, 1032},  {3072, 2048}, {2048, 2048},
      {16384, 2048}, {2048, 8192}, {6144, 4096}, {4096, 4096}, {4096, 14336}};
  for (const auto& [n, k] : shapes) {
    const Problem pr(n, k, n * 7 + k);
    for (int m : kMs) {
      Buffers run(pr, m, n);
      const std::vector<double> ref = pr.Rows(pr.ref, m);
      for (int split : Splits(m, n, k, SkinnyGemmEpilogue::kStore)) {
        SCOPED_TRACE(::testing::Message()
                     << "m=" << m << " n=" << n << " k=" << k << " split_k=" << split);
        run.dc.Poison();
        TS_ASSERT_OK(LaunchSkinnyGemm(run.Params(pr, split), nullptr));
        TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
        ExpectGemmCloseBf16(testing::FromBf16(run.dc.Download()), ref);
        EXPECT_TRUE(run.dc.GuardsIntact());
      }
    }
  }
}

// Every split count, including more splits than K tiles (k = 40 is one tile: splits 1..7 of the
// cluster add zeros) and split 7 at m = 128 (the largest receive area, 224 KB).
TEST(SkinnyGemmTest, EverySplitCount) {
  for (const auto& [n, k] : std::vector<std::pair<int, int>>{{24, 40}, {1000, 520}, {700, 4104}}) {
    const Problem pr(n, k, n + 3 * k);
    for (int m : {9, 100, 128}) {
      Buffers run(pr, m, n);
      const std::vector<double> ref = pr.Rows(pr.ref, m);
      for (int split = 1; split <= kSkinnyGemmMaxSplitK; ++split) {
        SCOPED_TRACE(::testing::Message()
                     << "m=" << m << " n=" << n << " k=" << k << " split_k=" << split);
        run.dc.Poison();
        TS_ASSERT_OK(LaunchSkinnyGemm(run.Params(pr, split), nullptr));
        TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
        ExpectGemmCloseBf16(testing::FromBf16(run.dc.Download()), ref);
        EXPECT_TRUE(run.dc.GuardsIntact());
      }
    }
  }
}

TEST(SkinnyGemmTest, Fp32OutputIsTighter) {
  for (const auto& [n, k] :
       std::vector<std::pair<int, int>>{{24, 40}, {1000, 520}, {2048, 8192}, {4096, 14336}}) {
    const Problem pr(n, k, n + 5 * k);
    for (int m : {9, 33, 128}) {
      Buffers run(pr, m, n);
      const std::vector<double> ref = pr.Rows(pr.ref, m), bound = pr.Rows(pr.abs_s, m);
      for (int split : {1, 3, 8}) {
        SCOPED_TRACE(::testing::Message()
                     << "m=" << m << " n=" << n << " k=" << k << " split_k=" << split);
        run.dc32.Poison();
        TS_ASSERT_OK(LaunchSkinnyGemm(run.Params(pr, split, /*fp32=*/true), nullptr));
        TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
        ExpectGemmCloseF32(run.dc32.Download(), ref, bound);
        EXPECT_TRUE(run.dc32.GuardsIntact());
      }
    }
  }
}

TEST(SkinnyGemmTest, AccumulateAddsIntoC) {
  for (const auto& [n, k] : std::vector<std::pair<int, int>>{{2048, 1000}, {300, 136}}) {
    const Problem pr(n, k, 91 + n);
    for (int m : {9, 64, 128}) {
      Buffers run(pr, m, n);
      const std::vector<float> c0 = testing::RandomFloats(size_t(m) * n, -4, 4, 17 * m);
      const std::vector<double> product = pr.Rows(pr.ref, m);
      std::vector<double> ref = product, bound = pr.Rows(pr.abs_s, m);
      for (size_t e = 0; e < ref.size(); ++e) {
        ref[e] += c0[e];
        bound[e] += 0.1 * std::fabs(c0[e]);  // c0 is exact in fp32: one more fp32 rounding
      }
      for (int split : {1, 3}) {
        SCOPED_TRACE(::testing::Message() << "m=" << m << " n=" << n << " split_k=" << split);
        run.dc.Upload(testing::ToBf16(c0));
        TS_ASSERT_OK(LaunchSkinnyGemm(run.Params(pr, split, false, SkinnyGemmEpilogue::kAccumulate),
                                      nullptr));
        TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
        const std::vector<float> got = testing::FromBf16(run.dc.Download());
        ExpectGemmCloseBf16(got, ref, &product);
        // Rounded as transformers' bf16 Linear then residual add: bf16(c0 + bf16(A W^T)).
        std::vector<float> hf(got.size());
        for (size_t e = 0; e < hf.size(); ++e) {
          hf[e] = testing::RoundBf16(testing::RoundBf16(float(product[e])) + c0[e]);
        }
        EXPECT_GE(testing::CompareBf16(got, hf).exact_fraction, 0.99);
        EXPECT_TRUE(run.dc.GuardsIntact());

        run.dc32.Upload(c0);
        TS_ASSERT_OK(LaunchSkinnyGemm(run.Params(pr, split, true, SkinnyGemmEpilogue::kAccumulate),
                                      nullptr));
        TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
        ExpectGemmCloseF32(run.dc32.Download(), ref, bound);
        EXPECT_TRUE(run.dc32.GuardsIntact());
      }
    }
  }
}

// SwiGLU over a fused [2n, k] gate_up weight against transformers' rounding of gate, up, silu and
// the product (the bound as derived in gemv_test.cc's SiluMul test).
TEST(SkinnyGemmTest, SiluMulEpilogueMatchesGateUpThenSiluMul) {
  for (const auto& [n, k] :
       std::vector<std::pair<int, int>>{{8192, 2048}, {20, 40}, {1000, 520}, {300, 136}}) {
    const Problem pr(2 * n, k, n + 11 * k);
    for (int m : {9, 33, 128}) {
      std::vector<double> ref(size_t(m) * n), bound(ref.size());
      std::vector<float> hf(ref.size());
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
          const size_t gi = size_t(i) * 2 * n + j, ui = gi + n, e = size_t(i) * n + j;
          const double g = pr.ref[gi], u = pr.ref[ui];
          ref[e] = g / (1 + std::exp(-g)) * u;
          const float gb = testing::RoundBf16(float(g)), ub = testing::RoundBf16(float(u));
          hf[e] = testing::RoundBf16(testing::RoundBf16(gb / (1.0f + std::exp(-gb))) * ub);
          const double sg = 1 / (1 + std::exp(-g));
          const double dsilu = std::fabs(sg * (1 + g * (1 - sg)));
          const double acc_err =
              1e-5 * (pr.abs_s[gi] * dsilu * std::fabs(u) + pr.abs_s[ui] * std::fabs(g * sg));
          bound[e] = (2 * (1 + std::fabs(g)) + 3) / 256 * std::fabs(ref[e]) + acc_err + 1e-30;
        }
      }
      Buffers run(pr, m, n);
      for (int split : Splits(m, n, k, SkinnyGemmEpilogue::kSiluMul)) {
        SCOPED_TRACE(::testing::Message()
                     << "m=" << m << " n=" << n << " k=" << k << " split_k=" << split);
        run.dc.Poison();
        TS_ASSERT_OK(
            LaunchSkinnyGemm(run.Params(pr, split, false, SkinnyGemmEpilogue::kSiluMul), nullptr));
        TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
        const std::vector<float> got = testing::FromBf16(run.dc.Download());
        EXPECT_LE(testing::RelL2Error(got, ref), 1e-2);
        EXPECT_GE(testing::CompareBf16(got, hf).exact_fraction, 0.98);
        for (size_t e = 0; e < got.size(); ++e) {
          ASSERT_LE(std::fabs(got[e] - ref[e]), bound[e]) << "element " << e;
        }
        EXPECT_TRUE(run.dc.GuardsIntact());
      }
    }
  }
}

// Two direct launches give the same bytes, and so do graph replays (with and without PDL).
TEST(SkinnyGemmTest, CapturesInGraphAndIsDeterministic) {
  const Problem pr(4096, 4096, 5);
  cudaStream_t stream;
  TS_ASSERT_CUDA_OK(cudaStreamCreate(&stream));
  for (int m : {33, 128}) {
    Buffers run(pr, m, pr.n);
    for (int split : {1, 3, 8}) {
      for (bool pdl : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "m=" << m << " split_k=" << split << " pdl=" << pdl);
        SkinnyGemmParams p = run.Params(pr, split);
        p.pdl = pdl;
        run.dc.Poison();
        TS_ASSERT_OK(LaunchSkinnyGemm(p, stream));
        TS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
        const auto first = run.dc.Download();
        ExpectGemmCloseBf16(testing::FromBf16(first), pr.Rows(pr.ref, m));
        run.dc.Poison();
        TS_ASSERT_OK(LaunchSkinnyGemm(p, stream));
        TS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
        const auto second = run.dc.Download();
        EXPECT_EQ(0, std::memcmp(first.data(), second.data(), first.size() * sizeof(first[0])));
        ExpectReplaysEqual(stream, run.dc, first, 3,
                           [&](cudaStream_t s) { return LaunchSkinnyGemm(p, s); });
        EXPECT_TRUE(run.dc.GuardsIntact());
      }
    }
  }
  cudaStreamDestroy(stream);
}

// With pdl the second launch issues its W copies before griddepcontrol.wait: its A is the first's
// output (poisoned with NaN before each replay), so reading A before the wait would show.
TEST(SkinnyGemmTest, PdlChainReadsTheProducersOutput) {
  const Problem p1(2048, 4096, 21), p2(3072, 2048, 22);
  constexpr int kM = 64;
  Buffers r1(p1, kM, 2048);
  GuardedBuffer<__nv_bfloat16> c2(size_t(kM) * 3072);
  cudaStream_t stream;
  TS_ASSERT_CUDA_OK(cudaStreamCreate(&stream));
  for (int split : {1, 4}) {
    SCOPED_TRACE(::testing::Message() << "split_k=" << split);
    SkinnyGemmParams first = r1.Params(p1, split);
    SkinnyGemmParams second;
    second.a = r1.dc.get();
    second.w = p2.dw.get();
    second.c = c2.get();
    second.m = kM;
    second.n = 3072;
    second.k = 2048;
    second.split_k = split;
    second.pdl = true;
    cudaGraph_t graph = nullptr;
    TS_ASSERT_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    absl::Status st = LaunchSkinnyGemm(first, stream);
    if (st.ok()) st = LaunchSkinnyGemm(second, stream);
    TS_ASSERT_CUDA_OK(cudaStreamEndCapture(stream, &graph));
    TS_ASSERT_OK(st);
    cudaGraphExec_t exec = nullptr;
    TS_ASSERT_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int r = 0; r < 3; ++r) {
      r1.dc.Poison();
      c2.Poison();
      TS_ASSERT_CUDA_OK(cudaGraphLaunch(exec, stream));
      TS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
      const std::vector<float> mid = testing::FromBf16(r1.dc.Download());
      ExpectGemmCloseBf16(mid, p1.Rows(p1.ref, kM));
      // The second product, in fp64 from the first's bf16 output.
      std::vector<double> ref2(size_t(kM) * 3072);
      ParallelFor(3072, [&](int j) {
        for (int i = 0; i < kM; ++i) {
          double s = 0;
          for (int t = 0; t < 2048; ++t)
            s += double(mid[size_t(i) * 2048 + t]) * p2.w[size_t(j) * 2048 + t];
          ref2[size_t(i) * 3072 + j] = s;
        }
      });
      ExpectGemmCloseBf16(testing::FromBf16(c2.Download()), ref2);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  EXPECT_TRUE(c2.GuardsIntact());
  cudaStreamDestroy(stream);
}

// Every cluster size fits on the device at every m; prints how many stay resident (a launch with
// more tiles than that runs in waves), which is what ChooseSkinnyGemmSplitK assumes.
TEST(SkinnyGemmTest, ClustersAreResident) {
  for (int m : {16, 128}) {
    std::string line = "resident clusters at m = " + std::to_string(m) + ", split_k 1..8:";
    for (int split = 1; split <= kSkinnyGemmMaxSplitK; ++split) {
      int32_t clusters = 0;
      TS_ASSERT_OK(SkinnyGemmResidentClusters(m, split, &clusters));
      EXPECT_GE(clusters, 1) << "split_k " << split;
      line += " " + std::to_string(clusters);
    }
    std::printf("%s\n", line.c_str());
  }
}

#endif  // TS_SKINNY_GEMM_HOST_ONLY

}  // namespace
}  // namespace ts::kernels
