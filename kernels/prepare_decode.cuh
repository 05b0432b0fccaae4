// The first kernel of a decode step: from the slot table, each row's input token, position, KV
// write slot, context length, block-table row and sampling row. It is what lets one captured
// graph serve any batch: the graph reads the row list, never host values.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/postprocess.cuh"
#include "kernels/sampling.cuh"
#include "kernels/step_stamps.cuh"

namespace ts::kernels {

struct PrepareDecodeParams {
  const int32_t* row_slots = nullptr;          // [rows] slot, or -1 for a padding row
  const SlotRow* slots = nullptr;              // [num_slots]
  const int32_t* slot_block_tables = nullptr;  // [num_slots, max_blocks]
  int32_t* tokens = nullptr;                   // [rows] the slot's last token (0: padding)
  int32_t* positions = nullptr;                // [rows] its position, prompt_len + generated - 1
  int32_t* slot_mapping = nullptr;  // [rows] KV write slot (KvSlotFor), kNoKvWrite: padding
  int32_t* context_lens = nullptr;  // [rows] position + 1, 0 for padding
  int32_t* block_tables = nullptr;  // [rows, max_blocks] the first entries the context uses
  SamplingRow* sampling = nullptr;  // [rows] the slot's row, position = position + 1
  int32_t* sample_slots = nullptr;  // [rows] slot, or num_slots (scratch) for padding
  int32_t rows = 0;                 // >= 0; 0 launches nothing
  int32_t num_slots = 0;            // > 0
  int32_t max_blocks = 0;           // > 0
  int32_t block_size = 0;           // > 0
  // Optional: [rows, rope_pairs, 2] cos and sin of each row's position times inv_freq[i], rounded
  // as rope_kv rounds them (RopeAngle, kernels/bf16_vec.cuh); padding rows get position 0's. Decode
  // attention's fused RoPE reads them in every layer (DecodeAttentionRope::angles), so the step
  // computes them once. 16-B aligned.
  float* rope_angles = nullptr;
  const float* inv_freq = nullptr;  // [rope_pairs], with rope_angles (models/rope.h)
  int32_t rope_pairs = 0;           // head_dim / 2, a multiple of 2, with rope_angles
  StepStamps* stamps = nullptr;     // benchmarks only: the step's start and idle gap
};

// A row whose slot is out of range or not ACTIVE is padding: greedy sampling of token 0 into the
// scratch sampling slot, no KV write, zero context. Graph-capturable; one CTA per row.
absl::Status LaunchPrepareDecode(PrepareDecodeParams p, cudaStream_t stream);

}  // namespace ts::kernels
