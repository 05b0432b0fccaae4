#include "kernels/postprocess.cuh"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda_check.h"

namespace ts::kernels {
namespace {

constexpr int kThreads = 128;

// Orders this thread's earlier stores before its later ones for every observer, the host's ring
// reader included: the release the ring's seqlock needs (engine/backend.cc, TokenRing).
// __threadfence_system() is fence.sc.sys, which also joins one total order of sc fences. With
// the cancel read below moved first, the 1B loop's step was 2-3 us shorter at batch 1 and 5-9 us
// at 64 rows; the moved read alone, 0-1 and 0-6 (bench/results/2026-12-06e-h100.md).
__device__ __forceinline__ void SystemRelease() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

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
  // The cancel flag is host memory: its read goes first, so that its PCIe round trip overlaps the
  // slot row's load instead of following it (this kernel is on every step's critical path).
  const bool cancelled = *static_cast<const volatile int32_t*>(p.cancel + slot) != 0;
  SlotRow& s = p.slots[slot];
  if (s.state != p.from_state) return;

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
  SystemRelease();
  e->token = token;
  e->flags = RingFlags(reason);
  SystemRelease();
  e->seq = seq;
  if (reason == FinishReason::kNone) {
    if (p.to_state != p.from_state) {
      __threadfence();
      *static_cast<volatile int32_t*>(&s.state) = p.to_state;
    }
  } else {
    s.state = kSlotFinished;
    if (p.done != nullptr) {
      SystemRelease();
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
