#include "server/cuda_serve.h"

#include <cstdio>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_ranks.h"
#include "models/config.h"

namespace ts::server {
namespace {

// The CUDA pipeline's stages (docs/pipeline.md, The CUDA pipeline): the plan by bf16 weight bytes,
// each stage on its --pipeline_devices entry. Prints the plan.
absl::StatusOr<std::vector<CudaStageOptions>> CudaStages(const ModelConfig& config,
                                                         const CudaServeFlags& f) {
  const int32_t stages = f.pipeline_stages;
  if (stages == 1) return std::vector<CudaStageOptions>{};
  std::vector<int> devices;
  const std::string& list = f.pipeline_devices;
  if (list.empty()) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
    if (count < stages) {
      return absl::InvalidArgumentError(
          absl::StrCat("--pipeline_stages: ", stages, " stages need ", stages, " GPUs; ", count,
                       " are visible (--pipeline_devices puts several stages on one GPU)"));
    }
    for (int d = 0; d < stages; ++d) devices.push_back(d);
  } else {
    for (absl::string_view item : absl::StrSplit(list, ',')) {
      int d = 0;
      if (!absl::SimpleAtoi(item, &d) || d < 0 || d > 1024) {
        return absl::InvalidArgumentError(
            absl::StrCat("--pipeline_devices: '", item, "' is not a device ordinal"));
      }
      devices.push_back(d);
    }
    if (static_cast<int32_t>(devices.size()) != stages) {
      return absl::InvalidArgumentError(absl::StrCat("--pipeline_devices: ", devices.size(),
                                                     " devices for --pipeline_stages ", stages));
    }
  }
  std::string plan;
  TS_ASSIGN_OR_RETURN(std::vector<CudaStageOptions> out,
                      PlanCudaStages(config, devices, f.kv_block_size, &plan));
  std::printf("tailserve: CUDA pipeline of %d stages on devices %s (bf16)\n%s", stages,
              absl::StrJoin(devices, ",").c_str(), plan.c_str());
  return out;
}

CudaBackendOptions OptionsFor(const CudaServeFlags& f, std::vector<CudaStageOptions> stages) {
  return CudaBackendOptions{.model_dir = f.model_dir,
                            .max_slots = f.buckets.back(),
                            .kv_block_size = f.kv_block_size,
                            .gpu_memory_fraction = f.gpu_memory_fraction,
                            .buckets = f.buckets,
                            .max_context = f.max_context,
                            .device = f.device,
                            .prefill_step_tokens = f.prefill_step_tokens,
                            .prefill_catchup_tokens = f.prefill_catchup_tokens,
                            .prefill_catchup_after = f.prefill_catchup_after,
                            .device_loop = f.device_loop,
                            .stages = std::move(stages),
                            .link_timeout = f.pipeline_timeout,
                            .ranks = CudaRankOptions{.rank = f.rank,
                                                     .world_size = f.world_size,
                                                     .leader_host = f.leader_host,
                                                     .leader_port = f.leader_port,
                                                     .on_listening = {},
                                                     .log = [](const std::string& line) {
                                                       std::printf("tailserve: %s\n", line.c_str());
                                                       std::fflush(stdout);
                                                     }}};
}

// Every rank of a pipeline, in one process or several, refuses the device loop the same way.
absl::Status HostDrivenOnly(const CudaServeFlags& f) {
  if (!f.device_loop) return absl::OkStatus();
  return absl::InvalidArgumentError(
      "--decode_loop: a CUDA pipeline runs host-driven steps (NCCL's work cannot be launched "
      "from the device loop's graphs, docs/pipeline.md); use --decode_loop host or auto");
}

absl::Status Named(const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat("--backend cuda: ", s.message()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(
    const ModelConfig& config, const CudaServeFlags& f,
    std::function<absl::Status()>* pipeline_health) {
  if (f.pipeline_stages > 1 || f.world_size > 1) TS_RETURN_IF_ERROR(HostDrivenOnly(f));
  std::vector<CudaStageOptions> stage_options;
  if (f.world_size <= 1) {
    TS_ASSIGN_OR_RETURN(stage_options, CudaStages(config, f));
  } else {
    std::string plan;
    const std::vector<int> devices(f.world_size, f.device);
    TS_RETURN_IF_ERROR(PlanCudaStages(config, devices, f.kv_block_size, &plan).status());
    std::printf(
        "tailserve: CUDA pipeline of %d processes, one stage each; rank 0 holds the last "
        "(bf16)\n%s",
        f.world_size, plan.c_str());
  }
  // The CUDA backend sizes its KV pool from --gpu_memory_fraction and prints its own budget.
  absl::StatusOr<std::unique_ptr<CudaBackend>> backend =
      CudaBackend::Create(OptionsFor(f, std::move(stage_options)));
  if (!backend.ok()) return Named(backend.status());
  if (f.world_size > 1) {
    CudaBackend* b = backend->get();
    *pipeline_health = [b] { return b->pipeline_health(); };
  }
  return std::unique_ptr<Backend>(*std::move(backend));
}

absl::Status RunCudaWorkerFromFlags(const CudaServeFlags& flags) {
  TS_RETURN_IF_ERROR(HostDrivenOnly(flags));
  CudaServeFlags f = flags;
  if (f.max_context <= 0) {
    // As rank 0 resolves it, so the ranks' checks agree.
    TS_ASSIGN_OR_RETURN(const ModelConfig config, LoadModelConfig(f.model_dir));
    f.max_context = config.max_position_embeddings;
  }
  const absl::Status s = RunCudaWorker(OptionsFor(f, {}));
  return s.ok() ? s : Named(s);
}

}  // namespace ts::server
