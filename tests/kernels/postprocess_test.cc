// LaunchPostprocess against a host model of its contract, step after step over random slot
// tables (a few hundred rows, so several CTAs), every buffer compared byte for byte after each
// step:
//  - the stop rule is ts::CheckStop's (engine/backend.cc), transcribed here because kernel tests
//    do not link the engine: from min_new_tokens on, EOS (unless ignore_eos; only the first
//    num_eos ids count) then the slot's first num_stop_ids stop ids; then max_new_tokens;
//  - a set cancel flag wins: a finish-only record (token -1), no count, generated unchanged;
//  - then a passed deadline (%globaltimer): the same, with the deadline reason; a deadline far in
//    the future, or none (0), changes nothing;
//  - the emitted token's count + 1, crossing 65535 and saturating at UINT32_MAX;
//  - an ACTIVE row's slot changes generated, last_token, seq and state only;
//  - a ring record (seq, token, flags) at (seq - 1) % capacity, its reserved word untouched,
//    wrapping around small rings and from seqs near 2^32;
//  - done set to 1 exactly where a slot finished (and never written when the pointer is null);
//  - padding rows (-1) and non-ACTIVE slots touch nothing; cancel flags are only read.
// Rings, cancel and done are host-mapped as in production; everything starts poisoned or random
// and is compared whole, so a stray write anywhere shows.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kernels/postprocess.cuh"
#include "tests/kernels/kernel_test_util.h"

namespace ts::kernels {
namespace {

using testing::GuardedBuffer;
using testing::HostMappedBuffer;

constexpr int32_t kPoison32 = -1;  // the buffers' 0xFF poison, as a word

// A finish reason as the ring's flags carry it (common/ring.h), and an index into the coverage.
constexpr uint32_t Code(FinishReason r) {
  return static_cast<uint32_t>(r);
}

// ts::CheckStop (engine/backend.cc), transcribed.
uint32_t CheckStopRule(const SlotRow& s, std::span<const int32_t> eos, int32_t token) {
  const int32_t index = s.generated;
  const std::span<const int32_t> stop(s.stop_ids, static_cast<size_t>(s.num_stop_ids));
  if (index >= s.min_new_tokens) {
    if (!s.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end())
      return Code(FinishReason::kEos);
    if (std::find(stop.begin(), stop.end(), token) != stop.end())
      return Code(FinishReason::kStopToken);
  }
  if (index + 1 >= s.max_new_tokens) return Code(FinishReason::kLength);
  return 0;
}

// The ring flag layout of engine/backend.h: bit 0 finished, bits 8..15 the reason.
uint32_t Flags(uint32_t reason) {
  return reason == 0 ? 0u : 1u | reason << 8;
}

struct Config {
  int num_slots = 300;
  int vocab = 1000;
  uint32_t capacity = 5;
  int num_eos = 2;  // of the kMaxEosIds ids passed; the others are decoys
  bool with_done = true;
  int steps = 40;
  uint32_t seed = 1;
  // The rows the kernel processes and where a row that does not finish goes: a decode step
  // ACTIVE -> ACTIVE, the device loop's prefill PREFILL -> READY.
  int32_t from_state = kSlotActive;
  int32_t to_state = kSlotActive;
  std::string Name() const {
    return "slots=" + std::to_string(num_slots) + " vocab=" + std::to_string(vocab) +
           " capacity=" + std::to_string(capacity) + " num_eos=" + std::to_string(num_eos) +
           " done=" + std::to_string(with_done) + " seed=" + std::to_string(seed) +
           " states=" + std::to_string(from_state) + "->" + std::to_string(to_state);
  }
};

// How often each behaviour came up, so the random data provably exercises all of them.
struct Coverage {
  int reasons[7] = {};      // by finish reason, 0 = none
  int held_by_min = 0;      // an EOS or stop id before min_new_tokens
  int eos_ignored = 0;      // an active EOS id with ignore_eos
  int decoys = 0;           // an id past num_eos / num_stop_ids, not stopping
  int crossed_16_bits = 0;  // a count going 65535 -> 65536
  int saturated = 0;        // a count held at UINT32_MAX
  int out_of_vocab = 0;     // an emitted token outside [0, vocab): no count
  int wrapped = 0;          // a record at seq > capacity
  int padding = 0, inactive = 0, republished = 0;
  int moved = 0;  // rows that did not finish and changed state (PREFILL -> READY)
};

// Each slot's hot tokens start at these counts, so the increments hit the edges.
constexpr uint32_t kHotCounts[] = {0u, 1u, 65534u, 65535u, UINT32_MAX - 1, UINT32_MAX};
constexpr int kHot = 6;

// The expected contents of every buffer the kernel can reach.
struct State {
  std::vector<SlotRow> slots;
  std::vector<uint32_t> counts;  // [num_slots, vocab]
  std::vector<RingEntry> rings;  // [num_slots, capacity]
  std::vector<int32_t> cancel, done;
  std::vector<int32_t> hot;  // [num_slots, kHot]
};

class Sim {
 public:
  Sim(const Config& c, Coverage* cov) : c_(c), cov_(cov), gen_(c.seed) {}

