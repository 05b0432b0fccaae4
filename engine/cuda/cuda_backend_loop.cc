// CudaBackend's device-resident loop (docs/device-loop.md): the scheduler kernel of
// graphs/device_loop.cuh tail-launches the bucket graphs step after step; new prompts are
// prefilled in mixed steps; the engine thread only polls: it relaunches the loop after an exit,
// pauses it when a prompt arrives, enqueues the mixed steps and reads the done flags.
//
// Prefill between steps, not beside them: measured on the H200, a prefill on a stream of its own
// next to the loop's back-to-back tail-launched graphs got the SMs only in the cracks between
// decode kernels, and a burst of prompts waited up to one whole generation (~700 ms at 16 req/s)
// for its first token. So prefill runs on the loop's own stream, with the whole GPU.
//
// Mixed steps: while prompts wait and streams decode, the loop is off and the host enqueues
// mixed steps (CudaModel::EnqueueMixedStep): every active slot decodes one token while the next
// chunk of prompt rows rides in the same layer GEMMs, so the weights, most of a step's bytes,
// are read once for both. A step holds at most prefill_step_tokens rows, decode and prompt
// (vLLM's max_num_batched_tokens), so a stream's token interval grows by the chunk's compute
// only; prefill_catchup_tokens once prompts have queued behind others for longer than
// prefill_catchup_after (MixedStepPromptRows). The host stages the next mixed step as soon as the
// last one's copies have run, keeping about one step queued ahead of the GPU; when the queue is
// empty the loop is launched behind the last one. With nothing decoding, a prompt goes in plain
// chunks as large as the prefill buffers allow, and the loop launched behind the chunk admits its
// slots at its first step.
//
// Who writes a slot's device state: the chunk that holds a prompt's first piece stages it
// PREFILL; the postprocess after its last piece makes it READY for the loop's scheduler (a plain
// chunk) or ACTIVE (a mixed step: the next mixed step decodes it), or FINISHED on its first
// token; the scheduler kernel makes READY ACTIVE at a step boundary; a step's postprocess makes
// it FINISHED. The engine thread writes nothing on the device for a running slot: a cancel is
// the mapped flag the postprocess reads (or, for a prompt still waiting for its chunks, the
// backend drops it and writes the FINISHED record itself).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/loop_policy.h"
#include "engine/cuda/regime_policy.h"
#include "engine/cuda/sampling_row.h"
#include "graphs/device_guard.h"
#include "graphs/device_loop.cuh"
#include "kernels/cuda_check.h"

namespace ts {
namespace {

namespace k = ::ts::kernels;

// A mixed step's prompt row at position p costs 1 + (p + 1) / kMixedStepKeysPerRow rows of the
// step's budget (PrefillQueue::NextChunk). In FLOPs one row's GEMMs (2 x parameters) equal the
// attention over 30k keys on the 8B shape and 19k on the 1B shape (4 x layers x q_dim per key);
// the prefill attention kernel runs at a third to a half of the GEMMs' rate, so a row's GEMM
// work is worth some 6k-15k keys, and 8192 sits there (docs/device-loop.md, mixed steps).
// Without it a 32k prompt's last mixed steps cost several times its first ones: the streams
// beside it saw their token interval grow 2.2x over its prefill (engine_cuda_long_prefill_test).
constexpr int32_t kMixedStepKeysPerRow = 8192;

}  // namespace

absl::Status CudaBackend::InitLoop() {
  TS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&control_stream_, cudaStreamNonBlocking));
  TS_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&chunk_end_, cudaEventDisableTiming));
  graphs::DeviceLoopParams p;
  p.num_buckets = static_cast<int32_t>(options_.buckets.size());
  if (p.num_buckets > graphs::kDeviceLoopMaxBuckets) {
    return absl::InvalidArgumentError(absl::StrCat("buckets: the device loop takes at most ",
                                                   graphs::kDeviceLoopMaxBuckets, ", got ",
                                                   p.num_buckets));
  }
  for (int32_t i = 0; i < p.num_buckets; ++i) p.buckets[i] = options_.buckets[i];
  p.slots = device_slots_->dev().slots;
  p.num_slots = options_.max_slots;
  p.row_slots = model_->dev().decode_head.row_slots;
  p.stamps = options_.step_stamps;
  TS_ASSIGN_OR_RETURN(loop_, graphs::DeviceLoop::Create(p, stream_));
  TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::BindLoop() {
  return loop_->BindTable(graphs_->device_table());
}

