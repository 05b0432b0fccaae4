// The few TCP helpers the pipeline's bootstrap and transport share: an owned descriptor, and
// sends, receives and connects that never wait past a deadline. Errors are absl::Status whose
// message starts with the caller's `context` and names the peer.
#pragma once

#include <netdb.h>

#include <chrono>
#include <cstddef>
#include <string>
#include <utility>

#include "absl/status/status.h"

namespace ts::pipeline {

using Clock = std::chrono::steady_clock;

// A descriptor closed on scope exit.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd();
  int get() const { return fd_; }

 private:
  int fd_;
};

int MillisLeft(Clock::time_point deadline);  // >= 0
// Waits until `fd` is ready for `events` or the deadline passes (false).
bool WaitFor(int fd, short events, Clock::time_point deadline);
void SetNonBlocking(int fd);

// Exactly `n` bytes to or from `fd` (non-blocking), or an error naming `peer`: DeadlineExceeded
// when time runs out, Unavailable when the peer closed the connection or it broke.
absl::Status SendAll(int fd, const void* data, size_t n, Clock::time_point deadline,
                     const std::string& context, const std::string& peer);
absl::Status RecvAll(int fd, void* data, size_t n, Clock::time_point deadline,
                     const std::string& context, const std::string& peer);

// One connection attempt to one address, bounded by `by`; errno says why on failure.
bool TryConnect(const addrinfo* a, Clock::time_point by, Fd* out);

}  // namespace ts::pipeline
