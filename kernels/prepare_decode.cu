#include "kernels/prepare_decode.cuh"

#include "common/status.h"
#include "kernels/bf16_vec.cuh"
#include "kernels/cuda_check.h"
#include "kernels/kv_layout.cuh"

namespace ts::kernels {
namespace {

constexpr int kThreads = 128;

// The row's RoPE angles, one pair a thread.
__device__ void WriteRopeAngles(const PrepareDecodeParams& p, int32_t row, int32_t pos) {
  if (p.rope_angles == nullptr) return;
  RopeCosSin* out = reinterpret_cast<RopeCosSin*>(p.rope_angles) + int64_t{row} * p.rope_pairs;
  for (int32_t i = threadIdx.x; i < p.rope_pairs; i += kThreads) {
    out[i] = RopeAngle(pos, p.inv_freq[i]);
  }
}

// One CTA per row: thread 0 writes the row's scalars, all threads copy the block table entries
// the row's context needs (the attention kernel reads no further) and the row's RoPE angles.
__global__ void __launch_bounds__(kThreads) PrepareDecodeKernel(PrepareDecodeParams p) {
  const int32_t row = blockIdx.x;
  if (p.stamps != nullptr && row == 0 && threadIdx.x == 0) StampStepStart(p.stamps);
  const int32_t slot = p.row_slots[row];
  const bool valid = slot >= 0 && slot < p.num_slots && p.slots[slot].state == kSlotActive;
  if (!valid) {
    WriteRopeAngles(p, row, 0);
    if (threadIdx.x == 0) {
      p.tokens[row] = 0;
      p.positions[row] = 0;
      p.slot_mapping[row] = kNoKvWrite;
      p.context_lens[row] = 0;
      p.sample_slots[row] = p.num_slots;
      SamplingRow greedy;
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
  WriteRopeAngles(p, row, pos);
  if (threadIdx.x == 0) {
    p.tokens[row] = s.last_token;
    p.positions[row] = pos;
    // A position past the table or on a padding entry gets kBadKvSlot, which the K/V writer
    // flags: skipping its write quietly would leave a hole the next step attends to.
    p.slot_mapping[row] = KvSlotFor(table, p.max_blocks, p.block_size, pos);
    p.context_lens[row] = pos + 1;
    p.sample_slots[row] = slot;
    SamplingRow r = s.sampling;
    r.position = static_cast<uint64_t>(pos) + 1;  // the token being sampled
    p.sampling[row] = r;
  }
}

}  // namespace

absl::Status LaunchPrepareDecode(PrepareDecodeParams p, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(RequireNonNegative("prepare.rows", p.rows));
  if (p.rows == 0) return absl::OkStatus();
  TS_RETURN_IF_ERROR(RequirePositive("prepare.num_slots", p.num_slots));
  TS_RETURN_IF_ERROR(RequirePositive("prepare.max_blocks", p.max_blocks));
  TS_RETURN_IF_ERROR(RequirePositive("prepare.block_size", p.block_size));
  TS_RETURN_IF_ERROR(RequirePointer("prepare.row_slots", p.row_slots, 4));
  TS_RETURN_IF_ERROR(RequirePointer("prepare.slots", p.slots, 16));
  TS_RETURN_IF_ERROR(RequirePointer("prepare.slot_block_tables", p.slot_block_tables, 4));
  TS_RETURN_IF_ERROR(RequirePointer("prepare.tokens", p.tokens, 4));
  TS_RETURN_IF_ERROR(RequirePointer("prepare.positions", p.positions, 4));
  TS_RETURN_IF_ERROR(RequirePointer("prepare.slot_mapping", p.slot_mapping, 4));
  TS_RETURN_IF_ERROR(RequirePointer("prepare.context_lens", p.context_lens, 4));
  TS_RETURN_IF_ERROR(RequirePointer("prepare.block_tables", p.block_tables, 4));
  TS_RETURN_IF_ERROR(RequirePointer("prepare.sampling", p.sampling, 8));
  TS_RETURN_IF_ERROR(RequirePointer("prepare.sample_slots", p.sample_slots, 4));
  if (p.rope_angles != nullptr) {
    TS_RETURN_IF_ERROR(RequirePointer("prepare.rope_angles", p.rope_angles, 16));
    TS_RETURN_IF_ERROR(RequirePointer("prepare.inv_freq", p.inv_freq, 4));
    TS_RETURN_IF_ERROR(RequirePositive("prepare.rope_pairs", p.rope_pairs));
    TS_RETURN_IF_ERROR(RequireMultipleOf("prepare.rope_pairs", p.rope_pairs, 2));
  }
  PrepareDecodeKernel<<<p.rows, kThreads, 0, stream>>>(p);
  TS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace ts::kernels
