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

// Forwards every call to a real backend, but parks the engine thread on `gate` at call number
// `hold_at` (1-based) of one method:
// - HoldPoint::kRun: at the start of that Run, before that step decodes anything. With the first
//   token sampled by Prefill and one token per Run(kOneStep), the slot then holds exactly
//   `hold_at` tokens while the test acts.
// - HoldPoint::kAfterPrefill: as that Prefill returns, before the scheduler's first drain of the
//   prefilled slots (Scheduler::Step drains before Run as well as after). A loop backend keeps
//   decoding meanwhile.
class GatedBackend : public Backend {
 public:
  enum class HoldPoint { kRun, kAfterPrefill };
  GatedBackend(std::unique_ptr<Backend> inner, int hold_at, std::shared_ptr<Gate> gate,
               HoldPoint point = HoldPoint::kRun)
      : inner_(std::move(inner)), hold_at_(hold_at), gate_(std::move(gate)), point_(point) {}

  const BackendInfo& info() const override { return inner_->info(); }
  absl::Status Prefill(std::span<const SlotInit> slots) override {
    absl::Status s = inner_->Prefill(slots);
    if (point_ == HoldPoint::kAfterPrefill && ++calls_ == hold_at_) gate_->Wait();
    return s;
  }
  absl::Status Run(RunMode mode) override {
    if (point_ == HoldPoint::kRun && ++calls_ == hold_at_) gate_->Wait();
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
  const int hold_at_;
  std::shared_ptr<Gate> gate_;
  const HoldPoint point_;
  int calls_ = 0;  // of the held method; engine thread only
};

}  // namespace ts::testing
