// Decode attention with the fused RoPE (DecodeAttentionParams::rope) against rope_kv followed by
// the plain kernel, bit for bit, and its checks of the current token's slot. The harness and the
// reference: tests/kernels/decode_attention_harness.h.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/decode_attention.cuh"
#include "kernels/prepare_decode.cuh"
#include "kernels/rope_kv.cuh"
#include "models/rope.h"
#include "tests/kernels/attention_test_util.h"
#include "tests/kernels/decode_attention_harness.h"

namespace ts::kernels::testing {
namespace {

std::vector<__nv_bfloat16> DownloadBf16(const __nv_bfloat16* p, size_t n) {
  std::vector<__nv_bfloat16> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return v;
}

// The RoPE angles of `positions` as a decode step gets them: from the prepare kernel, row s being
// an active slot at positions[s]. [rows, pairs, 2] floats.
std::unique_ptr<GuardedBuffer<float>> AnglesFromPrepare(const std::vector<int32_t>& positions,
                                                        const float* inv_freq, int32_t pairs) {
  const int32_t n = static_cast<int32_t>(positions.size());
  std::vector<SlotRow> slots(n);
  std::vector<int32_t> row_slots(n);
  for (int32_t s = 0; s < n; ++s) {
    slots[s].state = kSlotActive;
    slots[s].prompt_len = positions[s];  // position = prompt_len + generated - 1
    slots[s].generated = 1;
    row_slots[s] = s;
  }
  GuardedBuffer<SlotRow> d_slots(n);
  GuardedBuffer<int32_t> d_rows(n), tables(n), tokens(n), pos(n), mapping(n), ctx(n), out_tables(n),
      sample_slots(n);
  GuardedBuffer<SamplingRow> sampling(n);
  auto angles = std::make_unique<GuardedBuffer<float>>(static_cast<size_t>(n) * pairs * 2);
  d_slots.Upload(slots);
  d_rows.Upload(row_slots);
  tables.Upload(std::vector<int32_t>(n, 0));
  const PrepareDecodeParams p{.row_slots = d_rows.get(),
                              .slots = d_slots.get(),
                              .slot_block_tables = tables.get(),
                              .tokens = tokens.get(),
                              .positions = pos.get(),
                              .slot_mapping = mapping.get(),
                              .context_lens = ctx.get(),
                              .block_tables = out_tables.get(),
                              .sampling = sampling.get(),
                              .sample_slots = sample_slots.get(),
                              .rows = n,
                              .num_slots = n,
                              .max_blocks = 1,
                              .block_size = kBlockSize,
                              .rope_angles = angles->get(),
                              .inv_freq = inv_freq,
                              .rope_pairs = pairs};
  EXPECT_TRUE(LaunchPrepareDecode(p, nullptr).ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return angles;
}

// h's launch in mode m with the fused RoPE: q from qkv, the current K/V into h's cache.
DecodeAttentionParams FusedRopeParams(const DecodeHarness& h, const ModeConfig& m,
                                      const __nv_bfloat16* qkv, const float* angles,
                                      const int32_t* slot_mapping, int32_t* error_flag) {
  DecodeAttentionParams p = h.Params(m);
  p.q = nullptr;
  p.rope = DecodeAttentionRope{.qkv = qkv,
                               .angles = angles,
                               .slot_mapping = slot_mapping,
                               .k_cache = h.k_device(),
                               .v_cache = h.v_device(),
                               .error_flag = error_flag};
  return p;
}

// The fused RoPE (DecodeAttentionParams::rope) against the two kernels it replaces: rope_kv (q into
// its own buffer, K/V into a copy of the cache) then attention on that q. The output and the whole
// cache must match bit for bit in every mode, with the fused side's current K/V slots set to NaN
// before each launch, so a tile that read its current token from the cache instead of its own
// copy shows. The angles come from the prepare kernel, as in a step. Positions run far past the
// contexts (accurate sincosf's slow path), a padding row writes nothing (kNoKvWrite), and 32 query
// heads on 2 kv heads give two tiles per kv head that both write.
TEST(DecodeAttentionTest, FusedRopeIsBitwiseRopeKvThenAttention) {
  for (const auto& [heads, d] : {std::pair{Heads{32, 8}, 128}, std::pair{Heads{32, 2}, 128},
                                 std::pair{Heads{8, 2}, 64}, std::pair{Heads{4, 4}, 16}}) {
    SCOPED_TRACE(absl::StrCat("Hq ", heads.q, " Hkv ", heads.kv, " head_dim ", d));
    const std::vector<int32_t> ctx = {1, 15, 16, 17, 0, 64, 65, 300, 1000, 2049};
    const DecodeHarness h(heads, d, ctx, 500 + d + heads.kv);
    const PagedKv& kv = h.kv();
    const int n = h.num_seqs(), width = (heads.q + 2 * heads.kv) * d;
    std::vector<float> qkv = HashedValues(size_t(n) * width, 900 + d, 2.f);
    std::vector<int32_t> positions(n), slots(n);
    for (int s = 0; s < n; ++s) {
      const int cur = ctx[s] - 1;
      positions[s] = s % 2 == 0 ? std::max(cur, 0) : 100000 + 37 * s;
      slots[s] =
          cur < 0 ? kNoKvWrite
                  : kv.tables[size_t(s) * kv.max_blocks_per_seq + cur / kBlockSize] * kBlockSize +
                        cur % kBlockSize;
    }
    ModelConfig config;
    config.head_dim = d;
    config.rope_theta = 500000.0f;
    const absl::StatusOr<std::vector<float>> inv = ts::RopeInvFreq(config);
    ASSERT_TRUE(inv.ok()) << inv.status();
    // rope_kv rotates k in place: it gets a copy of qkv, the fused kernel the original.
    GuardedBuffer<__nv_bfloat16> dqkv(qkv.size()), ref_qkv(qkv.size()), ref_q(h.q().size());
    GuardedBuffer<__nv_bfloat16> ref_k(kv.k.size()), ref_v(kv.v.size());
    GuardedBuffer<int32_t> dpos(n), dslots(n), rope_flag(1);
    GuardedBuffer<float> dinv(inv->size());
    dqkv.Upload(ToBf16(qkv));
    ref_qkv.Upload(ToBf16(qkv));
    dpos.Upload(positions);
    dslots.Upload(slots);
    dinv.Upload(*inv);
    rope_flag.Upload({0});
    const size_t cache_bytes = kv.k.size() * sizeof(__nv_bfloat16);
    ASSERT_EQ(cudaMemcpy(ref_k.get(), h.k_device(), cache_bytes, cudaMemcpyDeviceToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(ref_v.get(), h.v_device(), cache_bytes, cudaMemcpyDeviceToDevice),
              cudaSuccess);
    const KvLayout layout{kv.num_blocks, heads.kv, kBlockSize, d};
    RopeKvParams r;
    r.qkv = ref_qkv.get();
    r.q_out = ref_q.get();
    r.positions = dpos.get();
    r.slot_mapping = dslots.get();
    r.inv_freq = dinv.get();
    r.k_cache = ref_k.get();
    r.v_cache = ref_v.get();
    r.layout = layout;
    r.rows = n;
    r.num_q_heads = heads.q;
    ASSERT_TRUE(LaunchRopeKv(r, nullptr).ok());
    const std::vector<__nv_bfloat16> want_k = ref_k.Download(), want_v = ref_v.Download();
    const std::unique_ptr<GuardedBuffer<float>> angles =
        AnglesFromPrepare(positions, dinv.get(), d / 2);

    for (const ModeConfig& m : AllModes(h)) {
      SCOPED_TRACE(m.Name());
      DecodeAttentionParams p = h.Params(m);
      p.q = ref_q.get();
      p.k_cache = ref_k.get();
      p.v_cache = ref_v.get();
      h.Poison(nullptr);
      ASSERT_TRUE(LaunchDecodeAttention(p, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> want = h.Output();

      for (int s = 0; s < n; ++s) {
        for (int kvh = 0; kvh < heads.kv && ctx[s] > 0; ++kvh) {
          const size_t off = kv.Offset(s, kvh, ctx[s] - 1);
          ASSERT_EQ(cudaMemset(h.k_device() + off, 0xFF, d * sizeof(__nv_bfloat16)), cudaSuccess);
          ASSERT_EQ(cudaMemset(h.v_device() + off, 0xFF, d * sizeof(__nv_bfloat16)), cudaSuccess);
        }
      }
      p = FusedRopeParams(h, m, dqkv.get(), angles->get(), dslots.get(), rope_flag.get());
      h.Poison(nullptr);
      ASSERT_TRUE(LaunchDecodeAttention(p, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> got = h.Output();
      ASSERT_EQ(got.size(), want.size());
      EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
      EXPECT_EQ(
          std::memcmp(DownloadBf16(h.k_device(), kv.k.size()).data(), want_k.data(), cache_bytes),
          0)
          << "k cache";
      EXPECT_EQ(
          std::memcmp(DownloadBf16(h.v_device(), kv.v.size()).data(), want_v.data(), cache_bytes),
          0)
          << "v cache";
      EXPECT_EQ(h.Flag(), 0);
      EXPECT_EQ(rope_flag.Download()[0], 0);
    }
    h.ExpectGuards();
    EXPECT_TRUE(angles->GuardsIntact());
  }
}

// A current token's slot outside the pool (kBadKvSlot, or one past the last slot) is an engine bug:
// the fused RoPE raises rope.error_flag and writes nothing, as rope_kv does.
TEST(DecodeAttentionTest, FusedRopeFlagsABadSlotAndWritesNothing) {
  const Heads heads{8, 2};
  const int d = 64;
  const DecodeHarness h(heads, d, {40, 17, 300}, 31);
  const PagedKv& kv = h.kv();
  const int n = h.num_seqs();
  GuardedBuffer<__nv_bfloat16> dqkv(size_t(n) * (heads.q + 2 * heads.kv) * d);
  dqkv.Upload(ToBf16(HashedValues(dqkv.size(), 8, 2.f)));
  ModelConfig config;
  config.head_dim = d;
  const absl::StatusOr<std::vector<float>> inv = ts::RopeInvFreq(config);
  ASSERT_TRUE(inv.ok()) << inv.status();
  GuardedBuffer<float> dinv(inv->size());
  dinv.Upload(*inv);
  GuardedBuffer<int32_t> dslots(n), rope_flag(1);
  const std::unique_ptr<GuardedBuffer<float>> angles =
      AnglesFromPrepare({39, 16, 299}, dinv.get(), d / 2);
  const std::vector<__nv_bfloat16> k0 = DownloadBf16(h.k_device(), kv.k.size());
  const std::vector<__nv_bfloat16> v0 = DownloadBf16(h.v_device(), kv.v.size());
  for (const int32_t bad : {kBadKvSlot, kv.num_blocks * kBlockSize}) {
    SCOPED_TRACE(absl::StrCat("slot ", bad));
    dslots.Upload({kNoKvWrite, bad, kNoKvWrite});
    rope_flag.Upload({0});
    const DecodeAttentionParams p =
        FusedRopeParams(h, {DecodeAttentionMode::kStaticSplit, 3}, dqkv.get(), angles->get(),
                        dslots.get(), rope_flag.get());
    ASSERT_TRUE(LaunchDecodeAttention(p, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(rope_flag.Download()[0], 1);
    EXPECT_EQ(h.Flag(), 0);
    const size_t bytes = kv.k.size() * sizeof(__nv_bfloat16);
    EXPECT_EQ(std::memcmp(DownloadBf16(h.k_device(), kv.k.size()).data(), k0.data(), bytes), 0);
    EXPECT_EQ(std::memcmp(DownloadBf16(h.v_device(), kv.v.size()).data(), v0.data(), bytes), 0);
  }
  h.ExpectGuards();
}

}  // namespace
}  // namespace ts::kernels::testing
