#include "models/llama_weights.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/common/safetensors_writer.h"

namespace ts {
namespace {

using ::testing::HasSubstr;
using testing::RandomTensor;
using testing::StTensor;
using testing::TempDir;
using testing::WriteSafetensors;

// Small but with every dimension distinct, so a transposed or swapped shape cannot pass:
// GQA (4 heads, 2 kv heads) and an explicit head_dim with heads*head_dim (24) != hidden (16).
ModelConfig TinyConfig(bool tied) {
  ModelConfig c;
  c.hidden_size = 16;
  c.intermediate_size = 40;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 6;
  c.vocab_size = 11;
  c.max_position_embeddings = 32;
  c.tie_word_embeddings = tied;
  return c;
}

// Every tensor transformers' LlamaForCausalLM saves for `c`, random BF16.
std::vector<StTensor> LlamaSpecs(const ModelConfig& c, bool with_lm_head) {
  const int64_t h = c.hidden_size, in = c.intermediate_size, v = c.vocab_size;
  const int64_t q = int64_t{c.num_heads} * c.head_dim, kv = int64_t{c.num_kv_heads} * c.head_dim;
  uint32_t seed = 100;
  std::vector<StTensor> t;
  auto add = [&](std::string name, std::vector<int64_t> shape) {
    t.push_back(RandomTensor(std::move(name), "BF16", std::move(shape), seed++));
  };
  add("model.embed_tokens.weight", {v, h});
  add("model.norm.weight", {h});
  if (with_lm_head) add("lm_head.weight", {v, h});
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    add(p + "input_layernorm.weight", {h});
    add(p + "self_attn.q_proj.weight", {q, h});
    add(p + "self_attn.k_proj.weight", {kv, h});
    add(p + "self_attn.v_proj.weight", {kv, h});
    add(p + "self_attn.o_proj.weight", {h, q});
    add(p + "post_attention_layernorm.weight", {h});
    add(p + "mlp.gate_proj.weight", {in, h});
    add(p + "mlp.up_proj.weight", {in, h});
    add(p + "mlp.down_proj.weight", {h, in});
  }
  return t;
}

class LlamaWeightsTest : public ::testing::Test {
 protected:
  // Writes `tensors` as model.safetensors, opens the dir and binds.
  absl::StatusOr<LlamaTensors> WriteAndBind(const std::vector<StTensor>& tensors,
                                            const ModelConfig& c) {
    EXPECT_TRUE(WriteSafetensors(dir_ / "model.safetensors", tensors));
    auto ckpt = Checkpoint::Open(dir_.path());
    if (!ckpt.ok()) return ckpt.status();
    ckpt_ = std::move(*ckpt);
    return BindLlamaTensors(*ckpt_, c);
  }
  void ExpectRefused(const std::vector<StTensor>& tensors, const ModelConfig& c,
                     const std::vector<std::string>& needles) {
    absl::StatusOr<LlamaTensors> w = WriteAndBind(tensors, c);
    ASSERT_FALSE(w.ok()) << "accepted; expected an error naming " << needles[0];
    for (const std::string& n : needles) EXPECT_THAT(w.status().message(), HasSubstr(n));
  }
  TempDir dir_{"ts_llama"};
  std::unique_ptr<Checkpoint> ckpt_;
};

void ExpectBound(const TensorView* t, const std::string& name, std::vector<int64_t> shape) {
  ASSERT_NE(t, nullptr) << name;
  EXPECT_EQ(t->name, name);
  EXPECT_EQ(t->shape, shape) << name;
}

TEST_F(LlamaWeightsTest, BindsEveryTensorUntied) {
  const ModelConfig c = TinyConfig(/*tied=*/false);
  std::vector<StTensor> tensors = LlamaSpecs(c, /*with_lm_head=*/true);
  // Old exports carry RoPE buffers; they are derived from the config and must be skipped.
  tensors.push_back(RandomTensor("model.layers.0.self_attn.rotary_emb.inv_freq", "F32", {3}, 9));
  absl::StatusOr<LlamaTensors> w = WriteAndBind(tensors, c);
  ASSERT_TRUE(w.ok()) << w.status();
  ExpectBound(w->embed, "model.embed_tokens.weight", {11, 16});
  ExpectBound(w->final_norm, "model.norm.weight", {16});
  ExpectBound(w->lm_head, "lm_head.weight", {11, 16});
  ASSERT_EQ(w->layers.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    const LlamaLayerTensors& l = w->layers[i];
    ExpectBound(l.attn_norm, p + "input_layernorm.weight", {16});
    ExpectBound(l.q_proj, p + "self_attn.q_proj.weight", {24, 16});
    ExpectBound(l.k_proj, p + "self_attn.k_proj.weight", {12, 16});
    ExpectBound(l.v_proj, p + "self_attn.v_proj.weight", {12, 16});
    ExpectBound(l.o_proj, p + "self_attn.o_proj.weight", {16, 24});
    ExpectBound(l.mlp_norm, p + "post_attention_layernorm.weight", {16});
    ExpectBound(l.gate_proj, p + "mlp.gate_proj.weight", {40, 16});
    ExpectBound(l.up_proj, p + "mlp.up_proj.weight", {40, 16});
    ExpectBound(l.down_proj, p + "mlp.down_proj.weight", {16, 40});
  }
  // The bound views carry the data that was written.
  const StTensor& down1 = tensors[tensors.size() - 2];
  ASSERT_EQ(down1.name, "model.layers.1.mlp.down_proj.weight");
  std::vector<float> got(down1.values.size());
  ConvertToF32(*w->layers[1].down_proj, got.data());
  EXPECT_EQ(got, down1.values);
}

TEST_F(LlamaWeightsTest, TiedEmbeddingsShareTheTensor) {
  const ModelConfig c = TinyConfig(/*tied=*/true);
  absl::StatusOr<LlamaTensors> w = WriteAndBind(LlamaSpecs(c, /*with_lm_head=*/false), c);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->lm_head, w->embed);
}

