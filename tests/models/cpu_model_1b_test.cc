// The CPU reference must load and decode a real-sized checkpoint, not only the tiny fixtures: a
// random bf16 checkpoint in the Llama-3.2-1B shape (1.24B parameters, 2.5 GB, llama3 rope, tied
// embeddings) is streamed to a temp dir, loaded (upcast to 4.9 GB of fp32) and run. Checks at that
// scale: the teacher-forced logits of every position equal an fp64 reference of the Llama forward
// pass written here from the transformers definitions (it reads the bf16 weights straight from
// the file and shares no code with CpuModel); every logit is written and finite; the same prompt
// gives bit-identical logits twice; incremental decoding through the paged KV cache reproduces
// the teacher-forced logits. Takes ~1 min and ~8 GB of memory.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <numbers>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "models/checkpoint.h"
#include "models/cpu_model.h"
#include "nlohmann/json.hpp"
#include "tests/common/safetensors_writer.h"

namespace ts {
namespace {

constexpr int kHidden = 2048, kInter = 8192, kLayers = 16, kHeads = 32, kKvHeads = 8;
constexpr int kHeadDim = 64, kVocab = 128256;
constexpr double kMaxRelErrorVsFp64 = 1e-5;

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

// The Llama forward pass in fp64, from the transformers definitions: LlamaRMSNorm, RoPE with
// rotate_half and the llama3 frequency scaling (_compute_llama3_parameters), causal GQA attention
// with softmax(q k / sqrt(head_dim)), the SiLU-gated MLP and the tied lm_head. Weights are the
// file's bf16 values, decoded here bit by bit.
class Fp64Llama {
 public:
  explicit Fp64Llama(const Checkpoint& ckpt) : ckpt_(ckpt) {}

