// The CUDA pipeline across processes (docs/pipeline.md, Across processes): one stage per process,
// on one node or several. Rank 0 holds the last stage, so the engine, the gRPC server, the slot
// table and sampling stay with the head; rank r > 0 holds stage r - 1, which keeps the ranks'
// ring in layer order (rank r sends to r + 1, the last back to 0).
//
// Every rank builds its stage, then joins the others over the TCP ring (TcpTransport): each
// announces its KV pool, its GPU and, on rank 0, an NCCL unique id, and a check string that
// every rank must share (the model's shapes, the split and the options that size a stage's
// buffers). The links are NCCL send/recv over one communicator of all the ranks, or, where two
// ranks share a GPU (NCCL refuses that), the bytes through the host over the ring
// (stage_link.h). The engine's KV pool is the smallest rank's.
//
// Per call, rank 0's backend sends what it decided (a prefill chunk's pieces, a decode step's
// bucket, an attention regime) round the ring ahead of the data; each worker passes it on and
// runs its part of the same StagePipeline call (stage_pipeline.h), so every rank makes the same
// moves in the same order. A worker waits for its stream before it takes the next call, bounded
// like every wait here.
//
// Failures: a worker whose link or stage fails exits non-zero (RunCudaWorker returns the error),
// which closes its links; rank 0's next step fails with it, and CudaBackend::pipeline_health
// shows it at once when nothing runs. Rank 0's clean shutdown travels the ring, and every
// worker returns OK.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/pipeline/stage_transport.h"

namespace ts {

// The rank that holds each of world_size stages: the last on rank 0, stage s on rank s + 1.
std::vector<int32_t> StageRanks(int32_t world_size);

// A worker rank's whole life (ranks 1..world_size - 1 of options.ranks): plans the stages as rank
// 0 does (PlanCudaStages over the checkpoint's config), builds its stage on options.device from
// options.model_dir, joins the ring and runs every call rank 0 sends, until rank 0's shutdown has
// passed (OK) or a link or the stage fails (its error). options must match rank 0's in what
// sizes a stage (the check string names them).
absl::Status RunCudaWorker(const CudaBackendOptions& options);

// The control messages, as they cross the ring.
// kCudaPrefill: piece i is starts[i] (its first row), lengths[i] (its rows) and block_counts[i]
// table entries from `blocks`; `tokens` holds, per piece, its prompt's length, its head row and
// then its rows' tokens. A worker rebuilds pieces whose prompt has those tokens at those rows
// (the rest are never read).
void PackPrefillChunk(std::span<const PrefillPiece> pieces, pipeline::StageMessage* m);
struct ReceivedChunk {
  std::vector<std::vector<int32_t>> prompts;  // [pieces] the prompt, zeros outside the rows
  std::vector<std::vector<int32_t>> tables;   // [pieces]
  std::vector<PrefillPiece> pieces;           // pointing into prompts and tables
  int32_t rows = 0;
};
// InvalidArgument for a malformed message (counts that do not add up, rows outside the prompt).
absl::Status UnpackPrefillChunk(const pipeline::StageMessage& m, ReceivedChunk* out);
// kCudaDecode: starts = {bucket index}.
pipeline::StageMessage DecodeMessage(int32_t index);
absl::StatusOr<int32_t> UnpackDecode(const pipeline::StageMessage& m, int32_t num_buckets);
// kCudaRegime: starts = {attention splits, max context}.
pipeline::StageMessage RegimeMessage(const graphs::Regime& regime);
absl::StatusOr<graphs::Regime> UnpackRegime(const pipeline::StageMessage& m);

// What every rank must agree on: "cuda", the shapes, the split by layers, and the options that
// size a stage's buffers (slots, buckets, KV block size, context, prefill chunk).
std::string CudaRankCheck(const ModelConfig& config, std::span<const CudaStageOptions> plan,
                          const CudaBackendOptions& options);

}  // namespace ts
