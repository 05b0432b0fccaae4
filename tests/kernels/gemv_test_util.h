// Shared by the GEMV tests (gemv_test.cc, gemv_norm_test.cc): the fp64 reference product, random
// weights and problems, the split_k values each kernel is tested at, and transformers' RMSNorm.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/gemv.cuh"
#include "tests/kernels/kernel_test_util.h"

namespace ts::kernels::gemv_test {

using testing::ExpectGemmCloseBf16;
using testing::ExpectGemmCloseF32;
using testing::ExpectReplaysEqual;
using testing::GuardedBuffer;

// (n, k): tiny and odd (k % 32 != 0 exercises the partial k-steps), Llama-3.2-1B qkv, o,
// gate_up, down, Llama-3.1-8B qkv, o, gate_up, down; (512, 8192) is one ChooseGemvSplitK splits.
inline const std::vector<std::pair<int, int>> kShapes = {
    {3072, 2048},  {2048, 2048},  {16384, 2048}, {2048, 8192}, {6144, 4096}, {4096, 4096},
    {28672, 4096}, {4096, 14336}, {24, 40},      {1000, 520},  {512, 8192}};

inline int NumSms() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  return sms > 0 ? sms : 132;
}

// C = A W^T (+ c0) in fp64; `abs_sum` (optional) gets sum_t |a_t w_t| per element.
inline std::vector<double> Reference(const std::vector<float>& a, const std::vector<float>& w,
                                     const std::vector<float>* c0, int m, int n, int k,
                                     std::vector<double>* abs_sum = nullptr) {
  std::vector<double> c(size_t(m) * n);
  if (abs_sum) abs_sum->assign(c.size(), 0.0);
  for (int j = 0; j < n; ++j) {
    const float* wr = w.data() + size_t(j) * k;
    for (int i = 0; i < m; ++i) {
      const float* ar = a.data() + size_t(i) * k;
      double s[4] = {0, 0, 0, 0};  // four chains: the reference is the slow part of this test
      for (int t = 0; t < k; t += 4) {
        for (int u = 0; u < 4 && t + u < k; ++u) s[u] += double(ar[t + u]) * wr[t + u];
      }
      const size_t e = size_t(i) * n + j;
      c[e] = s[0] + s[1] + s[2] + s[3] + (c0 ? (*c0)[e] : 0.0);
      if (abs_sum) {
        double as = 0;
        for (int t = 0; t < k; ++t) as += std::fabs(double(ar[t]) * wr[t]);
        (*abs_sum)[e] = as;
      }
    }
  }
  return c;
}

struct Weights {
  int n, k;
  std::vector<float> w;  // [n, k], bf16-exact
  GuardedBuffer<__nv_bfloat16> dw;
  Weights(int n_, int k_, uint32_t seed)
      : n(n_), k(k_), w(testing::RandomFloats(size_t(n) * k, -1, 1, seed)), dw(w.size()) {
    dw.Upload(testing::ToBf16(w));
  }
};

// Whether the fp64 reference of an (m, n, k) product is cheap enough for a unit test (~1 s).
inline bool Affordable(int m, int n, int k) {
  return double(m) * n * k <= 1.2e9;
}

// One problem's activations and outputs: A, bf16 and fp32 C, the initial C for accumulate, and a
// workspace sized for split_k <= kGemvMaxSplitK (m <= 8; m > 8 reduces in shared memory).
// Params(split): split >= 1 is split_k with the CTA's warps sharing each tile
// (GemvWarpTiles::kNever); split 0 is split_k 1 with each warp streaming whole tiles
// (GemvWarpTiles::kAlways), the path ChooseGemvWarpTiles picks for large n.
struct Problem {
  const Weights& wt;
  int m;
  std::vector<float> a, c0;
  GuardedBuffer<__nv_bfloat16> da, dc;
  GuardedBuffer<float> dc32, ws;
  Problem(const Weights& w, int m_, uint32_t seed)
      : wt(w),
        m(m_),
        a(testing::RandomFloats(size_t(m) * w.k, -1, 1, seed)),
        c0(testing::RandomFloats(size_t(m) * w.n, -4, 4, seed + 1)),
        da(a.size()),
        dc(c0.size()),
        dc32(c0.size()),
        ws(size_t(kGemvMaxSplitK) * m * w.n) {
    da.Upload(testing::ToBf16(a));
  }
  GemvParams Params(int split_k, bool fp32 = false, bool accumulate = false) const {
    GemvParams p;
    p.a = da.get();
    p.w = wt.dw.get();
    if (fp32) {
      p.c_f32 = dc32.get();
    } else {
      p.c = dc.get();
    }
    p.m = m;
    p.n = wt.n;
    p.k = wt.k;
    p.epilogue = accumulate ? GemvEpilogue::kAccumulate : GemvEpilogue::kStore;
    p.split_k = std::max(split_k, 1);
    p.warp_tiles = split_k == 0 ? GemvWarpTiles::kAlways : GemvWarpTiles::kNever;
    p.workspace = ws.get();
    p.workspace_bytes = ws.size() * sizeof(float);
    return p;
  }
};