void CudaBackend::StopLoop() {
  if (loop_ != nullptr) {
    (void)Pause();
    if (options_.log_progress && loop_launches_ > 0) {
      // How often the loop left the GPU idle for a regime update (bench/serving collects it).
      const RegimeChanges c = regime_changes();
      std::fprintf(stderr,
                   "tailserve: device loop: %llu steps, %llu mixed steps; attention regime "
                   "changes: %d on the device, %d by an exit, %d offers withdrawn\n",
                   static_cast<unsigned long long>(loop_->steps()),
                   static_cast<unsigned long long>(mixed_steps_), c.on_device, c.exits,
                   c.withdrawn);
    }
    loop_.reset();
  }
  if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);  // a chunk may still run
  if (control_stream_ != nullptr) (void)cudaStreamDestroy(control_stream_);
  control_stream_ = nullptr;
  if (chunk_end_ != nullptr) (void)cudaEventDestroy(chunk_end_);
  chunk_end_ = nullptr;
}

void CudaBackend::QueuePrefills(std::span<const SlotInit> inits) {
  const PrefillQueue::Clock::time_point now = PrefillQueue::Clock::now();
  for (const SlotInit& in : inits) {
    prefill_queue_.Push(in, now);
    Slot& s = slots_[in.slot];
    table_->set_state(in.slot, SlotState::kQueued);
    s.prompt_len = static_cast<int32_t>(in.prompt.size());
    s.generated = 0;
    s.prefill_started = {};
  }
}

absl::Status CudaBackend::EnqueueChunk(int32_t max_rows, int32_t mixed_bucket,
                                       int32_t mixed_splits) {
  // A mixed step's prompt rows also pay for their attention (kMixedStepKeysPerRow), so that a
  // step deep into a long prompt costs about what one near its start does.
  const std::vector<PrefillQueue::Piece> pieces =
      prefill_queue_.NextChunk(max_rows, mixed_bucket > 0 ? kMixedStepKeysPerRow : 0);
  std::vector<PrefillPiece> model_pieces;
  std::vector<int32_t> sample_slots;
  std::vector<k::SamplingRow> params;
  for (const PrefillQueue::Piece& p : pieces) {
    const SlotInit& in = *p.init;
    // Staging row = slot: a slot is staged once per request, so no later chunk's staging can
    // overwrite rows whose copies have not run yet.
    if (p.first) {
      TS_RETURN_IF_ERROR(StageSlot(in, in.slot, k::kSlotPrefill, stream_));
      slots_[in.slot].prefill_started = std::chrono::steady_clock::now();
    }
    int32_t head_row = -1;
    if (p.last) {
      head_row = static_cast<int32_t>(sample_slots.size());
      sample_slots.push_back(in.slot);
      params.push_back(ToSamplingRow(in.sampling, in.prompt.size()));
    }
    model_pieces.push_back(PrefillPiece{.tokens = in.prompt,
                                        .block_table = in.block_table,
                                        .start = p.start,
                                        .len = p.len,
                                        .head_row = head_row});
  }
  // A plain chunk's prompts become READY, for the loop launched behind it to admit at its first
  // step; a mixed step's become ACTIVE, for the next mixed step to decode (the loop is off).
  const FirstTokens first{.slots = sample_slots,
                          .params = params,
                          .from_state = k::kSlotPrefill,
                          .to_state = mixed_bucket > 0 ? k::kSlotActive : k::kSlotReady};
  if (mixed_bucket > 0) {
    TS_RETURN_IF_ERROR(
        model_->EnqueueMixedStep(mixed_bucket, mixed_splits, model_pieces, first, stream_));
  } else {
    TS_RETURN_IF_ERROR(model_->EnqueuePrefillChunk(model_pieces, first, stream_));
  }
  TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(chunk_end_, stream_));
  // From here on the host counts these slots as decoding (a first token that finishes one shows
  // in its done flag).
  for (int32_t slot : sample_slots) table_->set_state(slot, SlotState::kActive);
  if (mixed_bucket == 0 && !sample_slots.empty()) ready_unadmitted_ = true;
  prefill_queue_.PopFinished();
  chunk_pending_ = true;
  return absl::OkStatus();
}

