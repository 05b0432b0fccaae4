#include "kernels/postprocess.cuh"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda_check.h"

namespace ts::kernels {
namespace {

constexpr int kThreads = 128;

// The stop rule of ts::CheckStop (engine/backend.cc), token by token the same decisions.
__device__ FinishReason StopReason(const SlotRow& s, const PostprocessParams& p, int32_t token,
                                   int32_t index) {
  if (index >= s.min_new_tokens) {
    if (s.ignore_eos == 0) {
      for (int i = 0; i < p.num_eos; ++i) {
        if (p.eos_ids[i] == token) return FinishReason::kEos;
      }
    }
    const int n = s.num_stop_ids < kMaxStopIds ? s.num_stop_ids : kMaxStopIds;
    for (int i = 0; i < n; ++i) {
      if (s.stop_ids[i] == token) return FinishReason::kStopToken;
    }
  }
  if (index + 1 >= s.max_new_tokens) return FinishReason::kLength;
  return FinishReason::kNone;
}

__device__ void PostprocessRow(const PostprocessParams& p, int32_t row) {
  if (row >= p.rows) return;
  const int32_t slot = p.row_slots[row];
  if (slot < 0 || slot >= p.num_slots) return;  // padding row: touches nothing
  SlotRow& s = p.slots[slot];
  if (s.state != p.from_state) return;

  const bool cancelled = *static_cast<const volatile int32_t*>(p.cancel + slot) != 0;
  const uint64_t deadline = static_cast<uint64_t>(s.deadline_hi) << 32 | s.deadline_lo;
  const bool expired = !cancelled && deadline != 0 && GlobalTimerNs() >= deadline;
  int32_t token = p.tokens[row];
  FinishReason reason;
  if (cancelled || expired) {
    // The token sampled this step is dropped: a finish-only record, as the CPU backend writes
    // when it sees the flag (or the deadline) before decoding.
    token = -1;
    reason = cancelled ? FinishReason::kCancelled : FinishReason::kDeadline;
  } else {
    reason = StopReason(s, p, token, s.generated);
    if (token >= 0 && token < p.vocab) {
      uint32_t* c = p.output_counts + static_cast<int64_t>(slot) * p.vocab + token;
      if (*c != UINT32_MAX) *c += 1;
    }
    s.generated += 1;
    s.last_token = token;
  }
  const uint32_t seq = s.seq + 1;
  s.seq = seq;

  volatile RingEntry* e =
      p.rings + static_cast<int64_t>(slot) * p.ring_capacity + (seq - 1) % p.ring_capacity;
  e->seq = 0;
  __threadfence_system();
  e->token = token;
  e->flags = RingFlags(reason);
  __threadfence_system();
  e->seq = seq;
  if (reason == FinishReason::kNone) {
    if (p.to_state != p.from_state) {
      __threadfence();
      *static_cast<volatile int32_t*>(&s.state) = p.to_state;
    }
  } else {
    s.state = kSlotFinished;
    if (p.done != nullptr) {
      __threadfence_system();
      *static_cast<volatile int32_t*>(p.done + slot) = 1;
    }
  }
}

__global__ void __launch_bounds__(kThreads) PostprocessKernel(PostprocessParams p) {
  PostprocessRow(p, static_cast<int32_t>(blockIdx.x * kThreads + threadIdx.x));
  if (p.stamps != nullptr && blockIdx.x == 0) {
    __syncthreads();
    if (threadIdx.x == 0) StampStepEnd(p.stamps);
  }
}

}  // namespace

absl::Status LaunchPostprocess(const PostprocessParams& p, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(RequireNonNegative("postprocess.rows", p.rows));
  if (p.rows == 0) return absl::OkStatus();
  TS_RETURN_IF_ERROR(RequirePositive("postprocess.num_slots", p.num_slots));
  TS_RETURN_IF_ERROR(RequirePositive("postprocess.vocab", p.vocab));
  if (p.ring_capacity < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("postprocess.ring_capacity must be >= 2, got ", p.ring_capacity));
  }
  if (p.num_eos < 0 || p.num_eos > kMaxEosIds) {
    return absl::InvalidArgumentError(
        absl::StrCat("postprocess.num_eos must be in [0, ", kMaxEosIds, "], got ", p.num_eos));
  }
  TS_RETURN_IF_ERROR(RequirePointer("postprocess.row_slots", p.row_slots, 4));
  TS_RETURN_IF_ERROR(RequirePointer("postprocess.tokens", p.tokens, 4));
  TS_RETURN_IF_ERROR(RequirePointer("postprocess.slots", p.slots, 16));
  TS_RETURN_IF_ERROR(RequirePointer("postprocess.cancel", p.cancel, 4));
  TS_RETURN_IF_ERROR(RequirePointer("postprocess.rings", p.rings, 16));
  TS_RETURN_IF_ERROR(RequirePointer("postprocess.output_counts", p.output_counts, 4));
  if (p.done != nullptr) TS_RETURN_IF_ERROR(RequirePointer("postprocess.done", p.done, 4));
  const int blocks = (p.rows + kThreads - 1) / kThreads;
  PostprocessKernel<<<blocks, kThreads, 0, stream>>>(p);
  TS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace ts::kernels