// A few split_k values for each kernel: 0 (warp tiles), 1 and 4 at m <= 8; 1 and 3 (or as many as
// k's 64-wide stages allow) at m > 8.
inline std::vector<int> FewSplits(int m, int k) {
  if (m <= kGemvRegisterMaxM) return {0, 1, 4};
  const int most = std::min(3, (k + 63) / 64);
  return most > 1 ? std::vector<int>{1, most} : std::vector<int>{1};
}

inline std::vector<int> Splits(int m, int n, int k) {
  std::vector<int> s = m <= kGemvRegisterMaxM
                           ? std::vector<int>{0, 1, ChooseGemvSplitK(m, n, k, NumSms()), 4}
                           : std::vector<int>{1, ChooseGemvSplitK(m, n, k, NumSms()),
                                              std::min(kGemvTcMaxSplitK, (k + 63) / 64)};
  std::sort(s.begin(), s.end());
  s.erase(std::unique(s.begin(), s.end()), s.end());
  return s;
}

// transformers' bf16 LlamaRMSNorm of A's rows, emulated in fp32 (the kernel's prologue).
inline std::vector<float> NormalizedA(const std::vector<float>& a, const std::vector<float>& w,
                                      int m, int k, float eps) {
  std::vector<float> out(a.size());
  for (int i = 0; i < m; ++i) {
    double ss = 0;
    for (int t = 0; t < k; ++t) ss += double(a[size_t(i) * k + t]) * a[size_t(i) * k + t];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / k + eps));
    for (int t = 0; t < k; ++t) {
      const size_t e = size_t(i) * k + t;
      out[e] = testing::RoundBf16(w[t] * testing::RoundBf16(a[e] * inv));
    }
  }
  return out;
}

// Two launches captured on `stream` as one graph and instantiated (the PDL chain of a decode
// step); nullptr, with the failure recorded, if any of it fails.
inline cudaGraphExec_t InstantiatePair(const GemvParams& first, const GemvParams& second,
                                       cudaStream_t stream) {
  cudaGraph_t graph = nullptr;
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) != cudaSuccess) {
    ADD_FAILURE() << "cudaStreamBeginCapture failed";
    return nullptr;
  }
  absl::Status st = LaunchGemv(first, stream);
  if (st.ok()) st = LaunchGemv(second, stream);
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(end, cudaSuccess) << cudaGetErrorString(end);
  cudaGraphExec_t exec = nullptr;
  if (st.ok() && end == cudaSuccess) {
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    EXPECT_EQ(inst, cudaSuccess) << cudaGetErrorString(inst);
    if (inst != cudaSuccess) exec = nullptr;
  }
  if (graph != nullptr) cudaGraphDestroy(graph);
  return exec;
}

// The sums of squares of x's rows ([m, n]) per group of kGemvSumSqGroup columns, [m,
// GemvSumSqGroups(n)]: what a GEMV's sumsq_out leaves, summed in fp64.
inline std::vector<float> RowSumSq(const std::vector<float>& x, int m, int n) {
  const int groups = GemvSumSqGroups(n);
  std::vector<float> out(size_t(m) * groups);
  for (int i = 0; i < m; ++i) {
    for (int g = 0; g < groups; ++g) {
      double s = 0;
      for (int c = g * kGemvSumSqGroup; c < std::min(n, (g + 1) * kGemvSumSqGroup); ++c) {
        s += double(x[size_t(i) * n + c]) * x[size_t(i) * n + c];
      }
      out[size_t(i) * groups + g] = float(s);
    }
  }
  return out;
}

}  // namespace ts::kernels::gemv_test
