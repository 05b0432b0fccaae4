// Device code for engine_nccl_graphs_test (nccl_graphs_test.cc): a one-thread kernel that
// tail-launches a graph from the device, and a kernel that stores through NCCL 2.28's device API
// (an LSA pointer into a registered window) with an optional LSA barrier. Host-callable launchers
// keep the .cc free of <<<>>>; they return the launch error so the kernels can be captured.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstdint>

#if defined(__CUDACC__)
#define TS_NCCL_GRAPHS_HD __host__ __device__
#else
#define TS_NCCL_GRAPHS_HD
#endif

namespace ts::pipeline::testing {

// The value element i holds for `seed`: distinct across i (an odd multiplier and an xor are both
// bijections mod 2^32) and across seeds, so a stale or unwritten buffer never passes for a new one.
TS_NCCL_GRAPHS_HD inline uint32_t Pattern(uint32_t i, uint32_t seed) {
  return ((i + 1u) * 0x9E3779B1u) ^ (seed * 0x85EBCA77u + 0x165667B1u);
}

// One thread: cudaGraphLaunch(target, cudaStreamGraphTailLaunch). Only valid inside a graph
// instantiated for device launch; a failed launch leaves its cudaError_t in *status (else 0).
cudaError_t EnqueueTailLaunch(cudaGraphExec_t target, int32_t* status, cudaStream_t stream);

struct LsaStoreArgs {
  ncclWindow_t window = nullptr;   // from ncclCommWindowRegister over an ncclMemAlloc buffer
  ncclDevComm dev{};               // from ncclDevCommCreate, in the layout of the installed header
  bool barrier = false;            // dev carries one LSA barrier (lsaBarrierCount = 1)
  const uint32_t* seed = nullptr;  // [1], device: read when the kernel runs, so relaunches differ
  uint32_t n = 0;                  // elements written through the LSA pointer
  uint32_t* echo = nullptr;        // [n], plain device memory: the window read back locally
  unsigned long long* lsa_address = nullptr;  // [1], device: the LSA pointer the kernel used
};

// One block: writes Pattern(i, *seed) through ncclGetLsaPointer(window, 0, next LSA peer), which
// on one rank is this rank, then (after the barrier, if any) reads the window back through
// ncclGetLocalPointer into echo.
cudaError_t EnqueueLsaStore(const LsaStoreArgs& args, cudaStream_t stream);

}  // namespace ts::pipeline::testing
