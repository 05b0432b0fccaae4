// Copies chosen rows of one bf16 matrix into chosen rows of another: the prefill's last hidden
// row of each prompt into the sampling head's rows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace ts::kernels {

struct GatherRowsParams {
  const __nv_bfloat16* src = nullptr;  // [>= max src_rows + 1, width], 16-B aligned rows
  const int32_t* src_rows = nullptr;   // [n] device
  __nv_bfloat16* dst = nullptr;        // [>= max dst_rows + 1, width], 16-B aligned rows
  const int32_t* dst_rows = nullptr;   // [n] device, distinct
  int32_t n = 0;                       // >= 0; 0 launches nothing
  int32_t width = 0;                   // > 0, a multiple of 8
};

// dst[dst_rows[i], :] = src[src_rows[i], :] for i < n. Graph-capturable; one CTA per row.
absl::Status LaunchGatherRows(GatherRowsParams p, cudaStream_t stream);

}  // namespace ts::kernels
