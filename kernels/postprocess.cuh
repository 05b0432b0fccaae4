// Decode postprocess: the last kernel of a step (docs/architecture.md, Rings and postprocess). Per
// row it takes the sampled token of the row's slot, applies the stop rule (cancel flag, the
// deadline against %globaltimer, EOS unless ignore_eos, stop ids from min_new_tokens on,
// max_new_tokens), updates the slot's output counts
// for the penalties, appends a (seq, token, flags) record to the slot's ring in host-mapped memory
// and marks the slot FINISHED when it stops. One thread per row; rows map to distinct slots.
//
// The kernel knows slots and stop parameters, not requests: the slot table row (SlotRow) is the
// device-side contract shared with the step's prepare kernel and the host that publishes slots.
// Ring records are written as a seqlock, like ts::TokenRing::Push: seq = 0, fence, payload, fence,
// seq. A system-scope release fence orders the stores for the host reader over PCIe/NVLink.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "common/ring.h"
#include "kernels/sampling.cuh"
#include "kernels/step_stamps.cuh"

namespace ts::kernels {

inline constexpr int32_t kMaxStopIds = 16;  // StopParams::stop_token_ids capacity per slot
inline constexpr int32_t kMaxEosIds = 8;    // model EOS ids

// Slot states in SlotRow::state. Only ACTIVE rows are decoded. In the device-resident loop a
// slot is staged as PREFILL while its prefill runs beside the loop; the prefill's postprocess
// makes it READY (or FINISHED), and the loop's scheduler kernel turns READY into ACTIVE at a step
// boundary (docs/device-loop.md).
inline constexpr int32_t kSlotFree = 0;
inline constexpr int32_t kSlotActive = 1;
inline constexpr int32_t kSlotFinished = 2;
inline constexpr int32_t kSlotPrefill = 3;
inline constexpr int32_t kSlotReady = 4;

// One row of the device slot table. Written whole by the host when it publishes a slot (after
// the slot's prefill); afterwards only the GPU writes generated, last_token, seq and state.
struct SlotRow {
  int32_t state = kSlotFree;
  int32_t prompt_len = 0;
  int32_t generated = 0;    // tokens emitted so far (the prefill's first token counts)
  int32_t last_token = -1;  // the newest emitted token: the next step's input
  uint32_t seq = 0;         // seq of the newest ring record of this slot
  int32_t max_new_tokens = 1;
  int32_t min_new_tokens = 0;
  int32_t ignore_eos = 0;
  int32_t num_stop_ids = 0;
  int32_t stop_ids[kMaxStopIds] = {};
  // %globaltimer nanoseconds (low, high word) at which the stream ends with kDeadline;
  // 0 = none. Two words: the row's layout keeps 4-byte fields only.
  uint32_t deadline_lo = 0;
  uint32_t deadline_hi = 0;
  int32_t reserved = 0;
  SamplingRow sampling;  // position is filled per step by whoever builds the sampling rows
};
static_assert(sizeof(SlotRow) % 16 == 0);

struct PostprocessParams {
  const int32_t* row_slots = nullptr;  // [rows] slot of each row; -1 = padding row (skipped)
  const int32_t* tokens = nullptr;     // [rows] sampled token of each row
  SlotRow* slots = nullptr;            // [num_slots] device slot table
  // [num_slots] host-mapped; non-zero = the host asked this slot to stop. Read volatile.
  const int32_t* cancel = nullptr;
  // [num_slots] host-mapped; set to 1 after the finishing record is in the ring, so the host
  // learns which slots are done without scanning rings. Optional.
  int32_t* done = nullptr;
  RingEntry* rings = nullptr;  // [num_slots][ring_capacity] host-mapped (common/ring.h)
  // [count_slots, vocab] occurrences of each token in the slot's output, read by the sampling
  // penalties. The emitted token's count is incremented here, saturating at UINT32_MAX: uint32,
  // like the CPU reference's int counts, so a long generation's penalties never diverge.
  uint32_t* output_counts = nullptr;
  int32_t eos_ids[kMaxEosIds] = {};  // by value: a few ids, baked into a captured graph
  int32_t num_eos = 0;               // [0, kMaxEosIds]
  int32_t rows = 0;                  // >= 0; 0 launches nothing
  int32_t num_slots = 0;             // > 0
  int32_t vocab = 0;                 // > 0
  uint32_t ring_capacity = 0;        // >= 2
  // Rows whose slot is in `from_state` are processed (others are skipped); a row that does not
  // finish moves to `to_state`. A decode step and the host-driven prefill: ACTIVE -> ACTIVE; the
  // loop's prefill: PREFILL -> READY, stored after a fence so that a scheduler kernel on another
  // stream that sees READY also sees the row's token, counts and ring record.
  int32_t from_state = kSlotActive;
  int32_t to_state = kSlotActive;
  StepStamps* stamps = nullptr;  // benchmarks only (kernels/step_stamps.cuh): the step's end
};

// Validates params (InvalidArgument naming the field) and enqueues the kernel on `stream`.
// Graph-capturable: no allocation, no sync.
absl::Status LaunchPostprocess(const PostprocessParams& p, cudaStream_t stream);

}  // namespace ts::kernels
