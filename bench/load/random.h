// Counter-based draws for the load client. Every random quantity of a run is a pure function of
// (seed, request index, stream, draw), so a request's prompt and lengths do not depend on the mode
// (open or closed loop), the arrival order, or how many requests were sent before it.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/philox.h"

namespace ts::load {

// Independent streams of draws, one per purpose.
enum class Stream : uint32_t {
  kArrival = 1,
  kInputLen = 2,
  kOutputLen = 3,
  kPromptIds = 4,
  kSamplingSeed = 5,
  kPromptOrder = 6,
};

// Uniform double in [0, 1) with 53 random bits.
inline double Uniform01(uint64_t seed, uint64_t index, Stream stream, uint32_t draw = 0) {
  const Philox4x32 out =
      Philox4x32_10(Philox4x32{{static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
                                static_cast<uint32_t>(stream), draw}},
                    static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const uint64_t bits = (static_cast<uint64_t>(out.v[0]) << 21) ^ (out.v[1] >> 11);
  return static_cast<double>(bits & ((uint64_t{1} << 53) - 1)) * 0x1.0p-53;
}

// Raw 64 random bits (for seeds handed to the server).
inline uint64_t Bits64(uint64_t seed, uint64_t index, Stream stream, uint32_t draw = 0) {
  const Philox4x32 out =
      Philox4x32_10(Philox4x32{{static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
                                static_cast<uint32_t>(stream), draw}},
                    static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return (static_cast<uint64_t>(out.v[0]) << 32) | out.v[1];
}

// Uniform integer in [lo, hi] (inclusive). Floor of a 53-bit uniform: bias < 2^-20 for any range a
// load test uses, which is far below what a latency measurement can notice.
inline int64_t UniformInt(int64_t lo, int64_t hi, double u01) {
  const double span = static_cast<double>(hi - lo + 1);
  int64_t v = lo + static_cast<int64_t>(std::floor(u01 * span));
  return v > hi ? hi : v;
}

}  // namespace ts::load
