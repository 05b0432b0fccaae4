#include "engine/cuda/memory_plan.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "kernels/gemv.cuh"

namespace ts {
namespace {

constexpr size_t kAlign = 256;

size_t AlignUp(size_t v, size_t a) {
  return (v + a - 1) / a * a;
}
int32_t RoundUp8(int32_t v) {
  return (v + 7) / 8 * 8;
}

// Bump allocator over one block. With a null base it only measures (sizing pass); the same
// sequence of Take calls then hands out the real pointers, so plan and allocation agree.
class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}
  template <typename T>
  T* Take(size_t count, size_t* category) {
    offset_ = AlignUp(offset_, kAlign);
    T* p = base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + offset_);
    const size_t bytes = AlignUp(count * sizeof(T), kAlign);
    offset_ += bytes;
    if (category != nullptr) *category += bytes;
    return p;
  }
  size_t offset() const { return offset_; }

 private:
  char* base_;
  size_t offset_ = 0;
};

struct Categories {
  size_t weights = 0, kv = 0, activations = 0, attention = 0, logits_workspace = 0;
};

using bf16 = __nv_bfloat16;

void CarveForward(const ArenaShape& s, int32_t rows, Carver& c, size_t* cat, ForwardBuffers* f) {
  const ModelDims& d = s.dims;
  const size_t m = static_cast<size_t>(rows);
  f->rows = rows;
  f->h = c.Take<bf16>(m * d.hidden, cat);
  f->xn = c.Take<bf16>(m * d.hidden, cat);
  f->h_sumsq = c.Take<float>(m * kernels::GemvSumSqGroups(d.hidden), cat);
  f->qkv = c.Take<bf16>(m * d.qkv_dim(), cat);
  f->q = c.Take<bf16>(m * d.q_dim(), cat);
  f->attn = c.Take<bf16>(m * d.q_dim(), cat);
  f->gate_up = c.Take<bf16>(m * 2 * d.intermediate_padded, cat);
  f->act = c.Take<bf16>(m * d.intermediate_padded, cat);
  f->tokens = c.Take<int32_t>(m, cat);
  f->positions = c.Take<int32_t>(m, cat);
  f->slot_mapping = c.Take<int32_t>(m, cat);
  f->rope_angles = c.Take<float>(m * d.head_dim, cat);
}

void CarveHead(const ArenaShape& s, Carver& c, size_t* cat, HeadBuffers* h) {
  const ModelDims& d = s.dims;
  const size_t m = static_cast<size_t>(s.max_bucket);
  h->rows = s.max_bucket;
  h->hidden = c.Take<bf16>(m * d.hidden, cat);
  h->normed = c.Take<bf16>(m * d.hidden, cat);
  h->logits_f32 = c.Take<float>(m * d.vocab, cat);
  h->params = c.Take<kernels::SamplingRow>(m, cat);
  h->sample_slots = c.Take<int32_t>(m, cat);
  h->row_slots = c.Take<int32_t>(m, cat);
  h->sampled = c.Take<int32_t>(m, cat);
  h->sampling_workspace_bytes = kernels::SamplingWorkspaceBytes(s.max_bucket, d.vocab);
  h->sampling_workspace = c.Take<char>(h->sampling_workspace_bytes, cat);
}

