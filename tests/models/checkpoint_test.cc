#include "models/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "tests/common/safetensors_writer.h"

namespace ts {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::RandomTensor;
using testing::StTensor;
using testing::StWriteOptions;
using testing::TempDir;
using testing::WriteSafetensors;
using testing::WriteShardIndex;

void ExpectValues(const TensorView& t, const std::vector<float>& expected) {
  ASSERT_EQ(t.numel(), static_cast<int64_t>(expected.size()));
  std::vector<float> got(expected.size(), -12345.0f);
  ConvertToF32(t, got.data());
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_EQ(got[i], expected[i]) << t.name << "[" << i << "]";
  }
}

// The checkpoint is refused, and the message carries every one of `needles`.
void ExpectRefused(const absl::StatusOr<std::unique_ptr<Checkpoint>>& ckpt,
                   const std::vector<std::string>& needles) {
  ASSERT_FALSE(ckpt.ok()) << "accepted; expected an error naming " << needles[0];
  for (const std::string& n : needles) EXPECT_THAT(ckpt.status().message(), HasSubstr(n));
}

TEST(CheckpointTest, RoundTripsAllDtypes) {
  TempDir dir("ts_ckpt");
  const std::vector<StTensor> tensors = {
      RandomTensor("b.f16", "F16", {7, 3}, 2),      RandomTensor("a.f32", "F32", {3, 5}, 1),
      RandomTensor("c.bf16", "BF16", {2, 3, 4}, 3), RandomTensor("d.scalar", "F32", {}, 4),
      RandomTensor("e.empty", "BF16", {0, 4}, 5),
  };
  const auto path = dir / "model.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, tensors, {.metadata = {{"format", "pt"}}}));

  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::OpenFile(path);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_THAT((*ckpt)->Names(), ElementsAre("a.f32", "b.f16", "c.bf16", "d.scalar", "e.empty"));
  EXPECT_EQ((*ckpt)->Find("missing"), nullptr);
  size_t total = 0;
  for (const StTensor& s : tensors) {
    const TensorView* t = (*ckpt)->Find(s.name);
    ASSERT_NE(t, nullptr) << s.name;
    EXPECT_EQ(DTypeName(t->dtype), s.dtype);
    EXPECT_EQ(t->shape, s.shape);
    EXPECT_EQ(t->nbytes, s.bytes.size());
    EXPECT_EQ(t->file, "model.safetensors");
    ExpectValues(*t, s.values);
    total += s.bytes.size();
  }
  EXPECT_EQ((*ckpt)->total_bytes(), total);

  // Open(dir) finds the single file too.
  absl::StatusOr<std::unique_ptr<Checkpoint>> by_dir = Checkpoint::Open(dir.path());
  ASSERT_TRUE(by_dir.ok()) << by_dir.status();
  ExpectValues(*(*by_dir)->Find("c.bf16"), tensors[2].values);
}

TEST(CheckpointTest, UnalignedDataIsReadCorrectly) {
  TempDir dir("ts_ckpt");
  const std::vector<StTensor> tensors = {RandomTensor("odd", "BF16", {3}, 7),
                                         RandomTensor("f", "F32", {5}, 8)};
  ASSERT_TRUE(WriteSafetensors(dir / "x.safetensors", tensors, {.header_align = 1}));
  auto ckpt = Checkpoint::OpenFile(dir / "x.safetensors");
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ExpectValues(*(*ckpt)->Find("odd"), tensors[0].values);
  ExpectValues(*(*ckpt)->Find("f"), tensors[1].values);
}

