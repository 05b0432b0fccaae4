// tailserve: the gRPC server binary. Loads a model, starts the engine and serves
// tailserve.v1.Generation until SIGTERM/SIGINT, then drains (docs/serving.md).
#include <signal.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "engine/cpu_backend.h"
#if defined(TAILSERVE_WITH_CUDA)
#include "server/cuda_serve.h"
#include "server/watchdog.h"
#endif
#include "common/flags.h"
#include "engine/engine.h"
#include "engine/pipeline/pipeline_forward.h"
#include "engine/pipeline/ring_pipeline.h"
#include "engine/pipeline/stage_plan.h"
#include "engine/pipeline/topology.h"
#include "models/config.h"
#include "models/tokenizer/tokenizer.h"
#include "server/debug_backend.h"
#include "server/server.h"

ABSL_FLAG(std::string, host, "127.0.0.1", "Address to listen on (0.0.0.0 or :: for all).");
// The clients' default target is 127.0.0.1:50051 (tailserve-client, tailserve-load).
ABSL_FLAG(int32_t, port, 50051, "Port to listen on; 0 picks a free port (printed at startup).");
ABSL_FLAG(std::string, model_dir, "",
          "Hugging Face checkpoint directory (config.json, *.safetensors).");
ABSL_FLAG(std::string, tokenizer_dir, "",
          "Where tokenizer.json (or tokenizer.model) and tokenizer_config.json are; default: "
          "model_dir. Without one the server takes token ids only; \"none\" turns it off.");
ABSL_FLAG(std::string, model_name, "",
          "Name reported by GetModelInfo; default: model_dir's basename.");
ABSL_FLAG(std::string, backend, "cpu", "Decoder backend: cpu (fp32 reference) or cuda.");
ABSL_FLAG(int32_t, max_batch, 16, "Concurrent decoding requests.");
ABSL_FLAG(int32_t, pipeline_stages, 1,
          "Split the layers into this many pipeline stages (docs/pipeline.md), balanced by weight "
          "bytes; the plan is printed at startup. CPU backend: stage threads over one process, "
          "micro-batches in flight. CUDA backend: one GPU per stage (--pipeline_devices), NCCL "
          "between them, host-driven steps.");
ABSL_FLAG(std::string, pipeline_devices, "",
          "CUDA pipeline: the device of each stage, comma-separated (e.g. 0,1); default "
          "0..N-1. Stages that share a GPU pass their buffers by device copies instead of NCCL.");
// The multi-process pipeline (docs/pipeline.md, Processes): unset, each comes from TS_* or LWS_*.
ABSL_FLAG(int32_t, rank, -1,
          "This process's rank in a multi-process pipeline: 0 is the leader (scheduler, gRPC; "
          "stage 0 on cpu, the last stage on cuda), the others each run one stage and serve no "
          "port. Default: TS_RANK, LWS_WORKER_INDEX, else 0.");
ABSL_FLAG(int32_t, world_size, 0,
          "Processes in the pipeline, one stage each (cuda: on each rank's --device, NCCL "
          "between them). Default: TS_WORLD_SIZE, LWS_GROUP_SIZE, else 1 (a single process).");
ABSL_FLAG(std::string, leader_address, "",
          "host[:port] where rank 0 meets the others (port 29500 by default); rank 0 listens "
          "there. Default: TS_LEADER_ADDRESS, LWS_LEADER_ADDRESS.");
ABSL_FLAG(int32_t, pipeline_timeout_ms, 60000,
          "Multi-process pipeline: how long startup waits for every rank (a missing one fails it, "
          "named), and how long a step's result, a send or the shutdown may take before the "
          "pipeline counts as broken. CUDA pipeline: the same bound on NCCL's setup, its calls "
          "and each step's wait.");
ABSL_FLAG(std::string, decode_loop, "auto",
          "Who runs the decode steps: loop (the backend's own loop beside the engine thread; CUDA: "
          "the device-resident loop, no host call between steps, new prompts prefilled in mixed "
          "steps of --prefill_step_tokens rows; CPU: a loop thread), host (host-driven: the "
          "engine thread runs each step and waits for it; "
          "the baseline and fallback), auto (loop on cuda, host on cpu).");
ABSL_FLAG(int32_t, prefill_step_tokens, 256,
          "CUDA device loop: the rows of a mixed step, decode and prompt, while prompts wait "
          "beside decoding streams (a larger value: shorter time to first token, longer token "
          "intervals while prompts arrive; docs/device-loop.md).");
ABSL_FLAG(int32_t, prefill_catchup_ms, 0,
          "CUDA device loop: once a prompt has waited this long behind the prompts ahead of it, "
          "mixed steps hold --prefill_catchup_tokens rows until that backlog is through: a burst's "
          "first tokens come sooner, the streams' token intervals during it are longer; a lone "
          "prompt never triggers it. 0: off (docs/device-loop.md, Catching up after a burst).");
ABSL_FLAG(int32_t, prefill_catchup_tokens, 384,
          "CUDA device loop: the rows of a mixed step while prompts catch up "
          "(--prefill_catchup_ms); a value at or below --prefill_step_tokens changes nothing.");
ABSL_FLAG(std::string, buckets, "",
          "Comma list of batch-size buckets, ascending; default: 1,2,4,8,16,24,32,48,64,96,128 "
          "below max_batch, then max_batch.");
ABSL_FLAG(int32_t, queue_limit, 256,
          "Queued requests beyond which Generate is RESOURCE_EXHAUSTED.");
