// CudaBackend's device-resident loop (docs/device-loop.md): the scheduler kernel of
// graphs/device_loop.cuh tail-launches the bucket graphs step after step, a prefill thread runs
// new prompts on a stream of its own beside it, and the engine thread only polls: it relaunches
// the loop after an exit, pauses it for a graph update, and reads the done flags.
//
// Who writes a slot's device state: the prefill thread stages it PREFILL; the prefill's
// postprocess makes it READY (or FINISHED on its first token); the scheduler kernel makes READY
// ACTIVE at a step boundary; a step's postprocess makes it FINISHED. The engine thread writes
// nothing on the device for a running slot: a cancel is the mapped flag the postprocess reads.
#include <algorithm>
#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/cuda_backend.h"
#include "graphs/device_guard.h"
#include "graphs/device_loop.cuh"
#include "kernels/cuda_check.h"

namespace ts {

absl::Status CudaBackend::InitLoop() {
  // The loop's stream (stream_, created at the top priority for device_loop) outranks the
  // prefill stream: when both have blocks waiting for SMs, a decode step's go first, so a long
  // prefill slows decode steps down rather than stalling them.
  int least = 0;
  TS_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, nullptr));
  TS_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithPriority(&prefill_stream_, cudaStreamNonBlocking, least));
  TS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&control_stream_, cudaStreamNonBlocking));
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
  prefill_done_ = std::make_unique<std::atomic<bool>[]>(options_.max_slots);
  for (int32_t i = 0; i < options_.max_slots; ++i) prefill_done_[i].store(false);
  prefill_thread_ = std::thread([this] { PrefillThread(); });
  return absl::OkStatus();
}

void CudaBackend::StopLoop() {
  if (prefill_thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(prefill_mu_);
      prefill_stop_ = true;
    }
    prefill_cv_.notify_all();
    prefill_thread_.join();
  }
  if (loop_ != nullptr) {
    (void)Pause();
    loop_.reset();
  }
  if (prefill_stream_ != nullptr) (void)cudaStreamDestroy(prefill_stream_);
  if (control_stream_ != nullptr) (void)cudaStreamDestroy(control_stream_);
  prefill_stream_ = control_stream_ = nullptr;
}

absl::Status CudaBackend::EnqueuePrefillJobs(std::span<const SlotInit> inits) {
  {
    std::lock_guard<std::mutex> lock(prefill_mu_);
    if (!prefill_error_.ok()) return prefill_error_;
    for (const SlotInit& in : inits) {
      // The request's vectors outlive its slot, but a copy keeps the thread's input its own.
      auto job = std::make_unique<PrefillJob>();
      job->prompt.assign(in.prompt.begin(), in.prompt.end());
      job->block_table.assign(in.block_table.begin(), in.block_table.end());
      job->init = in;
      job->init.prompt = job->prompt;
      job->init.block_table = job->block_table;
      prefill_queue_.push_back(std::move(job));
      ++prefill_inflight_;
    }
  }
  for (const SlotInit& in : inits) {
    Slot& s = slots_[in.slot];
    s.state = SlotState::kPrefilling;
    s.prompt_len = static_cast<int32_t>(in.prompt.size());
    s.generated = 0;
  }
  prefill_cv_.notify_one();
  return absl::OkStatus();
}

void CudaBackend::PrefillThread() {
  if (cudaSetDevice(options_.device) != cudaSuccess) {
    std::lock_guard<std::mutex> lock(prefill_mu_);
    prefill_error_ = absl::InternalError("prefill thread: cudaSetDevice failed");
    return;
  }
  std::vector<std::unique_ptr<PrefillJob>> jobs;
  std::vector<SlotInit> inits;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(prefill_mu_);
      prefill_cv_.wait(lock, [&] { return prefill_stop_ || !prefill_queue_.empty(); });
      if (prefill_stop_) return;
      // Everything queued goes in one prefill: prompts pack into shared chunks.
      jobs.clear();
      while (!prefill_queue_.empty()) {
        jobs.push_back(std::move(prefill_queue_.front()));
        prefill_queue_.pop_front();
      }
    }
    inits.clear();
    for (const auto& j : jobs) inits.push_back(j->init);
    const absl::Status s = PrefillOn(inits, /*publish_ready=*/true, prefill_stream_);
    if (s.ok()) {
      for (const SlotInit& in : inits) {
        prefill_done_[in.slot].store(true, std::memory_order_release);
      }
    }
    {
      std::lock_guard<std::mutex> lock(prefill_mu_);
      prefill_inflight_ -= static_cast<int32_t>(inits.size());
      if (!s.ok()) prefill_error_ = s;  // sticky: the engine fails every request with it
    }
    prefill_idle_cv_.notify_all();
    if (!s.ok()) return;
  }
}

absl::Status CudaBackend::WaitForPrefills() {
  std::unique_lock<std::mutex> lock(prefill_mu_);
  prefill_idle_cv_.wait(lock, [&] { return prefill_inflight_ == 0 || !prefill_error_.ok(); });
  return prefill_error_;
}

absl::Status CudaBackend::LoopError() {
  {
    std::lock_guard<std::mutex> lock(prefill_mu_);
    TS_RETURN_IF_ERROR(prefill_error_);
  }
  TS_RETURN_IF_ERROR(loop_->status());
  return CheckErrorFlag("device loop");
}

void CudaBackend::RefreshSlots() {
  int32_t* done = model_->host().done;
  for (SlotId i = 0; i < info_.max_slots; ++i) {
    Slot& s = slots_[i];
    if (s.state == SlotState::kPrefilling && prefill_done_[i].load(std::memory_order_acquire)) {
      s.state = SlotState::kActive;
    }
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
  RefreshSlots();
  if (loop_->Running()) return absl::OkStatus();
  // The loop has exited, so every write of its steps (done flags, rings) is visible now; read
  // them again (the loop may have ended after the refresh above), and the host's contexts are
  // exact: the regime is chosen from what the host-driven mode would see before this step, and
  // the loop exits by itself at the step where that choice changes.
  RefreshSlots();
  if (num_active() == 0) return absl::OkStatus();
  TS_RETURN_IF_ERROR(MaybeUpdateRegime());
  const int32_t hi = graphs_->regime().max_context_len;
  int32_t lo = 0;  // MaybeUpdateRegime shrinks once RegimeBound(context) * 4 <= hi
  for (int32_t v = 128; v < hi && 4 * v <= hi; v *= 2) lo = v;
  return loop_->Launch(stream_, lo, hi);
}

absl::Status CudaBackend::Pause() {
  if (loop_ == nullptr || !loop_->Running()) return absl::OkStatus();
  TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(options_.device));
  TS_RETURN_IF_ERROR(loop_->RequestPause(control_stream_));
  TS_RETURN_IF_ERROR(loop_->Wait());
  // The pause word must have landed before the next Launch clears it, or it could land after.
  TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(control_stream_));
  return loop_->status();
}

absl::StatusOr<LoopStatus> CudaBackend::Poll() {
  if (loop_ == nullptr) return LoopStatus{.steps = steps_, .running = false};
  TS_RETURN_IF_ERROR(LoopError());
  return LoopStatus{.steps = loop_->steps(), .running = loop_->Running()};
}

}  // namespace ts
