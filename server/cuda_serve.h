// The `tailserve` binary's CUDA backend, built from what its flags ask (server/main.cc fills the
// struct): one GPU, or a pipeline of --pipeline_stages over --pipeline_devices (docs/pipeline.md,
// The CUDA pipeline). Only in a build with CUDA.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
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
  int32_t pipeline_stages = 1;
  std::string pipeline_devices;  // comma-separated, one per stage; empty: 0..stages-1
  std::chrono::milliseconds pipeline_timeout{60000};
};

// Errors name the flag ("--pipeline_devices: ...", "--backend cuda: ..."). Prints a pipeline's
// plan.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const ModelConfig& config,
                                                         const CudaServeFlags& flags);

}  // namespace ts::server
