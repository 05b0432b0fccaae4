// Pipeline stages of the CUDA model (docs/pipeline.md, CUDA stages). A model split into stages,
// each a CudaModel holding only its layers (the embedding on the first, the head on the last),
// chained by copying each stage's output hidden states into the next stage's input, must give the
// whole model's prompt logits bit for bit: the same kernels run on the same rows in the same
// order, only on other GPUs' worth of memory. Checked on the trained default model (each stage
// uploads only its own tensors from the checkpoint) and on random weights, tied and untied (a
// stage's random weights are the whole model's tensors it holds).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "engine/cuda/cuda_model.h"
#include "models/checkpoint.h"
#include "models/config.h"
#include "models/llama_shapes.h"
#include "tests/common/test_paths.h"

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
      auto m = CudaModel::Create(Options(c, st));
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

  // The prompt through every stage in turn; the last one's teacher-forced logits.
  std::vector<float> Logits(const std::vector<int32_t>& tokens) {
    const std::vector<int32_t> table = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const PrefillSeq seq{tokens, table};
    for (size_t s = 0; s + 1 < models_.size(); ++s) {
      const absl::Status st =
          models_[s]->EnqueuePrefill(std::span<const PrefillSeq>(&seq, 1), stream_);
      EXPECT_TRUE(st.ok()) << "stage " << s << ": " << st;
      // What the pipeline's transport moves: the stage's output rows, into the next one's input.
      const ForwardBuffers& from = models_[s]->dev().prefill;
      const size_t bytes = size_t(from.rows) * models_[s]->dims().hidden * sizeof(__nv_bfloat16);
      EXPECT_EQ(cudaMemcpyAsync(models_[s + 1]->dev().prefill.h, from.h, bytes,
                                cudaMemcpyDeviceToDevice, stream_),
                cudaSuccess);
    }
    auto logits = models_.back()->PromptLogits(tokens, table, stream_);
    EXPECT_TRUE(logits.ok()) << logits.status();
    return logits.ok() ? *logits : std::vector<float>{};
  }

 private:
  cudaStream_t stream_ = nullptr;
  std::vector<std::unique_ptr<CudaModel>> models_;
};

std::vector<int32_t> Prompt(int32_t n, int32_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> id(0, vocab - 1);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = id(rng);
  return t;
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
    // A stage without the head has no logits to give, and no stage decodes alone yet.
    const std::vector<int32_t> table = {0};
    EXPECT_EQ(stages[0].PromptLogits(prompts[0], table, nullptr).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(stages[0].EnqueueDecodeStep(1, 1, nullptr).code(),
              absl::StatusCode::kFailedPrecondition);
  }
}

TEST(CudaStageTest, ChainedStagesOfTheDefaultModelGiveItsLogits) {
  const std::filesystem::path dir = testing::SourceDir() / "models" / "default";
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ASSERT_TRUE(config->tie_word_embeddings);  // so the last stage holds the matrix as its lm_head
  const Checkpoint& c = **ckpt;
  CheckSplits(*config, [&](CudaModel& m, cudaStream_t s) { return m.UploadWeights(c, s); },
              {{4, 4}, {1, 6, 1}, {3, 2, 2, 1}});
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
  }
}

}  // namespace
}  // namespace ts
