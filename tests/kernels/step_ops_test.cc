// The small ops around a step, each against a host model: prepare_decode (a step's per-row inputs
// from the slot table), gather_rows (prompt rows into the head's rows) and fill_uniform (device
// random weights). Outputs start poisoned and guarded, so a row left unwritten, a stray write or
// an out-of-bounds one fails.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "common/philox.h"
#include "kernels/fill_uniform.cuh"
#include "kernels/gather_rows.cuh"
#include "kernels/kv_layout.cuh"
#include "kernels/prepare_decode.cuh"
#include "tests/kernels/kernel_test_util.h"

namespace ts::kernels::testing {
namespace {

struct PrepareCase {
  int32_t num_slots, max_blocks, block_size, rows;
  uint32_t seed;
};

TEST(PrepareDecodeTest, RowsFromTheSlotTableAsTheHostModelSays) {
  const PrepareCase cases[] = {
      {8, 6, 16, 8, 1}, {64, 40, 16, 48, 2}, {5, 3, 4, 7, 3}, {128, 300, 32, 128, 4}};
  for (const PrepareCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "slots " << c.num_slots << " rows " << c.rows);
    std::mt19937 rng(c.seed);
    auto pick = [&](int n) { return static_cast<int32_t>(rng() % static_cast<uint32_t>(n)); };
    std::vector<SlotRow> slots(c.num_slots);
    std::vector<int32_t> tables(static_cast<size_t>(c.num_slots) * c.max_blocks);
    for (int32_t& b : tables) b = pick(10000);
    for (int32_t i = 0; i < c.num_slots; ++i) {
      SlotRow& s = slots[i];
      const int k = pick(10);
      s.state = k < 7 ? kSlotActive : k < 8 ? kSlotFinished : k < 9 ? kSlotReady : kSlotFree;
      s.prompt_len = 1 + pick(c.max_blocks * c.block_size / 2);
      // Some contexts reach past the table: the row must get kBadKvSlot, not a silent skip.
      s.generated = 1 + pick(c.max_blocks * c.block_size / 2 + 3);
      s.last_token = pick(50000);
      s.sampling.temperature = 0.5f + pick(10) * 0.1f;
      s.sampling.top_k = pick(50);
      s.sampling.seed = rng();
      if (pick(5) == 0)
        tables[static_cast<size_t>(i) * c.max_blocks + pick(c.max_blocks)] = kInvalidKvBlock;
    }
    // Slot 0 sits just past its table, and is always a row: it must get kBadKvSlot, not a skip.
    slots[0].state = kSlotActive;
    slots[0].prompt_len = c.max_blocks * c.block_size;
    slots[0].generated = 1;
    // Rows: a shuffled subset of the slots, padding (-1) and out-of-range ids among them.
    std::vector<int32_t> rows(c.rows);
    std::vector<int32_t> order(c.num_slots);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int32_t r = 0; r < c.rows; ++r) {
      const int k = pick(8);
      rows[r] = k == 0 ? -1 : k == 1 ? c.num_slots + pick(3) : order[r % c.num_slots];
    }
    rows[pick(c.rows)] = 0;

    GuardedBuffer<int32_t> d_rows(rows.size()), d_tables(tables.size()), tokens(c.rows),
        positions(c.rows), mapping(c.rows), context(c.rows),
        out_tables(static_cast<size_t>(c.rows) * c.max_blocks), sample_slots(c.rows);
    GuardedBuffer<SlotRow> d_slots(slots.size());
    GuardedBuffer<SamplingRow> sampling(c.rows);
    // RoPE angles for a head_dim of 64: Llama 3's inverse frequencies (base 500000).
    constexpr int32_t kPairs = 32;
    std::vector<float> inv_freq(kPairs);
    for (int32_t i = 0; i < kPairs; ++i) {
      inv_freq[i] = static_cast<float>(1.0 / std::pow(500000.0, 2.0 * i / (2 * kPairs)));
    }
    GuardedBuffer<float> d_inv(kPairs), angles(static_cast<size_t>(c.rows) * kPairs * 2);
    d_inv.Upload(inv_freq);
    d_rows.Upload(rows);
    d_tables.Upload(tables);
    d_slots.Upload(slots);
    PrepareDecodeParams p{.row_slots = d_rows.get(),
                          .slots = d_slots.get(),
                          .slot_block_tables = d_tables.get(),
                          .tokens = tokens.get(),
                          .positions = positions.get(),
                          .slot_mapping = mapping.get(),
                          .context_lens = context.get(),
                          .block_tables = out_tables.get(),
                          .sampling = sampling.get(),
                          .sample_slots = sample_slots.get(),
                          .rows = c.rows,
                          .num_slots = c.num_slots,
                          .max_blocks = c.max_blocks,
                          .block_size = c.block_size,
                          .rope_angles = angles.get(),
                          .inv_freq = d_inv.get(),
                          .rope_pairs = kPairs};
    TS_ASSERT_OK(LaunchPrepareDecode(p, nullptr));
    TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());

