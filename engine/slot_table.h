// The slot table every backend keeps (engine/README.md, Slots): per slot a state, a token ring
// and a cancel flag, with one state machine for the CPU backend, the CUDA backend's host side and
// the test mock:
//
//   FREE --Prefill (engine thread)--> QUEUED --its prefill ran--> ACTIVE --a stop rule, a cancel,
//   a deadline--> FINISHED --Release (engine thread)--> FREE
//
// QUEUED: the prompt is handed over but not yet prefilled (a loop backend's pending prefill, the
// CUDA device loop's prefill queue); a host-driven prefill goes from FREE to ACTIVE at once.
// States are atomic (release stores, acquire loads), so a backend's loop thread and the engine
// thread may share a table: whoever finishes a slot stores FINISHED before it pushes the
// finishing ring entry, so an engine that saw the entry never races that store with Release.
// The rings and cancel flags may live in memory the table does not own (host-mapped memory that
// a GPU writes and reads); the table reaches the flags through std::atomic_ref.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/backend.h"

namespace ts {

enum class SlotState : uint8_t { kFree, kQueued, kActive, kFinished };

class SlotTable {
 public:
  // rings: [max_slots * ring_capacity] entries, or nullptr for storage of the table's own.
  // cancel: [max_slots] flags, or nullptr for the table's own.
  SlotTable(int32_t max_slots, uint32_t ring_capacity, RingEntry* rings = nullptr,
            int32_t* cancel = nullptr);
  SlotTable(const SlotTable&) = delete;
  SlotTable& operator=(const SlotTable&) = delete;

  int32_t size() const { return max_slots_; }
  SlotState state(SlotId slot) const { return states_[slot].load(std::memory_order_acquire); }
  void set_state(SlotId slot, SlotState s) { states_[slot].store(s, std::memory_order_release); }
  // The cancel flag: set by the engine thread (Cancel), read by whoever decodes the slot.
  bool cancelled(SlotId slot) const {
    return std::atomic_ref<int32_t>(cancel_[slot]).load(std::memory_order_acquire) != 0;
  }
  void set_cancelled(SlotId slot, bool on) {
    std::atomic_ref<int32_t>(cancel_[slot]).store(on ? 1 : 0, std::memory_order_release);
  }
  TokenRing& ring(SlotId slot) { return rings_[slot]; }
  const TokenRing& ring(SlotId slot) const { return rings_[slot]; }

  // For a new request: an empty ring and no cancel. Only while nothing produces into the slot.
  void ResetForRequest(SlotId slot);
  // The slots in `state`, ascending (a step's row list), into *rows, which is cleared first.
  void Rows(SlotState state, std::vector<SlotId>* rows) const;
  int32_t Count(SlotState state) const;
  bool Any(SlotState state) const;

 private:
  int32_t max_slots_ = 0;
  std::unique_ptr<std::atomic<SlotState>[]> states_;  // [max_slots]
  std::vector<RingEntry> own_rings_;                  // [max_slots * ring_capacity] or empty
  std::vector<int32_t> own_cancel_;                   // [max_slots] or empty
  int32_t* cancel_ = nullptr;                         // [max_slots]
  std::vector<TokenRing> rings_;                      // [max_slots]
};

}  // namespace ts