DeviceLayout Carve(const ArenaShape& s, void* base, Categories* cats, size_t* total) {
  const ModelDims& d = s.dims;
  Carver c(base);
  DeviceLayout l;
  const size_t hidden = static_cast<size_t>(d.hidden);
  const ModelStage& st = s.stage;
  const size_t table = static_cast<size_t>(d.vocab) * hidden;
  // A tied lm_head is the embedding matrix, so a last stage holds it even without the lookup.
  if (st.has_embedding || (st.has_head && !d.separate_lm_head())) {
    l.embed = c.Take<bf16>(table, &cats->weights);
  }
  if (st.has_head) {
    l.lm_head = d.separate_lm_head() ? c.Take<bf16>(table, &cats->weights) : l.embed;
    l.final_norm = c.Take<bf16>(hidden, &cats->weights);
  }
  l.inv_freq = c.Take<float>(d.head_dim / 2, &cats->weights);
  l.layers.resize(st.num_layers);
  const size_t kv_elems =
      static_cast<size_t>(s.num_kv_blocks) * d.num_kv_heads * s.kv_block_size * d.head_dim;
  for (LayerBuffers& layer : l.layers) {
    layer.attn_norm = c.Take<bf16>(hidden, &cats->weights);
    layer.mlp_norm = c.Take<bf16>(hidden, &cats->weights);
    layer.qkv = c.Take<bf16>(static_cast<size_t>(d.qkv_dim()) * hidden, &cats->weights);
    layer.o = c.Take<bf16>(hidden * d.q_dim(), &cats->weights);
    layer.gate_up =
        c.Take<bf16>(static_cast<size_t>(2) * d.intermediate_padded * hidden, &cats->weights);
    layer.down = c.Take<bf16>(hidden * d.intermediate_padded, &cats->weights);
  }
  for (LayerBuffers& layer : l.layers) {
    layer.k_cache = c.Take<bf16>(kv_elems, &cats->kv);
    layer.v_cache = c.Take<bf16>(kv_elems, &cats->kv);
  }
  const size_t mb = static_cast<size_t>(s.max_bucket);
  const size_t slots = static_cast<size_t>(s.max_slots);
  const size_t blocks = static_cast<size_t>(s.max_blocks_per_seq);
  CarveForward(s, s.max_bucket, c, &cats->activations, &l.decode);
  CarveHead(s, c, &cats->activations, &l.decode_head);
  l.decode_context_lens = c.Take<int32_t>(mb, &cats->activations);
  l.decode_block_tables = c.Take<int32_t>(mb * blocks, &cats->activations);
  CarveForward(s, s.prefill_rows, c, &cats->activations, &l.prefill);
  CarveHead(s, c, &cats->activations, &l.prefill_head);
  l.prefill_cu_seqlens = c.Take<int32_t>(slots + 1, &cats->activations);
  l.prefill_start_pos = c.Take<int32_t>(slots, &cats->activations);
  l.prefill_block_tables = c.Take<int32_t>(slots * blocks, &cats->activations);
  l.gather_src = c.Take<int32_t>(mb, &cats->activations);
  l.gather_dst = c.Take<int32_t>(mb, &cats->activations);
  l.attention_workspace = c.Take<char>(s.attention_workspace_bytes, &cats->attention);
  l.decode_logits_workspace = c.Take<char>(s.logits_workspace_bytes, &cats->logits_workspace);
  l.prefill_logits_workspace = c.Take<char>(s.logits_workspace_bytes, &cats->logits_workspace);
  *total = c.offset();
  return l;
}

HostLayout CarveHostImpl(const ArenaShape& s, void* base, size_t* total) {
  Carver c(base);
  HostLayout h;
  const size_t mb = static_cast<size_t>(s.max_bucket);
  const size_t slots = static_cast<size_t>(s.max_slots);
  const size_t blocks = static_cast<size_t>(s.max_blocks_per_seq);
  const size_t rows = static_cast<size_t>(s.prefill_rows);
  h.error_flag = c.Take<int32_t>(4, nullptr);
  h.row_slots = c.Take<int32_t>(mb, nullptr);
  h.tokens = c.Take<int32_t>(rows, nullptr);
  h.positions = c.Take<int32_t>(rows, nullptr);
  h.slot_mapping = c.Take<int32_t>(rows, nullptr);
  h.cu_seqlens = c.Take<int32_t>(slots + 1, nullptr);
  h.start_pos = c.Take<int32_t>(slots, nullptr);
  h.block_tables = c.Take<int32_t>(slots * blocks, nullptr);
  h.gather_src = c.Take<int32_t>(mb, nullptr);
  h.gather_dst = c.Take<int32_t>(mb, nullptr);
  h.sample_params = c.Take<kernels::SamplingRow>(mb, nullptr);
  h.sample_slots = c.Take<int32_t>(mb, nullptr);
  h.head_row_slots = c.Take<int32_t>(mb, nullptr);
  *total = c.offset();
  return h;
}

SlotDeviceLayout CarveSlotDeviceImpl(const SlotShape& s, void* base, size_t* total) {
  Carver c(base);
  SlotDeviceLayout l;
  const size_t slots = static_cast<size_t>(s.max_slots);
  const size_t rows = static_cast<size_t>(s.count_rows());
  l.slots = c.Take<kernels::SlotRow>(slots, nullptr);
  l.block_tables = c.Take<int32_t>(slots * s.max_blocks_per_seq, nullptr);
  l.output_counts = c.Take<uint32_t>(rows * s.vocab, nullptr);
  l.prompt_mask = c.Take<uint32_t>(rows * s.mask_words(), nullptr);
  *total = c.offset();
  return l;
}

