// Token sampling on the GPU, one CTA per row, the same pipeline as the CPU reference
// (models/sampling.h): penalties -> temperature (0 = greedy argmax, ties to the lowest id) ->
// top-k -> top-p -> min-p -> inverse-CDF draw in rank order (score desc, id asc) with
// u = UniformFromSeed(seed, position).
//
// No sort: every filter keeps a prefix of the rank order, so each cut-off is found by a 3-level
// radix walk (11 + 11 + 10 bits of an order-preserving key of the fp32 score) over count or
// weight histograms in shared memory, plus a ballot walk by id when a cut falls inside a group of
// equal scores. Weights w = exp(s - s_max) are summed in 32.32 fixed point with integer atomics,
// so a row's token is bit-for-bit reproducible and independent of the other rows in the launch.
// Versus the CPU reference, whose sums are sequential fp32: the cut-offs agree except when a
// running sum lands within rounding of a threshold; weights below 2^-33 count as zero (the
// reference's fp32 running sum, >= 1, drops them too). Greedy is exact.
//
// Cost: logits are re-read (from L2) once per radix level: greedy 1 pass; sampling 4 passes, +3
// with top-p, +3 with top-k (top_k == 1 takes the greedy path's 1 pass). Only the first pass is
// split over a row's CTAs; at about 0.1 ms a walk pass on one SM, a row sampled over a 128k
// vocabulary added 0.74-0.85 ms to an H100 step at any batch (docs/gpu-facts.md, Sampling).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace ts::kernels {

// One row's (or slot's) sampling parameters in device memory. Same meaning and ranges as the
// engine's SamplingParams (models/sampling.h, validated at the request edge), which the engine
// converts; kernels/ includes nothing from models/.
struct SamplingRow {
  float temperature = 1.0f;  // 0 = greedy
  int32_t top_k = 0;         // 0 or >= vocab = off
  float top_p = 1.0f;        // (0, 1]; 1 = off
  float min_p = 0.0f;        // [0, 1]; 0 = off
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  uint32_t reserved = 0;
  uint64_t seed = 0;
  uint64_t position = 0;  // absolute position of the token being sampled
};
static_assert(sizeof(SamplingRow) == 48);

struct SamplingKernelParams {
  const float* logits = nullptr;  // [rows, vocab], read only
  // [rows], or [num_slots] indexed through row_slots when params_by_slot.
  const SamplingRow* params = nullptr;
  const int32_t* row_slots = nullptr;  // [rows] slot of each row, in [0, num_slots)
  // [num_slots, vocab] how often each token occurs in the slot's output so far (saturates at
  // UINT32_MAX). Read for the penalties; when update_counts the drawn token's count is
  // incremented, so rows of one launch must then map to distinct slots.
  uint32_t* output_counts = nullptr;
  // [num_slots, ceil(vocab / 32)] bit (t % 32) of word t / 32 set when token t is in the prompt.
  const uint32_t* prompt_mask = nullptr;
  int32_t* tokens = nullptr;  // [rows] out
  // [1], optional. A row whose slot is outside [0, num_slots) stores 1 here, skips penalties
  // and the count update (and with params_by_slot samples greedily). Never cleared here.
  int32_t* error_flag = nullptr;
  int32_t rows = 0;       // >= 0; 0 launches nothing
  int32_t vocab = 0;      // in [1, kSamplingMaxVocab]
  int32_t num_slots = 0;  // > 0
  bool params_by_slot = false;
  bool update_counts = false;
  // The logits are a bf16 model's lm_head accumulated in fp32: read each rounded to bf16, the
  // value transformers' bf16 lm_head returns, so greedy ties and near-ties resolve as there.
  bool round_logits_to_bf16 = false;
  // Optional: spread each row's first pass (the argmax: all a greedy row needs) over `split`
  // CTAs; the last CTA of a row to finish (an atomic count) merges their results and completes
  // the row as before. One CTA reads a 128k-entry row at a few elements per cycle (30-35 us on
  // the H200 under ncu), so at batch 1 the other SMs would idle.
  int32_t split = 1;                 // 1..kSamplingMaxSplit
  float* split_best = nullptr;       // [rows, split] scratch
  int32_t* split_best_id = nullptr;  // [rows, split] scratch
  uint32_t* split_done = nullptr;    // [rows]: zero before the first launch; left zero
};

inline constexpr int32_t kSamplingMaxSplit = 32;

// Keeps fixed-point weight sums (vocab * 2^32) and u * sum inside 64 + 64 bits.
inline constexpr int32_t kSamplingMaxVocab = 1 << 24;

// Validates params (InvalidArgument naming the field) and enqueues the kernel on `stream`.
// Graph-capturable: no allocation, no sync.
absl::Status LaunchSampling(const SamplingKernelParams& p, cudaStream_t stream);

}  // namespace ts::kernels
