// CudaBackend's device-resident loop (docs/device-loop.md): the scheduler kernel of
// graphs/device_loop.cuh tail-launches the bucket graphs step after step; new prompts are
// prefilled between steps, one bounded chunk at a time; the engine thread only polls: it
// relaunches the loop after an exit, pauses it for the next prefill chunk and reads the done
// flags.
//
// Prefill between steps, not beside them: measured on the H200, a prefill on a stream of its own
// next to the loop's back-to-back tail-launched graphs got the SMs only in the cracks between
// decode kernels, and a burst of prompts waited up to one whole generation (~700 ms at 16 req/s)
// for its first token. A chunk on the loop's own stream runs with the whole GPU, and the loop
// launched behind it admits its slots at the first step. While streams decode, a chunk holds at
// most prefill_step_tokens rows (vLLM's max_num_batched_tokens plays the same part), so a
// stream's token interval grows by at most one such chunk while prompts are prefilled; with
// nothing decoding, chunks are as large as the prefill buffers allow.
//
// Who writes a slot's device state: the chunk that holds a prompt's first piece stages it
// PREFILL; the prefill's postprocess after its last piece makes it READY (or FINISHED on its
// first token); the scheduler kernel makes READY ACTIVE at a step boundary; a step's postprocess
// makes it FINISHED. The engine thread writes nothing on the device for a running slot: a cancel
// is the mapped flag the postprocess reads (or, for a prompt still waiting for its chunks, the
// backend drops it and writes the FINISHED record itself).
#include <algorithm>
#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/sampling_row.h"
#include "graphs/device_guard.h"
#include "graphs/device_loop.cuh"
#include "kernels/cuda_check.h"

namespace ts {
namespace {

namespace k = ::ts::kernels;

}  // namespace

absl::Status CudaBackend::InitLoop() {
  TS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&control_stream_, cudaStreamNonBlocking));
  TS_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&chunk_end_, cudaEventDisableTiming));
  graphs::DeviceLoopParams p;
  p.table = graphs_->device_table();
  p.num_buckets = graphs_->num_buckets();
  if (p.num_buckets > graphs::kDeviceLoopMaxBuckets) {
    return absl::InvalidArgumentError(absl::StrCat("buckets: the device loop takes at most ",
                                                   graphs::kDeviceLoopMaxBuckets, ", got ",
                                                   p.num_buckets));
  }
  for (int32_t i = 0; i < p.num_buckets; ++i) p.buckets[i] = options_.buckets[i];
  p.slots = model_->dev().slots;
  p.num_slots = options_.max_slots;
  p.row_slots = model_->dev().decode_head.row_slots;
  TS_ASSIGN_OR_RETURN(loop_, graphs::DeviceLoop::Create(p, stream_));
  TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

void CudaBackend::StopLoop() {
  if (loop_ != nullptr) {
    (void)Pause();
    loop_.reset();
  }
  if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);  // a chunk may still run
  if (control_stream_ != nullptr) (void)cudaStreamDestroy(control_stream_);
  control_stream_ = nullptr;
  if (chunk_end_ != nullptr) (void)cudaEventDestroy(chunk_end_);
  chunk_end_ = nullptr;
}

void CudaBackend::QueuePrefills(std::span<const SlotInit> inits) {
  for (const SlotInit& in : inits) {
    prefill_queue_.Push(in);
    Slot& s = slots_[in.slot];
    s.state = SlotState::kPrefilling;
    s.prompt_len = static_cast<int32_t>(in.prompt.size());
    s.generated = 0;
  }
}

absl::Status CudaBackend::EnqueueChunk(int32_t max_rows) {
  const std::vector<PrefillQueue::Piece> pieces = prefill_queue_.NextChunk(max_rows);
  std::vector<PrefillPiece> model_pieces;
  std::vector<int32_t> sample_slots;
  std::vector<k::SamplingRow> params;
  for (const PrefillQueue::Piece& p : pieces) {
    const SlotInit& in = *p.init;
    // Staging row = slot: a slot is staged once per request, so no later chunk's staging can
    // overwrite rows whose copies have not run yet.
    if (p.first) TS_RETURN_IF_ERROR(StageSlot(in, in.slot, k::kSlotPrefill, stream_));
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
  TS_RETURN_IF_ERROR(model_->EnqueuePrefillChunk(model_pieces, stream_));
  TS_RETURN_IF_ERROR(
      model_->EnqueuePrefillSample(sample_slots, params, /*publish_ready=*/true, stream_));
  TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(chunk_end_, stream_));
  // The loop launched behind this chunk admits these slots at its first step; from here on the
  // host counts them as decoding (a first token that finishes one shows in its done flag).
  for (int32_t slot : sample_slots) slots_[slot].state = SlotState::kActive;
  prefill_queue_.PopFinished();
  chunk_pending_ = true;
  return absl::OkStatus();
}