  // [tokens.size()][kVocab]
  std::vector<double> Logits(const std::vector<int32_t>& tokens) {
    const int n = static_cast<int>(tokens.size());
    std::vector<double> h(static_cast<size_t>(n) * kHidden);
    std::vector<double> row(kHidden);
    for (int t = 0; t < n; ++t) {
      Row("model.embed_tokens.weight", tokens[t], kHidden, row.data());
      std::copy(row.begin(), row.end(), h.begin() + static_cast<size_t>(t) * kHidden);
    }
    const std::vector<double> inv_freq = Llama3InvFreq();
    for (int l = 0; l < kLayers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      std::vector<double> x = RmsNorm(h, n, p + "input_layernorm.weight");
      std::vector<double> q =
          Linear(p + "self_attn.q_proj.weight", x, n, kHidden, kHeads * kHeadDim);
      std::vector<double> k =
          Linear(p + "self_attn.k_proj.weight", x, n, kHidden, kKvHeads * kHeadDim);
      const std::vector<double> v =
          Linear(p + "self_attn.v_proj.weight", x, n, kHidden, kKvHeads * kHeadDim);
      Rope(&q, n, kHeads, inv_freq);
      Rope(&k, n, kKvHeads, inv_freq);
      const std::vector<double> attn = Attention(q, k, v, n);
      Add(&h, Linear(p + "self_attn.o_proj.weight", attn, n, kHeads * kHeadDim, kHidden));
      x = RmsNorm(h, n, p + "post_attention_layernorm.weight");
      std::vector<double> gate = Linear(p + "mlp.gate_proj.weight", x, n, kHidden, kInter);
      const std::vector<double> up = Linear(p + "mlp.up_proj.weight", x, n, kHidden, kInter);
      for (size_t i = 0; i < gate.size(); ++i)
        gate[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
      Add(&h, Linear(p + "mlp.down_proj.weight", gate, n, kInter, kHidden));
    }
    const std::vector<double> x = RmsNorm(h, n, "model.norm.weight");
    return Linear("model.embed_tokens.weight", x, n, kHidden, kVocab);
  }

 private:
  const TensorView& Tensor(const std::string& name) const {
    const TensorView* t = ckpt_.Find(name);
    TS_CHECK(t != nullptr && t->dtype == DType::kBF16);
    return *t;
  }
  // Row `r` of a bf16 [rows][cols] tensor as doubles.
  void Row(const std::string& name, int64_t r, int cols, double* out) const {
    const TensorView& t = Tensor(name);
    std::vector<uint16_t> bits(cols);
    std::memcpy(bits.data(), t.data + r * cols * 2, static_cast<size_t>(cols) * 2);
    for (int i = 0; i < cols; ++i) {
      const uint32_t f = static_cast<uint32_t>(bits[i]) << 16;
      float v;
      std::memcpy(&v, &f, 4);
      out[i] = v;
    }
  }
  // y[t][o] = sum_i W[o][i] * x[t][i]; W is [out][in]. Rows split over a few threads.
  std::vector<double> Linear(const std::string& name, const std::vector<double>& x, int n, int in,
                             int out) const {
    std::vector<double> y(static_cast<size_t>(n) * out);
    const int threads = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 4u));
    std::vector<std::thread> pool;
    for (int w = 0; w < threads; ++w) {
      pool.emplace_back([&, w] {
        std::vector<double> row(in);
        for (int o = w; o < out; o += threads) {
          Row(name, o, in, row.data());
          for (int t = 0; t < n; ++t) {
            const double* xt = x.data() + static_cast<size_t>(t) * in;
            double acc = 0.0;
            for (int i = 0; i < in; ++i) acc += row[i] * xt[i];
            y[static_cast<size_t>(t) * out + o] = acc;
          }
        }
      });
    }
    for (auto& th : pool) th.join();
    return y;
  }
  std::vector<double> RmsNorm(const std::vector<double>& h, int n,
                              const std::string& weight) const {
    std::vector<double> w(kHidden), x(h.size());
    Row(weight, 0, kHidden, w.data());
    for (int t = 0; t < n; ++t) {
      const double* ht = h.data() + static_cast<size_t>(t) * kHidden;
      double ss = 0.0;
      for (int i = 0; i < kHidden; ++i) ss += ht[i] * ht[i];
      const double scale = 1.0 / std::sqrt(ss / kHidden + 1e-5);
      for (int i = 0; i < kHidden; ++i)
        x[static_cast<size_t>(t) * kHidden + i] = ht[i] * scale * w[i];
    }
    return x;
  }
  static std::vector<double> Llama3InvFreq() {
    const double factor = 32.0, low = 1.0, high = 4.0, old_context = 8192.0;
    std::vector<double> f(kHeadDim / 2);
    for (int i = 0; i < kHeadDim / 2; ++i) {
      const double base = 1.0 / std::pow(500000.0, 2.0 * i / kHeadDim);
      const double wavelen = 2.0 * std::numbers::pi / base;
      if (wavelen < old_context / high) {
        f[i] = base;
      } else if (wavelen > old_context / low) {
        f[i] = base / factor;
      } else {
        const double smooth = (old_context / wavelen - low) / (high - low);
        f[i] = (1.0 - smooth) * base / factor + smooth * base;
      }
    }
    return f;
  }
  // rotate_half: dims i and i + head_dim/2 form a pair. Token t sits at position t.
  static void Rope(std::vector<double>* x, int n, int heads, const std::vector<double>& inv_freq) {
    const int half = kHeadDim / 2;
    for (int t = 0; t < n; ++t) {
      for (int hd = 0; hd < heads; ++hd) {
        double* v = x->data() + (static_cast<size_t>(t) * heads + hd) * kHeadDim;
        for (int i = 0; i < half; ++i) {
          const double c = std::cos(t * inv_freq[i]), s = std::sin(t * inv_freq[i]);
          const double a = v[i], b = v[i + half];
          v[i] = a * c - b * s;
          v[i + half] = b * c + a * s;
        }
      }
    }
  }
  static std::vector<double> Attention(const std::vector<double>& q, const std::vector<double>& k,
                                       const std::vector<double>& v, int n) {
    std::vector<double> out(static_cast<size_t>(n) * kHeads * kHeadDim, 0.0);
    const int group = kHeads / kKvHeads;
    for (int t = 0; t < n; ++t) {
      for (int hd = 0; hd < kHeads; ++hd) {
        const double* qt = q.data() + (static_cast<size_t>(t) * kHeads + hd) * kHeadDim;
        const int kv = hd / group;
        std::vector<double> score(t + 1);
        double top = -std::numeric_limits<double>::infinity();
        for (int s = 0; s <= t; ++s) {
          const double* ks = k.data() + (static_cast<size_t>(s) * kKvHeads + kv) * kHeadDim;
          double d = 0.0;
          for (int i = 0; i < kHeadDim; ++i) d += qt[i] * ks[i];
          score[s] = d / std::sqrt(static_cast<double>(kHeadDim));
          top = std::max(top, score[s]);
        }
        double z = 0.0;
        for (double& sc : score) z += sc = std::exp(sc - top);
        double* o = out.data() + (static_cast<size_t>(t) * kHeads + hd) * kHeadDim;
        for (int s = 0; s <= t; ++s) {
          const double* vs = v.data() + (static_cast<size_t>(s) * kKvHeads + kv) * kHeadDim;
          for (int i = 0; i < kHeadDim; ++i) o[i] += score[s] / z * vs[i];
        }
      }
    }
    return out;
  }
  static void Add(std::vector<double>* h, const std::vector<double>& d) {
    for (size_t i = 0; i < h->size(); ++i) (*h)[i] += d[i];
  }

  const Checkpoint& ckpt_;
};

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

  // Against the fp64 reference, position by position; fp32 accumulation over K <= 8192 leaves
  // a relative error near 1e-6.
  {
    auto ckpt = Checkpoint::OpenFile(dir.path() / "model.safetensors");
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    const std::vector<double> want = Fp64Llama(**ckpt).Logits(tokens);
    for (size_t t = 0; t < tokens.size(); ++t) {
      double err = 0, norm = 0;
      size_t best = 0, best_ref = 0;
      for (int v = 0; v < kVocab; ++v) {
        const size_t i = t * kVocab + v;
        err += (all[i] - want[i]) * (all[i] - want[i]);
        norm += want[i] * want[i];
        if (all[i] > all[t * kVocab + best]) best = v;
        if (want[i] > want[t * kVocab + best_ref]) best_ref = v;
      }
      const double rel = std::sqrt(err / norm);
      std::printf("position %zu: relative error vs fp64 %.3g, argmax %zu (fp64 %zu)\n", t, rel,
                  best, best_ref);
      EXPECT_LT(rel, kMaxRelErrorVsFp64) << "position " << t;
    }
  }

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
