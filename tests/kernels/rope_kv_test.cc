// LaunchRopeKv against CPU rotations (angle formed in fp32 as transformers does), over a grid of
// rows x head_dim x head counts with large positions, paged slots in shuffled order and skipped
// (-1) rows. Checks: q/k equal an emulation of transformers' bf16 rounding points (cos and sin
// rounded to bf16, q * cos and rotate_half(q) * sin rounded, their sum rounded) on >= 99% of
// elements bit for bit, and everywhere within what one flipped rounding of cos or sin can move
// (2^-8 of the products' magnitude + 2^-9 |out|); fp64 rotation within 5e-3 relative L2;
// v untouched in qkv; the cache holds exactly the rotated k and the raw v at each row's slot and
// nothing anywhere else (the rest of the pool keeps its poison); guards intact.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/rope_kv.cuh"
#include "models/rope.h"
#include "tests/kernels/kernel_test_util.h"

namespace ts::kernels {
namespace {

using testing::GuardedBuffer;

constexpr uint16_t kPoison = 0xFFFF;  // GuardedBuffer's poison, a bf16 NaN
constexpr int kBlockSize = 16;

uint16_t Bits(__nv_bfloat16 h) {
  return __nv_bfloat16_raw(h).x;
}

struct Shape {
  int rows, head_dim, hq, hkv;
};

struct Inputs {
  Shape s;
  int num_blocks;
  std::vector<float> qkv;  // [rows, (hq + 2 hkv) * D], bf16-exact
  std::vector<int32_t> positions, slots;
  std::vector<float> inv_freq;

