#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "engine/backend.h"

namespace ts {
namespace {

std::vector<int32_t> Tokens(const std::vector<RingEntry>& entries) {
  std::vector<int32_t> out;
  for (const RingEntry& e : entries) out.push_back(e.token);
  return out;
}

TEST(TokenRing, PushThenDrainInOrderAndWrapsAround) {
  std::vector<RingEntry> storage(4);
  TokenRing ring(storage.data(), 4);
  uint32_t next = 1;
  std::vector<RingEntry> out;
  EXPECT_TRUE(ring.Drain(&next, &out));
  EXPECT_TRUE(out.empty());
  // Three rounds of three tokens go around the 4-entry ring more than twice.
  int32_t token = 100;
  uint32_t written = 0;
  std::vector<int32_t> expected;
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 3; ++i) {
      ring.Push(++written, token, 0);
      expected.push_back(token++);
    }
    out.clear();
    ASSERT_TRUE(ring.Drain(&next, &out));
    EXPECT_EQ(Tokens(out), std::vector<int32_t>(expected.end() - 3, expected.end()));
  }
  EXPECT_EQ(next, 10u);
}

TEST(TokenRing, FinishedFlagCarriesReason) {
  std::vector<RingEntry> storage(8);
  TokenRing ring(storage.data(), 8);
  ring.Push(1, 7, 0);
  ring.Push(2, -1, RingFlags(FinishReason::kCancelled));
  uint32_t next = 1;
  std::vector<RingEntry> out;
  ASSERT_TRUE(ring.Drain(&next, &out));
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].flags & kRingFinished, 0u);
  EXPECT_NE(out[1].flags & kRingFinished, 0u);
  EXPECT_EQ(RingReason(out[1].flags), FinishReason::kCancelled);
  EXPECT_EQ(out[1].token, -1);
  EXPECT_EQ(RingFlags(FinishReason::kNone), 0u);
}

TEST(TokenRing, DetectsLapAndResyncsOnLatest) {
  std::vector<RingEntry> storage(4);
  TokenRing ring(storage.data(), 4);
  for (uint32_t s = 1; s <= 6; ++s) ring.Push(s, static_cast<int32_t>(s * 10), 0);
  uint32_t next = 1;
  std::vector<RingEntry> out;
  // Entry for seq 1 now holds seq 5: the reader was lapped.
  EXPECT_FALSE(ring.Drain(&next, &out));
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(next, 1u);
  EXPECT_EQ(ring.LatestSeq(), 6u);
  next = ring.LatestSeq();
  ASSERT_TRUE(ring.Drain(&next, &out));
  EXPECT_EQ(Tokens(out), std::vector<int32_t>({60}));
}

TEST(TokenRing, LapAfterSomeValidEntriesKeepsThem) {
  std::vector<RingEntry> storage(4);
  TokenRing ring(storage.data(), 4);
  uint32_t next = 1;
  std::vector<RingEntry> out;
  ring.Push(1, 11, 0);
  ring.Push(2, 12, 0);
  ASSERT_TRUE(ring.Drain(&next, &out));
  out.clear();
  // Seqs 3..7: seq 7 overwrites seq 3's entry before the reader gets there.
  for (uint32_t s = 3; s <= 7; ++s) ring.Push(s, static_cast<int32_t>(s + 10), 0);
  EXPECT_FALSE(ring.Drain(&next, &out));
  EXPECT_EQ(next, 3u);
}

TEST(TokenRing, ResetStartsOverAtSeqOne) {
  std::vector<RingEntry> storage(4);
  TokenRing ring(storage.data(), 4);
  ring.Push(1, 5, 0);
  ring.Push(2, 6, RingFlags(FinishReason::kLength));
  ring.Reset();
  EXPECT_EQ(ring.LatestSeq(), 0u);
  uint32_t next = 1;
  std::vector<RingEntry> out;
  ASSERT_TRUE(ring.Drain(&next, &out));
  EXPECT_TRUE(out.empty());
  ring.Push(1, 42, 0);
  ASSERT_TRUE(ring.Drain(&next, &out));
  EXPECT_EQ(Tokens(out), std::vector<int32_t>({42}));
}

// A producer thread and a consumer thread: the consumer sees every token exactly once and in
// order, or reports a lap; it never reads a torn entry (token always matches its seq).
TEST(TokenRing, ConcurrentProducerConsumerNeverTears) {
  constexpr uint32_t kCapacity = 64;
  constexpr uint32_t kTotal = 200000;
  std::vector<RingEntry> storage(kCapacity);
  TokenRing ring(storage.data(), kCapacity);
  std::atomic<uint32_t> consumed{0};
  std::thread producer([&] {
    for (uint32_t s = 1; s <= kTotal; ++s) {
      // Back-pressure keeps the producer within the ring so no lap is expected.
      while (s - consumed.load(std::memory_order_acquire) > kCapacity) std::this_thread::yield();
      ring.Push(s, static_cast<int32_t>(s * 3 + 1),
                s == kTotal ? RingFlags(FinishReason::kLength) : 0u);
    }
  });
  uint32_t next = 1;
  std::vector<RingEntry> out;
  bool finished = false;
  uint32_t bad = 0;
  while (!finished) {
    out.clear();
    ASSERT_TRUE(ring.Drain(&next, &out));
    for (const RingEntry& e : out) {
      if (e.token != static_cast<int32_t>(e.seq * 3 + 1)) ++bad;
      if (e.flags & kRingFinished) finished = true;
    }
    consumed.store(next - 1, std::memory_order_release);
    if (out.empty()) std::this_thread::yield();
  }
  producer.join();
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(next, kTotal + 1);
}

