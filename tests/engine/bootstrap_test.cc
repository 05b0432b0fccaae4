// The pipeline's TCP bootstrap on loopback: every rank gets rank 0's blob, and every way it can go
// wrong (a rank that never shows up, no leader, a peer with another world size, two peers with one
// rank) ends within the timeout with a message that says what happened. One case runs the ranks
// as separate processes, as a deployment does.
#include "engine/pipeline/bootstrap.h"

#include <sys/wait.h>
#include <unistd.h>

#include <future>
#include <random>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ts::pipeline {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

std::string RandomBlob(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string b(n, '\0');
  for (char& c : b) c = static_cast<char>(rng());
  return b;
}

// Starts rank 0 on a free port in a thread; returns its future and the port.
struct Leader {
  std::future<absl::StatusOr<std::string>> result;
  int32_t port = 0;
};
Leader StartLeader(int32_t world, std::string blob, std::chrono::milliseconds timeout) {
  auto port = std::make_shared<std::promise<int32_t>>();
  std::future<int32_t> port_f = port->get_future();
  Leader l;
  l.result = std::async(std::launch::async, [=] {
    return ExchangeBootstrapBlob({.rank = 0, .world_size = world, .timeout = timeout}, blob,
                                 [port](int32_t p) { port->set_value(p); });
  });
  l.port = port_f.wait_for(10s) == std::future_status::ready ? port_f.get() : -1;
  return l;
}

absl::StatusOr<std::string> Follower(int32_t rank, int32_t world, int32_t port,
                                     std::chrono::milliseconds timeout) {
  return ExchangeBootstrapBlob(
      {.rank = rank, .world_size = world, .port = port, .timeout = timeout}, "");
}

TEST(BootstrapTest, EveryRankGetsTheLeadersBlob) {
  const std::string blob = RandomBlob(128, 1);  // the size of an ncclUniqueId
  Leader leader = StartLeader(4, blob, 10s);
  ASSERT_GT(leader.port, 0);
  std::vector<std::future<absl::StatusOr<std::string>>> peers;
  // Out of order, as processes come up.
  for (int32_t r : {3, 1, 2}) {
    peers.push_back(std::async(std::launch::async, Follower, r, 4, leader.port, 10s));
  }
  for (auto& p : peers) {
    absl::StatusOr<std::string> got = p.get();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, blob);
  }
  absl::StatusOr<std::string> lead = leader.result.get();
  ASSERT_TRUE(lead.ok()) << lead.status();
  EXPECT_EQ(*lead, blob);
}

TEST(BootstrapTest, AFollowerTriesEveryAddressItsLeaderNameResolvesTo) {
  // The leader listens on 127.0.0.1 only; "localhost" may resolve to ::1 first.
  Leader leader = StartLeader(2, "by name", 10s);
  ASSERT_GT(leader.port, 0);
  absl::StatusOr<std::string> got = ExchangeBootstrapBlob(
      {.rank = 1, .world_size = 2, .leader_host = "localhost", .port = leader.port, .timeout = 10s},
      "");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "by name");
  EXPECT_TRUE(leader.result.get().ok());
}

TEST(BootstrapTest, AFollowerStartedBeforeTheLeaderWaitsForIt) {
  // Learn a free port, release it, and start the follower first.
  int32_t port = 0;
  {
    Leader probe = StartLeader(2, "x", 10s);
    port = probe.port;
    ASSERT_TRUE(Follower(1, 2, port, 5s).ok());
    ASSERT_TRUE(probe.result.get().ok());
  }
  auto follower = std::async(std::launch::async, Follower, 1, 2, port, 10s);
  std::this_thread::sleep_for(300ms);
  absl::StatusOr<std::string> lead = ExchangeBootstrapBlob(
      {.rank = 0, .world_size = 2, .port = port, .timeout = 10s}, "late leader");
  ASSERT_TRUE(lead.ok()) << lead.status();
  absl::StatusOr<std::string> got = follower.get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "late leader");
}

TEST(BootstrapTest, ARankThatNeverShowsUpTimesOutNamingIt) {
  const auto t0 = Clock::now();
  Leader leader = StartLeader(4, "blob", 1500ms);
  ASSERT_GT(leader.port, 0);
  auto one = std::async(std::launch::async, Follower, 1, 4, leader.port, 1500ms);
  absl::StatusOr<std::string> lead = leader.result.get();
  const auto waited = Clock::now() - t0;
  ASSERT_FALSE(lead.ok());
  EXPECT_EQ(lead.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(lead.status().message()), HasSubstr("ranks 2, 3 never connected"));
  EXPECT_LT(waited, 4s);
  // The rank that did come is told too, within its own timeout: it never gets a blob.
  absl::StatusOr<std::string> got = one.get();
  EXPECT_FALSE(got.ok());
}

TEST(BootstrapTest, NoLeaderTimesOutNamingTheAddress) {
  int32_t port = 0;
  {
    Leader probe = StartLeader(2, "x", 5s);
    port = probe.port;
    ASSERT_TRUE(Follower(1, 2, port, 5s).ok());
    ASSERT_TRUE(probe.result.get().ok());
  }
  const auto t0 = Clock::now();
  absl::StatusOr<std::string> got = Follower(1, 2, port, 800ms);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(got.status().message()),
              HasSubstr(absl::StrCat("could not reach the leader at 127.0.0.1:", port)));
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("refused"));
  EXPECT_LT(Clock::now() - t0, 3s);
}

TEST(BootstrapTest, PeersThatDisagreeAreRefused) {
  {
    Leader leader = StartLeader(3, "b", 5s);
    auto wrong = std::async(std::launch::async, Follower, 1, 4, leader.port, 5s);
    absl::StatusOr<std::string> lead = leader.result.get();
    ASSERT_FALSE(lead.ok());
    EXPECT_EQ(lead.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(lead.status().message()),
                HasSubstr("rank 1 says world size 4 (protocol 2); rank 0 has 3"));
    EXPECT_FALSE(wrong.get().ok());
  }
  {
    Leader leader = StartLeader(3, "b", 5s);
    auto a = std::async(std::launch::async, Follower, 2, 3, leader.port, 5s);
    auto b = std::async(std::launch::async, Follower, 2, 3, leader.port, 5s);
    absl::StatusOr<std::string> lead = leader.result.get();
    ASSERT_FALSE(lead.ok());
    EXPECT_THAT(std::string(lead.status().message()),
                HasSubstr("claims rank 2, which another peer already holds"));
    // The leader gave up, so neither of them gets a blob.
    EXPECT_FALSE(a.get().ok());
    EXPECT_FALSE(b.get().ok());
  }
  EXPECT_EQ(ExchangeBootstrapBlob({.rank = 3, .world_size = 3, .port = 1}, "").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExchangeBootstrapBlob({.rank = 1, .world_size = 2, .port = 0}, "").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(BootstrapTest, RanksInSeparateProcesses) {
  const std::string blob = RandomBlob(128, 7);
  Leader leader = StartLeader(3, blob, 10s);
  ASSERT_GT(leader.port, 0);
  std::vector<pid_t> children;
  for (int32_t r = 1; r < 3; ++r) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      // The child exits 0 only with the right blob; gtest must not run on in it.
      absl::StatusOr<std::string> got = Follower(r, 3, leader.port, 10s);
      _exit(got.ok() && *got == blob ? 0 : 1);
    }
    children.push_back(pid);
  }
  absl::StatusOr<std::string> lead = leader.result.get();
  EXPECT_TRUE(lead.ok()) << lead.status();
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child " << pid;
  }
}

}  // namespace
}  // namespace ts::pipeline
