#include "tests/engine/nccl_graphs_kernels.cuh"

namespace ts::pipeline::testing {
namespace {

constexpr int kThreads = 256;

__global__ void TailLaunchKernel(cudaGraphExec_t target, int32_t* status) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const cudaError_t e = cudaGraphLaunch(target, cudaStreamGraphTailLaunch);
  *status = static_cast<int32_t>(e);
}

__device__ void Store(uint32_t* dst, uint32_t n, uint32_t seed) {
  for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = Pattern(i, seed);
}

// A pipeline stage would store into the next stage's buffer; on one rank the next LSA peer is
// this rank itself, so the store goes through the LSA (flat, peer-indexed) mapping of our own
// window and the local pointer must then see it.
__global__ void LsaStoreKernel(LsaStoreArgs a) {
  const uint32_t seed = *a.seed;
  const int peer = (a.dev.lsaRank + 1) % a.dev.lsaSize;
  auto* remote = static_cast<uint32_t*>(ncclGetLsaPointer(a.window, 0, peer));
  if (threadIdx.x == 0) *a.lsa_address = reinterpret_cast<uintptr_t>(remote);
  if (a.barrier) {
    // As NCCL's examples do: relaxed sync first (every peer has entered), release after the stores
    // (they are visible to the peers' reads after their wait).
    ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), a.dev, ncclTeamTagLsa(), blockIdx.x);
    bar.sync(ncclCoopCta(), cuda::memory_order_relaxed);
    Store(remote, a.n, seed);
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
  } else {
    Store(remote, a.n, seed);
    __threadfence();
    __syncthreads();
  }
  const auto* local = static_cast<const uint32_t*>(ncclGetLocalPointer(a.window, 0));
  for (uint32_t i = threadIdx.x; i < a.n; i += blockDim.x) a.echo[i] = local[i];
}

}  // namespace

cudaError_t EnqueueTailLaunch(cudaGraphExec_t target, int32_t* status, cudaStream_t stream) {
  TailLaunchKernel<<<1, 1, 0, stream>>>(target, status);
  return cudaGetLastError();
}

cudaError_t EnqueueLsaStore(const LsaStoreArgs& args, cudaStream_t stream) {
  // One block: the barrier is indexed by blockIdx.x and the communicator holds one.
  LsaStoreKernel<<<1, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace ts::pipeline::testing
