#include "engine/backend.h"

#include <algorithm>
#include <atomic>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace ts {

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone:
      return "none";
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kStopToken:
      return "stop_token";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kError:
      return "error";
    case FinishReason::kDeadline:
      return "deadline";
  }
  return "unknown";
}

FinishReason CheckStop(const StopParams& stop, std::span<const int32_t> eos_token_ids,
                       int32_t token, int32_t index) {
  if (index >= stop.min_new_tokens) {
    if (!stop.ignore_eos &&
        std::find(eos_token_ids.begin(), eos_token_ids.end(), token) != eos_token_ids.end()) {
      return FinishReason::kEos;
    }
    if (std::find(stop.stop_token_ids.begin(), stop.stop_token_ids.end(), token) !=
        stop.stop_token_ids.end()) {
      return FinishReason::kStopToken;
    }
  }
  if (index + 1 >= stop.max_new_tokens) return FinishReason::kLength;
  return FinishReason::kNone;
}

// The ring is a seqlock per entry: the writer first invalidates seq, then writes the payload, then
// release-stores the new seq. The reader loads seq (acquire), the payload, and seq again after an
// acquire fence; a changed seq means the writer overwrote the entry meanwhile (a lap).
void TokenRing::Push(uint32_t seq, int32_t token, uint32_t flags) {
  TS_CHECK_GT(seq, 0u);
  RingEntry& e = entries_[(seq - 1) % capacity_];
  std::atomic_ref<uint32_t>(e.seq).store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  std::atomic_ref<int32_t>(e.token).store(token, std::memory_order_relaxed);
  std::atomic_ref<uint32_t>(e.flags).store(flags, std::memory_order_relaxed);
  std::atomic_ref<uint32_t>(e.seq).store(seq, std::memory_order_release);
}

bool TokenRing::Drain(uint32_t* next_seq, std::vector<RingEntry>* out) const {
  if (capacity_ == 0) return true;
  // One pass reads at most capacity entries: anything beyond is a lap the next call reports.
  for (uint32_t n = 0; n < capacity_; ++n) {
    const uint32_t want = *next_seq;
    RingEntry& e = entries_[(want - 1) % capacity_];
    const uint32_t s1 = std::atomic_ref<uint32_t>(e.seq).load(std::memory_order_acquire);
    if (s1 == 0 || s1 < want) return true;  // not written yet
    if (s1 != want) return false;           // overwritten by seq want + k * capacity
    RingEntry copy;
    copy.seq = s1;
    copy.token = std::atomic_ref<int32_t>(e.token).load(std::memory_order_relaxed);
    copy.flags = std::atomic_ref<uint32_t>(e.flags).load(std::memory_order_relaxed);
    copy.reserved = 0;
    std::atomic_thread_fence(std::memory_order_acquire);
    const uint32_t s2 = std::atomic_ref<uint32_t>(e.seq).load(std::memory_order_relaxed);
    if (s2 != s1) return false;
    out->push_back(copy);
    *next_seq = want + 1;
  }
  return true;
}

uint32_t TokenRing::LatestSeq() const {
  uint32_t latest = 0;
  for (uint32_t i = 0; i < capacity_; ++i) {
    latest = std::max(latest,
                      std::atomic_ref<uint32_t>(entries_[i].seq).load(std::memory_order_acquire));
  }
  return latest;
}

void TokenRing::Reset() {
  for (uint32_t i = 0; i < capacity_; ++i) {
    std::atomic_ref<uint32_t>(entries_[i].seq).store(0, std::memory_order_relaxed);
    entries_[i].token = 0;
    entries_[i].flags = 0;
    entries_[i].reserved = 0;
  }
  std::atomic_thread_fence(std::memory_order_release);
}

int32_t PickBucket(std::span<const int32_t> buckets, int32_t n) {
  if (n <= 0) return 0;
  TS_CHECK(!buckets.empty());
  auto it = std::lower_bound(buckets.begin(), buckets.end(), n);
  TS_CHECK(it != buckets.end());
  return *it;
}

absl::Status ValidateBuckets(std::span<const int32_t> buckets) {
  if (buckets.empty()) return absl::InvalidArgumentError("buckets: must not be empty");
  for (size_t i = 0; i < buckets.size(); ++i) {
    if (buckets[i] <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("buckets[", i, "]: must be positive, got ", buckets[i]));
    }
    if (i > 0 && buckets[i] <= buckets[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat("buckets[", i,
                                                     "]: must be strictly ascending, got ",
                                                     buckets[i - 1], " then ", buckets[i]));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateSlotInit(const SlotInit& in, const BackendInfo& info) {
  const std::string where = absl::StrCat("prefill slot ", in.slot, ": ");
  if (in.slot < 0 || in.slot >= info.max_slots) {
    return absl::InvalidArgumentError(absl::StrCat(where, "slot out of [0, ", info.max_slots, ")"));
  }
  if (in.prompt.empty()) return absl::InvalidArgumentError(absl::StrCat(where, "empty prompt"));
  if (in.stop.max_new_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat(where, "max_new_tokens < 1"));
  }
  for (size_t i = 0; i < in.prompt.size(); ++i) {
    if (in.prompt[i] < 0 || in.prompt[i] >= info.model.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "prompt[", i, "] = ", in.prompt[i], " outside the vocabulary"));
    }
  }
  const int64_t tokens = static_cast<int64_t>(in.prompt.size()) + in.stop.max_new_tokens;
  const int64_t need = (tokens + info.kv_block_size - 1) / info.kv_block_size;
  if (static_cast<int64_t>(in.block_table.size()) < need) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "block_table has ", in.block_table.size(), " blocks, needs ", need));
  }
  for (int64_t i = 0; i < need; ++i) {
    if (in.block_table[i] < 0 || in.block_table[i] >= info.num_kv_blocks) {
      return absl::InvalidArgumentError(absl::StrCat(where, "block_table[", i,
                                                     "] = ", in.block_table[i], " outside [0, ",
                                                     info.num_kv_blocks, ")"));
    }
  }
  return ValidateSamplingParams(in.sampling, info.model.vocab_size);
}

}  // namespace ts
