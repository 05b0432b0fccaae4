// A Backend decorator for the end-to-end tests (--debug_step_delay_ms, --debug_fail_step).
// Slowing a tiny CPU model down to a predictable pace makes "cancel mid-stream", "flood a full
// queue", "SIGTERM with a stream in flight" and "a stalled step trips the watchdog" reproducible;
// failing a chosen step stands in for a sticky device error. Neither changes any behaviour of the
// real backend underneath.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/backend.h"

namespace ts::server {

class DebugBackend final : public Backend {
 public:
  // fail_step: the 1-based decode step that fails, and every one after it; 0 = never.
  DebugBackend(std::unique_ptr<Backend> inner, std::chrono::milliseconds delay, int64_t fail_step)
      : inner_(std::move(inner)), delay_(delay), fail_step_(fail_step) {}

  const BackendInfo& info() const override { return inner_->info(); }
  absl::Status Prefill(std::span<const SlotInit> slots) override { return inner_->Prefill(slots); }
  absl::Status Run(RunMode mode) override {
    // Runs on the engine thread, which is exactly the thread a slow device would hold up.
    std::this_thread::sleep_for(delay_);
    if (fail_step_ > 0 && ++runs_ >= fail_step_) {
      // Sticky, as a CUDA context error is: once failed, every later step fails the same way.
      return absl::InternalError(absl::StrCat("--debug_fail_step: injected failure at step ",
                                              fail_step_, " (a sticky device error)"));
    }
    return inner_->Run(mode);
  }
  void Cancel(SlotId slot) override { inner_->Cancel(slot); }
  const TokenRing& Ring(SlotId slot) const override { return inner_->Ring(slot); }
  void Release(SlotId slot) override { inner_->Release(slot); }
  StepReport last_step() const override { return inner_->last_step(); }

 private:
  std::unique_ptr<Backend> inner_;
  const std::chrono::milliseconds delay_;
  const int64_t fail_step_;
  int64_t runs_ = 0;
};

}  // namespace ts::server