  int RowWidth() const { return (s.hq + 2 * s.hkv) * s.head_dim; }
};

Inputs MakeInputs(const Shape& s, uint32_t seed) {
  Inputs in{s, s.rows / kBlockSize + 4, {}, {}, {}, {}};
  in.qkv = testing::RandomFloats(size_t(s.rows) * in.RowWidth(), -1, 1, seed);
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> pos(0, 200000);
  std::vector<int32_t> free_slots(in.num_blocks * kBlockSize);
  std::iota(free_slots.begin(), free_slots.end(), 0);
  std::shuffle(free_slots.begin(), free_slots.end(), gen);
  for (int r = 0; r < s.rows; ++r) {
    // Position 0 (identity rotation) and 131071 (Llama 3.1's last) on fixed rows, random else.
    in.positions.push_back(r == 0 ? 131071 : r == 1 ? 0 : pos(gen));
    in.slots.push_back(r % 5 == 4 ? -1 : free_slots[r]);
  }
  ModelConfig c;
  c.head_dim = s.head_dim;
  c.rope_theta = 500000.0f;
  c.rope_scaling.type = RopeType::kLlama3;
  c.rope_scaling.factor = 8.0f;
  auto inv = ts::RopeInvFreq(c);
  EXPECT_TRUE(inv.ok()) << inv.status();
  in.inv_freq = *inv;
  return in;
}

// Rotated q and k heads of every row: [rows, (hq + hkv) * D] each.
struct Ref {
  std::vector<double> exact;  // fp64 rotation
  std::vector<float> hf;      // transformers' bf16 rounding points
  std::vector<double> bound;  // allowed |got - hf|
};
Ref Reference(const Inputs& in) {
  using testing::RoundBf16;
  const int d = in.s.head_dim, half = d / 2, heads = in.s.hq + in.s.hkv;
  const size_t n = size_t(in.s.rows) * heads * d;
  Ref ref{std::vector<double>(n), std::vector<float>(n), std::vector<double>(n)};
  for (int r = 0; r < in.s.rows; ++r) {
    for (int h = 0; h < heads; ++h) {
      const float* x = in.qkv.data() + size_t(r) * in.RowWidth() + h * d;
      const size_t o = (size_t(r) * heads + h) * d;
      for (int i = 0; i < half; ++i) {
        const float angle = static_cast<float>(in.positions[r]) * in.inv_freq[i];  // fp32, as HF
        const double c = std::cos(double(angle)), sn = std::sin(double(angle));
        const float x1 = x[i], x2 = x[i + half];
        ref.exact[o + i] = x1 * c - x2 * sn;
        ref.exact[o + i + half] = x2 * c + x1 * sn;
        const float cb = RoundBf16(static_cast<float>(c)), sb = RoundBf16(static_cast<float>(sn));
        ref.hf[o + i] = RoundBf16(RoundBf16(x1 * cb) + RoundBf16(-x2 * sb));
        ref.hf[o + i + half] = RoundBf16(RoundBf16(x2 * cb) + RoundBf16(x1 * sb));
        const double terms = std::fabs(x1 * c) + std::fabs(x2 * sn);
        ref.bound[o + i] = terms / 256 + std::fabs(ref.hf[o + i]) / 512;
        ref.bound[o + i + half] = terms / 256 + std::fabs(ref.hf[o + i + half]) / 512;
      }
    }
  }
  return ref;
}

struct Device {
  GuardedBuffer<__nv_bfloat16> qkv, q_out, k_cache, v_cache;
  GuardedBuffer<int32_t> positions, slots, flag;
  GuardedBuffer<float> inv_freq;
  explicit Device(const Inputs& in)
      : qkv(in.qkv.size()),
        q_out(size_t(in.s.rows) * in.s.hq * in.s.head_dim),
        k_cache(size_t(in.num_blocks) * in.s.hkv * kBlockSize * in.s.head_dim),
        v_cache(k_cache.size()),
        positions(in.s.rows),
        slots(in.s.rows),
        flag(1),
        inv_freq(in.inv_freq.size()) {
    qkv.Upload(testing::ToBf16(in.qkv));
    positions.Upload(in.positions);
    slots.Upload(in.slots);
    flag.Upload({0});
    inv_freq.Upload(in.inv_freq);
  }
  RopeKvParams Params(const Inputs& in, bool use_q_out) {
    RopeKvParams p;
    p.qkv = qkv.get();
    p.q_out = use_q_out ? q_out.get() : nullptr;
    p.positions = positions.get();
    p.slot_mapping = slots.get();
    p.inv_freq = inv_freq.get();
    p.k_cache = k_cache.get();
    p.v_cache = v_cache.get();
    p.error_flag = flag.get();
    p.layout = KvLayout{in.num_blocks, in.s.hkv, kBlockSize, in.s.head_dim};
    p.rows = in.s.rows;
    p.num_q_heads = in.s.hq;
    return p;
  }
};

void CheckOutputs(const Inputs& in, Device& dev, bool use_q_out) {
  const int d = in.s.head_dim, hq = in.s.hq, hkv = in.s.hkv, heads = hq + hkv;
  const auto ref = Reference(in);
  const auto qkv = dev.qkv.Download();
  const auto q_out = dev.q_out.Download();
  const auto k_cache = dev.k_cache.Download();
  const auto v_cache = dev.v_cache.Download();
  const auto qkv_in = testing::ToBf16(in.qkv);

  std::vector<float> got;  // rotated q and k, laid out like `ref`
  got.reserve(ref.hf.size());
  std::vector<char> cache_written(k_cache.size(), 0);
  for (int r = 0; r < in.s.rows; ++r) {
    const size_t row = size_t(r) * in.RowWidth();
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < d; ++i) {
        const bool q = h < hq;
        const __nv_bfloat16 v =
            q && use_q_out ? q_out[(size_t(r) * hq + h) * d + i] : qkv[row + h * d + i];
        got.push_back(testing::FromBf16(v));
        if (q && use_q_out) {  // qkv's q part stays as it was
          ASSERT_EQ(Bits(qkv[row + h * d + i]), Bits(qkv_in[row + h * d + i])) << "row " << r;
        }
      }
    }
    for (int i = 0; i < hkv * d; ++i) {  // v part unchanged
      ASSERT_EQ(Bits(qkv[row + heads * d + i]), Bits(qkv_in[row + heads * d + i])) << "row " << r;
    }
    const int32_t slot = in.slots[r];
    if (slot < 0) continue;
    const KvLayout l{in.num_blocks, hkv, kBlockSize, d};
    for (int h = 0; h < hkv; ++h) {
      const int64_t off = KvOffset(l, slot / kBlockSize, h, slot % kBlockSize);
      for (int i = 0; i < d; ++i) {
        cache_written[off + i] = 1;
        ASSERT_EQ(Bits(k_cache[off + i]), Bits(qkv[row + (hq + h) * d + i])) << "k row " << r;
        ASSERT_EQ(Bits(v_cache[off + i]), Bits(qkv_in[row + (heads + h) * d + i])) << "v row " << r;
      }
    }
  }
  EXPECT_LE(testing::RelL2Error(got, ref.exact), 5e-3);
  EXPECT_GE(testing::CompareBf16(got, ref.hf).exact_fraction, 0.99);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_LE(std::fabs(got[i] - ref.hf[i]), ref.bound[i]) << "element " << i;
  }
  for (size_t i = 0; i < k_cache.size(); ++i) {
    if (cache_written[i]) continue;
    ASSERT_EQ(Bits(k_cache[i]), kPoison) << "stray k write at " << i;
    ASSERT_EQ(Bits(v_cache[i]), kPoison) << "stray v write at " << i;
  }
  EXPECT_EQ(dev.flag.Download()[0], 0);
  EXPECT_TRUE(dev.qkv.GuardsIntact());
  EXPECT_TRUE(dev.q_out.GuardsIntact());
  EXPECT_TRUE(dev.k_cache.GuardsIntact());
  EXPECT_TRUE(dev.v_cache.GuardsIntact());
}