TEST(CheckpointTest, ShardedIndex) {
  TempDir dir("ts_ckpt");
  const std::vector<StTensor> shard1 = {RandomTensor("w.a", "BF16", {4, 4}, 11),
                                        RandomTensor("w.b", "F32", {6}, 12)};
  const std::vector<StTensor> shard2 = {RandomTensor("w.c", "F16", {2, 5}, 13)};
  ASSERT_TRUE(WriteSafetensors(dir / "model-00001-of-00002.safetensors", shard1));
  ASSERT_TRUE(WriteSafetensors(dir / "model-00002-of-00002.safetensors", shard2));
  ASSERT_TRUE(WriteShardIndex(dir / "model.safetensors.index.json",
                              {{"w.a", "model-00001-of-00002.safetensors"},
                               {"w.b", "model-00001-of-00002.safetensors"},
                               {"w.c", "model-00002-of-00002.safetensors"}}));
  // A stale single file next to the index must be ignored: the index wins.
  ASSERT_TRUE(WriteSafetensors(dir / "model.safetensors", {RandomTensor("stale", "F32", {1}, 1)}));

  auto ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_THAT((*ckpt)->Names(), ElementsAre("w.a", "w.b", "w.c"));
  EXPECT_EQ((*ckpt)->Find("w.a")->file, "model-00001-of-00002.safetensors");
  EXPECT_EQ((*ckpt)->Find("w.c")->file, "model-00002-of-00002.safetensors");
  ExpectValues(*(*ckpt)->Find("w.a"), shard1[0].values);
  ExpectValues(*(*ckpt)->Find("w.b"), shard1[1].values);
  ExpectValues(*(*ckpt)->Find("w.c"), shard2[0].values);
}

TEST(CheckpointTest, EmptyDirIsNotFound) {
  TempDir dir("ts_ckpt");
  auto ckpt = Checkpoint::Open(dir.path());
  ExpectRefused(ckpt, {dir.path().string()});
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kNotFound);
  ExpectRefused(Checkpoint::OpenFile(dir / "nope.safetensors"), {"nope.safetensors"});
}

// One malformed single-file case: the tensors, the writer's corruption knobs, and what the
// message must name (the file name is always checked).
struct Malformed {
  std::string label;
  std::vector<StTensor> tensors;
  StWriteOptions options;
  std::vector<std::string> needles;
};

void PrintTo(const Malformed& m, std::ostream* os) {
  *os << m.label;
}

class MalformedFileTest : public ::testing::TestWithParam<Malformed> {};

TEST_P(MalformedFileTest, RefusedNamingFileAndTensor) {
  const Malformed& m = GetParam();
  TempDir dir("ts_ckpt");
  const auto path = dir / "bad.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, m.tensors, m.options));
  std::vector<std::string> needles = m.needles;
  needles.push_back(path.string());
  ExpectRefused(Checkpoint::OpenFile(path), needles);
}

StTensor WithOffsets(StTensor t, int64_t begin, int64_t end) {
  t.data_offsets = std::array<int64_t, 2>{begin, end};
  return t;
}

StTensor WithShape(StTensor t, std::vector<int64_t> shape) {
  t.shape = std::move(shape);
  return t;
}

StTensor WithDtype(StTensor t, std::string dtype) {
  t.dtype = std::move(dtype);
  return t;
}

