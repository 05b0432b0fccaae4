// The CUDA backend's memory plan (docs/architecture.md, Memory): everything the GPU needs is sized
// here once, at startup. A model (one stage) is ONE device arena (weights, KV pool, activations,
// attention scratch) plus one pinned host-mapped block (staging). The slot table is apart from it
// (DeviceSlots, engine/cuda/device_slots.h: the device slot rows, block tables, sampling counts and
// prompt masks, and in pinned host-mapped memory the token rings, cancel and done flags and the
// publish staging), held once, on the GPU of the stage with the head, and counted in that stage's
// budget. The cuBLASLt workspaces (allocated by each kernels::Gemm) and the graphs are counted in
// the budget but allocated by their owners. Nothing is allocated during capture or a step.
//
// The KV pool gets what is left of gpu_memory_fraction * total device memory after everything
// else; the plan refuses (FailedPrecondition) when that cannot hold one max_context sequence.
//
// One function per block (the carves in memory_plan.cc) lays out every buffer, both to size the
// plan and to hand out the pointers, so the budget printed at startup is exactly what is allocated.
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/postprocess.cuh"
#include "kernels/sampling.cuh"
#include "models/config.h"

namespace ts {

// Model shapes as the GPU stores them. The layer GEMMs need N and K in multiples of 8, so the
// intermediate size is zero-padded at upload (exact: the padded gate/up rows give silu(0) * 0 = 0
// and meet zero columns of down). The lm_head GEMM (fp32 output, its own cuBLASLt plan) takes
// any vocab size, so lm_head is stored unpadded and shared with the embedding when tied.
struct ModelDims {
  int32_t hidden = 0;
  int32_t intermediate = 0;
  int32_t intermediate_padded = 0;  // multiple of 8
  int32_t num_layers = 0;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t vocab = 0;
  bool tied = false;
  int32_t q_dim() const { return num_heads * head_dim; }
  int32_t kv_dim() const { return num_kv_heads * head_dim; }
  int32_t qkv_dim() const { return q_dim() + 2 * kv_dim(); }
  bool separate_lm_head() const { return !tied; }
};

// InvalidArgument naming the config field when the GPU kernels cannot run this shape.
absl::StatusOr<ModelDims> MakeModelDims(const ModelConfig& config);

// The part of the model one GPU holds: the decoder layers [first_layer, first_layer + num_layers),
// the token embedding (a pipeline's first stage) and the head: final norm, lm_head, sampling (its
// last stage). docs/pipeline.md (CUDA stages) describes what a stage runs. The default is the
// whole model.
struct ModelStage {
  int32_t first_layer = 0;
  int32_t num_layers = -1;  // -1: through the model's last layer
  bool has_embedding = true;
  bool has_head = true;
};

// The stage with num_layers resolved; InvalidArgument naming "stage.first_layer" or
// "stage.num_layers" when the range is empty or leaves the model's layers.
absl::StatusOr<ModelStage> ResolveStage(const ModelStage& stage, int32_t model_layers);

struct MemoryPlanOptions {
  ModelConfig model;
  ModelStage stage;  // which layers, embedding and head this GPU holds
  int32_t max_slots = 0;
  std::vector<int32_t> buckets;  // ascending; buckets.back() >= max_slots
  int32_t kv_block_size = 16;
  int32_t max_context = 0;  // tokens per sequence (prompt + new)
  int32_t prefill_chunk_tokens = 0;
  uint32_t ring_capacity = 0;
  double gpu_memory_fraction = 0.9;
  size_t total_device_bytes = 0;  // cudaMemGetInfo's total
  // Per cuBLASLt workspace. The backend has four: layer GEMMs and lm_head, for decode and for
  // prefill (kernels::Gemm allocates its own; the lm_head ones live in the arena).
  size_t gemm_workspace_bytes = 0;
  size_t attention_workspace_bytes = 0;  // decode attention partials for the largest need
  size_t graph_reserve_bytes = 0;        // estimate for graph execs, cuBLASLt handles
};

// Sizes that fix the slot table's layout (DeviceSlots).
struct SlotShape {
  int32_t max_slots = 0;
  int32_t max_blocks_per_seq = 0;
  int32_t vocab = 0;
  uint32_t ring_capacity = 0;
  int32_t mask_words() const { return (vocab + 31) / 32; }
  // Sampling state rows: one per slot plus a scratch row that padding rows of a bucket sample
  // from, so the sampling kernel never sees an out-of-range slot.
  int32_t count_rows() const { return max_slots + 1; }
  bool operator==(const SlotShape&) const = default;
};

// Sizes that fix the arena's layout.
struct ArenaShape {
  ModelDims dims;    // the whole model's
  ModelStage stage;  // resolved: num_layers >= 1
  int32_t max_slots = 0;
  int32_t max_bucket = 0;  // decode rows (largest bucket)
  int32_t prefill_rows = 0;
  int32_t max_blocks_per_seq = 0;
  int32_t num_kv_blocks = 0;
  int32_t kv_block_size = 0;
  uint32_t ring_capacity = 0;
  size_t attention_workspace_bytes = 0;
  size_t logits_workspace_bytes = 0;  // each of the two lm_head GEMM workspaces
  int32_t mask_words() const { return slot_shape().mask_words(); }
  int32_t count_rows() const { return slot_shape().count_rows(); }
  SlotShape slot_shape() const {
    return {max_slots, max_blocks_per_seq, dims.vocab, ring_capacity};
  }
};

struct MemoryPlan {
  ArenaShape shape;
  size_t budget_bytes = 0;          // gpu_memory_fraction * total
  int64_t kv_blocks_in_budget = 0;  // before the cap at max_slots full-length sequences
  // Device bytes by category (the arena holds all but gemm workspaces and graphs).
  size_t weight_bytes = 0;
  size_t kv_bytes = 0;
  size_t activation_bytes = 0;  // forward buffers, logits, step inputs
  // The slot table's device block (SlotDeviceBytes), outside the arena; 0 for a stage without
  // the head, which holds none.
  size_t state_bytes = 0;
  size_t attention_workspace_bytes = 0;
  size_t logits_workspace_bytes = 0;  // both lm_head GEMM workspaces (in the arena)
  size_t gemm_workspace_bytes = 0;    // the two kernels::Gemm objects (outside the arena)
  size_t graph_reserve_bytes = 0;
  size_t arena_bytes = 0;
  size_t host_bytes = 0;       // the model's pinned host-mapped block
  size_t slot_host_bytes = 0;  // the slot table's (SlotHostBytes); 0 without the head
  int64_t kv_tokens() const {
    return static_cast<int64_t>(shape.num_kv_blocks) * shape.kv_block_size;
  }
  std::string Summary() const;  // the startup budget, several lines
};

absl::StatusOr<MemoryPlan> PlanMemory(const MemoryPlanOptions& options);

// The row counts prefill GEMMs (chunks and mixed steps) are planned for and padded to, ascending,
// the last one `chunk`: 16, 32 and 64, then steps of 64 up to 512 and of 256 beyond. So 16
// cuBLASLt plans cover every row count of a 2048-row chunk, and a mixed step of, say, 32 decode
// rows and 140 prompt rows computes 192 rows, not the 256 the next power of two would. From
// about 150 rows an 8B layer GEMM is compute-bound (16 GFLOP a row against 16 GB of weights a
// step), so its cost follows its padded rows.
std::vector<int32_t> PrefillGemmRows(int32_t chunk);

// ---- Pointers into the arena. Shapes in comments; M = rows of that buffer set. ----

struct LayerBuffers {
  __nv_bfloat16* attn_norm = nullptr;  // [hidden]
  __nv_bfloat16* mlp_norm = nullptr;   // [hidden]
  __nv_bfloat16* qkv = nullptr;        // [qkv_dim, hidden]: q rows, k rows, v rows
  __nv_bfloat16* o = nullptr;          // [hidden, q_dim]
  __nv_bfloat16* gate_up = nullptr;    // [2 * intermediate_padded, hidden]: gate rows, up rows
  __nv_bfloat16* down = nullptr;       // [hidden, intermediate_padded]
  __nv_bfloat16* k_cache = nullptr;    // [num_kv_blocks, num_kv_heads, block_size, head_dim]
  __nv_bfloat16* v_cache = nullptr;    // [num_kv_blocks, num_kv_heads, block_size, head_dim]
};

// Activations of one forward pass over up to `rows` tokens.
struct ForwardBuffers {
  int32_t rows = 0;
  __nv_bfloat16* h = nullptr;   // [M, hidden] residual stream
  __nv_bfloat16* xn = nullptr;  // [M, hidden] normed input of a GEMM
  // [M, ceil(hidden / 32)] sums of squares of h's rows per 32 columns, left by the 9-16-row down
  // GEMV for the next layer's qkv GEMV, which applies attn_norm (kernels/gemv.cuh, sumsq_out and
  // a_sumsq).
  float* h_sumsq = nullptr;
  __nv_bfloat16* qkv = nullptr;      // [M, qkv_dim]
  __nv_bfloat16* q = nullptr;        // [M, q_dim] rotated q, contiguous for attention
  __nv_bfloat16* attn = nullptr;     // [M, q_dim]
  __nv_bfloat16* gate_up = nullptr;  // [M, 2 * intermediate_padded]
  __nv_bfloat16* act = nullptr;      // [M, intermediate_padded]
  int32_t* tokens = nullptr;         // [M]
  int32_t* positions = nullptr;      // [M]
  int32_t* slot_mapping = nullptr;   // [M] block * block_size + offset; -1 = no KV write
  // [M, head_dim / 2, 2] cos and sin of each decode row's position (kernels/prepare_decode.cuh),
  // read by every layer's decode attention.
  float* rope_angles = nullptr;
};

// lm_head -> fp32 logits -> sampling -> postprocess for up to `rows` rows.
struct HeadBuffers {
  int32_t rows = 0;
  __nv_bfloat16* hidden = nullptr;         // [M, hidden] gathered last-token rows (prefill)
  __nv_bfloat16* normed = nullptr;         // [M, hidden] final norm output
  __nv_bfloat16* logits = nullptr;         // [M, vocab_padded]
  float* logits_f32 = nullptr;             // [M, vocab]
  kernels::SamplingRow* params = nullptr;  // [M]
  int32_t* sample_slots = nullptr;         // [M] slot per row; padding -> scratch row max_slots
  int32_t* row_slots = nullptr;            // [M] slot per row; -1 = padding (postprocess)
  int32_t* sampled = nullptr;              // [M]
  // [sampling_workspace_bytes] SamplingKernelParams::workspace for up to M rows: zero from the
  // arena's memset, and left ready by every launch.
  void* sampling_workspace = nullptr;
  size_t sampling_workspace_bytes = 0;
};

struct DeviceLayout {
  __nv_bfloat16* embed = nullptr;       // [vocab, hidden]
  __nv_bfloat16* lm_head = nullptr;     // [vocab, hidden]; == embed when tied
  __nv_bfloat16* final_norm = nullptr;  // [hidden]
  float* inv_freq = nullptr;            // [head_dim / 2]
  std::vector<LayerBuffers> layers;     // [num_layers]

