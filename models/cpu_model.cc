#include "models/cpu_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "models/checkpoint.h"
#include "models/cpu_ops.h"
#include "models/llama_weights.h"
#include "models/rope.h"
#include "models/thread_pool.h"

namespace ts {

// ---------------------------------------------------------------------------------------------
// KV pool

CpuKvPool::CpuKvPool(const ModelConfig& config, int32_t num_blocks, int32_t block_size)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      num_layers_(config.num_layers),
      num_kv_heads_(config.num_kv_heads),
      head_dim_(config.head_dim) {
  TS_CHECK_GE(num_blocks, 0);
  TS_CHECK_GE(block_size, 1);
  const size_t n =
      static_cast<size_t>(num_layers_) * num_blocks_ * block_size_ * num_kv_heads_ * head_dim_;
  k_.assign(n, 0.0f);
  v_.assign(n, 0.0f);
}

// ---------------------------------------------------------------------------------------------
// Model

namespace {

struct LayerWeights {
  std::vector<float> attn_norm;  // [hidden]
  std::vector<float> wqkv;      // [(heads + 2*kv_heads) * head_dim, hidden]: q rows, k rows, v rows
  std::vector<float> wo;        // [hidden, heads * head_dim]
  std::vector<float> mlp_norm;  // [hidden]
  std::vector<float> wgu;       // [2 * intermediate, hidden]: gate rows, then up rows
  std::vector<float> wdown;     // [hidden, intermediate]
};

struct TokenInfo {
  int32_t pos;                           // absolute position in its sequence
  std::span<const int32_t> block_table;  // its chunk's table
};

// One upcast job: a flat element range of a checkpoint tensor into its fp32 destination.
struct ConvertPiece {
  const TensorView* src;
  int64_t begin, count;
  float* dst;  // [src->numel()], the whole destination
};

// Splits every tensor into ~1M-element pieces so a huge embedding does not serialise the load.
void ConvertAll(ThreadPool& pool, const std::vector<std::pair<const TensorView*, float*>>& jobs) {
  constexpr int64_t kPiece = 1 << 20;
  std::vector<ConvertPiece> pieces;
  for (const auto& [src, dst] : jobs) {
    const int64_t n = src->numel();
    for (int64_t b = 0; b < n; b += kPiece)
      pieces.push_back({src, b, std::min(kPiece, n - b), dst});
  }
  pool.ParallelFor(static_cast<int64_t>(pieces.size()), 1, [&pieces](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const ConvertPiece& p = pieces[i];
      TensorView sub;
      sub.name = p.src->name;
      sub.dtype = p.src->dtype;
      sub.shape = {p.count};
      sub.data = p.src->data + p.begin * static_cast<int64_t>(DTypeSize(p.src->dtype));
      sub.nbytes = static_cast<size_t>(p.count) * DTypeSize(p.src->dtype);
      sub.file = p.src->file;
      ConvertToF32(sub, p.dst + p.begin);
    }
  });
}

}  // namespace

struct CpuModel::Impl {
  ModelConfig config;
  CpuStage stage;  // num_layers resolved
  std::unique_ptr<ThreadPool> pool;
  std::vector<float> embed;       // [vocab, hidden]
  std::vector<float> final_norm;  // [hidden]
  std::vector<float> lm_head;     // [vocab, hidden]; empty when tied to embed
  std::vector<LayerWeights> layers;
  std::vector<float> inv_freq;  // [head_dim / 2]

  // Scratch reused across Forward calls; T = total tokens of the batch.
  std::vector<TokenInfo> tokens;          // [T]
  std::vector<float> rope_cos, rope_sin;  // [T, head_dim / 2]
  std::vector<float> x;                   // [T, hidden] residual stream
  std::vector<float> h;                   // [T, hidden] normed input of a GEMM
  std::vector<float> qkv;                 // [T, (heads + 2*kv_heads) * head_dim]
  std::vector<float> attn;                // [T, heads * head_dim]
  std::vector<float> gu;                  // [T, 2 * intermediate]
  std::vector<float> act;                 // [T, intermediate]
  std::vector<float> out;                 // [T, hidden] GEMM output added into x

