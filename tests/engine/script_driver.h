// Drives a Backend directly through a script of arrivals and cancels at known step counts, so
// that two backends (the device loop and the host-driven mode, a pipeline and one GPU) can be
// held to the same tokens for the same events.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/backend.h"
#include "engine/engine.h"

namespace ts::testing {

// Random requests over the fixture's vocabulary: greedy and seeded, mixed lengths, some with a
// stop id; EOS ignored so lengths are the test's choice.
inline std::vector<GenerateRequest> RandomRequests(int n, uint32_t seed, int32_t vocab) {
  std::mt19937 rng(seed);
  std::vector<GenerateRequest> out;
  for (int i = 0; i < n; ++i) {
    GenerateRequest r;
    r.request_id = "r" + std::to_string(i);
    const int len = std::uniform_int_distribution<int>(1, 90)(rng);
    for (int t = 0; t < len; ++t)
      r.prompt.push_back(std::uniform_int_distribution<int>(3, vocab - 1)(rng));
    r.stop.max_new_tokens = std::uniform_int_distribution<int>(1, 120)(rng);
    r.stop.ignore_eos = true;
    r.sampling.temperature = 0.0f;  // greedy unless seeded below
    if (i % 3 == 1) {
      r.sampling.temperature = 0.8f;
      r.sampling.top_k = 20;
      r.sampling.seed = 1000 + i;
    }
    if (i % 5 == 2) r.stop.stop_token_ids = {std::uniform_int_distribution<int>(3, vocab - 1)(rng)};
    out.push_back(std::move(r));
  }
  return out;
}

struct Outcome {
  std::vector<int32_t> tokens;
  FinishReason reason = FinishReason::kNone;
  absl::Status status;
};

// A request's arrival or cancel at a known step: `at_step` steps had run when it happened.
struct Event {
  uint64_t at_step = 0;
  bool cancel = false;
  int request = 0;
  SlotId slot = 0;
};

// Drives one backend over `reqs`: the rings, the slot of each request and its result.
class ScriptDriver {
 public:
  // Each slot's block table covers max_context tokens.
  ScriptDriver(Backend& b, const std::vector<GenerateRequest>& reqs, int32_t max_context)
      : b_(b),
        reqs_(reqs),
        out_(reqs.size()),
        slot_of_(reqs.size(), -1),
        next_(b.info().max_slots, 1),
        owner_(b.info().max_slots, -1) {
    per_ = (max_context + b.info().kv_block_size - 1) / b.info().kv_block_size;
  }
  void Arrive(int request, SlotId slot) {
    const GenerateRequest& r = reqs_[request];
    tables_[request].clear();
    for (int32_t k = 0; k < per_; ++k) tables_[request].push_back(slot * per_ + k);
    const SlotInit in{.slot = slot,
                      .prompt = r.prompt,
                      .block_table = tables_[request],
                      .sampling = r.sampling,
                      .stop = r.stop};
    ASSERT_TRUE(b_.Prefill(std::span<const SlotInit>(&in, 1)).ok());
    slot_of_[request] = slot;
    owner_[slot] = request;
    next_[slot] = 1;
  }
  void Cancel(int request) { b_.Cancel(slot_of_[request]); }
  // Reads every ring; frees the slots whose request finished.
  void Drain() {
    for (SlotId s = 0; s < b_.info().max_slots; ++s) {
      if (owner_[s] < 0) continue;
      entries_.clear();
      ASSERT_TRUE(b_.Ring(s).Drain(&next_[s], &entries_));
      Outcome& o = out_[owner_[s]];
      for (const RingEntry& e : entries_) {
        if (e.token >= 0) o.tokens.push_back(e.token);
        if (e.flags & kRingFinished) {
          o.reason = RingReason(e.flags);
          b_.Release(s);
          owner_[s] = -1;
          ++finished_;
          break;
        }
      }
    }
  }
  SlotId FreeSlot() const {
    for (SlotId s = 0; s < static_cast<SlotId>(owner_.size()); ++s) {
      if (owner_[s] < 0) return s;
    }
    return -1;
  }
  bool IsFree(SlotId s) const { return owner_[s] < 0; }
  bool Running(int request) const {
    return slot_of_[request] >= 0 && owner_[slot_of_[request]] == request;
  }
  int finished() const { return finished_; }
  const std::vector<Outcome>& out() const { return out_; }

 private:
  Backend& b_;
  const std::vector<GenerateRequest>& reqs_;
  std::vector<Outcome> out_;
  std::vector<SlotId> slot_of_;
  std::vector<uint32_t> next_;
  std::vector<int> owner_;
  std::map<int, std::vector<int32_t>> tables_;
  std::vector<RingEntry> entries_;
  int32_t per_ = 0;
  int finished_ = 0;
};

}  // namespace ts::testing