ABSL_FLAG(int32_t, max_context, 0, "Prompt + new tokens per request; 0 = the model's maximum.");
ABSL_FLAG(int32_t, kv_blocks, 0, "KV pool size in blocks; 0 = max_batch full-length sequences.");
ABSL_FLAG(int32_t, kv_block_size, 16, "Tokens per KV block.");
ABSL_FLAG(double, cpu_kv_gib, 8.0,
          "CPU backend: memory for the fp32 KV pool. Without --kv_blocks the pool is max_batch "
          "full-length sequences or what this holds, whichever is less; a max_context above the "
          "pool's tokens is lowered to them (both printed at startup).");
ABSL_FLAG(int32_t, drain_timeout_s, 30,
          "On SIGTERM/SIGINT, how long open and queued requests may take to finish. Streams still "
          "open when it runs out are cut with UNAVAILABLE and tailserve exits 3 (0 when all "
          "finished); a second signal cuts them at once and exits 128+signal.");
ABSL_FLAG(int32_t, stream_buffer_tokens, 4096,
          "Unread tokens per stream before a slow reader's request is cancelled.");
ABSL_FLAG(int32_t, threads, 0, "CPU backend threads; 0 = all hardware threads.");
ABSL_FLAG(double, gpu_memory_fraction, 0.9,
          "CUDA backend: fraction of device memory for weights, KV pool, activations and graphs.");
ABSL_FLAG(int32_t, device, 0,
          "CUDA backend: device ordinal (with --world_size, this rank's GPU; a one-process "
          "pipeline uses --pipeline_devices instead).");
ABSL_FLAG(int32_t, stats_interval_s, 60, "Log a one-line stats summary this often; 0 = off.");
ABSL_FLAG(int32_t, watchdog_s, 30,
          "Report NOT_SERVING while requests wait and the engine completes nothing (no decode "
          "step, no prefill's first token, no finished request) for this long; keep it above the "
          "longest single prefill. 0 = off.");
ABSL_FLAG(int32_t, debug_step_delay_ms, 0,
          "Testing only: sleep this long before every decode step (simulates a slow device).");
ABSL_FLAG(int32_t, debug_prefill_delay_ms, 0,
          "Testing only: sleep this long before every prefill (simulates long prompts).");
ABSL_FLAG(int64_t, debug_fail_step, 0,
          "Testing only: decode step N and every later one fail with INTERNAL (simulates a sticky "
          "device error); 0 = never.");
ABSL_FLAG(int32_t, debug_generate_delay_ms, 0,
          "Testing only: Generate sleeps this long before it looks at a request (simulates a "
          "request that reaches the server after its deadline).");
ABSL_FLAG(std::string, debug_gate_file, "",
          "Testing only: the gated calls (--debug_gate_step, --debug_gate_prefill) wait until "
          "this file exists (simulates a hung device, released at a moment the test chooses).");
ABSL_FLAG(int64_t, debug_gate_step, 0,
          "Testing only: decode step N and every later one wait for --debug_gate_file; 0 = none.");
ABSL_FLAG(bool, debug_gate_prefill, false,
          "Testing only: every prefill waits for --debug_gate_file.");

namespace ts::server {
namespace {

using Clock = std::chrono::steady_clock;

absl::StatusOr<std::vector<int32_t>> ParseBuckets(const std::string& text, int32_t max_batch) {
  std::vector<int32_t> buckets;
  if (text.empty()) {
    // The engine's list (1, 2, 4, 8, 16, 24, 32, 48, ...): steps of at most 1.5x above 16 pad a
    // batch by at most a third, where powers of two pad by up to half.
    for (int32_t b : EngineOptions{}.buckets) {
      if (b < max_batch) buckets.push_back(b);
    }
    buckets.push_back(max_batch);
    return buckets;
  }
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int32_t b = 0;
    if (!absl::SimpleAtoi(part, &b) || b < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--buckets: '", part, "' is not a positive integer"));
    }
    buckets.push_back(b);
  }
  if (buckets.empty()) return absl::InvalidArgumentError("--buckets: empty list");
  TS_RETURN_IF_ERROR(ValidateBuckets(buckets));
  if (buckets.back() < max_batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("--buckets: the largest bucket (", buckets.back(),
                     ") is smaller than --max_batch (", max_batch, ")"));
  }
  return buckets;
}

struct Loaded {
  std::unique_ptr<Engine> engine;
  // Rank 0 of a multi-process pipeline: the links to the other ranks (their owner is the
  // engine's backend); else null.
  std::function<absl::Status()> pipeline_health;
  std::unique_ptr<Tokenizer> tokenizer;  // null: the model has none
  std::string model_name;
};

// The tokenizer beside the checkpoint (or in --tokenizer_dir), or null when there is none. A file
// that is there but cannot be read stops the server: serving ids only would hide the mistake.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::string& model_dir,
                                                         int32_t vocab_size) {
  std::string dir = absl::GetFlag(FLAGS_tokenizer_dir);
  if (dir == "none") return nullptr;
  const bool explicit_dir = !dir.empty();
  if (!explicit_dir) dir = model_dir;
  const std::filesystem::path d(dir);
  if (!std::filesystem::exists(d / "tokenizer.json") &&
      !std::filesystem::exists(d / "tokenizer.model")) {
    if (explicit_dir) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tokenizer_dir: no tokenizer.json or tokenizer.model in ", dir));
    }
    std::printf("tailserve: no tokenizer in %s: requests must send token ids\n", dir.c_str());
    return nullptr;
  }
  absl::StatusOr<Tokenizer> tok = Tokenizer::Load(dir);
  if (!tok.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer in ", dir, ": ", tok.status().message()));
  }
  if (tok->vocab_size() > vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tokenizer in ", dir, ": its ", tok->vocab_size(), " tokens exceed the model's vocab_size ",
        vocab_size, " (is it the checkpoint's own tokenizer?)"));
  }
  std::printf("tailserve: tokenizer from %s: %d tokens\n", dir.c_str(), tok->vocab_size());
  return std::make_unique<Tokenizer>(*std::move(tok));
}