void RunCase(const Shape& s, bool use_q_out, bool pdl = false) {
  SCOPED_TRACE(::testing::Message() << "rows=" << s.rows << " D=" << s.head_dim << " hq=" << s.hq
                                    << " hkv=" << s.hkv << " q_out=" << use_q_out);
  const Inputs in = MakeInputs(s, s.rows * 1000 + s.head_dim + s.hq);
  Device dev(in);
  RopeKvParams p = dev.Params(in, use_q_out);
  p.pdl = pdl;
  TS_ASSERT_OK(LaunchRopeKv(p, nullptr));
  TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
  CheckOutputs(in, dev, use_q_out);
}

TEST(RopeKvTest, MatchesReferenceOverShapeGrid) {
  for (int d : {16, 64, 128}) {
    for (auto [hq, hkv] : {std::pair{4, 2}, std::pair{32, 8}}) {
      for (int rows : {1, 3, 17, 64}) RunCase(Shape{rows, d, hq, hkv}, /*use_q_out=*/false);
    }
  }
}

TEST(RopeKvTest, ProgrammaticDependentLaunch) {
  RunCase(Shape{17, 128, 32, 8}, /*use_q_out=*/true, /*pdl=*/true);
}

TEST(RopeKvTest, QOutLeavesQkvQUntouched) {
  RunCase(Shape{17, 128, 32, 8}, /*use_q_out=*/true);
  RunCase(Shape{3, 64, 4, 4}, /*use_q_out=*/true);
}

TEST(RopeKvTest, OutOfRangeSlotsAreSkippedAndFlagged) {
  Inputs in = MakeInputs(Shape{4, 64, 4, 2}, 42);
  in.slots = {in.num_blocks * kBlockSize, -7, kNoKvWrite, kBadKvSlot};
  Device dev(in);
  TS_ASSERT_OK(LaunchRopeKv(dev.Params(in, false), nullptr));
  TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(dev.flag.Download()[0], 1);
  for (const auto& cache : {dev.k_cache.Download(), dev.v_cache.Download()}) {
    for (const __nv_bfloat16 h : cache) ASSERT_EQ(Bits(h), kPoison);
  }
  EXPECT_TRUE(dev.k_cache.GuardsIntact());
  EXPECT_TRUE(dev.v_cache.GuardsIntact());
}

