// tailserve-cublaslt-pdl: could a cuBLASLt GEMM of the decode step launch early, behind a
// programmatic edge, and wait for the kernel before it on the GPU? Only if the kernel cuBLASLt
// launches executes griddepcontrol.wait before it reads its operands. For each Llama projection
// at each M (arguments; default 32 64 128), with operands declared 16- and 256-byte aligned, it
// lists the heuristic's candidates (up to --results) with:
//   - the kernels one launch captures (names through the driver's entry points);
//   - us per launch in a graph of 20 back-to-back launches, W rotating over >= 192 MB, median of
//     7 replays;
//   - waits: whether the GEMM's output is right behind a producer that lets it launch at once
//     (griddepcontrol.launch_dependents first) and writes A only 60 us later, joined to the GEMM
//     by a programmatic edge, three times ("RACE" when any output left 1% of the reference's
//     largest value). A first node that is not a kernel (a memset) keeps the edge from mattering.
// docs/gpu-facts.md, cuBLAS at decode shapes, says what cuBLAS 13.0 gave.
//
//   tailserve-cublaslt-pdl [--results=16] [M ...]
#include <cublasLt.h>
#include <cuda.h>  // driver types only: the functions come through cudaGetDriverEntryPoint
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

#define CHECK(x) ts::bench::CheckOrExit("tailserve-cublaslt-pdl", static_cast<int>(x), #x, __LINE__)

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // as kernels/gemm.cuh's default
constexpr size_t kRotateBytes = size_t{192} << 20;    // W copies: >= 3x a 50-60 MB L2
constexpr int kLaunches = 20;
constexpr int kMaxResults = 64;
constexpr unsigned long long kProducerDelayNs = 60000;

__global__ void LateCopy(const __nv_bfloat16* src /* [n] */, __nv_bfloat16* dst /* [n] */, size_t n,
                         unsigned long long delay_ns) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < delay_ns);
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    dst[i] = src[i];
  }
}

// Values in [-scale, scale) from a hash of the index: non-zero, sign-mixed, reproducible.
__global__ void Fill(__nv_bfloat16* p /* [n] */, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    p[i] = __float2bfloat16(scale * (static_cast<float>(x >> 8) / 8388608.f - 1.f));
  }
}

void* DriverEntry(const char* symbol) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(symbol, &fn, 12030, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return fn;
}

std::string NodeName(cudaGraphNode_t node) {
  using GetParams = CUresult (*)(CUgraphNode, CUDA_KERNEL_NODE_PARAMS*);
  using FuncName = CUresult (*)(const char**, CUfunction);
  using KernelName = CUresult (*)(const char**, CUkernel);
  static const auto get_params =
      reinterpret_cast<GetParams>(DriverEntry("cuGraphKernelNodeGetParams"));
  static const auto func_name = reinterpret_cast<FuncName>(DriverEntry("cuFuncGetName"));
  static const auto kernel_name = reinterpret_cast<KernelName>(DriverEntry("cuKernelGetName"));
  cudaGraphNodeType type;
  CHECK(cudaGraphNodeGetType(node, &type));
  if (type != cudaGraphNodeTypeKernel) return "[node type " + std::to_string(int(type)) + "]";
  CUDA_KERNEL_NODE_PARAMS params;
  std::memset(&params, 0, sizeof(params));
  if (get_params == nullptr || get_params(reinterpret_cast<CUgraphNode>(node), &params) != 0) {
    return "?";
  }
  const char* name = nullptr;
  if (params.func != nullptr && func_name != nullptr) func_name(&name, params.func);
  if (name == nullptr && params.kern != nullptr && kernel_name != nullptr) {
    kernel_name(&name, params.kern);
  }
  return name != nullptr ? std::string(name).substr(0, 64) : "?";
}

// The timed GEMM, plus A's values apart from the buffer it reads, for the late producer.
struct Problem {
  ts::bench::TimedGemm g;                // g.a aliases `a`
  const __nv_bfloat16* a_src = nullptr;  // [m, k]: A's values
  __nv_bfloat16* a = nullptr;            // [m, k]: what the GEMM reads
  size_t a_elems = 0, c_elems = 0;
};

cublasStatus_t Launch(const Problem& p, const cublasLtMatmulAlgo_t& algo) {
  return ts::bench::LaunchCopy(p.g, algo, 0);
}

