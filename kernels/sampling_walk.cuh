// The radix walks of the sampling kernel (kernels/sampling.cu), included by it alone: the
// per-element score of a row, its passes, the level histograms and their scans, and the tie walks
// by id. The kernel's stages, their state and their synchronisation stay in sampling.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cstdint>

namespace ts::kernels::sampling_walk {

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
constexpr int kLevel0Shift = 21;
__host__ __device__ constexpr int LevelShift(int level) {
  return level == 0 ? kLevel0Shift : level == 1 ? kLevel0Shift - 11 : 0;
}
__host__ __device__ constexpr int LevelBins(int level) {
  return level < kLevels - 1 ? kMaxBins : kLastBins;
}
// The three levels tile the key's 32 bits.
static_assert(kMaxBins == 1 << (32 - kLevel0Shift) &&
              (kMaxBins << LevelShift(1)) == 1 << kLevel0Shift && kLastBins == 1 << LevelShift(1));
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

// Order-preserving map of a non-NaN float (with -0 folded into +0) to uint32, and back.
__device__ __forceinline__ uint32_t OrderKey(float s) {
  const uint32_t u = __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float FromOrderKey(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// The walks' shared memory.
struct WalkSmem {
  uint32_t count[kMaxBins];
  // A gather stages each warp's candidates in here: [kWarps][64].
  u64 weight[kMaxBins];
  // The last level's lowest ids [0, kLastBins) and highest [kLastBins, 2 kLastBins); then a tie
  // group's ids.
  int32_t ids[2 * kLastBins];
  u64 warp_sum[kWarps];
  float warp_best[kWarps];
  int32_t warp_best_id[kWarps];
  int32_t sel_bin;
  u64 sel_before;
  int32_t found_id;
  uint32_t tie_n;
};
static_assert(kMaxBins * sizeof(u64) == kWarps * 64 * sizeof(u64));

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

__device__ __forceinline__ u64 FixedWeight(float w) {
  return __float2ull_rn(w * kFixedOne);
}

// Adds a fixed-point weight to a shared u64 bin as two 32-bit atomics, low word then carry:
// ATOMS.ADD takes 32-bit operands only, so a 64-bit shared atomicAdd compiles to a
// compare-and-swap loop, which the crowded level-0 bins would serialise.
__device__ __forceinline__ void AddWeight(u64* bin, u64 v) {
  if (v == 0) return;
  uint32_t* w = reinterpret_cast<uint32_t*>(bin);  // little-endian: w[0] low, w[1] high
  const uint32_t lo = static_cast<uint32_t>(v);
  const uint32_t old = atomicAdd(w, lo);
  const uint32_t hi = static_cast<uint32_t>(v >> 32) + (old + lo < old ? 1u : 0u);
  if (hi != 0) atomicAdd(w + 1, hi);
}

// Warp w owns ids [w * range, (w + 1) * range), a multiple of 32 ids: ids are in order across
// warps, which the tie walk relies on (it walks a warp's range again with ballots).
__device__ __forceinline__ int32_t WarpRange(int32_t vocab) {
  return ((vocab + kWarps - 1) / kWarps + 31) / 32 * 32;
}

// Calls f(id, value, valid) for this thread's ids in [lo, hi), value = penalised logit with NaN
// -> -inf when `greedy`, else the score. Every lane of a warp makes the same calls (`valid` is
// false past its range's end), so f may use warp votes.
//
// A pass streams a row at one CTA an SM, so its speed is the bytes each SM keeps in flight: the
// warp reads its range as 16-byte vectors, kUnroll of them a lane issued before any is used (64
// KB a CTA in the first pass, 32 in the walks; the scalar loads before kept 16 KB in flight:
// bench/results/2026-12-05d-h100.md). The range's ends up to a 16-byte boundary of the row (a
// vocab or a slice start that is not a multiple of 4) are read one id a lane. The order of calls
// within a warp is unspecified.
template <int kUnroll, typename F>
__device__ __forceinline__ void ForEachValueInWarp(const Row& r, bool greedy, F&& f, int32_t lo,
                                                   int32_t hi) {
  const int32_t range = WarpRange(hi - lo);
  const int32_t begin = lo + (threadIdx.x / 32) * range;
  const int32_t end = min(begin + range, hi);
  const int32_t lane = threadIdx.x % 32;
  auto value = [&](float v) { return greedy ? NanToNegInf(v) : r.Temper(v); };
  auto one = [&](int32_t i, bool valid) {  // a head or tail id
    float v = valid ? r.Load(__ldg(r.logits + i)) : 0.0f;
    if (valid && r.penalize) v = r.Penalize(i, v);
    f(i, value(v), valid);
  };
  // [body, body_end): whole 16-byte vectors of the row.
  const int32_t misaligned =
      static_cast<int32_t>(reinterpret_cast<uintptr_t>(r.logits + begin) / 4 % 4);
  const int32_t body = min(end, begin + (kVec - misaligned) % kVec);
  const int32_t body_end = body + max(0, end - body) / kVec * kVec;
  one(begin + lane, begin + lane < body);
  for (int32_t first = body; first < body_end; first += 32 * kVec * kUnroll) {
    const int32_t base = first + kVec * lane;
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
      for (int j = 0; j < kVec; ++j) f(i + j, value(v[u][j]), i < body_end);
    }
  }
  one(body_end + lane, body_end + lane < end);
}

// As ForEachValueInWarp, calling f(id, value) for the valid ids only.
template <int kUnroll = kFirstPassUnroll, typename F>
__device__ __forceinline__ void ForEachValue(const Row& r, bool greedy, F&& f, int32_t lo,
                                             int32_t hi) {
  ForEachValueInWarp<kUnroll>(
      r, greedy,
      [&](int32_t i, float v, bool valid) {
        if (valid) f(i, v);
      },
      lo, hi);
}

__device__ __forceinline__ bool Better(float v, int32_t i, float best, int32_t best_i) {
  return v > best || (v == best && i < best_i);
}

__device__ inline void BlockArgMax(float& best, int32_t& best_i, WalkSmem& sh) {
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
__device__ inline u64 BlockExclusiveScan(u64 v, WalkSmem& sh, u64* total) {
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
__device__ inline u64 WalkTarget(const WalkArgs& a, u64 total) {
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

// Where a walk's elements come from: a slice of the row's logits (a split CTA's), the whole row
// (a finisher whose bin overflowed the candidates), or the gathered candidates. ForEach calls
// f(id, score) once per element, spread over the CTA's threads.
struct RowSource {
  const Row& r;
  int32_t lo, hi;
  template <typename F>
  __device__ __forceinline__ void ForEach(F&& f) const {
    ForEachValue<kWalkUnroll>(r, false, f, lo, hi);
  }
};
struct CandidateSource {
  const u64* cands;  // [n] (key << 32) | id
  uint32_t n;
  // Loads kBatch a thread before using any: the list is re-read from L2 by every level.
  template <typename F>
  __device__ __forceinline__ void ForEach(F&& f) const {
    constexpr int kBatch = 8;
    for (uint32_t first = threadIdx.x; first < n; first += kThreads * kBatch) {
      u64 c[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const uint32_t k = first + u * kThreads;
        c[u] = k < n ? __ldcg(cands + k) : 0;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (first + u * kThreads < n) {
          f(static_cast<int32_t>(static_cast<uint32_t>(c[u])),
            FromOrderKey(static_cast<uint32_t>(c[u] >> 32)));
        }
      }
    }
  }
};

// How far a walk has descended: the key bits fixed so far, and the amounts.
struct WalkPos {
  int level = 0;
  uint32_t prefix = 0, prefix_mask = 0;
  u64 above = 0;   // amount of set elements ranked above the current bin range
  u64 target = 0;  // set from the level-0 total
};

// The selected last-level bin: one key, a group of equal scores.
struct TieGroup {
  uint32_t count = 0;
  u64 weight = 0;
  int32_t min_id = -1, max_id = -1;
};

__device__ __forceinline__ bool Weighted(const WalkArgs& a) {
  return a.mode != Walk::kTopK;
}

// Histogram, in shared memory, of the set elements under pos's prefix at pos.level: weights for
// a weighted walk, counts for top-k and (for the tie group) at the last level, and the last
// level's lowest and highest ids.
template <typename Source>
__device__ inline void BuildLevel(const Source& src, const Row& r, WalkSmem& sh, const WalkArgs& a,
                                  Cut cut, const WalkPos& pos) {
  const bool weighted = Weighted(a);
  const int shift = LevelShift(pos.level), bins = LevelBins(pos.level);
  const bool last = pos.level == kLevels - 1;
  for (int b = threadIdx.x; b < bins; b += kThreads) {
    sh.count[b] = 0;
    sh.weight[b] = 0;
    if (last) sh.ids[b] = INT_MAX, sh.ids[kLastBins + b] = -1;
  }
  __syncthreads();
  src.ForEach([&](int32_t i, float s) {
    const uint32_t key = OrderKey(s);
    if ((key & pos.prefix_mask) != pos.prefix || !InCut(key, i, cut)) return;
    float w = 0.0f;
    if (weighted || a.use_min_p) w = r.Weight(s);
    if (a.use_min_p && !(w >= r.min_p)) return;
    const uint32_t bin = (key >> shift) & (bins - 1);
    if (weighted) AddWeight(&sh.weight[bin], FixedWeight(w));
    if (!weighted || last) atomicAdd(&sh.count[bin], 1u);
    if (last) atomicMin(&sh.ids[bin], i), atomicMax(&sh.ids[kLastBins + bin], i);
  });
  __syncthreads();
}

// Scans a level's histogram from the highest key down for the bin where the running amount
// passes t = target_of(total); *before gets the amount ranked above it. -1 (block-uniform) if
// no bin does.
template <typename TargetOf>
__device__ inline int FindBin(WalkSmem& sh, int bins, bool weighted, TargetOf&& target_of,
                              u64* before) {
  if (threadIdx.x == 0) sh.sel_bin = -1;
  // Thread t owns positions [2t, 2t + 2) (fewer bins: [t, t + 1)), position q being bin
  // bins - 1 - q.
  const int per = bins / kThreads;
  u64 local = 0;
  for (int q = 0; q < per; ++q) {
    const int b = bins - 1 - (threadIdx.x * per + q);
    local += weighted ? sh.weight[b] : sh.count[b];
  }
  u64 total;
  u64 run = BlockExclusiveScan(local, sh, &total);
  const u64 t = target_of(total);
  for (int q = 0; q < per; ++q) {
    const int b = bins - 1 - (threadIdx.x * per + q);
    const u64 amount = weighted ? sh.weight[b] : sh.count[b];
    if (run <= t && t < run + amount) sh.sel_bin = b, sh.sel_before = run;
    run += amount;
  }
  __syncthreads();
  const int sel = sh.sel_bin;
  *before = sh.sel_before;
  __syncthreads();  // sel_bin is reset by the next scan
  return sel;
}

// Descends one level: into the bin of pos.level's histogram where the running amount passes the
// target (level 0 sets the target from the histogram's total). False, block-uniformly, when no
// bin does (the targets rule it out).
__device__ inline bool SelectLevel(WalkSmem& sh, const WalkArgs& a, WalkPos& pos, TieGroup* tie) {
  const int shift = LevelShift(pos.level), bins = LevelBins(pos.level);
  u64 before = 0;
  const int sel = FindBin(
      sh, bins, Weighted(a),
      [&](u64 total) {
        if (pos.level == 0) pos.target = WalkTarget(a, total);
        return pos.target - pos.above;
      },
      &before);
  if (sel < 0) return false;
  pos.above += before;
  pos.prefix |= static_cast<uint32_t>(sel) << shift;
  pos.prefix_mask |= static_cast<uint32_t>(bins - 1) << shift;
  if (pos.level == kLevels - 1) {
    tie->count = sh.count[sel];
    tie->weight = sh.weight[sel];
    tie->min_id = sh.ids[sel];
    tie->max_id = sh.ids[kLastBins + sel];
  }
  ++pos.level;
  __syncthreads();  // the histograms are reset by the next level or walk
  return true;
}

// The j-th (1-based) lowest id among set elements with key == key_t, over the whole row. Only
// warps whose id range holds the answer walk it with ballots, so this is one counting pass plus
// a short walk.
__device__ inline int32_t NthTieId(const Row& r, WalkSmem& sh, uint32_t key_t, Cut cut, u64 j) {
  auto match = [&](int32_t i, float s) { return OrderKey(s) == key_t && InCut(key_t, i, cut); };
  uint32_t mine = 0;
  ForEachValue<kWalkUnroll>(
      r, false, [&](int32_t i, float s) { mine += match(i, s) ? 1u : 0u; }, 0, r.vocab);
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

// The same over gathered candidates, which are in no particular order. A group of up to
// 2 kLastBins ties is collected in shared memory and the id with j - 1 smaller ones found there;
// a larger one by a radix select of the j-th smallest id, 8 bits a level (ids are <
// kSamplingMaxVocab = 2^24, and distinct).
__device__ inline int32_t NthTieId(const CandidateSource& src, WalkSmem& sh, uint32_t key_t,
                                   Cut cut, u64 j, uint32_t count) {
  auto match = [&](int32_t i, float s) { return OrderKey(s) == key_t && InCut(key_t, i, cut); };
  if (count <= 2 * kLastBins) {
    if (threadIdx.x == 0) sh.tie_n = 0, sh.found_id = -1;
    __syncthreads();
    src.ForEach([&](int32_t i, float s) {
      if (match(i, s)) sh.ids[atomicAdd(&sh.tie_n, 1u)] = i;
    });
    __syncthreads();
    const uint32_t n = min(sh.tie_n, static_cast<uint32_t>(2 * kLastBins));
    for (uint32_t t = threadIdx.x; t < n; t += kThreads) {
      const int32_t mine = sh.ids[t];
      uint32_t below = 0;
      for (uint32_t q = 0; q < n; ++q) below += sh.ids[q] < mine ? 1u : 0u;
      if (below + 1 == j) sh.found_id = mine;
    }
    __syncthreads();
    const int32_t id = sh.found_id;
    __syncthreads();
    return id;
  }
  constexpr int kIdBins = 256;
  uint32_t prefix = 0, mask = 0;
  u64 below = 0;  // matches with ids below the current range
  for (int shift = 16; shift >= 0; shift -= 8) {
    if (threadIdx.x < kIdBins) sh.count[threadIdx.x] = 0;
    if (threadIdx.x == 0) sh.sel_bin = -1;
    __syncthreads();
    src.ForEach([&](int32_t i, float s) {
      if (match(i, s) && (static_cast<uint32_t>(i) & mask) == prefix) {
        atomicAdd(&sh.count[(i >> shift) & (kIdBins - 1)], 1u);
      }
    });
    __syncthreads();
    const u64 c = threadIdx.x < kIdBins ? sh.count[threadIdx.x] : 0;
    u64 total;
    const u64 run = below + BlockExclusiveScan(c, sh, &total);
    if (run < j && j <= run + c) sh.sel_bin = threadIdx.x, sh.sel_before = run;
    __syncthreads();
    if (sh.sel_bin < 0) return -1;  // block-uniform; j > the group's size cannot happen
    below = sh.sel_before;
    prefix |= static_cast<uint32_t>(sh.sel_bin) << shift;
    mask |= static_cast<uint32_t>(kIdBins - 1) << shift;
    __syncthreads();
  }
  return static_cast<int32_t>(prefix);
}

__device__ __forceinline__ int32_t NthTieId(const RowSource& src, WalkSmem& sh, uint32_t key_t,
                                            Cut cut, u64 j, uint32_t /*count*/) {
  return NthTieId(src.r, sh, key_t, cut, j);
}

// Descends from pos to the last level and resolves ties by id: the first element in rank order,
// within the set (cut, plus min-p when use_min_p), at which the running amount exceeds the
// target. Returns its id (-1 if none, which the targets rule out) and narrows `cut` to end at it.
// *through gets the set's amount ranked up to and including the element (the kept set's total
// for a top-p walk).
template <typename Source>
__device__ inline int32_t FinishWalk(const Source& src, const Row& r, WalkSmem& sh,
                                     const WalkArgs& a, Cut& cut, WalkPos pos,
                                     u64* through = nullptr) {
  TieGroup tie;
  while (pos.level < kLevels) {
    BuildLevel(src, r, sh, a, cut, pos);
    if (!SelectLevel(sh, a, pos, &tie)) return -1;
  }
  // prefix is now the key of the element; `above` the amount ranked above its group of ties,
  // each of which carries the same amount.
  const u64 each = Weighted(a) ? tie.weight / tie.count : 1;
  const u64 j = (pos.target - pos.above) / each + 1;
  int32_t id;
  if (j == 1) {
    id = tie.min_id;
  } else if (j >= tie.count) {
    id = tie.max_id;
  } else {
    id = NthTieId(src, sh, pos.prefix, cut, j, tie.count);
  }
  if (through != nullptr) *through = pos.above + (j < tie.count ? j : tie.count) * each;
  if (id >= 0) cut = Cut{pos.prefix, id};
  return id;
}

}  // namespace ts::kernels::sampling_walk