void LogLine(const std::string& line) {
  std::printf("tailserve: %s\n", line.c_str());
  std::fflush(stdout);
}

pipeline::RankOptions RankOptionsFor(const pipeline::Topology& t, int threads) {
  return pipeline::RankOptions{
      .model_dir = absl::GetFlag(FLAGS_model_dir),
      .rank = t.rank,
      .world_size = t.world_size,
      .leader_host = t.leader_host,
      .leader_port = t.leader_port,
      .timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_pipeline_timeout_ms)),
      .threads = threads,
      .on_listening = {},
      .log = LogLine};
}

// Rank 0 of a multi-process pipeline: stage 0 here, the CPU backend over the ring. It decides the
// KV pool and hands it to the workers. *ring stays valid while the backend lives.
absl::StatusOr<std::unique_ptr<Backend>> MakeRankZeroBackend(const pipeline::Topology& topology,
                                                             const CpuBackendOptions& options,
                                                             int threads,
                                                             pipeline::RingForward** ring) {
  // One micro-batch per stage keeps every rank busy within a step, as with stage threads.
  TS_ASSIGN_OR_RETURN(
      std::unique_ptr<pipeline::RingForward> forward,
      pipeline::ConnectLeader(RankOptionsFor(topology, threads), options.num_kv_blocks,
                              options.kv_block_size, topology.world_size));
  *ring = forward.get();
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CpuBackend> backend,
                      CpuBackend::Create(std::move(forward), options));
  return std::unique_ptr<Backend>(std::move(backend));
}

// The fp32 KV pool of the CPU backend. A real checkpoint's context (128K for Llama-3.1) times
// max_batch would ask for terabytes, so without --kv_blocks the pool is capped by --cpu_kv_gib and
// *context is lowered to what the pool holds; the startup log says which limit applied.
absl::StatusOr<std::unique_ptr<Backend>> MakeCpuBackend(const ModelConfig& config,
                                                        const std::vector<int32_t>& buckets,
                                                        int32_t* context, int32_t block,
                                                        int32_t max_batch, bool loop,
                                                        const pipeline::Topology& topology,
                                                        pipeline::RingForward** ring) {
  const double gib = absl::GetFlag(FLAGS_cpu_kv_gib);
  if (!(gib > 0) || gib > 1 << 20) {
    return absl::InvalidArgumentError(absl::StrCat("--cpu_kv_gib: ", gib, " is outside (0, 2^20]"));
  }
  const int64_t budget = static_cast<int64_t>(gib * (int64_t{1} << 30));
  const int64_t bytes_per_block = int64_t{2} * config.num_layers * config.num_kv_heads *
                                  config.head_dim * static_cast<int64_t>(sizeof(float)) * block;
  const int64_t fit = budget / bytes_per_block;
  int64_t blocks = absl::GetFlag(FLAGS_kv_blocks);
  if (blocks > 0) {
    if (blocks > fit) {
      return absl::InvalidArgumentError(
          absl::StrCat("--kv_blocks: ", blocks, " blocks of ", block, " tokens need ",
                       blocks * bytes_per_block >> 20, " MiB of fp32 KV, above --cpu_kv_gib ", gib,
                       " (", fit, " blocks fit)"));
    }
  } else {
    const int64_t want = int64_t{max_batch} * ((*context + block - 1) / block);
    blocks = std::min(want, fit);
    if (blocks < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--cpu_kv_gib: ", gib, " GiB hold no KV block of ", bytes_per_block, " bytes"));
    }
    if (blocks < want) {
      std::printf(
          "tailserve: KV pool capped by --cpu_kv_gib %g: %lld blocks (%lld tokens), shared by "
          "up to --max_batch %d sequences (%d full-length ones would need %.1f GiB)\n",
          gib, static_cast<long long>(blocks), static_cast<long long>(blocks * block), max_batch,
          max_batch, static_cast<double>(want * bytes_per_block) / (int64_t{1} << 30));
    }
  }
  if (blocks * block < *context) {
    if (absl::GetFlag(FLAGS_max_context) > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--max_context: ", *context, " tokens do not fit the KV pool of ", blocks * block,
          " tokens; raise --kv_blocks or --cpu_kv_gib, or lower --max_context"));
    }
    std::printf(
        "tailserve: max_context lowered from the model's %d to the KV pool's %lld tokens "
        "(--max_context, --cpu_kv_gib)\n",
        *context, static_cast<long long>(blocks * block));
    *context = static_cast<int32_t>(blocks * block);
  }
  int32_t threads = absl::GetFlag(FLAGS_threads);
  if (threads <= 0) threads = std::max(1u, std::thread::hardware_concurrency());
  CpuBackendOptions options{.model_dir = absl::GetFlag(FLAGS_model_dir),
                            .max_slots = buckets.back(),
                            .num_kv_blocks = static_cast<int32_t>(blocks),
                            .kv_block_size = block,
                            .buckets = buckets,
                            .num_threads = threads,
                            .max_kv_bytes = budget,
                            .loop_thread = loop};
  if (topology.world_size > 1) {
    return MakeRankZeroBackend(topology, options, threads, ring);
  }
  const int32_t stages = absl::GetFlag(FLAGS_pipeline_stages);
  if (stages == 1) return CreateCpuBackend(options);
  TS_ASSIGN_OR_RETURN(
      const std::vector<pipeline::StagePlan> plan,
      pipeline::PlanStages(config,
                           {.num_stages = stages, .bytes_per_weight = 4, .bytes_per_kv = 4}));
  std::printf(
      "tailserve: pipeline of %d stages (fp32, a thread group each; every stage holds the %d KV "
      "blocks for its own layers)\n%s",
      stages, options.num_kv_blocks, pipeline::DescribePlan(plan, 0, block).c_str());
  // The threads are the stages' to share; each stage's micro-batch runs on its own.
  TS_ASSIGN_OR_RETURN(
      std::unique_ptr<pipeline::PipelineForward> forward,
      pipeline::PipelineForward::Load(options.model_dir, plan, options.num_kv_blocks, block, stages,
                                      std::max(1, threads / stages)));
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CpuBackend> backend,
                      CpuBackend::Create(std::move(forward), options));
  return std::unique_ptr<Backend>(std::move(backend));
}

