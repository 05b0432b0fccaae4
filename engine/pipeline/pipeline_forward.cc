#include "engine/pipeline/pipeline_forward.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace ts::pipeline {

absl::StatusOr<std::unique_ptr<CpuModel>> LoadStageModel(const std::filesystem::path& dir,
                                                         const StagePlan& p,
                                                         int threads_per_stage) {
  CpuModelOptions o{.num_threads = threads_per_stage};
  o.stage = {.first_layer = p.first_layer,
             .num_layers = p.num_layers,
             .embedding = p.has_embedding,
             .head = p.has_head};
  absl::StatusOr<std::unique_ptr<CpuModel>> m = CpuModel::Load(dir, o);
  if (!m.ok()) {
    return absl::Status(m.status().code(),
                        absl::StrCat("pipeline stage ", p.stage, ": ", m.status().message()));
  }
  return m;
}

absl::StatusOr<std::unique_ptr<PipelineForward>> PipelineForward::Load(
    const std::filesystem::path& dir, const std::vector<StagePlan>& plan, int32_t num_kv_blocks,
    int32_t block_size, int32_t micro_batches, int threads_per_stage) {
  if (plan.empty()) return absl::InvalidArgumentError("pipeline_stages: no stage");
  if (micro_batches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("micro_batches: must be >= 1, got ", micro_batches));
  }
  std::vector<std::unique_ptr<StageRunner>> stages;
  ModelConfig config;
  for (const StagePlan& p : plan) {
    absl::StatusOr<std::unique_ptr<CpuModel>> m = LoadStageModel(dir, p, threads_per_stage);
    if (!m.ok()) return m.status();
    if (p.stage == 0) config = (*m)->config();
    stages.push_back(std::make_unique<CpuStageRunner>(*std::move(m), num_kv_blocks, block_size));
  }
  return std::unique_ptr<PipelineForward>(new PipelineForward(
      std::move(config), std::make_unique<LocalPipeline>(std::move(stages)), micro_batches));
}

absl::Status PipelineForward::Forward(std::span<const SeqChunk> chunks, LogitsMode mode,
                                      std::vector<float>* logits) {
  return pipeline_->Forward(chunks, mode, micro_batches_, logits);
}

}  // namespace ts::pipeline
