// The decode attention launch's host-side choices (kernels/decode_attention.cuh): how many splits a
// static-split launch cuts each sequence into, and the work queue's chunk size. Host-only, so
// kernels_attention_params_test checks them without a GPU.
#include <algorithm>
#include <cstdint>

#include "kernels/decode_attention.cuh"

namespace ts::kernels {

namespace {
int32_t CtasPerSm(const SplitChoiceInputs& in) {
  return in.ctas_per_sm > 0 ? in.ctas_per_sm : 3;
}
}  // namespace

constexpr int64_t kMaxSplitTokens = 1024;

int32_t ChooseNumSplits(const SplitChoiceInputs& in) {
  const int group = in.num_kv_heads > 0 ? std::max(1, in.num_q_heads / in.num_kv_heads) : 1;
  const int64_t tiles_per_split = static_cast<int64_t>(std::max(in.num_seqs, 1)) *
                                  std::max(in.num_kv_heads, 1) * ((group + 7) / 8);
  // At most one wave of resident CTAs. A second wave only adds each split's fixed cost (the
  // warps' merge, the partial writes, the combine): measured on the H200 with 64 sequences of 256
  // tokens (8B shape), 1 split took 29.0 us, 2 splits 34.5 and 4 splits 43.2.
  const int64_t one_wave = static_cast<int64_t>(std::max(in.num_sms, 1)) * CtasPerSm(in);
  const int64_t ctx = std::max(in.max_context_len, 1);
  const int64_t sms = std::max(in.num_sms, 1);
  // But no split longer than kMaxSplitTokens: the choice only knows the longest context, and in a
  // ragged batch the longest sequences' tiles would finish long after everyone else's (32
  // sequences of 100-4000 tokens, 8B shape: 1 split 140.9 us, 5 splits 88.5).
  int64_t splits = std::max<int64_t>(1, one_wave / tiles_per_split);
  splits = std::max<int64_t>(splits, (ctx + kMaxSplitTokens - 1) / kMaxSplitTokens);
  // A batch whose unsplit tiles already cover half the SMs gains less from splitting than the
  // merge and the combine node cost: measured on the H200 (bench/results/2026-12-03c-h200.md, 8
  // kv heads, 160-token contexts), splits of >= 256 tokens there made the 1B step 2.4% and 3%
  // faster at batch 16 and 32 than >= 128, and the 8B step no slower. Narrower batches keep
  // 128-token splits.
  const bool wide = 2 * tiles_per_split > sms;
  const int64_t min_tokens = wide ? 256 : 128;
  splits = std::min<int64_t>(splits, (ctx + min_tokens - 1) / min_tokens);
  if (!wide && splits * tiles_per_split < sms) {
    // Latency-bound: measured at batch 1 (H200, 128-384 tokens) 64-token splits beat 128 by 20-30
    // us per step; at batch 8, where 128-token splits fill the SMs, shorter ones lost.
    const int64_t floor_tokens = in.min_split_tokens > 0 ? in.min_split_tokens : 64;
    splits = std::max(splits, std::min((sms + tiles_per_split - 1) / tiles_per_split,
                                       (ctx + floor_tokens - 1) / floor_tokens));
  }
  return static_cast<int32_t>(std::clamp<int64_t>(splits, 1, std::max(in.max_splits, 1)));
}

WorkQueueConfig ChooseWorkQueueConfig(const SplitChoiceInputs& in, int32_t block_size) {
  WorkQueueConfig c;
  c.persistent_ctas = std::max(in.num_sms, 1) * CtasPerSm(in);
  const int group = in.num_kv_heads > 0 ? std::max(1, in.num_q_heads / in.num_kv_heads) : 1;
  // Aim for ~8 tiles per CTA assuming half the batch's maximum as the mean context.
  const int64_t tokens = static_cast<int64_t>(std::max(in.num_seqs, 1)) *
                         std::max(in.num_kv_heads, 1) * ((group + 7) / 8) *
                         std::max(in.max_context_len / 2, 1);
  int64_t chunk = tokens / (static_cast<int64_t>(c.persistent_ctas) * 8);
  chunk = std::clamp<int64_t>(chunk, 64, 512);
  const int64_t bs = std::max(block_size, 1);
  c.chunk_tokens = static_cast<int32_t>((chunk + bs - 1) / bs * bs);
  c.tiles_per_claim = 1;
  return c;
}

}  // namespace ts::kernels
