#include "engine/pipeline/socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace ts::pipeline {

Fd::~Fd() {
  if (fd_ >= 0) close(fd_);
}

int MillisLeft(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 0, INT32_MAX));
}

bool WaitFor(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{.fd = fd, .events = events, .revents = 0};
    const int n = poll(&p, 1, MillisLeft(deadline));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) return false;
  }
}

void SetNonBlocking(int fd) {
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

absl::Status SendAll(int fd, const void* data, size_t n, Clock::time_point deadline,
                     const std::string& context, const std::string& peer) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    if (!WaitFor(fd, POLLOUT, deadline)) {
      return absl::DeadlineExceededError(
          absl::StrCat(context, ": sending to ", peer, " did not finish in time"));
    }
    const ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k <= 0) {
      return absl::UnavailableError(
          absl::StrCat(context, ": ", peer, ": send: ", std::strerror(errno)));
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
  return absl::OkStatus();
}

absl::Status RecvAll(int fd, void* data, size_t n, Clock::time_point deadline,
                     const std::string& context, const std::string& peer) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    if (!WaitFor(fd, POLLIN, deadline)) {
      return absl::DeadlineExceededError(
          absl::StrCat(context, ": ", peer, " sent nothing in time"));
    }
    const ssize_t k = recv(fd, p, n, 0);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k == 0) {
      return absl::UnavailableError(absl::StrCat(context, ": ", peer, " closed the connection"));
    }
    if (k < 0) {
      return absl::UnavailableError(
          absl::StrCat(context, ": ", peer, ": recv: ", std::strerror(errno)));
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
  return absl::OkStatus();
}

bool TryConnect(const addrinfo* a, Clock::time_point by, Fd* out) {
  Fd fd(socket(a->ai_family, SOCK_STREAM, 0));
  if (fd.get() < 0) return false;
  SetNonBlocking(fd.get());
  int rc = connect(fd.get(), a->ai_addr, a->ai_addrlen);
  if (rc != 0 && errno == EINPROGRESS) {
    if (WaitFor(fd.get(), POLLOUT, by)) {
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      rc = err == 0 ? 0 : -1;
      errno = err;
    } else {
      errno = ETIMEDOUT;
    }
  }
  if (rc != 0) return false;
  // Connecting to a local port that nobody listens on yet can connect the socket to itself: its
  // ephemeral port may be the very port asked for (TCP simultaneous open). That socket would then
  // hold the leader's port, and the leader could not bind it. Treat it as refused and retry.
  sockaddr_storage self{}, peer{};
  socklen_t self_len = sizeof(self), peer_len = sizeof(peer);
  if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&self), &self_len) == 0 &&
      getpeername(fd.get(), reinterpret_cast<sockaddr*>(&peer), &peer_len) == 0 &&
      self_len == peer_len && std::memcmp(&self, &peer, self_len) == 0) {
    errno = ECONNREFUSED;
    return false;
  }
  *out = std::move(fd);
  return true;
}

}  // namespace ts::pipeline
