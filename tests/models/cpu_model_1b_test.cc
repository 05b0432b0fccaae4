// The CPU reference must load and decode a real-sized checkpoint, not only the tiny fixtures: a
// random bf16 checkpoint in the Llama-3.2-1B shape (1.24B parameters, 2.5 GB, llama3 rope, tied
// embeddings) is streamed to a temp dir, loaded (upcast to 4.9 GB of fp32) and run. Checks at that
// scale: every logit is written and finite, logits are not degenerate, the same prompt gives
// bit-identical logits twice, and incremental decoding through the paged KV cache reproduces the
// teacher-forced logits of the same positions. Takes ~40 s and ~8 GB of memory.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "models/cpu_model.h"
#include "nlohmann/json.hpp"
#include "tests/common/safetensors_writer.h"

namespace ts {
namespace {

constexpr int kHidden = 2048, kInter = 8192, kLayers = 16, kHeads = 32, kKvHeads = 8;
constexpr int kHeadDim = 64, kVocab = 128256;

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
  bool norm;  // RMSNorm weights live near 1; linear weights are small
};

std::vector<Spec> Tensors() {
  std::vector<Spec> t = {{"model.embed_tokens.weight", {kVocab, kHidden}, false},
                         {"model.norm.weight", {kHidden}, true}};
  for (int l = 0; l < kLayers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.push_back({p + "input_layernorm.weight", {kHidden}, true});
    t.push_back({p + "self_attn.q_proj.weight", {kHeads * kHeadDim, kHidden}, false});
    t.push_back({p + "self_attn.k_proj.weight", {kKvHeads * kHeadDim, kHidden}, false});
    t.push_back({p + "self_attn.v_proj.weight", {kKvHeads * kHeadDim, kHidden}, false});
    t.push_back({p + "self_attn.o_proj.weight", {kHidden, kHeads * kHeadDim}, false});
    t.push_back({p + "post_attention_layernorm.weight", {kHidden}, true});
    t.push_back({p + "mlp.gate_proj.weight", {kInter, kHidden}, false});
    t.push_back({p + "mlp.up_proj.weight", {kInter, kHidden}, false});
    t.push_back({p + "mlp.down_proj.weight", {kHidden, kInter}, false});
  }
  return t;
}

// Streams the checkpoint tensor by tensor so the writer never holds more than one of them.
void WriteCheckpoint(const std::filesystem::path& dir) {
  const nlohmann::json config = {{"architectures", {"LlamaForCausalLM"}},
                                 {"model_type", "llama"},
                                 {"hidden_size", kHidden},
                                 {"intermediate_size", kInter},
                                 {"num_hidden_layers", kLayers},
                                 {"num_attention_heads", kHeads},
                                 {"num_key_value_heads", kKvHeads},
                                 {"head_dim", kHeadDim},
                                 {"vocab_size", kVocab},
                                 {"max_position_embeddings", 131072},
                                 {"rms_norm_eps", 1e-5},
                                 {"rope_theta", 500000.0},
                                 {"tie_word_embeddings", true},
                                 {"hidden_act", "silu"},
                                 {"rope_scaling",
                                  {{"rope_type", "llama3"},
                                   {"factor", 32.0},
                                   {"low_freq_factor", 1.0},
                                   {"high_freq_factor", 4.0},
                                   {"original_max_position_embeddings", 8192}}},
                                 {"torch_dtype", "bfloat16"},
                                 {"bos_token_id", 128000},
                                 {"eos_token_id", 128001}};
  std::ofstream(dir / "config.json") << config.dump(2);

  const std::vector<Spec> specs = Tensors();
  nlohmann::json header = nlohmann::json::object();
  int64_t offset = 0;
  for (const Spec& s : specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    header[s.name] = {
        {"dtype", "BF16"}, {"shape", s.shape}, {"data_offsets", {offset, offset + 2 * n}}};
    offset += 2 * n;
  }
  std::string h = header.dump();
  while ((8 + h.size()) % 8 != 0) h.push_back(' ');
  std::ofstream out(dir / "model.safetensors", std::ios::binary);
  const uint64_t len = h.size();
  out.write(reinterpret_cast<const char*>(&len), 8);  // little-endian on x86-64
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  uint64_t state = 0x9E3779B97F4A7C15ull;
  std::vector<uint16_t> buf;
  for (const Spec& s : specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    buf.resize(static_cast<size_t>(n));
    for (uint16_t& v : buf) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const float u = static_cast<float>(state >> 40) / static_cast<float>(1 << 24) - 0.5f;
      const float x = s.norm ? 1.0f + 0.2f * u : 0.04f * u;  // linear: std ~0.012
      uint32_t bits;
      std::memcpy(&bits, &x, 4);
      v = static_cast<uint16_t>(bits >> 16);  // truncation is fine: any bf16 value will do
    }
    out.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(2 * n));
  }
  ASSERT_TRUE(static_cast<bool>(out)) << "could not write the 1B checkpoint";
}

