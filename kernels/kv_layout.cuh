// Paged KV cache layout shared by every kernel that reads or writes KV (rope_kv_write, decode and
// prefill attention). Per layer, K and V are separate pools:
//   k_cache, v_cache: [num_blocks][num_kv_heads][block_size][head_dim] bf16
// One head's block_size tokens are contiguous (HND), so a decode CTA streams block_size*head_dim*2
// contiguous bytes per (block, head). Token t of a sequence lives in block block_table[t / bs] at
// offset t % bs.
#pragma once

#include <cstdint>

namespace ts::kernels {

struct KvLayout {
  int32_t num_blocks;
  int32_t num_kv_heads;
  int32_t block_size;
  int32_t head_dim;
};

__host__ __device__ inline int64_t KvOffset(const KvLayout& l, int32_t block, int32_t kv_head,
                                            int32_t offset_in_block) {
  return ((static_cast<int64_t>(block) * l.num_kv_heads + kv_head) * l.block_size +
          offset_in_block) * l.head_dim;
}

}  // namespace ts::kernels
