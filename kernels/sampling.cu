#include "kernels/sampling.cuh"

#include <cuda_bf16.h>

#include <cfloat>
#include <climits>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/philox.h"
#include "common/status.h"
#include "kernels/cuda_check.h"

namespace ts::kernels {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
// 16-byte loads in flight per thread in a pass: the first pass (the argmax) keeps little else
// in registers, the radix walks' histogram updates more (at 1,024 threads a thread has 64).
constexpr int kFirstPassUnroll = 4;
constexpr int kWalkUnroll = 2;
constexpr int kVec = 4;  // floats per 16-byte load
// Radix levels over the 32-bit key: bits [31:21], [20:10], [9:0].
constexpr int kLevels = 3;
constexpr int kMaxBins = 2048;
constexpr int kLastBins = 1024;
__host__ __device__ constexpr int LevelShift(int level) {
  return level == 0 ? 21 : level == 1 ? 10 : 0;
}
__host__ __device__ constexpr int LevelBins(int level) {
  return level < 2 ? 2048 : 1024;
}
constexpr float kFixedOne = 4294967296.0f;  // weights in 32.32 fixed point

using u64 = unsigned long long;

// A prefix of the rank order (score desc, id asc): elements with key > key, or key == key and
// id <= id. {0, INT_MAX} is everything (every real key is > 0).
struct Cut {
  uint32_t key;
  int32_t id;
};
__device__ __forceinline__ bool InCut(uint32_t key, int32_t id, Cut c) {
  return key > c.key || (key == c.key && id <= c.id);
}

// Order-preserving map of a non-NaN float (with -0 folded into +0) to uint32.
__device__ __forceinline__ uint32_t OrderKey(float s) {
  const uint32_t u = __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct Smem {
  uint32_t count[kMaxBins];
  u64 weight[kMaxBins];
  int32_t min_id[kLastBins];
  int32_t max_id[kLastBins];
  u64 warp_sum[kWarps];
  float warp_best[kWarps];
  int32_t warp_best_id[kWarps];
  int32_t sel_bin;
  int32_t is_last;  // split: this CTA merges the row
  u64 sel_before;
  int32_t found_id;
};

// One row: where its data is, and the per-element score recomputed by every pass (cheaper than a
// scratch copy of the row, and keeps the logits read-only).
struct Row {
  const float* logits;     // [vocab]
  const uint32_t* counts;  // [vocab], only when penalize
  const uint32_t* mask;    // [ceil(vocab / 32)], only when penalize
  int32_t vocab;
  bool penalize;
  bool round_bf16;  // SamplingKernelParams::round_logits_to_bf16
  float repetition, presence, frequency, temperature, min_p;
  float s0;  // max score, known after the first pass

  // Step 1 of models/sampling.h, with explicit roundings so nvcc's FMA contraction cannot make it
  // differ from the CPU's separate multiply and add.
  __device__ __forceinline__ float Penalize(int32_t i, float l) const {
    const uint32_t c = counts[i];
    if (repetition != 1.0f && (c > 0 || ((mask[i >> 5] >> (i & 31)) & 1u))) {
      l = l > 0.0f ? __fdiv_rn(l, repetition) : __fmul_rn(l, repetition);
    }
    if (c > 0) l = __fsub_rn(l, __fadd_rn(presence, __fmul_rn(frequency, static_cast<float>(c))));
    return l;
  }
  // Step 3: s = l / T, NaN -> -inf, +inf -> FLT_MAX, -0 -> +0 (equal floats must get equal keys).
  __device__ __forceinline__ float Temper(float l) const {
    float s = __fdiv_rn(l, temperature);
    if (isnan(s)) return -INFINITY;
    s = fminf(s, FLT_MAX);
    return s == 0.0f ? 0.0f : s;
  }
  __device__ __forceinline__ float Load(float l) const {
    return round_bf16 ? __bfloat162float(__float2bfloat16_rn(l)) : l;
  }
  __device__ __forceinline__ float ScoreAt(int32_t i) const {
    float l = Load(logits[i]);
    if (penalize) l = Penalize(i, l);
    return Temper(l);
  }
  __device__ __forceinline__ float Weight(float s) const { return expf(__fsub_rn(s, s0)); }
};

__device__ __forceinline__ float NanToNegInf(float v) {
  return isnan(v) ? -INFINITY : v;
}

// Warp w owns ids [w * range, (w + 1) * range), a multiple of 32 ids: ids are in order across
// warps, which the tie walk relies on (it walks a warp's range again with ballots).
__device__ __forceinline__ int32_t WarpRange(int32_t vocab) {
  return ((vocab + kWarps - 1) / kWarps + 31) / 32 * 32;
}

// Calls f(id, value) for this thread's ids, value = penalised logit with NaN -> -inf when
// `greedy`, else the score. Only ids in [lo, hi) when given (a split CTA's slice).
//
// A pass streams a row at one CTA an SM, so its speed is the bytes each SM keeps in flight: the
// warp reads its range as 16-byte vectors, kUnroll of them a lane issued before any is used (64
// KB a CTA in the first pass, 32 in the walks; the scalar loads before kept 16 KB in flight:
// bench/results/2026-12-05d-h100.md). The range's ends up to a 16-byte boundary of the row (a
// vocab or a slice start that is not a multiple of 4) are read one id a lane. The order of calls
// within a warp is unspecified.
template <int kUnroll = kFirstPassUnroll, typename F>
__device__ __forceinline__ void ForEachValue(const Row& r, bool greedy, F&& f, int32_t lo = 0,
                                             int32_t hi = -1) {
  if (hi < 0) hi = r.vocab;
  const int32_t range = WarpRange(hi - lo);
  const int32_t begin = lo + (threadIdx.x / 32) * range;
  const int32_t end = min(begin + range, hi);
  const int32_t lane = threadIdx.x % 32;
  auto value = [&](float v) { return greedy ? NanToNegInf(v) : r.Temper(v); };
  auto one = [&](int32_t i) {  // a head or tail id
    float v = r.Load(__ldg(r.logits + i));
    if (r.penalize) v = r.Penalize(i, v);
    f(i, value(v));
  };
  // [body, body_end): whole 16-byte vectors of the row.
  const int32_t misaligned =
      static_cast<int32_t>(reinterpret_cast<uintptr_t>(r.logits + begin) / 4 % 4);
  const int32_t body = min(end, begin + (kVec - misaligned) % kVec);
  const int32_t body_end = body + max(0, end - body) / kVec * kVec;
  if (begin + lane < body) one(begin + lane);
  for (int32_t base = body + kVec * lane; base < body_end; base += 32 * kVec * kUnroll) {
    float v[kUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int32_t i = base + 32 * kVec * u;
      const float4 x =
          i < body_end ? __ldg(reinterpret_cast<const float4*>(r.logits + i)) : float4{};
      v[u][0] = r.Load(x.x);
      v[u][1] = r.Load(x.y);
      v[u][2] = r.Load(x.z);
      v[u][3] = r.Load(x.w);
    }
    if (r.penalize) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int32_t i = base + 32 * kVec * u;
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          if (i < body_end) v[u][j] = r.Penalize(i + j, v[u][j]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int32_t i = base + 32 * kVec * u;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if (i < body_end) f(i + j, value(v[u][j]));
      }
    }
  }
  if (body_end + lane < end) one(body_end + lane);
}

__device__ __forceinline__ bool Better(float v, int32_t i, float best, int32_t best_i) {
  return v > best || (v == best && i < best_i);
}

// Rank 0: the largest value, lowest id among equals. Every thread gets the result.
__device__ void BlockArgMax(float& best, int32_t& best_i, Smem& sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int32_t oi = __shfl_xor_sync(0xffffffffu, best_i, o);
    if (Better(ov, oi, best, best_i)) best = ov, best_i = oi;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) sh.warp_best[warp] = best, sh.warp_best_id[warp] = best_i;
  __syncthreads();
  best = sh.warp_best[lane];
  best_i = sh.warp_best_id[lane];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int32_t oi = __shfl_xor_sync(0xffffffffu, best_i, o);
    if (Better(ov, oi, best, best_i)) best = ov, best_i = oi;
  }
  __syncthreads();  // warp_best is reused by the next reduction
}

