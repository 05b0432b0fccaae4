// Counter-based RNG shared by the CPU reference sampler and the CUDA sampling kernel, so a seeded
// stream depends only on (seed, position) and never on batch composition or launch order.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TS_HD __host__ __device__ __forceinline__
#else
#define TS_HD inline
#endif

namespace ts {

struct Philox4x32 {
  uint32_t v[4];
};

TS_HD uint32_t MulHiLo32(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

// Philox4x32-10 (Salmon et al., SC'11).
TS_HD Philox4x32 Philox4x32_10(Philox4x32 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = MulHiLo32(kM0, ctr.v[0], &hi0);
    const uint32_t lo1 = MulHiLo32(kM1, ctr.v[2], &hi1);
    ctr = Philox4x32{{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
    k0 += kW0;
    k1 += kW1;
  }
  return ctr;
}

// Uniform float in [0, 1) for one draw of a request: key = seed, counter = (position, stream).
// `position` is the absolute index of the token being sampled; `stream` separates independent
// draws at one position (0 = the token draw).
TS_HD float UniformFromSeed(uint64_t seed, uint64_t position, uint32_t stream = 0) {
  const Philox4x32 out = Philox4x32_10(
      Philox4x32{{static_cast<uint32_t>(position), static_cast<uint32_t>(position >> 32), stream, 0u}},
      static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  // 24 random bits -> exactly representable float in [0, 1).
  return static_cast<float>(out.v[0] >> 8) * (1.0f / 16777216.0f);
}

}  // namespace ts
