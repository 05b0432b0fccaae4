// The token-ring protocol between a slot's producer and the engine that drains it
// (engine/README.md, Rings): one definition of the entry and of the finish reasons for every
// producer, whether the CPU backend's loop thread (ts::TokenRing::Push, engine/backend.h) or the
// GPU's postprocess kernel writing host-mapped memory (kernels/postprocess.cuh).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TS_HOST_DEVICE __host__ __device__
#else
#define TS_HOST_DEVICE
#endif

namespace ts {

enum class FinishReason : uint8_t {
  kNone = 0,
  kEos = 1,        // a model EOS id
  kStopToken = 2,  // one of StopParams::stop_token_ids
  kLength = 3,     // max_new_tokens reached
  kCancelled = 4,  // Cancel() took effect
  kError = 5,
  kDeadline = 6,  // StopParams::deadline passed
};

// One token-ring entry. The writer fills token and flags, then release-stores seq; the reader
// accepts an entry only when seq equals the one it expects, so it never reads a torn entry.
struct RingEntry {
  uint32_t seq;    // 1-based sequence number of this token within the slot's current request
  int32_t token;   // -1 for a finish-only entry (e.g. cancelled with no new token)
  uint32_t flags;  // bit 0: FINISHED; bits 8..15: FinishReason
  uint32_t reserved;
};
static_assert(sizeof(RingEntry) == 16);

inline constexpr uint32_t kRingFinished = 1u;
TS_HOST_DEVICE constexpr uint32_t RingFlags(FinishReason r) {
  return r == FinishReason::kNone ? 0u : (kRingFinished | (static_cast<uint32_t>(r) << 8));
}
TS_HOST_DEVICE constexpr FinishReason RingReason(uint32_t flags) {
  return static_cast<FinishReason>((flags >> 8) & 0xff);
}

}  // namespace ts