  int32_t Pick(int n) { return static_cast<int32_t>(gen_() % static_cast<uint32_t>(n)); }

  // Junk bytes everywhere; an ACTIVE slot then gets valid stop parameters (its reserved words
  // and sampling row stay junk: the kernel must leave them as they are).
  SlotRow RandomSlot(int32_t state) {
    std::array<uint32_t, sizeof(SlotRow) / 4> junk;
    for (uint32_t& w : junk) w = gen_();
    SlotRow s;
    std::memcpy(static_cast<void*>(&s), junk.data(), sizeof(s));
    s.state = state;
    if (state != c_.from_state) return s;
    s.prompt_len = 1 + Pick(4000);
    s.generated = Pick(20);
    s.last_token = Pick(c_.vocab);
    // Near 2^32 (but not past it within the steps) the ring index needs a true modulo.
    s.seq = Pick(4) == 0 ? 0xFFFFFF00u - static_cast<uint32_t>(Pick(64))
                         : static_cast<uint32_t>(Pick(3 * static_cast<int>(c_.capacity) + 1));
    const int m = Pick(8);
    s.max_new_tokens = m == 0 ? s.generated : m == 1 ? (1 << 30) : s.generated + 1 + Pick(25);
    s.min_new_tokens = std::max(0, s.generated - 5 + Pick(15));
    s.ignore_eos = Pick(4) == 0 ? 1 : 0;
    s.num_stop_ids = Pick(5) == 0 ? kMaxStopIds : Pick(kMaxStopIds + 1);
    for (int32_t& id : s.stop_ids) id = Pick(c_.vocab);
    if (Pick(4) == 0) s.stop_ids[0] = eos_[0];  // both: EOS wins unless ignored
    // Deadlines: none, long passed (1 ns after the timer's epoch), or centuries away.
    const int d = Pick(12);
    const uint64_t deadline = d == 0 ? 1 : d == 1 ? ~uint64_t{0} - Pick(1000) : 0;
    s.deadline_lo = static_cast<uint32_t>(deadline);
    s.deadline_hi = static_cast<uint32_t>(deadline >> 32);
    return s;
  }

  void Init() {
    for (int32_t& e : eos_) e = Pick(c_.vocab);
    const size_t n = static_cast<size_t>(c_.num_slots);
    st_.slots.resize(n);
    for (SlotRow& s : st_.slots) {
      const int k = Pick(10);
      // With PREFILL rows processed, ACTIVE and READY ones must be skipped.
      const int32_t other =
          c_.from_state == kSlotActive ? kSlotFree : (Pick(2) ? kSlotActive : kSlotReady);
      s = RandomSlot(k < 7 ? c_.from_state : k < 8 ? kSlotFinished : k < 9 ? other : kSlotFree);
    }
    st_.counts.resize(n * c_.vocab);
    for (uint32_t& v : st_.counts) v = gen_() % 5;
    st_.hot.resize(n * kHot);
    for (size_t i = 0; i < st_.hot.size(); ++i) {
      st_.hot[i] = Pick(c_.vocab);
      st_.counts[i / kHot * c_.vocab + st_.hot[i]] = kHotCounts[i % kHot];
    }
    RingEntry poison;
    std::memset(&poison, 0xFF, sizeof(poison));
    st_.rings.assign(n * c_.capacity, poison);
    st_.cancel.resize(n);
    for (size_t i = 0; i < n; ++i)
      st_.cancel[i] = st_.slots[i].state == c_.from_state ? 0 : kPoison32;
    st_.done.assign(n, kPoison32);
  }