// Exclusive prefix sum over threads in threadIdx order; *total gets the sum of all.
__device__ u64 BlockExclusiveScan(u64 v, Smem& sh, u64* total) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  u64 incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const u64 n = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += n;
  }
  if (lane == 31) sh.warp_sum[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    u64 w = sh.warp_sum[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const u64 n = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += n;
    }
    sh.warp_sum[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  *total = sh.warp_sum[kWarps - 1];
  const u64 before = warp > 0 ? sh.warp_sum[warp - 1] : 0;
  __syncthreads();  // warp_sum is reused by the next scan
  return before + incl - v;
}

enum class Walk { kTopK, kTopP, kDraw };

struct WalkArgs {
  Walk mode;
  int32_t top_k;
  float top_p;
  uint32_t u24;  // the draw's u * 2^24
  bool use_min_p;
};

// The walk's target: the first element (in rank order, within the set) whose running amount
// (count for top-k, fixed-point weight otherwise) exceeds it.
__device__ u64 WalkTarget(const WalkArgs& a, u64 total) {
  switch (a.mode) {
    case Walk::kTopK:
      return static_cast<u64>(a.top_k - 1);  // rank k-1 is the last kept
    case Walk::kTopP: {
      // Smallest prefix with running sum >= p * W, i.e. first running sum > ceil(p * W) - 1.
      u64 thr = static_cast<u64>(ceil(static_cast<double>(a.top_p) * static_cast<double>(total)));
      thr = thr < 1 ? 1 : (thr > total ? total : thr);
      return thr - 1;
    }
    case Walk::kDraw:
    default:
      // floor(u * S), exact: u = u24 / 2^24 and u24 * S needs up to 80 bits.
      return (__umul64hi(a.u24, total) << 40) | ((static_cast<u64>(a.u24) * total) >> 24);
  }
}

// The j-th (1-based) lowest id among set elements with key == key_t. Only warps whose id range
// holds the answer walk it with ballots, so this is one counting pass plus a short walk.
__device__ int32_t NthTieId(const Row& r, Smem& sh, uint32_t key_t, Cut cut, u64 j) {
  auto match = [&](int32_t i, float s) { return OrderKey(s) == key_t && InCut(key_t, i, cut); };
  uint32_t mine = 0;
  ForEachValue<kWalkUnroll>(r, false, [&](int32_t i, float s) { mine += match(i, s) ? 1u : 0u; });
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) sh.found_id = -1;
  u64 total;
  const u64 before = BlockExclusiveScan(lane == 0 ? mine : 0, sh, &total);
  const u64 warp_before = __shfl_sync(0xffffffffu, before, 0);
  if (warp_before < j && j <= warp_before + mine) {
    const int32_t range = WarpRange(r.vocab);
    const int32_t begin = warp * range, end = min(begin + range, r.vocab);
    u64 seen = warp_before;
    for (int32_t base = begin; base < end; base += 32) {
      const int32_t i = base + lane;
      const bool m = i < end && match(i, r.ScoreAt(i));
      uint32_t bits = __ballot_sync(0xffffffffu, m);
      const uint32_t n = __popc(bits);
      if (seen + n >= j) {
        for (u64 k = 1; k < j - seen; ++k) bits &= bits - 1;  // drop the lower set bits
        if (lane == 0) sh.found_id = base + __ffs(bits) - 1;
        break;
      }
      seen += n;
    }
  }
  __syncthreads();
  const int32_t id = sh.found_id;
  __syncthreads();
  return id;
}