// The CUDA backend's flags; `topology` places this process in a multi-process pipeline.
CudaServeFlags CudaFlags(const std::vector<int32_t>& buckets, int32_t context, int32_t block,
                         bool device_loop, const pipeline::Topology& topology) {
  return CudaServeFlags{
      .model_dir = absl::GetFlag(FLAGS_model_dir),
      .buckets = buckets,
      .max_context = context,
      .kv_block_size = block,
      .device_loop = device_loop,
      .gpu_memory_fraction = absl::GetFlag(FLAGS_gpu_memory_fraction),
      .device = absl::GetFlag(FLAGS_device),
      .prefill_step_tokens = absl::GetFlag(FLAGS_prefill_step_tokens),
      .prefill_catchup_tokens = absl::GetFlag(FLAGS_prefill_catchup_tokens),
      .prefill_catchup_after = std::chrono::milliseconds(absl::GetFlag(FLAGS_prefill_catchup_ms)),
      .pipeline_stages = absl::GetFlag(FLAGS_pipeline_stages),
      .pipeline_devices = absl::GetFlag(FLAGS_pipeline_devices),
      .pipeline_timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_pipeline_timeout_ms)),
      .rank = topology.rank,
      .world_size = topology.world_size,
      .leader_host = topology.leader_host,
      .leader_port = topology.leader_port};
}

absl::StatusOr<std::unique_ptr<Backend>> CudaBackendFromFlags(
    const ModelConfig& config, const CudaServeFlags& flags,
    std::function<absl::Status()>* pipeline_health) {
#if defined(TAILSERVE_WITH_CUDA)
  return MakeCudaBackend(config, flags, pipeline_health);
#else
  (void)config, (void)flags, (void)pipeline_health;
  return absl::UnimplementedError(
      "--backend cuda: this tailserve was built without the CUDA backend; use --backend cpu");
#endif
}

// Whether the backend's own loop decodes (--decode_loop), after checking --backend.
absl::StatusOr<bool> DecodeLoop(const pipeline::Topology& topology) {
  const std::string kind = absl::GetFlag(FLAGS_backend);
  if (kind != "cpu" && kind != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat("--backend: unknown '", kind, "' (cpu|cuda)"));
  }
  const std::string mode = absl::GetFlag(FLAGS_decode_loop);
  // A CUDA pipeline is host-driven (server/cuda_serve.cc).
  if (mode == "auto") {
    return kind == "cuda" && absl::GetFlag(FLAGS_pipeline_stages) == 1 && topology.world_size <= 1;
  }
  if (mode == "host") return false;
  if (mode != "loop") {
    return absl::InvalidArgumentError(
        absl::StrCat("--decode_loop: unknown '", mode, "' (loop|host|auto)"));
  }
  return true;
}