TEST_F(LlamaWeightsTest, UntiedWithoutLmHeadIsRefused) {
  const ModelConfig c = TinyConfig(/*tied=*/false);
  ExpectRefused(LlamaSpecs(c, /*with_lm_head=*/false), c,
                {"lm_head.weight", "tie_word_embeddings"});
}

TEST_F(LlamaWeightsTest, MissingTensorIsNamed) {
  const ModelConfig c = TinyConfig(/*tied=*/false);
  for (const std::string missing :
       {"model.layers.1.mlp.down_proj.weight", "model.norm.weight", "model.embed_tokens.weight",
        "model.layers.0.self_attn.k_proj.weight"}) {
    std::vector<StTensor> t = LlamaSpecs(c, true);
    std::erase_if(t, [&](const StTensor& s) { return s.name == missing; });
    ExpectRefused(t, c, {missing});
  }
}

TEST_F(LlamaWeightsTest, WrongShapeNamesTensorAndBothShapes) {
  const ModelConfig c = TinyConfig(/*tied=*/false);
  std::vector<StTensor> t = LlamaSpecs(c, true);
  for (StTensor& s : t) {
    // Transposed: same element count, so only the shape check can catch it.
    if (s.name == "model.layers.1.self_attn.o_proj.weight") s.shape = {24, 16};
  }
  ExpectRefused(t, c,
                {"model.layers.1.self_attn.o_proj.weight", "expected shape [16, 24]",
                 "got [24, 16]", "model.safetensors"});
}

TEST_F(LlamaWeightsTest, WrongVocabOrKvShapeIsRefused) {
  ModelConfig c = TinyConfig(/*tied=*/true);
  c.vocab_size = 12;  // checkpoint holds 11 rows
  ExpectRefused(LlamaSpecs(TinyConfig(true), false), c,
                {"model.embed_tokens.weight", "[12, 16]", "[11, 16]"});
  c = TinyConfig(/*tied=*/true);
  c.num_kv_heads = 4;  // MHA config against a GQA checkpoint
  ExpectRefused(LlamaSpecs(TinyConfig(true), false), c,
                {"model.layers.0.self_attn.k_proj.weight", "[24, 16]", "[12, 16]"});
}

TEST_F(LlamaWeightsTest, UnexpectedTensorsAreRefused) {
  const ModelConfig c = TinyConfig(/*tied=*/false);
  for (const std::string extra :
       {"model.layers.0.self_attn.q_proj.bias", "model.layers.1.mlp.down_proj.bias", "lm_head.bias",
        "model.layers.2.mlp.up_proj.weight", "model.layers.7.input_layernorm.weight",
        "model.layers.01.mlp.up_proj.weight", "model.layers.0.mlp.extra.weight",
        "model.vision_tower.weight"}) {
    std::vector<StTensor> t = LlamaSpecs(c, true);
    t.push_back(RandomTensor(extra, "BF16", {16}, 7));
    ExpectRefused(t, c, {"unexpected tensor", extra, "model.safetensors"});
  }
}

