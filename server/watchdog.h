// The server's watchdog (docs/serving.md): whether the engine still makes progress while requests
// wait. server/main.cc asks it every health tick.
#pragma once

#include <chrono>
#include <cstdint>

#include "engine/engine.h"

namespace ts::server {

// Flags the server unhealthy while requests wait and the engine completes nothing. Progress is
// any finished unit of work: a decode step, a prefill (it streams the request's first token), or
// a request leaving (finished or cancelled). Counting decode steps alone declared a server dead
// while it prefilled a backlog of one-token requests, which never reach a decode step. One backend
// call that outlasts the limit is a stall either way: from outside, a prefill that takes that long
// cannot be told from a hung device, so --watchdog_s must exceed the longest prefill.
class Watchdog {
 public:
  explicit Watchdog(std::chrono::seconds limit) : limit_(limit) {}
  // Returns the serving state the server should report now.
  bool Check(const EngineStats& s) {
    const auto now = std::chrono::steady_clock::now();
    const Progress p{s.steps, s.tokens_generated, s.requests_finished};
    if (p != last_ || s.queued + s.running == 0) {
      last_ = p;
      last_progress_ = now;
    }
    return limit_.count() == 0 || now - last_progress_ <= limit_;
  }

 private:
  struct Progress {
    uint64_t steps = 0, tokens = 0, finished = 0;
    bool operator==(const Progress&) const = default;
  };
  const std::chrono::seconds limit_;
  Progress last_;
  std::chrono::steady_clock::time_point last_progress_ = std::chrono::steady_clock::now();
};

}  // namespace ts::server
