#include "kernels/rope_kv.cuh"

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/bf16_vec.cuh"
#include "kernels/cuda_check.h"
#include "kernels/pdl.cuh"

namespace ts::kernels {
namespace {

constexpr int kThreads = 128;

// One CTA per row. A work item is (head, chunk): 8 rotation pairs (i, i + D/2), i.e. two 16-byte
// vectors of one head, so q, k and v heads all move with 16-byte loads and stores.
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads) RopeKvKernel(RopeKvParams p) {
  constexpr int kHalf = kHeadDim / 2;
  constexpr int kChunks = kHalf / 8;
  __shared__ RopeCosSin cs_s[kHalf];

  // Everything read here (qkv, positions, slots) comes from earlier kernels; the next kernel
  // may launch now and waits for our completion itself (kernels/pdl.cuh).
  GridDepWait();
  GridDepLaunchDependents();
  const int32_t row = blockIdx.x;
  const int32_t pos = p.positions[row];
  for (int i = threadIdx.x; i < kHalf; i += kThreads) cs_s[i] = RopeAngle(pos, p.inv_freq[i]);

  const KvLayout& l = p.layout;
  const int32_t slot = p.slot_mapping[row];
  const bool slot_ok = KvSlotInPool(slot, l.num_blocks, l.block_size);
  if (!slot_ok && slot != kNoKvWrite && threadIdx.x == 0 && p.error_flag != nullptr)
    *p.error_flag = 1;
  const int32_t block = slot_ok ? slot / l.block_size : 0;
  const int32_t offset = slot_ok ? slot % l.block_size : 0;
  __syncthreads();

  const int hq = p.num_q_heads, hkv = l.num_kv_heads;
  __nv_bfloat16* row_ptr = p.qkv + static_cast<int64_t>(row) * (hq + 2 * hkv) * kHeadDim;
  const int items = (hq + 2 * hkv) * kChunks;
  // kBatch items a thread in flight at once: a store may alias a later load as far as the
  // compiler knows (q is rotated in place when q_out is null), so an item-at-a-time loop took a
  // memory round trip per item. Llama-3.1-8B has 3 items a thread, Llama-3.2-1B 2.
  constexpr int kBatch = 4;
  for (int first = threadIdx.x; first < items; first += kBatch * kThreads) {
    Bf16x8 lo[kBatch], hi[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int item = first + b * kThreads;
      if (item >= items) break;
      const __nv_bfloat16* src = row_ptr + (item / kChunks) * kHeadDim + (item % kChunks) * 8;
      lo[b] = LoadBf16x8Coherent(src);
      hi[b] = LoadBf16x8Coherent(src + kHalf);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int item = first + b * kThreads;
      if (item >= items) break;
      const int head = item / kChunks;
      const int i0 = (item % kChunks) * 8;
      if (head >= hq + hkv) {  // v: copy into the cache only
        if (slot_ok) {
          __nv_bfloat16* dst = p.v_cache + KvOffset(l, block, head - hq - hkv, offset);
          StoreBf16x8(dst + i0, lo[b]);
          StoreBf16x8(dst + kHalf + i0, hi[b]);
        }
        continue;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float o1, o2;
        RopeRotate(__bfloat162float(lo[b].h[j]), __bfloat162float(hi[b].h[j]), cs_s[i0 + j], o1,
                   o2);
        lo[b].h[j] = __float2bfloat16_rn(o1);
        hi[b].h[j] = __float2bfloat16_rn(o2);
      }
      __nv_bfloat16* dst = row_ptr + head * kHeadDim;
      if (head < hq && p.q_out != nullptr) {
        dst = p.q_out + (static_cast<int64_t>(row) * hq + head) * kHeadDim;
      }
      StoreBf16x8(dst + i0, lo[b]);
      StoreBf16x8(dst + kHalf + i0, hi[b]);
      if (head >= hq && slot_ok) {
        __nv_bfloat16* kdst = p.k_cache + KvOffset(l, block, head - hq, offset);
        StoreBf16x8(kdst + i0, lo[b]);
        StoreBf16x8(kdst + kHalf + i0, hi[b]);
      }
    }
  }
}

absl::Status Validate(const RopeKvParams& p) {
  TS_RETURN_IF_ERROR(ValidateRopeKvTargets("rope_kv", p.layout, p.num_q_heads, p.positions,
                                           p.slot_mapping, p.inv_freq, p.k_cache, p.v_cache,
                                           p.error_flag));
  TS_RETURN_IF_ERROR(RequirePointer("rope_kv.qkv", p.qkv));
  if (p.q_out != nullptr) TS_RETURN_IF_ERROR(RequirePointer("rope_kv.q_out", p.q_out));
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateRopeKvTargets(const char* prefix, const KvLayout& layout, int32_t num_q_heads,
                                   const int32_t* positions, const int32_t* slot_mapping,
                                   const float* inv_freq, const __nv_bfloat16* k_cache,
                                   const __nv_bfloat16* v_cache, const int32_t* error_flag) {
  // The checks name the field without the prefix; it is prepended only on failure, so a valid
  // launch (every eager prefill layer) builds no strings.
  absl::Status st = [&]() -> absl::Status {
    TS_RETURN_IF_ERROR(RequirePositive("layout.num_blocks", layout.num_blocks));
    TS_RETURN_IF_ERROR(RequirePositive("layout.block_size", layout.block_size));
    TS_RETURN_IF_ERROR(RequirePositive("layout.num_kv_heads", layout.num_kv_heads));
    TS_RETURN_IF_ERROR(RequirePositive("num_q_heads", num_q_heads));
    if (num_q_heads % layout.num_kv_heads != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("num_q_heads (", num_q_heads, ") must be a multiple of ", prefix,
                       ".layout.num_kv_heads (", layout.num_kv_heads, ")"));
    }
    TS_RETURN_IF_ERROR(RequirePointer("positions", positions, 4));
    TS_RETURN_IF_ERROR(RequirePointer("slot_mapping", slot_mapping, 4));
    TS_RETURN_IF_ERROR(RequirePointer("inv_freq", inv_freq, 4));
    TS_RETURN_IF_ERROR(RequirePointer("k_cache", k_cache));
    TS_RETURN_IF_ERROR(RequirePointer("v_cache", v_cache));
    if (error_flag != nullptr) TS_RETURN_IF_ERROR(RequirePointer("error_flag", error_flag, 4));
    return absl::OkStatus();
  }();
  if (st.ok()) return st;
  return absl::InvalidArgumentError(absl::StrCat(prefix, ".", st.message()));
}

absl::Status LaunchRopeKv(const RopeKvParams& p, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(RequireNonNegative("rope_kv.rows", p.rows));
  if (p.rows == 0) return absl::OkStatus();
  TS_RETURN_IF_ERROR(Validate(p));
  // The one place head_dim becomes a compile-time constant.
  // 16 serves the tiny fixture models the GPU greedy tests run.
  switch (p.layout.head_dim) {
    case 16:
      TS_CUDA_RETURN_IF_ERROR(
          LaunchWithPdl(RopeKvKernel<16>, dim3(p.rows), dim3(kThreads), 0, stream, p.pdl, p));
      break;
    case 64:
      TS_CUDA_RETURN_IF_ERROR(
          LaunchWithPdl(RopeKvKernel<64>, dim3(p.rows), dim3(kThreads), 0, stream, p.pdl, p));
      break;
    case 128:
      TS_CUDA_RETURN_IF_ERROR(
          LaunchWithPdl(RopeKvKernel<128>, dim3(p.rows), dim3(kThreads), 0, stream, p.pdl, p));
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "rope_kv.layout.head_dim must be one of {16, 64, 128}, got ", p.layout.head_dim));
  }
  TS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace ts::kernels
