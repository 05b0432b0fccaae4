#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/sampling_row.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/cuda/regime_policy.h"
#include "graphs/device_guard.h"
#include "graphs/device_loop.cuh"
#include "kernels/cuda_check.h"
#include "kernels/global_timer.cuh"
#include "kernels/kv_layout.cuh"
#include "kernels/postprocess.cuh"
#include "models/checkpoint.h"
#include "models/sampling.h"

namespace ts {
namespace k = ::ts::kernels;

namespace {

absl::Status ValidateOptions(const CudaBackendOptions& o) {
  if (o.max_slots < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_slots: must be >= 1, got ", o.max_slots));
  }
  TS_RETURN_IF_ERROR(ValidateBuckets(o.buckets));
  if (o.prefill_step_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_step_tokens: must be >= 1, got ", o.prefill_step_tokens));
  }
  if (o.prefill_catchup_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_catchup_tokens: must be >= 1, got ", o.prefill_catchup_tokens));
  }
  if (o.prefill_catchup_after.count() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("prefill_catchup_after: must be >= 0 ms, got ",
                                                   o.prefill_catchup_after.count()));
  }
  if (o.buckets.back() < o.max_slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("buckets: largest bucket ", o.buckets.back(), " < max_slots ", o.max_slots));
  }
  if (o.device_loop && o.prefill_chunk_tokens <= o.buckets.back()) {
    // A mixed step holds a bucket's decode rows and at least one prompt row in the prefill
    // buffers (docs/device-loop.md, Mixed steps).
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_chunk_tokens: must exceed the largest bucket ", o.buckets.back(),
                     " with the device loop, got ", o.prefill_chunk_tokens));
  }
  if (o.device_loop && (o.stages.size() > 1 || o.ranks.world_size > 1)) {
    // NCCL's captured work cannot be device-launched (docs/pipeline.md, NCCL in CUDA graphs).
    return absl::InvalidArgumentError(
        "stages: a pipeline is host-driven; the device loop runs within one GPU");
  }
  if (o.ranks.world_size > 1 && !o.stages.empty()) {
    return absl::InvalidArgumentError(
        "stages: a pipeline across processes holds one stage per process; leave stages empty");
  }
  if (o.ranks.world_size < 1 || o.ranks.rank != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ranks: the backend is rank 0 of world_size >= 1; got rank ", o.ranks.rank,
                     " of ", o.ranks.world_size, " (ranks 1.. run RunCudaWorker)"));
  }
  return absl::OkStatus();
}

}  // namespace

CudaBackend::CudaBackend(const CudaBackendOptions& options) : options_(options) {
  // The last stage owns the slot table: it is the device every slot and step call works on.
  if (!options_.stages.empty()) options_.device = options_.stages.back().device;
}

CudaBackend::~CudaBackend() {
  // The engine destroys the backend on its own thread, whose current device may be another.
  const graphs::DeviceGuard guard = graphs::DeviceGuard::SetOrIgnore(options_.device);
  StopLoop();
  // Nothing may still run on our streams when the graphs and the arenas go away.
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  ShutdownRanks();
  for (Upstream& u : upstream_) {
    const graphs::DeviceGuard g = graphs::DeviceGuard::SetOrIgnore(u.device);
    if (u.stream != nullptr) cudaStreamSynchronize(u.stream);
  }
  pipeline_.reset();
  links_.reset();
  ring_.reset();
  for (Upstream& u : upstream_) {
    const graphs::DeviceGuard g = graphs::DeviceGuard::SetOrIgnore(u.device);
    u.graphs.reset();
    u.model.reset();
    if (u.stream != nullptr) cudaStreamDestroy(u.stream);
  }
  if (feed_stream_ != nullptr) cudaStreamSynchronize(feed_stream_);
  for (Group& g : groups_) {
    if (g.done != nullptr) cudaEventDestroy(g.done);
  }
  if (group_staging_ != nullptr) cudaFreeHost(group_staging_);
  if (feed_stream_ != nullptr) cudaStreamDestroy(feed_stream_);
  graphs_.reset();
  timer_.reset();
  model_.reset();
  device_slots_.reset();
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  if (clock_stream_ != nullptr) cudaStreamDestroy(clock_stream_);
  if (clock_sample_ != nullptr) cudaFree(clock_sample_);
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(const CudaBackendOptions& o) {
  TS_RETURN_IF_ERROR(ValidateOptions(o));
  TS_ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(o.model_dir));
  TS_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(o.model_dir));
  const Checkpoint* c = ckpt.get();
  return Make(o, config, [c](CudaModel& m, cudaStream_t s) { return m.UploadWeights(*c, s); });
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::CreateRandom(
    const CudaBackendOptions& o, const RandomWeightsSpec& spec) {
  TS_RETURN_IF_ERROR(ValidateOptions(o));
  return Make(o, spec.config, [&spec](CudaModel& m, cudaStream_t s) {
    return m.InitRandomWeights(spec.seed, spec.scale, s);
  });
}

