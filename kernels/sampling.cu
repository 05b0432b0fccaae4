#include "kernels/sampling.cuh"

#include <cuda_bf16.h>

#include <cfloat>
#include <climits>
#include <cstdint>
#include <new>

#include "absl/strings/str_cat.h"
#include "common/philox.h"
#include "common/status.h"
#include "kernels/cuda_check.h"
#include "kernels/sampling_walk.cuh"

namespace ts::kernels {
namespace {

using namespace sampling_walk;

// Elements a walk gathers from its level-0 bins for the finishing CTA. More (a row whose scores
// crowd into one quarter-octave) and the walk is finished from the whole row instead.
constexpr int32_t kMaxCandidates = 32768;

// A sampled row's stages. Each reads the row once, spread over the row's `split` CTAs; the last
// CTA to finish a stage (the finisher) completes it and starts the next. A walk (top-k, top-p or
// the draw) is two stages: a level-0 histogram of the walk's set, then a gather of the chosen
// bin's elements, from which the finisher completes the walk's two lower levels.
enum Stage : uint32_t {
  kArgMax = 0,
  kTopKBins = 1,
  kTopKGather = 2,
  kTopPBins = 3,
  kTopPGather = 4,
  kDrawBins = 5,
  kDrawGather = 6,
  kDone = 7,
};
constexpr uint32_t kNotFinisher = 0xffffffffu;

// A row's state in the workspace, read and written by its finishers. Between launches (and so
// from the arena's memset on) `stage` and `arrived` are zero, as are the row's histogram bins.
struct RowState {
  uint32_t stage;    // the row's running stage, release-stored; kDone once its token is out
  uint32_t arrived;  // CTAs done with the running stage
  // Gathered by the running walk (their sum may exceed the capacity): the walk's own bin's
  // elements fill the list from the front, those of the draw's bins from the back.
  uint32_t num_candidates, num_draw;
  uint32_t bin;  // the walk's level-0 bin
  // Top-p with the draw folded in: the draw's possible level-0 bins, gathered too (else empty).
  uint32_t draw_lo, draw_hi;
  u64 above;      // amount of the set ranked above that bin
  u64 target;     // the walk's target amount
  Cut cut;        // the set: the rank-order prefix the walks so far kept
  float s0;       // max score
  int32_t token;  // rank 0, the token if a walk finds none
  float slice_best[kSamplingMaxSplit];
  int32_t slice_best_id[kSamplingMaxSplit];
};

// Launch-wide counters at the workspace's start; zero between launches.
struct LaunchState {
  uint32_t ticket;  // CTAs started
  uint32_t exited;  // CTAs done
};

constexpr size_t kAlign = 256;
__host__ __device__ constexpr size_t AlignUp(size_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}
__host__ __device__ constexpr int32_t CandidateCapacity(int32_t vocab) {
  return vocab < kMaxCandidates ? vocab : kMaxCandidates;
}
// A row's block: RowState | count [kMaxBins] | weight [kMaxBins] | candidates [capacity]. Fixed
// per row, so launches of any row count share one workspace.
__host__ __device__ constexpr size_t RowBytes(int32_t vocab) {
  return AlignUp(sizeof(RowState)) + AlignUp(kMaxBins * sizeof(uint32_t)) +
         AlignUp(kMaxBins * sizeof(u64)) + AlignUp(CandidateCapacity(vocab) * sizeof(u64));
}

struct RowSpace {
  RowState* state;
  uint32_t* count;  // [kMaxBins] the row's level-0 histogram, summed over its CTAs
  u64* weight;      // [kMaxBins]
  u64* cands;       // [capacity] (key << 32) | id
  int32_t capacity;
};

__device__ RowSpace RowSpaceAt(void* workspace, int32_t row, int32_t vocab) {
  char* b = static_cast<char*>(workspace) + AlignUp(sizeof(LaunchState)) + row * RowBytes(vocab);
  RowSpace s;
  s.state = reinterpret_cast<RowState*>(b);
  b += AlignUp(sizeof(RowState));
  s.count = reinterpret_cast<uint32_t*>(b);
  b += AlignUp(kMaxBins * sizeof(uint32_t));
  s.weight = reinterpret_cast<u64*>(b);
  b += AlignUp(kMaxBins * sizeof(u64));
  s.cands = reinterpret_cast<u64*>(b);
  s.capacity = CandidateCapacity(vocab);
  return s;
}

struct Smem : WalkSmem {
  int32_t is_last;  // this CTA finishes the stage
  uint32_t ticket;
  uint32_t seen_stage;
  uint32_t num_candidates, num_draw;
  RowState rs;  // the row's state while a stage runs; the finisher's changes are published
};

__device__ __forceinline__ uint32_t LoadAcquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void StoreRelease(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Which stages a row runs, from its parameters alone (so a CTA knows without waiting).
struct Plan {
  bool sampled;  // not greedy, and not top_k == 1 (the argmax)
  bool top_k;
  bool top_p;
  // The draw is completed by the top-p walk's finisher (no min-p): the draw's level-0 histogram
  // is the top-p walk's, cut at the kept set, so the top-p gather also gathers the bins the draw
  // can land in.
  bool draw_in_top_p;
  __device__ bool Needs(uint32_t s) const {
    switch (s) {
      case kArgMax:
        return true;
      case kTopKBins:
      case kTopKGather:
        return top_k;
      case kTopPBins:
      case kTopPGather:
        return top_p;
      case kDrawBins:
      case kDrawGather:
        return sampled && !draw_in_top_p;
      default:
        return false;
    }
  }
  // The first stage after s that the row needs (kDone if none).
  __device__ uint32_t NextStage(uint32_t s) const {
    uint32_t n = s + 1;
    while (n < kDone && !Needs(n)) ++n;
    return n;
  }
};

// One CTA's view of its row and slice, in shared memory (the same for every thread).
struct Ctx {
  int32_t* tokens;          // SamplingKernelParams::tokens
  uint32_t* output_counts;  // SamplingKernelParams::output_counts
  bool update_counts;
  int32_t row, slice, split, lo, hi;
  int32_t slot;
  bool slot_ok;
  SamplingRow prm;
  Plan plan;
  Row r;
  RowSpace space;
  uint32_t u24;  // the draw's u * 2^24

  __device__ WalkArgs Args(uint32_t stage) const {
    if (stage <= kTopKGather) return WalkArgs{Walk::kTopK, prm.top_k, 1.0f, 0u, false};
    if (stage <= kTopPGather) return WalkArgs{Walk::kTopP, 0, prm.top_p, 0u, false};
    return WalkArgs{Walk::kDraw, 0, 1.0f, u24, prm.min_p > 0.0f};
  }
};

__device__ __forceinline__ Ctx MakeCtx(const SamplingKernelParams& p, int32_t row, int32_t slice) {
  Ctx c;
  c.tokens = p.tokens;
  c.output_counts = p.output_counts;
  c.update_counts = p.update_counts;
  c.row = row;
  c.slice = slice;
  c.split = p.split;
  const int32_t per = (p.vocab + p.split - 1) / p.split;
  c.lo = min(p.vocab, slice * per);
  c.hi = min(p.vocab, c.lo + per);
  c.slot = p.row_slots[row];
  c.slot_ok = c.slot >= 0 && c.slot < p.num_slots;
  // A bad slot with params_by_slot has no params: it samples greedily.
  if (!p.params_by_slot) {
    c.prm = p.params[row];
  } else if (c.slot_ok) {
    c.prm = p.params[c.slot];
  } else {
    c.prm = SamplingRow{};
    c.prm.temperature = 0.0f;
  }
  const SamplingRow& prm = c.prm;
  const bool greedy = prm.temperature == 0.0f;
  const bool top_k_on = prm.top_k > 0 && prm.top_k < p.vocab;
  c.plan.sampled = !greedy && !(top_k_on && prm.top_k == 1);
  c.plan.top_k = c.plan.sampled && top_k_on;
  c.plan.top_p = c.plan.sampled && prm.top_p < 1.0f;
  c.plan.draw_in_top_p = c.plan.top_p && !(prm.min_p > 0.0f);
  const int64_t words = (p.vocab + 31) / 32;
  Row& r = c.r;
  r.logits = p.logits + static_cast<int64_t>(row) * p.vocab;
  r.counts = c.slot_ok ? p.output_counts + static_cast<int64_t>(c.slot) * p.vocab : nullptr;
  r.mask = c.slot_ok ? p.prompt_mask + c.slot * words : nullptr;
  r.vocab = p.vocab;
  r.round_bf16 = p.round_logits_to_bf16;
  r.penalize = c.slot_ok && (prm.repetition_penalty != 1.0f || prm.presence_penalty != 0.0f ||
                             prm.frequency_penalty != 0.0f);
  r.repetition = prm.repetition_penalty;
  r.presence = prm.presence_penalty;
  r.frequency = prm.frequency_penalty;
  r.temperature = prm.temperature;
  r.min_p = prm.min_p;
  r.s0 = 0.0f;
  c.space = RowSpaceAt(p.workspace, row, p.vocab);
  c.u24 = 0;
  if (c.plan.sampled) {
    c.u24 = static_cast<uint32_t>(UniformFromSeed(prm.seed, prm.position) * 16777216.0f);
  }
  return c;
}

// Counts this CTA in to the running stage; true for the last of the row's CTAs, which finishes
// it (threadFenceReduction). Every thread fences its own global writes first.
__device__ bool Arrive(const Ctx& c, Smem& sh) {
  __threadfence();
  if (c.split == 1) {
    __syncthreads();
    return true;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t n = atomicAdd(&c.space.state->arrived, 1u);
    sh.is_last = n == static_cast<uint32_t>(c.split - 1);
    if (sh.is_last) c.space.state->arrived = 0;
    __threadfence();
  }
  __syncthreads();
  return sh.is_last;
}

// Ends the finisher's stage: the row's state (sh.rs) and everything the CTA wrote become visible
// before the row moves to stage `next`. Returns `next`.
__device__ uint32_t Publish(const Ctx& c, Smem& sh, uint32_t next) {
  if (c.split > 1) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      RowState* g = c.space.state;
      g->bin = sh.rs.bin;
      g->draw_lo = sh.rs.draw_lo;
      g->draw_hi = sh.rs.draw_hi;
      g->above = sh.rs.above;
      g->target = sh.rs.target;
      g->cut = sh.rs.cut;
      g->s0 = sh.rs.s0;
      g->token = sh.rs.token;
      __threadfence();
      StoreRelease(&g->stage, next);
    }
  }
  __syncthreads();
  return next;
}

__device__ void WriteToken(const Ctx& c, int32_t token) {
  if (threadIdx.x != 0) return;
  c.tokens[c.row] = token;
  if (c.update_counts && c.slot_ok) {
    uint32_t* n = c.output_counts + static_cast<int64_t>(c.slot) * c.r.vocab + token;
    if (*n != UINT32_MAX) *n += 1;
  }
}

// Stage 0: rank 0 of the slice (for greedy, of the penalised logits; otherwise of the scores),
// merged over the row's CTAs. A greedy row ends here.
__device__ __noinline__ uint32_t ArgMaxStage(const Ctx& c, Smem& sh) {
  const Row r = c.r;
  const bool greedy = c.prm.temperature == 0.0f;
  float best = -INFINITY;
  int32_t best_id = INT_MAX;
  ForEachValue(
      r, greedy,
      [&](int32_t i, float v) {
        if (Better(v, i, best, best_id)) best = v, best_id = i;
      },
      c.lo, c.hi);
  BlockArgMax(best, best_id, sh);
  if (c.split > 1) {
    if (threadIdx.x == 0) {
      c.space.state->slice_best[c.slice] = best;
      c.space.state->slice_best_id[c.slice] = best_id;
    }
    if (!Arrive(c, sh)) return kNotFinisher;
    best = -INFINITY;
    best_id = INT_MAX;
    if (threadIdx.x < c.split) {
      best = __ldcg(c.space.state->slice_best + threadIdx.x);
      best_id = __ldcg(c.space.state->slice_best_id + threadIdx.x);
    }
    BlockArgMax(best, best_id, sh);
  }
  if (!c.plan.sampled) {  // no CTA of the row waits for more: nothing to publish
    WriteToken(c, best_id);
    return kDone;
  }
  if (best == -INFINITY) {
    WriteToken(c, best_id);
    return Publish(c, sh, kDone);
  }
  if (threadIdx.x == 0) {
    sh.rs.s0 = best;
    sh.rs.token = best_id;
    sh.rs.cut = Cut{0u, INT_MAX};
  }
  return Publish(c, sh, c.plan.NextStage(kArgMax));
}

// The pass of a walk's first stage over a slice, compiled on its own (as is the gather's) so that
// the stage's other work does not take the loop's registers.
__device__ __noinline__ void LevelZeroPass(const Row r, Smem& sh, const WalkArgs a, Cut cut,
                                           int32_t lo, int32_t hi) {
  BuildLevel(RowSource{r, lo, hi}, r, sh, a, cut, WalkPos{});
}

// The draw over the whole row from level 0, by this CTA alone: the fallback when a walk that was
// to hand the draw its level-0 bins found none (the targets rule it out).
__device__ uint32_t DrawFromWholeRow(const Ctx& c, const Row& r, Smem& sh, Cut cut) {
  const int32_t id = FinishWalk(RowSource{r, 0, r.vocab}, r, sh, c.Args(kDrawBins), cut, WalkPos{});
  WriteToken(c, id >= 0 ? id : sh.rs.token);
  return Publish(c, sh, kDone);
}

// A walk's first stage: the level-0 histogram of its set, summed over the row's CTAs; the
// finisher picks the bin to descend into.
__device__ __noinline__ uint32_t BinsStage(const Ctx& c, Smem& sh, uint32_t stage) {
  const WalkArgs a = c.Args(stage);
  const bool weighted = Weighted(a);
  const bool with_draw = stage == kTopPBins && c.plan.draw_in_top_p;
  Row r = c.r;
  r.s0 = sh.rs.s0;
  WalkPos pos;
  LevelZeroPass(r, sh, a, sh.rs.cut, c.lo, c.hi);
  if (c.split > 1) {
    for (int b = threadIdx.x; b < kMaxBins; b += kThreads) {
      if (weighted && sh.weight[b] != 0) atomicAdd(c.space.weight + b, sh.weight[b]);
      if (!weighted && sh.count[b] != 0) atomicAdd(c.space.count + b, sh.count[b]);
    }
    if (!Arrive(c, sh)) return kNotFinisher;
    // The draw reads the top-p walk's histogram again after the gather (and then zeroes it).
    for (int b = threadIdx.x; b < kMaxBins; b += kThreads) {
      if (weighted) {
        sh.weight[b] = __ldcg(c.space.weight + b);
        if (!with_draw) c.space.weight[b] = 0;
      } else {
        sh.count[b] = __ldcg(c.space.count + b);
        c.space.count[b] = 0;
      }
    }
    __syncthreads();
  } else if (with_draw) {
    for (int b = threadIdx.x; b < kMaxBins; b += kThreads) c.space.weight[b] = sh.weight[b];
  }
  if (!SelectLevel(sh, a, pos, nullptr)) {
    // No bin: a top-k or top-p walk keeps its set; the draw keeps rank 0.
    if (with_draw) {
      for (int b = threadIdx.x; b < kMaxBins; b += kThreads) c.space.weight[b] = 0;
      return DrawFromWholeRow(c, r, sh, sh.rs.cut);
    }
    if (a.mode != Walk::kDraw) return Publish(c, sh, c.plan.NextStage(stage + 1));
    WriteToken(c, sh.rs.token);
    return Publish(c, sh, kDone);
  }
  const uint32_t bin = pos.prefix >> kLevel0Shift;
  uint32_t draw_lo = 1, draw_hi = 0;  // empty
  if (with_draw) {
    // The kept set's total W lies in [above, above + weight[bin]], so the draw's target
    // WalkTarget(W) in [t_lo, t_hi]; a target >= above falls in `bin`, a lower one in the bin
    // of this histogram that holds it. Those bins are a contiguous range above `bin`.
    const WalkArgs d = c.Args(kDrawBins);
    const u64 t_lo = WalkTarget(d, pos.above);
    const u64 t_hi = WalkTarget(d, pos.above + sh.weight[bin]);
    if (t_lo < pos.above) {
      u64 before;
      draw_hi = FindBin(
          sh, kMaxBins, true, [&](u64) { return t_lo; }, &before);
      draw_lo = FindBin(
          sh, kMaxBins, true, [&](u64) { return min(t_hi, pos.above - 1); }, &before);
    }
  }
  if (threadIdx.x == 0) {
    sh.rs.bin = bin;
    sh.rs.draw_lo = draw_lo;
    sh.rs.draw_hi = draw_hi;
    sh.rs.above = pos.above;
    sh.rs.target = pos.target;
    c.space.state->num_candidates = 0;
    c.space.state->num_draw = 0;
  }
  return Publish(c, sh, stage + 1);
}

// Bit 31 of a candidate's id word: it is one of the draw's bins (ids are < 2^24).
constexpr u64 kDrawTag = 1ull << 31;

// Appends a warp's staged candidates buf[0, n) (n <= 32) to the row's list: untagged ones at the
// front, tagged ones at the back.
__device__ __forceinline__ void FlushCandidates(const Ctx& c, const u64* buf, uint32_t n) {
  const int lane = threadIdx.x % 32;
  const u64 v = lane < n ? buf[lane] : 0;
  const bool draw = (v & kDrawTag) != 0;
  const uint32_t front = __ballot_sync(0xffffffffu, lane < n && !draw);
  const uint32_t back = __ballot_sync(0xffffffffu, lane < n && draw);
  uint32_t base_front = 0, base_back = 0;
  if (lane == 0) {
    if (front != 0) base_front = atomicAdd(&c.space.state->num_candidates, __popc(front));
    if (back != 0) base_back = atomicAdd(&c.space.state->num_draw, __popc(back));
  }
  base_front = __shfl_sync(0xffffffffu, base_front, 0);
  base_back = __shfl_sync(0xffffffffu, base_back, 0);
  const uint32_t below = (1u << lane) - 1;
  if (lane < n) {
    const uint32_t k = draw ? base_back + __popc(back & below) : base_front + __popc(front & below);
    if (k < static_cast<uint32_t>(c.space.capacity)) {
      c.space.cands[draw ? c.space.capacity - 1 - k : k] = v & ~kDrawTag;
    }
  }
}

// Gathers the slice's set elements whose level-0 bin is the walk's (front of the list) or in
// [draw_lo, draw_hi] (back) into the row's candidate list: a warp stages 32 before one atomic
// per end reserves their places. Returns the two lengths once every CTA is in (finisher only;
// false for the others).
__device__ __noinline__ bool Gather(const Ctx& c, const Row r, Smem& sh, const WalkArgs a,
                                    uint32_t* found, uint32_t* found_draw) {
  const Cut cut = sh.rs.cut;
  const uint32_t bin = sh.rs.bin, draw_lo = sh.rs.draw_lo, draw_hi = sh.rs.draw_hi;
  const int lane = threadIdx.x % 32;
  u64* buf = sh.weight + (threadIdx.x / 32) * 64;  // this warp's 64 staging entries
  uint32_t n = 0;                                  // staged, the same in every lane
  ForEachValueInWarp<kWalkUnroll>(
      r, false,
      [&](int32_t i, float s, bool valid) {
        const uint32_t key = OrderKey(s);
        const uint32_t b = key >> kLevel0Shift;
        const bool in_draw = b != bin && draw_lo <= b && b <= draw_hi;
        bool keep = valid && (b == bin || in_draw) && InCut(key, i, cut);
        if (keep && a.use_min_p) keep = r.Weight(s) >= r.min_p;
        const uint32_t ballot = __ballot_sync(0xffffffffu, keep);
        if (ballot == 0) return;
        if (keep) {
          buf[n + __popc(ballot & ((1u << lane) - 1))] =
              (static_cast<u64>(key) << 32) | static_cast<uint32_t>(i) | (in_draw ? kDrawTag : 0);
        }
        n += __popc(ballot);
        if (n >= 32) {
          __syncwarp();
          FlushCandidates(c, buf, 32);
          __syncwarp();
          if (lane < n - 32) buf[lane] = buf[32 + lane];
          __syncwarp();
          n -= 32;
        }
      },
      c.lo, c.hi);
  __syncwarp();
  if (n > 0) FlushCandidates(c, buf, n);
  if (!Arrive(c, sh)) return false;
  if (threadIdx.x == 0) {
    sh.num_candidates = __ldcg(&c.space.state->num_candidates);
    sh.num_draw = __ldcg(&c.space.state->num_draw);
  }
  __syncthreads();
  *found = sh.num_candidates;
  *found_draw = sh.num_draw;
  return true;
}

// Completes a walk from level 1 of its bin: over `list` when the gather fit (`fits`), else over
// the whole row.
__device__ __noinline__ int32_t FinishFrom(const Row r, WalkSmem& sh, const WalkArgs a,
                                           const u64* list, uint32_t n, bool fits, Cut& cut,
                                           WalkPos pos, u64* through = nullptr) {
  if (fits) return FinishWalk(CandidateSource{list, n}, r, sh, a, cut, pos, through);
  return FinishWalk(RowSource{r, 0, r.vocab}, r, sh, a, cut, pos, through);
}

__device__ WalkPos Level1(uint32_t bin, u64 above, u64 target) {
  WalkPos pos;
  pos.level = 1;
  pos.prefix = bin << kLevel0Shift;
  pos.prefix_mask = static_cast<uint32_t>(kMaxBins - 1) << kLevel0Shift;
  pos.above = above;
  pos.target = target;
  return pos;
}

// A walk's second stage: the gather, from which the finisher completes the walk (and, for top-p
// with draw_in_top_p, the draw).
__device__ __noinline__ uint32_t GatherStage(const Ctx& c, Smem& sh, uint32_t stage) {
  const WalkArgs a = c.Args(stage);
  Row r = c.r;
  r.s0 = sh.rs.s0;
  uint32_t found = 0, found_draw = 0;
  if (!Gather(c, r, sh, a, &found, &found_draw)) return kNotFinisher;
  const bool fits = static_cast<uint64_t>(found) + found_draw <= c.space.capacity;
  const uint32_t bin = sh.rs.bin;
  const u64 above = sh.rs.above;
  Cut cut = sh.rs.cut;
  u64 kept = 0;
  const int32_t id = FinishFrom(r, sh, a, c.space.cands, found, fits, cut,
                                Level1(bin, above, sh.rs.target), &kept);
  if (a.mode == Walk::kDraw) {
    WriteToken(c, id >= 0 ? id : sh.rs.token);
    return Publish(c, sh, kDone);
  }
  if (!(stage == kTopPGather && c.plan.draw_in_top_p)) {
    if (threadIdx.x == 0) sh.rs.cut = cut;
    return Publish(c, sh, c.plan.NextStage(stage));
  }
  // The draw: its level-0 histogram is the top-p walk's above `bin`, the kept part of `bin`
  // (kept - above), and nothing below. The top-p histogram is zeroed for the next launch.
  for (int b = threadIdx.x; b < kMaxBins; b += kThreads) {
    const u64 w = __ldcg(c.space.weight + b);
    c.space.weight[b] = 0;
    if (id >= 0) {
      sh.weight[b] = b > static_cast<int>(bin) ? w : b == static_cast<int>(bin) ? kept - above : 0;
    }
  }
  __syncthreads();
  if (id < 0) return DrawFromWholeRow(c, r, sh, cut);
  const WalkArgs d = c.Args(kDrawBins);
  WalkPos pos;
  if (!SelectLevel(sh, d, pos, nullptr)) return DrawFromWholeRow(c, r, sh, cut);
  // In `bin`: the front of the list; in the draw's range: the back; else (which the range rules
  // out) the whole row.
  const uint32_t draw_bin = pos.prefix >> kLevel0Shift;
  const bool in_range = sh.rs.draw_lo <= draw_bin && draw_bin <= sh.rs.draw_hi;
  const int32_t drawn =
      draw_bin == bin
          ? FinishFrom(r, sh, d, c.space.cands, found, fits, cut,
                       Level1(draw_bin, pos.above, pos.target))
          : FinishFrom(r, sh, d, fits ? c.space.cands + (c.space.capacity - found_draw) : nullptr,
                       found_draw, fits && in_range, cut, Level1(draw_bin, pos.above, pos.target));
  WriteToken(c, drawn >= 0 ? drawn : sh.rs.token);
  return Publish(c, sh, kDone);
}

__device__ uint32_t RunStage(const Ctx& c, Smem& sh, uint32_t stage) {
  switch (stage) {
    case kArgMax:
      return ArgMaxStage(c, sh);
    case kTopKBins:
    case kTopPBins:
    case kDrawBins:
      return BinsStage(c, sh, stage);
    default:
      return GatherStage(c, sh, stage);
  }
}

// Waits until the row has moved past `done` (the stage this CTA finished) and loads its state.
// Returns the row's new stage, kDone if it finished. The row cannot move further without this
// CTA, so the stage seen is the one to run next.
__device__ uint32_t WaitForNextStage(const Ctx& c, Smem& sh, uint32_t done) {
  if (threadIdx.x == 0) {
    RowState* g = c.space.state;
    uint32_t seen;
    unsigned ns = 32;
    while ((seen = LoadAcquire(&g->stage)) <= done) {
      __nanosleep(ns);
      ns = min(ns * 2, 256u);
    }
    sh.seen_stage = seen;
    if (seen < kDone) {
      sh.rs.bin = __ldcg(&g->bin);
      sh.rs.draw_lo = __ldcg(&g->draw_lo);
      sh.rs.draw_hi = __ldcg(&g->draw_hi);
      sh.rs.above = __ldcg(&g->above);
      sh.rs.target = __ldcg(&g->target);
      sh.rs.cut.key = __ldcg(&g->cut.key);
      sh.rs.cut.id = __ldcg(&g->cut.id);
      sh.rs.s0 = __ldcg(&g->s0);
      sh.rs.token = __ldcg(&g->token);
    }
  }
  __syncthreads();
  return sh.seen_stage;
}

// One CTA per row and slice. With split == 1 a CTA runs its row's stages one after another.
// With split > 1 the row's CTAs run each stage together: after its part of a stage a CTA waits
// for the stage's finisher (the last of them in) to publish the next. A greedy row ends after
// stage 0 and waits for nothing.
//
// Progress: a CTA's row and slice come from its ticket, the order CTAs start in, so the started
// CTAs are always whole rows plus part of one. Whole rows need nothing else and finish, freeing
// SMs for the rest of the partial row; this needs only that a row's `split` CTAs fit on the GPU
// at once (LaunchSampling checks), not the whole grid. Only this kernel's CTAs ever wait, so
// other kernels beside it (prefill) always drain.
__global__ void __launch_bounds__(kThreads, 1) SamplingKernel(SamplingKernelParams p) {
  __shared__ Smem sh;
  auto* launch = static_cast<LaunchState*>(p.workspace);
  int32_t row = blockIdx.x, slice = 0;
  if (p.split > 1) {
    if (threadIdx.x == 0) sh.ticket = atomicAdd(&launch->ticket, 1u);
    __syncthreads();
    row = static_cast<int32_t>(sh.ticket) / p.split;
    slice = static_cast<int32_t>(sh.ticket) % p.split;
  }
  // Built once, in shared memory: a per-thread copy would be a stack frame in local memory.
  __shared__ alignas(Ctx) unsigned char ctx[sizeof(Ctx)];
  if (threadIdx.x == 0) {
    new (ctx) Ctx(MakeCtx(p, row, slice));
    if (!reinterpret_cast<Ctx*>(ctx)->slot_ok && p.error_flag != nullptr) *p.error_flag = 1;
  }
  __syncthreads();
  const Ctx& c = *reinterpret_cast<const Ctx*>(ctx);
  uint32_t stage = kArgMax;
  while (true) {
    const uint32_t next = RunStage(c, sh, stage);
    if (p.split == 1) {
      if (next >= kDone) break;
      stage = next;
      continue;
    }
    if (c.plan.NextStage(stage) >= kDone) break;  // nothing after this stage for this row
    stage = WaitForNextStage(c, sh, stage);
    if (stage >= kDone) break;
  }
  if (p.split > 1) {
    // The last CTA out leaves the workspace ready for the next launch.
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      if (atomicAdd(&launch->exited, 1u) == gridDim.x - 1) {
        for (int32_t i = 0; i < p.rows; ++i) RowSpaceAt(p.workspace, i, p.vocab).state->stage = 0;
        launch->ticket = 0;
        launch->exited = 0;
        __threadfence();
      }
    }
  }
}

}  // namespace

