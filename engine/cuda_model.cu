// The step's small ops that know the slot table (prepare), plus the row gather and the random
// weight fill. Each is one kernel, graph-capturable, no allocation.
#include <cuda_bf16.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/philox.h"
#include "common/status.h"
#include "engine/cuda_model.h"
#include "kernels/cuda_check.h"
#include "kernels/kv_layout.cuh"

namespace ts::cuda_model_internal {
namespace {

using kernels::SlotRow;

constexpr int kThreads = 128;

// One CTA per row: thread 0 writes the row's scalars, all threads copy the block table entries
// the row's context needs (the attention kernel reads no further).
__global__ void __launch_bounds__(kThreads) PrepareDecodeKernel(PrepareDecodeParams p) {
  const int32_t row = blockIdx.x;
  if (p.stamps != nullptr && row == 0 && threadIdx.x == 0) kernels::StampStepStart(p.stamps);
  const int32_t slot = p.row_slots[row];
  const bool valid = slot >= 0 && slot < p.num_slots && p.slots[slot].state == kernels::kSlotActive;
  if (!valid) {
    if (threadIdx.x == 0) {
      p.tokens[row] = 0;
      p.positions[row] = 0;
      p.slot_mapping[row] = kernels::kNoKvWrite;
      p.context_lens[row] = 0;
      p.sample_slots[row] = p.num_slots;
      kernels::SamplingRow greedy;
      greedy.temperature = 0.0f;
      p.sampling[row] = greedy;
    }
    return;
  }
  const SlotRow& s = p.slots[slot];
  // The newest token is not in the cache yet: it is fed at its own position now.
  const int32_t pos = s.prompt_len + s.generated - 1;
  const int32_t* table = p.slot_block_tables + static_cast<int64_t>(slot) * p.max_blocks;
  int32_t* out_table = p.block_tables + static_cast<int64_t>(row) * p.max_blocks;
  const int32_t used = min(pos / p.block_size + 1, p.max_blocks);
  for (int32_t i = threadIdx.x; i < used; i += kThreads) out_table[i] = table[i];
  if (threadIdx.x == 0) {
    p.tokens[row] = s.last_token;
    p.positions[row] = pos;
    // A position past the table or on a padding entry gets kBadKvSlot, which the K/V writer
    // flags: skipping its write quietly would leave a hole the next step attends to.
    p.slot_mapping[row] = kernels::KvSlotFor(table, p.max_blocks, p.block_size, pos);
    p.context_lens[row] = pos + 1;
    p.sample_slots[row] = slot;
    kernels::SamplingRow r = s.sampling;
    r.position = static_cast<uint64_t>(pos) + 1;  // the token being sampled
    p.sampling[row] = r;
  }
}

__global__ void GatherRowsKernel(const __nv_bfloat16* src, const int32_t* src_rows,
                                 __nv_bfloat16* dst, const int32_t* dst_rows, int32_t width) {
  const int32_t i = blockIdx.x;
  const uint4* s = reinterpret_cast<const uint4*>(src + static_cast<int64_t>(src_rows[i]) * width);
  uint4* d = reinterpret_cast<uint4*>(dst + static_cast<int64_t>(dst_rows[i]) * width);
  for (int32_t v = threadIdx.x; v < width / 8; v += blockDim.x) d[v] = s[v];
}

__global__ void FillUniformKernel(__nv_bfloat16* p, size_t n, uint64_t seed, float lo, float hi) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    p[i] = __float2bfloat16(lo + (hi - lo) * UniformFromSeed(seed, i));
  }
}

}  // namespace

absl::Status LaunchPrepareDecode(const PrepareDecodeParams& p, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(kernels::RequireNonNegative("prepare.rows", p.rows));
  if (p.rows == 0) return absl::OkStatus();
  TS_RETURN_IF_ERROR(kernels::RequirePositive("prepare.num_slots", p.num_slots));
  TS_RETURN_IF_ERROR(kernels::RequirePositive("prepare.max_blocks", p.max_blocks));
  TS_RETURN_IF_ERROR(kernels::RequirePositive("prepare.block_size", p.block_size));
  PrepareDecodeKernel<<<p.rows, kThreads, 0, stream>>>(p);
  TS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchGatherRows(const __nv_bfloat16* src, const int32_t* src_rows, __nv_bfloat16* dst,
                              const int32_t* dst_rows, int32_t n, int32_t width,
                              cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  TS_RETURN_IF_ERROR(kernels::RequireMultipleOf("gather.width", width, 8));
  GatherRowsKernel<<<n, kThreads, 0, stream>>>(src, src_rows, dst, dst_rows, width);
  TS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchFillUniform(__nv_bfloat16* p, size_t n, uint64_t seed, float lo, float hi,
                               cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  const int threads = 256;
  const size_t want = (n + threads - 1) / threads;
  const int blocks = static_cast<int>(std::min<size_t>(want, 132 * 32));
  FillUniformKernel<<<blocks, threads, 0, stream>>>(p, n, seed, lo, hi);
  TS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace ts::cuda_model_internal
