// tailserve-cublaslt-sweep: is a better cuBLASLt configuration the lever for decode at batches
// above the GEMV's 8 rows? For the Llama-3.2-1B and Llama-3.1-8B projections (qkv, o, gate_up,
// down) at M = 8, 16, 32, 64, 128 it times every algorithm cuBLASLt's heuristic offers (up to 32
// asked) and each one's split-K variants (2..16 splits, in-place and fp32 reduction, where
// cublasLtMatmulAlgoCheck accepts them), and prints the heuristic's first choice, the fastest
// candidate, and the HBM roof (W + A + C bytes at the copy bandwidth measured first,
// bench/common/copy_roof.h).
//
// Method: each candidate is launched alone between two CUDA events, 3 warm-ups then the median of
// 10; W rotates over 4 copies so L2 never holds it. Standalone launches carry launch latency
// (a few us) that a graph hides, so small shapes read high; the comparison between candidates of
// one shape is what this tool is for.
//
// The row counts are the arguments (default 8 16 32 64 128); prefill and the device loop's mixed
// steps run M = 256 and up, where a GEMM also meets the tensor cores' roof, printed beside the
// bytes' (dense bf16 at 989 TFLOP/s).
//
// A second table times split-K done by hand: one strided-batched GEMM over `splits` slices of K
// that writes fp32 partials [splits, m, n] and no reduction, the heuristic's first algorithm for
// it. A kernel of ours would then add the partials and fuse what follows (the residual add and
// the next rmsnorm), one graph node where cuBLASLt's split-K runs its reduce kernel and then the
// norm: it pays if batched_us stays near the heuristic's top1_us, which includes its reduce.
//
//   tailserve-cublaslt-sweep [M ...]
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include "bench/common/copy_roof.h"
#include "cublaslt_setup.h"  // beside this file

namespace {

using ts::bench::Projection;

#define CHECK(x) \
  ts::bench::CheckOrExit("tailserve-cublaslt-sweep", static_cast<int>(x), #x, __LINE__)

constexpr double kPeakFlopsPerUs = 989e6;  // the H200's dense bf16 tensor-core peak
constexpr int kCopies = 4;
constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // as kernels/gemm.cuh's default

struct Candidate {
  cublasLtMatmulAlgo_t algo;
  uint32_t splits;  // 0: the heuristic's own configuration
};

// The heuristic's algorithms plus their split-K variants that cuBLASLt accepts for this problem.
std::vector<Candidate> Candidates(cublasLtHandle_t h, cublasLtMatmulDesc_t desc,
                                  cublasLtMatrixLayout_t wl, cublasLtMatrixLayout_t al,
                                  cublasLtMatrixLayout_t cl) {
  cublasLtMatmulPreference_t pref;
  CHECK(ts::bench::CreatePreference(kWorkspaceBytes, &pref));
  cublasLtMatmulHeuristicResult_t res[32];
  int found = 0;
  CHECK(cublasLtMatmulAlgoGetHeuristic(h, desc, wl, al, cl, cl, pref, 32, res, &found));
  cublasLtMatmulPreferenceDestroy(pref);
  std::vector<Candidate> out;
  for (int i = 0; i < found; ++i) {
    if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
    out.push_back({res[i].algo, 0});
    for (uint32_t splits : {2u, 3u, 4u, 6u, 8u, 12u, 16u}) {
      for (uint32_t scheme : {static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_INPLACE),
                              static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE)}) {
        cublasLtMatmulAlgo_t a = res[i].algo;
        cublasLtMatmulHeuristicResult_t check{};
        if (cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits,
                                                 sizeof(splits)) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                                 sizeof(scheme)) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulAlgoCheck(h, desc, wl, al, cl, cl, &a, &check) != CUBLAS_STATUS_SUCCESS ||
            check.workspaceSize > kWorkspaceBytes) {
          continue;
        }
        out.push_back({a, splits});
      }
    }
  }
  return out;
}

