// What Run(kLoop) does next in the CUDA backend's device-loop mode, decided from what the host
// knows (docs/device-loop.md, Prefill between steps: mixed steps). Host-only, so CI tests the
// decision without a GPU (tests/engine/loop_policy_test.cc); cuda_backend_loop.cc carries it out.
#pragma once

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

}  // namespace ts
