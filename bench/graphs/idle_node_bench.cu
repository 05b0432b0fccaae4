// tailserve-idle-node-bench: what a kernel node with nothing to do costs between two PDL-chained
// kernels, launched and disabled. The decode graphs keep one attention combine node a layer
// whatever the split count (an exec update cannot change the topology), which passes through at
// one split; disabling it there was tried and lost in the step (docs/gpu-facts.md, Graph updates).
//
// A graph of --pairs pairs: an 8 MB streaming kernel (264 CTAs of 256 threads, its loads before
// griddepcontrol.wait, then launch_dependents) and a pass-through kernel (132 CTAs: wait,
// trigger, exit), every launch with programmatic stream serialization. Variants: no pass-through
// node; the node launched; the node disabled with cudaGraphNodeSetEnabled; enabled again; and the
// launched and disabled node in an exec instantiated for device launch (host-launched here).
// Prints the median over --reps graph launches (after 3 warm-ups) per pair, in us.
//
//   tailserve-idle-node-bench [--pairs=32] [--reps=30]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bench/common/graph_timing.h"
#include "kernels/pdl.cuh"

namespace {

constexpr int kStreamCtas = 264, kStreamThreads = 256, kPassCtas = 132;
constexpr size_t kStreamBytes = size_t{8} << 20;
constexpr size_t kPoolBytes = size_t{1} << 30;  // far past L2: each pair streams from HBM

__global__ void __launch_bounds__(kStreamThreads)
    StreamKernel(const int4* __restrict__ src /* [per_cta * kStreamCtas] */, int per_cta,
                 int* sink /* [kStreamCtas] */) {
  const int4* p = src + static_cast<size_t>(blockIdx.x) * per_cta;
  int x = 0;
  for (int i = threadIdx.x; i < per_cta; i += kStreamThreads) x ^= __ldcs(p + i).x;
  ts::kernels::GridDepWait();
  ts::kernels::GridDepLaunchDependents();
  if (x == 0x12345) sink[blockIdx.x] = x;  // never with the pool's bytes: keeps the loads
}

__global__ void PassThroughKernel() {
  ts::kernels::GridDepWait();
  ts::kernels::GridDepLaunchDependents();
}

struct Variant {
  const char* name;
  bool node;         // the pass-through kernel between the streaming kernels
  bool disabled;     // ... disabled in the exec
  bool device_exec;  // instantiated with cudaGraphInstantiateFlagDeviceLaunch
};

double UsPerPair(const Variant& v, int pairs, int reps, const int4* pool, int* sink,
                 cudaStream_t s) {
  const int per_cta = static_cast<int>(kStreamBytes / sizeof(int4) / kStreamCtas);
  std::vector<cudaGraphNode_t> pass;  // the pass-through nodes, in the captured graph
  auto enqueue = [&](cudaStream_t stream) -> absl::Status {
    for (int i = 0; i < pairs; ++i) {
      const size_t slots = (kPoolBytes - kStreamBytes) / sizeof(int4);
      const int4* src = pool + (static_cast<size_t>(i) * kStreamBytes / sizeof(int4)) % slots;
      BENCH_CUDA(ts::kernels::LaunchWithPdl(StreamKernel, dim3(kStreamCtas), dim3(kStreamThreads),
                                            0, stream, true, src, per_cta, sink));
      if (!v.node) continue;
      BENCH_CUDA(ts::kernels::LaunchWithPdl(PassThroughKernel, dim3(kPassCtas), dim3(128), 0,
                                            stream, true));
      cudaStreamCaptureStatus st;
      const cudaGraphNode_t* deps = nullptr;
      size_t n = 0;
      BENCH_CUDA(cudaStreamGetCaptureInfo(stream, &st, nullptr, nullptr, &deps, nullptr, &n));
      if (n == 1) pass.push_back(deps[0]);
    }
    return absl::OkStatus();
  };
  auto disable = [&](cudaGraphExec_t exec) {
    if (!v.disabled) return;
    for (cudaGraphNode_t node : pass) BENCH_CUDA(cudaGraphNodeSetEnabled(exec, node, 0));
  };
  const std::vector<double> us = ts::bench::TimeGraphReplays(
      s, 3, reps, enqueue, v.device_exec ? cudaGraphInstantiateFlagDeviceLaunch : 0, disable);
  return us[us.size() / 2] / pairs;
}

int IntFlag(int argc, char** argv, const char* name, int def) {
  const size_t len = std::strlen(name);
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], name, len) == 0 && argv[i][len] == '=') {
      return std::atoi(argv[i] + len + 1);
    }
  }
  return def;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf(
          "usage: tailserve-idle-node-bench [--pairs=32] [--reps=30]\n"
          "  us per (8 MB streaming kernel + pass-through kernel) pair in a PDL chain: without\n"
          "  the pass-through node, with it launched, with it disabled (cudaGraphNodeSetEnabled),\n"
          "  and in an exec instantiated for device launch.\n");
      return 0;
    }
  }
  const int pairs = std::max(1, IntFlag(argc, argv, "--pairs", 32));
  const int reps = std::max(1, IntFlag(argc, argv, "--reps", 30));
  int4* pool;
  int* sink;
  BENCH_CUDA(cudaMalloc(&pool, kPoolBytes));
  BENCH_CUDA(cudaMemset(pool, 1, kPoolBytes));
  BENCH_CUDA(cudaMalloc(&sink, kStreamCtas * sizeof(int)));
  cudaStream_t s;
  BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const Variant variants[] = {
      {"no pass-through node", false, false, false},
      {"pass-through launched", true, false, false},
      {"pass-through disabled", true, true, false},
      {"pass-through launched again", true, false, false},
      {"device exec, launched", true, false, true},
      {"device exec, disabled", true, true, true},
  };
  std::printf("%-30s %10s\n", "variant", "us/pair");
  for (const Variant& v : variants) {
    std::printf("%-30s %10.2f\n", v.name, UsPerPair(v, pairs, reps, pool, sink, s));
  }
  BENCH_CUDA(cudaStreamDestroy(s));
  BENCH_CUDA(cudaFree(pool));
  BENCH_CUDA(cudaFree(sink));
  return 0;
}
