// tailserve-bench: decode throughput of the CUDA backend's host-driven graph path on random bf16
// weights in real Llama shapes (the peer baseline in docs/gpu-facts.md uses the same workload:
// greedy, 128-token prompt, 256 new tokens).
//
// Per shape (one CudaBackend, one captured graph per batch size) and per batch: prefill `batch`
// random prompts, then --new_tokens decode steps through Run(kOneStep). Each step is timed with
// CUDA events on the backend's stream (row-list copy + graph) and with the host clock (the whole
// Run: launch, sync, ring bookkeeping); medians are reported. Bytes per step = every weight
// matrix once + the KV read at the run's mean context; the roof is a device-to-device copy
// measured in the same run (bytes read + written).
//
// --modes host,loop: the host-driven mode (Run(kOneStep) per step) and the device-resident loop
// (one Run(kLoop); the scheduler kernel tail-launches every step). Both modes also read device
// timestamps of each step (kernels/step_stamps.cuh): the period between two steps' starts (the
// device's inter-token latency) and the GPU's idle gap from one step's last kernel to the next
// one's first; in the loop, launch_us is the part of that gap from the scheduler's tail-launch
// call to the next step's first kernel (the rest is the scheduler's own work). --host_load k runs k
// busy threads per host core while the steps are timed, as a loaded serving host has (gRPC streams,
// tokenization). --modes pipe: host-driven steps through a pipeline of --pipeline_stages stages (on
// one GPU by default, so its cost over one stage shows).
//
// --probe_tokens N: the time from Prefill of one more N-token prompt to its first token, with
// nothing decoding and beside each smaller batch: in the loop, the prompt rides in mixed steps
// with the batch's decode rows (--prefill_step_tokens rows a step, decode and prompt); host-driven,
// it is prefilled while the decode waits. In the loop the probe also times each mixed step on the
// GPU: what the decoding streams' token interval is while a prompt waits, to set against the
// loop's plain step at that batch (docs/device-loop.md, what the budget trades).
//
// --profile: for --profile_shape / --profile_batch, also runs --profile_reps steps host-launched
// op by op, each op between two events, and prints where a step's time goes: each op's time, the
// bytes it must move (OpBytes) and its time against their copy-bandwidth roof. Launched one by one,
// each op also pays its launch latency; what an op costs inside a graph step is measured by
// leaving it out (--timing_skip), which bench/decode/in_graph_costs.sh does for every op class.
//
// Device timestamps and the host-load threads: bench/decode/step_clock.h.
//
// Output: a table on stdout; one JSON object per line in --out (when given).
// Exit codes: 0 done; 1 a CUDA/backend error or a stream that did not finish as asked; 2 flags.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/common/copy_roof.h"
#include "bench/decode/step_clock.h"
#include "common/flags.h"
#include "common/status.h"
#include "engine/cuda/cuda_backend.h"
#include "kernels/cuda_check.h"
#include "models/llama_shapes.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, shapes, "1b,8b",
          "comma-separated model shapes: 1b (Llama-3.2-1B), 8b "
          "(Llama-3.1-8B)");
ABSL_FLAG(std::string, batches, "1,8,16,32,64,128", "comma-separated batch sizes");
ABSL_FLAG(int32_t, prompt_len, 128, "prompt tokens per request");
ABSL_FLAG(int32_t, new_tokens, 256, "decode steps timed per batch (after the prefill's token)");
ABSL_FLAG(float, temperature, 0.0f,
          "every stream's sampling temperature (0: greedy, as the peer baseline; > 0: seeded "
          "draws, each stream its own seed)");
ABSL_FLAG(float, top_p, 1.0f, "every stream's nucleus top_p, in (0, 1] (1: off)");
ABSL_FLAG(int32_t, top_k, 0, "every stream's top_k, >= 0 (0: off)");
ABSL_FLAG(float, min_p, 0.0f, "every stream's min_p, in [0, 1] (0: off)");
ABSL_FLAG(std::string, out, "",
          "JSON lines output file, appended to (as bench/peer/peer_decode.py does), so the runs "
          "of an A/B loop can share one file; optional");
ABSL_FLAG(bool, profile, false, "also time each op of a step in isolation");
ABSL_FLAG(std::string, profile_shape, "1b", "shape for --profile");
ABSL_FLAG(int32_t, profile_batch, 16, "batch for --profile (must be in --batches)");
ABSL_FLAG(int32_t, profile_reps, 20, "profiled steps; per-op medians are reported");
ABSL_FLAG(double, gpu_memory_fraction, 0.9, "memory budget fraction");
ABSL_FLAG(int32_t, device, 0, "CUDA device ordinal");
ABSL_FLAG(uint64_t, seed, 1, "weights and prompts seed");
ABSL_FLAG(std::vector<std::string>, timing_skip, {},
          "ops left out of the captured decode graphs (attention, qkv_rope_gemm, o_gemm, "
          "gate_up_gemm, down_gemm, or any op --profile names) to measure their in-graph cost by "
          "difference; tokens become meaningless");