  int q_dim() const { return config.num_heads * config.head_dim; }
  int kv_dim() const { return config.num_kv_heads * config.head_dim; }
  int qkv_dim() const { return q_dim() + 2 * kv_dim(); }
  const float* lm_head_data() const { return lm_head.empty() ? embed.data() : lm_head.data(); }

  absl::Status Validate(std::span<const SeqChunk> chunks, const CpuKvPool& kv) const;
  // hidden_in: empty on the embedding stage, else [T][hidden].
  void Prepare(std::span<const SeqChunk> chunks, std::span<const float> hidden_in);
  void RunLayer(int l, CpuKvPool& kv);
  void Attention(int l, CpuKvPool& kv);
  void NormRows(const float* in, int64_t rows, const float* w, float* dst);
  void Gemm(const float* in, int64_t rows, int64_t k, const std::vector<float>& w, int64_t n,
            float* dst);
  void AddOut(int64_t rows);
};

CpuModel::CpuModel() : impl_(std::make_unique<Impl>()) {}
CpuModel::~CpuModel() = default;
const ModelConfig& CpuModel::config() const {
  return impl_->config;
}
int CpuModel::num_threads() const {
  return impl_->pool->num_threads();
}

size_t CpuModel::weight_bytes() const {
  size_t n = impl_->embed.size() + impl_->final_norm.size() + impl_->lm_head.size();
  for (const LayerWeights& w : impl_->layers) {
    n += w.attn_norm.size() + w.wqkv.size() + w.wo.size() + w.mlp_norm.size() + w.wgu.size() +
         w.wdown.size();
  }
  return n * sizeof(float);
}

absl::StatusOr<std::unique_ptr<CpuModel>> CpuModel::Load(const std::filesystem::path& dir,
                                                         CpuModelOptions options) {
  TS_ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
  if (config.head_dim <= 0 || config.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir.string(), "/config.json: head_dim must be positive and even for RoPE, got ",
        config.head_dim));
  }
  if (config.num_kv_heads <= 0 || config.num_heads % config.num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir.string(), "/config.json: num_attention_heads (", config.num_heads,
                     ") must be a multiple of num_key_value_heads (", config.num_kv_heads, ")"));
  }
  CpuStage stage = options.stage;
  if (stage.num_layers < 0) stage.num_layers = config.num_layers - stage.first_layer;
  if (stage.first_layer < 0 || stage.num_layers < 1 ||
      stage.first_layer + stage.num_layers > config.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("stage: layers [", stage.first_layer, ", ",
                                                   stage.first_layer + stage.num_layers,
                                                   ") outside the model's ", config.num_layers));
  }
  TS_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(dir));
  TS_ASSIGN_OR_RETURN(LlamaTensors t, BindLlamaTensors(*ckpt, config));

  std::unique_ptr<CpuModel> model(new CpuModel());
  Impl& m = *model->impl_;
  m.config = config;
  m.stage = stage;
  m.pool = std::make_unique<ThreadPool>(options.num_threads, options.min_parallel_work);
  const int64_t hidden = config.hidden_size, inter = config.intermediate_size;
  const int64_t vocab = config.vocab_size;

  std::vector<std::pair<const TensorView*, float*>> jobs;
  const bool tied = t.lm_head == t.embed;
  // A tied head reads the embedding matrix as its lm_head.
  if (stage.embedding || (stage.head && tied)) {
    m.embed.resize(vocab * hidden);
    jobs.emplace_back(t.embed, m.embed.data());
  }
  if (stage.head) {
    m.final_norm.resize(hidden);
    jobs.emplace_back(t.final_norm, m.final_norm.data());
    if (!tied) {
      m.lm_head.resize(vocab * hidden);
      jobs.emplace_back(t.lm_head, m.lm_head.data());
    }
  }
  m.layers.resize(stage.num_layers);
  const int64_t q_rows = m.q_dim(), kv_rows = m.kv_dim();
  for (int l = 0; l < stage.num_layers; ++l) {
    const LlamaLayerTensors& src = t.layers[stage.first_layer + l];
    LayerWeights& w = m.layers[l];
    w.attn_norm.resize(hidden);
    w.wqkv.resize((q_rows + 2 * kv_rows) * hidden);
    w.wo.resize(hidden * q_rows);
    w.mlp_norm.resize(hidden);
    w.wgu.resize(2 * inter * hidden);
    w.wdown.resize(hidden * inter);
    jobs.emplace_back(src.attn_norm, w.attn_norm.data());
    jobs.emplace_back(src.q_proj, w.wqkv.data());
    jobs.emplace_back(src.k_proj, w.wqkv.data() + q_rows * hidden);
    jobs.emplace_back(src.v_proj, w.wqkv.data() + (q_rows + kv_rows) * hidden);
    jobs.emplace_back(src.o_proj, w.wo.data());
    jobs.emplace_back(src.mlp_norm, w.mlp_norm.data());
    jobs.emplace_back(src.gate_proj, w.wgu.data());
    jobs.emplace_back(src.up_proj, w.wgu.data() + inter * hidden);
    jobs.emplace_back(src.down_proj, w.wdown.data());
  }
  ConvertAll(*m.pool, jobs);
  TS_ASSIGN_OR_RETURN(m.inv_freq, RopeInvFreq(config));
  return model;
}

