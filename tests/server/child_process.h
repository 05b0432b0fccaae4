// Runs a child process (the real `tailserve` binary) for end-to-end tests: its stdout and stderr
// are collected line by line, every wait has a timeout, and the destructor kills and reaps it so a
// failing test never leaves a server behind.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

namespace ts::testing {

class ChildProcess {
 public:
  // Starts `argv[0]` with `argv`. The child dies with the test process (PR_SET_PDEATHSIG).
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Start(std::vector<std::string> argv);
  ~ChildProcess();  // SIGKILL if still running, then reap

  pid_t pid() const { return pid_; }
  // The first output line (stdout or stderr) containing `needle`; NotFound after `timeout` or
  // once the child has exited without printing it.
  absl::StatusOr<std::string> WaitForLine(const std::string& needle,
                                          std::chrono::milliseconds timeout);
  // Waits until `count` output lines contain `needle`; NotFound after `timeout` or at exit.
  absl::Status WaitForLineCount(const std::string& needle, int count,
                                std::chrono::milliseconds timeout);
  int CountLines(const std::string& needle) const;  // output lines so far containing `needle`
  bool Signal(int sig);
  // The exit code, or -signal if it was killed by one; nullopt on timeout.
  std::optional<int> WaitExit(std::chrono::milliseconds timeout);
  std::string Output() const;  // everything printed so far

 private:
  ChildProcess() = default;
  void ReadLoop(int fd);
  bool ReapLocked();  // waitpid(WNOHANG); caller holds mu_

  pid_t pid_ = -1;
  std::thread reader_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> lines_;  // guarded by mu_
  std::string partial_;             // guarded by mu_
  bool eof_ = false;                // guarded by mu_
  std::optional<int> exit_code_;    // guarded by mu_
};

// A loopback port nobody listens on now, for an address a child binds a moment later (a
// pipeline leader's, which its workers must know before either starts).
int32_t FreeLoopbackPort();

}  // namespace ts::testing
