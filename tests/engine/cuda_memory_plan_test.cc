// The CUDA backend's memory plan, on the host only (no GPU needed): byte counts from the model
// shape computed independently here, the KV pool from the budget, the refusal when one
// max-length sequence does not fit, the padding of GEMM dimensions, and a carve whose buffers are
// aligned, disjoint and inside the arena (and the slot table's blocks). Also CudaModel's and
// DeviceSlots' option checks, which run before they touch a GPU.
#include "engine/cuda/memory_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_model.h"
#include "engine/cuda/device_slots.h"
#include "models/llama_shapes.h"

namespace ts {
namespace {

constexpr size_t kGiB = size_t{1} << 30;

MemoryPlanOptions Options(const ModelConfig& c) {
  MemoryPlanOptions o;
  o.model = c;
  o.max_slots = 64;
  o.buckets = {1, 8, 64};
  o.kv_block_size = 16;
  o.max_context = 8192;
  o.prefill_chunk_tokens = 2048;
  o.ring_capacity = 1024;
  o.gpu_memory_fraction = 0.9;
  o.total_device_bytes = 80 * kGiB;
  o.gemm_workspace_bytes = 32 << 20;
  o.attention_workspace_bytes = 10 << 20;
  o.graph_reserve_bytes = 256 << 20;
  return o;
}

TEST(CudaModelOptionsTest, RejectsBadDecodeOptionsBeforeTouchingTheGpu) {
  CudaModelOptions o;
  o.config = Llama1bShape();
  o.max_slots = 8;
  o.buckets = {1, 8};
  o.attention_min_split_tokens = 0;
  absl::StatusOr<std::unique_ptr<CudaModel>> m = CudaModel::Create(o);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("attention_min_split_tokens"), std::string::npos);
  // The head samples into the slot table, so a model with it must be given one; a stage without
  // it must not.
  o.attention_min_split_tokens = 64;
  m = CudaModel::Create(o);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("slots: a model that holds the head"), std::string::npos)
      << m.status();
}

// A slot table with no slots, blocks or vocabulary, or a ring that cannot hold a record and its
// successor, is refused before anything is allocated.
TEST(DeviceSlotsTest, RefusesAnEmptyShapeBeforeTouchingTheGpu) {
  const SlotShape good{.max_slots = 4, .max_blocks_per_seq = 8, .vocab = 1000, .ring_capacity = 16};
  std::vector<SlotShape> bad(4, good);
  bad[0].max_slots = 0;
  bad[1].max_blocks_per_seq = 0;
  bad[2].vocab = 0;
  bad[3].ring_capacity = 1;
  for (const SlotShape& shape : bad) {
    auto s = DeviceSlots::Create(shape);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
    EXPECT_NE(s.status().message().find("DeviceSlots"), std::string::npos) << s.status();
  }
}

// The slot table's shape as a model resolves its options: max_context 0 is the config's
// max_position_embeddings, and the block tables cover it in whole blocks.
TEST(CudaModelOptionsTest, SlotShapeForResolvesTheContext) {
  CudaModelOptions o;
  o.config = Llama1bShape();
  o.max_slots = 8;
  o.kv_block_size = 16;
  o.ring_capacity = 300;
  o.max_context = 1000;
  SlotShape s = CudaModel::SlotShapeFor(o);
  EXPECT_EQ(s.max_slots, 8);
  EXPECT_EQ(s.max_blocks_per_seq, 63);
  EXPECT_EQ(s.vocab, 128256);
  EXPECT_EQ(s.ring_capacity, 300u);
  o.max_context = 0;
  s = CudaModel::SlotShapeFor(o);
  EXPECT_EQ(s.max_blocks_per_seq, (o.config.max_position_embeddings + 15) / 16);
  // What the memory plan of those options sizes: the same shape.
  MemoryPlanOptions p = Options(o.config);
  p.max_slots = 8;
  p.buckets = {1, 8};
  p.max_context = 1000;
  p.ring_capacity = 300;
  auto plan = PlanMemory(p);
  ASSERT_TRUE(plan.ok()) << plan.status();
  o.max_context = 1000;
  EXPECT_TRUE(plan->shape.slot_shape() == CudaModel::SlotShapeFor(o));
}

