// LaunchGemv (tensor-core GEMV, m <= 16) against an fp64 CPU product of the same bf16 inputs: the
// register kernel over m in {1, 2, 3, 5, 8} x (n, k) from tiny and odd to Llama-1B/8B projections x
// split_k in {1, ChooseGemvSplitK, 4}, and the shared-memory kernel over m in 9..16 x split_k in
// {1, ChooseGemvSplitK, as many as k and the 8-CTA cluster allow}, on the shapes whose fp64
// reference stays cheap. bf16 output tolerance as in gemm_test.cc: |err| <= 2^-8 |ref| +
// 1e-3 rms(ref) per element and ||err|| / ||ref|| <= 5e-3. fp32 output: only accumulation error
// is left, |err| <= 1e-5 sum_t |a_t w_t| per element and ||err|| / ||ref|| <= 1e-4.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "kernels/gemv.cuh"
#include "kernels/rope_kv.cuh"
#include "models/rope.h"
#include "tests/kernels/gemv_test_util.h"
#include "tests/kernels/kernel_test_util.h"

namespace ts::kernels {
namespace {

using namespace gemv_test;  // NOLINT(build/namespaces): the shared fixtures

// One (n, k) and m of a shape grid: every split of Splits, output against the fp64 product.
void ExpectGridCase(const Weights& wt, int m) {
  const int n = wt.n, k = wt.k;
  Problem pr(wt, m, m * 131 + n + k);
  const std::vector<double> ref = Reference(pr.a, wt.w, nullptr, m, n, k);
  for (int split : Splits(m, n, k)) {
    SCOPED_TRACE(::testing::Message()
                 << "m=" << m << " n=" << n << " k=" << k << " split_k=" << split);
    pr.dc.Poison();
    TS_ASSERT_OK(LaunchGemv(pr.Params(split), nullptr));
    TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
    ExpectGemmCloseBf16(testing::FromBf16(pr.dc.Download()), ref);
    EXPECT_TRUE(pr.dc.GuardsIntact());
    EXPECT_TRUE(pr.ws.GuardsIntact());
  }
}

TEST(GemvTest, Bf16OutputMatchesReferenceOverShapeGrid) {
  for (const auto& [n, k] : kShapes) {
    const Weights wt(n, k, n * 7 + k);
    for (int m : {1, 2, 3, 5, 8}) ExpectGridCase(wt, m);
  }
}

// The m > 8 kernel: 9 to 16 rows of A (padded to 16 in the kernel), k that ends inside a
// 64-wide stage, and split_k from 1 to the cluster's 8 (as k allows) with the in-kernel reduction.
TEST(GemvTest, SharedMemoryKernelMatchesReferenceOverShapeGrid) {
  const std::vector<std::tuple<int, int, std::vector<int>>> grid = {
      {3072, 2048, {16, 13}}, {2048, 8192, {12, 16}}, {6144, 4096, {16}},
      {4096, 4096, {16}},     {4096, 14336, {16}},    {16384, 2048, {9}},
      {24, 40, {9, 16}},      {1000, 520, {11, 16}},  {200, 136, {15}}};
  for (const auto& [n, k, ms] : grid) {
    const Weights wt(n, k, n * 5 + k);
    for (int m : ms) {
      ASSERT_TRUE(Affordable(m, n, k)) << m << " " << n << " " << k;
      ExpectGridCase(wt, m);
    }
  }
}

TEST(GemvTest, Fp32OutputIsTighter) {
  for (const auto& [n, k] :
       std::vector<std::pair<int, int>>{{24, 40}, {1000, 520}, {2048, 8192}, {4096, 14336}}) {
    const Weights wt(n, k, n + 3 * k);
    for (int m : {1, 5, 8, 13, 16}) {
      if (!Affordable(2 * m, n, k)) continue;  // the bound's pass costs a second product
      Problem pr(wt, m, m + n);
      std::vector<double> abs_sum;
      const std::vector<double> ref = Reference(pr.a, wt.w, nullptr, m, n, k, &abs_sum);
      for (int split : FewSplits(m, k)) {
        SCOPED_TRACE(::testing::Message()
                     << "m=" << m << " n=" << n << " k=" << k << " split_k=" << split);
        pr.dc32.Poison();
        TS_ASSERT_OK(LaunchGemv(pr.Params(split, /*fp32=*/true), nullptr));
        TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
        ExpectGemmCloseF32(pr.dc32.Download(), ref, abs_sum);
        EXPECT_TRUE(pr.dc32.GuardsIntact());
      }
    }
  }
}

TEST(GemvTest, AccumulateAddsIntoC) {
  const Weights wt(2048, 1000, 91);
  for (int m : {1, 3, 8, 10, 16}) {
    Problem pr(wt, m, 17 * m);
    std::vector<double> abs_sum;
    const std::vector<double> product = Reference(pr.a, wt.w, nullptr, m, 2048, 1000, &abs_sum);
    const std::vector<double> ref = Reference(pr.a, wt.w, &pr.c0, m, 2048, 1000);
    for (int split : FewSplits(m, 1000)) {
      SCOPED_TRACE(::testing::Message() << "m=" << m << " split_k=" << split);
      pr.dc.Upload(testing::ToBf16(pr.c0));
      TS_ASSERT_OK(LaunchGemv(pr.Params(split, false, /*accumulate=*/true), nullptr));
      TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> got = testing::FromBf16(pr.dc.Download());
      ExpectGemmCloseBf16(got, ref, &product);
      // Rounded as transformers' bf16 Linear then residual add: bf16(c0 + bf16(A W^T)).
      std::vector<float> hf(got.size());
      for (size_t i = 0; i < hf.size(); ++i) {
        hf[i] = testing::RoundBf16(testing::RoundBf16(float(product[i])) + pr.c0[i]);
      }
      EXPECT_GE(testing::CompareBf16(got, hf).exact_fraction, 0.99);
      EXPECT_TRUE(pr.dc.GuardsIntact());

      // fp32: c0 is exact in fp32, so the bound is the accumulation's plus one fp32 rounding.
      pr.dc32.Upload(pr.c0);
      TS_ASSERT_OK(LaunchGemv(pr.Params(split, true, true), nullptr));
      TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
      std::vector<double> bound = abs_sum;
      for (size_t i = 0; i < bound.size(); ++i) bound[i] += 0.1 * std::fabs(pr.c0[i]);
      ExpectGemmCloseF32(pr.dc32.Download(), ref, bound);
      EXPECT_TRUE(pr.dc32.GuardsIntact());
    }
  }
}

TEST(GemvTest, CapturesInGraphAndIsDeterministic) {
  const Weights wt(4096, 4096, 5);
  cudaStream_t stream;
  TS_ASSERT_CUDA_OK(cudaStreamCreate(&stream));
  for (int m : {5, 14}) {
    Problem pr(wt, m, 6);
    const std::vector<double> ref = Reference(pr.a, wt.w, nullptr, m, 4096, 4096);
    // m > 8, split_k 8: the CTAs of a cluster finish in any order, the bits stay the same.
    for (int split : m <= kGemvRegisterMaxM ? std::vector<int>{0, 1, 3} : std::vector<int>{1, 8}) {
      for (bool pdl : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "m=" << m << " split_k=" << split << " pdl=" << pdl);
        GemvParams p = pr.Params(split);
        p.pdl = pdl;
        pr.dc.Poison();
        TS_ASSERT_OK(LaunchGemv(p, stream));
        TS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
        const auto first = pr.dc.Download();
        ExpectGemmCloseBf16(testing::FromBf16(first), ref);
        ExpectReplaysEqual(stream, pr.dc, first, 3,
                           [&](cudaStream_t s) { return LaunchGemv(p, s); });
        EXPECT_TRUE(pr.dc.GuardsIntact());
      }
    }
  }
  cudaStreamDestroy(stream);
}

// With pdl the second GEMV issues its W loads before griddepcontrol.wait: its A is the first's
// output (poisoned with NaN before each replay), so reading A before the wait would show.
// At m > 8 both launches share one counter array, as the decode step's GEMVs do.
TEST(GemvTest, PdlChainReadsTheProducersOutput) {
  const Weights w1(2048, 4096, 21), w2(3072, 2048, 22);
  cudaStream_t stream;
  TS_ASSERT_CUDA_OK(cudaStreamCreate(&stream));
  for (int m : {4, 12}) {
    Problem p1(w1, m, 23);
    GuardedBuffer<__nv_bfloat16> c2(size_t(m) * 3072);
    GuardedBuffer<float> ws(size_t(kGemvMaxSplitK) * m * 3072);
    for (int split : FewSplits(m, 2048)) {
      SCOPED_TRACE(::testing::Message() << "m=" << m << " split_k=" << split);
      GemvParams first = p1.Params(m <= kGemvRegisterMaxM && split != 0 ? 1 : split);
      first.pdl = m > kGemvRegisterMaxM;  // behind nothing but a copy: no overlap, but legal
      GemvParams second;
      second.a = p1.dc.get();
      second.w = w2.dw.get();
      second.c = c2.get();
      second.m = m;
      second.n = 3072;
      second.k = 2048;
      second.split_k = std::max(split, 1);
      second.warp_tiles = split == 0 ? GemvWarpTiles::kAlways : GemvWarpTiles::kNever;
      second.workspace = ws.get();
      second.workspace_bytes = ws.size() * sizeof(float);
      second.pdl = true;
      cudaGraphExec_t exec = InstantiatePair(first, second, stream);
      ASSERT_NE(exec, nullptr);
      for (int r = 0; r < 3; ++r) {
        p1.dc.Poison();
        c2.Poison();
        TS_ASSERT_CUDA_OK(cudaGraphLaunch(exec, stream));
        TS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
        const std::vector<float> mid = testing::FromBf16(p1.dc.Download());
        ExpectGemmCloseBf16(mid, Reference(p1.a, w1.w, nullptr, m, 2048, 4096));
        ExpectGemmCloseBf16(testing::FromBf16(c2.Download()),
                            Reference(mid, w2.w, nullptr, m, 3072, 2048));
      }
      cudaGraphExecDestroy(exec);
    }
    EXPECT_TRUE(c2.GuardsIntact());
  }
  cudaStreamDestroy(stream);
}

TEST(GemvTest, RejectsBadParams) {
  const Weights wt(64, 64, 9);
  Problem pr(wt, 3, 10);
  GemvParams p = pr.Params(1);
  TS_ASSERT_OK(LaunchGemv(p, nullptr));
  auto with = [&](auto&& edit) {
    GemvParams q = pr.Params(1);
    edit(q);
    return LaunchGemv(q, nullptr);
  };
  TS_EXPECT_INVALID(with([](GemvParams& q) { q.m = 0; }), "gemv.m");
  TS_EXPECT_INVALID(with([](GemvParams& q) { q.m = kGemvMaxM + 1; }), "gemv.m");
  TS_EXPECT_INVALID(with([](GemvParams& q) { q.n = 0; }), "gemv.n");
  TS_EXPECT_INVALID(with([](GemvParams& q) { q.k = 60; }), "gemv.k");
  TS_EXPECT_INVALID(with([](GemvParams& q) { q.k = 0; }), "gemv.k");
  TS_EXPECT_INVALID(with([](GemvParams& q) { q.a = nullptr; }), "gemv.a");
  TS_EXPECT_INVALID(with([&](GemvParams& q) { q.w = pr.wt.dw.get() + 4; }), "gemv.w");
  TS_EXPECT_INVALID(with([](GemvParams& q) { q.c = nullptr; }), "gemv.c");
  TS_EXPECT_INVALID(with([&](GemvParams& q) { q.c_f32 = pr.dc32.get(); }), "gemv.c");
  TS_EXPECT_INVALID(with([](GemvParams& q) { q.split_k = 0; }), "gemv.split_k");
  TS_EXPECT_INVALID(with([](GemvParams& q) { q.split_k = kGemvMaxSplitK + 1; }), "gemv.split_k");
  TS_EXPECT_INVALID(with([](GemvParams& q) {
                      q.split_k = 2;
                      q.workspace = nullptr;
                    }),
                    "gemv.workspace");
  TS_EXPECT_INVALID(with([](GemvParams& q) {
                      q.split_k = 2;
                      q.workspace_bytes = GemvWorkspaceBytes(3, 64, 2) - 4;
                    }),
                    "gemv.workspace_bytes");
  TS_EXPECT_INVALID(with([](GemvParams& q) { q.epilogue = static_cast<GemvEpilogue>(7); }),
                    "gemv.epilogue");
  TS_EXPECT_INVALID(with([&](GemvParams& q) {
                      q.epilogue = GemvEpilogue::kSiluMul;
                      q.c = nullptr;
                      q.c_f32 = pr.dc32.get();
                    }),
                    "gemv.epilogue");
  TS_EXPECT_INVALID(with([&](GemvParams& q) { q.norm_weight = pr.wt.dw.get() + 4; }),
                    "gemv.norm_weight");
  TS_EXPECT_INVALID(with([&](GemvParams& q) {
                      q.norm_weight = pr.wt.dw.get();
                      q.norm_eps = 0;
                    }),
                    "gemv.norm_eps");
  TS_EXPECT_INVALID(with([&](GemvParams& q) {
                      q.norm_weight = pr.wt.dw.get();
                      q.split_k = 2;
                    }),
                    "gemv.norm_weight");
  TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(pr.dc.GuardsIntact());

  // What only the m > 8 kernel needs.
  Problem big(wt, 12, 11);
  auto with_big = [&](auto&& edit) {
    GemvParams q = big.Params(1);
    edit(q);
    return LaunchGemv(q, nullptr);
  };
  TS_ASSERT_OK(with_big([](GemvParams&) {}));
  TS_EXPECT_INVALID(with_big([&](GemvParams& q) { q.norm_weight = big.wt.dw.get(); }),
                    "gemv.norm_weight");
  TS_EXPECT_INVALID(with_big([](GemvParams& q) { q.split_k = 2; }), "gemv.split_k");  // k = 64
  TS_EXPECT_INVALID(with_big([](GemvParams& q) {
                      q.k = 64 * 16;
                      q.split_k = kGemvTcMaxSplitK + 1;
                    }),
                    "gemv.split_k");
  TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(big.dc.GuardsIntact());
}

// SwiGLU epilogue over a fused [2n, k] gate_up weight, with and without the norm prologue (the
// decode step uses both), against transformers' rounding of gate, up, silu and the product.
TEST(GemvTest, SiluMulEpilogueMatchesGateUpThenSiluMul) {
  for (const auto& [n, k] :
       std::vector<std::pair<int, int>>{{8192, 2048}, {14336, 4096}, {20, 40}, {1000, 520}}) {
    const Weights wt(2 * n, k, n + 11 * k);
    const auto nw = testing::RandomFloats(k, 0.5f, 1.5f, k + 1);
    GuardedBuffer<__nv_bfloat16> dnw(k);
    dnw.Upload(testing::ToBf16(nw));
    for (int m : {1, 3, 8, 9, 16}) {
      if (!Affordable(m, 2 * n, k)) continue;
      for (int variant = 0; variant < 4; ++variant) {
        const bool norm = variant & 1;
        // m <= 8: 0 warp tiles, 1 shared tiles. m > 8 (the norm from a_sumsq): split_k 1 or 3.
        const int split = m <= kGemvRegisterMaxM
                              ? variant >> 1
                              : FewSplits(m, k)[variant >> 1 ? FewSplits(m, k).size() - 1 : 0];
        SCOPED_TRACE(::testing::Message() << "m=" << m << " n=" << n << " k=" << k
                                          << " norm=" << norm << " split_k=" << split);
        Problem pr(wt, m, m * 3 + n + norm);
        const std::vector<float> a = norm ? NormalizedA(pr.a, nw, m, k, 1e-5f) : pr.a;
        std::vector<double> gu_abs;  // sum |a w| per gate/up output
        const std::vector<double> gu = Reference(a, wt.w, nullptr, m, 2 * n, k, &gu_abs);
        std::vector<double> ref(size_t(m) * n), bound(ref.size());
        std::vector<float> hf(ref.size());
        for (int i = 0; i < m; ++i) {
          for (int j = 0; j < n; ++j) {
            const double g = gu[size_t(i) * 2 * n + j], u = gu[size_t(i) * 2 * n + n + j];
            const size_t e = size_t(i) * n + j;
            ref[e] = g / (1 + std::exp(-g)) * u;
            const float gb = testing::RoundBf16(float(g)), ub = testing::RoundBf16(float(u));
            hf[e] = testing::RoundBf16(testing::RoundBf16(gb / (1.0f + std::exp(-gb))) * ub);
            // Four bf16 roundings (gate, up, silu, product; each <= 2^-8 relative) and one flip
            // of gate's rounding between fp32 and fp64 sums; silu(g) moves (1 + |g|) times g's
            // relative change. Plus the fp32 sums' own error (<= 1e-5 sum |a w|, as in
            // Fp32OutputIsTighter), which dominates where gate or up nearly cancel to zero,
            // carried through silu'(g) u and silu(g).
            const double sg = 1 / (1 + std::exp(-g));
            const double dsilu = std::fabs(sg * (1 + g * (1 - sg)));
            const double acc_err = 1e-5 * (gu_abs[size_t(i) * 2 * n + j] * dsilu * std::fabs(u) +
                                           gu_abs[size_t(i) * 2 * n + n + j] * std::fabs(g * sg));
            bound[e] = (2 * (1 + std::fabs(g)) + 3) / 256 * std::fabs(ref[e]) + acc_err + 1e-30;
          }
        }
        GemvParams p = pr.Params(split);
        p.n = n;
        p.epilogue = GemvEpilogue::kSiluMul;
        GuardedBuffer<float> dss(size_t(m) * GemvSumSqGroups(k));
        if (norm) {
          p.norm_weight = dnw.get();
          dss.Upload(RowSumSq(pr.a, m, k));
          if (m > kGemvRegisterMaxM) p.a_sumsq = dss.get();
        }
        pr.dc.Poison();
        TS_ASSERT_OK(LaunchGemv(p, nullptr));
        TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
        // dc is sized for [m, 2n]: C is its first m * n elements, the rest keeps the poison.
        std::vector<float> got = testing::FromBf16(pr.dc.Download());
        for (size_t e = ref.size(); e < got.size(); ++e) ASSERT_TRUE(std::isnan(got[e])) << e;
        got.resize(ref.size());
        EXPECT_LE(testing::RelL2Error(got, ref), 1e-2);
        EXPECT_GE(testing::CompareBf16(got, hf).exact_fraction, 0.98);
        for (size_t e = 0; e < got.size(); ++e) {
          ASSERT_LE(std::fabs(got[e] - ref[e]), bound[e]) << "element " << e;
        }
        EXPECT_TRUE(pr.dc.GuardsIntact());
      }
    }
  }
}

// kRopeKv against the two kernels it replaces: LaunchGemv (kStore) into a qkv buffer, then
// LaunchRopeKv with q_out (itself checked against transformers' rounding in rope_kv_test.cc).
// Both sum every output in the same order and round at the same points, so q and the cache agree
// bit for bit up to a rare 1-ulp difference (>= 99.9% exact, |diff| <= 2^-7 |value|): a misplaced
// rotation partner, head or slot is off by O(1) and fails. Cache cells outside the rows' slots
// keep their poison; a -1 slot writes nothing; an out-of-range slot sets the error flag.
struct RopeCase {
  int hq, hkv, head_dim, k;
};

void RunRopeCase(const RopeCase& rc, int m, bool norm, std::vector<int32_t> slots, int split = 1) {
  SCOPED_TRACE(::testing::Message()
               << "hq=" << rc.hq << " hkv=" << rc.hkv << " D=" << rc.head_dim << " k=" << rc.k
               << " m=" << m << " norm=" << norm << " split_k=" << split);
  constexpr int kBlock = 16, kBlocks = 6;
  const int d = rc.head_dim, n = (rc.hq + 2 * rc.hkv) * d;
  const Weights wt(n, rc.k, n + rc.k + m);
  Problem pr(wt, m, 7 * m + n);
  const auto nw = testing::RandomFloats(rc.k, 0.5f, 1.5f, rc.k + 3);
  GuardedBuffer<__nv_bfloat16> dnw(rc.k);
  dnw.Upload(testing::ToBf16(nw));
  std::vector<int32_t> positions;
  for (int i = 0; i < m; ++i) positions.push_back(i == 0 ? 131071 : 37 * i + 5);
  ModelConfig c;
  c.head_dim = d;
  c.rope_theta = 500000.0f;
  c.rope_scaling.type = RopeType::kLlama3;
  c.rope_scaling.factor = 8.0f;
  auto inv = ts::RopeInvFreq(c);
  ASSERT_TRUE(inv.ok()) << inv.status();
  GuardedBuffer<int32_t> dpos(m), dslots(m), flag(1);
  GuardedBuffer<float> dinv(inv->size());
  dpos.Upload(positions);
  dslots.Upload(slots);
  dinv.Upload(*inv);
  const KvLayout layout{kBlocks, rc.hkv, kBlock, d};
  const size_t cache = size_t(kBlocks) * rc.hkv * kBlock * d;
  // [0]: the fused kernel's outputs, [1]: the two-kernel path's.
  GuardedBuffer<__nv_bfloat16> q0(size_t(m) * rc.hq * d), q1(q0.size()), kc0(cache), kc1(cache),
      vc0(cache), vc1(cache), qkv(size_t(m) * n);
  flag.Upload({0});

  // The two-kernel path at m > 8 runs at the fused launch's split, so both sum each output in the
  // same order; at m <= 8 it runs split 1 (warp tiles, split 0, sum in another order).
  GemvParams p = pr.Params(m > kGemvRegisterMaxM ? split : 1);
  GuardedBuffer<float> dss(size_t(m) * GemvSumSqGroups(rc.k));
  dss.Upload(RowSumSq(pr.a, m, rc.k));
  if (norm) p.norm_weight = dnw.get();
  if (norm && m > kGemvRegisterMaxM) p.a_sumsq = dss.get();
  TS_ASSERT_OK(LaunchGemv(
      [&] {
        GemvParams f = pr.Params(split);
        f.norm_weight = p.norm_weight;
        f.a_sumsq = p.a_sumsq;
        f.c = q0.get();
        f.epilogue = GemvEpilogue::kRopeKv;
        f.rope = {dpos.get(), dslots.get(), dinv.get(), kc0.get(),
                  vc0.get(),  flag.get(),   layout,     rc.hq};
        return f;
      }(),
      nullptr));
  p.c = qkv.get();
  TS_ASSERT_OK(LaunchGemv(p, nullptr));
  TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
  // The pre-rotation values (rope_kv rotates k in place below).
  const std::vector<float> x = testing::FromBf16(qkv.Download());  // [m, n]
  RopeKvParams r;
  r.qkv = qkv.get();
  r.q_out = q1.get();
  r.positions = dpos.get();
  r.slot_mapping = dslots.get();
  r.inv_freq = dinv.get();
  r.k_cache = kc1.get();
  r.v_cache = vc1.get();
  r.layout = layout;
  r.rows = m;
  r.num_q_heads = rc.hq;
  TS_ASSERT_OK(LaunchRopeKv(r, nullptr));
  TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());

