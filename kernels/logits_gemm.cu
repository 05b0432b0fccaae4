#include "kernels/logits_gemm.cuh"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda_check.h"

namespace ts::kernels {

absl::StatusOr<std::unique_ptr<LogitsGemm>> LogitsGemm::Create(void* workspace,
                                                               size_t workspace_bytes) {
  std::unique_ptr<LogitsGemm> g(new LogitsGemm());
  g->workspace_ = workspace;
  g->workspace_bytes_ = workspace_bytes;
  TS_CUDA_RETURN_IF_ERROR(cublasLtCreate(&g->handle_));
  TS_CUDA_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&g->desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_w = CUBLAS_OP_T, trans_a = CUBLAS_OP_N;
  TS_CUDA_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(g->desc_, CUBLASLT_MATMUL_DESC_TRANSA,
                                                         &trans_w, sizeof(trans_w)));
  TS_CUDA_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(g->desc_, CUBLASLT_MATMUL_DESC_TRANSB,
                                                         &trans_a, sizeof(trans_a)));
  return g;
}

LogitsGemm::~LogitsGemm() {
  for (auto& [key, plan] : plans_) {
    cublasLtMatrixLayoutDestroy(plan.w_layout);
    cublasLtMatrixLayoutDestroy(plan.a_layout);
    cublasLtMatrixLayoutDestroy(plan.c_layout);
  }
  if (desc_ != nullptr) cublasLtMatmulDescDestroy(desc_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

absl::Status LogitsGemm::Plan(int32_t m, int32_t n, int32_t k) {
  if (m < 1 || n < 1 || k < 8 || k % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lm_head gemm: bad shape m=", m, " n=", n, " k=", k));
  }
  const std::array<int32_t, 3> key{m, n, k};
  if (plans_.count(key) != 0) return absl::OkStatus();
  PlanEntry plan;
  cublasLtMatmulPreference_t pref = nullptr;
  absl::Status status = [&]() -> absl::Status {
    TS_CUDA_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan.w_layout, CUDA_R_16BF, k, n, k));
    TS_CUDA_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan.a_layout, CUDA_R_16BF, k, m, k));
    TS_CUDA_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan.c_layout, CUDA_R_32F, n, m, n));
    TS_CUDA_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&pref));
    TS_CUDA_RETURN_IF_ERROR(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &workspace_bytes_, sizeof(workspace_bytes_)));
    // Operands are 256-B aligned buffers with 16-B rows (k % 8 == 0); output rows are n floats.
    const uint32_t ab_align = 16, c_align = n % 4 == 0 ? 16 : 4;
    for (auto [attr, v] : {std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, ab_align},
                           std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, ab_align},
                           std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, c_align},
                           std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, c_align}}) {
      TS_CUDA_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(pref, attr, &v, sizeof(v)));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    TS_CUDA_RETURN_IF_ERROR(
        cublasLtMatmulAlgoGetHeuristic(handle_, desc_, plan.w_layout, plan.a_layout, plan.c_layout,
                                       plan.c_layout, pref, 1, &result, &found));
    if (found == 0 || result.state != CUBLAS_STATUS_SUCCESS) {
      return absl::NotFoundError(absl::StrCat("lm_head gemm: cuBLASLt has no algorithm for m=", m,
                                              " n=", n, " k=", k, " (bf16 in, fp32 out)"));
    }
    plan.algo = result.algo;
    return absl::OkStatus();
  }();
  if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
  if (!status.ok()) {
    if (plan.w_layout) cublasLtMatrixLayoutDestroy(plan.w_layout);
    if (plan.a_layout) cublasLtMatrixLayoutDestroy(plan.a_layout);
    if (plan.c_layout) cublasLtMatrixLayoutDestroy(plan.c_layout);
    return status;
  }
  plans_.emplace(key, plan);
  return absl::OkStatus();
}

absl::Status LogitsGemm::Launch(const __nv_bfloat16* a, const __nv_bfloat16* w, float* out,
                                int32_t m, int32_t n, int32_t k, cudaStream_t stream) const {
  const auto it = plans_.find({m, n, k});
  if (it == plans_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("lm_head gemm: shape m=", m, " n=", n, " k=", k, " was not planned"));
  }
  const PlanEntry& plan = it->second;
  const float alpha = 1.0f, beta = 0.0f;  // host scalars: baked into a captured graph
  TS_CUDA_RETURN_IF_ERROR(cublasLtMatmul(handle_, desc_, &alpha, w, plan.w_layout, a, plan.a_layout,
                                         &beta, out, plan.c_layout, out, plan.c_layout, &plan.algo,
                                         workspace_, workspace_bytes_, stream));
  return absl::OkStatus();
}

}  // namespace ts::kernels