absl::Status CudaBackend::CreateStream() {
  TS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  TS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&clock_stream_, cudaStreamNonBlocking));
  TS_CUDA_RETURN_IF_ERROR(cudaMalloc(&clock_sample_, sizeof(uint64_t)));
  return absl::OkStatus();
}

absl::Status CudaBackend::CalibrateClock() {
  // The sample's error is half the bracket around it (a launch and a sync, some microseconds);
  // the tightest of a few brackets wins.
  using Clock = std::chrono::steady_clock;
  int64_t best_span = INT64_MAX;
  for (int i = 0; i < 5; ++i) {
    const Clock::time_point t0 = Clock::now();
    TS_RETURN_IF_ERROR(k::LaunchReadGlobalTimer({.out = clock_sample_}, clock_stream_));
    TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(clock_stream_));
    const Clock::time_point t1 = Clock::now();
    uint64_t gpu_ns = 0;
    TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&gpu_ns, clock_sample_, sizeof(gpu_ns),
                                            cudaMemcpyDeviceToHost, clock_stream_));
    TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(clock_stream_));
    const int64_t span = std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
    if (span >= best_span) continue;
    best_span = span;
    const int64_t mid = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            (t0 + (t1 - t0) / 2).time_since_epoch())
                            .count();
    gpu_clock_offset_ns_ = static_cast<int64_t>(gpu_ns) - mid;
  }
  calibrated_at_ = Clock::now();
  return absl::OkStatus();
}

absl::Status CudaBackend::MaybeCalibrateClock() {
  // The two clocks are both nanosecond counters but need not tick alike over hours. Called only
  // where nothing runs on the GPU, so the brackets stay tight and no decode step waits for them.
  if (std::chrono::steady_clock::now() - calibrated_at_ < std::chrono::seconds(10)) {
    return absl::OkStatus();
  }
  return CalibrateClock();
}

uint64_t CudaBackend::GpuDeadline(std::chrono::steady_clock::time_point deadline) const {
  if (deadline == std::chrono::steady_clock::time_point{}) return 0;
  const int64_t ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(deadline.time_since_epoch()).count() +
      gpu_clock_offset_ns_;
  return static_cast<uint64_t>(std::max<int64_t>(ns, 1));  // 0 means none
}

int32_t CudaBackend::RegimeBound(int32_t context) const {
  return ts::RegimeBound(context, model_->max_context());
}

