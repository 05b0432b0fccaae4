// Host-only checks of the attention launchers: parameter validation (every rejection happens before
// any CUDA call, so this runs without a GPU), the split geometry shared by the split and combine
// kernels, and the host heuristics.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "kernels/attention_combine.cuh"
#include "kernels/attention_common.cuh"
#include "kernels/decode_attention.cuh"
#include "kernels/kv_layout.cuh"
#include "kernels/prefill_attention.cuh"

namespace ts::kernels {
namespace {

using attention_internal::NumActiveSplits;
using attention_internal::SplitGeometry;
using attention_internal::SplitTokens;

template <typename T>
T* Fake(uintptr_t addr) {
  return reinterpret_cast<T*>(addr);  // never dereferenced: validation fails first
}

void ExpectInvalid(const absl::Status& s, const std::string& field) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find(field), std::string::npos) << s;
}

DecodeAttentionParams ValidDecode() {
  DecodeAttentionParams p;
  p.q = Fake<const __nv_bfloat16>(0x10000);
  p.k_cache = Fake<const __nv_bfloat16>(0x20000);
  p.v_cache = Fake<const __nv_bfloat16>(0x30000);
  p.block_tables = Fake<const int32_t>(0x40000);
  p.context_lens = Fake<const int32_t>(0x50000);
  p.out = Fake<__nv_bfloat16>(0x60000);
  p.workspace = Fake<void>(0x70000);
  p.num_seqs = 4;
  p.num_q_heads = 32;
  p.num_kv_heads = 8;
  p.head_dim = 128;
  p.block_size = 16;
  p.num_blocks = 100;
  p.max_blocks_per_seq = 20;
  p.scale = 0.088f;
  p.max_splits = 8;
  p.num_splits = 4;
  p.workspace_bytes = DecodeAttentionWorkspaceBytes(4, 32, 128, 8);
  return p;
}

TEST(DecodeAttentionParamsTest, RejectsEachBadField) {
  DecodeAttentionParams p = ValidDecode();
  p.head_dim = 96;
  p.workspace_bytes = DecodeAttentionWorkspaceBytes(4, 32, 96, 8);
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "head_dim");
  p = ValidDecode();
  p.head_dim = 32;
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "head_dim");
  p = ValidDecode();
  p.num_kv_heads = 5;
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "num_q_heads");
  p = ValidDecode();
  p.block_size = 12;
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "block_size");
  p = ValidDecode();
  p.num_splits = 9;
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "num_splits");
  p = ValidDecode();
  p.workspace_bytes -= 1;
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "workspace_bytes");
  p = ValidDecode();
  p.q = Fake<const __nv_bfloat16>(0x10008);
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "q");
  p = ValidDecode();
  p.context_lens = nullptr;
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "context_lens");
  p = ValidDecode();
  p.mode = DecodeAttentionMode::kWorkQueue;
  p.persistent_ctas = 0;
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "persistent_ctas");
  p.persistent_ctas = 132;
  p.chunk_tokens = 0;
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "chunk_tokens");
  p.chunk_tokens = 256;
  p.tiles_per_claim = 0;
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "tiles_per_claim");
  p.tiles_per_claim = 1;
  p.no_combine = true;  // the work queue always needs its combine kernel
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "no_combine");
  p = ValidDecode();
  p.no_combine = true;  // num_splits 4: the partials must be merged
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "no_combine");
}

// The fused RoPE: q or qkv, never both, and targets that describe the attention's own cache.
TEST(DecodeAttentionParamsTest, RejectsEachBadFusedRopeField) {
  auto fused = [] {
    DecodeAttentionParams p = ValidDecode();
    p.q = nullptr;
    p.rope = DecodeAttentionRope{.qkv = Fake<const __nv_bfloat16>(0x80000),
                                 .angles = Fake<const float>(0x90000),
                                 .slot_mapping = Fake<const int32_t>(0xA0000),
                                 .k_cache = Fake<__nv_bfloat16>(0x20000),
                                 .v_cache = Fake<__nv_bfloat16>(0x30000)};
    return p;
  };
  DecodeAttentionParams p = fused();
  p.q = Fake<const __nv_bfloat16>(0x10000);
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "q or rope.qkv");
  p = fused();
  p.rope.qkv = nullptr;
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "q or rope.qkv");
  p = fused();
  p.rope.qkv = Fake<const __nv_bfloat16>(0x80008);
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "rope.qkv");
  p = fused();
  p.rope.angles = nullptr;
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "rope.angles");
  p = fused();
  p.rope.angles = Fake<const float>(0x90008);
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "rope.angles");
  p = fused();
  p.rope.slot_mapping = nullptr;
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "rope.slot_mapping");
  p = fused();
  p.rope.v_cache = Fake<__nv_bfloat16>(0x20000);
  ExpectInvalid(LaunchDecodeAttention(p, nullptr), "rope.k_cache");
}