ABSL_FLAG(int32_t, attn_min_split_tokens, 64,
          "decode attention's shortest split when a batch leaves SMs idle (128: never shorter "
          "than the large-batch floor)");
ABSL_FLAG(std::string, modes, "host,loop",
          "comma-separated: host (host-driven, one Run(kOneStep) per step), loop (the "
          "device-resident loop), pipe (host-driven over --pipeline_stages stages, in one row "
          "group per stage: a step is a round of one Run per group)");
ABSL_FLAG(std::string, host_load, "0",
          "comma-separated busy threads per host core while steps are timed (0 = idle host)");
ABSL_FLAG(int32_t, pipeline_stages, 2,
          "mode pipe: the model split into this many stages (engine/pipeline/stage_plan.h), "
          "host-driven steps through them (docs/pipeline.md, The CUDA pipeline)");
ABSL_FLAG(std::string, pipeline_devices, "",
          "mode pipe: each stage's device, comma-separated; default: every stage on --device, "
          "linked by device copies (each stage then gets --gpu_memory_fraction / stages)");
ABSL_FLAG(int32_t, probe_tokens, 0,
          "also time one more prompt of this many tokens from Prefill to its first token, with "
          "nothing decoding and beside each batch below the largest (0 = off); at most "
          "--prompt_len + --new_tokens, one under the slots' max_context");
ABSL_FLAG(int32_t, max_context, 0,
          "the slots' max_context (0: --prompt_len + --new_tokens + 1). A server's is the "
          "model's, far longer, and then every bucket's graph holds an attention combine node a "
          "layer, which passes through in regimes of one split (docs/architecture.md, Graph "
          "updates)");
ABSL_FLAG(int32_t, prefill_step_tokens, 256,
          "mode loop: the rows of a mixed step, decode and prompt (tailserve's "
          "--prefill_step_tokens); what --probe_tokens' mixed steps hold");

namespace ts::bench {
namespace {

using nlohmann::json;

ModelConfig Shape(const std::string& name) {
  return Llama3Shape(name == "8b");
}

// --timing_skip, injected into every captured decode step (CudaModelOptions::capture_observer):
// the named ops are left out of the graphs, and every name must be one some capture asked about.
class SkipOps : public OpObserver {
 public:
  explicit SkipOps(std::vector<std::string> ops) : ops_(std::move(ops)), seen_(ops_.size()) {}
  bool empty() const { return ops_.empty(); }
  bool Skip(std::string_view op) override {
    for (size_t i = 0; i < ops_.size(); ++i) {
      if (ops_[i] == op) {
        seen_[i] = true;
        return true;
      }
    }
    return false;
  }
  absl::Status CheckAllSeen() const {
    for (size_t i = 0; i < ops_.size(); ++i) {
      if (!seen_[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat("--timing_skip: no captured decode step has an op named '", ops_[i],
                         "' (--profile lists the ops)"));
      }
    }
    return absl::OkStatus();
  }

 private:
  std::vector<std::string> ops_;
  std::vector<bool> seen_;
};

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5));
  return v[i];
}

absl::StatusOr<std::vector<int32_t>> ParseInts(const std::string& flag, const std::string& s) {
  std::vector<int32_t> out;
  for (absl::string_view part : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int32_t v = 0;
    if (!absl::SimpleAtoi(part, &v) || v < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": bad value '", part, "'"));
    }
    out.push_back(v);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": empty"));
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

struct Settings {
  std::vector<std::string> shapes;
  std::vector<std::string> modes;
  std::vector<int32_t> loads;  // busy threads per core
  std::vector<int32_t> batches;
  int32_t prompt_len = 0, new_tokens = 0;
  int32_t max_context = 0;  // 0: prompt_len + new_tokens + 1
  float temperature = 0.0f, top_p = 1.0f, min_p = 0.0f;
  int32_t top_k = 0;
  double copy_gbps = 0;
};