  const bool bad_slot = std::any_of(slots.begin(), slots.end(),
                                    [&](int32_t s) { return s < -1 || s >= kBlocks * kBlock; });
  EXPECT_EQ(flag.Download()[0], bad_slot ? 1 : 0);
  // Warp tiles (split 0) sum each output in another fp32 order than the reference GEMV, so a
  // pre-rotation value may round to its other bf16 neighbour: one operand ulp (2^-8 |x|) then
  // moves the rotated pair by up to (|x1| + |x2|) / 256. Bound per output cell by its operands.
  std::vector<float> q_ops(q0.size(), 0.f), k_ops(cache, 0.f), v_ops(cache, 0.f);
  for (int i = 0; i < m; ++i) {
    const float* row = x.data() + size_t(i) * n;
    auto pair_mag = [&](int head, int dd) {
      const int lo = dd % (d / 2);
      return std::fabs(row[head * d + lo]) + std::fabs(row[head * d + lo + d / 2]);
    };
    for (int h = 0; h < rc.hq; ++h) {
      for (int dd = 0; dd < d; ++dd) q_ops[(size_t(i) * rc.hq + h) * d + dd] = pair_mag(h, dd);
    }
    if (slots[i] < 0 || slots[i] >= kBlocks * kBlock) continue;
    for (int h = 0; h < rc.hkv; ++h) {
      const int64_t cell = KvOffset(layout, slots[i] / kBlock, h, slots[i] % kBlock);
      for (int dd = 0; dd < d; ++dd) {
        k_ops[cell + dd] = pair_mag(rc.hq + h, dd);
        v_ops[cell + dd] = std::fabs(row[(rc.hq + rc.hkv + h) * d + dd]);
      }
    }
  }
  // Same order: the reference GEMV sums each output as the fused launch does.
  const bool same_order = m > kGemvRegisterMaxM || split != 0;
  for (auto [fused, ref, ops] :
       {std::tuple{&q0, &q1, &q_ops}, {&kc0, &kc1, &k_ops}, {&vc0, &vc1, &v_ops}}) {
    const std::vector<float> got = testing::FromBf16(fused->Download());
    const std::vector<float> want = testing::FromBf16(ref->Download());
    std::vector<float> got_written, want_written;
    for (size_t e = 0; e < got.size(); ++e) {
      // The reference leaves exactly the cells nobody should write poisoned (NaN).
      ASSERT_EQ(std::isnan(got[e]), std::isnan(want[e])) << "element " << e;
      if (std::isnan(want[e])) continue;
      got_written.push_back(got[e]);
      want_written.push_back(want[e]);
      const double bound = std::fabs(want[e]) / 128 + (same_order ? 0.0 : (*ops)[e] / 128) + 1e-6;
      ASSERT_LE(std::fabs(got[e] - want[e]), bound) << "element " << e;
    }
    EXPECT_FALSE(got_written.empty());
    EXPECT_GE(testing::CompareBf16(got_written, want_written).exact_fraction,
              same_order ? 0.999 : 0.95);
    EXPECT_TRUE(fused->GuardsIntact());
  }
}

