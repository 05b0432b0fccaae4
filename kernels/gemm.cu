#include "kernels/gemm.cuh"

#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda_check.h"

namespace ts::kernels {
namespace {

// The alignment cuBLASLt may assume for A, W and C. Its default is 256 bytes; our operands are
// slices of larger buffers (per-layer weights, per-bucket activations) aligned to 16 only.
constexpr uint32_t kAlignBytes = 16;

absl::Status ValidateShape(const GemmShape& s) {
  TS_RETURN_IF_ERROR(RequirePositive("gemm.m", s.m));
  TS_RETURN_IF_ERROR(RequireMultipleOf("gemm.n", s.n, 8));
  TS_RETURN_IF_ERROR(RequireMultipleOf("gemm.k", s.k, 8));
  return absl::OkStatus();
}

std::string ShapeName(int32_t m, int32_t n, int32_t k) {
  return absl::StrCat("(m=", m, ", n=", n, ", k=", k, ")");
}

}  // namespace

absl::StatusOr<std::unique_ptr<Gemm>> Gemm::Create(const GemmOptions& options) {
  std::unique_ptr<Gemm> g(new Gemm());
  TS_CUDA_RETURN_IF_ERROR(cublasLtCreate(&g->handle_));
  TS_CUDA_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&g->desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_w = CUBLAS_OP_T, trans_a = CUBLAS_OP_N;
  TS_CUDA_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(g->desc_, CUBLASLT_MATMUL_DESC_TRANSA,
                                                         &trans_w, sizeof(trans_w)));
  TS_CUDA_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(g->desc_, CUBLASLT_MATMUL_DESC_TRANSB,
                                                         &trans_a, sizeof(trans_a)));
  g->workspace_bytes_ = options.workspace_bytes;
  if (g->workspace_bytes_ > 0) {
    TS_CUDA_RETURN_IF_ERROR(cudaMalloc(&g->workspace_, g->workspace_bytes_));
    // cuBLASLt's split-K reduce reads a few words of the workspace that nothing wrote before
    // (compute-sanitizer initcheck, 2026-12-01, splitKreduce_kernel at workspace + 0x400): its
    // counters, which it leaves as it found them. Zero, once, as the arena is, so that the first
    // launch does not depend on what cudaMalloc happened to return.
    TS_CUDA_RETURN_IF_ERROR(cudaMemset(g->workspace_, 0, g->workspace_bytes_));
  }
  return g;
}

Gemm::~Gemm() {
  for (auto& [key, plan] : plans_) {
    cublasLtMatrixLayoutDestroy(plan.w_layout);
    cublasLtMatrixLayoutDestroy(plan.a_layout);
    cublasLtMatrixLayoutDestroy(plan.c_layout);
  }
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (desc_ != nullptr) cublasLtMatmulDescDestroy(desc_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

absl::Status Gemm::Plan(const GemmShape& shape) {
  TS_RETURN_IF_ERROR(ValidateShape(shape));
  const Key key{shape.m, shape.n, shape.k};
  if (plans_.count(key) != 0) return absl::OkStatus();

  // Row-major C[m,n] = A[m,k] W[n,k]^T is column-major C^T[n,m] = W^T[n,k] A^T[k,m]: cuBLASLt's A
  // operand is W (col-major [k, n], transposed), its B operand is A (col-major [k, m]).
  PlanEntry plan;
  auto destroy = [&plan] {
    if (plan.w_layout) cublasLtMatrixLayoutDestroy(plan.w_layout);
    if (plan.a_layout) cublasLtMatrixLayoutDestroy(plan.a_layout);
    if (plan.c_layout) cublasLtMatrixLayoutDestroy(plan.c_layout);
  };
  cublasLtMatmulPreference_t pref = nullptr;
  absl::Status status = [&]() -> absl::Status {
    TS_CUDA_RETURN_IF_ERROR(
        cublasLtMatrixLayoutCreate(&plan.w_layout, CUDA_R_16BF, shape.k, shape.n, shape.k));
    TS_CUDA_RETURN_IF_ERROR(
        cublasLtMatrixLayoutCreate(&plan.a_layout, CUDA_R_16BF, shape.k, shape.m, shape.k));
    TS_CUDA_RETURN_IF_ERROR(
        cublasLtMatrixLayoutCreate(&plan.c_layout, CUDA_R_16BF, shape.n, shape.m, shape.n));
    TS_CUDA_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&pref));
    TS_CUDA_RETURN_IF_ERROR(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &workspace_bytes_, sizeof(workspace_bytes_)));
    for (auto attr :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      TS_CUDA_RETURN_IF_ERROR(
          cublasLtMatmulPreferenceSetAttribute(pref, attr, &kAlignBytes, sizeof(kAlignBytes)));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    TS_CUDA_RETURN_IF_ERROR(
        cublasLtMatmulAlgoGetHeuristic(handle_, desc_, plan.w_layout, plan.a_layout, plan.c_layout,
                                       plan.c_layout, pref, 1, &result, &found));
    if (found == 0 || result.state != CUBLAS_STATUS_SUCCESS) {
      return absl::NotFoundError(absl::StrCat("gemm: cuBLASLt has no algorithm for ",
                                              ShapeName(shape.m, shape.n, shape.k)));
    }
    plan.algo = result.algo;
    return absl::OkStatus();
  }();
  if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
  if (!status.ok()) {
    destroy();
    return status;
  }
  plans_.emplace(key, plan);
  return absl::OkStatus();
}

bool Gemm::IsPlanned(const GemmShape& shape) const {
  return plans_.count(Key{shape.m, shape.n, shape.k}) != 0;
}

absl::Status Gemm::Launch(const GemmParams& p, cudaStream_t stream) const {
  TS_RETURN_IF_ERROR(ValidateShape(GemmShape{p.m, p.n, p.k}));
  TS_RETURN_IF_ERROR(RequirePointer("gemm.a", p.a, kAlignBytes));
  TS_RETURN_IF_ERROR(RequirePointer("gemm.w", p.w, kAlignBytes));
  TS_RETURN_IF_ERROR(RequirePointer("gemm.c", p.c, kAlignBytes));
  const auto it = plans_.find(Key{p.m, p.n, p.k});
  if (it == plans_.end()) {
    return absl::FailedPreconditionError(absl::StrCat("gemm: shape ", ShapeName(p.m, p.n, p.k),
                                                      " was not planned (Gemm::Plan at setup)"));
  }
  const PlanEntry& plan = it->second;
  // Host scalars: under capture cuBLASLt bakes their values into the graph node.
  const float alpha = 1.0f, beta = p.accumulate ? 1.0f : 0.0f;
  TS_CUDA_RETURN_IF_ERROR(cublasLtMatmul(
      handle_, desc_, &alpha, p.w, plan.w_layout, p.a, plan.a_layout, &beta, p.c, plan.c_layout,
      p.c, plan.c_layout, &plan.algo, workspace_, workspace_bytes_, stream));
  return absl::OkStatus();
}

}  // namespace ts::kernels