absl::Status CudaBackend::EnqueueMixedStep() {
  // StageRows writes the row-list staging, which the last mixed step's copy may not have read
  // yet; the caller checked StagingFree. The host's ACTIVE set can include slots that finished
  // in a step still in flight: their rows are padding on the GPU (not ACTIVE there).
  TS_ASSIGN_OR_RETURN(const int32_t index, StageRows());
  TS_CHECK_GE(index, 0);
  const int32_t bucket = options_.buckets[index];
  std::optional<std::chrono::nanoseconds> backlog_wait;  // read only where catch-up is on
  if (options_.prefill_catchup_after.count() > 0) {
    if (const auto queued = prefill_queue_.oldest_unstarted()) {
      backlog_wait = PrefillQueue::Clock::now() - *queued;
    }
  }
  const int32_t prompt_rows =
      MixedStepPromptRows({.step_tokens = options_.prefill_step_tokens,
                           .catchup_tokens = options_.prefill_catchup_tokens,
                           .catchup_after = options_.prefill_catchup_after,
                           .chunk_tokens = options_.prefill_chunk_tokens},
                          bucket, backlog_wait);
  const int32_t splits = model_->NumSplits(bucket, RegimeBound(max_active_context()));
  TS_RETURN_IF_ERROR(EnqueueChunk(prompt_rows, bucket, splits));
  AfterStep(rows_);  // the host's decoded counts; RefreshSlots corrects them from the rings
  ++mixed_steps_;
  return absl::OkStatus();
}

void CudaBackend::DropCancelledPrefills() {
  if (prefill_queue_.empty()) return;
  for (SlotId i = 0; i < info_.max_slots; ++i) {
    if (table_->state(i) != SlotState::kQueued || !table_->cancelled(i)) continue;
    // A prompt whose last piece is already enqueued is cancelled by its first-token postprocess.
    if (prefill_queue_.Drop(i) == PrefillQueue::DropResult::kNotQueued) continue;
    // No kernel writes this slot's ring: its device row is PREFILL or not staged at all, which
    // the loop never admits. A chunk still in flight may write the slot's KV, but on the loop's
    // stream, before anything a later owner of those blocks enqueues.
    table_->set_state(i, SlotState::kFinished);  // before the entry, as every producer does
    table_->ring(i).Push(1, -1, RingFlags(FinishReason::kCancelled));
  }
}

absl::Status CudaBackend::WaitForPrefills() {
  TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(options_.device));
  TS_RETURN_IF_ERROR(Pause());
  DropCancelledPrefills();
  while (!prefill_queue_.empty()) TS_RETURN_IF_ERROR(EnqueueChunk(options_.prefill_chunk_tokens));
  TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  chunk_pending_ = false;
  TS_RETURN_IF_ERROR(CheckErrorFlag("prefill"));
  RefreshSlots();
  return absl::OkStatus();
}

absl::Status CudaBackend::LoopError() {
  TS_RETURN_IF_ERROR(loop_->status());
  return CheckErrorFlag("device loop");
}