absl::Status CpuModel::Impl::Validate(std::span<const SeqChunk> chunks, const CpuKvPool& kv) const {
  if (kv.num_layers() != stage.num_layers || kv.num_kv_heads() != config.num_kv_heads ||
      kv.head_dim() != config.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv pool shape (layers ", kv.num_layers(), ", kv_heads ", kv.num_kv_heads(),
                     ", head_dim ", kv.head_dim(), ") does not match the model (", stage.num_layers,
                     ", ", config.num_kv_heads, ", ", config.head_dim, ")"));
  }
  const int64_t bs = kv.block_size();
  std::vector<int32_t> used;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const SeqChunk& ch = chunks[c];
    const std::string where = absl::StrCat("chunk ", c, ": ");
    if (ch.tokens.empty()) return absl::InvalidArgumentError(where + "tokens is empty");
    if (ch.start_pos < 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, "start_pos ", ch.start_pos, " < 0"));
    }
    for (size_t i = 0; i < ch.tokens.size(); ++i) {
      if (ch.tokens[i] < 0 || ch.tokens[i] >= config.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat(where, "tokens[", i, "] = ", ch.tokens[i],
                                                       " outside [0, ", config.vocab_size, ")"));
      }
    }
    const int64_t end = static_cast<int64_t>(ch.start_pos) + static_cast<int64_t>(ch.tokens.size());
    if (end > config.max_position_embeddings) {
      return absl::InvalidArgumentError(absl::StrCat(where, "last position ", end - 1,
                                                     " >= max_position_embeddings ",
                                                     config.max_position_embeddings));
    }
    const int64_t needed = (end + bs - 1) / bs;
    if (static_cast<int64_t>(ch.block_table.size()) < needed) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "block_table has ", ch.block_table.size(), " entries, positions [0, ",
                       end, ") need ", needed));
    }
    used.assign(ch.block_table.begin(), ch.block_table.begin() + needed);
    for (int64_t i = 0; i < needed; ++i) {
      if (used[i] < 0 || used[i] >= kv.num_blocks()) {
        return absl::InvalidArgumentError(absl::StrCat(where, "block_table[", i, "] = ", used[i],
                                                       " outside [0, ", kv.num_blocks(), ")"));
      }
    }
    std::sort(used.begin(), used.end());
    if (std::adjacent_find(used.begin(), used.end()) != used.end()) {
      return absl::InvalidArgumentError(where + "block_table repeats a block id");
    }
  }
  return absl::OkStatus();
}