// The bytes one op of a decode step must move, summed over the layers (the op names of
// cuda_model_forward.cc): weights read once, the KV read and written, and the activations in and
// out. Its time against bytes / copy bandwidth says how far the op is from its own roof. 0 for
// an op this model does not know (it is then printed without a roof).
double OpBytes(const std::string& op, const ModelDims& d, int32_t batch, double context) {
  const double L = d.num_layers, b = batch, h = d.hidden, e = 2;  // bf16 bytes
  const double qkv = d.qkv_dim(), q = d.q_dim(), kv = d.kv_dim(), in = d.intermediate_padded;
  const double act = b * e;  // bytes per element of an activation row set
  if (op == "qkv_gemm" || op == "qkv_rope_gemm") {
    // W, A in, qkv (or q + the K/V cache write) out.
    return L * (qkv * h * e + act * (h + qkv));
  }
  if (op == "o_gemm") return L * (h * q * e + act * (q + 2 * h));
  if (op == "gate_up_gemm") return L * (2 * in * h * e + act * (h + 2 * in));
  if (op == "down_gemm") return L * (h * in * e + act * (in + 2 * h));
  if (op == "attention") return L * (b * context * 2 * kv * e + act * 2 * q);  // K and V read
  if (op == "rope_kv") return L * act * (qkv + q + 2 * kv);
  if (op == "attn_norm" || op == "mlp_norm" || op == "residual_add") return L * act * 3 * h;
  if (op == "silu_mul") return L * act * 3 * in;
  if (op == "lm_head_gemm") return static_cast<double>(d.vocab) * h * e + b * d.vocab * 4.0;
  if (op == "sampling") return b * d.vocab * 4.0;
  if (op == "final_norm") return act * 2 * h;
  return 0;
}

// Publishes `batch` random prompts into slots [0, batch) with the KV blocks of slot i at
// [i * per, (i + 1) * per).
absl::Status PrefillBatch(CudaBackend& b, const Settings& s, int32_t batch, int32_t max_new,
                          uint64_t seed) {
  const BackendInfo& info = b.info();
  const int32_t tokens = s.prompt_len + max_new;
  const int32_t per = (tokens + info.kv_block_size - 1) / info.kv_block_size;
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> prompts(batch), tables(batch);
  std::vector<SlotInit> inits;
  for (int32_t i = 0; i < batch; ++i) {
    for (int32_t t = 0; t < s.prompt_len; ++t) {
      prompts[i].push_back(static_cast<int32_t>(rng() % info.model.vocab_size));
    }
    for (int32_t k = 0; k < per; ++k) tables[i].push_back(i * per + k);
    SlotInit in{
        .slot = i, .prompt = prompts[i], .block_table = tables[i], .sampling = {}, .stop = {}};
    in.sampling.temperature = s.temperature;
    in.sampling.top_p = s.top_p;
    in.sampling.top_k = s.top_k;
    in.sampling.min_p = s.min_p;
    in.sampling.seed = seed * 1000 + i;
    in.stop.max_new_tokens = max_new;
    in.stop.ignore_eos = true;
    inits.push_back(in);
  }
  return b.Prefill(inits);
}

struct Probe {
  double first_token_ms = 0;  // host clock, Prefill to the first token in the ring
  // Loop only: each mixed step's GPU milliseconds, from the stream reaching it to its end (the
  // first one after the loop's exit also holds the host's staging of it, which the streams wait
  // for too).
  std::vector<double> mixed_step_ms;
};

// Prefill of one more prompt of `tokens` (slot `batch`, greedy, one new token) to its first token
// in the ring, while `batch` streams decode (0: nothing decodes). Then runs everything to the end
// and frees every slot.
absl::StatusOr<Probe> ProbePrefill(CudaBackend& b, const Settings& s, int32_t batch,
                                   int32_t max_new, int32_t tokens, bool loop);

// Every slot must hold exactly `records` ring records, the last one FINISHED; then frees them.
absl::Status CheckAndRelease(CudaBackend& b, int32_t batch, uint32_t records) {
  for (int32_t i = 0; i < batch; ++i) {
    uint32_t next = records;  // only the last record is read
    std::vector<RingEntry> entries;
    const TokenRing& ring = b.Ring(i);
    if (ring.LatestSeq() != records) {
      return absl::InternalError(
          absl::StrCat("slot ", i, ": ", ring.LatestSeq(), " ring records, expected ", records));
    }
    ring.Drain(&next, &entries);
    if (entries.empty() || (entries.back().flags & kRingFinished) == 0) {
      return absl::InternalError(absl::StrCat("slot ", i, ": last record is not FINISHED"));
    }
    b.Release(i);
  }
  return absl::OkStatus();
}

