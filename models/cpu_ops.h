// fp32 building blocks of the CPU reference model. Every output element is computed by one thread
// in a fixed order that does not depend on the batch, so a token's result is bit-identical whether
// it runs alone or in a mixed batch (the reference the CUDA kernels and the scheduler tests lean
// on).
#pragma once

#include <cstdint>
#include <vector>

#include "models/config.h"
#include "models/thread_pool.h"

namespace ts::cpu {

// y[t, n] = sum_k x[t, k] * w[n, k]  (i.e. Y = X W^T, the nn.Linear layout).
struct GemmArgs {
  const float* x = nullptr;  // [rows, ldx], first k columns used
  int64_t ldx = 0;
  int64_t rows = 0;
  const float* w = nullptr;  // [n, k], row-major, contiguous
  int64_t n = 0;
  int64_t k = 0;
  float* y = nullptr;  // [rows, ldy], columns [0, n) written
  int64_t ldy = 0;
};

// Rows of W are split across the pool's threads; each thread walks its rows in cache-sized blocks.
void Gemm(ThreadPool& pool, const GemmArgs& a);

// a . b over n elements, lane-blocked (same order as Gemm's dot products).
float Dot(const float* a, const float* b, int64_t n);
// y += alpha * x over n elements.
void Axpy(float alpha, const float* x, float* y, int64_t n);

// One row, HF order: out = w * (x * rsqrt(mean(x^2) + eps)). x, w, out: [n]; out may alias x.
void RmsNorm(const float* x, const float* w, int64_t n, float eps, float* out);

// Rotates one head vector in place, HF rotate_half convention: for i < half,
// (v[i], v[i+half]) <- (v[i]*c - v[i+half]*s, v[i+half]*c + v[i]*s).
// v: [2*half]; cos, sin: [half] for this token's position.
void ApplyRope(float* v, const float* cos, const float* sin, int64_t half);

// out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)). gate, up, out: [n].
void SiluMul(const float* gate, const float* up, int64_t n, float* out);

}  // namespace ts::cpu
