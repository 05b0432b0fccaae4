// Causal prefill attention over the paged KV cache, for a ragged batch of prompt chunks. The
// rope_kv kernel has already written this chunk's K/V into the cache, so every query reads all of
// its keys (cached prefix + chunk) from the cache. GQA: one CTA serves the query heads of one kv
// head for up to 128 (token, head) rows; QK^T and PV run on the tensor cores (mma.sync bf16,
// fp32 accumulate) with an fp32 online softmax, over 64-key tiles that cp.async stages in shared
// memory two tiles ahead.
//
// A short chunk after a long prefix (chunked prefill beside running decode streams) has too few
// (token, head) tiles to fill the GPU while each CTA walks the whole prefix, so the keys can also
// be split (flash-decoding's scheme applied to prefill): with num_splits > 1 each CTA covers one of
// num_splits equal key ranges of its sequence and writes an fp32 partial with its log-sum-exp, and
// a second kernel merges the partials in split order.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace ts::kernels {

struct PrefillAttentionParams {
  const __nv_bfloat16* q;        // [total_tokens, num_q_heads, head_dim], RoPE applied, 4-B aligned
  const __nv_bfloat16* k_cache;  // [num_blocks, num_kv_heads, block_size, head_dim] (kv_layout.cuh)
  const __nv_bfloat16* v_cache;  // [num_blocks, num_kv_heads, block_size, head_dim]
  const int32_t* block_tables;   // [num_seqs, max_blocks_per_seq], ids < num_blocks where read
  const int32_t* cu_seqlens;     // [num_seqs + 1], starts at 0, ends at total_tokens
  // [num_seqs], tokens already cached before this chunk (query i sits at position start + i and
  // attends to keys 0..start+i); nullptr means all zero.
  const int32_t* start_pos;
  __nv_bfloat16* out;  // [total_tokens, num_q_heads, head_dim]
  // [1], optional: set to 1 when a table entry a query attends to is not a block of the pool; the
  // kernel reads block 0 for it instead (in bounds, wrong output, the step is failed).
  int32_t* error_flag = nullptr;

  int32_t num_seqs = 0;
  int32_t total_tokens = 0;
  int32_t max_q_len = 0;  // >= every cu_seqlens[i+1] - cu_seqlens[i]; sizes the grid
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;  // divides num_q_heads
  int32_t head_dim = 0;      // one of 16, 64, 128
  int32_t block_size = 0;    // power of two
  int32_t num_blocks = 0;
  int32_t max_blocks_per_seq = 0;
  float scale = 0.f;  // usually 1/sqrt(head_dim)

  int32_t num_splits = 1;        // >= 1; > 1 needs the partials below (PrefillAttentionSplits)
  float* partial_out = nullptr;  // [total_tokens * num_q_heads, num_splits, head_dim], 16-B aligned
  float* partial_lse = nullptr;  // [total_tokens * num_q_heads, num_splits], log2 units
};

// The key split for a chunk. CTAs = ceil(max_q_len * group / 128) * num_kv_heads * num_seqs; 1 when
// they alone give every SM two CTAs or the longest sequence has few key tiles. Otherwise the fewest
// splits s that minimise ceil(CTAs * s / (2 * num_sms)) / s (waves of two CTAs per SM, each with
// 1/s of the keys), among s <= 16 with at least 4 64-key tiles per split, total_tokens * s <=
// max_split_rows (the partials' capacity) and num_seqs * s <= 65535.
int32_t PrefillAttentionSplits(int32_t total_tokens, int32_t max_q_len, int32_t num_seqs,
                               int32_t num_q_heads, int32_t num_kv_heads, int32_t max_kv_len,
                               int32_t num_sms, int32_t max_split_rows);
// Bytes of partial_out + partial_lse for max_split_rows (token, split) pairs, each part 256-B
// aligned: partial_lse starts at PrefillAttentionLseOffset.
size_t PrefillAttentionWorkspaceBytes(int32_t max_split_rows, int32_t num_q_heads,
                                      int32_t head_dim);
size_t PrefillAttentionLseOffset(int32_t max_split_rows, int32_t num_q_heads, int32_t head_dim);

// Validates `p` (InvalidArgument naming the field) and enqueues one kernel on `stream` (two with
// splits). No allocation, no synchronisation, no host reads of device memory.
absl::Status LaunchPrefillAttention(const PrefillAttentionParams& p, cudaStream_t stream);

}  // namespace ts::kernels