// The engine pads each table row with kInvalidKvBlock and maps positions through KvSlotFor. A
// position on a padding entry or past the row (an off-by-one upstream) must raise the flag and
// write nothing, not land in block 0 (someone else's live block) or be skipped quietly. The last
// offset of a padding entry is the case an id of -1 would get wrong: -1 * 16 + 15 = -1, "no write".
TEST(RopeKvTest, PositionsPastTheBlockTableAreFlaggedAndWriteNothing) {
  constexpr int kMaxBlocks = 4;
  const int32_t table[kMaxBlocks] = {3, 1, kInvalidKvBlock, kInvalidKvBlock};
  for (const int32_t pos : {2 * kBlockSize + 5, 3 * kBlockSize + kBlockSize - 1,
                            kMaxBlocks * kBlockSize, kMaxBlocks * kBlockSize + 7}) {
    SCOPED_TRACE(::testing::Message() << "position " << pos);
    Inputs in = MakeInputs(Shape{1, 64, 4, 2}, 42);
    in.positions = {pos};
    in.slots = {KvSlotFor(table, kMaxBlocks, kBlockSize, pos)};
    ASSERT_EQ(in.slots[0], kBadKvSlot);
    Device dev(in);
    TS_ASSERT_OK(LaunchRopeKv(dev.Params(in, false), nullptr));
    TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(dev.flag.Download()[0], 1);
    for (const auto& cache : {dev.k_cache.Download(), dev.v_cache.Download()}) {
      for (const __nv_bfloat16 h : cache) ASSERT_EQ(Bits(h), kPoison);
    }
    EXPECT_TRUE(dev.k_cache.GuardsIntact());
    EXPECT_TRUE(dev.v_cache.GuardsIntact());
  }
  // The same table's real entries and a padding row (kNoKvWrite): written, nothing flagged.
  Inputs in = MakeInputs(Shape{3, 64, 4, 2}, 43);
  ASSERT_GE(in.num_blocks, 4);
  in.positions = {kBlockSize + 3, 5, 0};
  in.slots = {KvSlotFor(table, kMaxBlocks, kBlockSize, in.positions[0]),
              KvSlotFor(table, kMaxBlocks, kBlockSize, in.positions[1]), kNoKvWrite};
  EXPECT_EQ(in.slots[0], 1 * kBlockSize + 3);
  EXPECT_EQ(in.slots[1], 3 * kBlockSize + 5);
  Device dev(in);
  TS_ASSERT_OK(LaunchRopeKv(dev.Params(in, false), nullptr));
  TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
  CheckOutputs(in, dev, false);  // the written slots and nothing else, flag 0
}

TEST(RopeKvTest, CapturesInGraph) {
  const Inputs in = MakeInputs(Shape{17, 128, 32, 8}, 9);
  Device dev(in);
  const RopeKvParams p = dev.Params(in, false);
  cudaStream_t stream;
  TS_ASSERT_CUDA_OK(cudaStreamCreate(&stream));
  EXPECT_TRUE(testing::RunInGraph(stream, [&](cudaStream_t s) { return LaunchRopeKv(p, s); }));
  cudaStreamDestroy(stream);
  CheckOutputs(in, dev, false);
}

TEST(RopeKvTest, RejectsBadParams) {
  const Inputs in = MakeInputs(Shape{2, 64, 4, 2}, 1);
  Device dev(in);
  const RopeKvParams good = dev.Params(in, false);
  RopeKvParams p = good;
  p.layout.head_dim = 96;
  TS_EXPECT_INVALID(LaunchRopeKv(p, nullptr), "rope_kv.layout.head_dim");
  p = good;
  p.num_q_heads = 3;
  TS_EXPECT_INVALID(LaunchRopeKv(p, nullptr), "rope_kv.num_q_heads");
  p = good;
  p.inv_freq = nullptr;
  TS_EXPECT_INVALID(LaunchRopeKv(p, nullptr), "rope_kv.inv_freq");
  p = good;
  p.layout.block_size = 0;
  TS_EXPECT_INVALID(LaunchRopeKv(p, nullptr), "rope_kv.layout.block_size");
  p = good;
  p.qkv = dev.qkv.get() + 1;
  TS_EXPECT_INVALID(LaunchRopeKv(p, nullptr), "rope_kv.qkv");
  p = good;
  p.slot_mapping = nullptr;
  TS_EXPECT_INVALID(LaunchRopeKv(p, nullptr), "rope_kv.slot_mapping");
  p = good;
  p.rows = -1;
  TS_EXPECT_INVALID(LaunchRopeKv(p, nullptr), "rope_kv.rows");
}

}  // namespace
}  // namespace ts::kernels
