// What moves between the processes of a pipeline, and the seam it moves through. The ranks form a
// ring: rank r sends to rank (r + 1) % world and receives from rank (r - 1) % world. Rank 0 sends
// each micro-batch's chunks and stage 0's hidden state to rank 1, every stage passes its own hidden
// state on, and the last rank sends its output (logits) back to rank 0. A shutdown travels the
// same way. TcpTransport (tcp_transport.h) is the implementation between processes. The CUDA
// pipeline across processes (engine/cuda/cuda_ranks.h) sends its control messages over it, and
// moves its data over NCCL, or over it too where two ranks share a GPU (docs/pipeline.md).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "models/cpu_model.h"

namespace ts::pipeline {

enum class StageOp : uint32_t {
  kForward = 1,   // a micro-batch: run it (unless it carries an error) and pass it on
  kShutdown = 2,  // the leader is stopping cleanly: pass it on, then exit 0
  // The CUDA pipeline across processes (engine/cuda/cuda_ranks.h): what the leader's backend
  // decided, for every worker to run its part of, and the bytes of a move between stages that
  // share a GPU.
  kCudaPrefill = 3,  // one prefill chunk's pieces
  kCudaDecode = 4,   // a decode step of one bucket
  kCudaRegime = 5,   // the attention regime of every stage's graphs
  kCudaData = 6,     // one move's bytes (host links), in `data`
};
inline constexpr uint32_t kLastStageOp = 6;

// One micro-batch on its way round the ring, with the chunks flattened so it can cross a wire:
// chunk i runs tokens [token_offset(i), +lengths[i]) from start_pos starts[i] over block ids
// [block_offset(i), +block_counts[i]).
struct StageMessage {
  StageOp op = StageOp::kForward;
  uint64_t id = 0;  // the leader's sequence number; results come back in the order sent
  LogitsMode mode = LogitsMode::kAll;
  std::vector<int32_t> starts;        // [chunks]
  std::vector<int32_t> lengths;       // [chunks]
  std::vector<int32_t> block_counts;  // [chunks]
  std::vector<int32_t> tokens;        // [sum of lengths]
  std::vector<int32_t> blocks;        // [sum of block_counts]
  std::vector<float> data;            // the previous stage's [tokens][hidden]; logits at the end
  // A stage's error travels on with its micro-batch instead of its output; later stages pass it
  // on untouched, so the leader reports it.
  absl::Status status;
};

// Flattens `chunks` into `m`'s chunk fields (its op, id, mode and data are left alone).
void PackChunks(std::span<const SeqChunk> chunks, StageMessage* m);
// The chunks of `m`, pointing into its vectors (valid while `m` lives unchanged); InvalidArgument
// if the counts do not add up (a malformed message).
absl::Status UnpackChunks(const StageMessage& m, std::vector<SeqChunk>* chunks);

// One rank's two links in the ring. Both calls are thread-compatible: one sender and one receiver
// at a time (they may be different threads). Once either link fails, the transport is broken:
// every later call fails at once with the first error, which names the peer.
class StageTransport {
 public:
  virtual ~StageTransport() = default;
  virtual int32_t rank() const = 0;
  virtual int32_t world_size() const = 0;
  // To rank (rank + 1) % world. Unavailable if the peer is gone, DeadlineExceeded if it stops
  // reading for longer than the transport's timeout.
  virtual absl::Status Send(const StageMessage& m) = 0;
  // The next message from rank (rank - 1) % world. `timeout`: how long to wait for one to start
  // arriving (nullopt: as long as the link lives; a dead peer still ends the wait). Unavailable
  // if the peer closed or broke the link, DeadlineExceeded when the timeout passes.
  virtual absl::Status Recv(StageMessage* m, std::optional<std::chrono::milliseconds> timeout) = 0;
  // The first error either link has seen, or OK (a health check: a peer that died while nothing
  // was in flight shows here before any request fails).
  virtual absl::Status health() const = 0;
};

}  // namespace ts::pipeline