SlotHostLayout CarveSlotHostImpl(const SlotShape& s, void* base, size_t* total) {
  Carver c(base);
  SlotHostLayout h;
  const size_t slots = static_cast<size_t>(s.max_slots);
  h.rings = c.Take<RingEntry>(slots * s.ring_capacity, nullptr);
  h.cancel = c.Take<int32_t>(slots, nullptr);
  h.done = c.Take<int32_t>(slots, nullptr);
  h.slot_rows = c.Take<kernels::SlotRow>(slots, nullptr);
  h.block_tables = c.Take<int32_t>(slots * s.max_blocks_per_seq, nullptr);
  h.prompt_mask = c.Take<uint32_t>(slots * s.mask_words(), nullptr);
  *total = c.offset();
  return h;
}

// A carve's byte count (a dry run at no base) and its layout at `base`, for the carves whose
// running total nobody else reads.
template <typename Layout, typename Shape>
size_t BytesOf(Layout (*carve)(const Shape&, void*, size_t*), const Shape& shape) {
  size_t total = 0;
  carve(shape, nullptr, &total);
  return total;
}
template <typename Layout, typename Shape>
Layout CarveAt(Layout (*carve)(const Shape&, void*, size_t*), const Shape& shape, void* base) {
  size_t total = 0;
  return carve(shape, base, &total);
}

std::string Bytes(size_t b) {
  const double mib = static_cast<double>(b) / (1 << 20);
  if (mib >= 1024) return absl::StrFormat("%.2f GiB", mib / 1024);
  return absl::StrFormat("%.1f MiB", mib);
}

}  // namespace

absl::StatusOr<ModelDims> MakeModelDims(const ModelConfig& c) {
  auto invalid = [](const char* field, int v, const char* why) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.", field, " = ", v, ": ", why, " for the CUDA backend"));
  };
  if (c.hidden_size <= 0 || c.hidden_size % 8 != 0) {
    return invalid("hidden_size", c.hidden_size, "must be a positive multiple of 8");
  }
  if (c.num_layers <= 0) return invalid("num_hidden_layers", c.num_layers, "must be positive");
  if (c.num_heads <= 0) return invalid("num_attention_heads", c.num_heads, "must be positive");
  if (c.num_kv_heads <= 0 || c.num_heads % c.num_kv_heads != 0) {
    return invalid("num_key_value_heads", c.num_kv_heads, "must divide num_attention_heads");
  }
  if (c.head_dim <= 0 || c.head_dim % 8 != 0) {
    return invalid("head_dim", c.head_dim, "must be a positive multiple of 8");
  }
  if (c.intermediate_size <= 0) {
    return invalid("intermediate_size", c.intermediate_size, "must be positive");
  }
  if (c.vocab_size <= 0 || c.vocab_size > kernels::kSamplingMaxVocab) {
    return invalid("vocab_size", c.vocab_size, "must be in [1, 2^24]");
  }
  ModelDims d;
  d.hidden = c.hidden_size;
  d.intermediate = c.intermediate_size;
  d.intermediate_padded = RoundUp8(c.intermediate_size);
  d.num_layers = c.num_layers;
  d.num_heads = c.num_heads;
  d.num_kv_heads = c.num_kv_heads;
  d.head_dim = c.head_dim;
  d.vocab = c.vocab_size;
  d.tied = c.tie_word_embeddings;
  return d;
}

size_t ArenaBytes(const ArenaShape& shape) {
  Categories cats;
  size_t total = 0;
  Carve(shape, nullptr, &cats, &total);
  return total;
}

size_t HostBytes(const ArenaShape& shape) {
  return BytesOf(CarveHostImpl, shape);
}

DeviceLayout CarveArena(const ArenaShape& shape, void* base) {
  Categories cats;
  size_t total = 0;
  return Carve(shape, base, &cats, &total);
}

HostLayout CarveHost(const ArenaShape& shape, void* host) {
  return CarveAt(CarveHostImpl, shape, host);
}

size_t SlotDeviceBytes(const SlotShape& shape) {
  return BytesOf(CarveSlotDeviceImpl, shape);
}

size_t SlotHostBytes(const SlotShape& shape) {
  return BytesOf(CarveSlotHostImpl, shape);
}

SlotDeviceLayout CarveSlotDevice(const SlotShape& shape, void* base) {
  return CarveAt(CarveSlotDeviceImpl, shape, base);
}

SlotHostLayout CarveSlotHost(const SlotShape& shape, void* host) {
  return CarveAt(CarveSlotHostImpl, shape, host);
}

