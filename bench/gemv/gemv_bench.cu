// tailserve-gemv-bench: the decode-shaped GEMMs of Llama-3.2-1B and Llama-3.1-8B (qkv, o, gate_up,
// down, lm_head) at the M of --ms (default 1, 4, 8: the register kernel; 12, 16: the shared-memory
// kernel): kernels/gemv.cuh (plain and with programmatic dependent launch), with
// ChooseGemvSplitK's split, against kernels/gemm.cuh's cuBLASLt Gemm. Each variant is captured as
// a graph of `launches` back-to-back launches whose W rotates over enough copies that L2 (read off
// the device) never holds it; a replay is timed with CUDA events after warm-up and the table shows
// the median per launch in us and as a fraction of the read roof (W bytes at the copy bandwidth
// measured in the same run, bench/common/copy_roof.h), plus the
// rel. L2 difference of our output against cuBLASLt's (a sanity check, ~1e-3 is bf16 rounding).
//
//   tailserve-gemv-bench [--model=all|1b|8b] [--ms=1,4,8,12,16] [--iters=30]
//                        [--warmup=3] [--launches=20] [--splits=2,4,8]
//
// --splits: at m > 8, one more row per listed split_k (marked "forced"), beside the chosen one.
// --help prints kUsage.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "bench/common/copy_roof.h"
#include "bench/common/graph_timing.h"
#include "kernels/gemm.cuh"
#include "kernels/gemv.cuh"

namespace ts::bench {
namespace {

struct Options {
  std::string model = "all";
  int iters = 30;
  int warmup = 3;
  int launches = 20;
  std::vector<int> ms = {1, 4, 8, 12, 16};
  std::vector<int> splits;  // forced split_k values at m > 8
};

bool ParseInt(const char* arg, const char* name, int* out) {
  const std::string prefix = absl::StrCat("--", name, "=");
  if (std::strncmp(arg, prefix.c_str(), prefix.size()) != 0) return false;
  *out = std::atoi(arg + prefix.size());
  return true;
}

constexpr char kUsage[] =
    "usage: tailserve-gemv-bench [--model=all|1b|8b] [--ms=1,4,8,12,16] [--iters=30]\n"
    "                            [--warmup=3] [--launches=20] [--splits=2,4,8]\n"
    "  Times the Llama-3.2-1B and Llama-3.1-8B decode GEMMs (qkv, o, gate_up, down, lm_head) at\n"
    "  each M of --ms: kernels/gemv.cuh, plain and with PDL, against cuBLASLt (us per launch and\n"
    "  fraction of the W roof at the copy bandwidth measured first). --splits: at m > 8, one more\n"
    "  row per forced split_k.\n"
    "  bench/gemv/README.md says more.\n";

// A comma-separated list of integers in [1, hi] replaces *out.
bool ParseList(const char* name, const char* list, int hi, std::vector<int>* out) {
  out->clear();
  for (absl::string_view part : absl::StrSplit(list, ',')) {
    int v = 0;
    if (!absl::SimpleAtoi(part, &v) || v < 1 || v > hi) {
      std::fprintf(stderr, "--%s: '%s' is not in [1, %d]\n", name, std::string(part).c_str(), hi);
      return false;
    }
    out->push_back(v);
  }
  return true;
}

bool Parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (std::strncmp(a, "--model=", 8) == 0) {
      o->model = a + 8;
    } else if (std::strncmp(a, "--ms=", 5) == 0) {
      if (!ParseList("ms", a + 5, kernels::kGemvMaxM, &o->ms)) return false;
    } else if (std::strncmp(a, "--splits=", 9) == 0) {
      if (!ParseList("splits", a + 9, kernels::kGemvTcMaxSplitK, &o->splits)) return false;
    } else if (!(ParseInt(a, "iters", &o->iters) || ParseInt(a, "warmup", &o->warmup) ||
                 ParseInt(a, "launches", &o->launches))) {
      std::fprintf(stderr, "unknown flag %s\n", a);
      return false;
    }
  }
  return (o->model == "all" || o->model == "1b" || o->model == "8b") && o->iters > 0 &&
         o->launches > 0 && !o->ms.empty();
}

// Uniform in (-1, 1), |x| >= 1/64: random data (zeros can run faster than real data), made on the
// device because W copies reach GBs.
__global__ void FillKernel(__nv_bfloat16* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    float f = static_cast<float>(x >> 40) / static_cast<float>(1 << 23) - 1.f;
    if (fabsf(f) < 1.f / 64) f = f < 0 ? -1.f / 64 : 1.f / 64;
    p[i] = __float2bfloat16_rn(f);
  }
}

void Fill(__nv_bfloat16* p, size_t n, uint64_t seed) {
  FillKernel<<<1024, 256>>>(p, n, seed);
  BENCH_CUDA(cudaGetLastError());
}