// The planned prefill GEMM rows: ascending, ending at the chunk, and no row count pads by more
// than 63 rows (a mixed step of 256 rows is planned exactly; 16 sizes for a 2048-row chunk).
TEST(CudaMemoryPlanTest, PrefillGemmRowsPadLittleAndEndAtTheChunk) {
  for (int32_t chunk : {16, 64, 100, 256, 2048, 3000}) {
    const std::vector<int32_t> sizes = PrefillGemmRows(chunk);
    ASSERT_FALSE(sizes.empty());
    EXPECT_EQ(sizes.back(), chunk);
    EXPECT_TRUE(std::is_sorted(sizes.begin(), sizes.end()));
    EXPECT_EQ(std::adjacent_find(sizes.begin(), sizes.end()), sizes.end()) << "a size twice";
    for (int32_t rows = 1; rows <= chunk; ++rows) {
      const int32_t padded = *std::lower_bound(sizes.begin(), sizes.end(), rows);
      EXPECT_GE(padded, rows);
      if (rows > 16 && rows <= 512) {
        EXPECT_LT(padded - rows, 64) << rows << " of " << chunk;
      }
      if (rows > 512) {
        EXPECT_LT(padded - rows, 256) << rows << " of " << chunk;
      }
    }
  }
  EXPECT_EQ(PrefillGemmRows(2048).size(), 16u);
  const std::vector<int32_t> s = PrefillGemmRows(2048);
  EXPECT_NE(std::find(s.begin(), s.end(), 256), s.end());
  EXPECT_NE(std::find(s.begin(), s.end(), 192), s.end());
}

TEST(CudaMemoryPlanTest, WeightsAndKvFollowTheShape) {
  const ModelConfig c = Llama1bShape();
  auto plan = PlanMemory(Options(c));
  ASSERT_TRUE(plan.ok()) << plan.status();
  // Parameters of Llama-3.2-1B (tied): 1,235,814,400.
  const int64_t h = 2048, layer = 2 * h + (32 + 16) * 64 * h + h * 32 * 64 + 3 * h * 8192;
  const int64_t params = 128256 * h + h + 16 * layer;
  EXPECT_EQ(params, 1235814400);
  // Each buffer is padded to 256 bytes at most (vectors of `hidden` are already multiples).
  EXPECT_GE(plan->weight_bytes, static_cast<size_t>(2 * params));
  EXPECT_LT(plan->weight_bytes, static_cast<size_t>(2 * params) + 256 * (3 + 6 * 16));
  EXPECT_EQ(plan->shape.dims.separate_lm_head(), false);  // tied: lm_head is the embedding
  // KV: 16 layers x (K + V) x 8 heads x 64 x bf16 = 32 KiB per token.
  const size_t per_token = 16 * 2 * 8 * 64 * 2;
  EXPECT_EQ(plan->kv_bytes, static_cast<size_t>(plan->kv_tokens()) * per_token);
  EXPECT_EQ(plan->shape.max_blocks_per_seq, 8192 / 16);
  // 64 slots x 8192 tokens = 16 GiB of KV fits 72 GiB: the pool is capped at what v1 can use.
  EXPECT_EQ(plan->shape.num_kv_blocks, 64 * 512);
  EXPECT_GT(plan->kv_blocks_in_budget, plan->shape.num_kv_blocks);
  // The whole device footprint stays inside the budget.
  EXPECT_LE(plan->arena_bytes + plan->state_bytes + plan->gemm_workspace_bytes +
                plan->graph_reserve_bytes,
            plan->budget_bytes);
  EXPECT_EQ(plan->arena_bytes, ArenaBytes(plan->shape));
  EXPECT_FALSE(plan->Summary().empty());
}

