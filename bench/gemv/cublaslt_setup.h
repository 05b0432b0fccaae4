// What tailserve-cublaslt-sweep and tailserve-cublaslt-search share: the Llama projections they
// time, and the cuBLASLt problem set up as kernels/gemm.cu sets it up, so that both tools time
// the GEMMs the decode step runs.
#pragma once

#include <cublasLt.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>

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

}  // namespace ts::bench