// *context: the max_context the engine is to use (the backend may lower the model's).
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const ModelConfig& config,
                                                     const std::vector<int32_t>& buckets, bool loop,
                                                     const pipeline::Topology& topology,
                                                     int32_t* max_context,
                                                     std::function<absl::Status()>* health) {
  const std::string kind = absl::GetFlag(FLAGS_backend);
  const int32_t max_batch = absl::GetFlag(FLAGS_max_batch);
  const int32_t block = absl::GetFlag(FLAGS_kv_block_size);
  if (block < 1) return absl::InvalidArgumentError("--kv_block_size: must be >= 1");
  int32_t context = absl::GetFlag(FLAGS_max_context);
  if (context <= 0) context = config.max_position_embeddings;
  const int32_t stages = absl::GetFlag(FLAGS_pipeline_stages);
  if (stages < 1 || stages > config.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("--pipeline_stages: ", stages,
                                                   " must be in [1, the model's ",
                                                   config.num_layers, " layers]"));
  }
  if (topology.world_size > 1 && stages != 1 && stages != topology.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--pipeline_stages: ", stages, " with --world_size ", topology.world_size,
        ": a multi-process pipeline has one stage per process; leave --pipeline_stages at 1"));
  }
  if (!absl::GetFlag(FLAGS_pipeline_devices).empty() && (kind != "cuda" || stages == 1)) {
    return absl::InvalidArgumentError(
        "--pipeline_devices: only for a CUDA pipeline (--backend cuda --pipeline_stages > 1)");
  }
  if (kind == "cuda" && stages > 1 && absl::GetFlag(FLAGS_device) != 0) {
    return absl::InvalidArgumentError(
        "--device: a CUDA pipeline puts its stages on --pipeline_devices; leave --device at 0");
  }
  std::unique_ptr<Backend> backend;
  if (kind == "cuda") {
    TS_ASSIGN_OR_RETURN(
        backend,
        CudaBackendFromFlags(config, CudaFlags(buckets, context, block, loop, topology), health));
    // 0: whatever the backend's memory plan settled on.
    *max_context = absl::GetFlag(FLAGS_max_context);
  } else {
    pipeline::RingForward* ring = nullptr;
    TS_ASSIGN_OR_RETURN(backend, MakeCpuBackend(config, buckets, &context, block, max_batch, loop,
                                                topology, &ring));
    if (ring != nullptr) *health = [ring] { return ring->health(); };
    *max_context = context;
  }
  DebugBackendOptions debug{
      .step_delay = std::chrono::milliseconds(absl::GetFlag(FLAGS_debug_step_delay_ms)),
      .prefill_delay = std::chrono::milliseconds(absl::GetFlag(FLAGS_debug_prefill_delay_ms)),
      .fail_step = absl::GetFlag(FLAGS_debug_fail_step),
      .gate_file = absl::GetFlag(FLAGS_debug_gate_file),
      .gate_step = absl::GetFlag(FLAGS_debug_gate_step),
      .gate_prefill = absl::GetFlag(FLAGS_debug_gate_prefill)};
  const bool gated = debug.gate_step > 0 || debug.gate_prefill;
  if (gated && debug.gate_file.empty()) {
    return absl::InvalidArgumentError(
        "--debug_gate_step/--debug_gate_prefill: need --debug_gate_file");
  }
  // They act on Run calls, which are decode steps only when the engine thread runs each one.
  if (loop && (debug.step_delay.count() > 0 || debug.fail_step > 0 || debug.gate_step > 0)) {
    return absl::InvalidArgumentError(
        "--debug_step_delay_ms/--debug_fail_step/--debug_gate_step: host-driven steps only; add "
        "--decode_loop host");
  }
  if (debug.step_delay.count() > 0 || debug.prefill_delay.count() > 0 || debug.fail_step > 0 ||
      gated) {
    backend = std::make_unique<DebugBackend>(std::move(backend), std::move(debug));
  }
  return backend;
}

// Parameter count of a Llama-family model, for the startup budget line.
int64_t CountParams(const ModelConfig& c) {
  const int64_t h = c.hidden_size, q = int64_t{c.num_heads} * c.head_dim,
                kv = int64_t{c.num_kv_heads} * c.head_dim;
  const int64_t per_layer = h * (q + 2 * kv) + q * h + 3 * h * c.intermediate_size + 2 * h;
  const int64_t embed = int64_t{c.vocab_size} * h;
  return embed + c.num_layers * per_layer + h + (c.tie_word_embeddings ? 0 : embed);
}

void PrintBudget(const BackendInfo& info, const ModelInfo& model) {
  const ModelConfig& c = info.model;
  const double mib = 1024.0 * 1024.0;
  // The CPU backend computes in fp32: 4 bytes per weight and per cached K/V element.
  const int64_t weight_bytes = CountParams(c) * 4;
  const int64_t kv_bytes_per_token = int64_t{2} * c.num_layers * c.num_kv_heads * c.head_dim * 4;
  const int64_t kv_tokens = int64_t{info.num_kv_blocks} * info.kv_block_size;
  std::printf(
      "tailserve budget: backend %s, weights %.1f MiB (fp32), KV %d blocks x %d tokens = %lld "
      "tokens (%.1f MiB), max_batch %d, max_context %d, ring %u entries/slot\n",
      info.name, weight_bytes / mib, info.num_kv_blocks, info.kv_block_size,
      static_cast<long long>(kv_tokens), kv_tokens * kv_bytes_per_token / mib, model.max_batch,
      model.max_context, info.ring_capacity);
}

absl::StatusOr<Loaded> Load(const pipeline::Topology& topology) {
  const std::string dir = absl::GetFlag(FLAGS_model_dir);
  if (dir.empty()) return absl::InvalidArgumentError("--model_dir: required");
  TS_ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
  Loaded out;
  TS_ASSIGN_OR_RETURN(out.tokenizer, LoadTokenizer(dir, config.vocab_size));
  const int32_t max_batch = absl::GetFlag(FLAGS_max_batch);
  if (max_batch < 1) return absl::InvalidArgumentError("--max_batch: must be >= 1");
  TS_ASSIGN_OR_RETURN(std::vector<int32_t> buckets,
                      ParseBuckets(absl::GetFlag(FLAGS_buckets), max_batch));
  int32_t max_context = 0;
  TS_ASSIGN_OR_RETURN(const bool loop, DecodeLoop(topology));
  TS_ASSIGN_OR_RETURN(
      std::unique_ptr<Backend> backend,
      MakeBackend(config, buckets, loop, topology, &max_context, &out.pipeline_health));
  const BackendInfo info = backend->info();
  EngineOptions options{.max_batch = max_batch,
                        .buckets = buckets,
                        .queue_limit = absl::GetFlag(FLAGS_queue_limit),
                        .max_context = max_context,
                        .stream_buffer_tokens = absl::GetFlag(FLAGS_stream_buffer_tokens),
                        .run_mode = loop ? RunMode::kLoop : RunMode::kOneStep};
  TS_ASSIGN_OR_RETURN(out.engine, Engine::Create(std::move(options), std::move(backend)));
  // The CUDA backend prints its own, measured budget while it allocates.
  if (absl::GetFlag(FLAGS_backend) == "cpu") PrintBudget(info, out.engine->model_info());
  out.model_name = absl::GetFlag(FLAGS_model_name);
  if (out.model_name.empty()) {
    out.model_name = std::filesystem::path(dir).lexically_normal().filename().string();
    if (out.model_name.empty()) {
      out.model_name = std::filesystem::path(dir).lexically_normal().parent_path().filename();
    }
  }
  return out;
}

