// A scripted Backend for the engine tests. It keeps the same slot table and ring semantics as the
// real backends (engine/slot_table.h: FREE -> ACTIVE -> FINISHED, seq-numbered ring entries,
// CheckStop after every token, cancel checked before sampling), emits deterministic tokens from a
// script, and records every call so a test can assert, step by step, which slots ran and with which
// bucket.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/backend.h"
#include "engine/slot_table.h"

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
  // What Poll reports besides the steps it counts and `running`: the loop's launches, mixed steps
  // and regime changes, as a loop backend would.
  LoopStatus loop_counters;
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
    table_ = std::make_unique<SlotTable>(o_.max_slots, o_.ring_capacity);
  }

  void set_script(Script script) { script_ = std::move(script); }
  // Pads each step to the smallest of these (sorted ascending) instead of options.buckets, e.g.
  // the list the scheduler normalised, as the server hands one list to both.
  void set_buckets(std::vector<int32_t> buckets) { o_.buckets = std::move(buckets); }
  // Tokens a slot emits in its next Run, from its prompt and the tokens it has emitted so far;
  // overrides options.tokens_per_run, so one slot can overrun its ring while others do not.
  void set_burst(Script burst) { burst_ = std::move(burst); }
  void fail_next_run(absl::Status s) { fail_next_run_ = std::move(s); }
  // Called at the start of every Prefill and every Run (to look at the scheduler mid-step).
  void set_on_prefill(std::function<void()> f) { on_prefill_ = std::move(f); }
  void set_on_run(std::function<void()> f) { on_run_ = std::move(f); }
  // What PrefillStarted reports for `slot` from now on (by default nothing, as a backend that
  // prefills inside Prefill).
  void set_prefill_started(SlotId slot, std::chrono::steady_clock::time_point t) {
    prefill_started_[slot] = t;
  }
  std::chrono::steady_clock::time_point PrefillStarted(SlotId slot) const override {
    auto it = prefill_started_.find(slot);
    return it == prefill_started_.end() ? std::chrono::steady_clock::time_point{} : it->second;
  }

  const BackendInfo& info() const override { return info_; }

  absl::Status Prefill(std::span<const SlotInit> inits) override {
    if (on_prefill_) on_prefill_();
    std::vector<SlotRecord> record;
    for (const SlotInit& in : inits) {
      if (in.slot < 0 || in.slot >= o_.max_slots || table_->state(in.slot) != SlotState::kFree) {
        return absl::InternalError(absl::StrCat("mock: prefill into busy slot ", in.slot));
      }
      Slot& s = slots_[in.slot];
      table_->ResetForRequest(in.slot);
      table_->set_state(in.slot, SlotState::kActive);
      s.prompt.assign(in.prompt.begin(), in.prompt.end());
      s.stop = in.stop;
      s.generated = 0;
      record.push_back(
          SlotRecord{in.slot, s.prompt,
                     std::vector<int32_t>(in.block_table.begin(), in.block_table.end()), in.stop});
      Emit(in.slot);
    }
    prefills.push_back(std::move(record));
    return absl::OkStatus();
  }

  absl::Status Run(RunMode mode) override {
    if (on_run_) on_run_();
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
    if (table_->state(slot) == SlotState::kActive) table_->set_cancelled(slot, true);
  }
  const TokenRing& Ring(SlotId slot) const override { return table_->ring(slot); }
  void Release(SlotId slot) override {
    releases.push_back(slot);
    slots_[slot].seq = 0;
    table_->ResetForRequest(slot);
    table_->set_state(slot, SlotState::kFree);
  }
  StepReport last_step() const override { return last_; }
  absl::StatusOr<LoopStatus> Poll() override {
    LoopStatus s = o_.loop_counters;
    s.steps = steps_;
    s.running = false;
    return s;
  }

  bool slot_free(SlotId slot) const { return table_->state(slot) == SlotState::kFree; }

  // Everything the engine asked for, in order.
  std::vector<std::vector<SlotRecord>> prefills;
  std::vector<RunRecord> runs;
  std::vector<SlotId> cancels;
  std::vector<SlotId> releases;

 private:
  // A slot's request; its state, ring and cancel flag are in table_ (engine/slot_table.h).
  struct Slot {
    std::vector<int32_t> prompt;
    StopParams stop;
    int32_t generated = 0;
    uint32_t seq = 0;
  };

  void Emit(SlotId slot) {
    Slot& s = slots_[slot];
    const int32_t token =
        script_ ? script_(s.prompt, s.generated) : DefaultMockToken(s.prompt, s.generated);
    const FinishReason r = CheckStop(s.stop, o_.eos_token_ids, token, s.generated);
    ++s.generated;
    if (r != FinishReason::kNone) table_->set_state(slot, SlotState::kFinished);
    table_->ring(slot).Push(++s.seq, token, RingFlags(r));
  }

  void OneStep() {
    RunRecord rec;
    table_->Rows(SlotState::kActive, &rec.active);
    const int32_t n = static_cast<int32_t>(rec.active.size());
    rec.bucket = PickBucket(o_.buckets, n);
    last_ = StepReport{.active = n, .bucket = rec.bucket};
    if (n > 0) ++steps_;
    if (n == 0) return;
    for (SlotId i : rec.active) {
      Slot& s = slots_[i];
      if (table_->cancelled(i)) {
        table_->set_state(i, SlotState::kFinished);
        table_->ring(i).Push(++s.seq, -1, RingFlags(FinishReason::kCancelled));
        continue;
      }
      const int32_t burst = burst_ ? burst_(s.prompt, s.generated) : o_.tokens_per_run;
      for (int32_t k = 0; k < burst && table_->state(i) == SlotState::kActive; ++k) Emit(i);
    }
    runs.push_back(std::move(rec));
  }

  MockBackendOptions o_;
  BackendInfo info_;
  std::vector<Slot> slots_;
  std::unique_ptr<SlotTable> table_;
  Script script_;
  Script burst_;
  std::function<void()> on_prefill_;
  std::function<void()> on_run_;
  std::map<SlotId, std::chrono::steady_clock::time_point> prefill_started_;
  absl::Status fail_next_run_;
  StepReport last_;
  uint64_t steps_ = 0;
};

}  // namespace ts::testing
