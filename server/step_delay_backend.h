// A Backend decorator that sleeps before every decode step. It exists for the end-to-end tests
// (--debug_step_delay_ms): slowing a tiny CPU model down to a predictable pace makes "cancel
// mid-stream", "flood a full queue" and "SIGTERM with a stream in flight" reproducible without
// changing any behaviour of the real backend underneath.
#pragma once

#include <chrono>
#include <memory>
#include <span>
#include <thread>
#include <utility>

#include "engine/backend.h"

namespace ts::server {

class StepDelayBackend final : public Backend {
 public:
  StepDelayBackend(std::unique_ptr<Backend> inner, std::chrono::milliseconds delay)
      : inner_(std::move(inner)), delay_(delay) {}

  const BackendInfo& info() const override { return inner_->info(); }
  absl::Status Prefill(std::span<const SlotInit> slots) override { return inner_->Prefill(slots); }
  absl::Status Run(RunMode mode) override {
    // Runs on the engine thread, which is exactly the thread a slow device would hold up.
    std::this_thread::sleep_for(delay_);
    return inner_->Run(mode);
  }
  void Cancel(SlotId slot) override { inner_->Cancel(slot); }
  const TokenRing& Ring(SlotId slot) const override { return inner_->Ring(slot); }
  void Release(SlotId slot) override { inner_->Release(slot); }
  StepReport last_step() const override { return inner_->last_step(); }

 private:
  std::unique_ptr<Backend> inner_;
  const std::chrono::milliseconds delay_;
};

}  // namespace ts::server
