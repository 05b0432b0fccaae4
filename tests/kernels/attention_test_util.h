// Host-side paged KV cache for the attention tests: random bf16-exact K/V, block tables drawn from
// a shuffled permutation (so a sequence's blocks are never contiguous), unused table entries set to
// kInvalidKvBlock as the engine pads them (an illegal address if dereferenced, and the attention
// kernels flag it if looked up), and
// PoisonPastContexts to put NaN wherever no sequence's context reaches.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/kv_layout.cuh"
#include "tests/kernels/kernel_test_util.h"

namespace ts::kernels::testing {

// Fast deterministic values in [-amp, amp], never closer to zero than amp/64, bf16-exact.
inline std::vector<float> HashedValues(size_t n, uint64_t seed, float amp) {
  std::vector<float> v(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  for (size_t i = 0; i < n; ++i) {
    x += 0x9E3779B97F4A7C15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) / static_cast<float>(1ull << 24);  // [0, 1)
    float f = (2.f * u - 1.f) * amp;
    if (std::fabs(f) < amp / 64) f = f < 0 ? -amp / 64 : amp / 64;
    v[i] = RoundBf16(f);
  }
  return v;
}

// `v` rounded to the nearest multiple of `step` (a power of two), never to zero. Attention tests
// use it for q and K so that every partial sum of a dot product is exact in fp32 whatever the
// summation order (see decode_attention_harness.h): with |q| <= 4 on a 1/16 grid and |k| <= 1 on a
// 1/64 grid, a product is a multiple of 2^-10 below 4, and 128 of them need 19 bits.
inline void QuantizeTo(std::vector<float>& v, float step) {
  for (float& x : v) {
    const float q = std::nearbyint(x / step) * step;
    x = q != 0.f ? q : (x < 0 ? -step : step);
  }
}

struct PagedKv {
  int32_t num_blocks = 0;
  int32_t num_kv_heads = 0;
  int32_t block_size = 0;
  int32_t head_dim = 0;
  int32_t max_blocks_per_seq = 0;
  std::vector<float> k, v;      // [num_blocks, num_kv_heads, block_size, head_dim], bf16-exact
  std::vector<int32_t> tables;  // [num_seqs, max_blocks_per_seq]