// Finds the first element in rank order, within the set (cut, plus min-p when use_min_p), at
// which the running amount exceeds the target. Returns its id (-1 if none, which the targets
// rule out) and narrows `cut` to end at it.
__device__ int32_t RadixWalk(const Row& r, Smem& sh, const WalkArgs& a, Cut& cut) {
  const bool weighted = a.mode != Walk::kTopK;
  uint32_t prefix = 0, prefix_mask = 0;
  u64 above = 0;   // amount of set elements ranked above the current bin range
  u64 target = 0;  // set from the level-0 total
  uint32_t tie_count = 0;
  u64 tie_weight = 0;
  int32_t tie_min = -1, tie_max = -1;
  for (int level = 0; level < kLevels; ++level) {
    const int shift = LevelShift(level), bins = LevelBins(level);
    const bool last = level == kLevels - 1;
    for (int b = threadIdx.x; b < bins; b += kThreads) {
      sh.count[b] = 0;
      sh.weight[b] = 0;
      if (last) sh.min_id[b] = INT_MAX, sh.max_id[b] = -1;
    }
    if (threadIdx.x == 0) sh.sel_bin = -1;
    __syncthreads();
    ForEachValue<kWalkUnroll>(r, false, [&](int32_t i, float s) {
      const uint32_t key = OrderKey(s);
      if ((key & prefix_mask) != prefix || !InCut(key, i, cut)) return;
      float w = 0.0f;
      if (weighted || a.use_min_p) w = r.Weight(s);
      if (a.use_min_p && !(w >= r.min_p)) return;
      const uint32_t bin = (key >> shift) & (bins - 1);
      atomicAdd(&sh.count[bin], 1u);
      if (weighted) atomicAdd(&sh.weight[bin], __float2ull_rn(w * kFixedOne));
      if (last) atomicMin(&sh.min_id[bin], i), atomicMax(&sh.max_id[bin], i);
    });
    __syncthreads();

    // Scan the bins from the highest key down; thread t owns positions [2t, 2t + 2) (fewer bins:
    // [t, t + 1)), position q being bin bins - 1 - q.
    const int per = bins / kThreads;
    u64 local = 0;
    for (int q = 0; q < per; ++q) {
      const int b = bins - 1 - (threadIdx.x * per + q);
      local += weighted ? sh.weight[b] : sh.count[b];
    }
    u64 total;
    u64 run = BlockExclusiveScan(local, sh, &total);
    if (level == 0) target = WalkTarget(a, total);
    const u64 t = target - above;
    for (int q = 0; q < per; ++q) {
      const int b = bins - 1 - (threadIdx.x * per + q);
      const u64 amount = weighted ? sh.weight[b] : sh.count[b];
      if (run <= t && t < run + amount) sh.sel_bin = b, sh.sel_before = run;
      run += amount;
    }
    __syncthreads();
    const int sel = sh.sel_bin;
    if (sel < 0) return -1;  // block-uniform
    above += sh.sel_before;
    prefix |= static_cast<uint32_t>(sel) << shift;
    prefix_mask |= static_cast<uint32_t>(bins - 1) << shift;
    if (last) {
      tie_count = sh.count[sel];
      tie_weight = sh.weight[sel];
      tie_min = sh.min_id[sel];
      tie_max = sh.max_id[sel];
    }
    __syncthreads();  // the histograms are reset by the next level or walk
  }
  // prefix is now the key of the element; `above` the amount ranked above its group of ties,
  // each of which carries the same amount.
  const u64 each = weighted ? tie_weight / tie_count : 1;
  const u64 j = (target - above) / each + 1;
  int32_t id;
  if (j == 1) {
    id = tie_min;
  } else if (j >= tie_count) {
    id = tie_max;
  } else {
    id = NthTieId(r, sh, prefix, cut, j);
  }
  cut = Cut{prefix, id};
  return id;
}

