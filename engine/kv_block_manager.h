// Host-side bookkeeping for the paged KV pool: which of the backend's blocks are free. The engine
// reserves a request's worst case (prompt + max_new_tokens) at admission, so v1 never evicts and a
// decoding request can never run out of blocks mid-stream.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace ts {

class KvBlockManager {
 public:
  KvBlockManager(int32_t num_blocks, int32_t block_size);

  int32_t num_blocks() const { return static_cast<int32_t>(allocated_.size()); }
  int32_t block_size() const { return block_size_; }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  // ceil(tokens / block_size).
  int32_t BlocksFor(int64_t tokens) const;
  bool CanAllocate(int32_t n) const { return n >= 0 && n <= num_free(); }

  // n block ids, lowest free ids first; RESOURCE_EXHAUSTED (nothing taken) when fewer are free.
  absl::StatusOr<std::vector<int32_t>> Allocate(int32_t n);
  // Returns blocks to the pool. Freeing a block that is not allocated is a bug (TS_CHECK).
  void Free(std::span<const int32_t> blocks);

 private:
  int32_t block_size_;
  std::vector<int32_t> free_;    // free ids, highest first so pop_back yields the lowest
  std::vector<bool> allocated_;  // [num_blocks]
};

}  // namespace ts