// The kernels of one captured launch, or "" when cuBLASLt refuses it.
std::string Kernels(const Problem& p, const cublasLtMatmulAlgo_t& algo) {
  cudaGraph_t g;
  CHECK(cudaStreamBeginCapture(p.g.stream, cudaStreamCaptureModeThreadLocal));
  const cublasStatus_t st = Launch(p, algo);
  CHECK(cudaStreamEndCapture(p.g.stream, &g));
  std::string names;
  if (st == CUBLAS_STATUS_SUCCESS) {
    size_t n = 0;
    CHECK(cudaGraphGetNodes(g, nullptr, &n));
    std::vector<cudaGraphNode_t> nodes(n);
    CHECK(cudaGraphGetNodes(g, nodes.data(), &n));
    for (cudaGraphNode_t node : nodes) {
      if (!names.empty()) names += ' ';
      names += NodeName(node);
    }
  }
  CHECK(cudaGraphDestroy(g));
  return names;
}

std::vector<float> Download(const Problem& p) {
  std::vector<__nv_bfloat16> raw(p.c_elems);
  CHECK(cudaMemcpyAsync(raw.data(), p.g.c, p.c_elems * sizeof(__nv_bfloat16),
                        cudaMemcpyDeviceToHost, p.g.stream));
  CHECK(cudaStreamSynchronize(p.g.stream));
  std::vector<float> out(p.c_elems);
  for (size_t i = 0; i < p.c_elems; ++i) out[i] = __bfloat162float(raw[i]);
  return out;
}