// The state category, byte for byte: the slot table, the block tables, and per slot (plus the
// padding rows' scratch slot) a 4-byte count per token and a prompt bit per token. Counts were
// uint16 once and saturated at 65535, so long generations' penalties diverged from the CPU's. The
// slot table is its own block (DeviceSlots), outside the arena, and counts in the budget.
TEST(CudaMemoryPlanTest, StateHoldsUint32CountsPerSlot) {
  const ModelConfig c = Llama1bShape();
  auto plan = PlanMemory(Options(c));
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto padded = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  const size_t slots = 64, count_rows = slots + 1, vocab = 128256;
  const size_t slot_table = padded(slots * sizeof(kernels::SlotRow));
  const size_t block_tables = padded(slots * (8192 / 16) * 4);
  const size_t counts = padded(count_rows * vocab * 4);
  const size_t masks = padded(count_rows * ((vocab + 31) / 32) * 4);
  EXPECT_EQ(plan->state_bytes, slot_table + block_tables + counts + masks)
      << "counts alone should take " << counts << " bytes";
  EXPECT_EQ(SlotDeviceBytes(plan->shape.slot_shape()), plan->state_bytes);
  // The counts are the bulk of it: 65 x 128256 x 4 = 33.3 MB.
  EXPECT_EQ(counts, 33346560u);
  char* base = reinterpret_cast<char*>(uintptr_t{1} << 40);
  const SlotDeviceLayout l = CarveSlotDevice(plan->shape.slot_shape(), base);
  EXPECT_EQ(reinterpret_cast<char*>(l.slots), base);
  EXPECT_EQ(
      reinterpret_cast<const char*>(l.prompt_mask) - reinterpret_cast<const char*>(l.output_counts),
      static_cast<std::ptrdiff_t>(counts));
  EXPECT_EQ(reinterpret_cast<const char*>(l.prompt_mask) + masks, base + plan->state_bytes);
  // Outside the arena, inside the budget.
  EXPECT_EQ(plan->arena_bytes, ArenaBytes(plan->shape));
  EXPECT_LE(plan->arena_bytes + plan->state_bytes + plan->gemm_workspace_bytes +
                plan->graph_reserve_bytes,
            plan->budget_bytes);
}

// A stage without the head holds no slot table (the last stage's is the pipeline's only one),
// and its KV pool gets those bytes: 33 MB of sampling counts for a 128K vocabulary.
TEST(CudaMemoryPlanTest, OnlyTheStageWithTheHeadHoldsTheSlotTable) {
  ModelConfig c = Llama1bShape();
  MemoryPlanOptions o = Options(c);
  o.max_context = 131072;  // the budget sizes the pool
  o.stage = {.first_layer = 0, .num_layers = 8, .has_embedding = true, .has_head = false};
  auto first = PlanMemory(o);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->state_bytes, 0u);
  EXPECT_EQ(first->slot_host_bytes, 0u);
  EXPECT_NE(first->Summary().find("state        none"), std::string::npos) << first->Summary();
  o.stage = {.first_layer = 8, .num_layers = -1, .has_embedding = false, .has_head = true};
  auto last = PlanMemory(o);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->state_bytes, SlotDeviceBytes(last->shape.slot_shape()));
  EXPECT_EQ(last->slot_host_bytes, SlotHostBytes(last->shape.slot_shape()));
  EXPECT_GT(last->state_bytes, size_t{33} << 20);
}

TEST(CudaMemoryPlanTest, KvPoolTakesWhatTheBudgetLeaves) {
  MemoryPlanOptions o = Options(Llama1bShape());
  o.max_context = 131072;  // 64 full-length sequences would need 256 GiB
  auto plan = PlanMemory(o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->shape.num_kv_blocks, plan->kv_blocks_in_budget);
  const size_t used = plan->arena_bytes + plan->state_bytes + plan->gemm_workspace_bytes +
                      plan->graph_reserve_bytes;
  EXPECT_LE(used, plan->budget_bytes);
  // Less than one more block would fit.
  const size_t block = 16 * 2 * 8 * 64 * 2 * 16;
  EXPECT_LT(plan->budget_bytes - used, block + 16 * 2 * 256);
}

