// A pipeline whose stages are threads of one process, connected by in-memory queues: micro-batch
// k moves to stage s + 1 as soon as stage s has finished it, so with M micro-batches in flight up
// to min(S, M) stages compute at once. Stages are StageRunners, so the same schedule drives the
// CPU reference now and other runners later (docs/pipeline.md, Micro-batches).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "models/cpu_model.h"

namespace ts::pipeline {

// One stage's compute.
class StageRunner {
 public:
  virtual ~StageRunner() = default;
  // `chunks`: the micro-batch's sequences. `hidden_in`: empty on the first stage, else the
  // previous stage's [tokens][hidden]. `out`: that stage's hidden, or on the last stage the
  // logits as `mode` asks. Called from the stage's own thread only.
  virtual absl::Status Run(std::span<const SeqChunk> chunks, std::span<const float> hidden_in,
                           LogitsMode mode, std::vector<float>* out) = 0;
};

// The CPU reference's part of the model (CpuStage), with a KV pool of its own layers.
class CpuStageRunner final : public StageRunner {
 public:
  CpuStageRunner(std::unique_ptr<CpuModel> model, int32_t num_blocks, int32_t block_size);
  absl::Status Run(std::span<const SeqChunk> chunks, std::span<const float> hidden_in,
                   LogitsMode mode, std::vector<float>* out) override;

 private:
  std::unique_ptr<CpuModel> model_;
  CpuKvPool kv_;
};

// Sequences [first, first + count).
struct MicroBatch {
  int32_t first = 0;
  int32_t count = 0;
};
// `sequences` in at most `micro_batches` contiguous, non-empty pieces whose sizes differ by at
// most one, the larger ones first.
std::vector<MicroBatch> SplitMicroBatches(int32_t sequences, int32_t micro_batches);

class LocalPipeline {
 public:
  // One thread per stage, started here; stages[0] embeds, the last one ends in logits.
  explicit LocalPipeline(std::vector<std::unique_ptr<StageRunner>> stages);
  ~LocalPipeline();  // closes the queues and joins the threads
  LocalPipeline(const LocalPipeline&) = delete;
  LocalPipeline& operator=(const LocalPipeline&) = delete;

  // Runs `chunks` through every stage in `micro_batches` pieces and returns the last stage's
  // output rows in chunk order, as CpuModel::Forward would. The first stage error wins; the
  // micro-batches after it still drain, so the pipeline stays usable. One call at a time.
  absl::Status Forward(std::span<const SeqChunk> chunks, LogitsMode mode, int32_t micro_batches,
                       std::vector<float>* out);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ts::pipeline