void CudaBackend::RefreshSlots() {
  int32_t* done = device_slots_->host().done;
  for (SlotId i = 0; i < info_.max_slots; ++i) {
    Slot& s = slots_[i];
    if (table_->state(i) != SlotState::kActive) continue;
    // Records so far (one read per new one): the context the attention regime follows.
    RingEntry* e = table_->ring(i).entries();
    const uint32_t cap = table_->ring(i).capacity();
    for (uint32_t g = static_cast<uint32_t>(s.generated);; ++g) {
      const uint32_t seq =
          std::atomic_ref<uint32_t>(e[g % cap].seq).load(std::memory_order_relaxed);
      if (seq <= g) {
        s.generated = static_cast<int32_t>(g);
        break;
      }
    }
    if (std::atomic_ref<int32_t>(done[i]).load(std::memory_order_acquire) != 0) {
      table_->set_state(i, SlotState::kFinished);
    }
  }
}

LoopState CudaBackend::LoopView(bool staging_free) const {
  return LoopState{.loop_running = loop_->Running(),
                   .stepped_since_launch = loop_->steps() > launch_steps_,
                   .pause_requested = pause_requested_,
                   .prompts_queued = !prefill_queue_.empty(),
                   .staging_free = staging_free,
                   .decoding = num_active() > 0,
                   .ready_unadmitted = ready_unadmitted_};
}

absl::Status CudaBackend::RunLoop() {
  TS_RETURN_IF_ERROR(LoopError());
  DropCancelledPrefills();
  RefreshSlots();
  TS_RETURN_IF_ERROR(MaybeAdoptFlip());
  if (loop_->Running() || chunk_pending_) TS_RETURN_IF_ERROR(MaybePrepareRegime(false));
  TS_RETURN_IF_ERROR(MaybeOfferFlip());
  if (pause_requested_ && !loop_->Running()) {
    // The pause word must have landed before the next Launch clears it, or it could land after.
    TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(control_stream_));
    pause_requested_ = false;
  }
  // At most a plain chunk, then the launch behind it.
  for (int32_t round = 0; round < 2; ++round) {
    TS_ASSIGN_OR_RETURN(const bool staging_free, model_->StagingFree());
    switch (NextLoopAction(LoopView(staging_free))) {
      case LoopAction::kNone:
        return absl::OkStatus();
      case LoopAction::kRequestPause:
        TS_RETURN_IF_ERROR(loop_->RequestPause(control_stream_));
        pause_requested_ = true;
        return absl::OkStatus();
      case LoopAction::kMixedStep:
        return EnqueueMixedStep();
      case LoopAction::kPlainChunk:
        TS_RETURN_IF_ERROR(EnqueueChunk(options_.prefill_chunk_tokens));
        // Behind the chunk, not in the launch that follows: the GPU runs the chunk meanwhile,
        // and no stream decodes, so nothing waits for the whole capture.
        TS_RETURN_IF_ERROR(MaybePrepareRegime(true));
        continue;
      case LoopAction::kLaunch:
        return LaunchLoop();
    }
  }
  return absl::OkStatus();
}

std::optional<graphs::Regime> CudaBackend::RegimeToPrepare() const {
  // The loop exits when the longest context leaves its window, and the host-driven mode changes
  // regime at that same step. The regime it changes to is prepared in the idle execs, so that the
  // running loop switches to it by itself (MaybeOfferFlip) or, failing that, the launch after the
  // exit only flips to it. Capturing takes the host 1.4-3.5 ms (measured on the H200), which the
  // running loop, a chunk or the mixed steps queued ahead of the GPU hide, instead of the GPU
  // waiting on it. A queued prompt counts from the moment it is queued: a 32k prompt's regime
  // captured at the loop's relaunch behind its prefill was the longest interval of the streams
  // beside it (engine_cuda_long_prefill_test).
  RegimeOutlook o{.current = graphs_->regime().max_context_len,
                  .max_context = model_->max_context()};
  const int32_t lo = RegimeWindowLo(o.current);
  for (SlotId i = 0; i < info_.max_slots; ++i) {
    const SlotState state = table_->state(i);
    int32_t next = 0;  // the context of the slot's next decode step
    if (state == SlotState::kActive) next = slots_[i].prompt_len + slots_[i].generated + 1;
    if (state == SlotState::kQueued) next = slots_[i].prompt_len + 1;
    o.longest = std::max(o.longest, next);
    if (next <= lo) o.rest = std::max(o.rest, next);
  }
  const std::optional<int32_t> bound = ts::RegimeToPrepare(o);
  if (!bound) return std::nullopt;
  return RegimeFor(*bound);
}

