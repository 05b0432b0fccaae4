// Test helper: accumulates everything a RequestStream hands out.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "engine/engine.h"

namespace ts::testing {

struct StreamReader {
  std::shared_ptr<RequestStream> stream;
  std::vector<int32_t> tokens;
  bool finished = false;
  FinishReason reason = FinishReason::kNone;
  absl::Status status;
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
  int32_t updates = 0;

  explicit StreamReader(std::shared_ptr<RequestStream> s) : stream(std::move(s)) {}

  // Takes whatever is pending; returns the number of new tokens.
  size_t Pull() {
    StreamUpdate u;
    if (!stream->Take(&u)) return 0;
    ++updates;
    tokens.insert(tokens.end(), u.tokens.begin(), u.tokens.end());
    prompt_tokens = u.prompt_tokens;
    completion_tokens = u.completion_tokens;
    if (u.finished) {
      finished = true;
      reason = u.reason;
      status = u.status;
    }
    return u.tokens.size();
  }
};

// Blocks (on a condition variable fed by the stream's notifier) until the stream finishes. The
// wait state is shared with the notifier so a notifier still running on the engine thread never
// touches a dead stack frame.
inline void ReadToEnd(StreamReader* r) {
  struct Wake {
    std::mutex mu;
    std::condition_variable cv;
    bool signalled = false;
  };
  auto wake = std::make_shared<Wake>();
  r->stream->SetNotifier([wake] {
    std::lock_guard<std::mutex> lock(wake->mu);
    wake->signalled = true;
    wake->cv.notify_one();
  });
  while (true) {
    r->Pull();
    if (r->finished) break;
    std::unique_lock<std::mutex> lock(wake->mu);
    wake->cv.wait(lock, [&] { return wake->signalled; });
    wake->signalled = false;
  }
}

}  // namespace ts::testing
