// The seam between the engine (request state, admission, KV blocks, streaming) and a decoder
// (CPU reference now; CUDA host-driven and device-resident loop later). Shaped after
// docs/architecture.md (The Backend seam): the backend owns a slot table; the engine publishes
// requests into slots with Prefill, lets the backend decode with Run, and reads each slot's tokens
// from a per-slot TokenRing. Stop conditions (EOS, stop ids, min/max new tokens, cancel) are
// decided by the backend, exactly like the GPU's postprocess kernel, so a device loop can run many
// steps with no host call in between.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/ring.h"
#include "models/config.h"
#include "models/sampling.h"

namespace ts {

using SlotId = int32_t;

struct StopParams {
  std::vector<int32_t> stop_token_ids;  // finishing tokens besides EOS; the token is emitted
  int32_t max_new_tokens = 16;          // >= 1
  int32_t min_new_tokens = 0;           // EOS and stop ids are ignored before this many tokens
  bool ignore_eos = false;
  // The stream ends with kDeadline at the first step at or after this instant (checked on the
  // GPU by the postprocess kernel against its own clock); the epoch (the default) means none.
  std::chrono::steady_clock::time_point deadline{};
};

const char* FinishReasonName(FinishReason r);

// The stop rule every backend applies after sampling a token, exactly as the GPU postprocess kernel
// does. `index` is the token's 0-based index among the generated tokens. EOS (unless ignore_eos)
// and stop ids count only from index min_new_tokens on (vLLM's min_tokens); the token is emitted
// either way. Reaching max_new_tokens gives kLength unless the token also stops for EOS/stop id.
// Cancellation is checked before sampling, by the backend, and is not part of this rule.
FinishReason CheckStop(const StopParams& stop, std::span<const int32_t> eos_token_ids,
                       int32_t token, int32_t index);

// RingEntry, FinishReason and the flag layout: common/ring.h, shared with the GPU's writer.

// Single-producer single-consumer ring over caller-owned storage of `capacity` entries.
class TokenRing {
 public:
  TokenRing() = default;
  TokenRing(RingEntry* entries, uint32_t capacity) : entries_(entries), capacity_(capacity) {}
  uint32_t capacity() const { return capacity_; }
  RingEntry* entries() const { return entries_; }

  // Producer side (CPU backend; the GPU writes the same layout from a kernel).
  void Push(uint32_t seq, int32_t token, uint32_t flags);
  // Consumer side: appends every entry from *next_seq on and advances *next_seq. Returns false if
  // the producer lapped the reader (entries were lost), which the engine treats as an error.
  bool Drain(uint32_t* next_seq, std::vector<RingEntry>* out) const;
  // Zeroes every entry's seq so a new request starts at seq 1. Only while the producer is idle.
  void Reset();
  // Highest seq currently stored (0 when empty). After a lap the reader resynchronises here.
  uint32_t LatestSeq() const;

