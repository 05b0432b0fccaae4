// Drives any ts::Backend directly (no Engine): publishes requests into slots with Prefill, steps
// Run(kOneStep), drains every ring after each call and releases finished slots. The same driver
// runs the CPU and the CUDA backend, so tests compare them stream for stream.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "engine/backend.h"

namespace ts::testing {

struct DriverRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  StopParams stop;
};

struct DriverResult {
  std::vector<int32_t> tokens;  // emitted tokens (finish-only records excluded)
  FinishReason reason = FinishReason::kNone;
  int32_t records = 0;  // ring records seen
};

inline DriverRequest GreedyRequest(std::vector<int32_t> prompt, int32_t max_new) {
  DriverRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0.0f;
  r.stop.max_new_tokens = max_new;
  r.stop.ignore_eos = true;
  return r;
}

// Runs `reqs` together: request i in slot i, with KV blocks [i * per, (i + 1) * per) where per
// covers max_context tokens. `on_step(step)` runs before each Run (step 0 = first decode step).
inline std::vector<DriverResult> RunTogether(
    Backend& backend, const std::vector<DriverRequest>& reqs, int32_t max_context,
    const std::function<void(int32_t step)>& on_step = {}) {
  const BackendInfo& info = backend.info();
  const int32_t n = static_cast<int32_t>(reqs.size());
  EXPECT_LE(n, info.max_slots);
  const int32_t per = (max_context + info.kv_block_size - 1) / info.kv_block_size;
  EXPECT_LE(static_cast<int64_t>(per) * n, info.num_kv_blocks);
  std::vector<std::vector<int32_t>> tables(n);
  std::vector<SlotInit> inits;
  for (int32_t i = 0; i < n; ++i) {
    const int64_t tokens =
        static_cast<int64_t>(reqs[i].prompt.size()) + reqs[i].stop.max_new_tokens;
    const int32_t need =
        static_cast<int32_t>((tokens + info.kv_block_size - 1) / info.kv_block_size);
    for (int32_t b = 0; b < need; ++b) tables[i].push_back(i * per + b);
    inits.push_back(SlotInit{.slot = i,
                             .prompt = reqs[i].prompt,
                             .block_table = tables[i],
                             .sampling = reqs[i].sampling,
                             .stop = reqs[i].stop});
  }
  std::vector<DriverResult> out(n);
  std::vector<uint32_t> next(n, 1);
  std::vector<bool> finished(n, false);
  std::vector<RingEntry> entries;
  auto drain = [&] {
    for (int32_t i = 0; i < n; ++i) {
      if (finished[i]) continue;
      entries.clear();
      EXPECT_TRUE(backend.Ring(i).Drain(&next[i], &entries)) << "ring lapped, slot " << i;
      for (const RingEntry& e : entries) {
        ++out[i].records;
        if (e.token >= 0) out[i].tokens.push_back(e.token);
        if ((e.flags & kRingFinished) != 0) {
          out[i].reason = RingReason(e.flags);
          finished[i] = true;
          backend.Release(i);
        }
      }
    }
  };
  const absl::Status prefill = backend.Prefill(inits);
  EXPECT_TRUE(prefill.ok()) << prefill;
  if (!prefill.ok()) return out;
  drain();
  int32_t longest = 0;
  for (const DriverRequest& r : reqs) longest = std::max(longest, r.stop.max_new_tokens);
  for (int32_t step = 0; step < longest + 2; ++step) {
    if (std::all_of(finished.begin(), finished.end(), [](bool f) { return f; })) break;
    if (on_step) on_step(step);
    const absl::Status run = backend.Run(RunMode::kOneStep);
    EXPECT_TRUE(run.ok()) << run;
    if (!run.ok()) break;
    drain();
  }
  for (int32_t i = 0; i < n; ++i) EXPECT_TRUE(finished[i]) << "request " << i << " never finished";
  return out;
}

// The tokens and reason a backend must produce for `stop` along a known greedy path: the path
// cut at the first token where CheckStop says stop.
inline DriverResult ExpectedAlongPath(const std::vector<int32_t>& path, const StopParams& stop,
                                      std::span<const int32_t> eos) {
  DriverResult r;
  for (int32_t i = 0; i < static_cast<int32_t>(path.size()); ++i) {
    r.tokens.push_back(path[i]);
    r.reason = CheckStop(stop, eos, path[i], i);
    if (r.reason != FinishReason::kNone) break;
  }
  return r;
}

}  // namespace ts::testing
