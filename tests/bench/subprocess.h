// Child processes for the load client's integration tests: spawn with output to a file, wait for
// a line, wait for exit with a bound (a stuck child is killed, never waited on forever).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace ts::test {

inline std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Starts argv[0] with stdout and stderr appended to log_path. Returns the pid, or -1.
inline pid_t SpawnLogged(const std::vector<std::string>& argv, const std::string& log_path) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  return rc == 0 ? pid : -1;
}

// Exit code of pid, waiting up to timeout; on timeout the child gets SIGKILL and this returns -9.
// A child killed by signal s returns -s.
inline int WaitExit(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (true) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0) return -1000;
    if (std::chrono::steady_clock::now() >= deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -9;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return -WTERMSIG(status);
  return -1000;
}

struct CommandResult {
  int exit_code = -1000;
  std::string output;  // stdout + stderr
};

inline CommandResult RunCommand(const std::vector<std::string>& argv, const std::string& log_path,
                                std::chrono::milliseconds timeout) {
  CommandResult result;
  const pid_t pid = SpawnLogged(argv, log_path);
  if (pid < 0) {
    result.output = "spawn failed: " + argv[0];
    return result;
  }
  result.exit_code = WaitExit(pid, timeout);
  result.output = ReadFileOrEmpty(log_path);
  return result;
}

// Polls log_path until a line containing `needle` appears; returns the text after the needle on
// that line. Empty when the child exits first or the timeout passes (the caller prints the log).
inline std::string WaitForLine(pid_t pid, const std::string& log_path, const std::string& needle,
                               std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    const std::string log = ReadFileOrEmpty(log_path);
    // Only complete lines: a half-written "HOST:PORT" would name the wrong port.
    for (size_t start = 0, end; (end = log.find('\n', start)) != std::string::npos;
         start = end + 1) {
      const std::string line = log.substr(start, end - start);
      const size_t at = line.find(needle);
      if (at != std::string::npos) return line.substr(at + needle.size());
    }
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return "";
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return "";
}

}  // namespace ts::test
