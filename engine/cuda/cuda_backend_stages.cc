// CudaBackend over the stages of a pipeline (docs/pipeline.md, The CUDA pipeline): building one
// model per stage, running prefill chunks and host-driven decode steps through them, and keeping
// every stage's graphs in the same attention regime. A whole model is the pipeline of one stage.
#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_ranks.h"
#include "engine/pipeline/stage_plan.h"
#include "graphs/device_guard.h"
#include "kernels/cuda_check.h"

namespace ts {

CudaModelOptions CudaBackend::StageModelOptions(const CudaBackendOptions& o,
                                                const ModelConfig& config,
                                                const CudaStageOptions& stage) {
  CudaModelOptions m;
  m.config = config;
  m.stage = stage.stage;
  m.max_slots = o.max_slots;
  m.buckets = o.buckets;
  m.kv_block_size = o.kv_block_size;
  m.max_context = o.max_context;
  m.prefill_chunk_tokens = o.prefill_chunk_tokens;
  m.ring_capacity = o.ring_capacity;
  m.gpu_memory_fraction = o.gpu_memory_fraction;
  m.device = stage.device;
  m.print_plan = o.log_progress;
  m.capture_observer = o.capture_observer;
  m.attention_min_split_tokens = o.attention_min_split_tokens;
  m.step_stamps = o.step_stamps;
  return m;
}

absl::Status ValidateStages(std::span<const CudaStageOptions> stages, int32_t num_layers) {
  if (stages.empty()) return absl::OkStatus();  // the whole model
  int32_t next = 0;
  for (size_t i = 0; i < stages.size(); ++i) {
    const ModelStage& st = stages[i].stage;
    const std::string where = absl::StrCat("stages[", i, "]: ");
    if (st.first_layer != next) {
      return absl::InvalidArgumentError(absl::StrCat(where, "starts at layer ", st.first_layer,
                                                     ", not at ", next,
                                                     ", where the one before ends"));
    }
    const int32_t layers = st.num_layers < 0 ? num_layers - st.first_layer : st.num_layers;
    if (layers < 1 || st.first_layer + layers > num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "layers [", st.first_layer, ", ", st.first_layer + layers,
                       ") must be non-empty within the model's ", num_layers));
    }
    next = st.first_layer + layers;
    if (st.has_embedding != (i == 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "the embedding belongs to the first stage, and only there"));
    }
    if (st.has_head != (i + 1 == stages.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "the head belongs to the last stage, and only there"));
    }
    if (stages[i].device < 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, "device ", stages[i].device));
    }
  }
  if (next != num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("stages: they end at layer ", next, "; the model has ", num_layers));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::WaitStream() {
  // A pipeline's last stage waited for every stage before it; over NCCL the wait is bounded.
  if (links_ != nullptr) return links_->Wait(stream_, options_.link_timeout);
  TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<CudaStageOptions>> PlanCudaStages(const ModelConfig& config,
                                                             std::span<const int> devices,
                                                             int32_t kv_block_size,
                                                             std::string* description) {
  const int32_t n = static_cast<int32_t>(devices.size());
  TS_ASSIGN_OR_RETURN(const std::vector<pipeline::StagePlan> plan,
                      pipeline::PlanStages(config, {.num_stages = n}));
  if (description != nullptr) *description = pipeline::DescribePlan(plan, 0, kv_block_size);
  std::vector<CudaStageOptions> out;
  for (const pipeline::StagePlan& p : plan) {
    out.push_back(CudaStageOptions{.stage = ModelStage{.first_layer = p.first_layer,
                                                       .num_layers = p.num_layers,
                                                       .has_embedding = p.has_embedding,
                                                       .has_head = p.has_head},
                                   .device = devices[p.stage]});
  }
  return out;
}

size_t CudaBackend::step_weight_bytes() const {
  size_t bytes = model_->step_weight_bytes();
  for (const Upstream& u : upstream_) bytes += u.model->step_weight_bytes();
  return bytes;
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Make(const CudaBackendOptions& o,
                                                               const ModelConfig& config,
                                                               const LoadWeights& load) {
  TS_RETURN_IF_ERROR(ValidateStages(o.stages, config.num_layers));
  std::vector<CudaStageOptions> stages =
      o.stages.empty() ? std::vector<CudaStageOptions>{{.stage = {}, .device = o.device}}
                       : o.stages;
  std::vector<CudaStageOptions> rank_plan;  // across processes: every rank's stage
  if (o.ranks.world_size > 1) {
    const std::vector<int> devices(o.ranks.world_size, o.device);
    TS_ASSIGN_OR_RETURN(rank_plan, PlanCudaStages(config, devices, o.kv_block_size, nullptr));
    stages = {rank_plan.back()};  // rank 0 holds the last stage: the slot table and sampling
  }
  std::unique_ptr<CudaBackend> b(new CudaBackend(o));
  // Each stage's model holds only its tensors (CudaModelOptions::stage). A failed Make destroys
  // the backend with each stage's device current (the destructor's guards); the caller's current
  // device is restored on return.
  for (size_t s = 0; s + 1 < stages.size(); ++s) {
    TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(stages[s].device));
    Upstream& u = b->upstream_.emplace_back();
    u.device = stages[s].device;
    TS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&u.stream, cudaStreamNonBlocking));
    TS_ASSIGN_OR_RETURN(u.model, CudaModel::Create(StageModelOptions(o, config, stages[s])));
    TS_RETURN_IF_ERROR(load(*u.model, u.stream));
  }
  TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(b->options_.device));
  TS_RETURN_IF_ERROR(b->CreateStream());
  CudaModelOptions last = StageModelOptions(o, config, stages.back());
  TS_ASSIGN_OR_RETURN(b->device_slots_, DeviceSlots::Create(CudaModel::SlotShapeFor(last)));
  last.slots = b->device_slots_.get();
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CudaModel> model, CudaModel::Create(last));
  TS_RETURN_IF_ERROR(load(*model, b->stream_));
  TS_RETURN_IF_ERROR(b->Init(std::move(model)));
  if (!rank_plan.empty()) TS_RETURN_IF_ERROR(b->ConnectRanks(rank_plan));
  return b;
}