void CpuModel::Impl::Prepare(std::span<const SeqChunk> chunks, std::span<const float> hidden_in) {
  tokens.clear();
  for (const SeqChunk& ch : chunks) {
    for (size_t i = 0; i < ch.tokens.size(); ++i) {
      tokens.push_back({ch.start_pos + static_cast<int32_t>(i), ch.block_table});
    }
  }
  const int64_t T = static_cast<int64_t>(tokens.size());
  const int64_t half = config.head_dim / 2, hidden = config.hidden_size;
  // transformers: freqs = position.float() * inv_freq (fp32), then cos/sin of it.
  rope_cos.resize(T * half);
  rope_sin.resize(T * half);
  for (int64_t t = 0; t < T; ++t) {
    const float pos = static_cast<float>(tokens[t].pos);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = pos * inv_freq[i];
      rope_cos[t * half + i] = std::cos(angle);
      rope_sin[t * half + i] = std::sin(angle);
    }
  }
  x.resize(T * hidden);
  h.resize(T * hidden);
  qkv.resize(T * qkv_dim());
  attn.resize(T * q_dim());
  gu.resize(T * 2 * config.intermediate_size);
  act.resize(T * config.intermediate_size);
  out.resize(T * hidden);
  if (!stage.embedding) {
    std::memcpy(x.data(), hidden_in.data(), T * hidden * sizeof(float));
    return;
  }
  int64_t t = 0;
  for (const SeqChunk& ch : chunks) {
    for (int32_t id : ch.tokens) {
      std::memcpy(&x[t * hidden], &embed[static_cast<int64_t>(id) * hidden],
                  hidden * sizeof(float));
      ++t;
    }
  }
}

void CpuModel::Impl::NormRows(const float* in, int64_t rows, const float* w, float* dst) {
  const int64_t hidden = config.hidden_size;
  pool->ParallelFor(rows, pool->Grain(hidden), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      cpu::RmsNorm(in + r * hidden, w, hidden, config.rms_norm_eps, dst + r * hidden);
    }
  });
}

void CpuModel::Impl::Gemm(const float* in, int64_t rows, int64_t k, const std::vector<float>& w,
                          int64_t n, float* dst) {
  cpu::Gemm(*pool,
            {.x = in, .ldx = k, .rows = rows, .w = w.data(), .n = n, .k = k, .y = dst, .ldy = n});
}

void CpuModel::Impl::AddOut(int64_t rows) {
  const int64_t n = rows * config.hidden_size;
  for (int64_t i = 0; i < n; ++i) x[i] += out[i];
}

// Rotates q and k of every token, writes k and v into the pool, then attends per (token, head)
// over the token's sequence up to and including its own position (causal by construction).
void CpuModel::Impl::Attention(int l, CpuKvPool& kv) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  const int hd = config.head_dim, half = hd / 2, heads = config.num_heads;
  const int kv_heads = config.num_kv_heads, group = heads / kv_heads;
  const int64_t ld = qkv_dim();
  const int32_t bs = kv.block_size();
  pool->ParallelFor(T, pool->Grain(ld), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* row = &qkv[t * ld];
      const float* c = &rope_cos[t * half];
      const float* s = &rope_sin[t * half];
      for (int hh = 0; hh < heads + kv_heads; ++hh) cpu::ApplyRope(row + hh * hd, c, s, half);
      const int32_t pos = tokens[t].pos;
      const int32_t block = tokens[t].block_table[pos / bs];
      for (int kh = 0; kh < kv_heads; ++kh) {
        std::memcpy(kv.k(l, block, pos % bs, kh), row + q_dim() + kh * hd, hd * sizeof(float));
        std::memcpy(kv.v(l, block, pos % bs, kh), row + q_dim() + kv_dim() + kh * hd,
                    hd * sizeof(float));
      }
    }
  });
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  int32_t max_ctx = 0;
  for (const TokenInfo& ti : tokens) max_ctx = std::max(max_ctx, ti.pos + 1);
  pool->ParallelFor(T * heads, pool->Grain(2 * int64_t{max_ctx} * hd), [&](int64_t b, int64_t e) {
    std::vector<float> scores;
    for (int64_t task = b; task < e; ++task) {
      const int64_t t = task / heads;
      const int head = static_cast<int>(task % heads), kh = head / group;
      const TokenInfo& ti = tokens[t];
      const float* q = &qkv[t * ld + head * hd];
      const int32_t ctx = ti.pos + 1;
      scores.resize(ctx);
      float max_score = -INFINITY;
      for (int32_t j = 0; j < ctx; ++j) {
        scores[j] = cpu::Dot(q, kv.k(l, ti.block_table[j / bs], j % bs, kh), hd) * scale;
        max_score = std::max(max_score, scores[j]);
      }
      float sum = 0.0f;
      for (int32_t j = 0; j < ctx; ++j) {
        scores[j] = std::exp(scores[j] - max_score);
        sum += scores[j];
      }
      const float inv_sum = 1.0f / sum;
      float* o = &attn[t * q_dim() + head * hd];
      std::fill(o, o + hd, 0.0f);
      for (int32_t j = 0; j < ctx; ++j) {
        cpu::Axpy(scores[j] * inv_sum, kv.v(l, ti.block_table[j / bs], j % bs, kh), o, hd);
      }
    }
  });
}

