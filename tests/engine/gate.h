// Test helpers that hold the engine thread at a known point, so a test decides the order of
// events instead of racing the decode loop on a loaded CI machine. Every wait is bounded: a wait
// that times out records a test failure and returns, so a bug fails the test instead of hanging
// it (and the engine thread is released, so teardown can still join it).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>

#include "engine/backend.h"

namespace ts::testing {

// Generous: only a broken build or a deadlock gets anywhere near it.
constexpr std::chrono::seconds kWaitTimeout{120};

class Gate {
 public:
  // Engine side: parks until Open(). Returns false (and fails the test) on timeout.
  bool Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    held_ = true;
    cv_.notify_all();
    if (cv_.wait_for(lock, kWaitTimeout, [&] { return open_; })) return true;
    ADD_FAILURE() << "gate: never opened within " << kWaitTimeout.count() << " s";
    return false;
  }
  // Test side: returns once the engine thread is parked in Wait(); false (and a failure) on
  // timeout.
  bool WaitUntilHeld() {
    std::unique_lock<std::mutex> lock(mu_);
    if (cv_.wait_for(lock, kWaitTimeout, [&] { return held_; })) return true;
    ADD_FAILURE() << "gate: the engine thread never reached it within " << kWaitTimeout.count()
                  << " s";
    return false;
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  bool held_ = false;
};

// Opens the gate when it goes out of scope, so an ASSERT that returns early never leaves the
// engine thread parked while the engine's destructor joins it. Declare it after the engine.
class OpenOnExit {
 public:
  explicit OpenOnExit(std::shared_ptr<Gate> gate) : gate_(std::move(gate)) {}
  ~OpenOnExit() { gate_->Open(); }
  OpenOnExit(const OpenOnExit&) = delete;
  OpenOnExit& operator=(const OpenOnExit&) = delete;

 private:
  std::shared_ptr<Gate> gate_;
};

// Forwards every call to a real backend, but parks the engine thread on `gate` at the start of
// Run call number `hold_at_run` (1-based), before that step decodes anything. With the first
// token sampled by Prefill and one token per Run(kOneStep), the slot then holds exactly
// `hold_at_run` tokens while the test acts.
class GatedBackend : public Backend {
 public:
  GatedBackend(std::unique_ptr<Backend> inner, int hold_at_run, std::shared_ptr<Gate> gate)
      : inner_(std::move(inner)), hold_at_run_(hold_at_run), gate_(std::move(gate)) {}

  const BackendInfo& info() const override { return inner_->info(); }
  absl::Status Prefill(std::span<const SlotInit> slots) override { return inner_->Prefill(slots); }
  absl::Status Run(RunMode mode) override {
    if (++runs_ == hold_at_run_) gate_->Wait();
    return inner_->Run(mode);
  }
  void Cancel(SlotId slot) override { inner_->Cancel(slot); }
  const TokenRing& Ring(SlotId slot) const override { return inner_->Ring(slot); }
  void Release(SlotId slot) override { inner_->Release(slot); }
  StepReport last_step() const override { return inner_->last_step(); }
  std::chrono::steady_clock::time_point PrefillStarted(SlotId slot) const override {
    return inner_->PrefillStarted(slot);
  }
  absl::Status Pause() override { return inner_->Pause(); }
  absl::StatusOr<LoopStatus> Poll() override { return inner_->Poll(); }

 private:
  std::unique_ptr<Backend> inner_;
  const int hold_at_run_;
  std::shared_ptr<Gate> gate_;
  int runs_ = 0;  // engine thread only
};

}  // namespace ts::testing