absl::Status CudaBackend::MaybePrepareRegime(bool whole) {
  // The running loop may switch to the offered execs at any step: they stay as they are, unless
  // the regime wanted has changed (a shrink's remaining contexts outgrew its bound, or the longest
  // stream neared the top after all), in which case the offer is withdrawn first.
  if (flip_offered_ && !withdraw_pending_ && loop_->Running() &&
      RegimeToPrepare() != graphs_->prepared()) {
    TS_RETURN_IF_ERROR(loop_->WithdrawOffer(control_stream_));
    withdraw_pending_ = true;
    withdraw_steps_ = loop_->steps();  // a step claimed after this one saw the cleared word
  }
  TS_RETURN_IF_ERROR(MaybeAdoptFlip());  // the idle execs are the host's idea of them again
  if (flip_offered_ && loop_->Running()) return absl::OkStatus();
  // While the loop runs, only once it has stepped: the last flip, before its launch on the same
  // stream, has then run, and PrepareRegime does not wait for it. Once the loop has exited, its
  // flip has run too.
  if (loop_->Running() && loop_->steps() <= launch_steps_) return absl::OkStatus();
  const std::optional<graphs::Regime> regime = RegimeToPrepare();
  if (!regime) return absl::OkStatus();
  // Unless `whole`, one bucket per call: the engine thread drains the rings between calls, and a
  // whole capture held the streams' tokens back for ~3 ms (engine_cuda_long_prefill_test saw
  // that interval as its longest).
  if (whole) return graphs_->PrepareRegime(*regime);  // a no-op when prepared
  return graphs_->PrepareRegimeStep(*regime).status();
}

FlipState CudaBackend::FlipView() const {
  const std::optional<graphs::Regime>& prepared = graphs_->prepared();
  return FlipState{.loop_running = loop_->Running(),
                   .stepped_since_launch = loop_->steps() > launch_steps_,
                   .offered = flip_offered_,
                   .flips = loop_->flips(),
                   .flips_adopted = flips_adopted_.load(std::memory_order_relaxed),
                   .steps = loop_->steps(),
                   .flip_step = loop_->flip_step(),
                   .prompts_queued = !prefill_queue_.empty(),
                   .wanted_prepared = prepared.has_value() && prepared == RegimeToPrepare()};
}

// Both run on every pass of the engine thread: the common case returns after one host read.
absl::Status CudaBackend::MaybeOfferFlip() {
  if (flip_offered_ || !ShouldOfferFlip(FlipView())) return absl::OkStatus();
  const int32_t hi = graphs_->prepared()->max_context_len;
  TS_ASSIGN_OR_RETURN(const cudaGraphExec_t* table, graphs_->PreparedTable(control_stream_));
  // The scheduler takes it where RegimeBound gives hi, the host-driven mode's choice, from
  // whichever side the longest context leaves the window.
  TS_RETURN_IF_ERROR(
      loop_->OfferFlip(table, RegimeTakeLo(hi), RegimeWindowLo(hi), hi, control_stream_));
  flip_offered_ = true;
  return absl::OkStatus();
}

