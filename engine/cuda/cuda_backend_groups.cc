// CudaBackend's host-driven decode in row groups (docs/pipeline.md, Micro-batches in decode).
// Each group runs its own step cycle. On a pipeline of two stages, group A's step runs on the
// last stage while group B's runs on the first, and each GPU stays busy.
//
// Why it is safe without the device loop:
//   - a group's rows are chosen only after its previous step completed on the host, and a slot
//     the engine released while the step that finished it was in flight is not reused before
//     every step in flight has completed (a prefill settles first), nor touched by its completion;
//   - a prefill and a regime change complete every step in flight first;
//   - a cancel reaches the GPU only when the slot's group launches next (cancel_pending_), so no
//     step in flight sees it half the time;
//   - on a pipeline, the last stage prepares the inputs it sends upstream on a stream of its own,
//     into its decode feed (CudaModel::AddDecodeFeed), so they need not wait behind the other
//     group's graph there. It prepares its own inputs again just before its graph.
#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_ranks.h"
#include "engine/cuda/regime_policy.h"
#include "graphs/device_guard.h"
#include "kernels/cuda_check.h"

namespace ts {

absl::Status CudaBackend::InitGroups() {
  int32_t n = options_.decode_groups;
  if (n == 0) n = num_stages();
  if (n < 1 || n > info_.max_slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("decode_groups: ", options_.decode_groups, " must be in [0, max_slots]"));
  }
  if (n == 1 || options_.device_loop) return absl::OkStatus();
  group_of_.assign(info_.max_slots, -1);
  cancel_pending_.assign(info_.max_slots, 0);
  const size_t slots = static_cast<size_t>(info_.max_slots);
  TS_CUDA_RETURN_IF_ERROR(
      cudaMallocHost(reinterpret_cast<void**>(&group_staging_), n * slots * sizeof(int32_t)));
  groups_.resize(n);
  for (int32_t i = 0; i < n; ++i) {
    groups_[i].staging = group_staging_ + i * slots;
    TS_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&groups_[i].done, cudaEventDisableTiming));
  }
  if (pipeline_ != nullptr) {
    TS_RETURN_IF_ERROR(model_->AddDecodeFeed());
    TS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&feed_stream_, cudaStreamNonBlocking));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::LaunchGroup(Group& g) {
  const int32_t n = static_cast<int32_t>(g.rows.size());
  TS_ASSIGN_OR_RETURN(const int32_t index, graphs_->BucketIndexFor(n));
  g.bucket = options_.buckets[index];
  for (SlotId id : g.rows) {
    if (std::atomic_ref<int32_t>(cancel_pending_[id]).exchange(0, std::memory_order_acq_rel)) {
      table_->set_cancelled(id, true);  // read by this step's postprocess
    }
  }
  std::copy(g.rows.begin(), g.rows.end(), g.staging);
  std::fill(g.staging + n, g.staging + g.bucket, -1);
  const size_t bytes = static_cast<size_t>(g.bucket) * sizeof(int32_t);
  // The staging is rewritten only at this group's next launch, after `done`, which follows both
  // copies (the feed's through the stages its inputs go to).
  TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(model_->dev().decode_head.row_slots, g.staging, bytes,
                                          cudaMemcpyHostToDevice, stream_));
  if (pipeline_ == nullptr) {
    TS_RETURN_IF_ERROR(graphs_->Launch(index, stream_));
  } else {
    TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(model_->feed_row_slots(), g.staging, bytes,
                                            cudaMemcpyHostToDevice, feed_stream_));
    if (ring_ != nullptr) TS_RETURN_IF_ERROR(SendControl(DecodeMessage(index)));
    TS_RETURN_IF_ERROR(pipeline_->Decode(index, g.bucket, feed_stream_));
  }
  TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(g.done, stream_));
  g.in_flight = true;
  g.order = ++launches_;
  return absl::OkStatus();
}