TEST(CudaMemoryPlanTest, RefusesWhenOneSequenceDoesNotFit) {
  MemoryPlanOptions o = Options(Llama1bShape());
  o.total_device_bytes = 4 * kGiB;  // 2.5 GiB of weights leave ~1 GiB: 32K tokens at most
  o.max_context = 131072;
  auto plan = PlanMemory(o);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(plan.status().message().find("131072 tokens"), std::string::npos) << plan.status();
  EXPECT_NE(plan.status().message().find("gpu_memory_fraction"), std::string::npos);
  // The same device holds a shorter context.
  o.max_context = 8192;
  EXPECT_TRUE(PlanMemory(o).ok());
  // And a budget smaller than the weights is refused the same way, not underflowed.
  o.gpu_memory_fraction = 0.1;
  EXPECT_EQ(PlanMemory(o).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(CudaMemoryPlanTest, PadsGemmDimensionsAndChecksTheConfig) {
  ModelConfig c = Llama1bShape();
  c.intermediate_size = 172;
  c.vocab_size = 311;
  auto d = MakeModelDims(c);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->intermediate_padded, 176);
  EXPECT_EQ(d->vocab, 311);  // the fp32 lm_head GEMM takes any vocab: no padding
  EXPECT_FALSE(d->separate_lm_head());
  c.tie_word_embeddings = false;
  EXPECT_TRUE(MakeModelDims(c)->separate_lm_head());
  c.hidden_size = 100;
  EXPECT_EQ(MakeModelDims(c).status().code(), absl::StatusCode::kInvalidArgument);
  c.hidden_size = 2048;
  c.num_kv_heads = 5;
  EXPECT_EQ(MakeModelDims(c).status().code(), absl::StatusCode::kInvalidArgument);
}

// A pipeline stage holds its layers' weights and KV only, the embedding only on the first stage
// (and, tied, on the last, whose lm_head it is), the head only on the last: two stages of an
// untied model together weigh the whole model, their KV per block halves, and the pool holds
// twice the blocks for the same budget.
TEST(CudaMemoryPlanTest, StagesHoldTheirLayersEmbeddingAndHeadOnly) {
  ModelConfig c = Llama1bShape();
  c.tie_word_embeddings = false;
  MemoryPlanOptions o = Options(c);
  o.max_context = 131072;  // the budget, not max_slots, sizes the pools
  auto whole = PlanMemory(o);
  ASSERT_TRUE(whole.ok()) << whole.status();
  o.stage = {.first_layer = 0, .num_layers = 6, .has_embedding = true, .has_head = false};
  auto first = PlanMemory(o);
  ASSERT_TRUE(first.ok()) << first.status();
  o.stage = {.first_layer = 6, .num_layers = -1, .has_embedding = false, .has_head = true};
  auto last = PlanMemory(o);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->shape.stage.num_layers, 10);  // -1: through the last layer
  // Byte for byte (every buffer here is a multiple of 256 bytes but the RoPE table, 32 floats
  // padded to 256, which both stages hold).
  const size_t h = 2048, inv_freq = 256, table = 128256 * h * 2, norm = h * 2;
  const size_t layer = 2 * (2 * h + 3072 * h + h * 2048 + 3 * h * 8192);
  EXPECT_EQ(whole->weight_bytes, 2 * table + norm + inv_freq + 16 * layer);
  EXPECT_EQ(first->weight_bytes, table + inv_freq + 6 * layer);
  EXPECT_EQ(last->weight_bytes, table + norm + inv_freq + 10 * layer);
  const DeviceLayout fl = CarveArena(first->shape, reinterpret_cast<char*>(uintptr_t{1} << 40));
  EXPECT_NE(fl.embed, nullptr);
  EXPECT_EQ(fl.lm_head, nullptr);
  EXPECT_EQ(fl.final_norm, nullptr);
  EXPECT_EQ(fl.layers.size(), 6u);
  const DeviceLayout ll = CarveArena(last->shape, reinterpret_cast<char*>(uintptr_t{1} << 40));
  EXPECT_EQ(ll.embed, nullptr);
  EXPECT_NE(ll.lm_head, nullptr);
  EXPECT_NE(ll.final_norm, nullptr);
  EXPECT_EQ(ll.layers.size(), 10u);
  // KV per token is the stage's layers': more blocks fit a budget of the same size.
  const size_t per_token_layer = 2 * 8 * 64 * 2;
  EXPECT_EQ(first->kv_bytes, static_cast<size_t>(first->kv_tokens()) * 6 * per_token_layer);
  EXPECT_EQ(last->kv_bytes, static_cast<size_t>(last->kv_tokens()) * 10 * per_token_layer);
  EXPECT_GT(first->shape.num_kv_blocks, 2 * whole->shape.num_kv_blocks);
  EXPECT_NE(first->Summary().find("layers 0-5 of 16, embedding, vocab"), std::string::npos)
      << first->Summary();
  EXPECT_NE(last->Summary().find("layers 6-15 of 16, separate lm_head"), std::string::npos)
      << last->Summary();

  // Tied: the last stage holds the matrix as its lm_head, the first as its embedding.
  c.tie_word_embeddings = true;
  o = Options(c);
  o.stage = {.first_layer = 15, .num_layers = 1, .has_embedding = false, .has_head = true};
  auto tied_last = PlanMemory(o);
  ASSERT_TRUE(tied_last.ok()) << tied_last.status();
  const DeviceLayout tl = CarveArena(tied_last->shape, reinterpret_cast<char*>(uintptr_t{1} << 40));
  EXPECT_NE(tl.embed, nullptr);
  EXPECT_EQ(tl.lm_head, tl.embed);
  EXPECT_GE(tied_last->weight_bytes, table);
}

