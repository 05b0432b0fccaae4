// The serving engine: one engine thread owns all request state and runs
//   Admit -> Prefill -> Publish -> Run (one step, or the device loop) -> Drain rings -> Retire
// Requests move queued -> prefilling -> decoding -> finished | cancelled | failed.
// The server talks to it only through this header; protobuf never reaches here.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "models/sampling.h"

namespace ts {

// Engine::Create normalises these: buckets are sorted and deduplicated (each must be positive);
// max_batch is clamped to the backend's max_slots and to the largest bucket; buckets above the
// first one >= max_batch are dropped. max_context must fit the model and the whole KV pool
// (v1 reserves a request's worst case at admission and never evicts), else Create fails.
struct EngineOptions {
  int32_t max_batch = 64;  // concurrent decoding requests; <= backend max_slots
  std::vector<int32_t> buckets = {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128};
  int32_t queue_limit = 256;  // queued (not yet admitted) requests; beyond: RESOURCE_EXHAUSTED
  int32_t max_context = 0;    // prompt + max_new_tokens; 0 = model max_position_embeddings
  int32_t max_stop_ids = 16;  // cap on StopParams::stop_token_ids
  int32_t stream_buffer_tokens = 4096;  // unread tokens per stream before it is cancelled
  // kOneStep: the engine thread runs each decode step (host-driven). kLoop: the backend's own
  // loop decodes (the device-resident loop on CUDA), and the engine thread admits, prefills,
  // cancels, streams and retires beside it, waking every loop_poll_us to drain the rings.
  RunMode run_mode = RunMode::kOneStep;
  int32_t loop_poll_us = 100;
};

struct GenerateRequest {
  std::string request_id;  // optional; the engine assigns one when empty
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  StopParams stop;
};

// When a request passed each phase, on the steady clock (the engine thread's view). A point not
// reached is time_point{}: a request cancelled in the queue is never scheduled.
struct RequestTimes {
  using Clock = std::chrono::steady_clock;
  Clock::time_point submitted;  // Submit queued it
  Clock::time_point scheduled;  // it took a slot and KV blocks; its prompt went to the backend
  // The backend handed the prompt's first rows to the device (Backend::PrefillStarted); unset
  // when the backend started it inside Prefill, at `scheduled`.
  Clock::time_point prefill_started;
  Clock::time_point first_token;  // the engine read its first token from the backend
  Clock::time_point finished;     // the engine finished its stream
};

// Everything a stream has not yet sent, coalesced. How a request ends:
//   eos / stop_token / length       status OK
//   cancelled by Engine::Cancel      status OK
//   cancelled because the reader fell more than stream_buffer_tokens behind: RESOURCE_EXHAUSTED
//   cancelled because the engine shut down: UNAVAILABLE
//   error (backend failure, ring overrun): INTERNAL
struct StreamUpdate {
  std::vector<int32_t> tokens;
  bool finished = false;
  FinishReason reason = FinishReason::kNone;
  absl::Status status;  // non-OK when the request failed
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
  RequestTimes times;  // as of this update
};

// Shared between the engine thread (producer) and one server stream (consumer). Bounded: when more
// than EngineOptions::stream_buffer_tokens are unread, the engine cancels the request, so a slow
// reader never stalls the loop.
class RequestStream {
 public:
  // Its times().submitted is the construction.
  explicit RequestStream(std::string id, int32_t prompt_tokens);
  const std::string& id() const { return id_; }

  // Consumer: moves everything pending into *out. Returns false when there is nothing new.
  bool Take(StreamUpdate* out);
  // Consumer: called from the engine thread after new data arrives. Must not block.
  void SetNotifier(std::function<void()> notify);

  // Producer (engine thread).
  void MarkScheduled();  // the request took a slot and KV blocks
  // Returns without blocking. The first non-empty call is the first token's time, and records
  // `prefill_started` (the backend's report, unset if it has none) with it.
  void Append(std::span<const int32_t> tokens,
              RequestTimes::Clock::time_point prefill_started = {});
  // First call wins; later Append/Finish calls are ignored.
  void Finish(FinishReason reason, absl::Status status);
  int32_t unread() const;  // tokens appended but not yet taken
  bool finished() const;   // Finish was called (the consumer may not have taken it yet)
  int32_t completion_tokens() const;
  RequestTimes times() const;

 private:
  void Notify();
  const std::string id_;
  const int32_t prompt_tokens_;
  mutable std::mutex mu_;
  StreamUpdate pending_;
  bool done_ = false;
  int32_t completion_tokens_ = 0;
  RequestTimes times_;
  std::function<void()> notify_;
};

struct ModelInfo {
  int32_t vocab_size = 0;
  int32_t max_context = 0;
  int32_t max_new_tokens = 0;  // max_context - 1
  std::vector<int32_t> eos_token_ids;
  std::vector<int32_t> bos_token_ids;
  std::vector<int32_t> buckets;
  int32_t max_batch = 0;
  int32_t max_stop_ids = 0;
  std::string backend;
};

struct EngineStats {
  int32_t queued = 0;
  int32_t running = 0;
  int32_t kv_blocks_total = 0;
  int32_t kv_blocks_free = 0;
  uint64_t steps = 0;
  uint64_t tokens_generated = 0;
  uint64_t requests_finished = 0;
  // The backend's loop (LoopStatus): starts, mixed steps among `steps`, regime changes.
  uint64_t loop_launches = 0;
  uint64_t mixed_steps = 0;
  uint64_t regime_changes_on_device = 0;
  uint64_t regime_changes_by_exit = 0;
};

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(EngineOptions options,
                                                        std::unique_ptr<Backend> backend);
  ~Engine();  // stops the engine thread; unfinished streams finish with kCancelled

  // INVALID_ARGUMENT naming the field; RESOURCE_EXHAUSTED when the queue is full;
  // UNAVAILABLE when draining or stopped.
  absl::StatusOr<std::shared_ptr<RequestStream>> Submit(GenerateRequest request);
  // Frees the request's slot and KV blocks within one step. Idempotent.
  void Cancel(const std::string& request_id);

  // Stops admitting (Submit returns UNAVAILABLE); running requests continue.
  void BeginDrain();
  // True when nothing is queued or running.
  bool Idle() const;

  ModelInfo model_info() const;
  EngineStats stats() const;
  // OK while the backend works. After a backend failure every request has ended with INTERNAL,
  // Submit returns UNAVAILABLE, and this returns the failure (the server goes NOT_SERVING).
  absl::Status health() const;

 private:
  Engine();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ts
