// Paged decode attention (one new query token per sequence) with GQA, split along the context
// (flash-decoding). One tile = (sequence, kv head, up to 8 query heads, split): it reads its K/V
// range once for all of those heads, on the tensor cores (mma.sync bf16: S^T = K Q^T, O^T += V^T
// P^T with P rounded to bf16, fp32 accumulation and an fp32 online softmax). Each warp streams its
// 16-key chunks through a two-stage cp.async ring in shared memory (ldmatrix feeds the mma), so
// the next chunk is in flight while one is computed and no register holds a byte in flight. Tiles
// write normalised partial outputs and their log2-sum-exp to a workspace; attention_combine merges
// the splits.
//
// Two ways to cut the work, chosen by `mode`:
//  - kStaticSplit: grid = num_splits x kv-head groups x num_seqs; each sequence is cut into
//    num_splits block-aligned ranges of equal size. Simple; a ragged batch leaves SMs idle.
//  - kWorkQueue: a persistent grid pulls fixed-size chunks (chunk_tokens) of every sequence from an
//    atomic counter, so a batch with contexts 100..4000 keeps every SM busy until the end. Each CTA
//    prefix-sums the per-sequence chunk counts itself (num_seqs is small), which saves a graph
//    node.
//
// Graph capture: LaunchDecodeAttention enqueues exactly two kernels (split + combine; only the
// split kernel with no_combine), allocates nothing and never reads device memory on the host. The
// work-queue counters live in the workspace and are reset by the last CTA of each launch, so a
// captured graph can be replayed any number of times. num_splits / chunk_tokens are ordinary kernel
// parameters, so cudaGraphExecUpdate can change them when the context-length regime changes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ts::kernels {

enum class DecodeAttentionMode : int32_t {
  kStaticSplit = 0,
  kWorkQueue = 1,
};

// The rope_kv node's work for a decode step, done inside decode attention. When qkv is set, q is
// read from qkv's q heads and rotated by `angles`, and the tile that holds a sequence's current
// token (context_lens[seq] - 1) rotates that row's k and writes k and v to the cache at
// slot_mapping[seq] for later steps, and uses them for this one from registers and shared memory
// (it never reads the slot back). slot_mapping[seq] must be that token's slot in block_tables, as
// a decode step's inputs are (kernels/prepare_decode.cuh). The output and the cache are bitwise
// those of LaunchRopeKv followed by this kernel on its q. A row of context 0 writes nothing; a slot
// outside the pool is flagged and not written, and the cache's value at the token is then used.
struct DecodeAttentionRope {
  // [num_seqs, (num_q_heads + 2 num_kv_heads) * head_dim]: each row's q heads, k heads, v heads,
  // unrotated (the qkv GEMM's output), 16-B aligned.
  const __nv_bfloat16* qkv = nullptr;
  // [num_seqs, head_dim / 2, 2]: cos and sin of each row's position times inv_freq[i], as
  // rope_kv forms them (RopeAngle, kernels/bf16_vec.cuh), 16-B aligned. The decode prepare kernel
  // writes them once a step for every layer (PrepareDecodeParams::rope_angles).
  const float* angles = nullptr;
  const int32_t* slot_mapping = nullptr;  // [num_seqs] KvSlotFor; kNoKvWrite = no K/V write
  __nv_bfloat16* k_cache = nullptr;       // k_cache and v_cache below, writable
  __nv_bfloat16* v_cache = nullptr;
  // [1], optional: set to 1 when a slot lies outside [kNoKvWrite, num_blocks * block_size).
  int32_t* error_flag = nullptr;
};

struct DecodeAttentionParams {
  // [num_seqs, num_q_heads, head_dim], RoPE applied, 16-B aligned. Null when rope.qkv is set.
  const __nv_bfloat16* q;
  const __nv_bfloat16* k_cache;  // [num_blocks, num_kv_heads, block_size, head_dim] (kv_layout.cuh)
  const __nv_bfloat16* v_cache;  // [num_blocks, num_kv_heads, block_size, head_dim]
  // [num_seqs, max_blocks_per_seq], block ids < num_blocks for the blocks a context covers; the
  // rest is never read (the engine pads with kInvalidKvBlock).
  const int32_t* block_tables;
  // [num_seqs], tokens to attend to, including the current token, whose K/V is already written
  // (or written by this kernel: rope).
  // 0 marks a padding row (its output is all zeros); values above max_blocks_per_seq * block_size
  // are clamped to it.
  const int32_t* context_lens;
  // Optional, decode steps: q straight from the qkv GEMM, rotated here, and the current token's
  // K/V written here (DecodeAttentionRope): one rope_kv graph node less per layer.
  DecodeAttentionRope rope{};
  __nv_bfloat16* out;  // [num_seqs, num_q_heads, head_dim]
  // DecodeAttentionWorkspaceBytes(num_seqs, num_q_heads, head_dim, max_splits) bytes, 256-B
  // aligned; zero it once after allocation (ResetDecodeAttentionWorkspace), never again.
  void* workspace;
  size_t workspace_bytes = 0;
  // [1], optional: set to 1 when an entry within a context is not a block of the pool; the kernel
  // reads block 0 for it instead (in bounds, wrong output, the step is failed). Never cleared.
  int32_t* error_flag = nullptr;

