// Test helpers: accumulate everything a RequestStream hands out, and wait for a stream or an
// engine with a bound, so a bug fails the test instead of hanging it.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
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

// Only a broken build or a deadlock gets anywhere near these.
constexpr std::chrono::seconds kStreamTimeout{120};

// Blocks (on a condition variable fed by the stream's notifier) until the stream holds `n`
// tokens or has finished, or fails the test after kStreamTimeout. The wait state is shared with
// the notifier so a notifier still running on the engine thread never touches a dead stack frame.
inline void ReadAtLeast(StreamReader* r, size_t n) {
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
  const auto deadline = std::chrono::steady_clock::now() + kStreamTimeout;
  while (true) {
    r->Pull();
    if (r->finished || r->tokens.size() >= n) return;
    std::unique_lock<std::mutex> lock(wake->mu);
    if (!wake->cv.wait_until(lock, deadline, [&] { return wake->signalled; })) {
      ADD_FAILURE() << "stream " << r->stream->id() << " did not reach " << n
                    << " tokens or its end within " << kStreamTimeout.count() << " s ("
                    << r->tokens.size() << " tokens so far)";
      return;
    }
    wake->signalled = false;
  }
}

// Until the stream finishes.
inline void ReadToEnd(StreamReader* r) {
  ReadAtLeast(r, SIZE_MAX);
}

// Polls until the engine has retired everything (a finished stream is retired at the end of the
// same step, so this is short), or fails the test after kStreamTimeout.
inline void WaitIdle(const Engine& engine) {
  const auto deadline = std::chrono::steady_clock::now() + kStreamTimeout;
  while (!engine.Idle() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  ASSERT_TRUE(engine.Idle()) << "engine not idle after " << kStreamTimeout.count() << " s";
}

}  // namespace ts::testing