// Median us of 10 launches after 3 warm-ups, each alone between two events; launch(rep) enqueues
// one (rotating W by rep). 0 when a launch is refused.
template <typename Launch>
float MedianUs(Launch launch, cudaStream_t stream, cudaEvent_t e0, cudaEvent_t e1) {
  std::vector<float> us;
  for (int rep = 0; rep < 13; ++rep) {
    CHECK(cudaEventRecord(e0, stream));
    if (launch(rep) != CUBLAS_STATUS_SUCCESS) return 0.f;
    CHECK(cudaEventRecord(e1, stream));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (rep >= 3) us.push_back(ms * 1000);
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// Median us of C_s = A[:, s k/splits ...] W[:, s k/splits ...]^T for s < splits, as one strided
// batch into fp32 partials `c32` ([splits][m][n]); 0 when cuBLASLt offers no algorithm. `desc` is
// the row-major product's (the output type lives in the layouts).
float TimeBatchedSplitK(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, const Projection& s, int m,
                        int splits, const __nv_bfloat16* w, size_t w_copy_elems,
                        const __nv_bfloat16* a, float* c32, void* ws, cudaStream_t stream,
                        cudaEvent_t e0, cudaEvent_t e1) {
  const int64_t ks = s.k / splits;
  // Column-major views of the row-major operands: W slice s is rows [s ks, s ks + ks) of the
  // k-by-n view (leading dimension k), A slice s likewise of k-by-m; C_s is n-by-m fp32.
  cublasLtMatrixLayout_t wl, al, cl;
  CHECK(cublasLtMatrixLayoutCreate(&wl, CUDA_R_16BF, ks, s.n, s.k));
  CHECK(cublasLtMatrixLayoutCreate(&al, CUDA_R_16BF, ks, m, s.k));
  CHECK(cublasLtMatrixLayoutCreate(&cl, CUDA_R_32F, s.n, m, s.n));
  const int32_t count = splits;
  const int64_t c_stride = int64_t{s.n} * m;
  for (auto [layout, stride] : {std::pair{wl, ks}, std::pair{al, ks}, std::pair{cl, c_stride}}) {
    CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                           sizeof(count)));
    CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                           &stride, sizeof(stride)));
  }
  cublasLtMatmulPreference_t pref;
  CHECK(cublasLtMatmulPreferenceCreate(&pref));
  size_t ws_bytes = kWorkspaceBytes;
  CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &ws_bytes, sizeof(ws_bytes)));
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  float median = 0.f;
  if (cublasLtMatmulAlgoGetHeuristic(h, desc, wl, al, cl, cl, pref, 1, &res, &found) ==
          CUBLAS_STATUS_SUCCESS &&
      found > 0) {
    const float alpha = 1.f, beta = 0.f;
    median = MedianUs(
        [&](int rep) {
          return cublasLtMatmul(h, desc, &alpha, w + size_t(rep % kCopies) * w_copy_elems, wl, a,
                                al, &beta, c32, cl, c32, cl, &res.algo, ws, kWorkspaceBytes,
                                stream);
        },
        stream, e0, e1);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(wl);
  cublasLtMatrixLayoutDestroy(al);
  cublasLtMatrixLayoutDestroy(cl);
  return median;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> ms;
  for (int i = 1; i < argc; ++i) {
    const int m = std::atoi(argv[i]);
    if (m < 1 || m > 65536) {
      std::fprintf(stderr, "tailserve-cublaslt-sweep: bad row count '%s'\n", argv[i]);
      return 2;
    }
    ms.push_back(m);
  }
  if (ms.empty()) ms = {8, 16, 32, 64, 128};
  const auto& shapes = ts::bench::kProjections;
  const int kMaxM = *std::max_element(ms.begin(), ms.end());
  const auto [max_w, max_k, max_n] = ts::bench::MaxExtents(shapes);
  cublasLtHandle_t h;
  CHECK(cublasLtCreate(&h));
  cublasLtMatmulDesc_t desc;
  CHECK(ts::bench::CreateRowMajorDesc(&desc));
  void* ws;
  __nv_bfloat16 *w, *a, *c;
  CHECK(cudaMalloc(&ws, kWorkspaceBytes));
  CHECK(cudaMalloc(&w, max_w * kCopies * sizeof(__nv_bfloat16)));
  CHECK(cudaMalloc(&a, kMaxM * max_k * sizeof(__nv_bfloat16)));
  CHECK(cudaMalloc(&c, kMaxM * max_n * sizeof(__nv_bfloat16)));
  // 0x3c3c is bf16 0.0115: finite, non-zero products.
  CHECK(cudaMemset(w, 0x3c, max_w * kCopies * sizeof(__nv_bfloat16)));
  CHECK(cudaMemset(a, 0x3c, kMaxM * max_k * sizeof(__nv_bfloat16)));
  cudaStream_t stream;
  cudaEvent_t e0, e1;
  CHECK(cudaStreamCreate(&stream));
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));

  const double copy_gbps = ts::bench::MeasureCopyBandwidthGbps();
  const double roof_bytes_per_us = copy_gbps * 1e3;
  std::printf("device-to-device copy: %.0f GB/s (read + write): the roof\n", copy_gbps);
  std::printf("%-11s %4s %9s %9s %9s %9s %11s %s\n", "shape", "m", "top1_us", "best_us", "roof_us",
              "flop_us", "best_splits", "candidates");
  std::vector<float> top1;  // per (m, shape), in loop order, for the second table
  for (int m : ms) {
    for (const Projection& s : shapes) {
      cublasLtMatrixLayout_t wl, al, cl;
      CHECK(ts::bench::CreateLayouts(s, m, &wl, &al, &cl));
      const std::vector<Candidate> cand = Candidates(h, desc, wl, al, cl);
      std::vector<float> median(cand.size(), 1e30f);
      for (size_t i = 0; i < cand.size(); ++i) {
        const float alpha = 1.f, beta = 0.f;
        const float us = MedianUs(
            [&](int rep) {
              return cublasLtMatmul(h, desc, &alpha, w + size_t(rep % kCopies) * max_w, wl, a, al,
                                    &beta, c, cl, c, cl, &cand[i].algo, ws, kWorkspaceBytes,
                                    stream);
            },
            stream, e0, e1);
        // 0: a candidate the check accepted but the launch refuses; skip it
        if (us > 0.f) median[i] = us;
      }
      const double roof =
          (double(s.n) * s.k + double(m) * (s.k + s.n)) * sizeof(__nv_bfloat16) / roof_bytes_per_us;
      top1.push_back(cand.empty() ? 0.f : median[0]);
      if (cand.empty()) {
        std::printf("%-11s %4d  no algorithm\n", s.name, m);
      } else {
        const size_t best = std::min_element(median.begin(), median.end()) - median.begin();
        const double flop_us = 2.0 * m * s.n * s.k / kPeakFlopsPerUs;
        std::printf("%-11s %4d %9.1f %9.1f %9.1f %9.1f %11u %zu\n", s.name, m, median[0],
                    median[best], roof, flop_us, cand[best].splits, cand.size());
      }
      cublasLtMatrixLayoutDestroy(wl);
      cublasLtMatrixLayoutDestroy(al);
      cublasLtMatrixLayoutDestroy(cl);
    }
  }

  constexpr int kSplits[] = {2, 4, 8};
  float* c32;
  CHECK(cudaMalloc(&c32, size_t{8} * kMaxM * max_n * sizeof(float)));
  std::printf("\nsplit-K by hand: one strided-batched GEMM into fp32 partials, no reduce\n");
  std::printf("%-11s %4s %9s %9s %9s %9s\n", "shape", "m", "top1_us", "batch2_us", "batch4_us",
              "batch8_us");
  size_t row = 0;
  for (int m : ms) {
    for (const Projection& s : shapes) {
      std::printf("%-11s %4d %9.1f", s.name, m, top1[row++]);
      for (int splits : kSplits) {
        const float us =
            s.k % (8 * splits) == 0
                ? TimeBatchedSplitK(h, desc, s, m, splits, w, max_w, a, c32, ws, stream, e0, e1)
                : 0.f;
        std::printf(" %9.1f", us);
      }
      std::printf("\n");
    }
  }
  CHECK(cudaDeviceSynchronize());
  return 0;
}