// Whether the output is right behind the late producer on a programmatic edge, in three replays.
bool Waits(const Problem& p, const cublasLtMatmulAlgo_t& algo) {
  CHECK(cudaMemcpyAsync(p.a, p.a_src, p.a_elems * sizeof(__nv_bfloat16), cudaMemcpyDeviceToDevice,
                        p.g.stream));
  CHECK(Launch(p, algo));
  const std::vector<float> ref = Download(p);
  double max_ref = 0;
  for (float v : ref) max_ref = std::max(max_ref, std::fabs(double(v)));
  cudaGraph_t g;
  CHECK(cudaStreamBeginCapture(p.g.stream, cudaStreamCaptureModeThreadLocal));
  LateCopy<<<64, 256, 0, p.g.stream>>>(p.a_src, p.a, p.a_elems, kProducerDelayNs);
  CHECK(cudaGetLastError());
  cudaStreamCaptureStatus status;
  const cudaGraphNode_t* deps = nullptr;
  size_t num_deps = 0;
  CHECK(cudaStreamGetCaptureInfo(p.g.stream, &status, nullptr, nullptr, &deps, nullptr, &num_deps));
  std::vector<cudaGraphNode_t> nodes(deps, deps + num_deps);
  std::vector<cudaGraphEdgeData> edges(num_deps);
  for (cudaGraphEdgeData& e : edges) {
    e = cudaGraphEdgeData{};
    e.from_port = cudaGraphKernelNodePortProgrammatic;
    e.type = cudaGraphDependencyTypeProgrammatic;
  }
  CHECK(cudaStreamUpdateCaptureDependencies(p.g.stream, nodes.data(), edges.data(), num_deps,
                                            cudaStreamSetCaptureDependencies));
  CHECK(Launch(p, algo));
  CHECK(cudaStreamEndCapture(p.g.stream, &g));
  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, g, 0));
  bool ok = true;
  for (int replay = 0; replay < 3; ++replay) {
    CHECK(cudaMemsetAsync(p.a, 0, p.a_elems * sizeof(__nv_bfloat16), p.g.stream));
    CHECK(cudaMemsetAsync(p.g.c, 0, p.c_elems * sizeof(__nv_bfloat16), p.g.stream));
    CHECK(cudaGraphLaunch(exec, p.g.stream));
    const std::vector<float> got = Download(p);
    for (size_t i = 0; i < got.size() && ok; ++i) {
      ok = std::fabs(double(got[i]) - ref[i]) <= 1e-2 * max_ref;
    }
  }
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(g));
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  int results = 16;
  std::vector<int> ms;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf(
          "usage: tailserve-cublaslt-pdl [--results=16] [M (1..4096) ...]   (default M: 32 64 "
          "128)\n"
          "  cuBLASLt's heuristic candidates for the Llama projections, their kernels, us per\n"
          "  launch in a graph, and whether each waits behind a programmatic edge\n"
          "  (bench/gemv/README.md).\n");
      return 0;
    }
    if (std::strncmp(argv[i], "--results=", 10) == 0) {
      results = std::atoi(argv[i] + 10);
      if (results < 1 || results > kMaxResults) {
        std::fprintf(stderr, "tailserve-cublaslt-pdl: --results must be in [1, 64]\n");
        return 2;
      }
      continue;
    }
    const int m = std::atoi(argv[i]);
    if (m < 1 || m > 4096) {
      std::fprintf(stderr, "usage: tailserve-cublaslt-pdl [--results=16] [M (1..4096) ...]\n");
      return 2;
    }
    ms.push_back(m);
  }
  if (ms.empty()) ms = {32, 64, 128};
  const int max_m = *std::max_element(ms.begin(), ms.end());
  const ts::bench::Extents ext = ts::bench::MaxExtents(ts::bench::kProjections);
  const size_t max_w = ext.w, max_k = ext.k, max_n = ext.n;

  Problem p;
  CHECK(cublasLtCreate(&p.g.h));
  CHECK(ts::bench::CreateRowMajorDesc(&p.g.desc));
  CHECK(cudaStreamCreateWithFlags(&p.g.stream, cudaStreamNonBlocking));
  CHECK(cudaEventCreate(&p.g.e0));
  CHECK(cudaEventCreate(&p.g.e1));
  const size_t w_total = std::max(kRotateBytes / sizeof(__nv_bfloat16), 2 * max_w);
  __nv_bfloat16 *w, *a_src;
  CHECK(cudaMalloc(&w, w_total * sizeof(__nv_bfloat16)));
  CHECK(cudaMalloc(&a_src, size_t(max_m) * max_k * sizeof(__nv_bfloat16)));
  CHECK(cudaMalloc(&p.a, size_t(max_m) * max_k * sizeof(__nv_bfloat16)));
  CHECK(cudaMalloc(&p.g.c, size_t(max_m) * max_n * sizeof(__nv_bfloat16)));
  CHECK(cudaMalloc(&p.g.ws, kWorkspaceBytes));
  CHECK(cudaMemset(p.g.ws, 0, kWorkspaceBytes));
  p.g.ws_bytes = kWorkspaceBytes;
  Fill<<<1024, 256, 0, p.g.stream>>>(w, w_total, 1, 0.05f);
  Fill<<<1024, 256, 0, p.g.stream>>>(a_src, size_t(max_m) * max_k, 2, 1.f);
  CHECK(cudaGetLastError());
  CHECK(cudaStreamSynchronize(p.g.stream));
  p.g.w = w;
  p.g.a = p.a;
  p.a_src = a_src;

  std::printf("%-11s %4s %5s %3s %8s %6s %s\n", "shape", "m", "align", "#", "us", "waits",
              "kernels");
  for (const Projection& s : ts::bench::kProjections) {
    for (int m : ms) {
      CHECK(ts::bench::CreateLayouts(s, m, &p.g.wl, &p.g.al, &p.g.cl));
      p.g.w_elems = size_t(s.n) * s.k;
      p.g.copies = static_cast<int>(w_total / p.g.w_elems);  // >= 2: w_total >= 2 max_w
      p.a_elems = size_t(m) * s.k;
      p.c_elems = size_t(m) * s.n;
      for (uint32_t align : {16u, 256u}) {
        cublasLtMatmulPreference_t pref;
        CHECK(ts::bench::CreatePreference(kWorkspaceBytes, &pref, align));
        cublasLtMatmulHeuristicResult_t res[kMaxResults];
        int found = 0;
        CHECK(cublasLtMatmulAlgoGetHeuristic(p.g.h, p.g.desc, p.g.wl, p.g.al, p.g.cl, p.g.cl, pref,
                                             results, res, &found));
        cublasLtMatmulPreferenceDestroy(pref);
        for (int r = 0; r < found; ++r) {
          if (res[r].state != CUBLAS_STATUS_SUCCESS) continue;
          const std::string kernels = Kernels(p, res[r].algo);
          if (kernels.empty()) continue;  // accepted by the heuristic, refused at launch
          std::printf(
              "%-11s %4d %5u %3d %8.2f %6s %s\n", s.name, m, align, r,
              ts::bench::GraphUsPerLaunch("tailserve-cublaslt-pdl", p.g, res[r].algo, kLaunches),
              Waits(p, res[r].algo) ? "yes" : "RACE", kernels.c_str());
          std::fflush(stdout);
        }
      }
      cublasLtMatrixLayoutDestroy(p.g.wl);
      cublasLtMatrixLayoutDestroy(p.g.al);
      cublasLtMatrixLayoutDestroy(p.g.cl);
    }
  }
  return 0;
}
