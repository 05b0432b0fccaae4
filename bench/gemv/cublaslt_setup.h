// What tailserve-cublaslt-sweep, -search and -pdl share: the Llama projections they time, the
// cuBLASLt problem set up as kernels/gemm.cu sets it up, so that the tools time the GEMMs the
// decode step runs, and the timing of one configuration in a graph.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <vector>

namespace ts::bench {

// Exits 1, naming the tool, the call and the line, when a CUDA or cuBLASLt call returned `rc` != 0.
inline void CheckOrExit(const char* tool, int rc, const char* what, int line) {
  if (rc == 0) return;
  std::fprintf(stderr, "%s: %s failed (%d) at line %d\n", tool, what, rc, line);
  std::exit(1);
}

struct Projection {
  const char* name;
  int n, k;  // W is [n, k]
};

inline constexpr Projection kProjections[] = {
    {"8b.qkv", 6144, 4096},      {"8b.o", 4096, 4096},    {"8b.gate_up", 28672, 4096},
    {"8b.down", 4096, 14336},    {"1b.qkv", 3072, 2048},  {"1b.o", 2048, 2048},
    {"1b.gate_up", 16384, 2048}, {"1b.down", 2048, 8192},
};

// The largest W (elements), k and n over `ps`: what the tools' buffers are sized for.
struct Extents {
  size_t w = 0, k = 0, n = 0;
};
inline Extents MaxExtents(std::span<const Projection> ps) {
  Extents e;
  for (const Projection& p : ps) {
    e.w = e.w > size_t(p.n) * p.k ? e.w : size_t(p.n) * p.k;
    e.k = e.k > size_t(p.k) ? e.k : size_t(p.k);
    e.n = e.n > size_t(p.n) ? e.n : size_t(p.n);
  }
  return e;
}

// Row-major C[m, n] = A[m, k] W[n, k]^T is column-major C^T[n, m] = W^T A^T: cuBLASLt's A operand
// is W (transposed), its B operand is A. fp32 compute and scale.
inline cublasStatus_t CreateRowMajorDesc(cublasLtMatmulDesc_t* desc) {
  cublasStatus_t s = cublasLtMatmulDescCreate(desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  const cublasOperation_t trans_w = CUBLAS_OP_T, trans_a = CUBLAS_OP_N;
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatmulDescSetAttribute(*desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_w,
                                       sizeof(trans_w));
  }
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatmulDescSetAttribute(*desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_a,
                                       sizeof(trans_a));
  }
  return s;
}

// The bf16 layouts of W, A and C for `m` rows of projection `p`.
inline cublasStatus_t CreateLayouts(const Projection& p, int m, cublasLtMatrixLayout_t* w,
                                    cublasLtMatrixLayout_t* a, cublasLtMatrixLayout_t* c) {
  cublasStatus_t s = cublasLtMatrixLayoutCreate(w, CUDA_R_16BF, p.k, p.n, p.k);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(a, CUDA_R_16BF, p.k, m, p.k);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(c, CUDA_R_16BF, p.n, m, p.n);
  return s;
}

// The heuristic's preference as kernels/gemm.cu asks: `workspace` bytes at most, operands aligned
// to `align` bytes (kernels/gemm.cu asks 16).
inline cublasStatus_t CreatePreference(size_t workspace, cublasLtMatmulPreference_t* pref,
                                       uint32_t align = 16) {
  cublasStatus_t s = cublasLtMatmulPreferenceCreate(pref);
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatmulPreferenceSetAttribute(*pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &workspace, sizeof(workspace));
  }
  for (auto attr :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    if (s == CUBLAS_STATUS_SUCCESS) {
      s = cublasLtMatmulPreferenceSetAttribute(*pref, attr, &align, sizeof(align));
    }
  }
  return s;
}

// One GEMM as the tools time it; W rotates over `copies` copies so that L2 never holds it.
struct TimedGemm {
  cublasLtHandle_t h = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t wl = nullptr, al = nullptr, cl = nullptr;
  const __nv_bfloat16* w = nullptr;  // [copies][n, k]
  size_t w_elems = 0;                // n * k
  int copies = 0;
  const __nv_bfloat16* a = nullptr;  // [m, k]
  __nv_bfloat16* c = nullptr;        // [m, n]
  void* ws = nullptr;                // [ws_bytes]
  size_t ws_bytes = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
};

// One launch of `algo` on W copy `copy % copies`.
inline cublasStatus_t LaunchCopy(const TimedGemm& p, const cublasLtMatmulAlgo_t& algo, int copy) {
  const float alpha = 1.f, beta = 0.f;
  return cublasLtMatmul(p.h, p.desc, &alpha, p.w + size_t(copy % p.copies) * p.w_elems, p.wl, p.a,
                        p.al, &beta, p.c, p.cl, p.c, p.cl, &algo, p.ws, p.ws_bytes, p.stream);
}

// us per launch in a graph of `launches` back-to-back launches (launch latency hidden, as in a
// decode step), median of 7 replays after 2; 0 when cuBLASLt refuses the launch. A failed CUDA
// call exits, naming `tool`.
inline float GraphUsPerLaunch(const char* tool, const TimedGemm& p,
                              const cublasLtMatmulAlgo_t& algo, int launches) {
  auto check = [tool](cudaError_t rc, const char* what, int line) {
    CheckOrExit(tool, static_cast<int>(rc), what, line);
  };
  cudaGraph_t graph;
  check(cudaStreamBeginCapture(p.stream, cudaStreamCaptureModeThreadLocal), "begin capture",
        __LINE__);
  bool ok = true;
  for (int i = 0; i < launches && ok; ++i) ok = LaunchCopy(p, algo, i) == CUBLAS_STATUS_SUCCESS;
  check(cudaStreamEndCapture(p.stream, &graph), "end capture", __LINE__);
  if (!ok) {
    check(cudaGraphDestroy(graph), "graph destroy", __LINE__);
    return 0.f;
  }
  cudaGraphExec_t exec;
  check(cudaGraphInstantiate(&exec, graph, 0), "instantiate", __LINE__);
  std::vector<float> us;
  for (int rep = 0; rep < 9; ++rep) {
    check(cudaEventRecord(p.e0, p.stream), "event record", __LINE__);
    check(cudaGraphLaunch(exec, p.stream), "graph launch", __LINE__);
    check(cudaEventRecord(p.e1, p.stream), "event record", __LINE__);
    check(cudaEventSynchronize(p.e1), "event sync", __LINE__);
    float ms = 0;
    check(cudaEventElapsedTime(&ms, p.e0, p.e1), "elapsed", __LINE__);
    if (rep >= 2) us.push_back(ms * 1000 / launches);
  }
  check(cudaGraphExecDestroy(exec), "exec destroy", __LINE__);
  check(cudaGraphDestroy(graph), "graph destroy", __LINE__);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace ts::bench