    const std::vector<int32_t> got_tok = tokens.Download(), got_pos = positions.Download(),
                               got_map = mapping.Download(), got_ctx = context.Download(),
                               got_tab = out_tables.Download(), got_ss = sample_slots.Download();
    const std::vector<SamplingRow> got_samp = sampling.Download();
    const std::vector<float> got_angles = angles.Download();
    // Each pair is (cos, sin) of float(pos) * inv_freq[i], formed in fp32 as transformers forms
    // it, then rounded to bf16: within a bf16 rounding (2^-9 on [-1, 1]) and sincosf's few fp32
    // ulps of the exact value.
    auto expect_angles = [&](int32_t r, int32_t pos) {
      for (int32_t i = 0; i < kPairs; ++i) {
        const double angle = static_cast<double>(static_cast<float>(pos) * inv_freq[i]);
        const float* got = got_angles.data() + (static_cast<size_t>(r) * kPairs + i) * 2;
        EXPECT_NEAR(got[0], std::cos(angle), 0x1p-9 + 0x1p-20) << "cos, pair " << i;
        EXPECT_NEAR(got[1], std::sin(angle), 0x1p-9 + 0x1p-20) << "sin, pair " << i;
        EXPECT_EQ(got[0], RoundBf16(got[0])) << "cos, pair " << i << " is not bf16";
        EXPECT_EQ(got[1], RoundBf16(got[1])) << "sin, pair " << i << " is not bf16";
      }
    };
    int active = 0, padding = 0, bad_kv = 0;
    for (int32_t r = 0; r < c.rows; ++r) {
      SCOPED_TRACE(::testing::Message() << "row " << r << " slot " << rows[r]);
      const int32_t slot = rows[r];
      const bool valid = slot >= 0 && slot < c.num_slots && slots[slot].state == kSlotActive;
      if (!valid) {
        expect_angles(r, 0);
        ++padding;
        EXPECT_EQ(got_tok[r], 0);
        EXPECT_EQ(got_pos[r], 0);
        EXPECT_EQ(got_map[r], kNoKvWrite);
        EXPECT_EQ(got_ctx[r], 0);
        EXPECT_EQ(got_ss[r], c.num_slots);
        EXPECT_EQ(got_samp[r].temperature, 0.0f);
        continue;
      }
      ++active;
      const SlotRow& s = slots[slot];
      const int32_t pos = s.prompt_len + s.generated - 1;
      const int32_t* table = tables.data() + static_cast<size_t>(slot) * c.max_blocks;
      EXPECT_EQ(got_tok[r], s.last_token);
      EXPECT_EQ(got_pos[r], pos);
      expect_angles(r, pos);
      const int32_t want_map = KvSlotFor(table, c.max_blocks, c.block_size, pos);
      bad_kv += want_map == kBadKvSlot;
      EXPECT_EQ(got_map[r], want_map);
      EXPECT_EQ(got_ctx[r], pos + 1);
      EXPECT_EQ(got_ss[r], slot);
      const int32_t used = std::min(pos / c.block_size + 1, c.max_blocks);
      for (int32_t b = 0; b < used; ++b) {
        EXPECT_EQ(got_tab[static_cast<size_t>(r) * c.max_blocks + b], table[b]) << "entry " << b;
      }
      SamplingRow want = s.sampling;
      want.position = static_cast<uint64_t>(pos) + 1;
      EXPECT_EQ(std::memcmp(&got_samp[r], &want, sizeof(want)), 0) << "sampling row";
    }
    EXPECT_GT(active, 0);
    EXPECT_GT(padding, 0);
    for (auto* b : {&tokens, &positions, &mapping, &context, &out_tables, &sample_slots}) {
      EXPECT_TRUE(b->GuardsIntact());
    }
    EXPECT_TRUE(sampling.GuardsIntact());
    EXPECT_TRUE(angles.GuardsIntact());
    EXPECT_GT(bad_kv, 0) << "no row reached past its table";
  }
}

TEST(PrepareDecodeTest, RejectsBadParams) {
  PrepareDecodeParams p;
  EXPECT_TRUE(LaunchPrepareDecode(p, nullptr).ok());  // zero rows launch nothing
  p.rows = 2;
  TS_EXPECT_INVALID(LaunchPrepareDecode(p, nullptr), "prepare.num_slots");
  p.num_slots = 2;
  p.max_blocks = 1;
  p.block_size = 16;
  TS_EXPECT_INVALID(LaunchPrepareDecode(p, nullptr), "prepare.row_slots");
  // Every other pointer set (never dereferenced: validation fails first), then the angles'.
  int32_t* const fake = reinterpret_cast<int32_t*>(uintptr_t{0x10000});
  p.row_slots = p.slot_block_tables = p.tokens = p.positions = p.slot_mapping = p.context_lens =
      p.block_tables = p.sample_slots = fake;
  p.slots = reinterpret_cast<const SlotRow*>(fake);
  p.sampling = reinterpret_cast<SamplingRow*>(fake);
  p.rope_angles = reinterpret_cast<float*>(uintptr_t{0x20008});
  TS_EXPECT_INVALID(LaunchPrepareDecode(p, nullptr), "prepare.rope_angles");
  p.rope_angles = reinterpret_cast<float*>(uintptr_t{0x20000});
  TS_EXPECT_INVALID(LaunchPrepareDecode(p, nullptr), "prepare.inv_freq");
  p.inv_freq = reinterpret_cast<const float*>(uintptr_t{0x30000});
  p.rope_pairs = 3;
  TS_EXPECT_INVALID(LaunchPrepareDecode(p, nullptr), "prepare.rope_pairs");
}