__global__ void __launch_bounds__(kThreads, 1) SamplingKernel(SamplingKernelParams p) {
  __shared__ Smem sh;
  const int32_t row = blockIdx.x;
  const int32_t slot = p.row_slots[row];
  const bool slot_ok = slot >= 0 && slot < p.num_slots;
  if (!slot_ok && threadIdx.x == 0 && p.error_flag != nullptr) *p.error_flag = 1;
  SamplingRow prm;  // a bad slot with params_by_slot has no params: it samples greedily
  if (!p.params_by_slot) {
    prm = p.params[row];
  } else if (slot_ok) {
    prm = p.params[slot];
  } else {
    prm.temperature = 0.0f;
  }
  const int64_t words = (p.vocab + 31) / 32;
  Row r;
  r.logits = p.logits + static_cast<int64_t>(row) * p.vocab;
  r.counts = slot_ok ? p.output_counts + static_cast<int64_t>(slot) * p.vocab : nullptr;
  r.mask = slot_ok ? p.prompt_mask + slot * words : nullptr;
  r.vocab = p.vocab;
  r.round_bf16 = p.round_logits_to_bf16;
  r.penalize = slot_ok && (prm.repetition_penalty != 1.0f || prm.presence_penalty != 0.0f ||
                           prm.frequency_penalty != 0.0f);
  r.repetition = prm.repetition_penalty;
  r.presence = prm.presence_penalty;
  r.frequency = prm.frequency_penalty;
  r.temperature = prm.temperature;
  r.min_p = prm.min_p;

  // Pass 1: rank 0 (for greedy, of the penalised logits; otherwise of the scores).
  const bool greedy = prm.temperature == 0.0f;
  float best = -INFINITY;
  int32_t best_id = INT_MAX;
  const int32_t split = gridDim.y;
  const int32_t per = (p.vocab + split - 1) / split;
  const int32_t lo = min(p.vocab, static_cast<int32_t>(blockIdx.y) * per);
  ForEachValue(
      r, greedy,
      [&](int32_t i, float v) {
        if (Better(v, i, best, best_id)) best = v, best_id = i;
      },
      lo, min(p.vocab, lo + per));
  BlockArgMax(best, best_id, sh);
  if (split > 1) {
    // threadFenceReduction: publish this slice's best, count the CTA in; the last one merges.
    if (threadIdx.x == 0) {
      p.split_best[row * split + blockIdx.y] = best;
      p.split_best_id[row * split + blockIdx.y] = best_id;
      __threadfence();
      const uint32_t done = atomicAdd(p.split_done + row, 1u);
      sh.is_last = done == static_cast<uint32_t>(split - 1);
      if (sh.is_last) p.split_done[row] = 0;  // all slices are in: ready for the next launch
    }
    __syncthreads();
    if (!sh.is_last) return;
    __threadfence();
    best = -INFINITY;
    best_id = INT_MAX;
    if (threadIdx.x < split) {
      best = __ldcg(p.split_best + row * split + threadIdx.x);
      best_id = __ldcg(p.split_best_id + row * split + threadIdx.x);
    }
    BlockArgMax(best, best_id, sh);
  }

  int32_t token = best_id;
  const bool top_k_on = prm.top_k > 0 && prm.top_k < p.vocab;
  if (!greedy && best != -INFINITY && !(top_k_on && prm.top_k == 1)) {
    r.s0 = best;
    Cut cut{0u, INT_MAX};
    if (top_k_on) RadixWalk(r, sh, WalkArgs{Walk::kTopK, prm.top_k, 1.0f, 0u, false}, cut);
    if (prm.top_p < 1.0f) RadixWalk(r, sh, WalkArgs{Walk::kTopP, 0, prm.top_p, 0u, false}, cut);
    const float u = UniformFromSeed(prm.seed, prm.position);
    const uint32_t u24 = static_cast<uint32_t>(u * 16777216.0f);
    const int32_t drawn =
        RadixWalk(r, sh, WalkArgs{Walk::kDraw, 0, 1.0f, u24, prm.min_p > 0.0f}, cut);
    if (drawn >= 0) token = drawn;
  }
  if (threadIdx.x == 0) {
    p.tokens[row] = token;
    if (p.update_counts && slot_ok) {
      uint32_t* c = p.output_counts + static_cast<int64_t>(slot) * p.vocab + token;
      if (*c != UINT32_MAX) *c += 1;
    }
  }
}

}  // namespace

