#include "models/cpu_ops.h"

#include <algorithm>
#include <cmath>

// The hot loops get an AVX2+FMA clone picked at load time by the CPU, plus a baseline clone, so a
// binary built here still runs on any x86-64 (the GPU machine's host included). Not under
// ThreadSanitizer: the clones' ifunc resolvers run before its runtime is up and crash the binary.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define TS_HOT_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define TS_HOT_CLONES
#endif
#define TS_ALWAYS_INLINE inline __attribute__((always_inline))

namespace ts::cpu {
namespace {

// 8 fp32 lanes; on a baseline build the compiler splits it into two SSE registers.
typedef float V8 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

TS_ALWAYS_INLINE V8 Load(const float* p) {
  V8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// Fixed pairwise tree (lanes l and l+4, then l and l+2, then 0 and 1), so every dot product below
// reduces identically and the dependency chain is 3 adds, not 8.
TS_ALWAYS_INLINE float HSum(const V8& v) {
  const float a0 = v[0] + v[4], a1 = v[1] + v[5], a2 = v[2] + v[6], a3 = v[3] + v[7];
  return (a0 + a2) + (a1 + a3);
}

// y[t, r] = x[t] . w[r] for a TT x NR tile. TT x-vectors and the TT*NR accumulators stay in
// registers (3 x 4 + 3 + 1 = 16 AVX registers); each w row is streamed once per tile.
template <int TT, int NR>
TS_ALWAYS_INLINE void Tile(const float* x, int64_t ldx, const float* w, int64_t k, float* y,
                           int64_t ldy) {
  V8 acc[TT][NR] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    V8 xv[TT];
    for (int t = 0; t < TT; ++t) xv[t] = Load(x + t * ldx + i);
    for (int r = 0; r < NR; ++r) {
      const V8 wv = Load(w + r * k + i);
      for (int t = 0; t < TT; ++t) acc[t][r] += xv[t] * wv;
    }
  }
  for (int t = 0; t < TT; ++t) {
    for (int r = 0; r < NR; ++r) {
      float s = HSum(acc[t][r]);
      for (int64_t j = i; j < k; ++j) s += x[t * ldx + j] * w[r * k + j];
      y[t * ldy + r] = s;
    }
  }
}

constexpr int kTileRows = 4;    // rows of W per tile
constexpr int kTileTokens = 3;  // rows of X per tile

template <int NR>
TS_ALWAYS_INLINE void TileAnyTokens(int tt, const float* x, int64_t ldx, const float* w, int64_t k,
                                    float* y, int64_t ldy) {
  switch (tt) {
    case 3:
      Tile<3, NR>(x, ldx, w, k, y, ldy);
      break;
    case 2:
      Tile<2, NR>(x, ldx, w, k, y, ldy);
      break;
    default:
      Tile<1, NR>(x, ldx, w, k, y, ldy);
      break;
  }
}

// Rows [n_begin, n_end) of W. A block of W rows (~128 KiB) is reused across all tokens before the
// next block is read, so W streams from memory once per call however many tokens there are.
TS_HOT_CLONES void GemmRows(const GemmArgs& a, int64_t n_begin, int64_t n_end) {
  const int64_t block_bytes = 128 * 1024;
  int64_t block = block_bytes / std::max<int64_t>(a.k * 4, 1);
  block = std::max<int64_t>(kTileRows, block / kTileRows * kTileRows);
  for (int64_t nb = n_begin; nb < n_end; nb += block) {
    const int64_t ne = std::min(n_end, nb + block);
    for (int64_t t = 0; t < a.rows; t += kTileTokens) {
      const int tt = static_cast<int>(std::min<int64_t>(kTileTokens, a.rows - t));
      const float* x = a.x + t * a.ldx;
      float* y = a.y + t * a.ldy;
      int64_t n = nb;
      for (; n + kTileRows <= ne; n += kTileRows) {
        TileAnyTokens<kTileRows>(tt, x, a.ldx, a.w + n * a.k, a.k, y + n, a.ldy);
      }
      for (; n < ne; ++n) TileAnyTokens<1>(tt, x, a.ldx, a.w + n * a.k, a.k, y + n, a.ldy);
    }
  }
}

}  // namespace

void Gemm(ThreadPool& pool, const GemmArgs& a) {
  if (a.rows == 0 || a.n == 0) return;
  pool.ParallelFor(a.n, pool.Grain(a.rows * a.k, kTileRows),
                   [&a](int64_t b, int64_t e) { GemmRows(a, b, e); });
}

TS_HOT_CLONES float Dot(const float* a, const float* b, int64_t n) {
  V8 acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += Load(a + i) * Load(b + i);
  float s = HSum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

TS_HOT_CLONES void Axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void RmsNorm(const float* x, const float* w, int64_t n, float eps, float* out) {
  // torch reduces with pairwise sums; a double accumulator is at least as accurate.
  double sum_sq = 0.0;
  for (int64_t i = 0; i < n; ++i) sum_sq += static_cast<double>(x[i]) * x[i];
  const float variance = static_cast<float>(sum_sq / static_cast<double>(n));
  const float r = 1.0f / std::sqrt(variance + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

void ApplyRope(float* v, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i];
    const float b = v[i + half];
    v[i] = a * cos[i] - b * sin[i];
    v[i + half] = b * cos[i] + a * sin[i];
  }
}

void SiluMul(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

}  // namespace ts::cpu