TEST(GatherRowsTest, CopiesTheChosenRowsAndNothingElse) {
  for (const int32_t width : {8, 2048, 4104}) {
    SCOPED_TRACE(::testing::Message() << "width " << width);
    const int32_t src_n = 37, dst_n = 20, n = 11;
    const std::vector<float> src = RandomFloats(static_cast<size_t>(src_n) * width, -3, 3, width);
    std::vector<int32_t> src_rows(n), dst_rows(n);
    std::mt19937 rng(width);
    std::vector<int32_t> dsts(dst_n);
    std::iota(dsts.begin(), dsts.end(), 0);
    std::shuffle(dsts.begin(), dsts.end(), rng);
    for (int32_t i = 0; i < n; ++i) {
      src_rows[i] = static_cast<int32_t>(rng() % src_n);
      dst_rows[i] = dsts[i];
    }
    GuardedBuffer<__nv_bfloat16> d_src(src.size()), d_dst(static_cast<size_t>(dst_n) * width);
    GuardedBuffer<int32_t> d_sr(n), d_dr(n);
    d_src.Upload(ToBf16(src));
    d_sr.Upload(src_rows);
    d_dr.Upload(dst_rows);
    const std::vector<__nv_bfloat16> before = d_dst.Download();  // poisoned
    TS_ASSERT_OK(LaunchGatherRows({.src = d_src.get(),
                                   .src_rows = d_sr.get(),
                                   .dst = d_dst.get(),
                                   .dst_rows = d_dr.get(),
                                   .n = n,
                                   .width = width},
                                  nullptr));
    TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<__nv_bfloat16> got = d_dst.Download();
    std::vector<int32_t> from(dst_n, -1);
    for (int32_t i = 0; i < n; ++i) from[dst_rows[i]] = src_rows[i];
    for (int32_t r = 0; r < dst_n; ++r) {
      const __nv_bfloat16* g = got.data() + static_cast<size_t>(r) * width;
      if (from[r] < 0) {
        EXPECT_EQ(std::memcmp(g, before.data() + static_cast<size_t>(r) * width, width * 2), 0)
            << "row " << r << " was not to be written";
        continue;
      }
      for (int32_t e = 0; e < width; ++e) {
        ASSERT_EQ(FromBf16(g[e]), RoundBf16(src[static_cast<size_t>(from[r]) * width + e]))
            << "row " << r << " element " << e;
      }
    }
    EXPECT_TRUE(d_dst.GuardsIntact());
  }
  TS_EXPECT_INVALID(LaunchGatherRows({.n = 1, .width = 12}, nullptr), "gather.width");
}

TEST(FillUniformTest, EqualsTheHostPhiloxValuesInRange) {
  for (const size_t n : {size_t{1}, size_t{1000}, size_t{3} << 20}) {
    SCOPED_TRACE(::testing::Message() << "n " << n);
    const uint64_t seed = 0x1234567890abcdefull + n;
    const float lo = -0.035f, hi = 0.035f;
    GuardedBuffer<__nv_bfloat16> out(n);
    TS_ASSERT_OK(
        LaunchFillUniform({.out = out.get(), .n = n, .seed = seed, .lo = lo, .hi = hi}, nullptr));
    TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<__nv_bfloat16> got = out.Download();
    size_t off_by_one_ulp = 0;
    double sum = 0;
    for (size_t i = 0; i < n; ++i) {
      const float g = FromBf16(got[i]);
      ASSERT_GE(g, RoundBf16(lo)) << i;
      ASSERT_LE(g, RoundBf16(hi)) << i;
      // nvcc may contract lo + (hi - lo) * u into one FMA; the host does not. The two floats then
      // differ by the product's rounding and the sum's, each at most half an ulp of values up to
      // |lo| + (hi - lo): under (hi - lo) * 2^-22 here. Near zero, where lo and the product
      // cancel, that is large against the result itself. After the bf16 rounding they differ by
      // that plus one bf16 step of the value (at most |value| * 2^-7), never more; a host emulation
      // with std::fma over these seeds stays within the bound (311 of 3M values differ).
      const float want = RoundBf16(lo + (hi - lo) * UniformFromSeed(seed, i));
      if (g != want) {
        ++off_by_one_ulp;
        ASSERT_LE(std::abs(g - want), std::abs(want) * 0x1p-7f + (hi - lo) * 0x1p-22f) << i;
      }
      sum += g;
    }
    EXPECT_LE(off_by_one_ulp, n / 100 + 1);
    if (n > 1000) {
      EXPECT_NEAR(sum / static_cast<double>(n), 0.0, 1e-3);  // centred
    }
    EXPECT_TRUE(out.GuardsIntact());
  }
}

}  // namespace
}  // namespace ts::kernels::testing
