// The CUDA backend: engine/backend.h over a CudaModel, in one of two modes fixed at creation.
// With device_loop, the device-resident loop (docs/device-loop.md, cuda_backend_loop.cc): a
// scheduler kernel tail-launches the bucket graphs step after step, and Prefill runs on a thread
// and stream of its own. Host-driven (docs/architecture.md, Host-driven mode): each
// Run(kOneStep) writes the bucket's row list, launches that bucket's captured decode graph from
// the GraphCache and synchronises once. Slot and ring semantics are the
// CPU backend's (engine/cpu_backend.h): the first token is sampled by Prefill at position
// prompt_len, each step samples at prompt_len + generated, and the postprocess kernel applies the
// stop rule (CheckStop) and the cancel flag on the GPU, writing (seq, token, flags) records into
// per-slot rings in host-mapped memory.
//
// Attention splits follow the context-length regime (regime_policy.h): when the longest active
// context crosses a regime boundary, the backend calls GraphCache::UpdateRegime (exec update in
// place, never a re-instantiation); the device loop switches at exactly that step to the regime
// the host prepared and offered, or exits there so that the host can update.
//
// Pipeline parallelism (options.stages, docs/pipeline.md, The CUDA pipeline): the model is split
// into stages, each a CudaModel with its own graphs, KV pool and stream on its own GPU, linked by
// StageLinks (stage_link.h). The last stage holds the slot table, the rings and sampling; a
// host-driven step runs its prepare, moves the rows' inputs to the other stages and launches each
// stage's graph in turn with the hidden state moved between them (cuda_backend_stages.cc).
//
// Threading: one caller at a time, on any thread. Every entry that makes a CUDA call (Create,
// Prefill, Run, ProfileStep, PromptLogits, the destructor) makes options.device current for its
// duration and restores the caller's device: the engine thread that decodes is not the thread
// that created the backend, and on a multi-GPU host its current device is not ours. With
// device_loop, Prefill only queues the prompts; Run(kLoop) prefills them between decode steps,
// one bounded chunk at a time, on the loop's own stream (cuda_backend_loop.cc).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/cuda/cuda_model.h"
#include "engine/cuda/loop_policy.h"
#include "engine/cuda/stage_link.h"
#include "engine/cuda/stage_pipeline.h"
#include "engine/pipeline/stage_transport.h"
#include "engine/prefill_queue.h"
#include "engine/slot_table.h"
#include "graphs/graph_cache.h"