  int32_t num_seqs = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;  // divides num_q_heads
  int32_t head_dim = 0;      // one of 16, 64, 128
  int32_t block_size = 0;    // power of two
  int32_t num_blocks = 0;    // blocks in the cache pool; table entries are checked against it
  int32_t max_blocks_per_seq = 0;
  float scale = 0.f;  // usually 1/sqrt(head_dim)

  DecodeAttentionMode mode = DecodeAttentionMode::kStaticSplit;
  int32_t max_splits = 0;  // workspace capacity: partial results per (seq, head)
  // kStaticSplit: splits per sequence, in [1, max_splits]; see ChooseNumSplits.
  int32_t num_splits = 1;
  // kWorkQueue: tokens per work tile (rounded up to a block multiple); a sequence whose context
  // needs more than max_splits tiles gets proportionally larger tiles. See ChooseWorkQueueConfig.
  int32_t chunk_tokens = 256;
  int32_t persistent_ctas = 0;  // kWorkQueue: grid size, normally #SMs x resident CTAs per SM
  int32_t tiles_per_claim = 1;  // kWorkQueue: tiles taken per atomicAdd
  // Programmatic dependent launch of both kernels (kernels/pdl.cuh): each may start while the
  // kernel before it finishes, and waits for it before reading anything.
  bool pdl = false;
  // kStaticSplit with num_splits == 1 only: the split kernel writes the final output itself and
  // no combine kernel is launched (one graph node instead of two, and no round trip of the
  // partials through the workspace). For a batch whose split count is 1 at every context length
  // (ChooseNumSplits at the longest context), so a captured graph never needs the combine node.
  bool no_combine = false;
};

// Workspace layout: [kDecodeAttentionCounterBytes: two uint32 work-queue counters, rest padding]
// [LSE fp32 [num_seqs, num_q_heads, max_splits], padded to 256 B]
// [partial outputs fp32 [num_seqs, num_q_heads, max_splits, head_dim]].
inline constexpr size_t kDecodeAttentionCounterBytes = 256;

// Bytes of workspace for the given shape.
size_t DecodeAttentionWorkspaceBytes(int32_t num_seqs, int32_t num_q_heads, int32_t head_dim,
                                     int32_t max_splits);

// Zeroes the work-queue counters at the start of `workspace` (cudaMemsetAsync on `stream`). Call
// once after allocating the workspace, before the first launch or capture.
absl::Status ResetDecodeAttentionWorkspace(void* workspace, size_t workspace_bytes,
                                           cudaStream_t stream);

struct SplitChoiceInputs {
  int32_t num_seqs = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t max_context_len = 0;  // longest context in the batch (or the regime's upper bound)
  int32_t num_sms = 0;          // cudaDevAttrMultiProcessorCount
  int32_t max_splits = 0;       // workspace capacity
  int32_t ctas_per_sm = 0;      // resident decode CTAs per SM (DecodeAttentionCtasPerSm); 0 = 3
  // Shortest split when the grid would otherwise hold fewer CTAs than SMs; 0 = 64. A CTA walks
  // its tokens in dependent steps (32 tokens at head_dim 128), so at batch 1 shorter splits
  // shorten the critical path. Grids that fill the GPU keep splits of >= 128 (or 256) tokens.
  int32_t min_split_tokens = 0;
};

// How many decode-attention CTAs fit on one SM for this shape (cudaOccupancy on the kernel instance
// the launcher would pick). Host-only query; call it once at startup, not during capture.
absl::StatusOr<int32_t> DecodeAttentionCtasPerSm(int32_t head_dim, int32_t num_q_heads,
                                                 int32_t num_kv_heads);

// Static-split count: as many splits as fit in one wave of resident CTAs, but splits of at least
// 128 tokens (the merge would cost more than it saves; 256 once the unsplit tiles cover half the
// SMs) and at most 1024 (the longest sequences of a ragged batch would finish last); when that
// leaves fewer tiles than SMs (batch 1-8 at short contexts), up to one tile per SM with splits of
// at least min_split_tokens.
// Result in [1, max_splits].
int32_t ChooseNumSplits(const SplitChoiceInputs& in);

struct WorkQueueConfig {
  int32_t chunk_tokens;
  int32_t persistent_ctas;
  int32_t tiles_per_claim;
};

// Work-queue settings for a batch regime: grid = resident CTAs (num_sms x ctas_per_sm), chunk size
// so that each CTA gets about 8 tiles (the tail is then bounded by one small tile).
WorkQueueConfig ChooseWorkQueueConfig(const SplitChoiceInputs& in, int32_t block_size);

// Validates `p` (InvalidArgument naming the field), then enqueues the split kernel and the combine
// kernel on `stream`. Returns launch errors as Internal.
absl::Status LaunchDecodeAttention(const DecodeAttentionParams& p, cudaStream_t stream);

}  // namespace ts::kernels