  // Row of token `t` of sequence `s` for kv head `h`.
  const float* KRow(int s, int h, int t) const { return k.data() + Offset(s, h, t); }
  const float* VRow(int s, int h, int t) const { return v.data() + Offset(s, h, t); }
  size_t Offset(int s, int h, int t) const {
    const int32_t blk = tables[static_cast<size_t>(s) * max_blocks_per_seq + t / block_size];
    return ((static_cast<size_t>(blk) * num_kv_heads + h) * block_size + t % block_size) * head_dim;
  }
};

// Builds a pool that holds `tokens[s]` tokens for each sequence, plus a few spare blocks.
inline PagedKv MakePagedKv(const std::vector<int32_t>& tokens, int32_t num_kv_heads,
                           int32_t block_size, int32_t head_dim, uint32_t seed) {
  PagedKv kv;
  kv.num_kv_heads = num_kv_heads;
  kv.block_size = block_size;
  kv.head_dim = head_dim;
  int32_t total = 0;
  int32_t widest = 1;
  for (int32_t n : tokens) {
    const int32_t blocks = (n + block_size - 1) / block_size;
    total += blocks;
    widest = std::max(widest, blocks);
  }
  kv.num_blocks = total + 5;
  kv.max_blocks_per_seq = widest + 2;
  std::vector<int32_t> perm(kv.num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937 gen(seed);
  std::shuffle(perm.begin(), perm.end(), gen);
  kv.tables.assign(tokens.size() * kv.max_blocks_per_seq, kInvalidKvBlock);
  size_t next = 0;
  for (size_t s = 0; s < tokens.size(); ++s) {
    const int32_t blocks = (tokens[s] + block_size - 1) / block_size;
    for (int32_t b = 0; b < blocks; ++b) kv.tables[s * kv.max_blocks_per_seq + b] = perm[next++];
  }
  const size_t n = static_cast<size_t>(kv.num_blocks) * num_kv_heads * block_size * head_dim;
  kv.k = HashedValues(n, seed * 2 + 1, 1.f);
  kv.v = HashedValues(n, seed * 2 + 2, 1.f);
  return kv;
}

// Sets every K and V element that no sequence's first tokens[s] tokens occupy to NaN: the tail of
// each sequence's last block and every spare block. The cache past a context holds whatever an
// earlier request (or cudaMalloc) left, NaN bit patterns included, so a kernel must neither
// include such a key nor multiply such a V row by a zero weight (0 * NaN = NaN): either shows.
inline void PoisonPastContexts(PagedKv& kv, const std::vector<int32_t>& tokens) {
  const size_t bs = kv.block_size;
  std::vector<char> live(static_cast<size_t>(kv.num_blocks) * bs, 0);
  for (size_t s = 0; s < tokens.size(); ++s) {
    for (int32_t t = 0; t < tokens[s]; ++t) {
      const int32_t blk = kv.tables[s * kv.max_blocks_per_seq + t / kv.block_size];
      live[static_cast<size_t>(blk) * bs + t % kv.block_size] = 1;
    }
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int32_t b = 0; b < kv.num_blocks; ++b) {
    for (size_t o = 0; o < bs; ++o) {
      if (live[b * bs + o]) continue;
      for (int32_t h = 0; h < kv.num_kv_heads; ++h) {
        const size_t off = ((static_cast<size_t>(b) * kv.num_kv_heads + h) * bs + o) * kv.head_dim;
        std::fill_n(kv.k.begin() + off, kv.head_dim, nan);
        std::fill_n(kv.v.begin() + off, kv.head_dim, nan);
      }
    }
  }
}

// Elementwise check against a per-element bound: every element finite and |got - ref| <= tol. On
// failure names the worst element (row, column, both values, the bound) and how many failed.
inline ::testing::AssertionResult ElementsWithin(const std::vector<float>& got,
                                                 const std::vector<double>& ref,
                                                 const std::vector<double>& tol, size_t row_len) {
  if (got.size() != ref.size() || got.size() != tol.size())
    return ::testing::AssertionFailure() << "size mismatch";
  size_t bad = 0, worst = 0;
  double worst_ratio = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - ref[i]);
    const double ratio = std::isfinite(got[i]) ? (tol[i] > 0 ? err / tol[i] : (err > 0 ? 1e300 : 0))
                                               : std::numeric_limits<double>::infinity();
    if (!(ratio <= 1.0)) ++bad;
    if (!(ratio <= worst_ratio)) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess() << "worst err/tol " << worst_ratio;
  return ::testing::AssertionFailure()
         << bad << " of " << got.size() << " elements outside the bound; worst: row "
         << worst / row_len << " elem " << worst % row_len << " got " << got[worst] << " ref "
         << ref[worst] << " |err| " << std::fabs(got[worst] - ref[worst]) << " tol " << tol[worst]
         << (std::isfinite(got[worst]) ? "" : " (not finite: poison read or unwritten)");
}

// Per-row check: every element finite, max |got - ref| <= tol * max |ref| over the row; rows whose
// reference is all zero (empty sequences) must be exactly zero.
inline ::testing::AssertionResult RowsClose(const std::vector<float>& got,
                                            const std::vector<double>& ref, size_t row_len,
                                            double tol) {
  if (got.size() != ref.size()) return ::testing::AssertionFailure() << "size mismatch";
  for (size_t r = 0; r * row_len < got.size(); ++r) {
    double max_ref = 0, max_err = 0;
    for (size_t i = r * row_len; i < (r + 1) * row_len; ++i) {
      if (!std::isfinite(got[i])) {
        return ::testing::AssertionFailure()
               << "row " << r << " elem " << i - r * row_len << " is not finite (unwritten?)";
      }
      max_ref = std::max(max_ref, std::fabs(ref[i]));
      max_err = std::max(max_err, std::fabs(got[i] - ref[i]));
    }
    if (max_ref == 0 ? max_err != 0 : max_err > tol * max_ref) {
      return ::testing::AssertionFailure() << "row " << r << ": max abs err " << max_err
                                           << " vs max |ref| " << max_ref << " (tol " << tol << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace ts::kernels::testing