absl::Status CudaBackend::EnqueuePrefillStages(std::span<const PrefillSeq> seqs) {
  for (const std::vector<PrefillPiece>& pieces :
       ChunkPrefill(seqs, model_->plan().shape.prefill_rows)) {
    if (pipeline_ == nullptr) {
      TS_RETURN_IF_ERROR(model_->EnqueuePrefillChunk(pieces, FirstTokens{}, stream_));
      continue;
    }
    int32_t rows = 0;
    for (const PrefillPiece& p : pieces) rows += p.len;
    if (ring_ != nullptr) {
      pipeline::StageMessage m;
      PackPrefillChunk(pieces, &m);
      TS_RETURN_IF_ERROR(SendControl(std::move(m)));
    }
    TS_RETURN_IF_ERROR(pipeline_->PrefillChunk(pieces, rows));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::UpdateRegimeAll(const graphs::Regime& regime) {
  if (pipeline_ == nullptr) return graphs_->UpdateRegime(regime, stream_);
  if (ring_ != nullptr) TS_RETURN_IF_ERROR(SendControl(RegimeMessage(regime)));
  return pipeline_->UpdateRegime(regime);
}

absl::Status CudaBackend::LaunchStep(int32_t index) {
  const int32_t bucket = options_.buckets[index];
  TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(model_->dev().decode_head.row_slots,
                                          model_->host().row_slots, bucket * sizeof(int32_t),
                                          cudaMemcpyHostToDevice, stream_));
  if (pipeline_ == nullptr) return graphs_->Launch(index, stream_);
  if (ring_ != nullptr) TS_RETURN_IF_ERROR(SendControl(DecodeMessage(index)));
  return pipeline_->Decode(index, bucket);
}

}  // namespace ts