absl::Status CudaBackend::Init(std::unique_ptr<CudaModel> model) {
  model_ = std::move(model);
  const MemoryPlan& plan = model_->plan();
  info_.model = model_->config();
  info_.max_slots = options_.max_slots;
  info_.kv_block_size = plan.shape.kv_block_size;
  info_.num_kv_blocks = plan.shape.num_kv_blocks;
  info_.ring_capacity = plan.shape.ring_capacity;
  info_.name = "cuda";
  slots_.resize(options_.max_slots);
  rows_.reserve(options_.max_slots);
  table_ = std::make_unique<SlotTable>(options_.max_slots, info_.ring_capacity,
                                       device_slots_->host().rings, device_slots_->host().cancel);
  TS_ASSIGN_OR_RETURN(timer_, OpTimer::Create(16 * model_->dims().num_layers + 64));
  TS_RETURN_IF_ERROR(CalibrateClock());

  for (const Upstream& u : upstream_) {
    // Every stage holds KV for the same sequences under the engine's block ids.
    info_.num_kv_blocks = std::min(info_.num_kv_blocks, u.model->plan().shape.num_kv_blocks);
  }
  if (options_.device_loop) TS_RETURN_IF_ERROR(InitLoop());
  TS_ASSIGN_OR_RETURN(graphs_,
                      BuildGraphs(options_, *model_, options_.device, stream_, loop_.get()));
  for (Upstream& u : upstream_) {
    TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(u.device));
    TS_ASSIGN_OR_RETURN(u.graphs, BuildGraphs(options_, *u.model, u.device, u.stream));
  }
  if (!upstream_.empty()) {
    std::vector<StageQueue> queues;
    std::vector<PipelineStage> views;
    for (const Upstream& u : upstream_) {
      queues.push_back({.device = u.device, .stream = u.stream});
      views.push_back({u.device, u.stream, u.model.get(), u.graphs.get()});
    }
    queues.push_back({.device = options_.device, .stream = stream_});
    views.push_back({options_.device, stream_, model_.get(), graphs_.get()});
    TS_ASSIGN_OR_RETURN(links_, StageLinks::Create(queues, options_.link_timeout));
    pipeline_ = std::make_unique<StagePipeline>(std::move(views), links_.get());
    LogStages();
  }
  if (options_.device_loop) TS_RETURN_IF_ERROR(BindLoop());
  // Across processes the pipeline exists only once the ranks have joined (ConnectRanks).
  if (options_.ranks.world_size <= 1) TS_RETURN_IF_ERROR(InitGroups());
  return absl::OkStatus();
}

void CudaBackend::LogStages() const {
  if (!options_.log_progress) return;
  std::fprintf(stderr,
               "cuda backend: pipeline of %d stages, linked by %s; the engine's KV pool is the "
               "smallest stage's, %d blocks\n",
               num_stages(), links_->name(), info_.num_kv_blocks);
  for (int s = 0; s < num_stages(); ++s) {
    const PipelineStage& st = pipeline_->stage(s);
    if (!st.here()) {
      std::fprintf(stderr, "cuda backend: stage %d in another process (rank %d)\n", s, s + 1);
      continue;
    }
    const ModelStage& ms = st.model->stage();
    std::fprintf(stderr,
                 "cuda backend: stage %d on device %d: layers [%d, %d)%s%s, %.2f GiB of weights "
                 "read per step, %d KV blocks\n",
                 s, st.device, ms.first_layer, ms.first_layer + ms.num_layers,
                 ms.has_embedding ? ", embedding" : "", ms.has_head ? ", head" : "",
                 static_cast<double>(st.model->step_weight_bytes()) / (1 << 30),
                 st.model->plan().shape.num_kv_blocks);
  }
}

absl::StatusOr<std::unique_ptr<graphs::GraphCache>> CudaBackend::BuildGraphs(
    const CudaBackendOptions& options, CudaModel& model, int device, cudaStream_t stream,
    const graphs::DeviceLoop* loop) {
  // One decode graph per bucket. The regime's max_context_len picks each bucket's attention
  // split count; attention_num_splits (the smallest bucket's count) caps it, so the regime
  // value that changes is what the exec update carries.
  // Every stage starts in the regime of the shortest contexts, and a pipeline's stages change it
  // together (UpdateRegimeAll).
  const int32_t bound = std::min(128, model.max_context());
  graphs::GraphCacheOptions g;
  g.buckets = options.buckets;
  g.device = device;
  g.initial_regime = {.attention_num_splits = model.NumSplits(options.buckets.front(), bound),
                      .max_context_len = bound};
  g.log_progress = options.log_progress;
  CudaModel* m = &model;
  g.capture = [m, loop](const graphs::CaptureContext& ctx, cudaStream_t s) -> absl::Status {
    const int32_t splits =
        std::max(1, std::min(ctx.regime.attention_num_splits,
                             m->NumSplits(ctx.bucket, ctx.regime.max_context_len)));
    // A pipeline stage's graph is its part of the step: the last stage's prepare runs before
    // the first stage's graph (LaunchStep).
    if (!m->whole_model())
      return m->EnqueueStageDecode(ctx.bucket, splits, s, m->capture_observer());
    TS_RETURN_IF_ERROR(m->EnqueueDecodeStep(ctx.bucket, splits, s, m->capture_observer()));
    // The loop's next step is decided and launched from this step's own last node, so two steps
    // are one graph boundary apart (docs/device-loop.md, One step boundary).
    if (loop != nullptr) TS_RETURN_IF_ERROR(loop->EnqueueScheduler(s));
    return absl::OkStatus();
  };
  auto cache = std::make_unique<graphs::GraphCache>(std::move(g));
  TS_RETURN_IF_ERROR(cache->Build(stream));
  if (options.log_progress) {
    const graphs::BuildStats& st = cache->build_stats();
    std::fprintf(stderr,
                 "cuda backend: %d decode graphs on device %d, %lld nodes, capture %.1f ms, "
                 "instantiate %.1f ms, upload %.1f ms, graph memory ~%.1f MiB\n",
                 cache->num_buckets(), device, static_cast<long long>(st.total_nodes),
                 st.capture_ms, st.instantiate_ms, st.upload_ms,
                 static_cast<double>(st.graph_memory_bytes) / (1 << 20));
  }
  return cache;
}