std::vector<Malformed> MalformedCases() {
  const StTensor a = RandomTensor("layer.a", "F32", {4, 2}, 21);  // 32 bytes
  const StTensor b = RandomTensor("layer.b", "BF16", {3}, 22);    // 6 bytes
  // A header's exact size, so the truncation cases cut where intended.
  const size_t header_padded = [&] {
    size_t n = testing::SafetensorsHeader({a, b}).size();
    while ((8 + n) % 8 != 0) ++n;
    return 8 + n;
  }();
  return {
      {"shorter_than_8_bytes", {a}, {.truncate_to = 5}, {"shorter than the 8-byte"}},
      {"header_only_partly_present", {a}, {.truncate_to = 20}, {"header length"}},
      {"header_length_past_eof", {a}, {.header_length = 4096}, {"header length 4096"}},
      {"header_length_absurd", {a}, {.header_length = 1ull << 62}, {"absurd"}},
      {"data_truncated", {a, b}, {.truncate_to = header_padded + 35}, {"layer.b", "data section"}},
      {"bad_json", {a}, {.raw_header = R"({"layer.a": {"dtype": "F32", )"}, {"invalid JSON"}},
      {"header_not_object", {a}, {.raw_header = "[1, 2, 3]"}, {"object"}},
      {"entry_not_object", {a}, {.raw_header = R"({"layer.a": 5})"}, {"layer.a"}},
      {"missing_dtype",
       {a},
       {.raw_header = R"({"layer.a": {"shape": [8], "data_offsets": [0, 32]}})"},
       {"layer.a", "dtype"}},
      {"shape_not_array",
       {a},
       {.raw_header = R"({"layer.a": {"dtype": "F32", "shape": 8, "data_offsets": [0, 32]}})"},
       {"layer.a", "shape"}},
      {"negative_dim",
       {a},
       {.raw_header =
            R"({"layer.a": {"dtype": "F32", "shape": [-4, -2], "data_offsets": [0, 32]}})"},
       {"layer.a", "non-negative"}},
      {"fractional_dim",
       {a},
       {.raw_header = R"({"layer.a": {"dtype": "F32", "shape": [4.5], "data_offsets": [0, 32]}})"},
       {"layer.a", "shape"}},
      {"offsets_wrong_arity",
       {a},
       {.raw_header = R"({"layer.a": {"dtype": "F32", "shape": [8], "data_offsets": [0]}})"},
       {"layer.a", "data_offsets"}},
      {"offsets_negative",
       {a},
       {.raw_header = R"({"layer.a": {"dtype": "F32", "shape": [8], "data_offsets": [-32, 0]}})"},
       {"layer.a", "data_offsets"}},
      {"metadata_not_object",
       {a},
       {.raw_header = R"({"__metadata__": 3, "layer.a": {"dtype": "F32", "shape": [8],
           "data_offsets": [0, 32]}})"},
       {"__metadata__"}},
      {"offsets_outside_data", {WithOffsets(a, 8, 40)}, {}, {"layer.a", "run past the data"}},
      {"offsets_huge", {WithOffsets(a, 0, int64_t{1} << 40)}, {}, {"layer.a", "run past"}},
      {"begin_after_end", {WithOffsets(a, 32, 0)}, {}, {"layer.a", "begin 32 > end 0"}},
      {"overlapping", {a, WithOffsets(b, 28, 34)}, {}, {"layer.b", "overlaps", "layer.a"}},
      {"wrong_byte_length", {WithShape(a, {4, 3})}, {}, {"layer.a", "[4,3]", "needs 48"}},
      {"shape_overflow",
       {WithShape(a, {int64_t{1} << 40, int64_t{1} << 40})},
       {},
       {"layer.a", "overflows"}},
      {"unknown_dtype_i64", {a, WithDtype(b, "I64")}, {}, {"layer.b", "I64"}},
      {"unknown_dtype_f8", {WithDtype(b, "F8_E4M3")}, {}, {"layer.b", "F8_E4M3"}},
  };
}

INSTANTIATE_TEST_SUITE_P(All, MalformedFileTest, ::testing::ValuesIn(MalformedCases()),
                         [](const ::testing::TestParamInfo<Malformed>& info) {
                           return info.param.label;
                         });

class ShardedRefusalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(WriteSafetensors(dir_ / "s1.safetensors", {RandomTensor("t.a", "F32", {2}, 31),
                                                           RandomTensor("t.b", "F32", {3}, 32)}));
    ASSERT_TRUE(WriteSafetensors(dir_ / "s2.safetensors", {RandomTensor("t.c", "BF16", {4}, 33)}));
  }
  absl::StatusOr<std::unique_ptr<Checkpoint>> OpenWithIndex(
      const std::map<std::string, std::string>& weight_map) {
    EXPECT_TRUE(WriteShardIndex(index(), weight_map));
    return Checkpoint::Open(dir_.path());
  }
  std::string index() const { return (dir_ / "model.safetensors.index.json").string(); }
  TempDir dir_{"ts_shard"};
};

