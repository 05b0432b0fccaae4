// The CPU pipeline with one stage per process (docs/pipeline.md, Processes). Rank 0, the leader,
// runs the scheduler and stage 0; ranks 1..N-1 each run their own stage. Every rank computes the
// same plan (PlanStages over the checkpoint's config and the world size) and loads only its
// stage's tensors. Micro-batches travel round a StageTransport ring: the leader sends each one's
// chunks and stage 0's hidden state on, the last rank returns its logits, and the leader's CPU
// backend samples from them, as it does over the whole model or over stage threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cpu_backend.h"
#include "engine/pipeline/local_pipeline.h"
#include "engine/pipeline/stage_plan.h"
#include "engine/pipeline/stage_transport.h"

namespace ts::pipeline {

// The leader's CpuForward: stage 0 in this process, the other stages behind the transport.
class RingForward final : public CpuForward {
 public:
  // `config`: the whole model's (stage 0's CpuModel reports it). `timeout` bounds the wait for
  // each micro-batch's result and the shutdown's round trip.
  RingForward(ModelConfig config, std::unique_ptr<StageRunner> first,
              std::unique_ptr<StageTransport> transport, int32_t micro_batches,
              std::chrono::milliseconds timeout);
  ~RingForward() override;  // Shutdown(), if it has not run

  const ModelConfig& config() const override { return config_; }
  // As LocalPipeline::Forward. A stage's error fails this call only; a transport failure (a peer
  // gone, a result that does not come within the timeout) breaks the ring for good, and every
  // later call fails at once with it.
  absl::Status Forward(std::span<const SeqChunk> chunks, LogitsMode mode,
                       std::vector<float>* logits) override;
  // Sends the shutdown round the ring and waits for it to come back: every rank has then seen it
  // and exits 0. Idempotent; Forward fails after it.
  absl::Status Shutdown();
  // OK while the ring works; else why not (thread-safe, for the server's health loop).
  absl::Status health() const;

 private:
  absl::Status Break(absl::Status s);

  ModelConfig config_;
  std::unique_ptr<StageRunner> first_;
  std::unique_ptr<StageTransport> transport_;
  const int32_t micro_batches_;
  const std::chrono::milliseconds timeout_;
  uint64_t next_id_ = 0;  // the calling thread's
  mutable std::mutex mu_;
  absl::Status broken_;  // guarded by mu_
  bool shut_down_ = false;
};

// A worker's whole life: runs `stage` on every micro-batch from its predecessor and passes the
// result on, until the leader's shutdown has passed through (OK) or a link fails (its error).
absl::Status ServeStage(StageTransport& transport, StageRunner& stage);

// What every rank must agree on for the ring to compute the whole model: the shapes and the
// split (TcpTransportOptions::check).
std::string PlanCheck(const ModelConfig& config, const std::vector<StagePlan>& plan);

// One rank of a multi-process CPU pipeline, as `tailserve --world_size N --rank r` starts it.
struct RankOptions {
  std::filesystem::path model_dir;
  int32_t rank = 0;
  int32_t world_size = 2;
  std::string leader_host = "127.0.0.1";
  int32_t leader_port = 0;                   // rank 0: 0 picks one (on_listening)
  std::chrono::milliseconds timeout{60000};  // startup, each result, the shutdown
  int threads = 1;                           // CpuModelOptions::num_threads for this stage
  std::function<void(int32_t port)> on_listening;
  // Where the startup log goes (the plan, who connected); null: nowhere.
  std::function<void(const std::string& line)> log;
};

// Rank 0: loads stage 0, waits for every other rank, and returns the forward the CPU backend runs
// over. The leader decides the KV pool (`num_kv_blocks` of `block_size` tokens) and hands it to
// the workers, so only its flags size it. `micro_batches` >= 1.
absl::StatusOr<std::unique_ptr<RingForward>> ConnectLeader(const RankOptions& options,
                                                           int32_t num_kv_blocks,
                                                           int32_t block_size,
                                                           int32_t micro_batches);

// Ranks 1..N-1: loads this rank's stage, joins the ring and serves it (ServeStage); OK when the
// leader shut down cleanly.
absl::Status RunWorker(const RankOptions& options);

}  // namespace ts::pipeline
