// Pipeline stages of the CUDA model (docs/pipeline.md, CUDA stages). A model split into stages,
// each a CudaModel holding only its layers (the embedding on the first, the head on the last),
// chained by copying each stage's output hidden states into the next stage's input, must give the
// whole model's prompt logits bit for bit: the same kernels run on the same rows in the same
// order, only on other GPUs' worth of memory. Checked on the trained default model (each stage
// uploads only its own tensors from the checkpoint) and on random weights, tied and untied (a
// stage's random weights are the whole model's tensors it holds). Then decode: the last stage
// owns the slot table and prepares each step's row inputs, the other stages get copies, and the
// hidden states move stage to stage; every step's logits and sampled tokens (greedy, seeded,
// penalised) must equal the whole model's.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "engine/cuda/cuda_model.h"
#include "engine/cuda/sampling_row.h"
#include "kernels/kv_layout.cuh"
#include "kernels/postprocess.cuh"
#include "models/checkpoint.h"
#include "models/config.h"
#include "models/llama_shapes.h"
#include "tests/common/test_paths.h"
#include "tests/kernels/kernel_test_util.h"

namespace ts {
namespace {

constexpr int32_t kChunk = 256;  // every prompt here fits one prefill chunk

CudaModelOptions Options(const ModelConfig& c, const ModelStage& stage) {
  CudaModelOptions o;
  o.config = c;
  o.stage = stage;
  o.max_slots = 4;
  o.buckets = {1, 4};
  o.max_context = kChunk;
  o.prefill_chunk_tokens = kChunk;
  o.ring_capacity = 16;
  o.gpu_memory_fraction = 0.05;  // several models share the one GPU
  o.graph_reserve_bytes = 0;
  o.print_plan = false;
  return o;
}

// Contiguous stages over `layers`, the given sizes, the embedding first and the head last.
std::vector<ModelStage> Split(const std::vector<int32_t>& sizes) {
  std::vector<ModelStage> stages;
  int32_t first = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    stages.push_back({.first_layer = first,
                      .num_layers = sizes[i],
                      .has_embedding = i == 0,
                      .has_head = i + 1 == sizes.size()});
    first += sizes[i];
  }
  return stages;
}

class Models {
 public:
  Models(const ModelConfig& c, const std::vector<ModelStage>& stages,
         const std::function<absl::Status(CudaModel&, cudaStream_t)>& load) {
    EXPECT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    for (const ModelStage& st : stages) {
      CudaModelOptions o = Options(c, st);
      if (st.has_head) {  // the stage that samples holds the slot table
        auto slots = DeviceSlots::Create(CudaModel::SlotShapeFor(o));
        EXPECT_TRUE(slots.ok()) << slots.status();
        if (!slots.ok()) return;
        slots_ = std::move(*slots);
        o.slots = slots_.get();
      }
      auto m = CudaModel::Create(o);
      EXPECT_TRUE(m.ok()) << m.status();
      if (!m.ok()) return;
      const absl::Status s = load(**m, stream_);
      EXPECT_TRUE(s.ok()) << s;
      if (!s.ok()) return;
      models_.push_back(std::move(*m));
    }
  }
  ~Models() {
    models_.clear();
    cudaStreamDestroy(stream_);
  }
  bool ok() const { return !models_.empty(); }
  CudaModel& operator[](size_t i) { return *models_[i]; }
  size_t size() const { return models_.size(); }