TEST_F(ShardedRefusalTest, MissingShard) {
  auto ckpt = OpenWithIndex(
      {{"t.a", "s1.safetensors"}, {"t.b", "s1.safetensors"}, {"t.x", "s3.safetensors"}});
  ExpectRefused(ckpt, {index(), "s3.safetensors", "t.x"});
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ShardedRefusalTest, TensorMissingFromItsShard) {
  ExpectRefused(OpenWithIndex({{"t.a", "s1.safetensors"}, {"t.c", "s1.safetensors"}}),
                {index(), "t.c", "s1.safetensors"});
}

TEST_F(ShardedRefusalTest, DuplicateTensorAcrossShards) {
  ASSERT_TRUE(WriteSafetensors(dir_ / "s2.safetensors", {RandomTensor("t.c", "BF16", {4}, 33),
                                                         RandomTensor("t.a", "F32", {2}, 34)}));
  ExpectRefused(OpenWithIndex({{"t.a", "s1.safetensors"}, {"t.c", "s2.safetensors"}}),
                {"t.a", "s1.safetensors", "s2.safetensors"});
}

TEST_F(ShardedRefusalTest, CorruptShardNamesTheShard) {
  ASSERT_TRUE(WriteSafetensors(dir_ / "s2.safetensors", {RandomTensor("t.c", "BF16", {4}, 33)},
                               {.truncate_to = 12}));
  ExpectRefused(OpenWithIndex({{"t.a", "s1.safetensors"}, {"t.c", "s2.safetensors"}}),
                {"s2.safetensors", "header length"});
}

TEST_F(ShardedRefusalTest, MalformedIndex) {
  ASSERT_TRUE(testing::WriteBytes(index(), R"({"weight_map": {"t.a": )"));
  ExpectRefused(Checkpoint::Open(dir_.path()), {index(), "invalid JSON"});
  ASSERT_TRUE(testing::WriteBytes(index(), R"({"metadata": {}})"));
  ExpectRefused(Checkpoint::Open(dir_.path()), {index(), "weight_map"});
  ASSERT_TRUE(testing::WriteBytes(index(), R"({"weight_map": {}})"));
  ExpectRefused(Checkpoint::Open(dir_.path()), {index(), "no tensors"});
  ExpectRefused(OpenWithIndex({{"t.a", "../s1.safetensors"}}), {index(), "t.a", "plain file"});
  ASSERT_TRUE(testing::WriteBytes(index(), R"({"weight_map": {"t.a": 7}})"));
  ExpectRefused(Checkpoint::Open(dir_.path()), {index(), "t.a"});
}

TEST(ConversionTest, Bf16KnownBits) {
  EXPECT_EQ(Bf16ToF32(0x3f80), 1.0f);
  EXPECT_EQ(Bf16ToF32(0xc000), -2.0f);
  EXPECT_EQ(Bf16ToF32(0x4049), 3.140625f);
  EXPECT_EQ(Bf16ToF32(0x0001), std::ldexp(1.0f, -133));  // smallest subnormal
  EXPECT_EQ(Bf16ToF32(0x7f80), INFINITY);
  EXPECT_EQ(Bf16ToF32(0xff80), -INFINITY);
  EXPECT_TRUE(std::isnan(Bf16ToF32(0x7fc0)));
  EXPECT_TRUE(std::signbit(Bf16ToF32(0x8000)));
}

