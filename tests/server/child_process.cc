#include "tests/server/child_process.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace ts::testing {

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Start(std::vector<std::string> argv) {
  if (argv.empty()) return absl::InvalidArgumentError("argv: empty");
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0)
    return absl::InternalError(absl::StrCat("pipe: ", strerror(errno)));
  std::vector<char*> cargv;
  for (std::string& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", strerror(errno)));
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    // The test may have blocked signals in its threads; the server must start with a clean mask.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execv(cargv[0], cargv.data());
    _exit(127);
  }
  close(fds[1]);
  std::unique_ptr<ChildProcess> child(new ChildProcess());
  child->pid_ = pid;
  child->reader_ = std::thread([c = child.get(), fd = fds[0]] { c->ReadLoop(fd); });
  return child;
}

ChildProcess::~ChildProcess() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!exit_code_.has_value() && !ReapLocked()) {
      kill(pid_, SIGKILL);
      int status = 0;
      waitpid(pid_, &status, 0);
      exit_code_ = -SIGKILL;
    }
  }
  // The pipe reaches EOF once the child (and anything it forked) is gone.
  if (reader_.joinable()) reader_.join();
}

void ChildProcess::ReadLoop(int fd) {
  char buf[4096];
  while (true) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    std::lock_guard<std::mutex> lock(mu_);
    if (n <= 0) {
      if (!partial_.empty()) lines_.push_back(std::move(partial_));
      eof_ = true;
      cv_.notify_all();
      break;
    }
    partial_.append(buf, n);
    size_t pos;
    while ((pos = partial_.find('\n')) != std::string::npos) {
      // Echoed so a failing test shows what the server said.
      std::fprintf(stderr, "[tailserve %d] %s\n", pid_, partial_.substr(0, pos).c_str());
      lines_.push_back(partial_.substr(0, pos));
      partial_.erase(0, pos + 1);
    }
    cv_.notify_all();
  }
  close(fd);
}

absl::StatusOr<std::string> ChildProcess::WaitForLine(const std::string& needle,
                                                      std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_lock<std::mutex> lock(mu_);
  size_t seen = 0;
  while (true) {
    for (; seen < lines_.size(); ++seen) {
      if (lines_[seen].find(needle) != std::string::npos) return lines_[seen];
    }
    if (eof_ || std::chrono::steady_clock::now() >= deadline) break;
    cv_.wait_until(lock, deadline);
  }
  return absl::NotFoundError(absl::StrCat("no line containing '", needle, "' (",
                                          eof_ ? "child closed its output" : "timed out", ")"));
}

absl::Status ChildProcess::WaitForLineCount(const std::string& needle, int count,
                                            std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_lock<std::mutex> lock(mu_);
  size_t seen = 0;
  int found = 0;
  while (true) {
    for (; seen < lines_.size(); ++seen) {
      if (lines_[seen].find(needle) != std::string::npos && ++found >= count) {
        return absl::OkStatus();
      }
    }
    if (eof_ || std::chrono::steady_clock::now() >= deadline) break;
    cv_.wait_until(lock, deadline);
  }
  return absl::NotFoundError(absl::StrCat(found, " of ", count, " lines containing '", needle,
                                          "' (", eof_ ? "child closed its output" : "timed out",
                                          ")"));
}

int ChildProcess::CountLines(const std::string& needle) const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(std::count_if(lines_.begin(), lines_.end(), [&](const std::string& l) {
    return l.find(needle) != std::string::npos;
  }));
}

bool ChildProcess::Signal(int sig) {
  std::lock_guard<std::mutex> lock(mu_);
  if (exit_code_.has_value()) return false;
  return kill(pid_, sig) == 0;
}

bool ChildProcess::ReapLocked() {
  if (exit_code_.has_value()) return true;
  int status = 0;
  const pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r != pid_) return false;
  exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  return true;
}

std::optional<int> ChildProcess::WaitExit(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ReapLocked()) return exit_code_;
    }
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::string ChildProcess::Output() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const std::string& l : lines_) absl::StrAppend(&out, l, "\n");
  return out + partial_;
}

int32_t FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int32_t port = 0;
  if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&a), len) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  if (fd >= 0) close(fd);
  return port;
}

}  // namespace ts::testing