  ForwardBuffers decode;  // rows = max_bucket
  HeadBuffers decode_head;
  int32_t* decode_context_lens = nullptr;  // [max_bucket]
  int32_t* decode_block_tables = nullptr;  // [max_bucket, max_blocks_per_seq]

  ForwardBuffers prefill;                   // rows = prefill_rows
  HeadBuffers prefill_head;                 // rows = max_bucket
  int32_t* prefill_cu_seqlens = nullptr;    // [max_slots + 1]
  int32_t* prefill_start_pos = nullptr;     // [max_slots]
  int32_t* prefill_block_tables = nullptr;  // [max_slots, max_blocks_per_seq]
  int32_t* gather_src = nullptr;            // [max_bucket] rows of prefill.h
  int32_t* gather_dst = nullptr;            // [max_bucket] rows of prefill_head.hidden

  void* attention_workspace = nullptr;       // [attention_workspace_bytes], 256-B aligned
  void* decode_logits_workspace = nullptr;   // [logits_workspace_bytes] cuBLASLt, lm_head
  void* prefill_logits_workspace = nullptr;  // [logits_workspace_bytes]
};

// Pinned host memory, allocated cudaHostAllocMapped | cudaHostAllocPortable: the GPU writes the
// error flags through their device aliases.
struct HostLayout {
  int32_t* error_flag = nullptr;  // [4]; kernels store 1 on an upstream bug
  int32_t* row_slots = nullptr;   // [max_bucket] decode row list staging
  // Prefill staging, copied to the device per chunk.
  int32_t* tokens = nullptr;                      // [prefill_rows]
  int32_t* positions = nullptr;                   // [prefill_rows]
  int32_t* slot_mapping = nullptr;                // [prefill_rows]
  int32_t* cu_seqlens = nullptr;                  // [max_slots + 1]
  int32_t* start_pos = nullptr;                   // [max_slots]
  int32_t* block_tables = nullptr;                // [max_slots, max_blocks_per_seq]
  int32_t* gather_src = nullptr;                  // [max_bucket]
  int32_t* gather_dst = nullptr;                  // [max_bucket]
  kernels::SamplingRow* sample_params = nullptr;  // [max_bucket]
  int32_t* sample_slots = nullptr;                // [max_bucket]
  int32_t* head_row_slots = nullptr;              // [max_bucket]
};

// The slot table on the device: what the step kernels read and write per slot.
struct SlotDeviceLayout {
  kernels::SlotRow* slots = nullptr;  // [max_slots]
  int32_t* block_tables = nullptr;    // [max_slots, max_blocks_per_seq]
  uint32_t* output_counts = nullptr;  // [max_slots + 1, vocab]
  uint32_t* prompt_mask = nullptr;    // [max_slots + 1, mask_words]
};

// The slot table's pinned host-mapped part: the GPU writes the rings and done flags and reads the
// cancel flags through their device aliases; the host stages a slot's rows for their copies.
struct SlotHostLayout {
  RingEntry* rings = nullptr;             // [max_slots][ring_capacity] (common/ring.h)
  int32_t* cancel = nullptr;              // [max_slots]
  int32_t* done = nullptr;                // [max_slots]
  kernels::SlotRow* slot_rows = nullptr;  // [max_slots] publish staging
  int32_t* block_tables = nullptr;        // [max_slots, max_blocks_per_seq]
  uint32_t* prompt_mask = nullptr;        // [max_slots, mask_words]
};

// Byte sizes of the two blocks for `shape` (also what PlanMemory reports).
size_t ArenaBytes(const ArenaShape& shape);
size_t HostBytes(const ArenaShape& shape);
// Hands out the pointers. `base` must hold ArenaBytes(shape) bytes, 256-byte aligned; `host`
// HostBytes(shape) bytes. Carve the mapped host block twice: once at its host address (what the
// CPU touches) and once at cudaHostGetDevicePointer's alias (what kernels are given).
DeviceLayout CarveArena(const ArenaShape& shape, void* base);
HostLayout CarveHost(const ArenaShape& shape, void* host);

// The same for the slot table's two blocks.
size_t SlotDeviceBytes(const SlotShape& shape);
size_t SlotHostBytes(const SlotShape& shape);
SlotDeviceLayout CarveSlotDevice(const SlotShape& shape, void* base);
SlotHostLayout CarveSlotHost(const SlotShape& shape, void* host);

}  // namespace ts