TEST(PickBucket, SmallestBucketHoldingN) {
  const std::vector<int32_t> buckets = {1, 2, 4, 8, 16, 24, 32};
  EXPECT_EQ(PickBucket(buckets, 0), 0);
  EXPECT_EQ(PickBucket(buckets, 1), 1);
  EXPECT_EQ(PickBucket(buckets, 3), 4);
  EXPECT_EQ(PickBucket(buckets, 8), 8);
  EXPECT_EQ(PickBucket(buckets, 17), 24);
  EXPECT_EQ(PickBucket(buckets, 32), 32);
}

TEST(ValidateBuckets, NamesTheOffendingIndex) {
  EXPECT_TRUE(ValidateBuckets(std::vector<int32_t>{1, 4, 8}).ok());
  EXPECT_FALSE(ValidateBuckets(std::vector<int32_t>{}).ok());
  absl::Status s = ValidateBuckets(std::vector<int32_t>{1, 0, 4});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("buckets[1]"), std::string::npos) << s;
  s = ValidateBuckets(std::vector<int32_t>{1, 8, 4});
  EXPECT_NE(s.message().find("buckets[2]"), std::string::npos) << s;
}

TEST(CheckStop, EosStopIdsMinAndMax) {
  const std::vector<int32_t> eos = {2, 3};
  StopParams stop;
  stop.max_new_tokens = 5;
  stop.stop_token_ids = {9};
  EXPECT_EQ(CheckStop(stop, eos, 7, 0), FinishReason::kNone);
  EXPECT_EQ(CheckStop(stop, eos, 3, 0), FinishReason::kEos);
  EXPECT_EQ(CheckStop(stop, eos, 9, 1), FinishReason::kStopToken);
  EXPECT_EQ(CheckStop(stop, eos, 7, 4), FinishReason::kLength);
  // A stopping token at the last index reports its own reason, not length.
  EXPECT_EQ(CheckStop(stop, eos, 2, 4), FinishReason::kEos);
  stop.min_new_tokens = 2;
  EXPECT_EQ(CheckStop(stop, eos, 2, 1), FinishReason::kNone);
  EXPECT_EQ(CheckStop(stop, eos, 9, 1), FinishReason::kNone);
  EXPECT_EQ(CheckStop(stop, eos, 2, 2), FinishReason::kEos);
  stop.ignore_eos = true;
  EXPECT_EQ(CheckStop(stop, eos, 2, 3), FinishReason::kNone);
  EXPECT_EQ(CheckStop(stop, eos, 9, 3), FinishReason::kStopToken);
  EXPECT_EQ(CheckStop(stop, eos, 2, 4), FinishReason::kLength);
}

TEST(FinishReasonName, NamesEveryReason) {
  EXPECT_STREQ(FinishReasonName(FinishReason::kEos), "eos");
  EXPECT_STREQ(FinishReasonName(FinishReason::kStopToken), "stop_token");
  EXPECT_STREQ(FinishReasonName(FinishReason::kLength), "length");
  EXPECT_STREQ(FinishReasonName(FinishReason::kCancelled), "cancelled");
  EXPECT_STREQ(FinishReasonName(FinishReason::kError), "error");
  EXPECT_STREQ(FinishReasonName(FinishReason::kNone), "none");
}

}  // namespace
}  // namespace ts

namespace ts {
namespace {

TEST(ValidateSlotInit, EveryBackendSharedCheckNamesTheProblem) {
  BackendInfo info;
  info.model.vocab_size = 100;
  info.max_slots = 4;
  info.kv_block_size = 4;
  info.num_kv_blocks = 8;
  const std::vector<int32_t> prompt = {5, 6, 7};
  const std::vector<int32_t> blocks = {3, 1};  // 3 + 5 tokens -> 2 blocks
  SlotInit in{.slot = 2, .prompt = prompt, .block_table = blocks};
  in.stop.max_new_tokens = 5;
  EXPECT_TRUE(ValidateSlotInit(in, info).ok());

  auto expect_error = [&](SlotInit bad, const std::string& what) {
    const absl::Status s = ValidateSlotInit(bad, info);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_NE(s.message().find(what), std::string::npos) << s.message();
  };
  SlotInit bad = in;
  bad.slot = 4;
  expect_error(bad, "slot out of [0, 4)");
  bad = in;
  bad.prompt = {};
  expect_error(bad, "empty prompt");
  bad = in;
  bad.stop.max_new_tokens = 0;
  expect_error(bad, "max_new_tokens < 1");
  const std::vector<int32_t> oov = {5, 100};
  bad = in;
  bad.prompt = oov;
  expect_error(bad, "prompt[1] = 100");
  bad = in;
  bad.stop.max_new_tokens = 6;  // 9 tokens need 3 blocks
  expect_error(bad, "block_table has 2 blocks, needs 3");
  const std::vector<int32_t> far = {3, 8};
  bad = in;
  bad.block_table = far;
  expect_error(bad, "block_table[1] = 8");
  bad = in;
  bad.sampling.top_p = 0.0f;
  expect_error(bad, "sampling.top_p");
}

}  // namespace
}  // namespace ts