TEST(CudaMemoryPlanTest, RefusesAStageOutsideTheModel) {
  MemoryPlanOptions o = Options(Llama1bShape());  // 16 layers
  for (const auto& [stage, field] : std::vector<std::pair<ModelStage, std::string>>{
           {{.first_layer = 16}, "stage.first_layer"},
           {{.first_layer = -1}, "stage.first_layer"},
           {{.first_layer = 4, .num_layers = 0}, "stage.num_layers"},
           {{.first_layer = 4, .num_layers = 13}, "stage.num_layers"},
           {{.first_layer = 0, .num_layers = -2}, "stage.num_layers"}}) {
    o.stage = stage;
    auto plan = PlanMemory(o);
    ASSERT_FALSE(plan.ok()) << field;
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(plan.status().message().find(field), std::string::npos) << plan.status();
  }
}

TEST(CudaMemoryPlanTest, CarvedBuffersAreAlignedDisjointAndInside) {
  ModelConfig c = Llama1bShape();
  c.num_layers = 2;
  c.vocab_size = 1001;
  c.tie_word_embeddings = false;
  auto plan = PlanMemory(Options(c));
  ASSERT_TRUE(plan.ok()) << plan.status();
  // A fake base: the carve only computes addresses.
  char* base = reinterpret_cast<char*>(uintptr_t{1} << 40);
  const DeviceLayout l = CarveArena(plan->shape, base);
  const ModelDims& d = plan->shape.dims;
  const size_t bf = 2;
  std::vector<std::pair<const void*, size_t>> spans = {
      {l.embed, size_t(d.vocab) * d.hidden * bf},
      {l.lm_head, size_t(d.vocab) * d.hidden * bf},
      {l.decode.h, size_t(plan->shape.max_bucket) * d.hidden * bf},
      {l.prefill.gate_up, size_t(plan->shape.prefill_rows) * 2 * d.intermediate_padded * bf},
      {l.decode_head.logits_f32, size_t(plan->shape.max_bucket) * d.vocab * 4},
      {l.attention_workspace, plan->attention_workspace_bytes},
      {l.decode_logits_workspace, plan->shape.logits_workspace_bytes},
      {l.prefill_logits_workspace, plan->shape.logits_workspace_bytes}};
  for (const LayerBuffers& layer : l.layers) {
    spans.push_back({layer.qkv, size_t(d.qkv_dim()) * d.hidden * bf});
    spans.push_back({layer.k_cache, plan->kv_bytes / (2 * d.num_layers)});
    spans.push_back({layer.v_cache, plan->kv_bytes / (2 * d.num_layers)});
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 0; i < spans.size(); ++i) {
    const char* p = static_cast<const char*>(spans[i].first);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 256, 0u) << i;
    EXPECT_GE(p, base);
    EXPECT_LE(p + spans[i].second, base + plan->arena_bytes) << i;
    if (i + 1 < spans.size()) {
      EXPECT_LE(p + spans[i].second, static_cast<const char*>(spans[i + 1].first)) << i;
    }
  }
  // Host block: flags first, then staging, all inside HostBytes.
  char* host = reinterpret_cast<char*>(uintptr_t{1} << 41);
  const HostLayout h = CarveHost(plan->shape, host);
  EXPECT_EQ(reinterpret_cast<char*>(h.error_flag), host);
  EXPECT_LE(reinterpret_cast<char*>(h.head_row_slots + plan->shape.max_bucket),
            host + plan->host_bytes);
  // The slot table's blocks: rings first in the host one, each buffer inside its block.
  const SlotShape ss = plan->shape.slot_shape();
  const SlotHostLayout sh = CarveSlotHost(ss, host);
  EXPECT_EQ(reinterpret_cast<char*>(sh.rings), host);
  EXPECT_LE(reinterpret_cast<char*>(sh.rings + size_t(64) * ss.ring_capacity),
            reinterpret_cast<char*>(sh.cancel));
  EXPECT_LE(reinterpret_cast<char*>(sh.prompt_mask + size_t(64) * ss.mask_words()),
            host + plan->slot_host_bytes);
  const SlotDeviceLayout sd = CarveSlotDevice(ss, base);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(sd.output_counts) % 256, 0u);
  EXPECT_LE(reinterpret_cast<char*>(sd.prompt_mask + size_t(ss.count_rows()) * ss.mask_words()),
            base + plan->state_bytes);
}

