// The launches and moves of a CUDA pipeline's calls, in the one order every process follows
// (docs/pipeline.md, The CUDA pipeline). In one process every stage is here; across processes
// (cuda_ranks.h) each process holds one and runs the same calls over its own view, doing only
// its stage's work and its halves of the moves, which the links pair up. Every move is between
// neighbours: the rows' inputs go from the last stage to the first and then on stage by stage,
// so that a ring of processes carries them too.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "engine/cuda/cuda_model.h"
#include "engine/cuda/stage_link.h"
#include "graphs/graph_cache.h"

namespace ts {

// One stage as this process sees it: model, graphs and stream are null where another process
// holds it.
struct PipelineStage {
  int device = 0;
  cudaStream_t stream = nullptr;
  CudaModel* model = nullptr;
  graphs::GraphCache* graphs = nullptr;
  bool here() const { return model != nullptr; }
};

class StagePipeline {
 public:
  // `stages` in layer order, at least 2; `links` outlives this.
  StagePipeline(std::vector<PipelineStage> stages, StageLinks* links)
      : stages_(std::move(stages)), links_(links) {}

  int32_t num_stages() const { return static_cast<int32_t>(stages_.size()); }
  const PipelineStage& stage(int s) const { return stages_[s]; }

  // Bucket `index`'s decode step (`bucket` rows). Where the last stage is here, its row list
  // must already be in dev().decode_head.row_slots; this runs its prepare, moves the rows' inputs
  // along the stages, and launches each stage's graph with the hidden state moved between them.
  // `feed` (a second stream of the last stage, for row groups, CudaBackend): the inputs sent
  // upstream are prepared there, into the model's decode feed from the row list in
  // feed_row_slots() (enqueued there before), so they need not wait behind the last stage's graph
  // of another group; the last stage prepares its own just before its graph.
  absl::Status Decode(int32_t index, int32_t bucket, cudaStream_t feed = nullptr);
  // One prefill chunk (ChunkPrefill's pieces, `rows` prompt rows) through every stage in turn,
  // writing their KV; no sampling.
  absl::Status PrefillChunk(std::span<const PrefillPiece> pieces, int32_t rows);
  // Every stage's graphs to `regime`, each by an exec update on its own stream.
  absl::Status UpdateRegime(const graphs::Regime& regime);

 private:
  // Stage s's buffers, or none where another process holds it.
  std::vector<DeviceBytes> Inputs(int s, int32_t bucket, bool feed = false) const;
  std::vector<DeviceBytes> Hidden(int s, int32_t bucket) const;
  std::vector<DeviceBytes> PrefillRows(int s, int32_t rows) const;

  std::vector<PipelineStage> stages_;
  StageLinks* links_;
};

}  // namespace ts