absl::Status CudaBackend::MaybeAdoptFlip() {
  if (withdraw_pending_) {
    // Running first, then the step counter, then flips: a scheduler writes flips before the
    // step counter, and one that claims a step after withdraw_steps_ read the cleared word.
    const bool running = loop_->Running();
    if (!WithdrawalSettled(running, loop_->steps(), withdraw_steps_)) return absl::OkStatus();
    withdraw_pending_ = false;
    if (loop_->flips() == flips_adopted_.load(std::memory_order_relaxed)) {
      flip_offered_ = false;
      offers_withdrawn_.fetch_add(1, std::memory_order_relaxed);
      return absl::OkStatus();
    }
    // Taken just before the clear landed: recorded below, as any switch.
  }
  if (loop_->flips() == flips_adopted_.load(std::memory_order_relaxed)) return absl::OkStatus();
  const FlipState s = FlipView();
  if (!CanAdoptFlip(s)) return absl::OkStatus();
  TS_RETURN_IF_ERROR(graphs_->AdoptDeviceFlip());
  flips_adopted_.store(s.flips, std::memory_order_relaxed);
  flip_offered_ = false;
  return absl::OkStatus();
}

absl::Status CudaBackend::LaunchLoop() {
  if (chunk_pending_) {
    const cudaError_t q = cudaEventQuery(chunk_end_);
    if (q != cudaErrorNotReady) {
      TS_CUDA_RETURN_IF_ERROR(q);
      chunk_pending_ = false;
    }
  }
  // The clock is re-mapped only where the GPU is idle: after the loop's exit with nothing
  // enqueued behind it.
  if (!chunk_pending_) TS_RETURN_IF_ERROR(MaybeCalibrateClock());
  // With nothing in flight the loop has exited, so every write of its steps (done flags, rings)
  // is visible: read them again (the loop may have ended after the caller's refresh), and the
  // host's contexts are exact. The regime is then what the host-driven mode would choose before
  // this step, and the loop exits by itself at the step where that choice changes. Behind a
  // chunk or mixed steps still in flight, the host's counts run ahead of the GPU's by those
  // steps, so the regime may grow a step or two early; splits never change a result's
  // correctness, only its summation order.
  RefreshSlots();
  TS_RETURN_IF_ERROR(MaybeAdoptFlip());  // a switch just before the exit
  if (loop_launches_ > 0 && loop_->exit_reason() == graphs::kLoopExitContext) {
    context_exits_.fetch_add(1, std::memory_order_relaxed);
  }
  TS_RETURN_IF_ERROR(MaybeUpdateRegime());
  const int32_t hi = graphs_->regime().max_context_len;
  launch_steps_ = loop_->steps();
  flip_offered_ = false;  // Launch clears the offer
  withdraw_pending_ = false;
  TS_RETURN_IF_ERROR(loop_->Launch(stream_, RegimeWindowLo(hi), hi));
  ++loop_launches_;
  chunk_pending_ = false;     // the loop's end implies the chunk's
  ready_unadmitted_ = false;  // its first step admits them, paused or not
  return absl::OkStatus();
}

absl::Status CudaBackend::Pause() {
  if (loop_ == nullptr) return absl::OkStatus();
  TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(options_.device));
  if (loop_->Running()) {
    TS_RETURN_IF_ERROR(loop_->RequestPause(control_stream_));
    pause_requested_ = true;
    TS_RETURN_IF_ERROR(loop_->Wait());
  }
  TS_RETURN_IF_ERROR(MaybeAdoptFlip());
  if (pause_requested_) {
    TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(control_stream_));
    pause_requested_ = false;
  }
  if (chunk_pending_) {
    // Mixed steps or a chunk with no loop behind them: paused means nothing runs.
    TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    chunk_pending_ = false;
  }
  return loop_->status();
}

absl::StatusOr<LoopStatus> CudaBackend::Poll() {
  if (loop_ == nullptr) return LoopStatus{.steps = steps_, .running = false};
  TS_RETURN_IF_ERROR(LoopError());
  const RegimeChanges c = regime_changes();
  return LoopStatus{.steps = loop_->steps() + mixed_steps_,
                    .running = loop_->Running() || chunk_pending_,
                    .launches = loop_launches_,
                    .mixed_steps = mixed_steps_,
                    .regime_changes_on_device = static_cast<uint64_t>(c.on_device),
                    .regime_changes_by_exit = static_cast<uint64_t>(c.exits)};
}

}  // namespace ts