void LogStats(TailServer& server, Engine& engine, const char* prefix) {
  const EngineStats s = engine.stats();
  std::fprintf(stderr,
               "%s: queued %d running %d streams %d kv_free %d/%d steps %llu (mixed %llu) tokens "
               "%llu finished %llu loop_launches %llu regime_changes %llu on device, %llu by "
               "exit\n",
               prefix, s.queued, s.running, server.service().active_streams(), s.kv_blocks_free,
               s.kv_blocks_total, static_cast<unsigned long long>(s.steps),
               static_cast<unsigned long long>(s.mixed_steps),
               static_cast<unsigned long long>(s.tokens_generated),
               static_cast<unsigned long long>(s.requests_finished),
               static_cast<unsigned long long>(s.loop_launches),
               static_cast<unsigned long long>(s.regime_changes_on_device),
               static_cast<unsigned long long>(s.regime_changes_by_exit));
}

// Waits up to `timeout` for one of the signals in `set`; returns it, or 0 on timeout.
int WaitSignal(const sigset_t& set, std::chrono::milliseconds timeout) {
  timespec ts{.tv_sec = static_cast<time_t>(timeout.count() / 1000),
              .tv_nsec = static_cast<long>((timeout.count() % 1000) * 1000000)};
  const int sig = sigtimedwait(&set, nullptr, &ts);
  return sig > 0 ? sig : 0;
}

// Exit codes, for the supervisor (docs/serving.md).
constexpr int kExitDrained = 0;       // every accepted request finished
constexpr int kExitFailed = 1;        // startup error, or a sticky backend failure
constexpr int kExitDrainTimeout = 3;  // --drain_timeout_s ran out; open streams were cut
// A second SIGTERM/SIGINT during the drain exits 128 + that signal (143, 130), as a shell reports
// a process killed by it: the operator asked for an immediate stop, and streams were cut.

int Serve(TailServer& server, Engine& engine, const std::function<absl::Status()>& pipeline_health,
          const sigset_t& signals) {
  const std::chrono::seconds stats_every(absl::GetFlag(FLAGS_stats_interval_s));
  Watchdog watchdog{std::chrono::seconds(absl::GetFlag(FLAGS_watchdog_s))};
  auto next_stats = Clock::now() + stats_every;
  bool serving = true;
  int sig = 0;
  while (sig == 0) {
    sig = WaitSignal(signals, std::chrono::milliseconds(200));
    if (absl::Status h = engine.health(); !h.ok()) {
      // A sticky backend failure: every request has already ended with INTERNAL (and the stream
      // that carried it set NOT_SERVING first). Staying up would only answer errors, so exit
      // non-zero for the supervisor to restart us.
      std::fprintf(stderr, "tailserve: backend failed, exiting: %s\n", h.ToString().c_str());
      server.SetServing(false);
      server.Shutdown(std::chrono::milliseconds(1000));
      return kExitFailed;
    }
    // A pipeline peer lost. Running requests fail on their next step through the engine's own
    // failure path above (the broken ring fails every Forward at once); with none, nothing else
    // would notice, so stop here rather than take requests that cannot be served.
    if (absl::Status h = pipeline_health ? pipeline_health() : absl::OkStatus(); !h.ok()) {
      if (serving) {
        server.SetServing(false);
        std::fprintf(stderr, "tailserve: pipeline failed: %s; NOT_SERVING\n", h.ToString().c_str());
        serving = false;
      }
      const EngineStats s = engine.stats();
      if (s.running + s.queued == 0) {
        std::fprintf(stderr, "tailserve: pipeline failed with no request left, exiting\n");
        server.Shutdown(std::chrono::milliseconds(1000));
        return kExitFailed;
      }
      continue;
    }
    const bool healthy = watchdog.Check(engine.stats());
    if (healthy != serving) {
      // Set, then log: a reader of the line must find the health it names.
      server.SetServing(healthy);
      std::fprintf(stderr, "tailserve watchdog: %s\n",
                   healthy ? "progress resumed; SERVING"
                           : "nothing completed while requests wait; NOT_SERVING");
      serving = healthy;
    }
    if (stats_every.count() > 0 && Clock::now() >= next_stats) {
      LogStats(server, engine, "tailserve stats");
      next_stats = Clock::now() + stats_every;
    }
  }

  const std::chrono::seconds drain_timeout(absl::GetFlag(FLAGS_drain_timeout_s));
  // Drain before saying so: whoever reads the line (a supervisor, the e2e test) may check health
  // at once, and must see NOT_SERVING. Queued requests are not turned away: their clients were
  // accepted and hold open streams, so they are admitted and finish like the running ones.
  server.BeginDrain();
  const EngineStats at_start = engine.stats();
  std::fprintf(stderr,
               "tailserve draining: got %s, %d streams open (%d running, %d queued), waiting up "
               "to %llds\n",
               strsignal(sig), server.service().active_streams(), at_start.running, at_start.queued,
               static_cast<long long>(drain_timeout.count()));
  const auto deadline = Clock::now() + drain_timeout;
  int second = 0;
  while (!server.Drained() && Clock::now() < deadline) {
    second = WaitSignal(signals, std::chrono::milliseconds(50));
    if (second != 0) break;
  }
  if (server.Drained()) {
    server.Shutdown(std::chrono::milliseconds(1000));
    LogStats(server, engine, "tailserve stopped");
    return kExitDrained;
  }
  // Cut: every open stream ends with UNAVAILABLE (the tokens it already got stay valid; a client
  // may retry elsewhere) rather than vanishing with the connection.
  const int code = second != 0 ? 128 + second : kExitDrainTimeout;
  const std::string why =
      second != 0 ? absl::StrCat("server stopped by a second ", strsignal(second),
                                 " during drain; retry elsewhere")
                  : absl::StrCat("server shutting down: drain timeout (", drain_timeout.count(),
                                 " s) expired before this request finished; retry elsewhere");
  LogStats(server, engine, "tailserve drain cut short");
  const int cut = server.service().CutOpenStreams(grpc::Status(grpc::StatusCode::UNAVAILABLE, why));
  std::fprintf(stderr, "tailserve: %s: cut %d open streams with UNAVAILABLE, exiting %d\n",
               second != 0 ? "second signal during drain" : "drain timed out", cut, code);
  // The grace lets the cut streams' final status reach their clients.
  server.Shutdown(std::chrono::milliseconds(1000));
  LogStats(server, engine, "tailserve stopped");
  return code;
}

