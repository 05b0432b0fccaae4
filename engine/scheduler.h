// The engine's state machine without the thread, so tests can step it one iteration at a time.
// Each Step reads like its diagram (docs/style.md, Engine and server):
//   ProcessCancels -> Admit -> Prefill -> Run -> Drain -> Retire
// Submit/Cancel/BeginDrain/stats are safe from any thread; Step, WaitForWork and AbortAll belong to
// the one engine thread (or the test) that owns request state.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/engine.h"
#include "engine/kv_block_manager.h"
#include "engine/request.h"

namespace ts {

// What one Step did; the scheduler tests assert on it.
struct StepTrace {
  std::vector<std::string> admitted;  // request ids prefilled this step, in admission order
  std::vector<std::string> decoded;   // ids decoding when Run was called (empty: Run not called)
  std::vector<std::string> retired;   // ids whose slot and blocks were freed this step
  StepReport report;                  // backend's last_step() after Run
  bool did_work = false;
};

class Scheduler {
 public:
  // Validates and normalises the options against the backend (see engine.h for the rules).
  static absl::StatusOr<std::unique_ptr<Scheduler>> Create(EngineOptions options,
                                                           std::unique_ptr<Backend> backend);
  ~Scheduler();

  // Any thread.
  absl::StatusOr<std::shared_ptr<RequestStream>> Submit(GenerateRequest request);
  void Cancel(const std::string& request_id);
  void BeginDrain();
  // Wakes WaitForWork for good; Submit returns UNAVAILABLE from now on.
  void Stop();
  bool Idle() const;
  ModelInfo model_info() const;
  EngineStats stats() const;
  // OK until the backend failed; then that failure (every request was ended with it).
  absl::Status health() const;
  const EngineOptions& options() const { return options_; }

  // Engine thread only.
  StepTrace Step();
  // Sleeps on the condition variable until a request, a cancel or running work needs a Step.
  // Returns false once Stop was called.
  bool WaitForWork();
  // Ends every queued and running request's stream with kCancelled and `status` (shutdown).
  void AbortAll(const absl::Status& status);
  const Backend& backend() const { return *backend_; }
  Backend& mutable_backend() { return *backend_; }
  // Running requests by id (engine thread), for tests: nullptr when not running.
  const Request* FindRunning(const std::string& id) const;
  int32_t kv_blocks_free() const { return blocks_.num_free(); }

 private:
  Scheduler(EngineOptions options, std::unique_ptr<Backend> backend, RequestLimits limits);

  void ProcessCancels(StepTrace* trace);
  std::vector<Request*> Admit();
  absl::Status Prefill(const std::vector<Request*>& admitted);
  absl::Status RunBackend(StepTrace* trace);
  void Drain();
  void DrainOne(Request* r);
  void Retire(StepTrace* trace);
  void CancelRunning(Request* r, absl::Status why);
  void Fail(const absl::Status& status);
  void PublishStats();
  void PublishStatsLocked();  // mu_ held
  std::string NewRequestIdLocked();

  const EngineOptions options_;
  const RequestLimits limits_;
  std::unique_ptr<Backend> backend_;

  // Engine-thread state.
  KvBlockManager blocks_;
  std::vector<std::unique_ptr<Request>> running_;  // admitted, not yet retired
  std::vector<bool> slot_used_;                    // [max_slots]
  std::vector<RingEntry> drain_buf_;
  std::vector<int32_t> token_buf_;
  LoopStatus loop_;  // the backend's last Poll
  uint64_t tokens_generated_ = 0;
  uint64_t requests_finished_ = 0;

  // Shared with submitting threads.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Request>> queue_;
  std::vector<std::string> cancels_;
  std::unordered_set<std::string> inflight_ids_;  // queued or running
  bool draining_ = false;
  bool stopped_ = false;
  absl::Status fatal_;
  uint64_t next_id_ = 1;
  EngineStats stats_;  // published at the end of each Step (queued is computed live)
};

}  // namespace ts