TEST(AttentionCombineParamsTest, RejectsBadFields) {
  AttentionCombineParams c;
  c.partial_out = Fake<const float>(0x10000);
  c.partial_lse = Fake<const float>(0x20000);
  c.context_lens = Fake<const int32_t>(0x30000);
  c.out = Fake<__nv_bfloat16>(0x40000);
  c.num_seqs = 2;
  c.num_heads = 4;
  c.head_dim = 48;
  c.max_splits = 4;
  c.num_splits = 4;
  c.min_split_tokens = 1;
  c.block_size = 16;
  c.max_blocks_per_seq = 8;
  ExpectInvalid(LaunchAttentionCombine(c, nullptr), "head_dim");
  c.head_dim = 64;
  c.num_splits = 5;
  ExpectInvalid(LaunchAttentionCombine(c, nullptr), "num_splits");
}

TEST(PrefillAttentionParamsTest, RejectsBadFields) {
  PrefillAttentionParams p;
  p.q = Fake<const __nv_bfloat16>(0x10000);
  p.k_cache = Fake<const __nv_bfloat16>(0x20000);
  p.v_cache = Fake<const __nv_bfloat16>(0x30000);
  p.block_tables = Fake<const int32_t>(0x40000);
  p.cu_seqlens = Fake<const int32_t>(0x50000);
  p.out = Fake<__nv_bfloat16>(0x60000);
  p.num_seqs = 2;
  p.total_tokens = 10;
  p.max_q_len = 8;
  p.num_q_heads = 8;
  p.num_kv_heads = 2;
  p.head_dim = 100;
  p.block_size = 16;
  p.num_blocks = 4;
  p.max_blocks_per_seq = 2;
  p.scale = 0.1f;
  ExpectInvalid(LaunchPrefillAttention(p, nullptr), "head_dim");
  p.head_dim = 64;
  p.max_q_len = 11;
  ExpectInvalid(LaunchPrefillAttention(p, nullptr), "max_q_len");
  p.max_q_len = 8;
  p.cu_seqlens = nullptr;
  ExpectInvalid(LaunchPrefillAttention(p, nullptr), "cu_seqlens");
}

// The combine kernel trusts NumActiveSplits to stay within what the split kernel wrote.
TEST(SplitGeometryTest, ActiveSplitsCoverContextWithinBound) {
  for (int num_splits : {1, 2, 3, 7, 16, 64}) {
    for (int min_tokens : {1, 16, 64, 256}) {
      const SplitGeometry g{num_splits, min_tokens, 16, 1 << 20};
      for (int ctx = 1; ctx <= 5000; ctx += (ctx < 300 ? 1 : 37)) {
        const int per = SplitTokens(g, ctx);
        const int n = NumActiveSplits(g, ctx);
        ASSERT_GE(n, 1);
        ASSERT_LE(n, num_splits) << "ctx " << ctx;
        ASSERT_GE(per * n, ctx);
        ASSERT_LT(per * (n - 1), ctx);
        ASSERT_GE(per, min_tokens);
        if (min_tokens % 16 == 0) {
          ASSERT_EQ(per % 16, 0);
        }
      }
    }
  }
}