// ---------------------------------------------------------------------------------------------
// Prefill

absl::Status CudaBackend::ValidateInit(const SlotInit& in) const {
  TS_RETURN_IF_ERROR(ValidateSlotInit(in, info_));
  const std::string where = absl::StrCat("prefill slot ", in.slot, ": ");
  if (table_->state(in.slot) != SlotState::kFree) {
    return absl::FailedPreconditionError(absl::StrCat(where, "not FREE"));
  }
  const int64_t tokens = static_cast<int64_t>(in.prompt.size()) + in.stop.max_new_tokens;
  if (tokens > model_->max_context()) {
    return absl::InvalidArgumentError(absl::StrCat(where, "prompt + max_new_tokens = ", tokens,
                                                   " exceeds max_context ", model_->max_context()));
  }
  // The device slot row holds a fixed number of stop ids.
  if (in.stop.stop_token_ids.size() > static_cast<size_t>(k::kMaxStopIds)) {
    return absl::InvalidArgumentError(absl::StrCat(where, in.stop.stop_token_ids.size(),
                                                   " stop ids; the CUDA backend holds up to ",
                                                   k::kMaxStopIds));
  }
  return absl::OkStatus();
}

void CudaBackend::ResetSlotHost(SlotId slot) {
  // No kernel touches these for a slot that is not ACTIVE on the device, and the slot's staging
  // (which makes it so) is enqueued only after this returns.
  table_->ResetForRequest(slot);
  std::atomic_ref<int32_t>(device_slots_->host().done[slot]).store(0, std::memory_order_relaxed);
  // A cancel for the slot's previous request (one that had finished) must not end this one.
  if (!cancel_pending_.empty()) {
    std::atomic_ref<int32_t>(cancel_pending_[slot]).store(0, std::memory_order_relaxed);
  }
}

// The slot's device row from its request, published through staging row `index`
// (DeviceSlots::Stage).
absl::Status CudaBackend::StageSlot(const SlotInit& in, int32_t index, int32_t device_state,
                                    cudaStream_t stream) {
  k::SlotRow row;
  row.state = device_state;
  row.prompt_len = static_cast<int32_t>(in.prompt.size());
  row.generated = 0;
  row.last_token = -1;
  row.seq = 0;
  row.max_new_tokens = in.stop.max_new_tokens;
  row.min_new_tokens = in.stop.min_new_tokens;
  row.ignore_eos = in.stop.ignore_eos ? 1 : 0;
  row.num_stop_ids = static_cast<int32_t>(in.stop.stop_token_ids.size());
  std::copy(in.stop.stop_token_ids.begin(), in.stop.stop_token_ids.end(), row.stop_ids);
  const uint64_t deadline = GpuDeadline(in.stop.deadline);
  row.deadline_lo = static_cast<uint32_t>(deadline);
  row.deadline_hi = static_cast<uint32_t>(deadline >> 32);
  row.sampling = ToSamplingRow(in.sampling, 0);
  return device_slots_->Stage(row, in.block_table, in.prompt, in.slot, index, stream);
}