  int32_t RandomToken(int32_t slot) {
    const SlotRow& s = st_.slots[slot];
    if (s.state != c_.from_state) return static_cast<int32_t>(gen_());  // junk: never read
    const int k = Pick(100);
    if (k < 12 && c_.num_eos > 0) return eos_[Pick(c_.num_eos)];
    if (k < 17 && c_.num_eos < kMaxEosIds) return eos_[c_.num_eos + Pick(kMaxEosIds - c_.num_eos)];
    if (k < 29 && s.num_stop_ids > 0) return s.stop_ids[Pick(s.num_stop_ids)];
    if (k < 34 && s.num_stop_ids < kMaxStopIds) {
      return s.stop_ids[s.num_stop_ids + Pick(kMaxStopIds - s.num_stop_ids)];
    }
    if (k < 36) return Pick(2) == 0 ? -2 : c_.vocab;
    if (k < 70) return st_.hot[static_cast<size_t>(slot) * kHot + Pick(kHot)];
    return Pick(c_.vocab);
  }

  // The host between steps: republishes some finished or free slots (as the engine's publish
  // does: a whole new row, cancel 0, done cleared), raises some cancel flags.
  std::vector<int32_t> Republish() {
    std::vector<int32_t> changed;
    for (int32_t i = 0; i < c_.num_slots; ++i) {
      if (st_.slots[i].state != c_.from_state && Pick(10) == 0) {
        st_.slots[i] = RandomSlot(c_.from_state);
        st_.cancel[i] = 0;
        st_.done[i] = kPoison32;
        changed.push_back(i);
        ++cov_->republished;
      } else if (st_.slots[i].state == c_.from_state && st_.cancel[i] == 0 && Pick(25) == 0) {
        const int32_t flags[] = {1, -1, 0x10000, 7};
        st_.cancel[i] = flags[Pick(4)];
      }
    }
    return changed;
  }

  // One step's rows: a shuffled subset of all slots (any state), padding rows among them.
  void MakeRows(std::vector<int32_t>* rows, std::vector<int32_t>* tokens) {
    std::vector<int32_t> order(c_.num_slots);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), gen_);
    order.resize(1 + Pick(c_.num_slots));
    rows->clear();
    tokens->clear();
    for (int32_t slot : order) {
      if (Pick(7) == 0) {
        rows->push_back(-1);
        tokens->push_back(static_cast<int32_t>(gen_()));
      }
      rows->push_back(slot);
      tokens->push_back(RandomToken(slot));
    }
  }

  // What the kernel must do to one row.
  void Apply(int32_t slot, int32_t token) {
    if (slot < 0) {
      ++cov_->padding;
      return;
    }
    SlotRow& s = st_.slots[slot];
    if (s.state != c_.from_state) {
      ++cov_->inactive;
      return;
    }
    uint32_t reason;
    const bool expired = s.deadline_hi == 0 && s.deadline_lo == 1;  // RandomSlot's passed one
    if (st_.cancel[slot] != 0 || expired) {
      token = -1;
      reason =
          st_.cancel[slot] != 0 ? Code(FinishReason::kCancelled) : Code(FinishReason::kDeadline);
    } else {
      const std::span<const int32_t> eos(eos_.data(), static_cast<size_t>(c_.num_eos));
      reason = CheckStopRule(s, eos, token);
      Note(s, token, reason);
      if (token >= 0 && token < c_.vocab) {
        uint32_t& count = st_.counts[static_cast<size_t>(slot) * c_.vocab + token];
        cov_->crossed_16_bits += count == 65535u;
        cov_->saturated += count == UINT32_MAX;
        if (count != UINT32_MAX) ++count;
      } else {
        ++cov_->out_of_vocab;
      }
      s.generated += 1;
      s.last_token = token;
    }
    s.seq += 1;
    cov_->wrapped += s.seq > c_.capacity;
    RingEntry& r = st_.rings[static_cast<size_t>(slot) * c_.capacity + (s.seq - 1) % c_.capacity];
    r.seq = s.seq;
    r.token = token;
    r.flags = Flags(reason);
    ++cov_->reasons[reason];
    if (reason != 0) {
      s.state = kSlotFinished;
      if (c_.with_done) st_.done[slot] = 1;
    } else if (c_.to_state != c_.from_state) {
      s.state = c_.to_state;
      ++cov_->moved;
    }
  }