// Every numeric flag's range, checked before anything loads: an out-of-range value would
// otherwise wrap (--port 70000 bound 4464) or fail later under another name.
absl::Status CheckFlagRanges() {
  auto range = [](absl::string_view flag, int64_t v, int64_t lo, int64_t hi) -> absl::Status {
    if (v >= lo && v <= hi) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": ", v, " is outside [", lo, ", ", hi, "]"));
  };
  constexpr int64_t kDay = 24 * 3600;
  TS_RETURN_IF_ERROR(range("port", absl::GetFlag(FLAGS_port), 0, 65535));
  TS_RETURN_IF_ERROR(range("max_batch", absl::GetFlag(FLAGS_max_batch), 1, 4096));
  TS_RETURN_IF_ERROR(range("queue_limit", absl::GetFlag(FLAGS_queue_limit), 1, 1 << 20));
  TS_RETURN_IF_ERROR(range("max_context", absl::GetFlag(FLAGS_max_context), 0, 1 << 24));
  TS_RETURN_IF_ERROR(range("kv_blocks", absl::GetFlag(FLAGS_kv_blocks), 0, 1 << 26));
  TS_RETURN_IF_ERROR(range("kv_block_size", absl::GetFlag(FLAGS_kv_block_size), 1, 1024));
  TS_RETURN_IF_ERROR(range("drain_timeout_s", absl::GetFlag(FLAGS_drain_timeout_s), 0, kDay));
  TS_RETURN_IF_ERROR(
      range("stream_buffer_tokens", absl::GetFlag(FLAGS_stream_buffer_tokens), 1, 1 << 24));
  TS_RETURN_IF_ERROR(range("threads", absl::GetFlag(FLAGS_threads), 0, 4096));
  TS_RETURN_IF_ERROR(range("device", absl::GetFlag(FLAGS_device), 0, 1024));
  TS_RETURN_IF_ERROR(
      range("prefill_step_tokens", absl::GetFlag(FLAGS_prefill_step_tokens), 1, 1 << 20));
  TS_RETURN_IF_ERROR(
      range("prefill_catchup_tokens", absl::GetFlag(FLAGS_prefill_catchup_tokens), 1, 1 << 20));
  TS_RETURN_IF_ERROR(
      range("prefill_catchup_ms", absl::GetFlag(FLAGS_prefill_catchup_ms), 0, 1000 * kDay));
  TS_RETURN_IF_ERROR(range("stats_interval_s", absl::GetFlag(FLAGS_stats_interval_s), 0, kDay));
  TS_RETURN_IF_ERROR(range("watchdog_s", absl::GetFlag(FLAGS_watchdog_s), 0, kDay));
  TS_RETURN_IF_ERROR(range("rank", absl::GetFlag(FLAGS_rank), -1, 1 << 20));
  TS_RETURN_IF_ERROR(range("world_size", absl::GetFlag(FLAGS_world_size), 0, 1 << 20));
  TS_RETURN_IF_ERROR(
      range("pipeline_timeout_ms", absl::GetFlag(FLAGS_pipeline_timeout_ms), 1, 1000 * kDay));
  TS_RETURN_IF_ERROR(
      range("debug_step_delay_ms", absl::GetFlag(FLAGS_debug_step_delay_ms), 0, 1000 * kDay));
  TS_RETURN_IF_ERROR(
      range("debug_prefill_delay_ms", absl::GetFlag(FLAGS_debug_prefill_delay_ms), 0, 1000 * kDay));
  TS_RETURN_IF_ERROR(range("debug_generate_delay_ms", absl::GetFlag(FLAGS_debug_generate_delay_ms),
                           0, 1000 * kDay));
  TS_RETURN_IF_ERROR(range("debug_fail_step", absl::GetFlag(FLAGS_debug_fail_step), 0,
                           std::numeric_limits<int64_t>::max()));
  TS_RETURN_IF_ERROR(range("debug_gate_step", absl::GetFlag(FLAGS_debug_gate_step), 0,
                           std::numeric_limits<int64_t>::max()));
  const double fraction = absl::GetFlag(FLAGS_gpu_memory_fraction);
  if (!(fraction > 0.0 && fraction <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--gpu_memory_fraction: ", fraction, " is outside (0, 1]"));
  }
  return absl::OkStatus();
}

