// Polling for tests whose condition has nothing to wait on (ring contents, a step counter in
// mapped memory): a test asks for a state, not a time, so it holds under a sanitizer's slowdown.
#pragma once

#include <chrono>
#include <functional>
#include <thread>

namespace ts::testing {

// Polls `done` every 50 us until it holds; false once `timeout` has passed.
inline bool Eventually(const std::function<bool()>& done,
                       std::chrono::seconds timeout = std::chrono::seconds(120)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return true;
}

}  // namespace ts::testing