// Mode pipe's stages, and the memory fraction each GPU gives each of its stages.
absl::StatusOr<std::vector<CudaStageOptions>> PipeStages(const ModelConfig& config,
                                                         double* fraction) {
  const int32_t n = absl::GetFlag(FLAGS_pipeline_stages);
  std::vector<int> devices;
  const std::string list = absl::GetFlag(FLAGS_pipeline_devices);
  if (list.empty()) {
    devices.assign(n, absl::GetFlag(FLAGS_device));
  } else {
    TS_ASSIGN_OR_RETURN(const std::vector<int32_t> parsed, ParseInts("pipeline_devices", list));
    devices.assign(parsed.begin(), parsed.end());
  }
  if (static_cast<int32_t>(devices.size()) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("--pipeline_devices: ", devices.size(), " devices for ", n, " stages"));
  }
  std::string plan;
  TS_ASSIGN_OR_RETURN(std::vector<CudaStageOptions> out,
                      PlanCudaStages(config, devices, 16, &plan));
  std::fprintf(stderr, "%s", plan.c_str());
  int32_t sharing = 1;
  for (int d : devices) {
    sharing = std::max<int32_t>(sharing, std::count(devices.begin(), devices.end(), d));
  }
  *fraction /= sharing;
  return out;
}

absl::Status RunShape(const std::string& shape, const std::string& mode, const Settings& s,
                      std::ofstream* out) {
  const bool loop = mode == "loop";
  const ModelConfig config = Shape(shape);
  // The prefill emits the first token; then new_tokens decode steps, the last one finishing.
  const int32_t max_new = s.new_tokens + 1;
  CudaBackendOptions o;
  o.max_slots = s.batches.back();
  o.buckets = s.batches;
  o.kv_block_size = 16;
  o.max_context = std::max(s.max_context, s.prompt_len + max_new);
  o.gpu_memory_fraction = absl::GetFlag(FLAGS_gpu_memory_fraction);
  o.device = absl::GetFlag(FLAGS_device);
  o.ring_capacity = static_cast<uint32_t>(max_new + 8);
  // --timing_skip is injected into the captures; an op name no capture asked about is an error
  // (a misspelt op would time the full step as if it had been left out).
  SkipOps skip(absl::GetFlag(FLAGS_timing_skip));
  if (!skip.empty()) o.capture_observer = &skip;
  o.attention_min_split_tokens = absl::GetFlag(FLAGS_attn_min_split_tokens);
  o.device_loop = loop;
  o.prefill_step_tokens = absl::GetFlag(FLAGS_prefill_step_tokens);
  if (mode == "pipe") {
    TS_ASSIGN_OR_RETURN(o.stages, PipeStages(config, &o.gpu_memory_fraction));
  }
  TS_ASSIGN_OR_RETURN(std::unique_ptr<Stamps> stamps,
                      Stamps::Create(static_cast<uint32_t>(max_new + 16)));
  o.step_stamps = stamps->device();
  std::fprintf(stderr, "== shape %s, mode %s: building the backend\n", shape.c_str(), mode.c_str());
  TS_ASSIGN_OR_RETURN(
      std::unique_ptr<CudaBackend> b,
      CudaBackend::CreateRandom(
          o, RandomWeightsSpec{.config = config, .seed = absl::GetFlag(FLAGS_seed)}));
  TS_RETURN_IF_ERROR(skip.CheckAllSeen());
  const ModelDims& d = b->model().dims();
  const size_t weight_bytes = b->step_weight_bytes();
  const int32_t groups = loop ? 1 : b->decode_groups();
  const size_t kv_per_token =
      static_cast<size_t>(d.num_layers) * 2 * d.num_kv_heads * d.head_dim * sizeof(uint16_t);
  cudaEvent_t e0, e1;
  TS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e0));
  TS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e1));
  std::printf("\n%-4s %-5s %6s %5s %10s %10s %10s %10s %9s %9s %9s %12s %9s %8s\n", "shape", "mode",
              "batch", "load", "step_ms", "p90_ms", "p99_ms", "host_ms", "gap_us", "gap_p99",
              "launch_us", "tokens/s", "GB/s", "of_copy");
  for (int32_t batch : s.batches) {
    for (int32_t load : s.loads) {
      TS_RETURN_IF_ERROR(PrefillBatch(*b, s, batch, max_new, absl::GetFlag(FLAGS_seed) + batch));
      if (loop) TS_RETURN_IF_ERROR(b->WaitForPrefills());
      TS_RETURN_IF_ERROR(stamps->Reset());
      std::vector<double> host_ms, period_ms, gap_us, launch_us;
      const int64_t updates0 = b->graph_cache().update_count();
      TS_ASSIGN_OR_RETURN(const LoopStatus before, b->Poll());
      {
        const HostLoad busy(load);
        if (loop) {
          // The loop runs every step by itself; it exits only when all slots have finished or
          // when the longest context crosses an attention regime bound, where Run relaunches it
          // after the graph update (docs/device-loop.md). An event after a launch completes once
          // that loop has exited (graphs/tail_launch.cuh).
          const auto t0 = std::chrono::steady_clock::now();
          do {
            TS_RETURN_IF_ERROR(b->Run(RunMode::kLoop));
            TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(e1, b->stream()));
            TS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(e1));
          } while (b->num_active() > 0);
          host_ms.push_back(
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                  .count() /
              s.new_tokens);
        } else {
          // With row groups (a pipeline's micro-batches, docs/pipeline.md) each Run is one
          // group's step, and a step of the whole batch is a round of `groups` of them.
          int32_t round_rows = 0;
          auto t0 = std::chrono::steady_clock::now();
          for (int32_t step = 0; step < s.new_tokens * groups; ++step) {
            TS_RETURN_IF_ERROR(b->Run(RunMode::kOneStep));
            round_rows += b->last_step().active;
            if (step % groups != groups - 1) continue;
            const auto t1 = std::chrono::steady_clock::now();
            host_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
            t0 = t1;
            if (round_rows != batch) {
              return absl::InternalError(absl::StrCat("round ", step / groups, ": ", round_rows,
                                                      " rows decoded, expected ", batch));
            }
            round_rows = 0;
          }
        }
      }
      TS_ASSIGN_OR_RETURN(const LoopStatus after, b->Poll());
      const uint64_t want_steps = static_cast<uint64_t>(s.new_tokens) * groups;
      if (after.steps - before.steps != want_steps) {
        return absl::InternalError(absl::StrCat(mode, ": ", after.steps - before.steps,
                                                " steps ran, expected ", want_steps));
      }
      TS_RETURN_IF_ERROR(stamps->Read(&period_ms, &gap_us, &launch_us));
      TS_RETURN_IF_ERROR(CheckAndRelease(*b, batch, static_cast<uint32_t>(max_new)));
      // A group's steps start one period apart in the steady state: a round is `groups` of them.
      for (double& p : period_ms) p *= groups;
      const double med = Quantile(period_ms, 0.5);
      double gap_mean = 0;
      for (double g : gap_us) gap_mean += g / std::max<size_t>(gap_us.size(), 1);
      // The device loop's tail-launch call to the step's first kernel: the graph boundary, what
      // is left of the gap once the scheduler kernel's own work is taken out.
      double launch_mean = 0;
      for (double g : launch_us) launch_mean += g / std::max<size_t>(launch_us.size(), 1);
      const double mean_ctx = s.prompt_len + 1 + s.new_tokens / 2.0;
      const double bytes = weight_bytes + static_cast<double>(batch) * mean_ctx * kv_per_token;
      const double gbps = bytes / (med * 1e-3) / 1e9;
      const json row = {{"shape", shape},
                        {"mode", mode},
                        {"stages", b->num_stages()},
                        {"decode_groups", groups},
                        {"batch", batch},
                        {"host_load_per_core", load},
                        {"prompt_len", s.prompt_len},
                        {"new_tokens", s.new_tokens},
                        {"temperature", s.temperature},
                        {"top_p", s.top_p},
                        {"top_k", s.top_k},
                        {"min_p", s.min_p},
                        {"step_ms_median", med},
                        {"step_ms_p10", Quantile(period_ms, 0.1)},
                        {"step_ms_p90", Quantile(period_ms, 0.9)},
                        {"step_ms_p99", Quantile(period_ms, 0.99)},
                        {"host_step_ms_median", Quantile(host_ms, 0.5)},
                        {"gap_us_mean", gap_mean},
                        {"gap_us_median", Quantile(gap_us, 0.5)},
                        {"gap_us_p99", Quantile(gap_us, 0.99)},
                        {"launch_to_start_us_mean", launch_mean},
                        {"tokens_per_s", batch / (med * 1e-3)},
                        {"weight_bytes", weight_bytes},
                        {"kv_bytes_per_step_mean", batch * mean_ctx * kv_per_token},
                        {"bytes_per_step", bytes},
                        {"achieved_gbps", gbps},
                        {"copy_gbps", s.copy_gbps},
                        {"fraction_of_copy", gbps / s.copy_gbps},
                        {"graph_nodes", b->graph_cache().node_count(
                                            b->graph_cache().BucketIndexFor(batch).value_or(0))},
                        {"regime_updates", b->graph_cache().update_count() - updates0},
                        {"timing_skip", absl::GetFlag(FLAGS_timing_skip)},
                        {"attn_min_split_tokens", absl::GetFlag(FLAGS_attn_min_split_tokens)},
                        {"max_context", o.max_context}};
      std::printf(
          "%-4s %-5s %6d %5d %10.3f %10.3f %10.3f %10.3f %9.2f %9.2f %9.2f %12.0f %9.0f %7.1f%%\n",
          shape.c_str(), mode.c_str(), batch, load, med, Quantile(period_ms, 0.9),
          Quantile(period_ms, 0.99), Quantile(host_ms, 0.5), gap_mean, Quantile(gap_us, 0.99),
          launch_mean, batch / (med * 1e-3), gbps, 100 * gbps / s.copy_gbps);
      std::fflush(stdout);
      if (out != nullptr) *out << row.dump() << "\n";
    }
  }

  if (const int32_t probe = absl::GetFlag(FLAGS_probe_tokens); probe > 0) {
    // Idle first, then beside every batch that leaves the probe a slot. Host-driven, the
    // streams wait while the probe's Prefill runs; in the loop they decode beside it.
    std::vector<int32_t> besides = {0};
    for (int32_t batch : s.batches) {
      if (batch < s.batches.back()) besides.push_back(batch);
    }
    for (int32_t beside : besides) {
      TS_ASSIGN_OR_RETURN(const Probe p, ProbePrefill(*b, s, beside, max_new, probe, loop));
      std::printf("prefill probe %-4s %-5s: %d tokens beside %d decoding streams: %.2f ms",
                  shape.c_str(), mode.c_str(), probe, beside, p.first_token_ms);
      const std::vector<double>& mixed = p.mixed_step_ms;
      if (!mixed.empty()) {
        std::printf("; %zu mixed steps of up to %d rows, median %.3f ms, max %.3f", mixed.size(),
                    absl::GetFlag(FLAGS_prefill_step_tokens), Quantile(mixed, 0.5),
                    *std::max_element(mixed.begin(), mixed.end()));
      }
      std::printf("\n");
      if (out != nullptr) {
        json row = {{"probe", shape},
                    {"mode", mode},
                    {"probe_tokens", probe},
                    {"beside", beside},
                    {"first_token_ms", p.first_token_ms}};
        if (!mixed.empty()) {
          row["prefill_step_tokens"] = absl::GetFlag(FLAGS_prefill_step_tokens);
          row["mixed_step_ms"] = mixed;
        }
        *out << row.dump() << "\n";
      }
    }
  }

  if (!loop && absl::GetFlag(FLAGS_profile) && shape == absl::GetFlag(FLAGS_profile_shape)) {
    const int32_t batch = absl::GetFlag(FLAGS_profile_batch);
    // The rings hold new_tokens + 8 records: profiled steps stay within that.
    const int32_t reps = std::clamp(absl::GetFlag(FLAGS_profile_reps), 1, s.new_tokens);
    if (std::find(s.batches.begin(), s.batches.end(), batch) == s.batches.end()) {
      return absl::InvalidArgumentError("--profile_batch must be one of --batches");
    }
    TS_RETURN_IF_ERROR(PrefillBatch(*b, s, batch, reps + 1, absl::GetFlag(FLAGS_seed)));
    std::map<std::string, std::vector<double>> per_op;  // op -> us per step, one per rep
    std::vector<std::string> order;
    for (int32_t r = 0; r < reps; ++r) {
      TS_ASSIGN_OR_RETURN(auto ops, b->ProfileStep());
      std::map<std::string, double> step;
      for (const auto& [name, ms] : ops) {
        if (step.count(name) == 0 && r == 0) order.push_back(name);
        step[name] += ms * 1e3;
      }
      for (const auto& [name, us] : step) per_op[name].push_back(us);
    }
    TS_RETURN_IF_ERROR(CheckAndRelease(*b, batch, static_cast<uint32_t>(reps + 1)));
    double total = 0;
    for (const auto& name : order) total += Quantile(per_op[name], 0.5);
    // The profiled steps' mean context: the prompt, then one token per step.
    const double context = s.prompt_len + 1 + reps / 2.0;
    std::printf(
        "\nprofile %s batch %d (ops launched one by one, each between two events; "
        "median of %d steps; roof = bytes / %.0f GB/s copy)\n%-14s %10s %7s %10s %9s %8s\n",
        shape.c_str(), batch, reps, s.copy_gbps, "op", "us/step", "share", "MB/step", "roof us",
        "x roof");
    json prof = {{"profile", shape}, {"batch", batch}, {"ops", json::array()}};
    for (const auto& name : order) {
      const double us = Quantile(per_op[name], 0.5);
      const double bytes = OpBytes(name, d, batch, context);
      const double roof_us = bytes / (s.copy_gbps * 1e3);
      if (bytes > 0) {
        std::printf("%-14s %10.1f %6.1f%% %10.2f %9.1f %8.2f\n", name.c_str(), us, 100 * us / total,
                    bytes / 1e6, roof_us, us / roof_us);
      } else {
        std::printf("%-14s %10.1f %6.1f%%\n", name.c_str(), us, 100 * us / total);
      }
      prof["ops"].push_back(
          {{"op", name}, {"us_per_step", us}, {"bytes_per_step", bytes}, {"roof_us", roof_us}});
    }
    std::printf("%-14s %10.1f\n", "sum", total);
    prof["sum_us"] = total;
    if (out != nullptr) *out << prof.dump() << "\n";
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return absl::OkStatus();
}