  // Prompts into slots 0..n-1 (the last stage's slot table: block table, prompt mask, stop and
  // sampling rows), prefilled through every stage in turn, the first tokens sampled on the last.
  void Prefill(const std::vector<std::vector<int32_t>>& prompts,
               const std::vector<SamplingParams>& sampling) {
    CudaModel& last = *models_.back();
    const ArenaShape& sh = last.plan().shape;
    std::vector<PrefillSeq> seqs;
    std::vector<int32_t> slots;
    std::vector<kernels::SamplingRow> params;
    tables_.assign(prompts.size(), {});
    for (size_t i = 0; i < prompts.size(); ++i) {
      const int32_t blocks = sh.max_blocks_per_seq;  // each slot its own blocks
      for (int32_t b = 0; b < blocks; ++b) tables_[i].push_back(int32_t(i) * blocks + b);
      kernels::SlotRow row;
      row.state = kernels::kSlotActive;
      row.prompt_len = static_cast<int32_t>(prompts[i].size());
      row.max_new_tokens = 1 << 20;
      row.ignore_eos = 1;
      row.sampling = ToSamplingRow(sampling[i], 0);
      std::vector<uint32_t> mask(sh.mask_words(), 0u);
      for (int32_t t : prompts[i]) mask[t / 32] |= 1u << (t % 32);
      const SlotDeviceLayout& d = slots_->dev();
      EXPECT_EQ(cudaMemcpy(d.slots + i, &row, sizeof(row), cudaMemcpyHostToDevice), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(d.block_tables + i * blocks, tables_[i].data(), blocks * sizeof(int32_t),
                           cudaMemcpyHostToDevice),
                cudaSuccess);
      EXPECT_EQ(cudaMemcpy(d.prompt_mask + i * mask.size(), mask.data(),
                           mask.size() * sizeof(uint32_t), cudaMemcpyHostToDevice),
                cudaSuccess);
      seqs.push_back({prompts[i], tables_[i]});
      slots.push_back(static_cast<int32_t>(i));
      params.push_back(ToSamplingRow(sampling[i], prompts[i].size()));
    }
    for (size_t s = 0; s < models_.size(); ++s) {
      if (s > 0) CopyPrefillHidden(s - 1);
      const absl::Status st = models_[s]->EnqueuePrefill(seqs, stream_);
      EXPECT_TRUE(st.ok()) << "stage " << s << ": " << st;
    }
    const absl::Status st =
        last.EnqueuePrefillSample(FirstTokens{.slots = slots,
                                              .params = params,
                                              .from_state = kernels::kSlotActive,
                                              .to_state = kernels::kSlotActive},
                                  stream_);
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  }

