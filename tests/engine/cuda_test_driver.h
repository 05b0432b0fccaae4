// Drives any ts::Backend directly (no Engine): publishes requests into slots with Prefill, steps
// Run(kOneStep) (one step of every ACTIVE row, or with a pipeline's row groups of one group's
// rows) until all have finished, drains every ring after each call and releases finished slots. The
// same driver runs the CPU and the CUDA backend, so tests compare them stream for stream.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <vector>

#include "engine/backend.h"
#include "models/cpu_model.h"

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
// covers max_context tokens. `on_step(step)` runs before each Run (step 0 = first decode step);
// `after_call(step)` right after the Prefill (step -1) and after each Run, before the rings are
// drained (so the slots that ran are still ACTIVE or just FINISHED, none released).
inline std::vector<DriverResult> RunTogether(
    Backend& backend, const std::vector<DriverRequest>& reqs, int32_t max_context,
    const std::function<void(int32_t step)>& on_step = {},
    const std::function<void(int32_t step)>& after_call = {}) {
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
  if (after_call) after_call(-1);
  drain();
  // A Run advances at least one ACTIVE row (with row groups, one group's rows), so every request
  // has finished within this many Runs.
  int32_t runs = 2;
  for (const DriverRequest& r : reqs) runs += r.stop.max_new_tokens;
  for (int32_t step = 0; step < runs; ++step) {
    if (std::all_of(finished.begin(), finished.end(), [](bool f) { return f; })) break;
    if (on_step) on_step(step);
    const absl::Status run = backend.Run(RunMode::kOneStep);
    EXPECT_TRUE(run.ok()) << run;
    if (!run.ok()) break;
    if (after_call) after_call(step);
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

// A greedy continuation by the fp32 CPU reference model, with the top1-top2 logit gap of each
// step: a step whose gap is above the bf16 engine's logit error is one the CUDA backend must
// reproduce exactly (the fixtures select their prompts by a gap of 0.1, tests/fixtures/README.md).
struct ReferencePath {
  std::vector<int32_t> prompt;
  std::vector<int32_t> tokens;  // [n], EOS ignored
  std::vector<float> margins;   // [n] top1 - top2 logit at each step
  // Steps [0, robust_len) all keep a margin >= the threshold given to RobustLen.
  int32_t RobustLen(float min_margin) const {
    int32_t i = 0;
    while (i < static_cast<int32_t>(margins.size()) && margins[i] >= min_margin) ++i;
    return i;
  }
};

// n greedy tokens for every prompt, all prompts in one CpuModel::Forward per step (a row does not
// depend on its batch neighbours, so this is what the CPU backend computes for each alone).
inline std::vector<ReferencePath> CpuGreedyPaths(CpuModel& model,
                                                 const std::vector<std::vector<int32_t>>& prompts,
                                                 int32_t n, int32_t block_size = 16) {
  const int32_t vocab = model.config().vocab_size;
  const size_t count = prompts.size();
  std::vector<ReferencePath> out(count);
  std::vector<std::vector<int32_t>> tables(count);
  int32_t blocks = 0;
  for (size_t i = 0; i < count; ++i) {
    out[i].prompt = prompts[i];
    const int32_t tokens = static_cast<int32_t>(prompts[i].size()) + n;
    for (int32_t b = 0; b < (tokens + block_size - 1) / block_size; ++b)
      tables[i].push_back(blocks++);
  }
  CpuKvPool kv(model.config(), blocks, block_size);
  std::vector<int32_t> last(count);
  std::vector<float> logits;
  std::vector<SeqChunk> chunks(count);
  for (int32_t step = 0; step < n; ++step) {
    for (size_t i = 0; i < count; ++i) {
      const int32_t len = static_cast<int32_t>(prompts[i].size());
      chunks[i] = step == 0
                      ? SeqChunk{prompts[i], 0, tables[i]}
                      : SeqChunk{std::span<const int32_t>(&last[i], 1), len + step - 1, tables[i]};
    }
    const absl::Status st = model.Forward(chunks, kv, LogitsMode::kLastPerChunk, &logits);
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) return {};
    for (size_t i = 0; i < count; ++i) {
      const float* row = logits.data() + i * vocab;
      int32_t best = 0;
      for (int32_t v = 1; v < vocab; ++v) best = row[v] > row[best] ? v : best;
      float second = -std::numeric_limits<float>::infinity();
      for (int32_t v = 0; v < vocab; ++v) second = v != best ? std::max(second, row[v]) : second;
      out[i].tokens.push_back(best);
      out[i].margins.push_back(row[best] - second);
      last[i] = best;
    }
  }
  return out;
}

// A reference path on which greedy decoding meets an EOS id.
struct EosPath {
  ReferencePath path;
  int32_t eos_index = -1;  // first index of an EOS id in path.tokens
  int32_t robust_len = 0;  // path.RobustLen(min_margin) > eos_index
};

// Among `paths`, the one whose first EOS id (one `accept` takes) comes at index >= min_index and
// whose steps up to it keep the largest smallest margin, if that is >= min_margin. Ties go to the
// earliest path, so the choice is deterministic.
inline std::optional<EosPath> PickEosPath(const std::vector<ReferencePath>& paths,
                                          std::span<const int32_t> eos_ids, float min_margin,
                                          int32_t min_index,
                                          const std::function<bool(int32_t)>& accept) {
  std::optional<EosPath> best;
  float best_margin = min_margin;
  for (const ReferencePath& p : paths) {
    const auto it = std::find_if(p.tokens.begin(), p.tokens.end(), [&](int32_t t) {
      return std::find(eos_ids.begin(), eos_ids.end(), t) != eos_ids.end();
    });
    if (it == p.tokens.end() || !accept(*it)) continue;
    const int32_t j = static_cast<int32_t>(it - p.tokens.begin());
    if (j < min_index) continue;
    const float m = *std::min_element(p.margins.begin(), p.margins.begin() + j + 1);
    if (m < best_margin || (best.has_value() && m == best_margin)) continue;
    best_margin = m;
    best = EosPath{.path = p, .eos_index = j, .robust_len = p.RobustLen(min_margin)};
  }
  return best;
}

}  // namespace ts::testing