absl::StatusOr<Probe> ProbePrefill(CudaBackend& b, const Settings& s, int32_t batch,
                                   int32_t max_new, int32_t tokens, bool loop) {
  const BackendInfo& info = b.info();
  const int32_t per = (s.prompt_len + max_new + info.kv_block_size - 1) / info.kv_block_size;
  // The slot's share of the pool, and one token under max_context for the first token.
  tokens = std::min({tokens, per * info.kv_block_size - 1, s.prompt_len + max_new - 1});
  if (batch > 0) {
    TS_RETURN_IF_ERROR(PrefillBatch(b, s, batch, max_new, absl::GetFlag(FLAGS_seed) + 7));
    if (loop) {
      TS_RETURN_IF_ERROR(b.WaitForPrefills());
      TS_RETURN_IF_ERROR(b.Run(RunMode::kLoop));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    } else {
      for (int i = 0; i < 4; ++i) TS_RETURN_IF_ERROR(b.Run(RunMode::kOneStep));
    }
  }
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed) + 11);
  std::vector<int32_t> prompt(tokens), table(per);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % info.model.vocab_size);
  for (int32_t k = 0; k < per; ++k) table[k] = batch * per + k;
  SlotInit probe{.slot = batch, .prompt = prompt, .block_table = table, .sampling = {}, .stop = {}};
  probe.sampling.temperature = 0.0f;
  probe.stop.max_new_tokens = 1;
  // A Run(kLoop) enqueues at most one mixed step and nothing else, so two events around a call
  // that did bracket that step's work on the stream.
  struct Marks {
    cudaEvent_t begin = nullptr, end = nullptr;
    Marks() {
      cudaEventCreate(&begin);
      cudaEventCreate(&end);
    }
    ~Marks() {
      cudaEventDestroy(begin);
      cudaEventDestroy(end);
    }
    Marks(const Marks&) = delete;
    Marks& operator=(const Marks&) = delete;
  };
  std::vector<std::unique_ptr<Marks>> marks;
  auto next = std::make_unique<Marks>();
  const auto t0 = std::chrono::steady_clock::now();
  TS_RETURN_IF_ERROR(b.Prefill(std::span<const SlotInit>(&probe, 1)));
  const auto deadline = t0 + std::chrono::seconds(30);
  while (b.Ring(batch).LatestSeq() < 1) {
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError("prefill probe: no first token in 30 s");
    }
    if (loop) {
      const uint64_t before = b.mixed_steps();
      TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(next->begin, b.stream()));
      TS_RETURN_IF_ERROR(b.Run(RunMode::kLoop));  // a mixed step, a pause, or a relaunch
      TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(next->end, b.stream()));
      if (b.mixed_steps() > before) {  // kept; otherwise recorded again at the next call
        marks.push_back(std::move(next));
        next = std::make_unique<Marks>();
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  Probe result;
  result.first_token_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  // Everything to the end: the batch's streams, and the probe (finished by its first token).
  if (loop) TS_RETURN_IF_ERROR(b.WaitForPrefills());
  do {
    TS_RETURN_IF_ERROR(b.Run(loop ? RunMode::kLoop : RunMode::kOneStep));
    TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(b.stream()));
  } while (b.num_active() > 0);
  for (const auto& m : marks) {
    float ms = 0.f;
    TS_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, m->begin, m->end));
    result.mixed_step_ms.push_back(ms);
  }
  if (batch > 0) TS_RETURN_IF_ERROR(CheckAndRelease(b, batch, static_cast<uint32_t>(max_new)));
  b.Release(batch);
  return result;
}