TEST(DecodeHeuristicsTest, SplitChoicesStayInRange) {
  SplitChoiceInputs in;
  in.num_q_heads = 32;
  in.num_kv_heads = 8;
  in.num_sms = 132;
  in.max_splits = 32;
  in.num_seqs = 1;
  in.max_context_len = 8000;
  EXPECT_EQ(ChooseNumSplits(in), 32);  // one sequence: as many splits as the workspace allows
  in.max_context_len = 60;
  EXPECT_EQ(ChooseNumSplits(in), 1);  // short context: splitting would not pay
  // 8 tiles per split leave SMs idle: splits down to 64 tokens (min_split_tokens 0), up to 17.
  in.max_context_len = 100;
  EXPECT_EQ(ChooseNumSplits(in), 2);
  in.max_context_len = 512;
  EXPECT_EQ(ChooseNumSplits(in), 8);
  in.min_split_tokens = 32;
  EXPECT_EQ(ChooseNumSplits(in), 16);
  in.max_context_len = 4096;
  EXPECT_EQ(ChooseNumSplits(in), 32);  // 32 x 128 tokens already fill the SMs
  in.min_split_tokens = 128;
  in.max_context_len = 512;
  EXPECT_EQ(ChooseNumSplits(in), 4);  // the floor of grids that fill the GPU
  in.min_split_tokens = 0;
  in.num_seqs = 8;  // 64 tiles per split: 128-token splits already give 256 tiles
  EXPECT_EQ(ChooseNumSplits(in), 4);
  in.num_seqs = 256;
  in.max_context_len = 8000;
  EXPECT_EQ(ChooseNumSplits(in), 8);  // 2048 tiles fill the GPU, but splits stay <= 1024 tokens
  in.max_context_len = 1024;
  EXPECT_EQ(ChooseNumSplits(in), 1);
  // One wave, not two: 64 x 8 tiles per split against 132 x 4 resident CTAs.
  in.num_seqs = 64;
  in.max_context_len = 384;
  in.ctas_per_sm = 4;
  EXPECT_EQ(ChooseNumSplits(in), 1);
  // 128 tiles per split cover half the SMs: 4 splits fit in one wave, but splits keep >= 256
  // tokens, and the latency branch no longer applies.
  in.num_seqs = 16;
  EXPECT_EQ(ChooseNumSplits(in), 2);
  in.max_context_len = 4096;
  EXPECT_EQ(ChooseNumSplits(in), 4);
  in.ctas_per_sm = 0;
  in.max_context_len = 256;
  EXPECT_EQ(ChooseNumSplits(in), 1);
  in.num_seqs = 8;  // 64 tiles per split: 128-token splits, then up to one tile per SM at >= 64
  EXPECT_EQ(ChooseNumSplits(in), 3);
  in.num_seqs = 32;
  const WorkQueueConfig wq = ChooseWorkQueueConfig(in, 16);
  EXPECT_EQ(wq.persistent_ctas, 3 * 132);  // ctas_per_sm 0 means 3
  in.ctas_per_sm = 2;
  EXPECT_EQ(ChooseWorkQueueConfig(in, 16).persistent_ctas, 2 * 132);
  EXPECT_EQ(wq.chunk_tokens % 16, 0);
  EXPECT_GE(wq.chunk_tokens, 64);
  EXPECT_LE(wq.chunk_tokens, 512);
  EXPECT_GE(wq.tiles_per_claim, 1);
}

TEST(PrefillHeuristicsTest, SplitChoiceFillsTheGpuOnlyWhereTilesDoNot) {
  // 64 tokens x 4 heads per kv head = 2 CTAs of 128 rows x 8 kv heads = 16 CTAs on 132 SMs (264
  // slots of two per SM): splits up to one wave pay fully, so the caps decide: the keys (40 tiles
  // / 4 = 10), the partials' room, 16.
  EXPECT_EQ(PrefillAttentionSplits(64, 64, 1, 32, 8, 2560, 132, 2048), 10);
  EXPECT_EQ(PrefillAttentionSplits(64, 64, 1, 32, 8, 1024, 132, 2048), 4);       // 16 key tiles
  EXPECT_EQ(PrefillAttentionSplits(64, 64, 1, 32, 8, 32000, 132, 256), 4);       // room: 256 / 64
  EXPECT_EQ(PrefillAttentionSplits(64, 64, 1, 32, 8, 32000, 132, 1 << 20), 16);  // at most 16
  EXPECT_EQ(PrefillAttentionSplits(2048, 2048, 1, 32, 8, 32000, 132, 2048), 1);  // 512 CTAs
  EXPECT_EQ(PrefillAttentionSplits(64, 64, 1, 32, 8, 200, 132, 2048), 1);        // a short prefix
  // A 256-token chunk after a 16k prefix: 64 CTAs. 4 splits fill 256 of 264 slots; 5 would need a
  // second wave for 25% more work per wave-time, and 8 only tie with 4 (two full waves).
  EXPECT_EQ(PrefillAttentionSplits(256, 256, 1, 32, 8, 16640, 132, 2048), 4);
  // 256 CTAs already fill one wave: a second split would only double the waves.
  EXPECT_EQ(PrefillAttentionSplits(1024, 1024, 1, 32, 8, 32000, 132, 2048), 1);
  // Past one wave a split must fill the last wave better: 200 CTAs, 5 splits = 1000 CTAs in 4
  // waves (1.25 splits per wave) beat 1-4 splits (1 per wave); 9 = 1800 in 7 waves beat 5.
  EXPECT_EQ(PrefillAttentionSplits(800, 800, 1, 32, 8, 32000, 132, 8000), 9);
  EXPECT_EQ(PrefillAttentionSplits(800, 800, 1, 32, 8, 32000, 132, 5600), 5);  // room: 7
  // Several sequences: 4 x 16 = 64 CTAs, as one 256-token chunk.
  EXPECT_EQ(PrefillAttentionSplits(256, 64, 4, 32, 8, 16640, 132, 2048), 4);
}

