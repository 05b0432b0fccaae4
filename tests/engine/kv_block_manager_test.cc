#include "engine/kv_block_manager.h"

#include <gtest/gtest.h>

#include <set>

namespace ts {
namespace {

TEST(KvBlockManager, BlocksForRoundsUp) {
  KvBlockManager m(10, 16);
  EXPECT_EQ(m.BlocksFor(0), 0);
  EXPECT_EQ(m.BlocksFor(1), 1);
  EXPECT_EQ(m.BlocksFor(16), 1);
  EXPECT_EQ(m.BlocksFor(17), 2);
  EXPECT_EQ(m.BlocksFor(160), 10);
}

TEST(KvBlockManager, AllocatesDistinctLowestIdsAndFrees) {
  KvBlockManager m(8, 4);
  EXPECT_EQ(m.num_free(), 8);
  auto a = m.Allocate(3);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, (std::vector<int32_t>{0, 1, 2}));
  auto b = m.Allocate(4);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, (std::vector<int32_t>{3, 4, 5, 6}));
  EXPECT_EQ(m.num_free(), 1);
  EXPECT_FALSE(m.CanAllocate(2));
  m.Free(*a);
  EXPECT_EQ(m.num_free(), 4);
  auto c = m.Allocate(4);
  ASSERT_TRUE(c.ok());
  // Freed blocks are reused, lowest first, and never collide with b's.
  EXPECT_EQ(*c, (std::vector<int32_t>{0, 1, 2, 7}));
  std::set<int32_t> all(b->begin(), b->end());
  all.insert(c->begin(), c->end());
  EXPECT_EQ(all.size(), 8u);
  EXPECT_EQ(m.num_free(), 0);
}

TEST(KvBlockManager, FailureTakesNothing) {
  KvBlockManager m(4, 16);
  auto a = m.Allocate(3);
  ASSERT_TRUE(a.ok());
  auto b = m.Allocate(2);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(m.num_free(), 1);
  EXPECT_TRUE(m.Allocate(1).ok());
  EXPECT_EQ(m.num_free(), 0);
  EXPECT_TRUE(m.Allocate(0).ok());
}

TEST(KvBlockManager, ChurnReturnsPoolToFull) {
  KvBlockManager m(64, 16);
  std::vector<std::vector<int32_t>> held;
  for (int i = 0; i < 200; ++i) {
    const int32_t n = 1 + (i * 7) % 9;
    if (m.CanAllocate(n)) {
      auto a = m.Allocate(n);
      ASSERT_TRUE(a.ok());
      held.push_back(*a);
    } else {
      m.Free(held.front());
      held.erase(held.begin());
    }
  }
  for (const auto& h : held) m.Free(h);
  EXPECT_EQ(m.num_free(), 64);
}

TEST(KvBlockManagerDeathTest, DoubleFreeIsABug) {
  KvBlockManager m(4, 16);
  auto a = m.Allocate(1);
  ASSERT_TRUE(a.ok());
  m.Free(*a);
  EXPECT_DEATH(m.Free(*a), "CHECK failed");
}

}  // namespace
}  // namespace ts
