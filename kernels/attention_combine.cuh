// Merges the per-split partial results of split (flash-decoding) attention into the final output:
// out[s, h, :] = sum_i w_i * partial_out[s, h, i, :] / sum_i w_i, with w_i = 2^(lse_i - max lse).
// Which splits of a sequence are valid is recomputed from context_lens with the same geometry the
// split kernel used, so splits that were never written are never read. With num_splits == 1 the
// split kernel writes every non-empty row's output itself (no partials), and this kernel only
// zeroes the rows of empty sequences.
//
// With pdl the kernel starts while the split kernel runs: it reads the context lengths before its
// wait (kernels/pdl.cuh, the chain rule) and the partials after it, all of a row's splits at once
// when there are at most 8 (a merge of n splits cost n load round trips in a row, about 6 us a
// layer on the critical path at batch 1, bench/results/2026-12-02f-h200.md).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace ts::kernels {

struct AttentionCombineParams {
  const float* partial_out;  // [num_seqs, num_heads, max_splits, head_dim], each split normalised
  const float* partial_lse;  // [num_seqs, num_heads, max_splits], log2(sum 2^score), -inf = empty
  const int32_t* context_lens;  // [num_seqs], the same array the split kernel read
  __nv_bfloat16* out;           // [num_seqs, num_heads, head_dim]
  int32_t num_seqs = 0;
  int32_t num_heads = 0;   // query heads
  int32_t head_dim = 0;    // one of 16, 64, 128
  int32_t max_splits = 0;  // workspace capacity per (seq, head)
  // Split geometry; must equal the split kernel's (LaunchDecodeAttention fills these).
  int32_t num_splits = 0;        // split count upper bound, <= max_splits
  int32_t min_split_tokens = 0;  // >= 1
  int32_t block_size = 0;        // tokens per KV block
  int32_t max_blocks_per_seq = 0;
  bool pdl = false;  // programmatic dependent launch (kernels/pdl.cuh)
};

// Validates `p` (InvalidArgument naming the field) and enqueues one kernel on `stream`. Graph
// capturable: no allocation, no synchronisation. A sequence with no tokens gets an all-zero output.
absl::Status LaunchAttentionCombine(const AttentionCombineParams& p, cudaStream_t stream);

}  // namespace ts::kernels