int Main() {
  Settings s;
  for (absl::string_view part :
       absl::StrSplit(absl::GetFlag(FLAGS_shapes), ',', absl::SkipEmpty())) {
    if (part != "1b" && part != "8b") {
      std::fprintf(stderr, "--shapes: unknown shape '%s' (1b, 8b)\n", std::string(part).c_str());
      return 2;
    }
    s.shapes.emplace_back(part);
  }
  auto batches = ParseInts("batches", absl::GetFlag(FLAGS_batches));
  if (!batches.ok()) {
    std::fprintf(stderr, "%s\n", batches.status().ToString().c_str());
    return 2;
  }
  s.batches = *batches;
  for (absl::string_view part :
       absl::StrSplit(absl::GetFlag(FLAGS_modes), ',', absl::SkipEmpty())) {
    if (part != "host" && part != "loop" && part != "pipe") {
      std::fprintf(stderr, "--modes: unknown mode '%s' (host, loop, pipe)\n",
                   std::string(part).c_str());
      return 2;
    }
    s.modes.emplace_back(part);
  }
  for (absl::string_view part :
       absl::StrSplit(absl::GetFlag(FLAGS_host_load), ',', absl::SkipEmpty())) {
    int32_t v = -1;
    if (!absl::SimpleAtoi(part, &v) || v < 0 || v > 16) {
      std::fprintf(stderr, "--host_load: bad value '%s' (0-16 threads per core)\n",
                   std::string(part).c_str());
      return 2;
    }
    s.loads.push_back(v);
  }
  if (s.modes.empty() || s.loads.empty()) {
    std::fprintf(stderr, "--modes and --host_load must not be empty\n");
    return 2;
  }
  s.prompt_len = absl::GetFlag(FLAGS_prompt_len);
  s.new_tokens = absl::GetFlag(FLAGS_new_tokens);
  s.max_context = absl::GetFlag(FLAGS_max_context);
  if (s.prompt_len < 1 || s.new_tokens < 1 || s.shapes.empty()) {
    std::fprintf(stderr, "--prompt_len and --new_tokens must be >= 1, --shapes non-empty\n");
    return 2;
  }
  if (s.max_context != 0 && s.max_context <= s.prompt_len + s.new_tokens) {
    std::fprintf(stderr, "--max_context must be 0 or above --prompt_len + --new_tokens (%d)\n",
                 s.prompt_len + s.new_tokens);
    return 2;
  }
  s.temperature = absl::GetFlag(FLAGS_temperature);
  s.top_p = absl::GetFlag(FLAGS_top_p);
  s.top_k = absl::GetFlag(FLAGS_top_k);
  s.min_p = absl::GetFlag(FLAGS_min_p);
  if (!(s.temperature >= 0.0f && s.temperature < 1e30f) || !(s.top_p > 0.0f && s.top_p <= 1.0f) ||
      s.top_k < 0 || !(s.min_p >= 0.0f && s.min_p <= 1.0f)) {
    std::fprintf(stderr,
                 "--temperature must be finite and >= 0, --top_p in (0, 1], --top_k >= 0, "
                 "--min_p in [0, 1]\n");
    return 2;
  }
  if (cudaSetDevice(absl::GetFlag(FLAGS_device)) != cudaSuccess) {
    std::fprintf(stderr, "no usable CUDA device %d\n", absl::GetFlag(FLAGS_device));
    return 1;
  }
  s.copy_gbps = MeasureCopyBandwidthGbps();
  std::printf("device-to-device copy: %.0f GB/s (read + write)\n", s.copy_gbps);
  std::unique_ptr<std::ofstream> out;
  if (!absl::GetFlag(FLAGS_out).empty()) {
    out = std::make_unique<std::ofstream>(absl::GetFlag(FLAGS_out), std::ios::app);
    if (!out->good()) {
      std::fprintf(stderr, "--out: cannot open %s\n", absl::GetFlag(FLAGS_out).c_str());
      return 1;
    }
    *out << json{{"copy_gbps", s.copy_gbps}}.dump() << "\n";
  }
  for (const std::string& shape : s.shapes) {
    for (const std::string& mode : s.modes) {
      const absl::Status st = RunShape(shape, mode, s, out.get());
      if (!st.ok()) {
        std::fprintf(stderr, "shape %s, mode %s: %s\n", shape.c_str(), mode.c_str(),
                     st.ToString().c_str());
        return 1;
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace ts::bench

int main(int argc, char** argv) {
  ts::ParseFlags(argc, argv,
                 "tailserve-bench: decode step time of the CUDA backend on random Llama weights",
                 "bench/decode/");
  return ts::bench::Main();
}