  void Note(const SlotRow& s, int32_t token, uint32_t reason) {
    const auto in = [&](const int32_t* b, int n) { return std::find(b, b + n, token) != b + n; };
    const bool eos = in(eos_.data(), c_.num_eos), stop = in(s.stop_ids, s.num_stop_ids);
    if ((eos || stop) && s.generated < s.min_new_tokens) ++cov_->held_by_min;
    if (eos && s.ignore_eos && s.generated >= s.min_new_tokens) ++cov_->eos_ignored;
    const bool decoy = in(eos_.data() + c_.num_eos, kMaxEosIds - c_.num_eos) ||
                       in(s.stop_ids + s.num_stop_ids, kMaxStopIds - s.num_stop_ids);
    if (decoy && !eos && !stop && reason != Code(FinishReason::kLength)) ++cov_->decoys;
  }

  const State& state() const { return st_; }
  const std::array<int32_t, kMaxEosIds>& eos() const { return eos_; }

 private:
  Config c_;
  Coverage* cov_;
  std::mt19937 gen_;
  std::array<int32_t, kMaxEosIds> eos_{};
  State st_;
};

std::string Describe(const SlotRow& s) {
  char buf[200];
  std::snprintf(buf, sizeof(buf),
                "{state %d generated %d last_token %d seq %u max %d min %d ignore_eos %d stops %d}",
                s.state, s.generated, s.last_token, s.seq, s.max_new_tokens, s.min_new_tokens,
                s.ignore_eos, s.num_stop_ids);
  return buf;
}

// Compares what the GPU left with the model; the first few differences, and how many.
::testing::AssertionResult SameState(const State& want, const std::vector<SlotRow>& slots,
                                     const std::vector<uint32_t>& counts, const RingEntry* rings,
                                     const int32_t* cancel, const int32_t* done, int vocab,
                                     uint32_t capacity) {
  std::string first;
  int bad = 0;
  auto report = [&](const std::string& what) {
    if (++bad <= 5) first += "\n  " + what;
  };
  for (size_t i = 0; i < want.slots.size(); ++i) {
    if (std::memcmp(&want.slots[i], &slots[i], sizeof(SlotRow)) != 0) {
      report("slot " + std::to_string(i) + ": got " + Describe(slots[i]) + " want " +
             Describe(want.slots[i]) + " (or their other bytes differ)");
    }
    if (cancel[i] != want.cancel[i]) report("cancel[" + std::to_string(i) + "] written");
    if (done[i] != want.done[i]) {
      report("done[" + std::to_string(i) + "] = " + std::to_string(done[i]) + ", want " +
             std::to_string(want.done[i]));
    }
    for (uint32_t k = 0; k < capacity; ++k) {
      const RingEntry& g = rings[i * capacity + k];
      const RingEntry& w = want.rings[i * capacity + k];
      if (std::memcmp(&g, &w, sizeof(RingEntry)) != 0) {
        char buf[160];
        std::snprintf(buf, sizeof(buf),
                      "ring %zu entry %u: got {seq %u token %d flags 0x%x reserved 0x%x}, want "
                      "{seq %u token %d flags 0x%x reserved 0x%x}",
                      i, k, g.seq, g.token, g.flags, g.reserved, w.seq, w.token, w.flags,
                      w.reserved);
        report(buf);
      }
    }
  }
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] != want.counts[i]) {
      report("count of slot " + std::to_string(i / vocab) + " token " + std::to_string(i % vocab) +
             ": got " + std::to_string(counts[i]) + " want " + std::to_string(want.counts[i]));
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " differences:" << first;
}