TEST(ConversionTest, F16KnownBits) {
  EXPECT_EQ(F16ToF32(0x3c00), 1.0f);
  EXPECT_EQ(F16ToF32(0xc000), -2.0f);
  EXPECT_EQ(F16ToF32(0x3555), 0.333251953125f);
  EXPECT_EQ(F16ToF32(0x7bff), 65504.0f);
  EXPECT_EQ(F16ToF32(0x0400), std::ldexp(1.0f, -14));     // smallest normal
  EXPECT_EQ(F16ToF32(0x0001), std::ldexp(1.0f, -24));     // smallest subnormal
  EXPECT_EQ(F16ToF32(0x03ff), std::ldexp(1023.0f, -24));  // largest subnormal
  EXPECT_EQ(F16ToF32(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::signbit(F16ToF32(0x8000)));
  EXPECT_EQ(F16ToF32(0x8000), 0.0f);
  EXPECT_EQ(F16ToF32(0x7c00), INFINITY);
  EXPECT_EQ(F16ToF32(0xfc00), -INFINITY);
  EXPECT_TRUE(std::isnan(F16ToF32(0x7e00)));
  EXPECT_TRUE(std::isnan(F16ToF32(0x7c01)));  // signalling NaN must not become inf
}

#ifdef __FLT16_MAX__
// Every one of the 65536 patterns against the compiler's own half-precision conversion.
TEST(ConversionTest, F16MatchesCompilerFloat16Exhaustively) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const auto h = std::bit_cast<_Float16>(static_cast<uint16_t>(b));
    const float want = static_cast<float>(h);
    const float got = F16ToF32(static_cast<uint16_t>(b));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << b;
    } else {
      ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want)) << std::hex << b;
    }
  }
}
#endif

TEST(ConversionTest, F32ToBf16RoundsToNearestEven) {
  auto from_bits = [](uint32_t u) { return std::bit_cast<float>(u); };
  EXPECT_EQ(F32ToBf16(1.0f), 0x3f80);
  EXPECT_EQ(F32ToBf16(-2.0f), 0xc000);
  EXPECT_EQ(F32ToBf16(from_bits(0x40490fdb)), 0x4049);  // pi rounds down
  EXPECT_EQ(F32ToBf16(from_bits(0x3f808000)), 0x3f80);  // tie, even neighbour below
  EXPECT_EQ(F32ToBf16(from_bits(0x3f818000)), 0x3f82);  // tie, even neighbour above
  EXPECT_EQ(F32ToBf16(from_bits(0x3f808001)), 0x3f81);  // just above the tie
  EXPECT_EQ(F32ToBf16(from_bits(0x3f807fff)), 0x3f80);  // just below the tie
  EXPECT_EQ(F32ToBf16(from_bits(0x7f7fffff)), 0x7f80);  // FLT_MAX rounds to inf
  EXPECT_EQ(F32ToBf16(INFINITY), 0x7f80);
  EXPECT_EQ(F32ToBf16(-INFINITY), 0xff80);
  EXPECT_EQ(F32ToBf16(-0.0f), 0x8000);
  EXPECT_EQ(F32ToBf16(from_bits(0x00010000)), 0x0001);  // subnormal kept
}

TEST(ConversionTest, F32ToBf16PreservesNaN) {
  // Payload only in the low bits: plain truncation would turn this NaN into inf.
  const uint16_t low = F32ToBf16(std::bit_cast<float>(0x7f800001u));
  EXPECT_TRUE(std::isnan(Bf16ToF32(low)));
  EXPECT_EQ(low & 0x8000, 0);
  const uint16_t neg = F32ToBf16(std::bit_cast<float>(0xffc00000u));
  EXPECT_TRUE(std::isnan(Bf16ToF32(neg)));
  EXPECT_EQ(neg, 0xffc0);
}

TEST(ConversionTest, Bf16RoundTripsEveryPattern) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = Bf16ToF32(static_cast<uint16_t>(b));
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(f)))) << std::hex << b;
    } else {
      ASSERT_EQ(F32ToBf16(f), b) << std::hex << b;
    }
  }
}

}  // namespace
}  // namespace ts
