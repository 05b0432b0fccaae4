// The lm_head GEMM: logits in fp32 through cuBLASLt.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ts::kernels {

// The lm_head GEMM with fp32 output, through cuBLASLt: logits[m, n] = a[m, k] w[n, k]^T, bf16
// operands, fp32 accumulation AND fp32 output, row-major. kernels::Gemm writes bf16 only; bf16
// logits (spacing 0.03 at |logit| ~ 4) create ties and flip greedy tokens that fp32 keeps apart,
// and sampling reads fp32 anyway, so this skips a rounding and a widening pass. n (the vocab) may
// be any size. Plans are made at setup, like kernels::Gemm; launches are graph-capturable.
class LogitsGemm {
 public:
  // `workspace` ([workspace_bytes] device) is owned by the caller; launches through one
  // LogitsGemm must be ordered (one stream).
  static absl::StatusOr<std::unique_ptr<LogitsGemm>> Create(void* workspace,
                                                            size_t workspace_bytes);
  ~LogitsGemm();
  LogitsGemm(const LogitsGemm&) = delete;
  LogitsGemm& operator=(const LogitsGemm&) = delete;
  absl::Status Plan(int32_t m, int32_t n, int32_t k);
  // a: [m, k] bf16, w: [n, k] bf16, out: [m, n] fp32; (m, n, k) planned.
  absl::Status Launch(const __nv_bfloat16* a, const __nv_bfloat16* w, float* out, int32_t m,
                      int32_t n, int32_t k, cudaStream_t stream) const;

 private:
  struct PlanEntry {
    cublasLtMatrixLayout_t w_layout = nullptr;  // W as col-major [k, n], op T
    cublasLtMatrixLayout_t a_layout = nullptr;  // A as col-major [k, m]
    cublasLtMatrixLayout_t c_layout = nullptr;  // out as col-major [n, m], fp32
    cublasLtMatmulAlgo_t algo{};
  };
  LogitsGemm() = default;
  cublasLtHandle_t handle_ = nullptr;
  cublasLtMatmulDesc_t desc_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<std::array<int32_t, 3>, PlanEntry> plans_;
};

}  // namespace ts::kernels
