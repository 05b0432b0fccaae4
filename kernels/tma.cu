// Host side of kernels/tma.cuh: the tensor-map encoding, through the driver entry point that the
// runtime hands out (so the library links cudart only, and the CPU-only CI machine, which has no
// driver, never calls it).
#include <cudaTypedefs.h>

#include <mutex>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_check.h"
#include "kernels/tma.cuh"

namespace ts::kernels::tma {
namespace {

absl::StatusOr<PFN_cuTensorMapEncodeTiled_v12000> EncodeTiled() {
  static std::once_flag once;
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static cudaError_t error = cudaSuccess;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    error = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                             &found);
    if (error == cudaSuccess && found == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    }
  });
  TS_CUDA_RETURN_IF_ERROR(error);
  if (fn == nullptr) return absl::UnavailableError("the driver has no cuTensorMapEncodeTiled");
  return fn;
}

}  // namespace

absl::StatusOr<CUtensorMap> EncodeBf16RowsSw128(const void* base, int64_t rows, int64_t cols,
                                                int32_t box_rows) {
  if (base == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0 || rows < 1 || cols < 8 ||
      cols % 8 != 0 || box_rows < 1 || box_rows > 256) {
    return absl::InvalidArgumentError(absl::StrCat("tma: a [", rows, ", ", cols,
                                                   "] bf16 matrix in boxes of ", box_rows,
                                                   " rows cannot be a tensor map"));
  }
  auto encode = EncodeTiled();
  if (!encode.ok()) return encode.status();
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};  // bytes, of dimension 1
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};  // 64 bf16 = 128 bytes
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r =
      (*encode)(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides,
                box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuTensorMapEncodeTiled failed (CUresult ", r,
                                            ") for a [", rows, ", ", cols, "] bf16 matrix"));
  }
  return map;
}

}  // namespace ts::kernels::tma