void CudaBackend::DropCancelledPrefills() {
  if (prefill_queue_.empty()) return;
  int32_t* cancel = model_->host().cancel;  // [max_slots] host-mapped, written by Cancel
  for (SlotId i = 0; i < info_.max_slots; ++i) {
    if (slots_[i].state != SlotState::kPrefilling) continue;
    if (std::atomic_ref<int32_t>(cancel[i]).load(std::memory_order_acquire) == 0) continue;
    // A prompt whose last piece is already enqueued is cancelled by its first-token postprocess.
    if (prefill_queue_.Drop(i) == PrefillQueue::DropResult::kNotQueued) continue;
    // No kernel writes this slot's ring: its device row is PREFILL or not staged at all, which
    // the loop never admits. A chunk still in flight may write the slot's KV, but on the loop's
    // stream, before anything a later owner of those blocks enqueues.
    slots_[i].ring.Push(1, -1, RingFlags(FinishReason::kCancelled));
    slots_[i].state = SlotState::kFinished;
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
  int32_t* done = model_->host().done;
  for (SlotId i = 0; i < info_.max_slots; ++i) {
    Slot& s = slots_[i];
    if (s.state != SlotState::kActive) continue;
    // Records so far (one read per new one): the context the attention regime follows.
    RingEntry* e = s.ring.entries();
    const uint32_t cap = s.ring.capacity();
    for (uint32_t g = static_cast<uint32_t>(s.generated);; ++g) {
      const uint32_t seq =
          std::atomic_ref<uint32_t>(e[g % cap].seq).load(std::memory_order_relaxed);
      if (seq <= g) {
        s.generated = static_cast<int32_t>(g);
        break;
      }
    }
    if (std::atomic_ref<int32_t>(done[i]).load(std::memory_order_acquire) != 0) {
      s.state = SlotState::kFinished;
    }
  }
}

absl::Status CudaBackend::RunLoop() {
  TS_RETURN_IF_ERROR(LoopError());
  DropCancelledPrefills();
  RefreshSlots();
  if (loop_->Running()) {
    // A chunk is waiting: the loop ends at the boundary after the step it is in, and at least
    // one step runs between two chunks.
    if (!prefill_queue_.empty() && !pause_requested_ && loop_->steps() > launch_steps_) {
      TS_RETURN_IF_ERROR(loop_->RequestPause(control_stream_));
      pause_requested_ = true;
    }
    return absl::OkStatus();
  }
  if (chunk_pending_) {
    // A chunk with no loop behind it (nothing was decoding) runs on: the next one waits for it,
    // since its staging may still be unread.
    const cudaError_t q = cudaEventQuery(chunk_end_);
    if (q == cudaErrorNotReady) return absl::OkStatus();
    TS_CUDA_RETURN_IF_ERROR(q);
    chunk_pending_ = false;
  }
  if (pause_requested_) {
    // The pause word must have landed before the next Launch clears it, or it could land after.
    TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(control_stream_));
    pause_requested_ = false;
  }
  TS_RETURN_IF_ERROR(MaybeCalibrateClock());  // the GPU is idle until the next enqueue
  // The loop has exited, so every write of its steps (done flags, rings) is visible now; read
  // them again (the loop may have ended after the refresh above), and the host's contexts are
  // exact: the regime is chosen from what the host-driven mode would see before this step, and
  // the loop exits by itself at the step where that choice changes.
  RefreshSlots();
  if (!prefill_queue_.empty()) {
    // With nothing decoding there is no step to keep short: the largest chunk.
    const int32_t cap = options_.prefill_chunk_tokens;
    TS_RETURN_IF_ERROR(
        EnqueueChunk(num_active() > 0 ? std::min(options_.prefill_step_tokens, cap) : cap));
  }
  if (num_active() == 0) return absl::OkStatus();
  TS_RETURN_IF_ERROR(MaybeUpdateRegime());
  const int32_t hi = graphs_->regime().max_context_len;
  int32_t lo = 0;  // MaybeUpdateRegime shrinks once RegimeBound(context) * 4 <= hi
  for (int32_t v = 128; v < hi && 4 * v <= hi; v *= 2) lo = v;
  launch_steps_ = loop_->steps();
  TS_RETURN_IF_ERROR(loop_->Launch(stream_, lo, hi));
  chunk_pending_ = false;  // the loop's end implies the chunk's
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
  if (pause_requested_) {
    TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(control_stream_));
    pause_requested_ = false;
  }
  return loop_->status();
}

absl::StatusOr<LoopStatus> CudaBackend::Poll() {
  if (loop_ == nullptr) return LoopStatus{.steps = steps_, .running = false};
  TS_RETURN_IF_ERROR(LoopError());
  return LoopStatus{.steps = loop_->steps(), .running = loop_->Running()};
}

}  // namespace ts
