#include "models/llama_weights.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstring>
#include <string>
#include <string_view>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace ts {
namespace {

constexpr std::string_view kLayerPrefix = "model.layers.";
constexpr std::array<std::string_view, 9> kLayerSuffixes = {
    "input_layernorm.weight",  "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",    "mlp.up_proj.weight",      "mlp.down_proj.weight",
};

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status Unexpected(const TensorView& t, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat(t.file, ": unexpected tensor '", t.name, "': ", why));
}

// Every tensor must be one the Llama math uses: an extra one (a bias, a layer past the config)
// would otherwise be silently dropped and the model computed wrongly.
absl::Status CheckKnown(const TensorView& t, const ModelConfig& c) {
  const std::string_view name = t.name;
  // Old exports save RoPE's precomputed inverse frequencies; we recompute them from the config.
  if (name.ends_with("rotary_emb.inv_freq")) return absl::OkStatus();
  if (name.ends_with(".bias")) return Unexpected(t, "bias tensors are not supported");
  if (name == "model.embed_tokens.weight" || name == "model.norm.weight" ||
      name == "lm_head.weight") {
    return absl::OkStatus();
  }
  if (!name.starts_with(kLayerPrefix)) return Unexpected(t, "not part of a Llama model");
  std::string_view rest = name.substr(kLayerPrefix.size());
  int layer = -1;
  auto [end, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), layer);
  const std::string_view digits = rest.substr(0, end - rest.data());
  // Canonical indices only: "01" or "-1" would dodge the binding below and be silently dropped.
  if (ec != std::errc() || end == rest.data() + rest.size() || *end != '.' || layer < 0 ||
      absl::StrCat(layer) != digits) {
    return Unexpected(t, "no valid layer index");
  }
  if (layer >= c.num_layers) {
    return Unexpected(t, absl::StrCat("layer ", layer, " >= num_hidden_layers ", c.num_layers));
  }
  std::string_view suffix = rest.substr(end - rest.data() + 1);
  for (std::string_view s : kLayerSuffixes) {
    if (suffix == s) return absl::OkStatus();
  }
  return Unexpected(t, "not part of a Llama layer");
}

absl::StatusOr<const TensorView*> Bind(const Checkpoint& ckpt, const std::string& name,
                                       const std::vector<int64_t>& shape) {
  const TensorView* t = ckpt.Find(name);
  if (t == nullptr) {
    return absl::NotFoundError(absl::StrCat("checkpoint has no tensor '", name, "'"));
  }
  if (t->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(t->file, ": tensor '", name,
                                                   "': expected shape ", ShapeString(shape),
                                                   ", got ", ShapeString(t->shape)));
  }
  return t;
}

// The exponent field all ones is Inf or NaN in every IEEE format; `Bits` is the storage word.
template <typename Bits>
int64_t FirstNonFinite(const std::byte* data, int64_t begin, int64_t end, Bits exponent) {
  // Branch-free OR over the range first (vectorises); the index is only searched on a hit.
  Bits hit = 0;
  for (int64_t i = begin; i < end; ++i) {
    Bits v;
    std::memcpy(&v, data + i * sizeof(Bits), sizeof(Bits));  // not necessarily aligned
    hit |= static_cast<Bits>((v & exponent) == exponent);
  }
  if (hit == 0) return -1;
  for (int64_t i = begin; i < end; ++i) {
    Bits v;
    std::memcpy(&v, data + i * sizeof(Bits), sizeof(Bits));
    if ((v & exponent) == exponent) return i;
  }
  return -1;
}

int64_t FirstNonFinite(const TensorView& t, int64_t begin, int64_t end) {
  switch (t.dtype) {
    case DType::kBF16:
      return FirstNonFinite<uint16_t>(t.data, begin, end, 0x7f80u);
    case DType::kF16:
      return FirstNonFinite<uint16_t>(t.data, begin, end, 0x7c00u);
    case DType::kF32:
      return FirstNonFinite<uint32_t>(t.data, begin, end, 0x7f800000u);
  }
  return -1;
}

bool IsNaN(const TensorView& t, int64_t i) {
  float v = 0.0f;
  switch (t.dtype) {
    case DType::kBF16:
    case DType::kF16: {
      uint16_t bits;
      std::memcpy(&bits, t.data + i * 2, 2);
      v = t.dtype == DType::kBF16 ? Bf16ToF32(bits) : F16ToF32(bits);
      break;
    }
    case DType::kF32:
      std::memcpy(&v, t.data + i * 4, 4);
      break;
  }
  return std::isnan(v);
}

std::vector<const TensorView*> AllTensors(const LlamaTensors& w) {
  std::vector<const TensorView*> out = {w.embed, w.final_norm};
  if (w.lm_head != w.embed) out.push_back(w.lm_head);
  for (const LlamaLayerTensors& l : w.layers) {
    out.insert(out.end(), {l.attn_norm, l.q_proj, l.k_proj, l.v_proj, l.o_proj, l.mlp_norm,
                           l.gate_proj, l.up_proj, l.down_proj});
  }
  return out;
}

}  // namespace

