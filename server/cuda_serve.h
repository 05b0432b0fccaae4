// The `tailserve` binary's CUDA backend, built from what its flags ask (server/main.cc fills the
// struct): one GPU, or a pipeline of --pipeline_stages over --pipeline_devices (docs/pipeline.md,
// The CUDA pipeline). Only in a build with CUDA.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "models/config.h"

namespace ts::server {

struct CudaServeFlags {
  std::filesystem::path model_dir;
  std::vector<int32_t> buckets;  // the largest is the slot count
  int32_t max_context = 0;
  int32_t kv_block_size = 16;
  bool device_loop = false;
  double gpu_memory_fraction = 0.9;
  int device = 0;
  int32_t prefill_step_tokens = 256;
  int32_t prefill_catchup_tokens = 384;
  std::chrono::milliseconds prefill_catchup_after{0};
  int32_t pipeline_stages = 1;
  std::string pipeline_devices;  // comma-separated, one per stage; empty: 0..stages-1
  std::chrono::milliseconds pipeline_timeout{60000};
  // A pipeline across processes (--world_size > 1): one stage per process on --device, rank 0
  // the leader (docs/pipeline.md, Across processes).
  int32_t rank = 0;
  int32_t world_size = 1;
  std::string leader_host;
  int32_t leader_port = 0;
};

// Errors name the flag ("--pipeline_devices: ...", "--backend cuda: ..."). Prints a pipeline's
// plan. Rank 0 of a pipeline across processes sets *pipeline_health to its links' health (the
// backend owns them).
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(
    const ModelConfig& config, const CudaServeFlags& flags,
    std::function<absl::Status()>* pipeline_health);

// Ranks 1..world_size - 1: this rank's stage until the leader shuts the pipeline down (OK) or a
// link or the stage fails.
absl::Status RunCudaWorkerFromFlags(const CudaServeFlags& flags);

}  // namespace ts::server