absl::StatusOr<pipeline::Topology> ResolveTopology() {
  pipeline::TopologyFlags flags;
  if (absl::GetFlag(FLAGS_rank) >= 0) flags.rank = absl::GetFlag(FLAGS_rank);
  if (absl::GetFlag(FLAGS_world_size) != 0) flags.world_size = absl::GetFlag(FLAGS_world_size);
  if (!absl::GetFlag(FLAGS_leader_address).empty()) {
    flags.leader_address = absl::GetFlag(FLAGS_leader_address);
  }
  TS_ASSIGN_OR_RETURN(pipeline::Topology t, pipeline::ResolveTopology(flags, pipeline::ProcessEnv));
  if (t.world_size > 1) {
    std::printf("tailserve: rank %d of %d, leader %s:%d (%s)\n", t.rank, t.world_size,
                t.leader_host.c_str(), t.leader_port, t.source.c_str());
  }
  return t;
}

// Ranks 1..N-1: this rank's stage until the leader shuts the pipeline down (exit 0) or a link
// fails (exit 1).
int RunWorkerRank(const pipeline::Topology& topology) {
  if (absl::GetFlag(FLAGS_model_dir).empty()) {
    std::fprintf(stderr, "tailserve: --model_dir: required\n");
    return kExitFailed;
  }
  absl::Status s;
  if (absl::GetFlag(FLAGS_backend) == "cuda") {
    const int32_t max_batch = absl::GetFlag(FLAGS_max_batch);
    absl::StatusOr<std::vector<int32_t>> buckets =
        ParseBuckets(absl::GetFlag(FLAGS_buckets), max_batch);
    absl::StatusOr<bool> loop = DecodeLoop(topology);
    s = !buckets.ok() ? buckets.status() : !loop.ok() ? loop.status() : absl::OkStatus();
#if defined(TAILSERVE_WITH_CUDA)
    if (s.ok()) {
      s = RunCudaWorkerFromFlags(CudaFlags(*buckets, absl::GetFlag(FLAGS_max_context),
                                           absl::GetFlag(FLAGS_kv_block_size), *loop, topology));
    }
#else
    if (s.ok()) s = absl::UnimplementedError("--backend cuda: built without the CUDA backend");
#endif
  } else {
    int threads = absl::GetFlag(FLAGS_threads);
    if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    s = pipeline::RunWorker(RankOptionsFor(topology, threads));
  }
  std::fflush(stdout);
  if (s.ok()) {
    std::printf("tailserve: rank %d: the leader shut the pipeline down; exiting 0\n",
                topology.rank);
    return kExitDrained;
  }
  std::fprintf(stderr, "tailserve: rank %d: %s; exiting 1\n", topology.rank, s.ToString().c_str());
  return kExitFailed;
}

int Main(int argc, char** argv) {
  ParseFlags(
      argc, argv,
      "serves a Llama checkpoint over gRPC.\n  tailserve --model_dir DIR [--port N] [--backend "
      "cpu|cuda] ...\nSee docs/serving.md.",
      "server/main.cc");
  if (absl::Status flags = CheckFlagRanges(); !flags.ok()) {
    std::fprintf(stderr, "tailserve: %s\n", flags.ToString().c_str());
    return kExitFailed;
  }
  absl::StatusOr<pipeline::Topology> topology = ResolveTopology();
  if (!topology.ok()) {
    std::fprintf(stderr, "tailserve: %s\n", topology.status().ToString().c_str());
    return kExitFailed;
  }
  // A worker rank serves no port and keeps the default signal actions: SIGTERM ends it at once,
  // and the leader learns so from the closed link.
  if (topology->rank > 0) return RunWorkerRank(*topology);

  // Block the shutdown signals before any thread starts, so every thread inherits the mask and
  // only sigtimedwait in this thread ever sees them: no work happens inside a signal handler.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  absl::StatusOr<Loaded> loaded = Load(*topology);
  if (!loaded.ok()) {
    std::fprintf(stderr, "tailserve: %s\n", loaded.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<Engine> engine = std::move(loaded->engine);
  absl::StatusOr<std::unique_ptr<TailServer>> server = TailServer::Start(
      ServerOptions{.host = absl::GetFlag(FLAGS_host),
                    .port = absl::GetFlag(FLAGS_port),
                    .model_name = loaded->model_name,
                    .tokenizer = loaded->tokenizer.get(),
                    .debug_generate_delay =
                        std::chrono::milliseconds(absl::GetFlag(FLAGS_debug_generate_delay_ms))},
      engine.get());
  if (!server.ok()) {
    std::fprintf(stderr, "tailserve: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::printf("tailserve listening on %s\n", (*server)->address().c_str());
  std::fflush(stdout);
  const int rc = Serve(**server, *engine, loaded->pipeline_health, signals);
  // The server goes first: no reactor may outlive the engine it points into.
  server->reset();
  if (rc != kExitDrained && rc != kExitFailed) {
    // The drain was cut short, often because a step never returns (a hung device). Joining the
    // engine thread could then wait forever, so leave without it; the OS reclaims the rest.
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(rc);
  }
  engine.reset();
  return rc;
}

}  // namespace
}  // namespace ts::server

int main(int argc, char** argv) {
  return ts::server::Main(argc, argv);
}
