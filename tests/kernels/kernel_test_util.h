// Helpers for kernel tests: guarded and poisoned device and host-mapped buffers, bf16 conversion
// on the host, random non-zero data, error metrics, and capture into a CUDA graph. Header-only so
// any test binary (ours or the attention tests) can include it without a library.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"

#define TS_ASSERT_CUDA_OK(expr)                                                  \
  do {                                                                           \
    const cudaError_t ts_e_ = (expr);                                            \
    ASSERT_EQ(ts_e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(ts_e_); \
  } while (0)

#define TS_ASSERT_OK(expr)                                        \
  do {                                                            \
    const ::absl::Status ts_s_ = (expr);                          \
    ASSERT_TRUE(ts_s_.ok()) << #expr << ": " << ts_s_.ToString(); \
  } while (0)

// Expects InvalidArgument whose message names `field`.
#define TS_EXPECT_INVALID(expr, field)                                      \
  do {                                                                      \
    const ::absl::Status ts_s_ = (expr);                                    \
    EXPECT_EQ(ts_s_.code(), ::absl::StatusCode::kInvalidArgument) << ts_s_; \
    EXPECT_NE(std::string(ts_s_.message()).find(field), std::string::npos)  \
        << "message does not name " << (field) << ": " << ts_s_;            \
  } while (0)

namespace ts::kernels::testing {

// ---- bf16 on the host (round to nearest even, as __float2bfloat16_rn does) ----
inline uint16_t F32ToBf16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float Bf16BitsToF32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float RoundBf16(float f) {
  return Bf16BitsToF32(F32ToBf16Bits(f));
}
inline __nv_bfloat16 ToBf16(float f) {
  __nv_bfloat16_raw r;
  r.x = F32ToBf16Bits(f);
  return __nv_bfloat16(r);
}
inline float FromBf16(__nv_bfloat16 h) {
  return Bf16BitsToF32(__nv_bfloat16_raw(h).x);
}

inline std::vector<__nv_bfloat16> ToBf16(const std::vector<float>& v) {
  std::vector<__nv_bfloat16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = ToBf16(v[i]);
  return out;
}
inline std::vector<float> FromBf16(const std::vector<__nv_bfloat16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FromBf16(v[i]);
  return out;
}

// Uniform in [lo, hi], redrawn while |x| < min_abs so no element is zero (zeros hide unwritten
// outputs and wrong indexing). Values are rounded to bf16 when `bf16_exact`, so the bf16 copy on
// the device and the float copy the reference reads are the same numbers.
inline std::vector<float> RandomFloats(size_t n, float lo, float hi, uint32_t seed,
                                       bool bf16_exact = true, float min_abs = 1e-3f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) {
    do {
      x = dist(gen);
      if (bf16_exact) x = RoundBf16(x);
    } while (std::fabs(x) < min_abs);
  }
  return v;
}

// Token ids uniform in [0, vocab).
inline std::vector<int32_t> RandomTokens(size_t n, int32_t vocab, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> id(0, vocab - 1);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = id(gen);
  return t;
}

// ---- Device buffers with guard regions ----
// [guard | data | guard]. The data is poisoned with 0xFF bytes (NaN for bf16 and fp32, -1 for
// ints) and the guards hold kGuardByte; GuardsIntact() proves a kernel wrote nothing outside.
template <typename T>
class GuardedBuffer {
 public:
  static constexpr size_t kGuardBytes = 256;  // keeps the data 256-byte aligned
  static constexpr unsigned char kGuardByte = 0x5A;

  explicit GuardedBuffer(size_t n) : n_(n) {
    const size_t bytes = kGuardBytes * 2 + n * sizeof(T);
    if (cudaMalloc(&base_, bytes) != cudaSuccess) {
      ADD_FAILURE() << "cudaMalloc(" << bytes << ") failed";
      base_ = nullptr;
      return;
    }
    cudaMemset(base_, kGuardByte, bytes);
    Poison();
  }
  ~GuardedBuffer() {
    if (base_ != nullptr) cudaFree(base_);
  }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;

  T* get() const {
    return base_ == nullptr ? nullptr
                            : reinterpret_cast<T*>(static_cast<char*>(base_) + kGuardBytes);
  }
  size_t size() const { return n_; }

  void Poison() {
    if (base_ != nullptr) cudaMemset(get(), 0xFF, n_ * sizeof(T));
  }
  void Upload(const std::vector<T>& v) {
    EXPECT_EQ(v.size(), n_);
    if (base_ != nullptr) cudaMemcpy(get(), v.data(), n_ * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> Download() const {
    std::vector<T> v(n_);
    if (base_ != nullptr) cudaMemcpy(v.data(), get(), n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }
  ::testing::AssertionResult GuardsIntact() const {
    if (base_ == nullptr) return ::testing::AssertionFailure() << "no buffer";
    std::vector<unsigned char> head(kGuardBytes), tail(kGuardBytes);
    cudaMemcpy(head.data(), base_, kGuardBytes, cudaMemcpyDeviceToHost);
    cudaMemcpy(tail.data(), static_cast<char*>(base_) + kGuardBytes + n_ * sizeof(T), kGuardBytes,
               cudaMemcpyDeviceToHost);
    for (size_t i = 0; i < kGuardBytes; ++i) {
      if (head[i] != kGuardByte) return ::testing::AssertionFailure() << "guard before, byte " << i;
      if (tail[i] != kGuardByte) return ::testing::AssertionFailure() << "guard after, byte " << i;
    }
    return ::testing::AssertionSuccess();
  }

 private:
  size_t n_;
  void* base_ = nullptr;
};

// ---- Host-mapped buffers, as the engine's rings and flags are ----
// [guard | data | guard] in pinned memory allocated cudaHostAllocMapped: kernels get device(),
// the host reads and writes host() directly (after syncing the stream that writes it). The data
// is poisoned with 0xFF bytes and the guards hold kGuardByte, as in GuardedBuffer.
template <typename T>
class HostMappedBuffer {
 public:
  static constexpr size_t kGuardBytes = 256;
  static constexpr unsigned char kGuardByte = 0x5A;

  explicit HostMappedBuffer(size_t n) : n_(n) {
    const size_t bytes = kGuardBytes * 2 + n * sizeof(T);
    if (cudaHostAlloc(&base_, bytes, cudaHostAllocMapped) != cudaSuccess) {
      ADD_FAILURE() << "cudaHostAlloc(" << bytes << ", mapped) failed";
      base_ = nullptr;
      return;
    }
    std::memset(base_, kGuardByte, bytes);
    Poison();
    void* dev = nullptr;
    if (cudaHostGetDevicePointer(&dev, base_, 0) != cudaSuccess) {
      ADD_FAILURE() << "cudaHostGetDevicePointer failed";
    }
    dev_base_ = static_cast<char*>(dev);
  }
  ~HostMappedBuffer() {
    if (base_ != nullptr) cudaFreeHost(base_);
  }
  HostMappedBuffer(const HostMappedBuffer&) = delete;
  HostMappedBuffer& operator=(const HostMappedBuffer&) = delete;

  T* host() const {
    return base_ == nullptr ? nullptr
                            : reinterpret_cast<T*>(static_cast<char*>(base_) + kGuardBytes);
  }
  T* device() const {
    return dev_base_ == nullptr ? nullptr : reinterpret_cast<T*>(dev_base_ + kGuardBytes);
  }
  size_t size() const { return n_; }

  void Poison() {
    if (base_ != nullptr) std::memset(static_cast<void*>(host()), 0xFF, n_ * sizeof(T));
  }
  ::testing::AssertionResult GuardsIntact() const {
    if (base_ == nullptr) return ::testing::AssertionFailure() << "no buffer";
    const unsigned char* head = static_cast<const unsigned char*>(base_);
    const unsigned char* tail = head + kGuardBytes + n_ * sizeof(T);
    for (size_t i = 0; i < kGuardBytes; ++i) {
      if (head[i] != kGuardByte) return ::testing::AssertionFailure() << "guard before, byte " << i;
      if (tail[i] != kGuardByte) return ::testing::AssertionFailure() << "guard after, byte " << i;
    }
    return ::testing::AssertionSuccess();
  }

 private:
  size_t n_;
  void* base_ = nullptr;
  char* dev_base_ = nullptr;
};

// ---- Error metrics ----
// ||got - ref||_2 / ||ref||_2; +inf when any got is NaN/inf (poison left unwritten never passes).
inline double RelL2Error(const std::vector<float>& got, const std::vector<double>& ref) {
  if (got.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    const double d = static_cast<double>(got[i]) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Largest |got - ref| / (atol + |ref|); a per-element bound that RelL2Error can average away.
inline double MaxScaledError(const std::vector<float>& got, const std::vector<double>& ref,
                             double atol) {
  double worst = 0;
  for (size_t i = 0; i < got.size() && i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    worst = std::max(worst, std::fabs(got[i] - ref[i]) / (atol + std::fabs(ref[i])));
  }
  return worst;
}

// A GEMM's output against an fp64 reference (cuBLASLt and gemv tests): every element
// within |ref| / 256 (plus the A W^T part's magnitude, `product`, when C is accumulated: cuBLASLt's
// bf16 epilogue was measured on the H200 to round the product to bf16 before adding C, as an HF
// bf16 model rounds o_proj(h) before `x + o_proj(h)`) + 1e-3 rms of the output, and a relative L2
// error under 5e-3. Unwritten (poisoned) elements fail.
inline void ExpectGemmCloseBf16(const std::vector<float>& got, const std::vector<double>& ref,
                                const std::vector<double>* product = nullptr) {
  ASSERT_EQ(got.size(), ref.size());
  double ss = 0;
  for (double r : ref) ss += r * r;
  const double rms = std::sqrt(ss / ref.size());
  double worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << "element " << i << " not written";
    const double scale = std::fabs(ref[i]) + (product ? std::fabs((*product)[i]) : 0.0);
    const double e = std::fabs(got[i] - ref[i]) / (scale / 256 + 1e-3 * rms);
    if (e > worst) worst = e, worst_i = i;
  }
  EXPECT_LE(worst, 1.0) << "at " << worst_i << ": got " << got[worst_i] << " want " << ref[worst_i];
  EXPECT_LE(RelL2Error(got, ref), 5e-3);
}

// An fp32-output GEMM: every element within 1e-5 of the sum of its products' magnitudes
// (`abs_sum`, fp32 accumulation's own bound), and a relative L2 error under 1e-4.
inline void ExpectGemmCloseF32(const std::vector<float>& got, const std::vector<double>& ref,
                               const std::vector<double>& abs_sum) {
  ASSERT_EQ(got.size(), ref.size());
  double worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << "element " << i << " not written";
    const double e = std::fabs(got[i] - ref[i]) / (1e-5 * abs_sum[i] + 1e-30);
    if (e > worst) worst = e, worst_i = i;
  }
  EXPECT_LE(worst, 1.0) << "at " << worst_i << ": got " << got[worst_i] << " want " << ref[worst_i];
  EXPECT_LE(RelL2Error(got, ref), 1e-4);
}

// Against a CPU emulation that rounds to bf16 at the same points as the kernel (the ops that
// mirror transformers' bf16 rounding): the fraction of elements that are bit-identical, and
// whether every element is within `max_ulps` bf16 ulps. Only fp32 rounding inside the kernel
// (rsqrtf, expf, summation order) may differ, which flips a bf16 rounding rarely; an op that
// rounds at other points differs on a large fraction of elements.
struct Bf16Match {
  double exact_fraction = 0;
  int32_t worst_ulps = 0;  // INT32_MAX when a value is not finite
};
inline Bf16Match CompareBf16(const std::vector<float>& got, const std::vector<float>& want) {
  Bf16Match m;
  if (got.size() != want.size() || got.empty()) return {0, std::numeric_limits<int32_t>::max()};
  size_t exact = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return {0, std::numeric_limits<int32_t>::max()};
    // bf16 bit patterns as ordered integers (sign-magnitude -> two's complement order).
    auto ordered = [](float f) {
      const int32_t b = F32ToBf16Bits(f);
      return (b & 0x8000) ? -(b & 0x7fff) : b;
    };
    const int32_t ulps = std::abs(ordered(got[i]) - ordered(want[i]));
    exact += ulps == 0;
    m.worst_ulps = std::max(m.worst_ulps, ulps);
  }
  m.exact_fraction = static_cast<double>(exact) / static_cast<double>(got.size());
  return m;
}

// ---- CUDA graphs ----
// Captures `fn` once and replays it `replays` times, poisoning `out` before each; every replay's
// bytes must equal `expect`.
template <typename T, typename Fn>
void ExpectReplaysEqual(cudaStream_t stream, GuardedBuffer<T>& out, const std::vector<T>& expect,
                        int replays, Fn&& fn) {
  cudaGraph_t graph = nullptr;
  TS_ASSERT_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const absl::Status st = fn(stream);
  TS_ASSERT_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  TS_ASSERT_OK(st);
  cudaGraphExec_t exec = nullptr;
  TS_ASSERT_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int r = 0; r < replays; ++r) {
    out.Poison();
    TS_ASSERT_CUDA_OK(cudaGraphLaunch(exec, stream));
    TS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
    const std::vector<T> got = out.Download();
    EXPECT_EQ(0, std::memcmp(got.data(), expect.data(), got.size() * sizeof(T))) << "replay " << r;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// Captures fn(stream) into a graph, instantiates and launches it once, and syncs the stream:
// proves the launcher allocates, syncs and reads nothing on the host while captured.
template <typename Fn>
::testing::AssertionResult RunInGraph(cudaStream_t stream, Fn&& fn) {
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) != cudaSuccess) {
    return ::testing::AssertionFailure() << "cudaStreamBeginCapture failed";
  }
  const absl::Status st = fn(stream);
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  if (!st.ok()) return ::testing::AssertionFailure() << "launcher under capture: " << st;
  if (end != cudaSuccess) {
    return ::testing::AssertionFailure() << "EndCapture: " << cudaGetErrorString(end);
  }
  cudaGraphExec_t exec = nullptr;
  cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
  if (e == cudaSuccess) e = cudaGraphLaunch(exec, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  if (e != cudaSuccess) return ::testing::AssertionFailure() << cudaGetErrorString(e);
  return ::testing::AssertionSuccess();
}

}  // namespace ts::kernels::testing