TEST(GemvTest, RopeKvEpilogueMatchesGemvThenRopeKv) {
  // Llama-1B and 8B attention, the fixtures' head_dim 16, an odd k; slots out of order.
  for (const RopeCase& rc : {RopeCase{32, 8, 64, 2048}, RopeCase{32, 8, 128, 4096},
                             RopeCase{4, 2, 16, 64}, RopeCase{6, 2, 128, 520}}) {
    for (int m : {1, 3, 8, 12, 16}) {
      const int n = (rc.hq + 2 * rc.hkv) * rc.head_dim;
      if (!Affordable(m, n, rc.k)) continue;
      std::vector<int32_t> slots;  // distinct: 29 is prime to the 96 slots
      for (int i = 0; i < m; ++i) slots.push_back(i == 1 ? -1 : (i * 29 + 7) % 96);
      for (bool norm : {false, true}) {
        // m > 8: split_k 1 and 3, the norm from a_sumsq; m <= 8: warp tiles and shared tiles.
        for (int split : m > kGemvRegisterMaxM ? FewSplits(m, rc.k) : std::vector<int>{0, 1}) {
          RunRopeCase(rc, m, norm, slots, split);
        }
      }
    }
  }
}

TEST(GemvTest, RopeKvEpilogueSkipsAndFlagsBadSlots) {
  RunRopeCase(RopeCase{4, 2, 64, 256}, 3, true, {96, -7, 5});
  RunRopeCase(RopeCase{4, 2, 64, 256}, 3, true, {96, -7, 5}, /*split=*/0);
  // What KvSlotFor gives a position on block-table padding or past the table.
  RunRopeCase(RopeCase{4, 2, 64, 256}, 3, true, {kBadKvSlot, kNoKvWrite, 5});
}