void CpuModel::Impl::RunLayer(int l, CpuKvPool& kv) {
  const LayerWeights& w = layers[l];
  const int64_t T = static_cast<int64_t>(tokens.size());
  const int64_t hidden = config.hidden_size, inter = config.intermediate_size;
  NormRows(x.data(), T, w.attn_norm.data(), h.data());
  Gemm(h.data(), T, hidden, w.wqkv, qkv_dim(), qkv.data());
  Attention(l, kv);
  Gemm(attn.data(), T, q_dim(), w.wo, hidden, out.data());
  AddOut(T);
  NormRows(x.data(), T, w.mlp_norm.data(), h.data());
  Gemm(h.data(), T, hidden, w.wgu, 2 * inter, gu.data());
  pool->ParallelFor(T, pool->Grain(4 * inter), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      cpu::SiluMul(&gu[t * 2 * inter], &gu[t * 2 * inter + inter], inter, &act[t * inter]);
    }
  });
  Gemm(act.data(), T, inter, w.wdown, hidden, out.data());
  AddOut(T);
}

absl::Status CpuModel::Forward(std::span<const SeqChunk> chunks, CpuKvPool& kv, LogitsMode mode,
                               std::vector<float>* logits) {
  if (!impl_->stage.embedding || !impl_->stage.head) {
    return absl::FailedPreconditionError("Forward needs the whole model; this one is a stage");
  }
  return ForwardStage(chunks, kv, {}, mode, logits);
}

int32_t CpuModel::num_stage_layers() const {
  return impl_->stage.num_layers;
}

absl::Status CpuModel::ForwardStage(std::span<const SeqChunk> chunks, CpuKvPool& kv,
                                    std::span<const float> hidden_in, LogitsMode mode,
                                    std::vector<float>* out) {
  if (out == nullptr) return absl::InvalidArgumentError("logits must not be null");
  Impl& m = *impl_;
  TS_RETURN_IF_ERROR(m.Validate(chunks, kv));
  const int64_t hidden = m.config.hidden_size, vocab = m.config.vocab_size;
  int64_t total = 0;
  for (const SeqChunk& ch : chunks) total += static_cast<int64_t>(ch.tokens.size());
  if (!m.stage.embedding && static_cast<int64_t>(hidden_in.size()) != total * hidden) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden_in: ", hidden_in.size(), " floats, want ", total, " x ", hidden));
  }
  m.Prepare(chunks, hidden_in);
  for (int l = 0; l < m.stage.num_layers; ++l) m.RunLayer(l, kv);
  if (!m.stage.head) {
    out->assign(m.x.begin(), m.x.begin() + total * hidden);
    return absl::OkStatus();
  }

  // Final norm only on the rows whose logits are wanted; h holds them packed.
  int64_t rows = 0;
  if (mode == LogitsMode::kAll) {
    rows = total;
    m.NormRows(m.x.data(), rows, m.final_norm.data(), m.h.data());
  } else {
    int64_t last = -1;
    for (const SeqChunk& ch : chunks) {
      last += static_cast<int64_t>(ch.tokens.size());
      cpu::RmsNorm(&m.x[last * hidden], m.final_norm.data(), hidden, m.config.rms_norm_eps,
                   &m.h[rows * hidden]);
      ++rows;
    }
  }
  out->resize(rows * vocab);
  cpu::Gemm(*m.pool, {.x = m.h.data(),
                      .ldx = hidden,
                      .rows = rows,
                      .w = m.lm_head_data(),
                      .n = vocab,
                      .k = hidden,
                      .y = out->data(),
                      .ldy = vocab});
  return absl::OkStatus();
}

}  // namespace ts
