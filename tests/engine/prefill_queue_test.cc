// PrefillQueue: chunks in arrival order, whole prompts while they fit, a prompt split across
// chunks with its first and last pieces marked, and cancellation before, during and after.
#include "engine/prefill_queue.h"

#include <gtest/gtest.h>

#include <chrono>
#include <numeric>
#include <vector>

namespace ts {
namespace {

struct Prompt {
  std::vector<int32_t> tokens;
  std::vector<int32_t> table;
};

Prompt MakePrompt(int32_t len, int32_t first_token) {
  Prompt p;
  p.tokens.resize(len);
  std::iota(p.tokens.begin(), p.tokens.end(), first_token);
  p.table = {first_token, first_token + 1};
  return p;
}

void Push(PrefillQueue& q, SlotId slot, const Prompt& p,
          PrefillQueue::Clock::time_point queued_at = {}) {
  q.Push(
      SlotInit{
          .slot = slot, .prompt = p.tokens, .block_table = p.table, .sampling = {}, .stop = {}},
      queued_at);
}

TEST(PrefillQueueTest, PacksWholePromptsThenSplitsTheNextInArrivalOrder) {
  PrefillQueue q;
  {
    // The queue keeps its own copies: these vectors die before any chunk is taken.
    const Prompt a = MakePrompt(3, 100), b = MakePrompt(10, 200), c = MakePrompt(2, 300);
    Push(q, 5, a);
    Push(q, 1, b);
    Push(q, 7, c);
  }
  EXPECT_EQ(q.pending_rows(), 15);
  std::vector<PrefillQueue::Piece> chunk = q.NextChunk(8);
  ASSERT_EQ(chunk.size(), 2u);
  EXPECT_EQ(chunk[0].init->slot, 5);
  EXPECT_EQ(chunk[0].start, 0);
  EXPECT_EQ(chunk[0].len, 3);
  EXPECT_TRUE(chunk[0].first && chunk[0].last);
  EXPECT_EQ(chunk[0].init->prompt[2], 102);
  EXPECT_EQ(chunk[0].init->block_table[1], 101);
  EXPECT_EQ(chunk[1].init->slot, 1);
  EXPECT_EQ(chunk[1].start, 0);
  EXPECT_EQ(chunk[1].len, 5);
  EXPECT_TRUE(chunk[1].first);
  EXPECT_FALSE(chunk[1].last);
  EXPECT_EQ(q.pending_rows(), 7);
  q.PopFinished();  // slot 5 is out whole
  EXPECT_FALSE(q.Contains(5));
  EXPECT_TRUE(q.Contains(1));

  chunk = q.NextChunk(4);
  ASSERT_EQ(chunk.size(), 1u);
  EXPECT_EQ(chunk[0].init->slot, 1);
  EXPECT_EQ(chunk[0].start, 5);
  EXPECT_EQ(chunk[0].len, 4);
  EXPECT_FALSE(chunk[0].first || chunk[0].last);
  EXPECT_EQ(chunk[0].init->prompt[chunk[0].start], 205);

  chunk = q.NextChunk(100);
  ASSERT_EQ(chunk.size(), 2u);
  EXPECT_EQ(chunk[0].init->slot, 1);
  EXPECT_EQ(chunk[0].start, 9);
  EXPECT_EQ(chunk[0].len, 1);
  EXPECT_TRUE(chunk[0].last);
  EXPECT_FALSE(chunk[0].first);
  EXPECT_EQ(chunk[1].init->slot, 7);
  EXPECT_TRUE(chunk[1].first && chunk[1].last);
  EXPECT_EQ(q.pending_rows(), 0);
  EXPECT_FALSE(q.empty());  // handed out, not yet popped
  EXPECT_TRUE(q.NextChunk(100).empty());
  q.PopFinished();
  EXPECT_TRUE(q.empty());
}

TEST(PrefillQueueTest, EveryRowIsHandedOutOnceWhateverTheChunkSizes) {
  PrefillQueue q;
  std::vector<Prompt> prompts;
  for (int i = 0; i < 6; ++i) prompts.push_back(MakePrompt(1 + 7 * i, 1000 * i));
  for (int i = 0; i < 6; ++i) Push(q, i, prompts[i]);
  std::vector<std::vector<int32_t>> seen(6);
  const int32_t sizes[] = {1, 5, 16, 2, 64, 3};
  for (int round = 0; !q.empty(); ++round) {
    ASSERT_LT(round, 1000);
    int32_t rows = 0;
    for (const PrefillQueue::Piece& p : q.NextChunk(sizes[round % 6])) {
      const SlotId s = p.init->slot;
      EXPECT_EQ(p.first, seen[s].empty());
      EXPECT_EQ(p.start, static_cast<int32_t>(seen[s].size()));
      for (int32_t t = 0; t < p.len; ++t) seen[s].push_back(p.init->prompt[p.start + t]);
      EXPECT_EQ(p.last, seen[s].size() == prompts[s].tokens.size());
      rows += p.len;
    }
    EXPECT_LE(rows, sizes[round % 6]);
    q.PopFinished();
  }
  for (int i = 0; i < 6; ++i) EXPECT_EQ(seen[i], prompts[i].tokens) << "prompt " << i;
}

// The attention-weighted budget: a row at position p costs 1 + (p + 1) / keys_per_row, so a
// prompt's chunks shrink as its prefix grows, every row is still handed out once, and the first
// row of a chunk is taken even when it alone exceeds the budget.
TEST(PrefillQueueTest, AttentionWeightedChunksShrinkWithThePrefix) {
  PrefillQueue q;
  const Prompt a = MakePrompt(1000, 0), b = MakePrompt(5, 5000);
  Push(q, 0, a);
  Push(q, 1, b);
  std::vector<int32_t> lens;
  std::vector<int32_t> seen;
  for (int round = 0; round < 1000; ++round) {
    const std::vector<PrefillQueue::Piece> chunk = q.NextChunk(64, 100);
    if (chunk.empty()) break;
    const PrefillQueue::Piece& p = chunk.front();
    if (p.init->slot != 0) break;  // a is done; b follows in the same or the next chunk
    // The chunk's cost: its rows' 1 + (pos + 1) / 100 add up to at most 64, and one more row
    // would not have fit (unless the prompt ended).
    double cost = 0;
    for (int32_t pos = p.start; pos < p.start + p.len; ++pos) cost += 1.0 + (pos + 1) / 100.0;
    EXPECT_LE(cost, 64.0 + 1e-9) << "chunk at " << p.start;
    if (!p.last) {
      EXPECT_GT(cost + 1.0 + (p.start + p.len + 1) / 100.0, 64.0);
    }
    for (int32_t t = 0; t < p.len; ++t) seen.push_back(p.init->prompt[p.start + t]);
    lens.push_back(p.len);
    q.PopFinished();
  }
  ASSERT_GE(lens.size(), 3u);
  EXPECT_EQ(lens.front(), 50);  // positions 0..49 cost 50 + 12.75; the 51st row would pass 64
  EXPECT_GT(lens.front(), 4 * lens.back());
  EXPECT_EQ(seen, a.tokens);
  // Past position 6300 one row costs more than 64 units: it is still taken, alone.
  PrefillQueue big;
  const Prompt c = MakePrompt(7000, 0);
  Push(big, 2, c);
  int32_t handed = 0;
  for (int round = 0; handed < 7000; ++round) {
    ASSERT_LT(round, 7000);
    const std::vector<PrefillQueue::Piece> chunk = big.NextChunk(64, 100);
    ASSERT_EQ(chunk.size(), 1u);
    if (chunk[0].start > 6300) {
      EXPECT_EQ(chunk[0].len, 1);
    }
    handed += chunk[0].len;
    big.PopFinished();
  }
  EXPECT_TRUE(big.empty());
}

TEST(PrefillQueueTest, DropSaysWhetherThePromptWasStartedAndKeepsTheOthers) {
  PrefillQueue q;
  const Prompt a = MakePrompt(10, 0), b = MakePrompt(4, 50), c = MakePrompt(4, 90);
  Push(q, 0, a);
  Push(q, 1, b);
  Push(q, 2, c);
  EXPECT_EQ(q.Drop(9), PrefillQueue::DropResult::kNotQueued);
  (void)q.NextChunk(6);  // slot 0 part-way
  EXPECT_EQ(q.Drop(1), PrefillQueue::DropResult::kUnstarted);
  EXPECT_EQ(q.Drop(0), PrefillQueue::DropResult::kStarted);
  EXPECT_EQ(q.Drop(0), PrefillQueue::DropResult::kNotQueued);
  const std::vector<PrefillQueue::Piece> chunk = q.NextChunk(10);
  ASSERT_EQ(chunk.size(), 1u);
  EXPECT_EQ(chunk[0].init->slot, 2);
  // Its last piece is out: the first-token postprocess, not the queue, owns its cancel now.
  EXPECT_EQ(q.Drop(2), PrefillQueue::DropResult::kNotQueued);
  q.PopFinished();
  EXPECT_TRUE(q.empty());
}

// The catch-up budget (MixedStepPromptRows) keys on how long prompts wait behind others, so the
// queue reports the oldest prompt no chunk has started: a started prompt, however long it still
// runs, is not a backlog; a dropped one waits no more.
TEST(PrefillQueueTest, OldestUnstartedIsTheFirstPromptNoChunkHasStarted) {
  using namespace std::chrono_literals;
  const PrefillQueue::Clock::time_point t0{1s};
  PrefillQueue q;
  EXPECT_FALSE(q.oldest_unstarted().has_value());
  const Prompt a = MakePrompt(10, 100), b = MakePrompt(4, 200), c = MakePrompt(4, 300);
  Push(q, 1, a, t0);
  Push(q, 2, b, t0 + 5ms);
  Push(q, 3, c, t0 + 9ms);
  EXPECT_EQ(q.oldest_unstarted(), t0);
  q.NextChunk(6);  // a started, not finished
  EXPECT_EQ(q.oldest_unstarted(), t0 + 5ms);
  q.PopFinished();
  EXPECT_EQ(q.oldest_unstarted(), t0 + 5ms);
  EXPECT_EQ(q.Drop(2), PrefillQueue::DropResult::kUnstarted);
  EXPECT_EQ(q.oldest_unstarted(), t0 + 9ms);
  q.NextChunk(5);  // the rest of a, and c's first row
  EXPECT_FALSE(q.oldest_unstarted().has_value());
  q.PopFinished();
  ASSERT_TRUE(q.Contains(3));
  EXPECT_FALSE(q.oldest_unstarted().has_value());
}

}  // namespace
}  // namespace ts
