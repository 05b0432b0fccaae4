// The CPU backend's forward pass as a pipeline (docs/pipeline.md): one CpuModel stage per entry of
// a stage plan, each loading only its own tensors and holding the KV of its own layers, run as
// LocalPipeline stage threads with the batch split into micro-batches. The CPU backend over it
// serves exactly what it serves over the whole model, which is how `tailserve --backend cpu
// --pipeline_stages N` runs, and how CI tests the pipeline's schedule end to end.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cpu_backend.h"
#include "engine/pipeline/local_pipeline.h"
#include "engine/pipeline/stage_plan.h"

namespace ts::pipeline {

// The CpuModel of one stage of `plan`: only its tensors ("pipeline stage s: ..." on errors).
absl::StatusOr<std::unique_ptr<CpuModel>> LoadStageModel(const std::filesystem::path& dir,
                                                         const StagePlan& stage,
                                                         int threads_per_stage);

class PipelineForward final : public CpuForward {
 public:
  // Loads each stage of `plan` (PlanStages) from `dir`, with a KV pool of `num_kv_blocks` blocks
  // of `block_size` tokens for its layers (block ids are the engine's, shared by every stage).
  // `micro_batches` >= 1 splits each batch; `threads_per_stage` as CpuModelOptions::num_threads.
  static absl::StatusOr<std::unique_ptr<PipelineForward>> Load(
      const std::filesystem::path& dir, const std::vector<StagePlan>& plan, int32_t num_kv_blocks,
      int32_t block_size, int32_t micro_batches, int threads_per_stage);

  const ModelConfig& config() const override { return config_; }
  absl::Status Forward(std::span<const SeqChunk> chunks, LogitsMode mode,
                       std::vector<float>* logits) override;

 private:
  PipelineForward(ModelConfig config, std::unique_ptr<LocalPipeline> pipeline,
                  int32_t micro_batches)
      : config_(std::move(config)), pipeline_(std::move(pipeline)), micro_batches_(micro_batches) {}
  ModelConfig config_;
  std::unique_ptr<LocalPipeline> pipeline_;
  int32_t micro_batches_;
};

}  // namespace ts::pipeline
