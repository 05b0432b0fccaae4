// tailserve-cublaslt-search: does cuBLASLt hold a faster kernel than its heuristic picks for our
// projections? tailserve-cublaslt-sweep times only what cublasLtMatmulAlgoGetHeuristic offers
// (eight algorithms and their split-K variants); this tool walks the whole configuration space
// the library exposes, as a tactic search does: every algorithm id for bf16 in, bf16 out, fp32
// compute, and for each its tiles, stage counts, split-K counts and reduction schemes, CTA
// swizzling, custom options (0-7) and Hopper cluster shapes (auto, 1x1, 2x1, 1x2, 4x1), keeping
// what cublasLtMatmulAlgoCheck accepts within kernels/gemm.cuh's 32 MB workspace. The whole
// product is too large to time, so the search has two levels: every (algorithm, tile, stages)
// base, then every variant of the kBases fastest bases.
//
// Method, per (projection, M):
//  1. every accepted base, then every accepted variant, is timed alone between two events
//     (1 warm-up, median of 3);
//  2. the heuristic's first choice and the 12 fastest of step 1 are timed again as a graph of
//     kLaunches back-to-back launches, W rotating over enough copies to keep L2 from holding
//     it, median of 7 replays: the per-launch cost a decode graph pays, launch latency hidden;
//  3. the winner's output is compared with the first choice's (max |diff| / max |ref|): a
//     split-K reduction changes the summation order, so ~1e-3 is bf16 rounding, more is a bug.
// It prints the first choice and the winner in us per launch, the winner's configuration, and
// the bytes' and FLOPs' roofs at --roof_gbps and 989 TFLOP/s.
//
//   tailserve-cublaslt-search [--roof_gbps=4230] [--shapes=8b,1b] [M ...]   (default M: 16 32 64
//   128 256)
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cublaslt_setup.h"  // beside this file

