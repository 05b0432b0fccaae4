// What Run(kLoop) does next in the CUDA backend's device-loop mode, decided from what the host
// knows (docs/device-loop.md, Prefill between steps: mixed steps). Host-only, so CI tests the
// decision without a GPU (tests/engine/loop_policy_test.cc); cuda_backend_loop.cc carries it out.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>

namespace ts {

struct LoopState {
  bool loop_running = false;  // launched, and its exit event not reached
  // A step of the last launch has run, so that launch's clear of the pause word has landed.
  bool stepped_since_launch = false;
  bool pause_requested = false;   // the pause word was set for the running loop
  bool prompts_queued = false;    // prompt rows wait for a chunk or mixed step
  bool staging_free = true;       // the last chunk's or mixed step's staging copies have run
  bool decoding = false;          // some slot decodes (ACTIVE, READY, or its last chunk enqueued)
  bool ready_unadmitted = false;  // a plain chunk made slots READY, and no loop has run since
};

enum class LoopAction {
  kNone,          // nothing to do until the next call
  kRequestPause,  // a prompt waits beside the running loop: end it at the next boundary
  kMixedStep,     // decode every active slot and prefill the next prompt rows in one step
  kPlainChunk,    // nothing decodes: prefill the largest chunk
  kLaunch,        // (re)launch the loop, behind whatever the stream still runs
};

// - A running loop is asked to pause when a prompt waits, once a step of its launch has run
//   (before that, its own clear of the pause word could still land after the request).
// - With the loop off, waiting prompts go in mixed steps while slots decode, or in plain chunks
//   when none does, each staged only once the last one's copies have run (the host never waits).
// - Slots a plain chunk made READY decode only in a loop step (a mixed step leaves them out), so
//   the loop runs first; it is paused again behind its first step.
// - Otherwise the loop runs whenever a slot decodes.
inline LoopAction NextLoopAction(const LoopState& s) {
  if (s.loop_running) {
    return s.prompts_queued && !s.pause_requested && s.stepped_since_launch
               ? LoopAction::kRequestPause
               : LoopAction::kNone;
  }
  if (s.prompts_queued && !(s.decoding && s.ready_unadmitted)) {
    if (!s.staging_free) return LoopAction::kNone;
    return s.decoding ? LoopAction::kMixedStep : LoopAction::kPlainChunk;
  }
  return s.decoding ? LoopAction::kLaunch : LoopAction::kNone;
}

// How many rows a mixed step gives the prompts (docs/device-loop.md, mixed steps, and Catching
// up after a burst). A step holds step_tokens rows, decode and prompt, as vLLM's
// max_num_batched_tokens counts, and the prompts always get a quarter of it. Once a prompt has
// waited longer than catchup_after behind the ones ahead of it (no chunk has started it), steps
// hold catchup_tokens rows until that backlog is through: a burst of arrivals then clears at the
// larger step's prefill rate, while a lone prompt, however long, never lengthens the streams'
// steps beyond step_tokens. Every size is capped by the prefill buffers (chunk_tokens rows).
struct MixedStepBudget {
  int32_t step_tokens = 256;                  // >= 1
  int32_t catchup_tokens = 384;               // >= 1; below step_tokens it changes nothing
  std::chrono::nanoseconds catchup_after{0};  // 0: never catch up
  int32_t chunk_tokens = 2048;                // > the largest bucket
};

inline int32_t MixedStepPromptRows(const MixedStepBudget& b, int32_t bucket,
                                   std::optional<std::chrono::nanoseconds> oldest_unstarted_wait) {
  int32_t step = b.step_tokens;
  if (b.catchup_after.count() > 0 && oldest_unstarted_wait.has_value() &&
      *oldest_unstarted_wait > b.catchup_after) {
    step = std::max(step, b.catchup_tokens);
  }
  step = std::min(step, b.chunk_tokens);
  return std::min(std::max(step - bucket, std::max(step / 4, 1)), b.chunk_tokens - bucket);
}

// The loop's own regime switch (docs/device-loop.md, The attention regime): the host offers the
// running loop the regime it prepared (DeviceLoop::OfferFlip), larger or smaller, the scheduler
// takes it at the step whose longest context leaves the window where the host-driven mode would
// choose exactly that regime, and the host then records it in the graph cache
// (GraphCache::AdoptDeviceFlip) before it may prepare another. An offer whose regime is no longer
// the one wanted is withdrawn (DeviceLoop::WithdrawOffer) and settled before anything else.
struct FlipState {
  bool loop_running = false;
  bool stepped_since_launch = false;  // as LoopState's: the launch's clear of the offer has landed
  bool offered = false;               // an offer stands for the running launch
  int32_t flips = 0;                  // offers the scheduler took (DeviceLoop::flips)
  int32_t flips_adopted = 0;          // of those, recorded in the graph cache
  uint64_t steps = 0;                 // the loop's step counter
  uint64_t flip_step = 0;             // the first step run from the last offer taken
  bool prompts_queued = false;
  // Every idle exec holds the regime the host wants next (GraphCache::prepared): the next one up
  // near the window's top, or a shrink once longer streams end (CudaBackend::RegimeToPrepare).
  bool wanted_prepared = false;
};

// A switch the scheduler made is recorded once none of the old execs runs: the loop has exited,
// or a step after the switch's first has been claimed (by the new execs' scheduler).
inline bool CanAdoptFlip(const FlipState& s) {
  return s.flips != s.flips_adopted && (!s.loop_running || s.steps > s.flip_step);
}

// One offer per launch at a time, to a loop that has stepped, once the last switch is recorded
// (the idle execs are then the ones prepared), and not while prompts wait: the loop pauses for
// them soon, and a prompt's first step may need another regime prepared.
inline bool ShouldOfferFlip(const FlipState& s) {
  return s.loop_running && s.stepped_since_launch && !s.offered && s.flips == s.flips_adopted &&
         !s.prompts_queued && s.wanted_prepared;
}

// Whether a withdrawn offer may still be taken: a scheduler that read it before the clear landed
// claims at most the step after `withdraw_steps` (the counter read once the clear had landed),
// and writes flips before that step's count. Once settled, flips says whether it was taken.
inline bool WithdrawalSettled(bool loop_running, uint64_t steps, uint64_t withdraw_steps) {
  return !loop_running || steps > withdraw_steps;
}

}  // namespace ts