// A pipeline's stages must tile the model's layers in order, with the embedding first and the
// head last (CudaBackend checks this before it touches a GPU).
TEST(CudaPipelineOptionsTest, StagesMustTileTheLayersWithTheEndsInPlace) {
  auto stage = [](int32_t first, int32_t n, bool emb, bool head, int device = 0) {
    return CudaStageOptions{
        .stage = {.first_layer = first, .num_layers = n, .has_embedding = emb, .has_head = head},
        .device = device};
  };
  const std::vector<CudaStageOptions> good = {stage(0, 3, true, false), stage(3, 2, false, false),
                                              stage(5, -1, false, true, 1)};
  EXPECT_TRUE(ValidateStages(good, 8).ok());
  EXPECT_TRUE(ValidateStages({}, 8).ok());  // the whole model
  struct Bad {
    std::vector<CudaStageOptions> stages;
    const char* names;
  };
  const std::vector<Bad> bad = {
      {{stage(1, 3, true, false), stage(4, -1, false, true)}, "stages[0]: starts at layer 1"},
      {{stage(0, 3, true, false), stage(4, -1, false, true)}, "stages[1]: starts at layer 4"},
      {{stage(0, 0, true, false), stage(0, -1, false, true)}, "stages[0]: layers [0, 0)"},
      {{stage(0, 3, true, false), stage(3, 6, false, true)}, "stages[1]: layers [3, 9)"},
      {{stage(0, 3, true, false), stage(3, 4, false, true)}, "they end at layer 7"},
      {{stage(0, 3, false, false), stage(3, -1, false, true)}, "stages[0]: the embedding"},
      {{stage(0, 3, true, false), stage(3, -1, true, true)}, "stages[1]: the embedding"},
      {{stage(0, 3, true, true), stage(3, -1, false, true)}, "stages[0]: the head"},
      {{stage(0, 3, true, false), stage(3, -1, false, false)}, "stages[1]: the head"},
      {{stage(0, 3, true, false), stage(3, -1, false, true, -1)}, "stages[1]: device -1"},
  };
  for (const Bad& b : bad) {
    const absl::Status st = ValidateStages(b.stages, 8);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << b.names;
    EXPECT_NE(st.message().find(b.names), std::string::npos) << st;
  }
  // The device loop stays within one GPU; refused before any GPU work.
  CudaBackendOptions o;
  o.stages = good;
  o.device_loop = true;
  o.max_slots = 4;
  o.buckets = {1, 4};
  const auto made = CudaBackend::CreateRandom(o, RandomWeightsSpec{.config = Llama3Shape(false)});
  ASSERT_FALSE(made.ok());
  EXPECT_NE(made.status().message().find("stages: a pipeline is host-driven"), std::string::npos)
      << made.status();
}