TEST(DecodeWorkspaceTest, SizeCoversCountersLseAndPartials) {
  const size_t b = DecodeAttentionWorkspaceBytes(3, 5, 64, 7);
  EXPECT_GE(b, kDecodeAttentionCounterBytes + 3 * 5 * 7 * 4 + 3 * 5 * 7 * 64 * 4);
  EXPECT_LT(b, kDecodeAttentionCounterBytes + 3 * 5 * 7 * 4 + 3 * 5 * 7 * 64 * 4 + 256);
}

// The block-table row the engine stages: real ids, then kInvalidKvBlock padding. A position on
// the padding or past the row must map to kBadKvSlot (flagged by the K/V writers), never to a slot
// of block 0 or to kNoKvWrite (a silent skip).
TEST(KvLayoutTest, KvSlotForRejectsPaddingAndPositionsPastTheTable) {
  const int32_t table[4] = {7, 2, kInvalidKvBlock, kInvalidKvBlock};
  for (const int32_t bs : {1, 16, 256}) {
    SCOPED_TRACE(bs);
    EXPECT_EQ(KvSlotFor(table, 4, bs, 0), 7 * bs);
    EXPECT_EQ(KvSlotFor(table, 4, bs, bs - 1), 7 * bs + bs - 1);
    EXPECT_EQ(KvSlotFor(table, 4, bs, 2 * bs - 1), 2 * bs + bs - 1);
    for (const int32_t pos : {2 * bs, 3 * bs - 1, 3 * bs, 4 * bs - 1, 4 * bs, 4 * bs + 1, -1})
      EXPECT_EQ(KvSlotFor(table, 4, bs, pos), kBadKvSlot) << "pos " << pos;
  }
  const int32_t negative[1] = {-1};  // any negative id, e.g. an old -1 padding
  EXPECT_EQ(KvSlotFor(negative, 1, 16, 15), kBadKvSlot);
  const int32_t huge[1] = {INT32_MAX / 8};  // a slot past int32: rejected, not wrapped
  EXPECT_EQ(KvSlotFor(huge, 1, 16, 3), kBadKvSlot);
  EXPECT_NE(kBadKvSlot, kNoKvWrite);
}

// The writers' range check (rope_kv, the GEMV's RoPE epilogue, decode attention's fused RoPE):
// every slot of the pool and nothing else, including past int32 products of blocks x block size.
TEST(KvLayoutTest, KvSlotInPoolIsExactlyThePool) {
  EXPECT_TRUE(KvSlotInPool(0, 3, 16));
  EXPECT_TRUE(KvSlotInPool(3 * 16 - 1, 3, 16));
  EXPECT_FALSE(KvSlotInPool(3 * 16, 3, 16));
  EXPECT_FALSE(KvSlotInPool(kNoKvWrite, 3, 16));
  EXPECT_FALSE(KvSlotInPool(kBadKvSlot, 3, 16));
  EXPECT_TRUE(KvSlotInPool(INT32_MAX, 1 << 24, 256));  // the pool spans more than int32 slots
  EXPECT_FALSE(KvSlotInPool(INT32_MAX, 1, 256));
}

}  // namespace
}  // namespace ts::kernels
