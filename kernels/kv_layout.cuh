// Paged KV cache layout shared by every kernel that reads or writes KV (rope_kv_write, decode and
// prefill attention). Per layer, K and V are separate pools:
//   k_cache, v_cache: [num_blocks][num_kv_heads][block_size][head_dim] bf16
// One head's block_size tokens are contiguous (HND), so a decode CTA streams block_size*head_dim*2
// contiguous bytes per (block, head). Token t of a sequence lives in block block_table[t / bs] at
// offset t % bs.
//
// Block-table entries past a sequence's blocks hold kInvalidKvBlock, never a real id: block 0 is
// some other request's live block. Writers turn a position whose entry is invalid (or past the
// table) into kBadKvSlot with KvSlotFor; rope_kv and the GEMV's kRopeKv epilogue then write
// nothing and raise the error flag, so an off-by-one fails the step instead of corrupting KV.
#pragma once

#include <cstdint>

namespace ts::kernels {

// Not a block: a kernel that dereferences it anyway lands ~2^31 blocks past the pool, an illegal
// address rather than a silent read of another request's KV.
inline constexpr int32_t kInvalidKvBlock = INT32_MAX;
// slot_mapping of a row that writes no K/V (batch padding). Not an error.
inline constexpr int32_t kNoKvWrite = -1;
// slot_mapping of a row whose K/V should be written but has no valid slot (a bug upstream): the
// writers reject every slot outside [kNoKvWrite, num_blocks * block_size) with the error flag.
inline constexpr int32_t kBadKvSlot = INT32_MIN;

// The K/V slot of position `pos` in a block-table row of `max_blocks` entries: block * block_size
// + offset, or kBadKvSlot when pos is past the row, its entry is negative or kInvalidKvBlock, or
// the slot overflows int32. An id >= num_blocks passes here and is flagged by the writer.
__host__ __device__ inline int32_t KvSlotFor(const int32_t* table, int32_t max_blocks,
                                             int32_t block_size, int32_t pos) {
  const int32_t index = pos / block_size;
  if (pos < 0 || index >= max_blocks) return kBadKvSlot;
  const int32_t block = table[index];
  if (block < 0 || block == kInvalidKvBlock) return kBadKvSlot;
  const int64_t slot = static_cast<int64_t>(block) * block_size + pos % block_size;
  return slot > INT32_MAX ? kBadKvSlot : static_cast<int32_t>(slot);
}

// Whether `slot` is a token slot of a pool of `num_blocks` blocks. A writer given any other slot
// writes nothing, and raises its error flag unless the slot is kNoKvWrite.
__host__ __device__ inline bool KvSlotInPool(int32_t slot, int32_t num_blocks, int32_t block_size) {
  return slot >= 0 && static_cast<int64_t>(slot) < static_cast<int64_t>(num_blocks) * block_size;
}

struct KvLayout {
  int32_t num_blocks;
  int32_t num_kv_heads;
  int32_t block_size;
  int32_t head_dim;
};

__host__ __device__ inline int64_t KvOffset(const KvLayout& l, int32_t block, int32_t kv_head,
                                            int32_t offset_in_block) {
  return ((static_cast<int64_t>(block) * l.num_kv_heads + kv_head) * l.block_size +
          offset_in_block) *
         l.head_dim;
}

}  // namespace ts::kernels
