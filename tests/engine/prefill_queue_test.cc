// PrefillQueue: chunks in arrival order, whole prompts while they fit, a prompt split across
// chunks with its first and last pieces marked, and cancellation before, during and after.
#include "engine/prefill_queue.h"

#include <gtest/gtest.h>

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

void Push(PrefillQueue& q, SlotId slot, const Prompt& p) {
  q.Push(SlotInit{
      .slot = slot, .prompt = p.tokens, .block_table = p.table, .sampling = {}, .stop = {}});
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

}  // namespace
}  // namespace ts