TEST_F(LlamaWeightsTest, ShardedCheckpointBinds) {
  const ModelConfig c = TinyConfig(/*tied=*/false);
  std::vector<StTensor> all = LlamaSpecs(c, true);
  std::vector<StTensor> s1(all.begin(), all.begin() + 8), s2(all.begin() + 8, all.end());
  std::map<std::string, std::string> weight_map;
  for (const StTensor& t : s1) weight_map[t.name] = "model-00001-of-00002.safetensors";
  for (const StTensor& t : s2) weight_map[t.name] = "model-00002-of-00002.safetensors";
  ASSERT_TRUE(WriteSafetensors(dir_ / "model-00001-of-00002.safetensors", s1));
  ASSERT_TRUE(WriteSafetensors(dir_ / "model-00002-of-00002.safetensors", s2));
  ASSERT_TRUE(testing::WriteShardIndex(dir_ / "model.safetensors.index.json", weight_map));
  auto ckpt = Checkpoint::Open(dir_.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  absl::StatusOr<LlamaTensors> w = BindLlamaTensors(**ckpt, c);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->embed->file, "model-00001-of-00002.safetensors");
  EXPECT_EQ(w->layers[1].down_proj->file, "model-00002-of-00002.safetensors");
}

// Sets element `i` of a BF16 tensor to the raw bits `bits` (0x7fc0 NaN, 0x7f80 +Inf, 0xff80 -Inf).
void PoisonBf16(StTensor* t, int64_t i, uint16_t bits) {
  t->bytes[2 * i] = static_cast<uint8_t>(bits & 0xff);
  t->bytes[2 * i + 1] = static_cast<uint8_t>(bits >> 8);
}

TEST_F(LlamaWeightsTest, NonFiniteWeightIsRefusedNamingTheTensor) {
  const ModelConfig c = TinyConfig(/*tied=*/false);
  struct Case {
    std::string tensor;
    int64_t element;
    uint16_t bits;
    std::string kind;
  };
  for (const Case& k :
       {Case{"model.layers.1.mlp.up_proj.weight", 17, 0x7fc0, "NaN"},
        Case{"lm_head.weight", 0, 0x7f80, "Inf"}, Case{"model.norm.weight", 15, 0xff80, "Inf"},
        Case{"model.layers.0.self_attn.q_proj.weight", 383, 0xffc1, "NaN"}}) {
    SCOPED_TRACE(k.tensor);
    std::vector<StTensor> t = LlamaSpecs(c, true);
    auto it =
        std::find_if(t.begin(), t.end(), [&](const StTensor& s) { return s.name == k.tensor; });
    ASSERT_NE(it, t.end());
    PoisonBf16(&*it, k.element, k.bits);
    ExpectRefused(t, c, {k.tensor, k.kind, absl::StrCat("element ", k.element)});
  }
  // The same tensors without the poison bind (the random values are all finite and non-zero).
  EXPECT_TRUE(WriteAndBind(LlamaSpecs(c, true), c).ok());
}

// Directly over big tensors of every dtype, so that the element lies past the first 1M-element
// chunk and several threads share the scan.
TEST(CheckTensorsFiniteTest, FindsTheElementInEveryDtypeAcrossChunks) {
  constexpr int64_t kN = 3 * (int64_t{1} << 20) + 5;
  struct Case {
    DType dtype;
    size_t size;
    uint32_t finite, nan, inf;
  };
  for (const Case& k :
       {Case{DType::kBF16, 2, 0x3f80, 0x7fc1, 0xff80}, Case{DType::kF16, 2, 0x3c00, 0x7e01, 0xfc00},
        Case{DType::kF32, 4, 0x3f800000, 0x7fc00001, 0x7f800000}}) {
    SCOPED_TRACE(DTypeName(k.dtype));
    std::vector<std::byte> buf(kN * k.size);
    auto set = [&](int64_t i, uint32_t v) { std::memcpy(buf.data() + i * k.size, &v, k.size); };
    for (int64_t i = 0; i < kN; ++i) set(i, k.finite + static_cast<uint32_t>(i % 7));
    TensorView clean{.name = "clean",
                     .dtype = k.dtype,
                     .shape = {kN},
                     .data = buf.data(),
                     .nbytes = buf.size(),
                     .file = "a.safetensors"};
    std::vector<std::byte> bad_buf = buf;
    TensorView bad = clean;
    bad.name = "bad";
    bad.data = bad_buf.data();
    const int64_t at = 2 * (int64_t{1} << 20) + 12345;
    for (const auto& [bits, kind] : {std::pair{k.nan, "NaN"}, std::pair{k.inf, "Inf"}}) {
      std::memcpy(bad_buf.data() + at * k.size, &bits, k.size);
      // A second bad value later: the first one is the one reported.
      std::memcpy(bad_buf.data() + (kN - 1) * k.size, &bits, k.size);
      for (int threads : {1, 4}) {
        EXPECT_TRUE(CheckTensorsFinite({&clean}, threads).ok());
        const absl::Status s = CheckTensorsFinite({&clean, &bad}, threads);
        ASSERT_FALSE(s.ok()) << kind;
        EXPECT_THAT(s.message(), HasSubstr("'bad'"));
        EXPECT_THAT(s.message(), HasSubstr(kind));
        EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("element ", at)));
      }
    }
  }
}

}  // namespace
}  // namespace ts
