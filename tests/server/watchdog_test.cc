// server/watchdog.h: the server stays healthy while the engine makes progress or has nothing to do,
// and turns unhealthy once requests wait for longer than the limit with nothing completing. Every
// kind of progress (a decode step, a token, a finished request) counts; a limit of 0 turns it off.
#include "server/watchdog.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

namespace ts::server {
namespace {

using namespace std::chrono_literals;

TEST(WatchdogTest, AStallPastTheLimitIsUnhealthyUntilProgressResumes) {
  Watchdog w(1s);
  EngineStats s{.queued = 2, .running = 1};
  EXPECT_TRUE(w.Check(s));
  std::this_thread::sleep_for(1100ms);
  EXPECT_FALSE(w.Check(s));  // requests wait, nothing completed for longer than the limit
  s.tokens_generated = 1;    // a prefill streamed a first token
  EXPECT_TRUE(w.Check(s));
  std::this_thread::sleep_for(1100ms);
  EXPECT_FALSE(w.Check(s));
  s.requests_finished = 1;
  EXPECT_TRUE(w.Check(s));
  std::this_thread::sleep_for(1100ms);
  s.steps = 7;
  EXPECT_TRUE(w.Check(s));
}

TEST(WatchdogTest, AnIdleEngineIsHealthyAndLimitZeroNeverTrips) {
  Watchdog idle(1s);
  EXPECT_TRUE(idle.Check({}));
  std::this_thread::sleep_for(1100ms);
  EXPECT_TRUE(idle.Check({}));  // nothing queued or running: nothing to complete
  Watchdog off(0s);
  EXPECT_TRUE(off.Check({.queued = 3}));
  std::this_thread::sleep_for(1100ms);
  EXPECT_TRUE(off.Check({.queued = 3}));
}

}  // namespace
}  // namespace ts::server
