// SlotTable (engine/slot_table.h): states, row lists, cancel flags and rings, over its own storage
// and over storage the caller provides (the CUDA backend's host-mapped block).
#include "engine/slot_table.h"

#include <gtest/gtest.h>

#include <vector>

namespace ts {
namespace {

TEST(SlotTableTest, StatesRowListsAndCountsFollowTheStateMachine) {
  SlotTable t(6, 4);
  EXPECT_EQ(t.size(), 6);
  EXPECT_EQ(t.Count(SlotState::kFree), 6);
  EXPECT_FALSE(t.Any(SlotState::kActive));
  t.set_state(4, SlotState::kActive);
  t.set_state(1, SlotState::kActive);
  t.set_state(2, SlotState::kQueued);
  t.set_state(5, SlotState::kFinished);
  std::vector<SlotId> rows = {9, 9, 9};  // cleared first
  t.Rows(SlotState::kActive, &rows);
  EXPECT_EQ(rows, (std::vector<SlotId>{1, 4}));  // ascending, as a step's row list
  EXPECT_EQ(t.Count(SlotState::kFree), 2);
  EXPECT_EQ(t.Count(SlotState::kQueued), 1);
  EXPECT_TRUE(t.Any(SlotState::kFinished));
  t.set_state(5, SlotState::kFree);
  EXPECT_FALSE(t.Any(SlotState::kFinished));
}

TEST(SlotTableTest, ResetForRequestEmptiesTheRingAndClearsTheCancel) {
  SlotTable t(2, 4);
  t.ring(1).Push(1, 7, 0);
  t.ring(1).Push(2, 8, RingFlags(FinishReason::kLength));
  t.set_cancelled(1, true);
  EXPECT_TRUE(t.cancelled(1));
  EXPECT_FALSE(t.cancelled(0));
  EXPECT_EQ(t.ring(1).LatestSeq(), 2u);
  t.ResetForRequest(1);
  EXPECT_FALSE(t.cancelled(1));
  EXPECT_EQ(t.ring(1).LatestSeq(), 0u);
  uint32_t next = 1;
  std::vector<RingEntry> got;
  EXPECT_TRUE(t.ring(1).Drain(&next, &got));
  EXPECT_TRUE(got.empty());
}

// The CUDA backend's rings and cancel flags live in host-mapped memory the GPU reads and writes:
// the table must use that memory, each slot its own ring of ring_capacity entries.
TEST(SlotTableTest, UsesTheCallersRingsAndCancelFlags) {
  constexpr uint32_t kCap = 3;
  std::vector<RingEntry> rings(2 * kCap, RingEntry{});
  std::vector<int32_t> cancel(2, 0);
  SlotTable t(2, kCap, rings.data(), cancel.data());
  EXPECT_EQ(t.ring(0).entries(), rings.data());
  EXPECT_EQ(t.ring(1).entries(), rings.data() + kCap);
  EXPECT_EQ(t.ring(1).capacity(), kCap);
  t.set_cancelled(1, true);
  EXPECT_EQ(cancel[1], 1);
  EXPECT_EQ(cancel[0], 0);
  cancel[0] = 1;  // as a producer outside the table would see or set it
  EXPECT_TRUE(t.cancelled(0));
  t.ring(1).Push(1, 42, 0);
  EXPECT_EQ(rings[kCap].seq, 1u);
  EXPECT_EQ(rings[kCap].token, 42);
}

}  // namespace
}  // namespace ts