namespace ts {
namespace graphs {
class DeviceLoop;
}  // namespace graphs

// One stage of a CUDA pipeline: which part of the model, on which GPU.
struct CudaStageOptions {
  ModelStage stage;
  int device = 0;
};

// A CUDA pipeline across processes (docs/pipeline.md, Across processes; cuda_ranks.h): one
// stage per process. world_size 1 is one process.
struct CudaRankOptions {
  int32_t rank = 0;
  int32_t world_size = 1;
  // Rank 0 listens there for the others' rendezvous (port 0 picks one, see on_listening).
  std::string leader_host = "127.0.0.1";
  int32_t leader_port = 0;
  std::function<void(int32_t port)> on_listening;
  std::function<void(const std::string& line)> log;  // the startup lines; null: stderr
};

struct CudaBackendOptions {
  std::filesystem::path model_dir;
  int32_t max_slots = 64;
  int32_t kv_block_size = 16;
  double gpu_memory_fraction = 0.9;
  // Sorted ascending; the largest must be >= max_slots. One captured graph per bucket.
  std::vector<int32_t> buckets = {1, 2, 4, 8, 16, 24, 32, 48, 64};
  int32_t max_context = 0;  // tokens per sequence; 0 = the model's max_position_embeddings
  int device = 0;
  int32_t prefill_chunk_tokens = 2048;  // rows of the prefill buffers: the largest chunk
  // Device loop: the rows of a mixed step, decode and prompt, while prompts wait beside decoding
  // streams (docs/device-loop.md, mixed steps); >= 1, capped at prefill_chunk_tokens. The prompts
  // get at least a quarter of it.
  int32_t prefill_step_tokens = 256;
  // Device loop: once a prompt has waited longer than prefill_catchup_after behind the ones ahead
  // of it, mixed steps hold prefill_catchup_tokens rows until that backlog is through
  // (MixedStepPromptRows, engine/cuda/loop_policy.h; docs/device-loop.md, Catching up after a
  // burst). 0: off, the default.
  int32_t prefill_catchup_tokens = 384;
  std::chrono::milliseconds prefill_catchup_after{0};
  uint32_t ring_capacity = 1024;
  // The device-resident loop (docs/device-loop.md): Run(kLoop) keeps a scheduler kernel
  // tail-launching the bucket graphs with no host call between steps, and prefills new prompts
  // between steps in chunks no longer than one step. false: host-driven, Run(kOneStep) launches
  // one step and synchronises (the baseline and the fallback).
  bool device_loop = false;
  bool log_progress = true;                    // memory budget and graph capture progress on stderr
  OpObserver* capture_observer = nullptr;      // benchmarks only, see CudaModelOptions
  int32_t attention_min_split_tokens = 64;     // see CudaModelOptions
  kernels::StepStamps* step_stamps = nullptr;  // benchmarks only, see CudaModelOptions
  // Pipeline parallelism (docs/pipeline.md, The CUDA pipeline): the model split over these
  // stages, in layer order, each a CudaModel on its own device (engine/pipeline/stage_plan.h
  // plans them; ValidateStages below says what they must be). Empty: the whole model on
  // `device`. Host-driven only (device_loop = false). gpu_memory_fraction applies to each GPU.
  std::vector<CudaStageOptions> stages;
  // Bounds NCCL's setup, each NCCL call between the stages and each host-driven step's wait
  // (StageLinks); across processes also the ranks' rendezvous and each message between them.
  std::chrono::milliseconds link_timeout{60000};
  // Host-driven decode in this many row groups, each with its own step cycle (docs/pipeline.md,
  // Micro-batches in decode): Run(kOneStep) completes the oldest group's step and relaunches it,
  // so that on a pipeline one group's step runs on some stages while another's runs on the
  // rest. 0: one group per pipeline stage, and 1 for a whole model, where groups only split the
  // batch (tests compare a pipeline with a whole model in the same groups).
  int32_t decode_groups = 0;
  // world_size > 1: this process is rank 0 of a pipeline across processes, holding the last
  // stage of a plan over world_size stages on `device` (stages stays empty); ranks 1.. run
  // RunCudaWorker (cuda_ranks.h). Host-driven only.
  CudaRankOptions ranks;
};

// A pipeline's stages: contiguous layer ranges from layer 0 through the model's last, at least
// one layer each, the embedding on the first stage only and the head on the last only.
// InvalidArgument naming "stages[i]" otherwise. No stage at all is the whole model.
absl::Status ValidateStages(std::span<const CudaStageOptions> stages, int32_t num_layers);

// The stages of a CUDA pipeline, stage s on devices[s]: the layers split by bf16 weight bytes
// (pipeline::PlanStages, docs/pipeline.md). `description` gets the plan's lines for the startup
// log (pipeline::DescribePlan), with `kv_block_size`-token blocks. InvalidArgument naming
// "pipeline_stages" for fewer layers than devices.
absl::StatusOr<std::vector<CudaStageOptions>> PlanCudaStages(const ModelConfig& config,
                                                             std::span<const int> devices,
                                                             int32_t kv_block_size,
                                                             std::string* description);

// Weights generated on the device instead of read from model_dir (benchmarks).
struct RandomWeightsSpec {
  ModelConfig config;
  uint64_t seed = 1;
  float scale = 0.035f;  // linear weights U(-scale, scale): std 0.02 as HF initialises
};

class CudaBackend : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const CudaBackendOptions& options);
  // options.model_dir is ignored.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> CreateRandom(
      const CudaBackendOptions& options, const RandomWeightsSpec& spec);
  ~CudaBackend() override;

  const BackendInfo& info() const override { return info_; }
  absl::Status Prefill(std::span<const SlotInit> slots) override;
  absl::Status Run(RunMode mode) override;
  absl::Status Pause() override;
  absl::StatusOr<LoopStatus> Poll() override;
  void Cancel(SlotId slot) override;
  const TokenRing& Ring(SlotId slot) const override;
  void Release(SlotId slot) override;
  StepReport last_step() const override { return last_; }
  std::chrono::steady_clock::time_point PrefillStarted(SlotId slot) const override {
    return slots_[slot].prefill_started;
  }

  // For benchmarks and tests. model() is the last stage of a pipeline, on slot_table()'s GPU.
  CudaModel& model() { return *model_; }
  const DeviceSlots& slot_table() const { return *device_slots_; }
  int32_t num_stages() const { return pipeline_ != nullptr ? pipeline_->num_stages() : 1; }
  // Row groups of host-driven decode (CudaBackendOptions::decode_groups as resolved).
  int32_t decode_groups() const {
    return groups_.empty() ? 1 : static_cast<int32_t>(groups_.size());
  }
  // Bytes of weights one decode step reads, summed over this process's stages
  // (CudaModel::step_weight_bytes).
  size_t step_weight_bytes() const;
  // Across processes: OK while every link to the other ranks is up, else why not (thread-safe;
  // for the server's health loop, since a rank that dies while nothing runs fails no call).
  absl::Status pipeline_health() const;
  cudaStream_t stream() const { return stream_; }
  const graphs::GraphCache& graph_cache() const { return *graphs_; }
  int32_t num_active() const;
  // Device loop: pauses the loop and prefills every prompt queued so far, in the largest chunks,
  // returning once they have completed (benchmarks and tests that want a batch to start decoding
  // together). The next Run(kLoop) relaunches the loop.
  absl::Status WaitForPrefills();
  // Device loop: mixed steps enqueued so far (docs/device-loop.md, Mixed steps).
  uint64_t mixed_steps() const { return mixed_steps_; }
  // Device loop: attention regime changes so far (docs/device-loop.md, The attention regime),
  // those the scheduler made by itself and those for which the loop exited. Any thread.
  // `withdrawn` counts offers of a prepared regime taken back before the loop used them (the
  // regime wanted changed first).
  struct RegimeChanges {
    int32_t on_device = 0;
    int32_t exits = 0;
    int32_t withdrawn = 0;
  };
  RegimeChanges regime_changes() const {
    return {.on_device = flips_adopted_.load(std::memory_order_relaxed),
            .exits = context_exits_.load(std::memory_order_relaxed),
            .withdrawn = offers_withdrawn_.load(std::memory_order_relaxed)};
  }
  // The longest context (prompt + generated) among ACTIVE slots after the last step.
  int32_t max_active_context() const;
  // One decode step like Run(kOneStep), but host-launched op by op, each op timed with events.
  // Returns (op, milliseconds) in launch order.
  absl::StatusOr<std::vector<std::pair<std::string, float>>> ProfileStep();
  // Teacher-forced logits [tokens.size(), vocab] of one prompt (tests); needs no active slot.
  absl::StatusOr<std::vector<float>> PromptLogits(std::span<const int32_t> tokens);
  // Teacher-forced logits through the decode graphs (tests). Prompt i's first `prefill_len`
  // tokens are prefilled into slot i; then each later token of it is fed as the slot's input in
  // place of the sampled one, one captured decode step per position, every prompt in the same
  // step (the bucket that holds prompts.size() rows). Returns per prompt the logits
  // [len - prefill_len, vocab] of positions prefill_len .. len - 1, rounded to bf16 as the
  // sampler reads them. Prompts of one length; needs no active slot and leaves none.
  absl::StatusOr<std::vector<std::vector<float>>> DecodeLogits(
      std::span<const std::vector<int32_t>> prompts, int32_t prefill_len);

 private:
  // A slot's host-side state, ring and cancel flag are in table_ (engine/slot_table.h; the rings
  // and cancel flags in the pinned host-mapped block the GPU writes and reads): QUEUED while its
  // prompt waits for chunks (device loop only), ACTIVE once prefilled or its last chunk enqueued
  // (on the device READY or ACTIVE), FINISHED once the GPU's done flag (or the host's record for a
  // prompt cancelled before its last chunk) was seen.
  struct Slot {
    int32_t prompt_len = 0;
    int32_t generated = 0;  // host mirror of the device count, for the regime choice
    // Loop mode: when the first chunk holding the prompt was enqueued (unset before, and in
    // host-driven mode, where Prefill runs the prompt at once).
    std::chrono::steady_clock::time_point prefill_started;
  };

  // Stages before the last one of a pipeline (empty for a whole model). The last stage is
  // model_, graphs_ and stream_: it owns the slot table, the rings and sampling.
  struct Upstream {
    int device = 0;
    cudaStream_t stream = nullptr;
    std::unique_ptr<CudaModel> model;
    std::unique_ptr<graphs::GraphCache> graphs;
  };
  using LoadWeights = std::function<absl::Status(CudaModel&, cudaStream_t)>;
  friend absl::Status RunCudaWorker(const CudaBackendOptions& options);

  explicit CudaBackend(const CudaBackendOptions& options);
  // Create and CreateRandom: every stage's model, loaded by `load`, then Init.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Make(const CudaBackendOptions& options,
                                                           const ModelConfig& config,
                                                           const LoadWeights& load);
  // The decode graphs of one stage's model: the whole step, or the stage's part of it. With a
  // device loop, each whole step ends with the loop's scheduler node.
  static absl::StatusOr<std::unique_ptr<graphs::GraphCache>> BuildGraphs(
      const CudaBackendOptions& options, CudaModel& model, int device, cudaStream_t stream,
      const graphs::DeviceLoop* loop = nullptr);
  static CudaModelOptions StageModelOptions(const CudaBackendOptions& options,
                                            const ModelConfig& config,
                                            const CudaStageOptions& stage);
  void LogStages() const;  // a pipeline's stages, one line each, for the startup log
  // Across processes: joins the other ranks (cuda_ranks.cc) once this rank's stage is built.
  absl::Status ConnectRanks(const std::vector<CudaStageOptions>& plan);
  // Across processes: tells every worker what to run next (the leader's side of RunCudaWorker).
  absl::Status SendControl(pipeline::StageMessage m);
  // Across processes: sends the shutdown round the ring and waits for it to come back.
  void ShutdownRanks();
  // Host-driven: enqueues bucket `index`'s step over the row list in host().row_slots: through
  // every stage of a pipeline (the last stage's prepare, the rows' inputs to the others, each
  // stage's graph with the hidden state moved between them), or the whole model's graph.
  absl::Status LaunchStep(int32_t index);
  // Runs the prompts' chunks through every stage in turn, writing their KV (no sampling).
  absl::Status EnqueuePrefillStages(std::span<const PrefillSeq> seqs);
  absl::Status UpdateRegimeAll(const graphs::Regime& regime);
  // Host-driven: waits for everything on stream_, within link_timeout on an NCCL pipeline.
  absl::Status WaitStream();
  // Row groups (cuda_backend_groups.cc). A group's rows stay in it until released.
  struct Group {
    std::vector<SlotId> rows;  // its step in flight, or its last
    int32_t bucket = 0;
    int32_t* staging = nullptr;  // [max_slots] pinned: the row list its copies read
    cudaEvent_t done = nullptr;  // after its step's last stage
    bool in_flight = false;
    uint64_t order = 0;  // launch order; the oldest completes first
  };
  absl::Status InitGroups();
  // Run(kOneStep) with groups: launches every idle group that has rows, then completes the
  // oldest step in flight and relaunches its group.
  absl::Status RunGroups();
  absl::Status LaunchGroup(Group& g);
  absl::Status CompleteGroup(Group& g);
  // Completes every step in flight (before a prefill, a regime change or a test's call), then
  // deals the ACTIVE slots out to the groups afresh, in slot order.
  absl::Status SettleGroups();
  bool grouped() const { return groups_.size() > 1 && !single_group_; }
  absl::Status CreateStream();
  // Maps the host's steady clock onto %globaltimer, which the postprocess kernel reads for the
  // request deadlines (GpuDeadline). At creation, then every 10 s through MaybeCalibrateClock
  // from Run, where the GPU is idle.
  absl::Status CalibrateClock();
  absl::Status MaybeCalibrateClock();
  // StopParams::deadline on the GPU's clock; 0 for none.
  uint64_t GpuDeadline(std::chrono::steady_clock::time_point deadline) const;
  absl::Status Init(std::unique_ptr<CudaModel> model);
  absl::Status ValidateInit(const SlotInit& init) const;
  // Engine thread: clears the slot's ring and mapped cancel/done flags for a new request.
  void ResetSlotHost(SlotId slot);
  // Stages the slot's device row (state `device_state`), block table, prompt mask and count reset
  // from staging row `index`, on `stream`.
  absl::Status StageSlot(const SlotInit& init, int32_t index, int32_t device_state,
                         cudaStream_t stream);
  // Host-driven: stages, prefills and samples the first tokens of `inits` on stream_ (every
  // chunk at once), then waits for it.
  absl::Status PrefillNow(std::span<const SlotInit> inits);
  // Device loop (cuda_backend_loop.cc). InitLoop runs before the graphs are built (their last
  // node is the loop's scheduler), BindLoop after.
  absl::Status InitLoop();
  absl::Status BindLoop();
  void StopLoop();
  void QueuePrefills(std::span<const SlotInit> inits);
  // Stages and prefills the next chunk of at most max_rows prompt rows from the queue on
  // stream_, and samples the first token of each prompt it completes. With mixed_bucket > 0 the
  // chunk rides in a mixed step with that bucket's decode rows (the row list staged by
  // StageRows) and mixed_splits attention splits.
  absl::Status EnqueueChunk(int32_t max_rows, int32_t mixed_bucket = 0, int32_t mixed_splits = 1);
  // One mixed step (docs/device-loop.md, Mixed steps): the active slots decode one token while
  // the next chunk of queued prompts is prefilled through the same GEMMs. The loop is not
  // running; the model's staging must be free.
  absl::Status EnqueueMixedStep();
  // Prompts cancelled before their last chunk: dropped, with a FINISHED record written here.
  void DropCancelledPrefills();
  absl::Status LoopError();
  // Host slot states (decoded counts, FINISHED) from the rings and the GPU's done flags.
  void RefreshSlots();
  // Run(kLoop): carries out NextLoopAction (loop_policy.h) on what LoopView sees.
  absl::Status RunLoop();
  LoopState LoopView(bool staging_free) const;
  // Relaunches the loop on stream_ behind whatever it still runs, after a regime update if the
  // longest context left the current window.
  absl::Status LaunchLoop();
  // Active slots in ascending order; fills the row-list staging and returns the bucket index.
  absl::StatusOr<int32_t> StageRows();
  absl::Status MaybeUpdateRegime();
  // The graphs' regime for contexts up to `bound` (a RegimeBound).
  graphs::Regime RegimeFor(int32_t bound) const;
  // Device loop: the regime the idle execs should hold (ts::RegimeToPrepare over the slots'
  // next contexts): the one the loop's next launch will choose, the next one up near the
  // window's top, or the shrink that follows once the longer streams end.
  std::optional<graphs::Regime> RegimeToPrepare() const;
  // Device loop: while the loop, a chunk or mixed steps run, prepares RegimeToPrepare in the idle
  // execs (GraphCache::PrepareRegime), so that the running loop switches to it or the launch only
  // flips to it; withdraws a standing offer that is no longer that regime. One bucket per call
  // unless `whole` (GraphCache::PrepareRegimeStep).
  absl::Status MaybePrepareRegime(bool whole);
  // Device loop: offers the running loop the prepared regime (DeviceLoop::OfferFlip), so that it
  // switches at the step the host-driven mode would update instead of exiting; and, once it has
  // switched and the old execs no longer run, or a withdrawn offer is settled, records that
  // (GraphCache::AdoptDeviceFlip), so that another regime can be prepared.
  absl::Status MaybeOfferFlip();
  absl::Status MaybeAdoptFlip();
  FlipState FlipView() const;
  absl::Status CheckErrorFlag(const char* where) const;
  void AfterStep(const std::vector<SlotId>& rows);
  // ts::RegimeBound for this model.
  int32_t RegimeBound(int32_t context) const;

  CudaBackendOptions options_;
  BackendInfo info_;
  // The slot table on the last stage's GPU; declared before model_, which points at it.
  std::unique_ptr<DeviceSlots> device_slots_;
  std::unique_ptr<CudaModel> model_;
  std::unique_ptr<graphs::GraphCache> graphs_;
  std::vector<Upstream> upstream_;
  // Across processes: the ring to the other ranks (control, and the host links' bytes).
  std::unique_ptr<pipeline::StageTransport> ring_;
  std::unique_ptr<StageLinks> links_;        // between the stages of a pipeline
  std::unique_ptr<StagePipeline> pipeline_;  // a pipeline's launches and moves; null: one stage
  uint64_t control_id_ = 0;                  // the last control message's id, across processes
  std::vector<Group> groups_;                // empty: one step over every ACTIVE slot
  std::vector<int32_t> group_of_;            // [max_slots] the slot's group, -1 for none
  // [max_slots] with groups: a Cancel not yet handed to the GPU (atomic_ref). It is written into
  // the slot's mapped cancel word when the slot's group next launches, never while the group's
  // step may be reading it: so a cancel takes effect at that group's next step whatever the
  // timing, and two backends driven alike end a cancelled stream at the same token.
  std::vector<int32_t> cancel_pending_;
  bool single_group_ = false;           // DecodeLogits: one step over every row, groups or not
  int32_t* group_staging_ = nullptr;    // [groups * max_slots] pinned
  cudaStream_t feed_stream_ = nullptr;  // a pipeline's feed (StagePipeline::Decode)
  uint64_t launches_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaStream_t clock_stream_ = nullptr;  // CalibrateClock's
  uint64_t* clock_sample_ = nullptr;     // [1] device
  int64_t gpu_clock_offset_ns_ = 0;      // %globaltimer minus steady_clock, in ns
  std::chrono::steady_clock::time_point calibrated_at_{};
  std::vector<Slot> slots_;  // [max_slots]
  std::unique_ptr<SlotTable> table_;
  std::vector<SlotId> rows_;  // [active] this step's row list, reused (no per-step allocation)
  std::unique_ptr<OpTimer> timer_;
  StepReport last_;
  uint64_t steps_ = 0;  // host-driven steps that decoded >= 1 row

  // Device loop (cuda_backend_loop.cc). Only the caller's thread touches any of it.
  std::unique_ptr<graphs::DeviceLoop> loop_;
  cudaStream_t control_stream_ = nullptr;  // the pause word's memset (stream_ is the loop's)
  PrefillQueue prefill_queue_;
  cudaEvent_t chunk_end_ = nullptr;  // behind the last chunk
  bool chunk_pending_ = false;     // a chunk or mixed steps with no loop behind them may still run
  bool pause_requested_ = false;   // the pause word was set, its memset not yet waited for
  uint64_t launch_steps_ = 0;      // the loop's step counter at its last Launch
  bool flip_offered_ = false;      // an offer stands for the running launch (MaybeOfferFlip)
  bool withdraw_pending_ = false;  // the offer was withdrawn, and may yet have been taken
  uint64_t withdraw_steps_ = 0;    // the loop's step counter once the withdrawal had landed
  std::atomic<int32_t> flips_adopted_ = 0;  // the loop's flips() recorded in the graph cache
  std::atomic<int32_t> context_exits_ = 0;  // relaunches after the loop exited for a regime change
  std::atomic<int32_t> offers_withdrawn_ = 0;  // offers settled as not taken (MaybeAdoptFlip)
  uint64_t loop_launches_ = 0;                 // LaunchLoop's launches of the loop
  uint64_t mixed_steps_ = 0;       // mixed steps enqueued (each decodes every active slot)
  bool ready_unadmitted_ = false;  // a plain chunk made slots READY; no loop has run since
};

// Loads options.model_dir and builds the backend.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const CudaBackendOptions& options);

}  // namespace ts