void RunSteps(const Config& c, Coverage* cov) {
  SCOPED_TRACE(c.Name());
  Sim sim(c, cov);
  sim.Init();
  const size_t n = static_cast<size_t>(c.num_slots);
  const size_t max_rows = 2 * n;
  GuardedBuffer<SlotRow> d_slots(n);
  GuardedBuffer<uint32_t> d_counts(n * c.vocab);
  GuardedBuffer<int32_t> d_rows(max_rows), d_tokens(max_rows);
  HostMappedBuffer<RingEntry> rings(n * c.capacity);
  HostMappedBuffer<int32_t> cancel(n), done(n);
  d_slots.Upload(sim.state().slots);
  d_counts.Upload(sim.state().counts);
  std::copy(sim.state().cancel.begin(), sim.state().cancel.end(), cancel.host());
  cudaStream_t stream;
  TS_ASSERT_CUDA_OK(cudaStreamCreate(&stream));
  std::vector<int32_t> rows, tokens;
  for (int step = 0; step < c.steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    for (int32_t slot : sim.Republish()) {
      TS_ASSERT_CUDA_OK(cudaMemcpy(d_slots.get() + slot, &sim.state().slots[slot], sizeof(SlotRow),
                                   cudaMemcpyHostToDevice));
      done.host()[slot] = kPoison32;
    }
    std::copy(sim.state().cancel.begin(), sim.state().cancel.end(), cancel.host());
    sim.MakeRows(&rows, &tokens);
    const int32_t num_rows = static_cast<int32_t>(rows.size());
    rows.resize(max_rows, kPoison32);  // past p.rows: poison the kernel must not read
    tokens.resize(max_rows, kPoison32);
    d_rows.Upload(rows);
    d_tokens.Upload(tokens);

    PostprocessParams p;
    p.row_slots = d_rows.get();
    p.tokens = d_tokens.get();
    p.slots = d_slots.get();
    p.cancel = cancel.device();
    p.done = c.with_done ? done.device() : nullptr;
    p.rings = rings.device();
    p.output_counts = d_counts.get();
    std::copy(sim.eos().begin(), sim.eos().end(), p.eos_ids);  // decoys past num_eos
    p.num_eos = c.num_eos;
    p.rows = num_rows;
    p.num_slots = c.num_slots;
    p.vocab = c.vocab;
    p.ring_capacity = c.capacity;
    p.from_state = c.from_state;
    p.to_state = c.to_state;
    if (step % 3 == 2) {  // as the captured decode graph runs it
      ASSERT_TRUE(
          testing::RunInGraph(stream, [&](cudaStream_t s) { return LaunchPostprocess(p, s); }));
    } else {
      TS_ASSERT_OK(LaunchPostprocess(p, stream));
      TS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream));  // ours: the host reads what it wrote
    }
    for (int32_t r = 0; r < num_rows; ++r) sim.Apply(rows[r], tokens[r]);

    ASSERT_TRUE(SameState(sim.state(), d_slots.Download(), d_counts.Download(), rings.host(),
                          cancel.host(), done.host(), c.vocab, c.capacity))
        << num_rows << " rows";
    ASSERT_TRUE(d_slots.GuardsIntact());
    ASSERT_TRUE(d_counts.GuardsIntact());
    ASSERT_TRUE(rings.GuardsIntact());
    ASSERT_TRUE(cancel.GuardsIntact());
    ASSERT_TRUE(done.GuardsIntact());
  }
  cudaStreamDestroy(stream);
}

