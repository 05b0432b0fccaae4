// How the stages of a CUDA pipeline (docs/pipeline.md, The CUDA pipeline) pass buffers to each
// other: each step's hidden state forward from stage to stage, and the rows' inputs from the last
// stage, which owns the slot table, to the others. Each stage is a CudaModel working on a stream
// of its own, usually on a GPU of its own.
//
// In one process, two ways, fixed by where the stages are:
//   - every stage on its own GPU: NCCL send/recv over one communicator per stage, created in one
//     process as a group (NcclComm::CreateGroup, engine/pipeline/nccl_comm.h);
//   - two stages or more sharing a GPU (NCCL refuses two ranks on one device): copies on the
//     receiving stage's stream (cudaMemcpyPeerAsync, which is a plain device copy on one GPU),
//     with peer access enabled between the GPUs that allow it.
// Across processes (docs/pipeline.md, Across processes), each process holds one stage and does
// its half of every move:
//   - every rank on its own GPU: NCCL send/recv over one communicator of all the ranks;
//   - ranks sharing a GPU: the bytes through the host, over the ranks' TCP ring (a D2H copy, a
//     message, an H2D copy; the host waits for each). That is for testing the protocol on one GPU,
//     not for speed.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/cuda/cuda_model.h"

namespace ts {

namespace pipeline {
class NcclComm;
class StageTransport;
}  // namespace pipeline

// Where one stage works. Across processes, stream is null for the stages other processes hold.
struct StageQueue {
  int device = 0;
  cudaStream_t stream = nullptr;
};

// One process's side of a pipeline across processes.
struct RankLinkOptions {
  int32_t rank = 0;
  std::vector<int32_t> stage_ranks;  // [stages] the rank that holds each stage
  // The ranks' ring: host links carry the bytes on it; NCCL links watch its health, so that a
  // peer that died ends a wait at once. Outlives the links.
  pipeline::StageTransport* transport = nullptr;
  std::unique_ptr<pipeline::NcclComm> comm;  // over all the ranks; null: host links
  std::chrono::milliseconds timeout{60000};  // each NCCL call, each message of a host link
};

class StageLinks {
 public:
  // `timeout` bounds NCCL's setup and each of its calls (a communicator that fails is aborted).
  static absl::StatusOr<std::unique_ptr<StageLinks>> Create(const std::vector<StageQueue>& stages,
                                                            std::chrono::milliseconds timeout);
  // This process's stages have a stream in `stages`; the others are held by other processes,
  // which run the same moves in the same order.
  static absl::StatusOr<std::unique_ptr<StageLinks>> CreateAcrossProcesses(
      const std::vector<StageQueue>& stages, RankLinkOptions options);
  virtual ~StageLinks() = default;

  // Moves src[i] (in stage `from`'s device memory) into dst[i] (in stage `to`'s), as many bytes
  // as src[i] says (dst[i] must hold them). Ordering, through the two stages' streams only:
  //   - the copy sees everything enqueued on `from`'s stream before this call;
  //   - work enqueued on `to`'s stream after this call sees the copy;
  //   - work enqueued on `from`'s stream after this call may overwrite src, and work on `to`'s
  //     stream before this call may still read dst: neither races with the copy.
  // Enqueues only; never waits on the host for the GPU (but host links do, see above).
  // Across processes, src is empty where `from` is another process's stage and dst where `to`
  // is: each process does its half, and the halves' buffers have the same sizes.
  // `from_stream`: another stream of the sending stage's GPU to order the send on instead of
  // the stage's own (the last stage's feed for a pipeline's row groups); null: the stage's.
  virtual absl::Status Move(int from, int to, std::span<const DeviceBytes> src,
                            std::span<const DeviceBytes> dst,
                            cudaStream_t from_stream = nullptr) = 0;
  // Waits on the host for `event` (recorded on a stage's stream), as Wait does for a stream.
  virtual absl::Status WaitEvent(cudaEvent_t event, std::chrono::milliseconds timeout) = 0;
  // Waits on the host for everything enqueued on `stream` (a stage's), however long the copies
  // take; over NCCL at most `timeout`, and an NCCL error or the timeout aborts every
  // communicator (which releases kernels stuck in a transfer) and fails this and every later
  // call.
  virtual absl::Status Wait(cudaStream_t stream, std::chrono::milliseconds timeout) = 0;
  virtual const char* name() const = 0;  // "nccl", "copy" or "host", for the startup log
};

}  // namespace ts