size_t SamplingWorkspaceBytes(int32_t rows, int32_t vocab) {
  if (rows <= 0 || vocab <= 0) return 0;
  return AlignUp(sizeof(LaunchState)) + static_cast<size_t>(rows) * RowBytes(vocab);
}

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
  TS_RETURN_IF_ERROR(RequirePointer("sampling.workspace", p.workspace, kAlign));
  const size_t need = SamplingWorkspaceBytes(p.rows, p.vocab);
  if (p.workspace_bytes < need) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.workspace_bytes must be >= ", need,
                                                   " for ", p.rows, " rows, got ",
                                                   p.workspace_bytes));
  }
  if (p.split > 1) {
    // A row's CTAs wait for each other between passes, so they must fit on the GPU together, and
    // with half of it per launch two launches running at once (the engine's decode and prefill
    // heads) cannot fill every SM with waiting CTAs of rows neither can finish.
    int device = 0, sms = 0, per_sm = 0;
    TS_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
    TS_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    TS_CUDA_RETURN_IF_ERROR(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, SamplingKernel, kThreads, 0));
    if (p.split > sms * per_sm / 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("sampling.split must be <= ", sms * per_sm / 2,
                       " (half the CTAs this GPU holds at once), got ", p.split));
    }
  }
  const int64_t ctas = static_cast<int64_t>(p.rows) * p.split;
  if (ctas > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.rows too large: ", p.rows));
  }
  SamplingKernel<<<static_cast<uint32_t>(ctas), kThreads, 0, stream>>>(p);
  TS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace ts::kernels
