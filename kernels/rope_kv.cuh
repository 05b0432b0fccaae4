// RoPE (rotate_half, as Hugging Face Llama) fused with the paged K/V cache write.
// Per row (token) of the fused QKV GEMM output:
//   q heads: rotated in place, or into q_out;
//   k heads: rotated in place and written to k_cache at the row's slot;
//   v heads: copied to v_cache at the row's slot.
// angle_i = float(position) * inv_freq[i] in fp32, as transformers forms it, then accurate
// sincosf (not __sinf: positions reach 1e5 and more). Rounded as transformers' bf16 Llama: cos
// and sin to bf16, then q * cos + rotate_half(q) * sin with each product and the sum rounded.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/kv_layout.cuh"

namespace ts::kernels {

struct RopeKvParams {
  // [rows, (num_q_heads + 2 * layout.num_kv_heads) * head_dim]: q heads, then k heads, then v
  // heads per row, as a fused QKV GEMM writes them. q (unless q_out is set) and k are rotated in
  // place, so a prefill attention may read K from here or from the cache.
  __nv_bfloat16* qkv = nullptr;
  // [rows, num_q_heads * head_dim], optional: receives rotated q; qkv's q part is then unchanged.
  __nv_bfloat16* q_out = nullptr;
  const int32_t* positions = nullptr;     // [rows] absolute position of each token
  const int32_t* slot_mapping = nullptr;  // [rows] KvSlotFor; kNoKvWrite = no KV write
  const float* inv_freq = nullptr;        // [head_dim / 2], models/rope.h
  __nv_bfloat16* k_cache = nullptr;       // [num_blocks][num_kv_heads][block_size][head_dim]
  __nv_bfloat16* v_cache = nullptr;       // [num_blocks][num_kv_heads][block_size][head_dim]
  // [1], optional. A slot outside [kNoKvWrite, num_blocks * block_size) (kBadKvSlot included) is a
  // bug upstream: its K/V are not written (never out of bounds) and the kernel stores 1 here.
  // Never cleared by the kernel.
  int32_t* error_flag = nullptr;
  KvLayout layout{};        // head_dim in {16, 64, 128}; gives num_kv_heads for the qkv row too
  int32_t rows = 0;         // >= 0; 0 launches nothing
  int32_t num_q_heads = 0;  // a positive multiple of layout.num_kv_heads
  bool pdl = false;         // programmatic dependent launch (kernels/pdl.cuh)
};

// Validates params (InvalidArgument naming the field) and enqueues the kernel on `stream`.
// Graph-capturable: no allocation, no sync.
absl::Status LaunchRopeKv(const RopeKvParams& p, cudaStream_t stream);

// The checks every RoPE + K/V-write launcher shares (LaunchRopeKv, and the GEMV's kRopeKv
// epilogue): a positive layout (head_dim is the caller's to check), num_q_heads a positive
// multiple of num_kv_heads, and the positions, slot_mapping, inv_freq, cache and optional
// error_flag pointers. InvalidArgument names the field under `prefix`, e.g. "rope_kv.inv_freq".
absl::Status ValidateRopeKvTargets(const char* prefix, const KvLayout& layout, int32_t num_q_heads,
                                   const int32_t* positions, const int32_t* slot_mapping,
                                   const float* inv_freq, const __nv_bfloat16* k_cache,
                                   const __nv_bfloat16* v_cache, const int32_t* error_flag);

}  // namespace ts::kernels
