#include "engine/kv_block_manager.h"

#include <algorithm>
#include <functional>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace ts {

KvBlockManager::KvBlockManager(int32_t num_blocks, int32_t block_size)
    : block_size_(block_size), allocated_(static_cast<size_t>(std::max(num_blocks, 0)), false) {
  TS_CHECK_GE(num_blocks, 0);
  TS_CHECK_GT(block_size, 0);
  free_.reserve(allocated_.size());
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

int32_t KvBlockManager::BlocksFor(int64_t tokens) const {
  if (tokens <= 0) return 0;
  return static_cast<int32_t>((tokens + block_size_ - 1) / block_size_);
}

absl::StatusOr<std::vector<int32_t>> KvBlockManager::Allocate(int32_t n) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("blocks: negative count ", n));
  if (n > num_free()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("kv blocks: need ", n, ", only ", num_free(), " of ", num_blocks(), " free"));
  }
  std::vector<int32_t> out;
  out.reserve(n);
  for (int32_t i = 0; i < n; ++i) {
    const int32_t b = free_.back();
    free_.pop_back();
    allocated_[b] = true;
    out.push_back(b);
  }
  return out;
}

void KvBlockManager::Free(std::span<const int32_t> blocks) {
  for (int32_t b : blocks) {
    TS_CHECK_GE(b, 0);
    TS_CHECK_LT(b, num_blocks());
    TS_CHECK(allocated_[b]);
    allocated_[b] = false;
    free_.push_back(b);
  }
  // Keep "lowest ids first" so allocation order is deterministic whatever the free order was.
  std::sort(free_.begin(), free_.end(), std::greater<int32_t>());
}

}  // namespace ts
