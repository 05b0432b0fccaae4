// One check macro for CUDA runtime, cuBLAS(Lt) and NCCL return codes: a failure becomes an
// absl::Status that names the call, the code and the source line, and the launcher returns it.
// The server decides what a failure means (docs/style.md, Errors; docs/serving.md), so nothing here
// aborts.
//
//   TS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p, 0, n, stream));
//   TS_CUDA_RETURN_IF_ERROR(cublasLtMatmul(...));
//   TS_CUDA_RETURN_IF_ERROR(cudaGetLastError());  // after every <<<>>> launch
// Also the small parameter checks every launcher starts with (Require*).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

#if __has_include(<nccl.h>)
#include <nccl.h>
#define TS_HAVE_NCCL_H 1
#endif

namespace ts::kernels {

inline bool CudaOk(cudaError_t e) {
  return e == cudaSuccess;
}
inline bool CudaOk(cublasStatus_t s) {
  return s == CUBLAS_STATUS_SUCCESS;
}

// Out-of-memory is the one failure a caller can act on (smaller pool, fewer buckets); every other
// code is an internal error, and a sticky one poisons the context (the server then exits).
inline absl::Status CudaErrorToStatus(cudaError_t e, const char* expr, const char* file, int line) {
  const std::string msg = absl::StrCat(cudaGetErrorName(e), " (", cudaGetErrorString(e), ") from ",
                                       expr, " at ", file, ":", line);
  if (e == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

inline absl::Status CudaErrorToStatus(cublasStatus_t s, const char* expr, const char* file,
                                      int line) {
  const std::string msg = absl::StrCat(cublasLtGetStatusName(s), " (", cublasLtGetStatusString(s),
                                       ") from ", expr, " at ", file, ":", line);
  if (s == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(msg);
  if (s == CUBLAS_STATUS_INVALID_VALUE || s == CUBLAS_STATUS_NOT_SUPPORTED) {
    return absl::InvalidArgumentError(msg);
  }
  return absl::InternalError(msg);
}

#ifdef TS_HAVE_NCCL_H
inline bool CudaOk(ncclResult_t r) {
  return r == ncclSuccess || r == ncclInProgress;
}
inline absl::Status CudaErrorToStatus(ncclResult_t r, const char* expr, const char* file,
                                      int line) {
  const std::string msg =
      absl::StrCat("NCCL error ", static_cast<int>(r), " (", ncclGetErrorString(r), ") from ", expr,
                   " at ", file, ":", line);
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) return absl::InvalidArgumentError(msg);
  if (r == ncclRemoteError || r == ncclSystemError) return absl::UnavailableError(msg);
  return absl::InternalError(msg);
}
#endif

// ---- Launcher parameter checks: InvalidArgument naming the field, e.g. "rmsnorm.hidden". ----

inline absl::Status RequirePositive(const char* field, int64_t v) {
  if (v > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, " must be > 0, got ", v));
}
inline absl::Status RequireNonNegative(const char* field, int64_t v) {
  if (v >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, " must be >= 0, got ", v));
}
inline absl::Status RequireMultipleOf(const char* field, int64_t v, int64_t m) {
  if (v > 0 && v % m == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " must be a positive multiple of ", m, ", got ", v));
}
// Non-null and aligned to `align` bytes (16 for the kernels' 16-byte vector accesses).
inline absl::Status RequirePointer(const char* field, const void* ptr, uintptr_t align = 16) {
  if (ptr == nullptr) return absl::InvalidArgumentError(absl::StrCat(field, " is null"));
  if (reinterpret_cast<uintptr_t>(ptr) % align != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be ", align,
                                                   "-byte aligned, got 0x",
                                                   absl::Hex(reinterpret_cast<uintptr_t>(ptr))));
  }
  return absl::OkStatus();
}

}  // namespace ts::kernels

// Evaluates `expr` once; on failure returns the converted absl::Status from the enclosing function.
#define TS_CUDA_RETURN_IF_ERROR(expr)                                                  \
  do {                                                                                 \
    const auto ts_cuda_rc_ = (expr);                                                   \
    if (!::ts::kernels::CudaOk(ts_cuda_rc_)) {                                         \
      return ::ts::kernels::CudaErrorToStatus(ts_cuda_rc_, #expr, __FILE__, __LINE__); \
    }                                                                                  \
  } while (0)
