// A scripted Backend for the engine tests. It keeps the same slot and ring semantics as the real
// backends (FREE -> ACTIVE -> FINISHED, seq-numbered ring entries, CheckStop after every token,
// cancel checked before sampling), emits deterministic tokens from a script, and records every
// call so a test can assert, step by step, which slots ran and with which bucket.
#pragma once

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/backend.h"

namespace ts::testing {

struct MockBackendOptions {
  int32_t vocab_size = 100;
  std::vector<int32_t> eos_token_ids = {2};
  int32_t max_position_embeddings = 256;
  int32_t max_slots = 64;
  int32_t kv_block_size = 4;
  int32_t num_kv_blocks = 1024;
  uint32_t ring_capacity = 64;
  std::vector<int32_t> buckets = {1, 2, 4, 8, 16, 24, 32, 48, 64};
  int32_t tokens_per_run = 1;  // > ring_capacity provokes a ring overrun
};

// The default script: a token that depends on the prompt and the index, never an EOS id (< 10).
inline int32_t DefaultMockToken(std::span<const int32_t> prompt, int32_t index) {
  return 10 + (prompt[0] * 7 + index * 3) % 80;
}

class MockBackend : public Backend {
 public:
  struct SlotRecord {
    SlotId slot;
    std::vector<int32_t> prompt;
    std::vector<int32_t> block_table;
    StopParams stop;
  };
  struct RunRecord {
    std::vector<SlotId> active;  // slots decoded, ascending
    int32_t bucket;
  };
  using Script = std::function<int32_t(std::span<const int32_t> prompt, int32_t index)>;

  explicit MockBackend(MockBackendOptions o = {}) : o_(std::move(o)) {
    info_.model.vocab_size = o_.vocab_size;
    info_.model.eos_token_ids = o_.eos_token_ids;
    info_.model.max_position_embeddings = o_.max_position_embeddings;
    info_.max_slots = o_.max_slots;
    info_.kv_block_size = o_.kv_block_size;
    info_.num_kv_blocks = o_.num_kv_blocks;
    info_.ring_capacity = o_.ring_capacity;
    info_.name = "mock";
    slots_.resize(o_.max_slots);
    storage_.resize(static_cast<size_t>(o_.max_slots) * o_.ring_capacity, RingEntry{});
    for (int32_t s = 0; s < o_.max_slots; ++s) {
      slots_[s].ring =
          TokenRing(storage_.data() + static_cast<size_t>(s) * o_.ring_capacity, o_.ring_capacity);
    }
  }

  void set_script(Script script) { script_ = std::move(script); }
  // Pads each step to the smallest of these (sorted ascending) instead of options.buckets, e.g.
  // the list the scheduler normalised, as the server hands one list to both.
  void set_buckets(std::vector<int32_t> buckets) { o_.buckets = std::move(buckets); }
  // Tokens a slot emits in its next Run, from its prompt and the tokens it has emitted so far;
  // overrides options.tokens_per_run, so one slot can overrun its ring while others do not.
  void set_burst(Script burst) { burst_ = std::move(burst); }
  void fail_next_run(absl::Status s) { fail_next_run_ = std::move(s); }
  // Called at the start of every Prefill (to look at the scheduler mid-step).
  void set_on_prefill(std::function<void()> f) { on_prefill_ = std::move(f); }

  const BackendInfo& info() const override { return info_; }

  absl::Status Prefill(std::span<const SlotInit> inits) override {
    if (on_prefill_) on_prefill_();
    std::vector<SlotRecord> record;
    for (const SlotInit& in : inits) {
      if (in.slot < 0 || in.slot >= o_.max_slots || slots_[in.slot].state != kFree) {
        return absl::InternalError(absl::StrCat("mock: prefill into busy slot ", in.slot));
      }
      Slot& s = slots_[in.slot];
      s.state = kActive;
      s.prompt.assign(in.prompt.begin(), in.prompt.end());
      s.stop = in.stop;
      s.generated = 0;
      s.cancel = false;
      record.push_back(
          SlotRecord{in.slot, s.prompt,
                     std::vector<int32_t>(in.block_table.begin(), in.block_table.end()), in.stop});
      Emit(s);
    }
    prefills.push_back(std::move(record));
    return absl::OkStatus();
  }

  absl::Status Run(RunMode mode) override {
    if (!fail_next_run_.ok()) {
      absl::Status s = fail_next_run_;
      fail_next_run_ = absl::OkStatus();
      return s;
    }
    do {
      OneStep();
    } while (mode == RunMode::kLoop && last_.active > 0);
    return absl::OkStatus();
  }

  void Cancel(SlotId slot) override {
    cancels.push_back(slot);
    if (slots_[slot].state == kActive) slots_[slot].cancel = true;
  }
  const TokenRing& Ring(SlotId slot) const override { return slots_[slot].ring; }
  void Release(SlotId slot) override {
    releases.push_back(slot);
    Slot& s = slots_[slot];
    s.state = kFree;
    s.seq = 0;
    s.ring.Reset();
  }
  StepReport last_step() const override { return last_; }
  absl::StatusOr<LoopStatus> Poll() override { return LoopStatus{.steps = steps_}; }

  bool slot_free(SlotId slot) const { return slots_[slot].state == kFree; }

  // Everything the engine asked for, in order.
  std::vector<std::vector<SlotRecord>> prefills;
  std::vector<RunRecord> runs;
  std::vector<SlotId> cancels;
  std::vector<SlotId> releases;

 private:
  enum State { kFree, kActive, kFinished };
  struct Slot {
    State state = kFree;
    std::vector<int32_t> prompt;
    StopParams stop;
    int32_t generated = 0;
    uint32_t seq = 0;
    bool cancel = false;
    TokenRing ring;
  };

  void Emit(Slot& s) {
    const int32_t token =
        script_ ? script_(s.prompt, s.generated) : DefaultMockToken(s.prompt, s.generated);
    const FinishReason r = CheckStop(s.stop, o_.eos_token_ids, token, s.generated);
    ++s.generated;
    s.ring.Push(++s.seq, token, RingFlags(r));
    if (r != FinishReason::kNone) s.state = kFinished;
  }

  void OneStep() {
    RunRecord rec;
    for (SlotId i = 0; i < o_.max_slots; ++i) {
      if (slots_[i].state == kActive) rec.active.push_back(i);
    }
    const int32_t n = static_cast<int32_t>(rec.active.size());
    rec.bucket = PickBucket(o_.buckets, n);
    last_ = StepReport{.active = n, .bucket = rec.bucket};
    if (n > 0) ++steps_;
    if (n == 0) return;
    for (SlotId i : rec.active) {
      Slot& s = slots_[i];
      if (s.cancel) {
        s.ring.Push(++s.seq, -1, RingFlags(FinishReason::kCancelled));
        s.state = kFinished;
        continue;
      }
      const int32_t burst = burst_ ? burst_(s.prompt, s.generated) : o_.tokens_per_run;
      for (int32_t k = 0; k < burst && s.state == kActive; ++k) Emit(s);
    }
    runs.push_back(std::move(rec));
  }

  MockBackendOptions o_;
  BackendInfo info_;
  std::vector<Slot> slots_;
  std::vector<RingEntry> storage_;  // [max_slots][ring_capacity]
  Script script_;
  Script burst_;
  std::function<void()> on_prefill_;
  absl::Status fail_next_run_;
  StepReport last_;
  uint64_t steps_ = 0;
};

}  // namespace ts::testing