absl::Status CheckTensorsFinite(const std::vector<const TensorView*>& tensors, int num_threads) {
  // Chunks of 1M elements: enough to keep every thread busy on a big checkpoint, and the first
  // bad chunk in tensor order is the one reported.
  constexpr int64_t kChunk = int64_t{1} << 20;
  struct Chunk {
    const TensorView* t;
    int64_t begin, end;
  };
  std::vector<Chunk> chunks;
  for (const TensorView* t : tensors) {
    const int64_t n = t->numel();
    for (int64_t b = 0; b < n; b += kChunk) chunks.push_back({t, b, std::min(n, b + kChunk)});
  }
  std::vector<int64_t> bad(chunks.size(), -1);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t c = next.fetch_add(1); c < chunks.size(); c = next.fetch_add(1)) {
      bad[c] = FirstNonFinite(*chunks[c].t, chunks[c].begin, chunks[c].end);
    }
  };
  if (num_threads <= 0) num_threads = static_cast<int>(std::thread::hardware_concurrency());
  const int threads =
      static_cast<int>(std::clamp<int64_t>(num_threads, 1, std::max<int64_t>(1, chunks.size())));
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(work);
  work();
  for (std::thread& th : pool) th.join();
  for (size_t c = 0; c < chunks.size(); ++c) {
    if (bad[c] < 0) continue;
    const TensorView& t = *chunks[c].t;
    return absl::InvalidArgumentError(
        absl::StrCat(t.file, ": tensor '", t.name, "' holds ", IsNaN(t, bad[c]) ? "NaN" : "Inf",
                     " at element ", bad[c], " of ", t.numel(), "; the checkpoint is corrupt"));
  }
  return absl::OkStatus();
}

absl::StatusOr<LlamaTensors> BindLlamaTensors(const Checkpoint& ckpt, const ModelConfig& c) {
  for (const std::string& name : ckpt.Names()) {
    TS_RETURN_IF_ERROR(CheckKnown(*ckpt.Find(name), c));
  }
  const int64_t hidden = c.hidden_size, inter = c.intermediate_size, vocab = c.vocab_size;
  const int64_t q_rows = static_cast<int64_t>(c.num_heads) * c.head_dim;
  const int64_t kv_rows = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;

  LlamaTensors w;
  TS_ASSIGN_OR_RETURN(w.embed, Bind(ckpt, "model.embed_tokens.weight", {vocab, hidden}));
  TS_ASSIGN_OR_RETURN(w.final_norm, Bind(ckpt, "model.norm.weight", {hidden}));
  if (c.tie_word_embeddings) {
    // transformers ties lm_head to the embedding and ignores a stored copy.
    w.lm_head = w.embed;
  } else {
    auto lm_head = Bind(ckpt, "lm_head.weight", {vocab, hidden});
    if (absl::IsNotFound(lm_head.status())) {
      return absl::NotFoundError(
          "checkpoint has no tensor 'lm_head.weight' and config.json says "
          "tie_word_embeddings is false");
    }
    TS_ASSIGN_OR_RETURN(w.lm_head, std::move(lm_head));
  }

  w.layers.resize(c.num_layers);
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    LlamaLayerTensors& l = w.layers[i];
    TS_ASSIGN_OR_RETURN(l.attn_norm, Bind(ckpt, p + "input_layernorm.weight", {hidden}));
    TS_ASSIGN_OR_RETURN(l.q_proj, Bind(ckpt, p + "self_attn.q_proj.weight", {q_rows, hidden}));
    TS_ASSIGN_OR_RETURN(l.k_proj, Bind(ckpt, p + "self_attn.k_proj.weight", {kv_rows, hidden}));
    TS_ASSIGN_OR_RETURN(l.v_proj, Bind(ckpt, p + "self_attn.v_proj.weight", {kv_rows, hidden}));
    TS_ASSIGN_OR_RETURN(l.o_proj, Bind(ckpt, p + "self_attn.o_proj.weight", {hidden, q_rows}));
    TS_ASSIGN_OR_RETURN(l.mlp_norm, Bind(ckpt, p + "post_attention_layernorm.weight", {hidden}));
    TS_ASSIGN_OR_RETURN(l.gate_proj, Bind(ckpt, p + "mlp.gate_proj.weight", {inter, hidden}));
    TS_ASSIGN_OR_RETURN(l.up_proj, Bind(ckpt, p + "mlp.up_proj.weight", {inter, hidden}));
    TS_ASSIGN_OR_RETURN(l.down_proj, Bind(ckpt, p + "mlp.down_proj.weight", {hidden, inter}));
  }
  TS_RETURN_IF_ERROR(CheckTensorsFinite(AllTensors(w)));
  return w;
}

}  // namespace ts