absl::Status CudaBackend::Prefill(std::span<const SlotInit> inits) {
  if (inits.empty()) return absl::OkStatus();
  TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(options_.device));
  if (inits.size() > static_cast<size_t>(info_.max_slots)) {
    return absl::InvalidArgumentError("prefill: more slots than max_slots");
  }
  for (size_t i = 0; i < inits.size(); ++i) {
    TS_RETURN_IF_ERROR(ValidateInit(inits[i]));
    for (size_t j = 0; j < i; ++j) {
      if (inits[j].slot == inits[i].slot) {
        return absl::InvalidArgumentError(
            absl::StrCat("prefill slot ", inits[i].slot, ": listed twice"));
      }
    }
  }
  // No step may be in flight while slots are staged and the stream prefills.
  if (grouped()) TS_RETURN_IF_ERROR(SettleGroups());
  for (const SlotInit& in : inits) ResetSlotHost(in.slot);
  if (options_.device_loop) {
    QueuePrefills(inits);  // Run(kLoop) prefills them between decode steps
    return absl::OkStatus();
  }
  TS_RETURN_IF_ERROR(PrefillNow(inits));
  for (const SlotInit& in : inits) {
    Slot& s = slots_[in.slot];
    table_->set_state(in.slot, SlotState::kActive);
    s.prompt_len = static_cast<int32_t>(in.prompt.size());
    s.generated = 1;
  }
  AfterStep({});
  return absl::OkStatus();
}

absl::Status CudaBackend::PrefillNow(std::span<const SlotInit> inits) {
  cudaStream_t stream = stream_;
  std::vector<PrefillSeq> seqs;
  std::vector<int32_t> slot_ids;
  std::vector<k::SamplingRow> params;
  for (size_t i = 0; i < inits.size(); ++i) {
    const SlotInit& in = inits[i];
    TS_RETURN_IF_ERROR(StageSlot(in, static_cast<int32_t>(i), k::kSlotActive, stream));
    seqs.push_back(PrefillSeq{in.prompt, in.block_table});
    slot_ids.push_back(in.slot);
    params.push_back(ToSamplingRow(in.sampling, in.prompt.size()));
  }
  TS_RETURN_IF_ERROR(EnqueuePrefillStages(seqs));
  TS_RETURN_IF_ERROR(model_->EnqueuePrefillSample(FirstTokens{.slots = slot_ids,
                                                              .params = params,
                                                              .from_state = k::kSlotActive,
                                                              .to_state = k::kSlotActive},
                                                  stream));
  // The engine drains the first tokens right after Prefill returns, and the staging rows are
  // free again after this.
  TS_RETURN_IF_ERROR(WaitStream());
  return CheckErrorFlag("prefill");
}

// ---------------------------------------------------------------------------------------------
// Decode

absl::StatusOr<int32_t> CudaBackend::StageRows() {
  table_->Rows(SlotState::kActive, &rows_);
  const int32_t n = static_cast<int32_t>(rows_.size());
  if (n == 0) return -1;
  TS_ASSIGN_OR_RETURN(const int32_t index, graphs_->BucketIndexFor(n));
  const int32_t bucket = options_.buckets[index];
  int32_t* staging = model_->host().row_slots;
  std::copy(rows_.begin(), rows_.end(), staging);
  std::fill(staging + n, staging + bucket, -1);
  return index;
}

absl::Status CudaBackend::MaybeUpdateRegime() {
  const int32_t current = graphs_->regime().max_context_len;
  const int32_t next = NextRegime(current, max_active_context(), model_->max_context());
  if (next == current) return absl::OkStatus();
  return UpdateRegimeAll(RegimeFor(next));
}

graphs::Regime CudaBackend::RegimeFor(int32_t bound) const {
  return graphs::Regime{.attention_num_splits = model_->NumSplits(options_.buckets.front(), bound),
                        .max_context_len = bound};
}