// The server's and the benchmark's plan: PlanStages' split, stage s on devices[s], which the
// backend accepts.
TEST(CudaPipelineOptionsTest, PlannedStagesFollowTheSplitOntoTheirDevices) {
  const ModelConfig c = Llama3Shape(true);
  std::string description;
  const std::vector<int> devices = {3, 1};
  auto stages = PlanCudaStages(c, devices, 16, &description);
  ASSERT_TRUE(stages.ok()) << stages.status();
  ASSERT_EQ(stages->size(), 2u);
  EXPECT_EQ((*stages)[0].stage.first_layer, 0);
  EXPECT_EQ((*stages)[0].stage.num_layers, 16);
  EXPECT_TRUE((*stages)[0].stage.has_embedding);
  EXPECT_FALSE((*stages)[0].stage.has_head);
  EXPECT_EQ((*stages)[0].device, 3);
  EXPECT_EQ((*stages)[1].stage.first_layer, 16);
  EXPECT_TRUE((*stages)[1].stage.has_head);
  EXPECT_EQ((*stages)[1].device, 1);
  EXPECT_TRUE(ValidateStages(*stages, c.num_layers).ok());
  EXPECT_NE(description.find("layers 16-31"), std::string::npos) << description;
  const std::vector<int> too_many(c.num_layers + 1, 0);
  const auto refused = PlanCudaStages(c, too_many, 16, nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("pipeline_stages"), std::string::npos);
}

// The chunks a pipeline runs through its stages one after another are EnqueuePrefill's: prompts
// packed in order, no chunk over the limit, each prompt's last piece naming its head row.
TEST(CudaPipelineOptionsTest, PrefillChunksPackPromptsInOrderUpToTheLimit) {
  const std::vector<int32_t> a(10, 1), b(3, 2), c(25, 3);
  const std::vector<int32_t> table = {0};
  const std::vector<PrefillSeq> seqs = {{a, table}, {b, table}, {c, table}};
  const auto chunks = ChunkPrefill(seqs, 8);
  // 38 rows in chunks of 8: 5 chunks, the last of 6.
  ASSERT_EQ(chunks.size(), 5u);
  std::vector<int32_t> next(3, 0);
  std::vector<int32_t> heads;
  for (size_t k = 0; k < chunks.size(); ++k) {
    int32_t rows = 0;
    for (const PrefillPiece& p : chunks[k]) {
      const int32_t seq = p.tokens.data() == a.data() ? 0 : p.tokens.data() == b.data() ? 1 : 2;
      EXPECT_EQ(p.start, next[seq]) << "chunk " << k;
      next[seq] += p.len;
      rows += p.len;
      if (p.head_row >= 0) {
        EXPECT_EQ(p.head_row, seq);
        EXPECT_EQ(next[seq], static_cast<int32_t>(seqs[seq].tokens.size()));
        heads.push_back(p.head_row);
      }
    }
    EXPECT_EQ(rows, k + 1 < chunks.size() ? 8 : 6) << "chunk " << k;
  }
  EXPECT_EQ(heads, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_TRUE(ChunkPrefill({}, 8).empty());
}

}  // namespace
}  // namespace ts