namespace {

using ts::bench::Projection;

#define CHECK(x) \
  ts::bench::CheckOrExit("tailserve-cublaslt-search", static_cast<int>(x), #x, __LINE__)

constexpr double kPeakFlopsPerUs = 989e6;  // dense bf16 tensor-core peak, H100 SXM and H200
constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // as kernels/gemm.cuh's default
constexpr size_t kRotateBytes = size_t{192} << 20;    // W copies per shape: >= 3x a 50-60 MB L2
constexpr int kLaunches = 20;                         // launches per timed graph
constexpr size_t kFinalists = 12;
constexpr size_t kBases = 24;  // bases whose variants are searched

struct Candidate {
  cublasLtMatmulAlgo_t algo;
  std::string name;
  float quick_us = 0;
};

uint32_t Get32(const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoConfigAttributes_t attr) {
  uint32_t v = 0;
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&a, attr, &v, sizeof(v), &written);
  return v;
}

std::string Describe(const cublasLtMatmulAlgo_t& a) {
  char buf[160];
  std::snprintf(buf, sizeof(buf), "id=%u tile=%u stages=%u splitk=%u red=%u swz=%u custom=%u cl=%u",
                Get32(a, CUBLASLT_ALGO_CONFIG_ID), Get32(a, CUBLASLT_ALGO_CONFIG_TILE_ID),
                Get32(a, CUBLASLT_ALGO_CONFIG_STAGES_ID), Get32(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                Get32(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                Get32(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
                Get32(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
                Get32(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID));
  return buf;
}

// A capability that is an array of uint32 ids; {0} (undefined) when the algorithm lists none.
std::vector<uint32_t> CapIds(const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoCapAttributes_t cap) {
  size_t bytes = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&a, cap, nullptr, 0, &bytes) != CUBLAS_STATUS_SUCCESS ||
      bytes == 0) {
    return {0};
  }
  std::vector<uint32_t> ids(bytes / sizeof(uint32_t));
  cublasLtMatmulAlgoCapGetAttribute(&a, cap, ids.data(), bytes, &bytes);
  return ids;
}

template <typename T>
T Cap(const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoCapAttributes_t cap) {
  T v{};
  size_t written = 0;
  cublasLtMatmulAlgoCapGetAttribute(&a, cap, &v, sizeof(v), &written);
  return v;
}

bool Set(cublasLtMatmulAlgo_t* a, cublasLtMatmulAlgoConfigAttributes_t attr, uint32_t v) {
  return cublasLtMatmulAlgoConfigSetAttribute(a, attr, &v, sizeof(v)) == CUBLAS_STATUS_SUCCESS;
}

bool Accepted(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t wl,
              cublasLtMatrixLayout_t al, cublasLtMatrixLayout_t cl, const cublasLtMatmulAlgo_t& a) {
  cublasLtMatmulHeuristicResult_t check{};
  return cublasLtMatmulAlgoCheck(h, desc, wl, al, cl, cl, &a, &check) == CUBLAS_STATUS_SUCCESS &&
         check.workspaceSize <= kWorkspaceBytes;
}

// The search's first level: every algorithm id with each of its tiles and stage counts, no
// split-K, no swizzling, custom option 0, the cluster shape left to the library.
std::vector<cublasLtMatmulAlgo_t> Bases(cublasLtHandle_t h, cublasLtMatmulDesc_t desc,
                                        cublasLtMatrixLayout_t wl, cublasLtMatrixLayout_t al,
                                        cublasLtMatrixLayout_t cl) {
  int ids[256];
  int num_ids = 0;
  CHECK(cublasLtMatmulAlgoGetIds(h, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF,
                                 CUDA_R_16BF, CUDA_R_16BF, 256, ids, &num_ids));
  std::vector<cublasLtMatmulAlgo_t> out;
  for (int i = 0; i < num_ids; ++i) {
    cublasLtMatmulAlgo_t base;
    if (cublasLtMatmulAlgoInit(h, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF,
                               CUDA_R_16BF, CUDA_R_16BF, ids[i], &base) != CUBLAS_STATUS_SUCCESS) {
      continue;
    }
    for (uint32_t tile : CapIds(base, CUBLASLT_ALGO_CAP_TILE_IDS)) {
      for (uint32_t stage : CapIds(base, CUBLASLT_ALGO_CAP_STAGES_IDS)) {
        cublasLtMatmulAlgo_t a = base;
        if (Set(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, tile) &&
            Set(&a, CUBLASLT_ALGO_CONFIG_STAGES_ID, stage) && Accepted(h, desc, wl, al, cl, a)) {
          out.push_back(a);
        }
      }
    }
  }
  return out;
}

// The second level, around one base: split-K counts with each reduction scheme the algorithm
// has, CTA swizzling, custom options and Hopper cluster shapes.
std::vector<cublasLtMatmulAlgo_t> Expand(cublasLtHandle_t h, cublasLtMatmulDesc_t desc,
                                         cublasLtMatrixLayout_t wl, cublasLtMatrixLayout_t al,
                                         cublasLtMatrixLayout_t cl,
                                         const cublasLtMatmulAlgo_t& base) {
  const bool splitk = Cap<int32_t>(base, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT) != 0;
  const uint32_t red_mask = Cap<uint32_t>(base, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK);
  const bool swizzle = Cap<uint32_t>(base, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT) != 0;
  const int32_t custom_max = std::min(Cap<int32_t>(base, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX), 7);
  const uint32_t clusters[] = {CUBLASLT_CLUSTER_SHAPE_AUTO, CUBLASLT_CLUSTER_SHAPE_1x1x1,
                               CUBLASLT_CLUSTER_SHAPE_2x1x1, CUBLASLT_CLUSTER_SHAPE_1x2x1,
                               CUBLASLT_CLUSTER_SHAPE_4x1x1};
  std::vector<cublasLtMatmulAlgo_t> out;
  for (uint32_t splits : {1u, 2u, 3u, 4u, 6u, 8u, 12u, 16u}) {
    if (splits > 1 && !splitk) break;
    // CUBLASLT_REDUCTION_SCHEME_{NONE = 0, INPLACE = 1, COMPUTE_TYPE = 2, OUTPUT_TYPE = 4}
    for (uint32_t red : {0u, 1u, 2u, 4u}) {
      if (splits == 1 ? red != 0 : (red == 0 || (red_mask & red) == 0)) continue;
      for (uint32_t swz = 0; swz <= (swizzle ? 1u : 0u); ++swz) {
        for (int32_t custom = 0; custom <= custom_max; ++custom) {
          for (uint32_t cluster : clusters) {
            if (splits == 1 && swz == 0 && custom == 0 && cluster == 0) continue;  // the base
            cublasLtMatmulAlgo_t a = base;
            if (Set(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, splits) &&
                (splits == 1 || Set(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, red)) &&
                Set(&a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, swz) &&
                Set(&a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, static_cast<uint32_t>(custom)) &&
                Set(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, cluster) &&
                Accepted(h, desc, wl, al, cl, a)) {
              out.push_back(a);
            }
          }
        }
      }
    }
  }
  return out;
}

using Problem = ts::bench::TimedGemm;

float Elapsed(const Problem& p) {
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, p.e0, p.e1));
  return ms * 1000;
}

// Step 1: alone between events, 1 warm-up and the median of 3; 0 when the launch is refused.
float QuickUs(const Problem& p, const cublasLtMatmulAlgo_t& algo) {
  float us[4];
  for (int rep = 0; rep < 4; ++rep) {
    CHECK(cudaEventRecord(p.e0, p.stream));
    if (ts::bench::LaunchCopy(p, algo, rep) != CUBLAS_STATUS_SUCCESS) {
      CHECK(cudaStreamSynchronize(p.stream));
      return 0.f;
    }
    CHECK(cudaEventRecord(p.e1, p.stream));
    CHECK(cudaEventSynchronize(p.e1));
    us[rep] = Elapsed(p);
  }
  std::sort(us + 1, us + 4);
  return us[2];
}

// Step 2: us per launch in a graph of kLaunches back-to-back launches, median of 7 replays.
float GraphUs(const Problem& p, const cublasLtMatmulAlgo_t& algo) {
  return ts::bench::GraphUsPerLaunch("tailserve-cublaslt-search", p, algo, kLaunches);
}

std::vector<float> Output(const Problem& p, const cublasLtMatmulAlgo_t& algo, size_t elems) {
  CHECK(ts::bench::LaunchCopy(p, algo, 0));
  std::vector<__nv_bfloat16> host(elems);
  CHECK(cudaMemcpyAsync(host.data(), p.c, elems * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost,
                        p.stream));
  CHECK(cudaStreamSynchronize(p.stream));
  std::vector<float> out(elems);
  for (size_t i = 0; i < elems; ++i) out[i] = __bfloat162float(host[i]);
  return out;
}

// Values in [-scale, scale) from a hash of the index: non-zero, sign-mixed, reproducible.
void Fill(__nv_bfloat16* dev, size_t n, uint32_t seed, float scale) {
  std::vector<__nv_bfloat16> host(n);
  for (size_t i = 0; i < n; ++i) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    host[i] = __float2bfloat16(scale * (static_cast<float>(x >> 8) / 8388608.f - 1.f));
  }
  CHECK(cudaMemcpy(dev, host.data(), n * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
}

}  // namespace

int main(int argc, char** argv) {
  double roof_gbps = 4230;
  std::string which = "8b,1b";
  std::vector<int> ms;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf(
          "usage: tailserve-cublaslt-search [--roof_gbps=4230] [--shapes=8b,1b] [M ...]\n"
          "  Searches cuBLASLt's configurations for the Llama-1B/8B projections at M rows\n"
          "  (default 16 32 64 128 256) and prints the heuristic's first choice against the\n"
          "  fastest found, timed in graphs (bench/gemv/README.md). --roof_gbps: the copy\n"
          "  bandwidth the bytes' roof column uses; --shapes: which of 8b and 1b.\n");
      return 0;
    }
    if (std::strncmp(argv[i], "--roof_gbps=", 12) == 0) {
      roof_gbps = std::atof(argv[i] + 12);
    } else if (std::strncmp(argv[i], "--shapes=", 9) == 0) {
      which = argv[i] + 9;
    } else {
      const int m = std::atoi(argv[i]);
      if (m < 1 || m > 65536) {
        std::fprintf(stderr, "tailserve-cublaslt-search: bad argument '%s'\n", argv[i]);
        return 2;
      }
      ms.push_back(m);
    }
  }
  if (roof_gbps <= 0) {
    std::fprintf(stderr, "tailserve-cublaslt-search: --roof_gbps must be > 0\n");
    return 2;
  }
  if (ms.empty()) ms = {16, 32, 64, 128, 256};
  std::vector<Projection> shapes;
  for (const Projection& s : ts::bench::kProjections) {
    if (which.find(std::string(s.name, 2)) != std::string::npos) shapes.push_back(s);
  }
  const int max_m = *std::max_element(ms.begin(), ms.end());
  const auto [max_w, max_k, max_n] = ts::bench::MaxExtents(shapes);
  const size_t w_bytes_all = std::max(kRotateBytes, 2 * max_w * sizeof(__nv_bfloat16));

  cublasLtHandle_t h;
  CHECK(cublasLtCreate(&h));
  cublasLtMatmulDesc_t desc;
  CHECK(ts::bench::CreateRowMajorDesc(&desc));
  void* ws;
  __nv_bfloat16 *w, *a, *c;
  CHECK(cudaMalloc(&ws, kWorkspaceBytes));
  CHECK(cudaMalloc(&w, w_bytes_all));
  CHECK(cudaMalloc(&a, max_m * max_k * sizeof(__nv_bfloat16)));
  CHECK(cudaMalloc(&c, max_m * max_n * sizeof(__nv_bfloat16)));
  Fill(w, w_bytes_all / sizeof(__nv_bfloat16), 1u, 0.05f);
  Fill(a, max_m * max_k, 2u, 1.f);
  Problem p{.h = h, .desc = desc, .w = w, .a = a, .c = c, .ws = ws, .ws_bytes = kWorkspaceBytes};
  CHECK(cudaStreamCreate(&p.stream));
  CHECK(cudaEventCreate(&p.e0));
  CHECK(cudaEventCreate(&p.e1));

  std::printf("%-11s %4s %9s %9s %7s %8s %8s %6s %9s  %s\n", "shape", "m", "top1_us", "best_us",
              "gain", "byte_us", "flop_us", "cands", "rel_diff", "best configuration");
  for (int m : ms) {
    for (const Projection& s : shapes) {
      CHECK(ts::bench::CreateLayouts(s, m, &p.wl, &p.al, &p.cl));
      p.w_elems = size_t(s.n) * s.k;
      p.copies = static_cast<int>(w_bytes_all / (p.w_elems * sizeof(__nv_bfloat16)));

      cublasLtMatmulPreference_t pref;
      CHECK(ts::bench::CreatePreference(kWorkspaceBytes, &pref));
      cublasLtMatmulHeuristicResult_t top{};
      int found = 0;
      CHECK(cublasLtMatmulAlgoGetHeuristic(h, desc, p.wl, p.al, p.cl, p.cl, pref, 1, &top, &found));
      cublasLtMatmulPreferenceDestroy(pref);
      if (found == 0) {
        std::printf("%-11s %4d  no algorithm\n", s.name, m);
        continue;
      }

      // Two levels, each timed quickly: every base, then the variants of the kBases fastest.
      auto quick = [&p](const std::vector<cublasLtMatmulAlgo_t>& algos) {
        std::vector<Candidate> out;
        for (const cublasLtMatmulAlgo_t& algo : algos) {
          const float us = QuickUs(p, algo);
          if (us > 0.f) out.push_back({algo, "", us});
        }
        std::sort(out.begin(), out.end(),
                  [](const Candidate& x, const Candidate& y) { return x.quick_us < y.quick_us; });
        return out;
      };
      std::vector<Candidate> cand = quick(Bases(h, desc, p.wl, p.al, p.cl));
      size_t searched = cand.size();
      if (cand.size() > kBases) cand.resize(kBases);
      std::vector<cublasLtMatmulAlgo_t> variants;
      for (const Candidate& cd : cand) {
        for (const cublasLtMatmulAlgo_t& v : Expand(h, desc, p.wl, p.al, p.cl, cd.algo)) {
          variants.push_back(v);
        }
      }
      std::vector<Candidate> more = quick(variants);
      searched += more.size();
      cand.insert(cand.end(), more.begin(), more.end());
      std::sort(cand.begin(), cand.end(),
                [](const Candidate& x, const Candidate& y) { return x.quick_us < y.quick_us; });
      if (cand.size() > kFinalists) cand.resize(kFinalists);
      for (Candidate& cd : cand) cd.name = Describe(cd.algo);

      const float top_us = GraphUs(p, top.algo);
      float best_us = top_us;
      const Candidate* best = nullptr;
      for (const Candidate& cd : cand) {
        const float us = GraphUs(p, cd.algo);
        if (us > 0.f && us < best_us) {
          best_us = us;
          best = &cd;
        }
      }
      double rel = 0;
      if (best != nullptr) {
        const size_t elems = size_t(m) * s.n;
        const std::vector<float> ref = Output(p, top.algo, elems);
        const std::vector<float> got = Output(p, best->algo, elems);
        double max_ref = 0, max_diff = 0;
        for (size_t i = 0; i < elems; ++i) {
          max_ref = std::max(max_ref, double(std::fabs(ref[i])));
          max_diff = std::max(max_diff, double(std::fabs(ref[i] - got[i])));
        }
        rel = max_ref > 0 ? max_diff / max_ref : max_diff;
      }
      const double byte_us =
          (double(s.n) * s.k + double(m) * (s.k + s.n)) * sizeof(__nv_bfloat16) / (roof_gbps * 1e3);
      const double flop_us = 2.0 * m * s.n * s.k / kPeakFlopsPerUs;
      std::printf(
          "%-11s %4d %9.2f %9.2f %6.1f%% %8.2f %8.2f %6zu %9.1e  %s\n", s.name, m, top_us, best_us,
          100.0 * (top_us - best_us) / top_us, byte_us, flop_us, searched, rel,
          best != nullptr ? best->name.c_str() : ("(first choice) " + Describe(top.algo)).c_str());
      std::fflush(stdout);
      cublasLtMatrixLayoutDestroy(p.wl);
      cublasLtMatrixLayoutDestroy(p.al);
      cublasLtMatrixLayoutDestroy(p.cl);
    }
  }
  CHECK(cudaDeviceSynchronize());
  return 0;
}