  // One decode step over `bucket` rows, the row list `rows` (-1: padding): the whole model's
  // EnqueueDecodeStep, or the stages' pieces with the copies a transport makes. Returns the
  // sampled tokens and appends the rows' fp32 logits to *logits.
  std::vector<int32_t> Decode(const std::vector<int32_t>& rows, std::vector<float>* logits) {
    const int32_t bucket = static_cast<int32_t>(rows.size());
    CudaModel& last = *models_.back();
    EXPECT_EQ(cudaMemcpyAsync(last.dev().decode_head.row_slots, rows.data(),
                              rows.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream_),
              cudaSuccess);
    if (models_.size() == 1) {
      const absl::Status st = last.EnqueueDecodeStep(bucket, 1, stream_);
      EXPECT_TRUE(st.ok()) << st;
    } else {
      absl::Status st = last.EnqueueDecodePrepare(bucket, stream_);
      EXPECT_TRUE(st.ok()) << st;
      const std::vector<DeviceBytes> from = last.DecodeRowInputs(bucket);
      for (size_t s = 0; s + 1 < models_.size(); ++s) {
        const std::vector<DeviceBytes> to = models_[s]->DecodeRowInputs(bucket);
        for (size_t b = 0; b < from.size(); ++b) {
          EXPECT_EQ(to[b].bytes, from[b].bytes);
          EXPECT_EQ(cudaMemcpyAsync(to[b].ptr, from[b].ptr, from[b].bytes, cudaMemcpyDeviceToDevice,
                                    stream_),
                    cudaSuccess);
        }
      }
      for (size_t s = 0; s < models_.size(); ++s) {
        if (s > 0) {
          const DeviceBytes h_from = models_[s - 1]->DecodeHidden(bucket);
          EXPECT_EQ(cudaMemcpyAsync(models_[s]->DecodeHidden(bucket).ptr, h_from.ptr, h_from.bytes,
                                    cudaMemcpyDeviceToDevice, stream_),
                    cudaSuccess);
        }
        st = models_[s]->EnqueueStageDecode(bucket, 1, stream_);
        EXPECT_TRUE(st.ok()) << "stage " << s << ": " << st;
      }
    }
    std::vector<int32_t> tokens(rows.size());
    const HeadBuffers& head = last.dev().decode_head;
    EXPECT_EQ(cudaMemcpyAsync(tokens.data(), head.sampled, tokens.size() * sizeof(int32_t),
                              cudaMemcpyDeviceToHost, stream_),
              cudaSuccess);
    const size_t vocab = last.dims().vocab, before = logits->size();
    logits->resize(before + rows.size() * vocab);
    EXPECT_EQ(cudaMemcpyAsync(logits->data() + before, head.logits_f32,
                              rows.size() * vocab * sizeof(float), cudaMemcpyDeviceToHost, stream_),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    return tokens;
  }

  // The prompt through every stage in turn; the last one's teacher-forced logits.
  std::vector<float> Logits(const std::vector<int32_t>& tokens) {
    const std::vector<int32_t> table = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const PrefillSeq seq{tokens, table};
    for (size_t s = 0; s + 1 < models_.size(); ++s) {
      const absl::Status st =
          models_[s]->EnqueuePrefill(std::span<const PrefillSeq>(&seq, 1), stream_);
      EXPECT_TRUE(st.ok()) << "stage " << s << ": " << st;
      CopyPrefillHidden(s);
    }
    auto logits = models_.back()->PromptLogits(tokens, table, stream_);
    EXPECT_TRUE(logits.ok()) << logits.status();
    return logits.ok() ? *logits : std::vector<float>{};
  }

 private:
  // What the pipeline's transport moves after a prefill chunk: stage s's output rows, into
  // stage s + 1's input.
  void CopyPrefillHidden(size_t s) {
    const ForwardBuffers& from = models_[s]->dev().prefill;
    const size_t bytes = size_t(from.rows) * models_[s]->dims().hidden * sizeof(__nv_bfloat16);
    EXPECT_EQ(cudaMemcpyAsync(models_[s + 1]->dev().prefill.h, from.h, bytes,
                              cudaMemcpyDeviceToDevice, stream_),
              cudaSuccess);
  }

  cudaStream_t stream_ = nullptr;
  std::unique_ptr<DeviceSlots> slots_;  // declared first: the last model points at it
  std::vector<std::unique_ptr<CudaModel>> models_;
  std::vector<std::vector<int32_t>> tables_;  // the prefilled slots' block tables
};

std::vector<int32_t> Prompt(int32_t n, int32_t vocab, uint32_t seed) {
  return kernels::testing::RandomTokens(n, vocab, seed);
}

// The trained default model's config and checkpoint (models/default).
struct DefaultModel {
  ModelConfig config;
  std::unique_ptr<Checkpoint> ckpt;
};
DefaultModel LoadDefaultModel() {
  const std::filesystem::path dir = testing::SourceDir() / "models" / "default";
  auto config = LoadModelConfig(dir);
  EXPECT_TRUE(config.ok()) << config.status();
  auto ckpt = Checkpoint::Open(dir);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  if (!config.ok() || !ckpt.ok()) return {};
  return {*config, std::move(*ckpt)};
}

// Equal bit for bit; on failure, how many and where the first difference is.
void ExpectSameLogits(const std::vector<float>& whole, const std::vector<float>& chained,
                      const char* what) {
  ASSERT_EQ(whole.size(), chained.size()) << what;
  ASSERT_FALSE(whole.empty()) << what;
  size_t differ = 0, first = whole.size();
  for (size_t i = 0; i < whole.size(); ++i) {
    if (whole[i] != chained[i]) {
      if (differ++ == 0) first = i;
    }
  }
  EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << whole.size()
                        << " logits differ, the first at " << first << " (" << whole[first]
                        << " vs " << chained[first] << ")";
}

void CheckSplits(const ModelConfig& c,
                 const std::function<absl::Status(CudaModel&, cudaStream_t)>& load,
                 const std::vector<std::vector<int32_t>>& splits) {
  Models whole(c, Split({c.num_layers}), load);
  ASSERT_TRUE(whole.ok());
  // Prompts that pad to other row counts (16, 64, 192) and one of a single token.
  std::vector<std::vector<int32_t>> prompts;
  for (int32_t n : {1, 13, 50, 190}) prompts.push_back(Prompt(n, c.vocab_size, 7 * n + 1));
  std::vector<std::vector<float>> expected;
  for (const auto& p : prompts) expected.push_back(whole.Logits(p));
  for (const std::vector<int32_t>& sizes : splits) {
    Models stages(c, Split(sizes), load);
    ASSERT_TRUE(stages.ok());
    ASSERT_EQ(stages.size(), sizes.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << sizes.size() << " stages, first of " << sizes[0]
                                        << " layers; prompt of " << prompts[i].size());
      ExpectSameLogits(expected[i], stages.Logits(prompts[i]), "chained stages");
    }
    // A stage without the head has no logits, no slot table and no first tokens to sample, and
    // a whole decode step (the graphs' unit) needs the whole model.
    const std::vector<int32_t> table = {0};
    EXPECT_EQ(stages[0].PromptLogits(prompts[0], table, nullptr).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(stages[0].EnqueueDecodeStep(1, 1, nullptr).code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(stages[0].EnqueueDecodePrepare(1, nullptr).code(),
              absl::StatusCode::kFailedPrecondition);
    const std::vector<int32_t> slot = {0};
    const std::vector<kernels::SamplingRow> row(1);
    const PrefillPiece piece{.tokens = prompts[0], .block_table = table, .len = 1, .head_row = 0};
    EXPECT_EQ(stages[0]
                  .EnqueuePrefillChunk(std::span<const PrefillPiece>(&piece, 1),
                                       FirstTokens{.slots = slot, .params = row}, nullptr)
                  .code(),
              absl::StatusCode::kFailedPrecondition);
  }
}

// Three prompts in slots 0-2 of a 4-row bucket (one padding row), then kSteps decode steps; a
// slot leaves the row list half way (as a finished stream would) and comes back.
void CheckDecode(const ModelConfig& c,
                 const std::function<absl::Status(CudaModel&, cudaStream_t)>& load,
                 const std::vector<int32_t>& sizes) {
  constexpr int32_t kSteps = 24;
  const std::vector<std::vector<int32_t>> prompts = {
      Prompt(5, c.vocab_size, 1), Prompt(37, c.vocab_size, 2), Prompt(90, c.vocab_size, 3)};
  std::vector<SamplingParams> sampling(3);
  sampling[0].temperature = 0.0f;  // greedy
  sampling[1].temperature = 0.8f;
  sampling[1].seed = 42;
  sampling[1].repetition_penalty = 1.3f;
  sampling[2].temperature = 1.0f;
  sampling[2].top_k = 40;
  sampling[2].seed = 7;
  sampling[2].frequency_penalty = 0.5f;
  auto run = [&](const std::vector<int32_t>& split, std::vector<float>* logits) {
    Models m(c, Split(split), load);
    std::vector<std::vector<int32_t>> tokens;
    if (!m.ok()) return tokens;
    m.Prefill(prompts, sampling);
    for (int32_t step = 0; step < kSteps; ++step) {
      const bool all = step < kSteps / 3 || step >= 2 * kSteps / 3;
      tokens.push_back(m.Decode(
          all ? std::vector<int32_t>{0, 1, 2, -1} : std::vector<int32_t>{0, 2, -1, -1}, logits));
    }
    return tokens;
  };
  std::vector<float> whole_logits, stage_logits;
  const auto whole = run({c.num_layers}, &whole_logits);
  const auto staged = run(sizes, &stage_logits);
  ASSERT_EQ(whole.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(staged.size(), whole.size());
  for (int32_t step = 0; step < kSteps; ++step) {
    EXPECT_EQ(staged[step], whole[step]) << "step " << step;
  }
  ExpectSameLogits(whole_logits, stage_logits, "decode logits");
  // Not a constant stream: the sampled rows took several tokens.
  std::vector<int32_t> seen;
  for (const auto& t : whole) seen.push_back(t[1]);
  std::sort(seen.begin(), seen.end());
  EXPECT_GT(std::unique(seen.begin(), seen.end()) - seen.begin(), 3);
}

TEST(CudaStageTest, ChainedStagesOfTheDefaultModelGiveItsLogits) {
  const DefaultModel d = LoadDefaultModel();
  ASSERT_NE(d.ckpt, nullptr);
  ASSERT_TRUE(d.config.tie_word_embeddings);  // so the last stage holds the matrix as its lm_head
  CheckSplits(d.config, [&](CudaModel& m, cudaStream_t s) { return m.UploadWeights(*d.ckpt, s); },
              {{4, 4}, {1, 6, 1}, {3, 2, 2, 1}});
}

TEST(CudaStageTest, ChainedStagesOfTheDefaultModelDecodeItsTokens) {
  const DefaultModel d = LoadDefaultModel();
  ASSERT_NE(d.ckpt, nullptr);
  auto load = [&](CudaModel& m, cudaStream_t s) { return m.UploadWeights(*d.ckpt, s); };
  for (const std::vector<int32_t>& sizes : std::vector<std::vector<int32_t>>{{4, 4}, {2, 3, 3}}) {
    SCOPED_TRACE(::testing::Message() << sizes.size() << " stages");
    CheckDecode(d.config, load, sizes);
  }
}

TEST(CudaStageTest, ChainedStagesOfRandomWeightsGiveTheWholeModelsLogits) {
  for (bool tied : {false, true}) {
    ModelConfig c = Llama1bShape();
    c.num_layers = 5;
    c.vocab_size = 5000;
    c.tie_word_embeddings = tied;
    SCOPED_TRACE(tied ? "tied" : "untied");
    CheckSplits(c, [](CudaModel& m, cudaStream_t s) { return m.InitRandomWeights(11, 0.05f, s); },
                {{2, 3}, {1, 1, 3}});
    CheckDecode(c, [](CudaModel& m, cudaStream_t s) { return m.InitRandomWeights(11, 0.05f, s); },
                {3, 2});
  }
}

}  // namespace
}  // namespace ts