absl::Status CudaBackend::Run(RunMode mode) {
  // The engine thread that calls Run is not the thread that created the backend.
  TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(options_.device));
  if (options_.device_loop) {
    if (mode != RunMode::kLoop) {
      return absl::FailedPreconditionError(
          "run: this backend runs the device loop; host-driven steps need device_loop = false");
    }
    return RunLoop();
  }
  if (grouped()) {
    do {
      TS_RETURN_IF_ERROR(RunGroups());
    } while (mode == RunMode::kLoop && last_.active > 0);
    return absl::OkStatus();
  }
  TS_RETURN_IF_ERROR(MaybeCalibrateClock());  // after the last step's sync: the GPU is idle
  do {
    TS_ASSIGN_OR_RETURN(const int32_t index, StageRows());
    if (index < 0) {
      last_ = StepReport{};
      return absl::OkStatus();
    }
    const int32_t bucket = options_.buckets[index];
    TS_RETURN_IF_ERROR(MaybeUpdateRegime());
    TS_RETURN_IF_ERROR(LaunchStep(index));
    // Host-driven mode: one synchronisation per step, on our stream (a pipeline's last stage,
    // which waited for every stage before it), so that every ring record and done flag of the
    // step is visible before the engine drains and picks the next batch. This is the baseline
    // the device-resident loop (no host call between steps) is measured against, and the
    // fallback.
    TS_RETURN_IF_ERROR(WaitStream());
    TS_RETURN_IF_ERROR(CheckErrorFlag("decode step"));
    AfterStep(rows_);
    last_ = StepReport{.active = static_cast<int32_t>(rows_.size()), .bucket = bucket};
    ++steps_;
  } while (mode == RunMode::kLoop);
  return absl::OkStatus();
}

void CudaBackend::AfterStep(const std::vector<SlotId>& rows) {
  for (SlotId id : rows) ++slots_[id].generated;
  int32_t* done = device_slots_->host().done;  // [max_slots] host-mapped, written by postprocess
  for (SlotId i = 0; i < info_.max_slots; ++i) {
    if (table_->state(i) != SlotState::kActive) continue;
    if (std::atomic_ref<int32_t>(done[i]).load(std::memory_order_acquire) != 0) {
      table_->set_state(i, SlotState::kFinished);
    }
  }
}

absl::Status CudaBackend::CheckErrorFlag(const char* where) const {
  int32_t flag =
      std::atomic_ref<int32_t>(model_->host().error_flag[0]).load(std::memory_order_acquire);
  for (const Upstream& u : upstream_) {
    flag |= std::atomic_ref<int32_t>(u.model->host().error_flag[0]).load(std::memory_order_acquire);
  }
  if (flag == 0) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(where,
                   ": a kernel flagged an out-of-range token id, KV slot, block-table entry or "
                   "sampling slot (a bug upstream of the GPU; the backend is no longer trusted)"));
}

absl::StatusOr<std::vector<std::pair<std::string, float>>> CudaBackend::ProfileStep() {
  if (options_.device_loop) return absl::FailedPreconditionError("ProfileStep: host-driven only");
  if (pipeline_ != nullptr) return absl::FailedPreconditionError("ProfileStep: one stage only");
  TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(options_.device));
  if (grouped()) TS_RETURN_IF_ERROR(SettleGroups());
  TS_ASSIGN_OR_RETURN(const int32_t index, StageRows());
  if (index < 0) return absl::FailedPreconditionError("ProfileStep: no active slot");
  const int32_t bucket = options_.buckets[index];
  const int32_t splits = model_->NumSplits(bucket, RegimeBound(max_active_context()));
  TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(model_->dev().decode_head.row_slots,
                                          model_->host().row_slots, bucket * sizeof(int32_t),
                                          cudaMemcpyHostToDevice, stream_));
  timer_->Reset();
  TS_RETURN_IF_ERROR(model_->EnqueueDecodeStep(bucket, splits, stream_, timer_.get()));
  // Profiling is host-driven like Run: wait for the step so the events can be read.
  TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  TS_RETURN_IF_ERROR(CheckErrorFlag("profiled decode step"));
  AfterStep(rows_);
  last_ = StepReport{.active = static_cast<int32_t>(rows_.size()), .bucket = bucket};
  return timer_->Read();
}