TEST(GemvTest, RopeKvEpilogueRejectsBadParams) {
  const Weights wt((4 + 2 * 2) * 64, 64, 3);
  Problem pr(wt, 2, 4);
  GuardedBuffer<int32_t> ints(2);
  GuardedBuffer<float> inv(32);
  GuardedBuffer<__nv_bfloat16> cache(16 * 2 * 64 * 4);
  GemvParams good = pr.Params(1);
  good.epilogue = GemvEpilogue::kRopeKv;
  good.rope = {
      ints.get(), ints.get(), inv.get(), cache.get(), cache.get(), nullptr, KvLayout{4, 2, 16, 64},
      4};
  GemvParams p = good;
  p.n -= 64;
  TS_EXPECT_INVALID(LaunchGemv(p, nullptr), "gemv.n");
  p = good;
  p.rope.layout.head_dim = 24;
  TS_EXPECT_INVALID(LaunchGemv(p, nullptr), "gemv.rope.layout.head_dim");
  p = good;
  p.rope.inv_freq = nullptr;
  TS_EXPECT_INVALID(LaunchGemv(p, nullptr), "gemv.rope.inv_freq");
  p = good;
  p.rope.slot_mapping = nullptr;
  TS_EXPECT_INVALID(LaunchGemv(p, nullptr), "gemv.rope.slot_mapping");
  p = good;
  p.rope.num_q_heads = 3;  // not a multiple of the 2 kv heads (checked before n)
  TS_EXPECT_INVALID(LaunchGemv(p, nullptr), "gemv.rope.num_q_heads");
  p = good;
  p.split_k = 2;
  TS_EXPECT_INVALID(LaunchGemv(p, nullptr), "kRopeKv");
  p = good;
  p.epilogue = GemvEpilogue::kStore;
  p.split_k = 2;
  p.warp_tiles = GemvWarpTiles::kAlways;
  TS_EXPECT_INVALID(LaunchGemv(p, nullptr), "gemv.warp_tiles");
  TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(pr.dc.GuardsIntact());

  // m > 8: a tile of 128 rows must hold whole heads.
  const Weights wide((4 + 2 * 2) * 48, 64, 4);
  Problem pr16(wide, 16, 5);
  p = pr16.Params(1);
  p.epilogue = GemvEpilogue::kRopeKv;
  p.rope = good.rope;
  p.rope.layout.head_dim = 48;
  TS_EXPECT_INVALID(LaunchGemv(p, nullptr), "gemv.rope.layout.head_dim");
}

}  // namespace
}  // namespace ts::kernels
