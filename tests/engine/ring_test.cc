#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
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

// Payload derived from seq, so an entry whose token or flags do not match its seq was torn (read
// while the producer rewrote it) and must never be accepted.
int32_t TokenOf(uint32_t seq) {
  return static_cast<int32_t>((seq * 2654435761u) >> 1);
}
uint32_t FlagsOf(uint32_t seq) {
  return seq * 40503u ^ 0x5bd1e995u;
}

// A producer laps a reader, with both gated so that every round is a known situation:
//  - lap: the producer is let a whole ring past what the reader wants next, so the drain must
//    report the lap (the entry it wants was overwritten) and accept nothing;
//  - clean: the producer may fill the ring but not lap it, and writes while the reader drains, so
//    the drain must succeed with at least the half ring that was there when it started;
//  - racing: the producer is held just under a lap ahead, then released, and the drain starts as
//    it begins to rewrite the entry the reader wants first, so entries are read while they are
//    being rewritten and the drain may or may not be lapped.
// Every accepted entry must be whole (its payload matches its seq) and in order; after a lap the
// reader resynchronises on LatestSeq().
TEST(TokenRing, ConcurrentProducerLapsAGatedReaderWhichSeesEveryLapAndNoTornEntry) {
  constexpr uint32_t kCapacity = 8;
  constexpr uint32_t kTotal = 300000;
  std::vector<RingEntry> storage(kCapacity);
  TokenRing ring(storage.data(), kCapacity);
  std::atomic<uint32_t> pushed{0}, allowed{0};
  std::atomic<bool> stop{false};
  std::thread producer([&] {
    for (uint32_t s = 1; s <= kTotal; ++s) {
      // Spins a little before yielding, so a release is seen while the reader is draining.
      for (int spin = 0; s > allowed.load(std::memory_order_acquire); ++spin) {
        if (stop.load(std::memory_order_relaxed)) return;
        if (spin > 256) std::this_thread::yield();
      }
      ring.Push(s, TokenOf(s), FlagsOf(s));
      pushed.store(s, std::memory_order_release);
    }
  });
  uint32_t next = 1;
  std::vector<RingEntry> out;
  uint64_t accepted = 0, torn = 0, out_of_order = 0, forced_laps = 0, missed_laps = 0;
  uint64_t clean_rounds = 0, bad_clean = 0, racing_laps = 0, bad_resync = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  bool timed_out = false;
  for (uint64_t round = 0; next <= kTotal; ++round) {
    enum {
      kLap,
      kClean,
      kRacing
    } kind = static_cast<decltype(kind)>(std::min<uint64_t>(round % 4, 2));
    const bool force = kind == kLap;
    const uint32_t base = next - 1;  // the reader has everything up to here
    const uint32_t limit[] = {base + kCapacity + 2, base + kCapacity, base + kCapacity - 1};
    allowed.store(limit[kind], std::memory_order_release);
    // Lap: seq next + capacity is written, so the entry for `next` no longer holds `next`.
    const uint32_t start[] = {base + kCapacity + 1, base + kCapacity / 2, base + kCapacity - 1};
    const uint32_t wait_for = std::min(start[kind], kTotal);
    while (pushed.load(std::memory_order_acquire) < wait_for) {
      if (std::chrono::steady_clock::now() > deadline) {
        timed_out = true;
        break;
      }
      std::this_thread::yield();
    }
    if (timed_out) break;
    const bool lap_certain =
        force && pushed.load(std::memory_order_acquire) >= base + kCapacity + 1;
    if (kind == kRacing) {
      // Released; the drain starts as the producer begins to rewrite the entry it wants first.
      allowed.store(base + 2 * kCapacity, std::memory_order_release);
      while (pushed.load(std::memory_order_acquire) < std::min(base + kCapacity, kTotal) &&
             std::chrono::steady_clock::now() < deadline) {
      }
    }
    out.clear();
    const uint32_t want = next;
    bool ok = ring.Drain(&next, &out);
    // An entry caught mid-rewrite reads as "not written yet"; once the rewrite is done the same
    // lap must be reported (bounded: the producer stops at `allowed`).
    for (int retry = 0; lap_certain && ok && out.empty() && retry < 1000000; ++retry) {
      ok = ring.Drain(&next, &out);
    }
    for (size_t i = 0; i < out.size(); ++i) {
      const RingEntry& e = out[i];
      if (e.seq != want + i) ++out_of_order;
      if (e.token != TokenOf(e.seq) || e.flags != FlagsOf(e.seq)) ++torn;
    }
    accepted += out.size();
    if (kind == kClean) {
      ++clean_rounds;
      if (!ok || next - 1 < wait_for) ++bad_clean;
    }
    if (lap_certain) {
      // The lap went unreported, or entries from the overwritten stretch were accepted.
      if (ok || !out.empty()) ++missed_laps;
      ++forced_laps;
    } else if (!ok && kind == kRacing) {
      ++racing_laps;
    }
    if (!ok) {
      if (next != want + out.size()) ++bad_resync;  // next_seq stays after the last good entry
      next = ring.LatestSeq();
      if (next < want) {
        ++bad_resync;
        break;
      }
    }
    if (pushed.load(std::memory_order_acquire) == kTotal && ok && out.empty()) break;
  }
  stop.store(true);
  allowed.store(kTotal);
  producer.join();
  std::printf(
      "accepted %llu entries; %llu forced laps, %llu clean rounds, %llu laps racing\n",
      static_cast<unsigned long long>(accepted), static_cast<unsigned long long>(forced_laps),
      static_cast<unsigned long long>(clean_rounds), static_cast<unsigned long long>(racing_laps));
  ASSERT_FALSE(timed_out) << "a gate wait timed out at seq " << next;
  EXPECT_EQ(torn, 0u) << "accepted entries whose payload does not match their seq";
  EXPECT_EQ(out_of_order, 0u);
  EXPECT_EQ(missed_laps, 0u) << "of " << forced_laps << " drains that were certainly lapped";
  EXPECT_EQ(bad_resync, 0u);
  EXPECT_EQ(bad_clean, 0u) << "of " << clean_rounds << " drains that could not be lapped";
  EXPECT_GT(forced_laps, 1000u);
  EXPECT_GT(clean_rounds, 1000u);
  // The reader ends on the producer's last entry: the newest one survives every lap.
  EXPECT_EQ(next, kTotal + 1);
}

// Against a linear scan written here, for every n up to the largest bucket, on lists that are
// not powers of two.
TEST(PickBucket, EqualsANaiveScanForEveryBatchSize) {
  const std::vector<std::vector<int32_t>> lists = {
      {1}, {3}, {1, 2, 4, 8, 16, 24, 32, 48, 64}, {2, 3, 5, 7, 11, 13}, {1, 6, 10, 100}, {4, 5}};
  for (const auto& buckets : lists) {
    for (int32_t n = 1; n <= buckets.back(); ++n) {
      int32_t want = -1;
      for (int32_t b : buckets) {
        if (b >= n) {
          want = b;
          break;
        }
      }
      ASSERT_EQ(PickBucket(buckets, n), want) << "n " << n << " of " << buckets.size();
    }
    EXPECT_EQ(PickBucket(buckets, 0), 0);
  }
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