absl::StatusOr<std::vector<float>> CudaBackend::PromptLogits(std::span<const int32_t> tokens) {
  if (num_active() > 0) return absl::FailedPreconditionError("PromptLogits: slots are active");
  TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(options_.device));
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= info_.model.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("PromptLogits: token[", i, "] = ", tokens[i], " outside the vocabulary"));
    }
  }
  const int64_t need =
      (static_cast<int64_t>(tokens.size()) + info_.kv_block_size - 1) / info_.kv_block_size;
  if (need > info_.num_kv_blocks) return absl::InvalidArgumentError("PromptLogits: too long");
  std::vector<int32_t> table(need);
  for (int32_t i = 0; i < need; ++i) table[i] = i;
  if (ring_ != nullptr) {
    return absl::FailedPreconditionError("PromptLogits: not across processes");
  }
  if (!upstream_.empty()) {
    // One chunk through the stages before the last, whose PromptLogits runs it on from there.
    if (tokens.size() > static_cast<size_t>(model_->plan().shape.prefill_rows)) {
      return absl::InvalidArgumentError("PromptLogits: a pipeline takes one prefill chunk");
    }
    const PrefillSeq seq{tokens, table};
    const int last = static_cast<int>(upstream_.size());
    for (int s = 0; s < last; ++s) {
      Upstream& u = upstream_[s];
      {
        TS_ASSIGN_OR_RETURN(graphs::DeviceGuard g, graphs::DeviceGuard::Set(u.device));
        TS_RETURN_IF_ERROR(u.model->EnqueuePrefill({&seq, 1}, u.stream));
      }
      CudaModel& next = s + 1 < last ? *upstream_[s + 1].model : *model_;
      const DeviceBytes from = u.model->PrefillHidden(static_cast<int32_t>(tokens.size()));
      const DeviceBytes to = next.PrefillHidden(static_cast<int32_t>(tokens.size()));
      TS_RETURN_IF_ERROR(links_->Move(s, s + 1, {&from, 1}, {&to, 1}));
    }
  }
  TS_ASSIGN_OR_RETURN(std::vector<float> logits, model_->PromptLogits(tokens, table, stream_));
  TS_RETURN_IF_ERROR(CheckErrorFlag("prompt logits"));
  return logits;
}

