#include "engine/cuda/stage_pipeline.h"

#include "common/status.h"
#include "graphs/device_guard.h"

namespace ts {

std::vector<DeviceBytes> StagePipeline::Inputs(int s, int32_t bucket, bool feed) const {
  if (!stages_[s].here()) return {};
  return stages_[s].model->DecodeRowInputs(bucket, feed);
}

std::vector<DeviceBytes> StagePipeline::Hidden(int s, int32_t bucket) const {
  if (!stages_[s].here()) return {};
  return {stages_[s].model->DecodeHidden(bucket)};
}

std::vector<DeviceBytes> StagePipeline::PrefillRows(int s, int32_t rows) const {
  if (!stages_[s].here()) return {};
  return {stages_[s].model->PrefillHidden(rows)};
}

absl::Status StagePipeline::Decode(int32_t index, int32_t bucket, cudaStream_t feed) {
  const int last = num_stages() - 1;
  const PipelineStage& tail = stages_[last];
  const bool fed = feed != nullptr && tail.here();
  if (tail.here()) {
    TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(tail.device));
    TS_RETURN_IF_ERROR(tail.model->EnqueueDecodePrepare(bucket, fed ? feed : tail.stream, fed));
  }
  TS_RETURN_IF_ERROR(
      links_->Move(last, 0, Inputs(last, bucket, fed), Inputs(0, bucket), fed ? feed : nullptr));
  for (int s = 0; s < last; ++s) {
    // Stage s passes the inputs on before its own graph, so the next stage never waits for them.
    if (s + 1 < last) {
      TS_RETURN_IF_ERROR(links_->Move(s, s + 1, Inputs(s, bucket), Inputs(s + 1, bucket)));
    }
    if (s > 0) TS_RETURN_IF_ERROR(links_->Move(s - 1, s, Hidden(s - 1, bucket), Hidden(s, bucket)));
    const PipelineStage& st = stages_[s];
    if (!st.here()) continue;
    TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(st.device));
    TS_RETURN_IF_ERROR(st.graphs->Launch(index, st.stream));
  }
  TS_RETURN_IF_ERROR(links_->Move(last - 1, last, Hidden(last - 1, bucket), Hidden(last, bucket)));
  if (!tail.here()) return absl::OkStatus();
  TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(tail.device));
  if (fed) TS_RETURN_IF_ERROR(tail.model->EnqueueDecodePrepare(bucket, tail.stream));
  return tail.graphs->Launch(index, tail.stream);
}

absl::Status StagePipeline::PrefillChunk(std::span<const PrefillPiece> pieces, int32_t rows) {
  for (int s = 0; s < num_stages(); ++s) {
    if (s > 0) {
      TS_RETURN_IF_ERROR(links_->Move(s - 1, s, PrefillRows(s - 1, rows), PrefillRows(s, rows)));
    }
    const PipelineStage& st = stages_[s];
    if (!st.here()) continue;
    TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(st.device));
    TS_RETURN_IF_ERROR(st.model->EnqueuePrefillChunk(pieces, FirstTokens{}, st.stream));
  }
  return absl::OkStatus();
}

absl::Status StagePipeline::UpdateRegime(const graphs::Regime& regime) {
  for (const PipelineStage& st : stages_) {
    if (!st.here()) continue;
    TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(st.device));
    TS_RETURN_IF_ERROR(st.graphs->UpdateRegime(regime, st.stream));
  }
  return absl::OkStatus();
}

}  // namespace ts