std::vector<int32_t> PrefillGemmRows(int32_t chunk) {
  std::vector<int32_t> sizes;
  for (int32_t m = 16; m < chunk;) {
    sizes.push_back(m);
    m = m < 64 ? 2 * m : m < 512 ? m + 64 : m + 256;
  }
  sizes.push_back(chunk);
  return sizes;
}

absl::StatusOr<ModelStage> ResolveStage(const ModelStage& stage, int32_t model_layers) {
  ModelStage s = stage;
  if (s.first_layer < 0 || s.first_layer >= model_layers) {
    return absl::InvalidArgumentError(absl::StrCat("stage.first_layer: ", s.first_layer,
                                                   " is not one of the model's ", model_layers,
                                                   " layers"));
  }
  if (s.num_layers == -1) s.num_layers = model_layers - s.first_layer;
  if (s.num_layers < 1 || s.num_layers > model_layers - s.first_layer) {
    return absl::InvalidArgumentError(
        absl::StrCat("stage.num_layers: ", s.num_layers, " layers from layer ", s.first_layer,
                     " must be in [1, ", model_layers - s.first_layer, "]"));
  }
  return s;
}

absl::StatusOr<MemoryPlan> PlanMemory(const MemoryPlanOptions& o) {
  TS_ASSIGN_OR_RETURN(ModelDims dims, MakeModelDims(o.model));
  TS_ASSIGN_OR_RETURN(const ModelStage stage, ResolveStage(o.stage, dims.num_layers));
  if (o.max_slots < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_slots: must be >= 1, got ", o.max_slots));
  }
  if (o.buckets.empty() || o.buckets.back() < o.max_slots) {
    return absl::InvalidArgumentError("buckets: the largest bucket must be >= max_slots");
  }
  if (o.kv_block_size < 1 || (o.kv_block_size & (o.kv_block_size - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_block_size: must be a power of two, got ", o.kv_block_size));
  }
  if (o.max_context < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_context: must be >= 2, got ", o.max_context));
  }
  if (o.prefill_chunk_tokens < 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_chunk_tokens: must be >= 16, got ", o.prefill_chunk_tokens));
  }
  if (o.ring_capacity < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring_capacity: must be >= 2, got ", o.ring_capacity));
  }
  if (!(o.gpu_memory_fraction > 0.0 && o.gpu_memory_fraction <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu_memory_fraction: must be in (0, 1], got ", o.gpu_memory_fraction));
  }

  MemoryPlan plan;
  ArenaShape& s = plan.shape;
  s.dims = dims;
  s.stage = stage;
  s.max_slots = o.max_slots;
  s.max_bucket = o.buckets.back();
  s.prefill_rows = o.prefill_chunk_tokens;
  s.max_blocks_per_seq = (o.max_context + o.kv_block_size - 1) / o.kv_block_size;
  s.kv_block_size = o.kv_block_size;
  s.ring_capacity = o.ring_capacity;
  s.attention_workspace_bytes = o.attention_workspace_bytes;
  s.logits_workspace_bytes = o.gemm_workspace_bytes;

  // Everything but KV first (num_kv_blocks = 0), then the KV pool takes what the budget leaves.
  s.num_kv_blocks = 0;
  Categories cats;
  size_t fixed_arena = 0;
  Carve(s, nullptr, &cats, &fixed_arena);
  plan.gemm_workspace_bytes = 2 * o.gemm_workspace_bytes;
  plan.graph_reserve_bytes = o.graph_reserve_bytes;
  plan.budget_bytes = static_cast<size_t>(
      std::floor(o.gpu_memory_fraction * static_cast<double>(o.total_device_bytes)));
  if (stage.has_head) {
    plan.state_bytes = SlotDeviceBytes(s.slot_shape());
    plan.slot_host_bytes = SlotHostBytes(s.slot_shape());
  }
  const size_t fixed =
      fixed_arena + plan.state_bytes + plan.gemm_workspace_bytes + plan.graph_reserve_bytes;
  const size_t block_bytes = static_cast<size_t>(stage.num_layers) * 2 * dims.num_kv_heads *
                             o.kv_block_size * dims.head_dim * sizeof(__nv_bfloat16);
  // Per-layer pools are each 256-byte aligned: at most 2 * layers * 256 bytes of padding.
  const size_t slack = static_cast<size_t>(stage.num_layers) * 2 * kAlign;
  const size_t left = plan.budget_bytes > fixed + slack ? plan.budget_bytes - fixed - slack : 0;
  plan.kv_blocks_in_budget = static_cast<int64_t>(left / block_bytes);
  if (plan.kv_blocks_in_budget < s.max_blocks_per_seq) {
    return absl::FailedPreconditionError(
        absl::StrCat("KV pool: gpu_memory_fraction ", o.gpu_memory_fraction, " of ",
                     Bytes(o.total_device_bytes), " = ", Bytes(plan.budget_bytes),
                     "; weights, activations, state, workspaces and graphs take ", Bytes(fixed),
                     ", leaving ", plan.kv_blocks_in_budget, " KV blocks of ", o.kv_block_size,
                     " tokens, but one max_context sequence of ", o.max_context, " tokens needs ",
                     s.max_blocks_per_seq, " blocks (", Bytes(block_bytes * s.max_blocks_per_seq),
                     "). Raise gpu_memory_fraction or lower max_context, max_slots, buckets or "
                     "prefill_chunk_tokens."));
  }
  // v1 never evicts or shares blocks: more than max_slots full-length sequences is never used.
  const int64_t useful = static_cast<int64_t>(s.max_blocks_per_seq) * s.max_slots;
  const int64_t blocks = std::min<int64_t>({plan.kv_blocks_in_budget, useful, INT32_MAX});
  s.num_kv_blocks = static_cast<int32_t>(blocks);

  Categories final_cats;
  size_t arena = 0;
  Carve(s, nullptr, &final_cats, &arena);
  plan.weight_bytes = final_cats.weights;
  plan.kv_bytes = final_cats.kv;
  plan.activation_bytes = final_cats.activations;
  plan.attention_workspace_bytes = final_cats.attention;
  plan.logits_workspace_bytes = final_cats.logits_workspace;
  plan.arena_bytes = arena;
  plan.host_bytes = HostBytes(s);
  return plan;
}

std::string MemoryPlan::Summary() const {
  const ModelDims& d = shape.dims;
  const size_t device_total =
      arena_bytes + state_bytes + gemm_workspace_bytes + graph_reserve_bytes;
  std::string out = absl::StrCat("memory plan (budget ", Bytes(budget_bytes), "):\n");
  const ModelStage& st = shape.stage;
  const std::string layers =
      st.num_layers == d.num_layers
          ? absl::StrCat(d.num_layers, " layers")
          : absl::StrCat("layers ", st.first_layer, "-", st.first_layer + st.num_layers - 1, " of ",
                         d.num_layers);
  absl::StrAppend(
      &out, "  weights      ", Bytes(weight_bytes), " (bf16, ", layers,
      st.has_embedding ? ", embedding" : "",
      st.has_head ? (d.separate_lm_head() ? ", separate lm_head" : ", tied lm_head") : "",
      ", vocab ", d.vocab, ")\n");
  absl::StrAppend(&out, "  kv pool      ", Bytes(kv_bytes), " = ", shape.num_kv_blocks,
                  " blocks x ", shape.kv_block_size, " tokens = ", kv_tokens(), " tokens (",
                  kv_blocks_in_budget, " blocks fit the budget; ", shape.max_blocks_per_seq,
                  " per max-length sequence)\n");
  absl::StrAppend(&out, "  activations  ", Bytes(activation_bytes), " (decode rows ",
                  shape.max_bucket, ", prefill rows ", shape.prefill_rows, ")\n");
  if (st.has_head) {
    absl::StrAppend(&out, "  state        ", Bytes(state_bytes), " (slot table, block tables, ",
                    "uint32 sampling counts and prompt masks for ", shape.max_slots,
                    " slots; apart from the arena)\n");
  } else {
    absl::StrAppend(&out, "  state        none (the stage with the head holds the slot table)\n");
  }
  absl::StrAppend(&out, "  workspace    ",
                  Bytes(gemm_workspace_bytes + logits_workspace_bytes + attention_workspace_bytes),
                  " (cuBLASLt ", Bytes(gemm_workspace_bytes + logits_workspace_bytes),
                  ", attention ", Bytes(attention_workspace_bytes), ")\n");
  absl::StrAppend(&out, "  graphs       ", Bytes(graph_reserve_bytes), " reserved\n");
  absl::StrAppend(&out, "  device total ", Bytes(device_total), "; pinned host ",
                  Bytes(host_bytes + slot_host_bytes));
  if (st.has_head) {
    absl::StrAppend(&out, " (rings ", shape.max_slots, " x ", shape.ring_capacity, ")");
  }
  absl::StrAppend(&out, "\n");
  return out;
}

}  // namespace ts