absl::StatusOr<std::vector<std::vector<float>>> CudaBackend::DecodeLogits(
    std::span<const std::vector<int32_t>> prompts, int32_t prefill_len) {
  if (options_.device_loop) return absl::FailedPreconditionError("DecodeLogits: host-driven only");
  if (num_active() > 0) return absl::FailedPreconditionError("DecodeLogits: slots are active");
  TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(options_.device));
  const int32_t n = prompts.empty() ? 0 : static_cast<int32_t>(prompts[0].size());
  if (prompts.empty() || prompts.size() > static_cast<size_t>(info_.max_slots)) {
    return absl::InvalidArgumentError(
        absl::StrCat("DecodeLogits: ", prompts.size(), " prompts; must be in [1, max_slots]"));
  }
  if (prefill_len < 1 || prefill_len >= n) {
    return absl::InvalidArgumentError(absl::StrCat("DecodeLogits: prefill_len ", prefill_len,
                                                   " must be in [1, prompt length ", n, ")"));
  }
  const int32_t steps = n - prefill_len;
  // The prefill samples one token and each step one more: the last step ends on max_new_tokens.
  const int32_t max_new = steps + 1;
  const int32_t blocks = (n + 1 + info_.kv_block_size - 1) / info_.kv_block_size;
  if (static_cast<int64_t>(blocks) * static_cast<int64_t>(prompts.size()) > info_.num_kv_blocks) {
    return absl::InvalidArgumentError("DecodeLogits: the prompts do not fit the KV pool");
  }
  std::vector<std::vector<int32_t>> tables(prompts.size());
  std::vector<SlotInit> inits(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (static_cast<int32_t>(prompts[i].size()) != n) {
      return absl::InvalidArgumentError("DecodeLogits: prompts of different lengths");
    }
    tables[i].resize(blocks);
    for (int32_t b = 0; b < blocks; ++b) tables[i][b] = static_cast<int32_t>(i) * blocks + b;
    SlotInit& in = inits[i];
    in.slot = static_cast<SlotId>(i);
    in.prompt = std::span<const int32_t>(prompts[i]).first(prefill_len);
    in.block_table = tables[i];
    in.sampling.temperature = 0.0f;
    in.stop.max_new_tokens = max_new;
    in.stop.ignore_eos = true;
  }
  TS_RETURN_IF_ERROR(Prefill(inits));
  // Teacher forcing needs every row in every step: no row groups (none is in flight, no slot
  // was active).
  single_group_ = true;
  struct Regroup {
    bool& flag;
    ~Regroup() { flag = false; }
  } regroup{single_group_};

  const int32_t vocab = info_.model.vocab_size;
  std::vector<std::vector<float>> out(prompts.size(),
                                      std::vector<float>(static_cast<size_t>(steps) * vocab));
  for (int32_t step = 0; step < steps; ++step) {
    // The teacher's token replaces the one the last step sampled (the slot row's only field the
    // next step reads as its input). Pageable sources: the copies are staged before returning.
    for (size_t i = 0; i < prompts.size(); ++i) {
      const int32_t token = prompts[i][prefill_len + step];
      if (token < 0 || token >= vocab) {
        return absl::InvalidArgumentError(absl::StrCat("DecodeLogits: prompt ", i, " token ",
                                                       prefill_len + step, " outside the vocab"));
      }
      TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&device_slots_->dev().slots[i].last_token, &token,
                                              sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    }
    TS_RETURN_IF_ERROR(Run(RunMode::kOneStep));
    if (last_.active != static_cast<int32_t>(prompts.size())) {
      return absl::InternalError(absl::StrCat("DecodeLogits: step ", step, " decoded ",
                                              last_.active, " rows, not ", prompts.size()));
    }
    // Row r of the step is slot r: StageRows lists the active slots in ascending order. Run
    // synchronised the stream, so the step's logits are complete.
    for (size_t i = 0; i < prompts.size(); ++i) {
      TS_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(out[i].data() + static_cast<size_t>(step) * vocab,
                     model_->dev().decode_head.logits_f32 + i * static_cast<size_t>(vocab),
                     static_cast<size_t>(vocab) * sizeof(float), cudaMemcpyDeviceToHost));
    }
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (table_->state(static_cast<SlotId>(i)) != SlotState::kFinished) {
      return absl::InternalError(absl::StrCat("DecodeLogits: slot ", i, " did not finish"));
    }
    Release(static_cast<SlotId>(i));
  }
  // The values the sampler uses, as PromptLogits returns them.
  for (std::vector<float>& rows : out) {
    for (float& v : rows) v = Bf16ToF32(F32ToBf16(v));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Slots

// Cancel, Ring and Release touch only host memory (the mapped cancel/done flags, the rings) and
// make no CUDA call, so they need no current device and stay cheap for any thread.
void CudaBackend::Cancel(SlotId slot) {
  TS_CHECK_GE(slot, 0);
  TS_CHECK_LT(slot, info_.max_slots);
  // Read by the postprocess kernel of the next step through the mapped alias. A FREE or
  // FINISHED slot ignores it; Prefill clears it for the next request. With row groups it waits
  // for the slot's group to launch next (cancel_pending_).
  if (!cancel_pending_.empty()) {
    std::atomic_ref<int32_t>(cancel_pending_[slot]).store(1, std::memory_order_release);
    return;
  }
  table_->set_cancelled(slot, true);
}

const TokenRing& CudaBackend::Ring(SlotId slot) const {
  TS_CHECK_GE(slot, 0);
  TS_CHECK_LT(slot, info_.max_slots);
  return table_->ring(slot);
}

void CudaBackend::Release(SlotId slot) {
  TS_CHECK_GE(slot, 0);
  TS_CHECK_LT(slot, info_.max_slots);
  // The device row is left as the GPU last wrote it: a slot that is not ACTIVE on the host is
  // never put in a row list, so the GPU does not touch it until the next Prefill rewrites it.
  slots_[slot] = Slot{};
  if (!group_of_.empty()) group_of_[slot] = -1;
  if (!cancel_pending_.empty()) {
    std::atomic_ref<int32_t>(cancel_pending_[slot]).store(0, std::memory_order_relaxed);
  }
  table_->ResetForRequest(slot);
  std::atomic_ref<int32_t>(device_slots_->host().done[slot]).store(0, std::memory_order_relaxed);
  table_->set_state(slot, SlotState::kFree);
}

int32_t CudaBackend::num_active() const {
  return table_->Count(SlotState::kActive);
}

int32_t CudaBackend::max_active_context() const {
  int32_t best = 0;
  for (SlotId i = 0; i < info_.max_slots; ++i) {
    const Slot& s = slots_[i];
    if (table_->state(i) == SlotState::kActive) best = std::max(best, s.prompt_len + s.generated);
  }
  return best;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const CudaBackendOptions& options) {
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> backend, CudaBackend::Create(options));
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace ts
