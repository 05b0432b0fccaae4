#include "engine/slot_table.h"

namespace ts {

SlotTable::SlotTable(int32_t max_slots, uint32_t ring_capacity, RingEntry* rings, int32_t* cancel)
    : max_slots_(max_slots), states_(new std::atomic<SlotState>[max_slots]) {
  for (int32_t i = 0; i < max_slots; ++i) states_[i].store(SlotState::kFree);
  if (rings == nullptr) {
    own_rings_.assign(static_cast<size_t>(max_slots) * ring_capacity, RingEntry{});
    rings = own_rings_.data();
  }
  if (cancel == nullptr) {
    own_cancel_.assign(static_cast<size_t>(max_slots), 0);
    cancel = own_cancel_.data();
  }
  cancel_ = cancel;
  rings_.reserve(max_slots);
  for (int32_t i = 0; i < max_slots; ++i) {
    rings_.emplace_back(rings + static_cast<size_t>(i) * ring_capacity, ring_capacity);
  }
}

void SlotTable::ResetForRequest(SlotId slot) {
  rings_[slot].Reset();
  set_cancelled(slot, false);
}

void SlotTable::Rows(SlotState state, std::vector<SlotId>* rows) const {
  rows->clear();
  for (SlotId i = 0; i < max_slots_; ++i) {
    if (this->state(i) == state) rows->push_back(i);
  }
}

int32_t SlotTable::Count(SlotState state) const {
  int32_t n = 0;
  for (SlotId i = 0; i < max_slots_; ++i) n += this->state(i) == state;
  return n;
}

bool SlotTable::Any(SlotState state) const {
  for (SlotId i = 0; i < max_slots_; ++i) {
    if (this->state(i) == state) return true;
  }
  return false;
}

}  // namespace ts