 private:
  RingEntry* entries_ = nullptr;
  uint32_t capacity_ = 0;
};

struct SlotInit {
  SlotId slot = -1;
  std::span<const int32_t> prompt;       // [prompt_len], prompt_len >= 1
  std::span<const int32_t> block_table;  // [ceil((prompt_len + max_new_tokens) / block_size)]
  SamplingParams sampling{};
  StopParams stop{};
};

struct BackendInfo {
  ModelConfig model;
  int32_t max_slots = 0;       // slot table rows (the largest bucket)
  int32_t kv_block_size = 0;   // tokens per KV block
  int32_t num_kv_blocks = 0;   // blocks in the pool
  uint32_t ring_capacity = 0;  // entries per slot ring
  const char* name = "";
};

// What one host-driven step did, for the scheduler tests.
struct StepReport {
  int32_t active = 0;  // slots decoded this step
  int32_t bucket = 0;  // padded batch size used
};

// Where a backend's decoding stands (Backend::Poll): the step counter replaces per-step reports
// for stats and for the watchdog, since in loop mode no host call sees each step. The other
// counters are for stats too (docs/device-loop.md); all count since creation, and stay 0 where a
// backend has no such thing.
struct LoopStatus {
  uint64_t steps = 0;    // decode steps completed since creation (at least one row each)
  bool running = false;  // a loop is decoding now (kLoop mode)
  // Starts of the loop: the first, and each one after it stopped. The device loop stops when no
  // slot decodes, while prompts are prefilled in mixed steps, and for an attention regime it could
  // not switch to by itself; the CPU loop thread waits instead of stopping, so only Pause does.
  uint64_t launches = 0;
  uint64_t mixed_steps = 0;  // of `steps`: those that also prefilled prompt rows
  // Changes of the decode graphs' attention regime: made by the running loop at a step, and made
  // by stopping it and launching it again.
  uint64_t regime_changes_on_device = 0;
  uint64_t regime_changes_by_exit = 0;
};

enum class RunMode {
  // Host-driven: one decode step over the active slots, then return. A backend that decodes in
  // row groups (a CUDA pipeline, docs/pipeline.md) completes one group's step instead, and may
  // leave another group's step in flight, whose tokens then reach the rings later, as in kLoop.
  kOneStep,
  // Loop: make sure the backend's own decode loop runs while any slot is active (relaunching it
  // if it exited), then return at once; tokens keep arriving in the rings. Prefill returns
  // before its work is done, and its slots join the running loop at a step boundary. A backend
  // with no loop of its own decodes until no slot is active instead.
  kLoop,
};

// Threading: every method is called by one thread at a time (the engine thread). A backend's
// loop, when it has one, runs on its own thread or on the GPU and shares with the caller only
// the slot protocol below: rings, cancel flags and FINISHED marks (engine/README.md).
class Backend {
 public:
  virtual ~Backend() = default;
  virtual const BackendInfo& info() const = 0;

  // Fills KV for the new slots, samples each first token into its ring (finishing it at once if
  // a stop condition holds) and publishes the slot as ACTIVE. In kOneStep mode the first tokens
  // are in the rings when it returns; a loop backend may return before, and the slot's first
  // token then arrives in its ring like any other. A slot's ring is reset before this returns.
  virtual absl::Status Prefill(std::span<const SlotInit> slots) = 0;
  // Decodes while any slot is active: one step, or keeps the loop running (RunMode).
  virtual absl::Status Run(RunMode mode) = 0;
  // Stops a running loop at the next step boundary and waits until it has (graph updates,
  // shutdown, tests); the next Run(kLoop) resumes it. Prefills already handed over still
  // complete. Nothing to do for a backend that only decodes inside Run.
  virtual absl::Status Pause() { return absl::OkStatus(); }
  // Step counter and loop state. Also surfaces a loop's failure (a device error) as the status.
  virtual absl::StatusOr<LoopStatus> Poll() = 0;
  // Takes effect within one step: the slot finishes with kCancelled.
  virtual void Cancel(SlotId slot) = 0;
  virtual const TokenRing& Ring(SlotId slot) const = 0;
  // After the engine has seen FINISHED: the slot is FREE again.
  virtual void Release(SlotId slot) = 0;
  // Report of the last completed step (kOneStep mode; with row groups, that group's rows).
  virtual StepReport last_step() const = 0;
  // When `slot`'s prompt began its prefill (the host handed its first rows to the device), for
  // the request's Timing. time_point{} for a backend that starts every prompt inside Prefill: the
  // engine's own scheduled time stands for it then. A loop backend's queued prompts wait behind
  // the earlier ones (docs/device-loop.md, Mixed steps).
  virtual std::chrono::steady_clock::time_point PrefillStarted(SlotId slot) const {
    (void)slot;
    return {};
  }
};

// Smallest bucket >= n (0 for n <= 0); buckets sorted ascending. n must be <= buckets.back().
int32_t PickBucket(std::span<const int32_t> buckets, int32_t n);
// Positive and strictly ascending; the error names the offending index.
absl::Status ValidateBuckets(std::span<const int32_t> buckets);

// The checks every backend's Prefill makes before touching a slot: slot in range, a non-empty
// prompt of in-vocabulary ids, max_new_tokens >= 1, a block table covering prompt +
// max_new_tokens with ids inside the pool, valid sampling parameters. Errors name the slot.
// Whether the slot is FREE is the backend's own state and its own check.
absl::Status ValidateSlotInit(const SlotInit& in, const BackendInfo& info);

}  // namespace ts
