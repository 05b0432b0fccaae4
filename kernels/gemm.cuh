// bf16 GEMM through cuBLASLt with fp32 accumulation, for the Linear layers:
//   C[m, n] = A[m, k] * W[n, k]^T  (+ C when accumulate, e.g. o_proj/down_proj adding into the
//   residual stream)
// all row-major, W laid out like a Hugging Face Linear weight [out_features, in_features].
//
// Everything cuBLASLt needs is made at setup: Create() makes the handle and allocates the
// workspace once; Plan() builds the matrix layouts and runs the algorithm heuristic for one
// (m, n, k). Launch() only looks the plan up and enqueues cublasLtMatmul, so it is capturable in
// a (device-launchable) CUDA graph; a shape that was not planned is an error, never a lazy plan.
//
// Which shapes to plan: the backend plans, for every batch bucket M it captures (decode buckets
// and prefill chunk sizes), the five Llama projections: qkv (N = (Hq + 2 Hkv) * D, K = hidden),
// o (N = hidden, K = Hq * D), gate_up (N = 2 * intermediate, K = hidden), down (N = hidden,
// K = intermediate) and lm_head (N = vocab, K = hidden). The tests plan M in {1, 3, 17, 64} with
// small, odd and 8B-sized (N, K).
//
// One Gemm owns one workspace, and split-K algorithms keep counters there: launches through one
// Gemm must be ordered (one stream, or one graph). Use one Gemm per concurrent stream.
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

struct GemmShape {
  int32_t m = 0;  // rows of A and C (tokens)
  int32_t n = 0;  // rows of W, columns of C (output features); multiple of 8
  int32_t k = 0;  // columns of A and W (input features); multiple of 8
};

struct GemmOptions {
  // cuBLASLt workspace, allocated once by Create(). 32 MiB covers Hopper's split-K algorithms.
  size_t workspace_bytes = size_t{32} << 20;
};

struct GemmParams {
  const __nv_bfloat16* a = nullptr;  // [m, k] row-major, 16-byte aligned
  const __nv_bfloat16* w = nullptr;  // [n, k] row-major, 16-byte aligned
  __nv_bfloat16* c = nullptr;        // [m, n] row-major, 16-byte aligned; read when accumulate
  int32_t m = 0, n = 0, k = 0;       // must have been planned
  bool accumulate = false;           // false: C = A W^T; true: C = A W^T + C (beta = 1)
};

class Gemm {
 public:
  static absl::StatusOr<std::unique_ptr<Gemm>> Create(const GemmOptions& options = {});
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // Setup time, outside any capture. Idempotent. InvalidArgument for a bad shape (naming the
  // field), NotFound when cuBLASLt has no algorithm for it.
  absl::Status Plan(const GemmShape& shape);
  bool IsPlanned(const GemmShape& shape) const;

  // Validates params (InvalidArgument naming the field; FailedPrecondition for an unplanned
  // shape) and enqueues the matmul on `stream`. Graph-capturable: no allocation, no sync.
  absl::Status Launch(const GemmParams& p, cudaStream_t stream) const;

  size_t workspace_bytes() const { return workspace_bytes_; }

 private:
  struct PlanEntry {
    cublasLtMatrixLayout_t w_layout = nullptr;  // cuBLASLt "A": W as col-major [k, n], op T
    cublasLtMatrixLayout_t a_layout = nullptr;  // cuBLASLt "B": A as col-major [k, m], op N
    cublasLtMatrixLayout_t c_layout = nullptr;  // C and D: col-major [n, m] = row-major [m, n]
    cublasLtMatmulAlgo_t algo{};
  };
  using Key = std::array<int32_t, 3>;  // {m, n, k}

  Gemm() = default;

  cublasLtHandle_t handle_ = nullptr;
  cublasLtMatmulDesc_t desc_ = nullptr;  // shape-independent: bf16 in/out, fp32 compute, W^T
  void* workspace_ = nullptr;            // [workspace_bytes_] device
  size_t workspace_bytes_ = 0;
  std::map<Key, PlanEntry> plans_;
};

}  // namespace ts::kernels
