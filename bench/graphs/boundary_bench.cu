// tailserve-boundary-bench: what one feature of a graph's nodes adds to the cost of a step
// boundary. The base step is two one-CTA kernels; each variant puts one more node between them:
//   big_smem    132 CTAs with 200 KB of dynamic shared memory, no work
//   cluster     132 CTAs in clusters of 2, no work
//   wide        132 CTAs, no shared memory, no work (what big_smem and cluster add beyond a node)
//   sys_fence   one CTA: three stores to host-mapped memory with two __threadfence_system()
//               (fence.sc.sys) between them, as the postprocess kernel writes a ring entry
//   sys_acqrel  the same with fence.acq_rel.sys, which is all the ring's ordering needs
//   sys_nofence the three stores alone
// Each graph runs as host launches back to back (no sync) and as a device tail-launch loop (a
// one-CTA node at the end relaunches the running graph, as graphs/device_loop.cu's scheduler
// does). Per step: the median over 7 timed runs of --steps steps, with the kernels' preferred
// shared-memory carveout left to the driver and then set to the maximum (a reconfiguration
// between kernels of different carveouts needs an idle SM). docs/device-loop.md, The gap.
//
//   tailserve-boundary-bench [--steps=400]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

#define CHECK(x)                                                               \
  do {                                                                         \
    const cudaError_t err_ = (x);                                              \
    if (err_ != cudaSuccess) {                                                 \
      std::fprintf(stderr, "tailserve-boundary-bench: %s: %s (line %d)\n", #x, \
                   cudaGetErrorString(err_), __LINE__);                        \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

constexpr int kBigSmemBytes = 200 * 1024;
constexpr int kWideCtas = 132;

__global__ void Tiny(int* counter) {
  if (threadIdx.x == 0) atomicAdd(counter, 1);
}

__global__ void BigSmem(int* counter) {
  extern __shared__ int smem[];
  smem[threadIdx.x] = static_cast<int>(threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0 && smem[5] == 7) atomicAdd(counter, 1);  // never: keeps the store
}

__global__ void __cluster_dims__(2, 1, 1) Clustered(int* counter) {
  if (threadIdx.x == 0 && blockIdx.x == kWideCtas) atomicAdd(counter, 1);  // never
}

__global__ void Wide(int* counter) {
  if (threadIdx.x == 0 && blockIdx.x == kWideCtas) atomicAdd(counter, 1);  // never
}

enum class Fence { kSc, kAcqRel, kNone };

template <Fence kFence>
__device__ __forceinline__ void SystemFence() {
  if constexpr (kFence == Fence::kSc) {
    __threadfence_system();
  } else if constexpr (kFence == Fence::kAcqRel) {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
  }
}

template <Fence kFence>
__global__ void SysStores(volatile int* host /* [3] host-mapped */, const int* counter) {
  if (threadIdx.x == 0) {
    host[0] = 0;
    SystemFence<kFence>();
    host[1] = *counter;
    SystemFence<kFence>();
    host[2] = 1;
  }
}

__device__ int g_steps_left;

__global__ void Relaunch() {
  if (threadIdx.x == 0 && atomicSub(&g_steps_left, 1) > 1) {
    cudaGraphLaunch(cudaGetCurrentGraphExec(), cudaStreamGraphTailLaunch);
  }
}

enum Variant { kBase, kBigSmem, kCluster, kWide, kSysFence, kSysAcqRel, kSysNoFence, kNumVariants };
const char* const kNames[] = {"base",      "big_smem",   "cluster",    "wide",
                              "sys_fence", "sys_acqrel", "sys_nofence"};

struct Env {
  cudaStream_t stream;
  cudaEvent_t e0, e1;
  int* counter;   // [1] device
  int* host_dev;  // [3] host-mapped, device address
};

void Capture(const Env& env, Variant v, bool loop, cudaGraph_t* graph) {
  CHECK(cudaStreamBeginCapture(env.stream, cudaStreamCaptureModeThreadLocal));
  Tiny<<<1, 32, 0, env.stream>>>(env.counter);
  switch (v) {
    case kBigSmem:
      BigSmem<<<kWideCtas, 128, kBigSmemBytes, env.stream>>>(env.counter);
      break;
    case kCluster:
      Clustered<<<kWideCtas, 128, 0, env.stream>>>(env.counter);
      break;
    case kWide:
      Wide<<<kWideCtas, 128, 0, env.stream>>>(env.counter);
      break;
    case kSysFence:
      SysStores<Fence::kSc><<<1, 32, 0, env.stream>>>(env.host_dev, env.counter);
      break;
    case kSysAcqRel:
      SysStores<Fence::kAcqRel><<<1, 32, 0, env.stream>>>(env.host_dev, env.counter);
      break;
    case kSysNoFence:
      SysStores<Fence::kNone><<<1, 32, 0, env.stream>>>(env.host_dev, env.counter);
      break;
    default:
      break;
  }
  Tiny<<<1, 32, 0, env.stream>>>(env.counter);
  if (loop) Relaunch<<<1, 32, 0, env.stream>>>();
  CHECK(cudaGetLastError());
  CHECK(cudaStreamEndCapture(env.stream, graph));
}

// Median us per step over 7 timed runs (after 2 untimed) of `steps` steps.
float UsPerStep(const Env& env, Variant v, bool loop, int steps) {
  cudaGraph_t graph;
  Capture(env, v, loop, &graph);
  cudaGraphExec_t exec;
  CHECK(
      cudaGraphInstantiateWithFlags(&exec, graph, loop ? cudaGraphInstantiateFlagDeviceLaunch : 0));
  if (loop) CHECK(cudaGraphUpload(exec, env.stream));
  std::vector<float> us;
  for (int run = 0; run < 9; ++run) {
    if (loop) {
      CHECK(cudaMemcpyToSymbolAsync(g_steps_left, &steps, sizeof(steps), 0, cudaMemcpyHostToDevice,
                                    env.stream));
    }
    CHECK(cudaStreamSynchronize(env.stream));
    CHECK(cudaEventRecord(env.e0, env.stream));
    for (int i = 0; i < (loop ? 1 : steps); ++i) CHECK(cudaGraphLaunch(exec, env.stream));
    CHECK(cudaEventRecord(env.e1, env.stream));
    CHECK(cudaEventSynchronize(env.e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, env.e0, env.e1));
    if (run >= 2) us.push_back(ms * 1000 / steps);
  }
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 400;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf(
          "usage: tailserve-boundary-bench [--steps=N (>= 2, default 400)]\n"
          "  us per step of a two-kernel graph with one more node kind between its kernels,\n"
          "  host-launched back to back and tail-launched (docs/device-loop.md, The gap).\n");
      return 0;
    }
    if (std::strncmp(argv[i], "--steps=", 8) == 0 && std::atoi(argv[i] + 8) >= 2) {
      steps = std::atoi(argv[i] + 8);
    } else {
      std::fprintf(stderr, "usage: tailserve-boundary-bench [--steps=N (>= 2)]\n");
      return 2;
    }
  }
  Env env;
  CHECK(cudaStreamCreateWithFlags(&env.stream, cudaStreamNonBlocking));
  CHECK(cudaEventCreate(&env.e0));
  CHECK(cudaEventCreate(&env.e1));
  CHECK(cudaMalloc(&env.counter, sizeof(int)));
  int* host = nullptr;
  CHECK(cudaHostAlloc(&host, 3 * sizeof(int), cudaHostAllocMapped));
  CHECK(cudaHostGetDevicePointer(&env.host_dev, host, 0));
  CHECK(cudaFuncSetAttribute(BigSmem, cudaFuncAttributeMaxDynamicSharedMemorySize, kBigSmemBytes));
  std::printf("%-10s %9s %12s %12s\n", "variant", "carveout", "host_us", "loop_us");
  for (int carveout : {-1, 100}) {  // -1: the driver's choice; 100: the most shared memory
    for (const void* fn : {reinterpret_cast<const void*>(Tiny), reinterpret_cast<const void*>(Wide),
                           reinterpret_cast<const void*>(SysStores<Fence::kSc>),
                           reinterpret_cast<const void*>(SysStores<Fence::kAcqRel>),
                           reinterpret_cast<const void*>(SysStores<Fence::kNone>),
                           reinterpret_cast<const void*>(Relaunch)}) {
      CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, carveout));
    }
    for (int v = 0; v < kNumVariants; ++v) {
      const float host_us = UsPerStep(env, static_cast<Variant>(v), false, steps);
      const float loop_us = UsPerStep(env, static_cast<Variant>(v), true, steps);
      std::printf("%-10s %9d %12.2f %12.2f\n", kNames[v], carveout, host_us, loop_us);
    }
  }
  CHECK(cudaFreeHost(host));
  return 0;
}