TEST(PostprocessTest, MatchesTheHostStopRuleStepByStep) {
  Coverage cov;
  const Config configs[] = {
      {.seed = 1},
      {.capacity = 2, .num_eos = kMaxEosIds, .with_done = false, .seed = 2},
      {.num_slots = 77, .vocab = 50000, .capacity = 3, .num_eos = 1, .seed = 3},
      {.num_slots = 200, .vocab = 4096, .capacity = 64, .num_eos = 0, .seed = 4},
      {.num_slots = 1, .vocab = 16, .capacity = 2, .num_eos = 3, .seed = 5},
      {.num_slots = 40, .seed = 6, .from_state = kSlotPrefill, .to_state = kSlotReady},
  };
  for (const Config& c : configs) {
    RunSteps(c, &cov);
    if (HasFatalFailure()) return;
  }
  std::printf(
      "coverage: none %d eos %d stop %d length %d cancelled %d deadline %d; held by min %d, eos "
      "ignored %d, "
      "decoys %d, 65535->65536 %d, saturated %d, out of vocab %d, wrapped %d, padding %d, "
      "inactive %d, republished %d\n",
      cov.reasons[0], cov.reasons[Code(FinishReason::kEos)],
      cov.reasons[Code(FinishReason::kStopToken)], cov.reasons[Code(FinishReason::kLength)],
      cov.reasons[Code(FinishReason::kCancelled)], cov.reasons[Code(FinishReason::kDeadline)],
      cov.held_by_min, cov.eos_ignored, cov.decoys, cov.crossed_16_bits, cov.saturated,
      cov.out_of_vocab, cov.wrapped, cov.padding, cov.inactive, cov.republished);
  for (int r = 0; r < 5; ++r) EXPECT_GT(cov.reasons[r], 0) << "finish reason " << r;
  EXPECT_GT(cov.reasons[Code(FinishReason::kDeadline)], 0);
  EXPECT_GT(cov.held_by_min, 0);
  EXPECT_GT(cov.eos_ignored, 0);
  EXPECT_GT(cov.decoys, 0);
  EXPECT_GT(cov.crossed_16_bits, 0);
  EXPECT_GT(cov.saturated, 0);
  EXPECT_GT(cov.out_of_vocab, 0);
  EXPECT_GT(cov.wrapped, 0);
  EXPECT_GT(cov.padding, 0);
  EXPECT_GT(cov.inactive, 0);
  EXPECT_GT(cov.moved, 0);
}

TEST(PostprocessTest, ZeroRowsLaunchNothing) {
  PostprocessParams p;  // every pointer null: nothing may be touched or checked
  p.rows = 0;
  TS_ASSERT_OK(LaunchPostprocess(p, nullptr));
}

TEST(PostprocessTest, RejectsBadParams) {
  GuardedBuffer<SlotRow> slots(2);
  GuardedBuffer<uint32_t> counts(2 * 64);
  GuardedBuffer<int32_t> rows(1), tokens(1), cancel(2), done(2);
  GuardedBuffer<RingEntry> rings(2 * 4);
  PostprocessParams good;
  good.row_slots = rows.get();
  good.tokens = tokens.get();
  good.slots = slots.get();
  good.cancel = cancel.get();
  good.done = done.get();
  good.rings = rings.get();
  good.output_counts = counts.get();
  good.rows = 1;
  good.num_slots = 2;
  good.vocab = 64;
  good.ring_capacity = 4;
  PostprocessParams p = good;
  p.rows = -1;
  TS_EXPECT_INVALID(LaunchPostprocess(p, nullptr), "postprocess.rows");
  p = good;
  p.num_slots = 0;
  TS_EXPECT_INVALID(LaunchPostprocess(p, nullptr), "postprocess.num_slots");
  p = good;
  p.vocab = 0;
  TS_EXPECT_INVALID(LaunchPostprocess(p, nullptr), "postprocess.vocab");
  p = good;
  p.ring_capacity = 1;
  TS_EXPECT_INVALID(LaunchPostprocess(p, nullptr), "postprocess.ring_capacity");
  for (int32_t num_eos : {-1, kMaxEosIds + 1}) {
    p = good;
    p.num_eos = num_eos;
    TS_EXPECT_INVALID(LaunchPostprocess(p, nullptr), "postprocess.num_eos");
  }
  p = good;
  p.cancel = nullptr;
  TS_EXPECT_INVALID(LaunchPostprocess(p, nullptr), "postprocess.cancel");
  p = good;
  p.rings = nullptr;
  TS_EXPECT_INVALID(LaunchPostprocess(p, nullptr), "postprocess.rings");
  p = good;
  // Counts are 4 bytes each: a 2-byte-aligned pointer is a uint16 layout's leftover.
  p.output_counts = reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(counts.get()) + 2);
  TS_EXPECT_INVALID(LaunchPostprocess(p, nullptr), "postprocess.output_counts");
  TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(counts.GuardsIntact());
  EXPECT_TRUE(rings.GuardsIntact());
}

}  // namespace
}  // namespace ts::kernels
