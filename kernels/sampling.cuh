// Token sampling on the GPU, the same pipeline as the CPU reference (models/sampling.h):
// penalties -> temperature (0 = greedy argmax, ties to the lowest id) -> top-k -> top-p -> min-p
// -> inverse-CDF draw in rank order (score desc, id asc) with u = UniformFromSeed(seed, position).
//
// No sort: every filter keeps a prefix of the rank order, so each cut-off is found by a 3-level
// radix walk (11 + 11 + 10 bits of an order-preserving key of the fp32 score) over count or
// weight histograms, plus a walk by id when a cut falls inside a group of equal scores. Weights
// w = exp(s - s_max) are summed in 32.32 fixed point with integer atomics, so a row's token is
// bit-for-bit reproducible and independent of the other rows in the launch and of `split`.
// Versus the CPU reference, whose sums are sequential fp32: the cut-offs agree except when a
// running sum lands within rounding of a threshold; weights below 2^-33 count as zero (the
// reference's fp32 running sum, >= 1, drops them too). Greedy is exact.
//
// Passes: a greedy row reads its logits once (the argmax). A sampled row reads them once for the
// max score, then twice for each walk: a level-0 histogram of the walk's set, then a gather of
// the elements of the chosen level-0 bin (a quarter octave of scores; a few percent of a 128k
// row), from which the last CTA in completes the walk's lower levels alone. Top-p gathers the
// bins the draw can land in too and completes the draw as well (unless min-p is on), so
// temperature with top-p or alone takes 3 passes, with top-k too 5, and min-p adds the draw's
// own 2. Every pass is spread over the row's `split` CTAs, which wait for each other between
// passes (docs/gpu-facts.md, Sampling).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
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
  // Each row's passes are spread over `split` CTAs, the last of which to finish a pass (an atomic
  // count) completes it. One CTA reads a 128k-entry row at a few elements per cycle (30-35 us on
  // the H200 under ncu), so at small batch the other SMs would idle. 1..kSamplingMaxSplit, and at
  // most half the CTAs of this kernel the GPU holds at once (66 on an H100), since a row's CTAs
  // wait for each other.
  int32_t split = 1;
  // [workspace_bytes >= SamplingWorkspaceBytes(rows, vocab)], 256-byte aligned: the rows' pass
  // state, histograms and gathered candidates. Zero before the first launch (the engine's arena
  // memset); every launch leaves it ready for the next, whatever its rows and split. Launches
  // that may run concurrently need workspaces of their own.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

inline constexpr int32_t kSamplingMaxSplit = 32;

// Keeps fixed-point weight sums (vocab * 2^32) and u * sum inside 64 + 64 bits.
inline constexpr int32_t kSamplingMaxVocab = 1 << 24;

// Bytes of workspace for launches of up to `rows` rows over `vocab` (0 if either is <= 0).
size_t SamplingWorkspaceBytes(int32_t rows, int32_t vocab);

// Validates params (InvalidArgument naming the field) and enqueues the kernel on `stream`.
// Graph-capturable: no allocation, no sync.
absl::Status LaunchSampling(const SamplingKernelParams& p, cudaStream_t stream);

}  // namespace ts::kernels