absl::Status CudaBackend::CompleteGroup(Group& g) {
  if (links_ != nullptr) {
    TS_RETURN_IF_ERROR(links_->WaitEvent(g.done, options_.link_timeout));
  } else {
    TS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(g.done));
  }
  g.in_flight = false;
  TS_RETURN_IF_ERROR(CheckErrorFlag("decode step"));
  // Only this group's rows: another group's step may still be writing its own done flags.
  int32_t* done = device_slots_->host().done;
  for (SlotId id : g.rows) {
    // The engine may have read this step's finishing record and released the slot while the step
    // was still in flight (and the step's done flag may have landed after the release reset it).
    // Such a slot is FREE now and stays so: no Prefill reuses it before every step in flight has
    // been completed (SettleGroups).
    if (table_->state(id) != SlotState::kActive) continue;
    ++slots_[id].generated;
    if (std::atomic_ref<int32_t>(done[id]).load(std::memory_order_acquire) != 0) {
      table_->set_state(id, SlotState::kFinished);
    }
  }
  last_ = StepReport{.active = static_cast<int32_t>(g.rows.size()), .bucket = g.bucket};
  ++steps_;
  return absl::OkStatus();
}

absl::Status CudaBackend::SettleGroups() {
  for (;;) {
    Group* oldest = nullptr;
    for (Group& g : groups_) {
      if (g.in_flight && (oldest == nullptr || g.order < oldest->order)) oldest = &g;
    }
    if (oldest == nullptr) break;
    TS_RETURN_IF_ERROR(CompleteGroup(*oldest));
  }
  TS_RETURN_IF_ERROR(MaybeCalibrateClock());  // nothing runs on the GPU now
  int32_t next = 0;
  for (SlotId i = 0; i < info_.max_slots; ++i) {
    group_of_[i] =
        table_->state(i) == SlotState::kActive ? next++ % static_cast<int32_t>(groups_.size()) : -1;
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::RunGroups() {
  // A regime change updates every graph, which no step may be running.
  const int32_t current = graphs_->regime().max_context_len;
  if (NextRegime(current, max_active_context(), model_->max_context()) != current) {
    TS_RETURN_IF_ERROR(SettleGroups());
    TS_RETURN_IF_ERROR(MaybeUpdateRegime());
  }
  // Slots that became ACTIVE since (a prefill settles first, so none is in a step) join the
  // smallest group.
  std::vector<int32_t> members(groups_.size(), 0);
  for (SlotId i = 0; i < info_.max_slots; ++i) {
    if (table_->state(i) == SlotState::kActive && group_of_[i] >= 0) ++members[group_of_[i]];
  }
  for (SlotId i = 0; i < info_.max_slots; ++i) {
    if (table_->state(i) != SlotState::kActive || group_of_[i] >= 0) continue;
    const auto smallest = std::min_element(members.begin(), members.end()) - members.begin();
    group_of_[i] = static_cast<int32_t>(smallest);
    ++members[smallest];
  }
  for (size_t k = 0; k < groups_.size(); ++k) {
    Group& g = groups_[k];
    if (g.in_flight) continue;
    g.rows.clear();
    for (SlotId i = 0; i < info_.max_slots; ++i) {
      if (table_->state(i) == SlotState::kActive && group_of_[i] == static_cast<int32_t>(k)) {
        g.rows.push_back(i);
      }
    }
    if (!g.rows.empty()) TS_RETURN_IF_ERROR(LaunchGroup(g));
  }
  Group* oldest = nullptr;
  for (Group& g : groups_) {
    if (g.in_flight && (oldest == nullptr || g.order < oldest->order)) oldest = &g;
  }
  if (oldest == nullptr) {
    last_ = StepReport{};
    return absl::OkStatus();
  }
  TS_RETURN_IF_ERROR(CompleteGroup(*oldest));
  // Relaunched at once, so it overlaps the other groups' steps while the engine drains this one,
  // unless the regime must change first (the next call settles and updates).
  if (NextRegime(current, max_active_context(), model_->max_context()) != current) {
    return absl::OkStatus();
  }
  oldest->rows.erase(
      std::remove_if(oldest->rows.begin(), oldest->rows.end(),
                     [&](SlotId id) { return table_->state(id) != SlotState::kActive; }),
      oldest->rows.end());
  if (!oldest->rows.empty()) TS_RETURN_IF_ERROR(LaunchGroup(*oldest));
  return absl::OkStatus();
}

}  // namespace ts
