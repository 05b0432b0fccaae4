// Engine-side request state. Owned by the scheduler; only the engine thread touches a Request once
// it has been queued (the submitting thread hands it over under the scheduler's lock).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/backend.h"
#include "engine/engine.h"

namespace ts {

enum class RequestState : uint8_t {
  kQueued,    // waiting for a slot, KV blocks and batch room
  kDecoding,  // prefilled into a slot; the backend decodes it
  kFinished,  // FINISHED seen in the ring; retired at the end of the step
};

struct Request {
  std::string id;
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  StopParams stop;
  std::shared_ptr<RequestStream> stream;

  RequestState state = RequestState::kQueued;
  SlotId slot = -1;
  std::vector<int32_t> blocks;  // [ceil((prompt_len + max_new_tokens) / block_size)]
  uint32_t next_seq = 1;        // next ring seq to read
  int32_t generated = 0;        // tokens appended to the stream
  // Set once the engine asked the backend to cancel; `cancel_status` is what the stream reports
  // (OK for a client cancel, RESOURCE_EXHAUSTED for a slow reader, ...).
  bool cancel_sent = false;
  absl::Status cancel_status;
  // Set when the engine decided the request failed (ring overrun) but the backend slot still has
  // to report FINISHED before it can be released.
  absl::Status error;
};

// The limits Submit checks, resolved from EngineOptions and the backend's model.
struct RequestLimits {
  int32_t vocab_size = 0;
  int32_t max_context = 0;   // prompt + max_new_tokens
  int32_t max_stop_ids = 0;  // stop.stop_token_ids size
};

// INVALID_ARGUMENT naming the proto field (prompt_token_ids, sampling.top_p, stop.max_new_tokens,
// stop.stop_token_ids, ...) so the server can pass it through unchanged.
absl::Status ValidateRequest(const GenerateRequest& request, const RequestLimits& limits);

}  // namespace ts
