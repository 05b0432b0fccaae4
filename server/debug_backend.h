// A Backend decorator for the end-to-end tests (the --debug_* flags of tailserve).
// Slowing a tiny CPU model down to a predictable pace, or holding it at a gate until the test
// creates a file, makes "cancel mid-stream", "flood a full queue", "SIGTERM with a stream in
// flight", "a drain that times out" and "a stalled step trips the watchdog" reproducible without
// racing the wall clock; failing a chosen step stands in for a sticky device error. None of it
// changes any behaviour of the real backend underneath.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/backend.h"

namespace ts::server {

struct DebugBackendOptions {
  std::chrono::milliseconds step_delay{0};     // slept before every decode step
  std::chrono::milliseconds prefill_delay{0};  // slept before every prefill
  int64_t fail_step = 0;  // the 1-based decode step that fails, and every one after it; 0 = never
  // The gate opens, for good, once this file exists. Until then the calls chosen below wait on
  // the engine thread, exactly where a hung device would hold it.
  std::string gate_file;
  int64_t gate_step = 0;      // decode step N (1-based) and every later one wait; 0 = none
  bool gate_prefill = false;  // every prefill waits
};

class DebugBackend final : public Backend {
 public:
  DebugBackend(std::unique_ptr<Backend> inner, DebugBackendOptions options)
      : inner_(std::move(inner)), options_(std::move(options)) {}

  const BackendInfo& info() const override { return inner_->info(); }
  absl::Status Prefill(std::span<const SlotInit> slots) override {
    std::this_thread::sleep_for(options_.prefill_delay);
    if (options_.gate_prefill) WaitForGate();
    return inner_->Prefill(slots);
  }
  absl::Status Run(RunMode mode) override {
    // Runs on the engine thread, which is exactly the thread a slow device would hold up.
    std::this_thread::sleep_for(options_.step_delay);
    ++runs_;
    if (options_.gate_step > 0 && runs_ >= options_.gate_step) WaitForGate();
    if (options_.fail_step > 0 && runs_ >= options_.fail_step) {
      // Sticky, as a CUDA context error is: once failed, every later step fails the same way.
      return absl::InternalError(absl::StrCat("--debug_fail_step: injected failure at step ",
                                              options_.fail_step, " (a sticky device error)"));
    }
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
  void WaitForGate() {
    if (gate_open_ || options_.gate_file.empty()) return;
    std::error_code ec;
    while (!std::filesystem::exists(options_.gate_file, ec)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    gate_open_ = true;
  }

  std::unique_ptr<Backend> inner_;
  const DebugBackendOptions options_;
  int64_t runs_ = 0;
  bool gate_open_ = false;
};

}  // namespace ts::server
