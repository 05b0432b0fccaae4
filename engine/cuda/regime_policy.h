// The attention regime's rules (docs/device-loop.md, The attention regime): which regime the
// decode graphs hold for the longest context of a step, where the device loop may run on without
// the host, where it may switch to a regime the host offered, and which regime the host prepares
// ahead. A regime is named by its upper bound, 128 * 2^k capped at the model's max_context; its
// split counts are chosen for contexts up to that bound. Host-only, so CI tests the rules without
// a GPU (tests/engine/regime_policy_test.cc).
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>

namespace ts {

// The regime bound for a context: 128 * 2^k, capped at max_context.
inline int32_t RegimeBound(int32_t context, int32_t max_context) {
  int32_t bound = 128;
  while (bound < context && bound < max_context) bound *= 2;
  return std::min(bound, max_context);
}

// The host-driven mode's rule, applied before every step: the regime for a step whose longest
// context is `context`, when the graphs hold `current`. Grow at once (too few splits starve the
// GPU on long contexts); shrink only by two levels, so that a batch hovering at a boundary does
// not update every step.
inline int32_t NextRegime(int32_t current, int32_t context, int32_t max_context) {
  const int32_t bound = RegimeBound(context, max_context);
  return bound <= current && bound * 4 > current ? current : bound;
}

// The window (RegimeWindowLo(hi), hi] of longest contexts for which NextRegime keeps regime hi:
// the device loop runs steps only inside it.
inline int32_t RegimeWindowLo(int32_t hi) {
  int32_t lo = 0;
  for (int32_t v = 128; v < hi && 4 * v <= hi; v *= 2) lo = v;
  return lo;
}

// The contexts (RegimeTakeLo(hi), hi] whose RegimeBound is hi: a step outside the current
// window whose longest context lies there is where NextRegime changes to exactly hi, so the
// scheduler may take an offer of regime hi there, from either side.
inline int32_t RegimeTakeLo(int32_t hi) {
  int32_t lo = 0;
  for (int32_t v = 128; v < hi; v *= 2) lo = v;
  return lo;
}

// What the host knows of the next step's contexts, for the regime it prepares while the loop
// runs (CudaBackend::RegimeToPrepare).
struct RegimeOutlook {
  int32_t current = 0;      // the graphs' regime
  int32_t max_context = 0;  // the model's
  // The longest context of the next step, over decoding streams and queued prompts (a prompt's
  // first decode step); 0 when there is none.
  int32_t longest = 0;
  // The longest of those at most RegimeWindowLo(current): what would remain once every longer
  // stream had ended; 0 when none.
  int32_t rest = 0;
};

// The next regime is prepared once the longest context is this close to the window's top: far
// enough ahead for the capture to finish before the loop reaches it (one token a step), late
// enough that a batch whose contexts stay below the top rarely pays for an unused capture.
inline constexpr int32_t kPrepareRegimeAhead = 64;

// The regime the idle graphs should hold, or none:
// - where the longest context already lies outside the window, the regime NextRegime picks (the
//   next launch's);
// - within kPrepareRegimeAhead of the top, the next one up;
// - otherwise, if some streams lie at or below the window's bottom, the shrink NextRegime would
//   pick once the longer ones had ended. They end at an EOS, a cancel or a length limit, which
//   the host cannot foresee, so the shrink is prepared as soon as it is possible; if the
//   remaining contexts outgrow its bound meanwhile, the answer changes with them.
inline std::optional<int32_t> RegimeToPrepare(const RegimeOutlook& o) {
  if (o.longest == 0) return std::nullopt;
  const int32_t lo = RegimeWindowLo(o.current);
  if (o.longest > o.current || o.longest <= lo) {
    // A context past the model's length (a stream at its last token) keeps the largest regime.
    const int32_t next = NextRegime(o.current, o.longest, o.max_context);
    if (next == o.current) return std::nullopt;
    return next;
  }
  if (o.current < o.max_context && o.longest + kPrepareRegimeAhead > o.current) {
    return RegimeBound(o.current + 1, o.max_context);
  }
  if (o.rest == 0) return std::nullopt;
  return RegimeBound(o.rest, o.max_context);
}

}  // namespace ts