TEST(CpuModel1B, LoadsAndDecodesALlama1BShapeCheckpoint) {
  testing::TempDir dir("ts_cpu_1b");
  WriteCheckpoint(dir.path());
  auto model = CpuModel::Load(dir.path());
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = (*model)->config();
  ASSERT_EQ(c.num_layers, kLayers);
  ASSERT_EQ(c.vocab_size, kVocab);

  const std::vector<int32_t> tokens = {128000, 791, 6864, 315, 9822, 374};
  constexpr int32_t kBlock = 16;
  const std::vector<int32_t> table = {3, 0};  // non-identity block ids
  const std::vector<int32_t> prompt(tokens.begin(), tokens.end() - 2);

  // Teacher-forced logits of all six positions, twice (bit-identical).
  std::vector<float> all, again;
  for (std::vector<float>* out : {&all, &again}) {
    CpuKvPool kv(c, 4, kBlock);
    out->assign(tokens.size() * kVocab, std::numeric_limits<float>::quiet_NaN());
    const SeqChunk chunk{.tokens = tokens, .start_pos = 0, .block_table = table};
    ASSERT_TRUE((*model)->Forward({&chunk, 1}, kv, LogitsMode::kAll, out).ok());
  }
  ASSERT_EQ(all.size(), tokens.size() * kVocab);
  EXPECT_EQ(0, std::memcmp(all.data(), again.data(), all.size() * sizeof(float)));
  double sum = 0, sum2 = 0;
  for (float v : all) {
    ASSERT_TRUE(std::isfinite(v));
    sum += v;
    sum2 += double(v) * v;
  }
  const double mean = sum / all.size();
  EXPECT_GT(sum2 / all.size() - mean * mean, 1e-6) << "degenerate logits";

  // Prefill four tokens, then decode the last two one at a time through the cache.
  CpuKvPool kv(c, 4, kBlock);
  std::vector<float> step;
  const SeqChunk pre{.tokens = prompt, .start_pos = 0, .block_table = table};
  ASSERT_TRUE((*model)->Forward({&pre, 1}, kv, LogitsMode::kLastPerChunk, &step).ok());
  for (size_t pos = prompt.size(); pos <= tokens.size(); ++pos) {
    const float* want = all.data() + (pos - 1) * kVocab;
    double err = 0, ref = 0;
    for (int v = 0; v < kVocab; ++v) {
      err += double(step[v] - want[v]) * (step[v] - want[v]);
      ref += double(want[v]) * want[v];
    }
    EXPECT_LT(std::sqrt(err / ref), 1e-4) << "position " << pos - 1;
    if (pos == tokens.size()) break;
    const SeqChunk one{
        .tokens = {&tokens[pos], 1}, .start_pos = static_cast<int32_t>(pos), .block_table = table};
    ASSERT_TRUE((*model)->Forward({&one, 1}, kv, LogitsMode::kLastPerChunk, &step).ok());
  }
}

}  // namespace
}  // namespace ts