absl::Status LaunchSampling(const SamplingKernelParams& p, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(RequireNonNegative("sampling.rows", p.rows));
  if (p.rows == 0) return absl::OkStatus();
  TS_RETURN_IF_ERROR(RequirePositive("sampling.vocab", p.vocab));
  if (p.vocab > kSamplingMaxVocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.vocab must be <= ", kSamplingMaxVocab, ", got ", p.vocab));
  }
  TS_RETURN_IF_ERROR(RequirePositive("sampling.num_slots", p.num_slots));
  TS_RETURN_IF_ERROR(RequirePointer("sampling.logits", p.logits, 4));
  TS_RETURN_IF_ERROR(RequirePointer("sampling.params", p.params, 8));
  TS_RETURN_IF_ERROR(RequirePointer("sampling.row_slots", p.row_slots, 4));
  TS_RETURN_IF_ERROR(RequirePointer("sampling.output_counts", p.output_counts, 4));
  TS_RETURN_IF_ERROR(RequirePointer("sampling.prompt_mask", p.prompt_mask, 4));
  TS_RETURN_IF_ERROR(RequirePointer("sampling.tokens", p.tokens, 4));
  if (p.error_flag != nullptr) {
    TS_RETURN_IF_ERROR(RequirePointer("sampling.error_flag", p.error_flag, 4));
  }
  if (p.split < 1 || p.split > kSamplingMaxSplit) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.split must be in [1, ", kSamplingMaxSplit, "], got ", p.split));
  }
  if (p.split > 1) {
    TS_RETURN_IF_ERROR(RequirePointer("sampling.split_best", p.split_best, 4));
    TS_RETURN_IF_ERROR(RequirePointer("sampling.split_best_id", p.split_best_id, 4));
    TS_RETURN_IF_ERROR(RequirePointer("sampling.split_done", p.split_done, 4));
  }
  SamplingKernel<<<dim3(p.rows, p.split), kThreads, 0, stream>>>(p);
  TS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace ts::kernels