// Captures `launches` calls fn(stream, i) into one graph; median us per launch over `iters`
// replays, each timed with events.
double TimePerLaunch(const Options& o, cudaStream_t stream,
                     const std::function<absl::Status(cudaStream_t, int)>& fn) {
  const std::vector<double> us = TimeGraphReplays(stream, o.warmup, o.iters, [&](cudaStream_t s) {
    absl::Status st;
    for (int i = 0; i < o.launches && st.ok(); ++i) st.Update(fn(s, i));
    return st;
  });
  return us[us.size() / 2] / o.launches;
}

std::vector<float> Download(const __nv_bfloat16* d, size_t n) {
  std::vector<__nv_bfloat16> h(n);
  BENCH_CUDA(cudaMemcpy(h.data(), d, n * sizeof(h[0]), cudaMemcpyDeviceToHost));
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = __bfloat162float(h[i]);
  return f;
}

double RelL2(const std::vector<float>& got, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += double(got[i] - ref[i]) * (got[i] - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

struct Shape {
  const char* model;
  const char* layer;
  int n, k;
};

struct Device {
  int num_sms = 0;
  size_t l2_bytes = 0;
  double copy_bytes_per_us = 0;  // the roof: device-to-device copy bandwidth, this run
};

// One shape's operands for up to max_m rows: `copies` copies of W that the timed launches rotate
// through (enough that the rotation's footprint is >= 3x L2, at least 4, at most one per launch,
// so every launch streams W from HBM), A, our output and cuBLASLt's. Freed on destruction.
struct Operands {
  Operands(const Options& o, const Device& dev, const Shape& s, int max_m)
      : w_elems(size_t(s.n) * s.k),
        bytes(2.0 * w_elems),
        copies(static_cast<int>(std::clamp<double>(std::ceil(3.0 * dev.l2_bytes / bytes), 4.0,
                                                   std::max(4, o.launches)))) {
    BENCH_CUDA(cudaMalloc(&w, w_elems * copies * sizeof(__nv_bfloat16)));
    BENCH_CUDA(cudaMalloc(&a, size_t(max_m) * s.k * sizeof(__nv_bfloat16)));
    BENCH_CUDA(cudaMalloc(&c_ours, size_t(max_m) * s.n * sizeof(__nv_bfloat16)));
    BENCH_CUDA(cudaMalloc(&c_blas, size_t(max_m) * s.n * sizeof(__nv_bfloat16)));
    Fill(w, w_elems * copies, 1234 + s.n);
    Fill(a, size_t(max_m) * s.k, 99 + s.k);
    BENCH_CUDA(cudaDeviceSynchronize());
  }
  ~Operands() {
    BENCH_CUDA(cudaFree(w));
    BENCH_CUDA(cudaFree(a));
    BENCH_CUDA(cudaFree(c_ours));
    BENCH_CUDA(cudaFree(c_blas));
  }
  const __nv_bfloat16* W(int i) const { return w + w_elems * (i % copies); }

  size_t w_elems;
  double bytes;  // of W
  int copies;
  __nv_bfloat16 *w = nullptr, *a = nullptr, *c_ours = nullptr, *c_blas = nullptr;
};

// cuBLASLt's time per launch at m rows (planned here), over the rotating copies of W.
double TimeCublas(const Options& o, cudaStream_t stream, kernels::Gemm& gemm, const Operands& x,
                  const Shape& s, int m) {
  CheckOk(gemm.Plan(kernels::GemmShape{m, s.n, s.k}), "gemm plan");
  return TimePerLaunch(o, stream, [&](cudaStream_t st, int i) {
    return gemm.Launch(kernels::GemmParams{x.a, x.W(i), x.c_blas, m, s.n, s.k, false}, st);
  });
}

// After our kernel has written c_ours from W copy 0 on `stream`: cuBLASLt on the same inputs,
// and the relative L2 difference of ours against it (the sanity check; ~1e-3 is bf16 rounding).
double DiffAgainstCublas(kernels::Gemm& gemm, const Operands& x, const Shape& s, int m,
                         cudaStream_t stream) {
  CheckOk(gemm.Launch(kernels::GemmParams{x.a, x.w, x.c_blas, m, s.n, s.k, false}, stream), "gemm");
  BENCH_CUDA(cudaStreamSynchronize(stream));
  return RelL2(Download(x.c_ours, size_t(m) * s.n), Download(x.c_blas, size_t(m) * s.n));
}

void RunShape(const Options& o, const Device& dev, const Shape& s, kernels::Gemm& gemm,
              cudaStream_t stream) {
  const Operands x(o, dev, s, kernels::kGemvMaxM);
  const std::vector<int>& ms = o.ms;
  size_t ws_bytes = 0;
  for (int m : ms) {
    ws_bytes = std::max(ws_bytes, kernels::GemvWorkspaceBytes(
                                      m, s.n, kernels::ChooseGemvSplitK(m, s.n, s.k, dev.num_sms)));
  }
  float* ws = nullptr;
  BENCH_CUDA(cudaMalloc(&ws, std::max<size_t>(ws_bytes, 16)));

  // The chosen split, then (m > 8) each forced one.
  std::vector<std::pair<int, int>> runs;
  for (int m : ms) {
    runs.push_back({m, 0});
    if (m > kernels::kGemvRegisterMaxM) {
      for (int sk : o.splits) runs.push_back({m, sk});
    }
  }
  for (const auto& [m, forced] : runs) {
    kernels::GemvParams gp;
    gp.a = x.a;
    gp.c = x.c_ours;
    gp.m = m;
    gp.n = s.n;
    gp.k = s.k;
    gp.split_k = forced > 0 ? forced : kernels::ChooseGemvSplitK(m, s.n, s.k, dev.num_sms);
    if (gp.split_k > (s.k + 63) / 64) continue;  // fewer 64-wide stages of k than splits
    gp.workspace = ws;
    gp.workspace_bytes = ws_bytes;
    auto gemv = [&](bool pdl) {
      return [&, pdl](cudaStream_t st, int i) {
        kernels::GemvParams p = gp;
        p.w = x.W(i);
        p.pdl = pdl;
        return kernels::LaunchGemv(p, st);
      };
    };
    const double t_blas = TimeCublas(o, stream, gemm, x, s, m);
    const double t_gemv = TimePerLaunch(o, stream, gemv(false));
    const double t_pdl = TimePerLaunch(o, stream, gemv(true));

    // Same inputs once more, outside any graph, for the sanity check.
    BENCH_CUDA(cudaMemset(x.c_ours, 0xFF, size_t(m) * s.n * 2));
    kernels::GemvParams p = gp;
    p.w = x.w;
    CheckOk(kernels::LaunchGemv(p, stream), "gemv");
    const double diff = DiffAgainstCublas(gemm, x, s, m, stream);

    const double roof = x.bytes / dev.copy_bytes_per_us;
    auto pct = [&](double us) { return 100.0 * roof / us; };
    std::printf(
        "%-3s %-8s %6d %6d %3d %8.1f %7.2f | %8.2f %4.0f%% | %8.2f %4.0f%% | %8.2f %4.0f%% |"
        " %5d%s %9.1e %3d\n",
        s.model, s.layer, s.n, s.k, m, x.bytes / 1e6, roof, t_blas, pct(t_blas), t_gemv,
        pct(t_gemv), t_pdl, pct(t_pdl), gp.split_k, forced > 0 ? " forced" : "", diff, x.copies);
    std::fflush(stdout);
  }
  BENCH_CUDA(cudaFree(ws));
}

int Main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::fputs(kUsage, stdout);
      return 0;
    }
  }
  if (!Parse(argc, argv, &o)) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  const double copy_gbps = MeasureCopyBandwidthGbps();
  const Device dev{prop.multiProcessorCount, static_cast<size_t>(prop.l2CacheSize),
                   copy_gbps * 1e3};
  std::printf(
      "device %s, %d SMs, L2 %.1f MB, copy %.0f GB/s; %d launches per graph, median of %d "
      "replays\n",
      prop.name, dev.num_sms, dev.l2_bytes / 1e6, copy_gbps, o.launches, o.iters);

  // Llama-3.2-1B: hidden 2048, 32 q / 8 kv heads of 64, intermediate 8192, vocab 128256.
  // Llama-3.1-8B: hidden 4096, 32 q / 8 kv heads of 128, intermediate 14336, vocab 128256.
  const std::vector<Shape> shapes = {
      {"1b", "qkv", 3072, 2048},       {"1b", "o", 2048, 2048},
      {"1b", "gate_up", 16384, 2048},  {"1b", "down", 2048, 8192},
      {"1b", "lm_head", 128256, 2048}, {"8b", "qkv", 6144, 4096},
      {"8b", "o", 4096, 4096},         {"8b", "gate_up", 28672, 4096},
      {"8b", "down", 4096, 14336},     {"8b", "lm_head", 128256, 4096}};
  auto gemm = kernels::Gemm::Create();
  CheckOk(gemm.status(), "gemm create");
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("%-3s %-8s %6s %6s %3s %8s %7s | %8s %5s | %8s %5s | %8s %5s | %5s %9s %3s\n", "mdl",
              "layer", "n", "k", "M", "W MB", "roof us", "cublas", "roof", "gemv", "roof",
              "gemv+pdl", "roof", "split", "relL2", "cps");
  for (const Shape& s : shapes) {
    if (o.model == "all" || o.model == s.model) RunShape(o, dev, s, **gemm, stream);
  }
  BENCH_CUDA(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace
}  // namespace ts::bench

int main(int argc, char** argv) {
  return ts::bench::Main(argc, argv);
}
