// tailserve-graph-bench: what GraphCache costs and what the device loop buys, on graphs of tiny
// kernels (the 8- and 65-node steps of docs/gpu-facts.md, Per-step launch cost, were measured the
// same way).
//   per graph size N: the host cost of UpdateRegime (median of --updates), and the time per step
//   of host graph launches, host launches with a per-step sync (the host-driven mode), and a
//   device scheduler graph that tail-launches the step and itself (TailLauncher loop mode).
// Steps are timed with CUDA events around --steps steps after warm-up, median of --reps. Every
// timed run is checked: the step counter in the graph must advance by exactly --steps.
//
// Exit codes: 0 done; 1 a CUDA or cache error, or a step count that does not match; 2 bad flags.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/graphs/tiny_kernels.cuh"
#include "common/status.h"
#include "graphs/graph_cache.h"
#include "graphs/tail_launch.cuh"
#include "kernels/cuda_check.h"

ABSL_FLAG(std::string, nodes, "8,73,289", "comma-separated graph sizes in nodes (each >= 1)");
ABSL_FLAG(int32_t, steps, 200, "steps per timed run (device loop: <= 2^31-1)");
ABSL_FLAG(int32_t, reps, 20, "timed runs per mode; the median is reported");
ABSL_FLAG(int32_t, updates, 50, "timed UpdateRegime calls per size; the median is reported");
ABSL_FLAG(int32_t, device, 0, "CUDA device ordinal");

namespace ts::graphs::bench {
namespace {

struct Config {
  std::vector<int32_t> nodes;
  int32_t steps = 0, reps = 0, updates = 0, device = 0;
};

struct SizeResult {
  int32_t nodes = 0;
  double update_total_us = 0, update_exec_us = 0, update_capture_us = 0;
  double host_us = 0, host_sync_us = 0, device_us = 0;  // per step
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 == 1 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

absl::StatusOr<Config> ParseConfig() {
  Config c;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_nodes), ',')) {
    int32_t n = 0;
    if (!absl::SimpleAtoi(part, &n) || n < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--nodes: bad size '", part, "'"));
    }
    c.nodes.push_back(n);
  }
  c.steps = absl::GetFlag(FLAGS_steps);
  c.reps = absl::GetFlag(FLAGS_reps);
  c.updates = absl::GetFlag(FLAGS_updates);
  c.device = absl::GetFlag(FLAGS_device);
  if (c.steps < 1) return absl::InvalidArgumentError("--steps must be >= 1");
  if (c.reps < 1) return absl::InvalidArgumentError("--reps must be >= 1");
  if (c.updates < 1) return absl::InvalidArgumentError("--updates must be >= 1");
  if (c.device < 0) return absl::InvalidArgumentError("--device must be >= 0");
  return c;
}

// Device buffers, events and a pinned scalar for one graph size; freed on scope exit.
struct Resources {
  float* buf = nullptr;        // [kTinyWidth]
  int32_t* counter = nullptr;  // [1]
  int32_t* scalars = nullptr;  // [3]: bucket_index, remaining_steps, status
  int32_t* pinned = nullptr;   // [3], host staging for scalars
  cudaEvent_t start = nullptr, stop = nullptr;
  ~Resources() {
    if (buf != nullptr) cudaFree(buf);
    if (counter != nullptr) cudaFree(counter);
    if (scalars != nullptr) cudaFree(scalars);
    if (pinned != nullptr) cudaFreeHost(pinned);
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
  }
  absl::Status Init(cudaStream_t stream) {
    TS_CUDA_RETURN_IF_ERROR(cudaMalloc(&buf, sizeof(float) * kTinyWidth));
    TS_CUDA_RETURN_IF_ERROR(cudaMalloc(&counter, sizeof(int32_t)));
    TS_CUDA_RETURN_IF_ERROR(cudaMalloc(&scalars, sizeof(int32_t) * 3));
    TS_CUDA_RETURN_IF_ERROR(cudaMallocHost(&pinned, sizeof(int32_t) * 3));
    TS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
    TS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
    std::mt19937 rng(1234);
    std::uniform_real_distribution<float> dist(0.5f, 2.0f);
    std::vector<float> host(kTinyWidth);
    for (float& f : host) f = dist(rng);
    TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(buf, host.data(), sizeof(float) * kTinyWidth,
                                            cudaMemcpyHostToDevice, stream));
    TS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(counter, 0, sizeof(int32_t), stream));
    // Waits for the copies on `stream` before `host` goes out of scope.
    TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  }
  absl::StatusOr<int32_t> Counter() const {
    int32_t v = 0;
    TS_CUDA_RETURN_IF_ERROR(cudaMemcpy(&v, counter, sizeof(v), cudaMemcpyDeviceToHost));
    return v;
  }
};

enum class Mode { kHost, kHostSync, kDevice };

// One timed run of `steps` steps; returns microseconds per step and checks the step counter.
absl::StatusOr<double> TimedRun(Mode mode, int32_t steps, GraphCache& cache, TailLauncher& looper,
                                Resources& r, cudaStream_t stream) {
  TS_ASSIGN_OR_RETURN(const int32_t before, r.Counter());
  if (mode == Mode::kDevice) {
    r.pinned[0] = 0;
    r.pinned[1] = steps;
    r.pinned[2] = 0;
    TS_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(r.scalars, r.pinned, sizeof(int32_t) * 3, cudaMemcpyHostToDevice, stream));
  }
  TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(r.start, stream));
  switch (mode) {
    case Mode::kHost:
      for (int32_t i = 0; i < steps; ++i) TS_RETURN_IF_ERROR(cache.Launch(0, stream));
      break;
    case Mode::kHostSync:
      for (int32_t i = 0; i < steps; ++i) {
        TS_RETURN_IF_ERROR(cache.Launch(0, stream));
        // The host-driven mode's per-step sync on the step stream (it reads the tokens after).
        TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
      }
      break;
    case Mode::kDevice:
      TS_RETURN_IF_ERROR(looper.Launch(stream));
      break;
  }
  TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(r.stop, stream));
  TS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(r.stop));
  float ms = 0;
  TS_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, r.start, r.stop));
  TS_ASSIGN_OR_RETURN(const int32_t after, r.Counter());
  if (mode == Mode::kDevice) {
    TS_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(r.pinned, r.scalars, sizeof(int32_t) * 3, cudaMemcpyDeviceToHost));
    if (r.pinned[2] != 0) {
      return absl::InternalError(
          absl::StrCat("device-side graph launch failed with status ", r.pinned[2]));
    }
  }
  if (after - before != steps) {
    return absl::InternalError(
        absl::StrCat("expected ", steps, " steps to run, the counter says ", after - before));
  }
  return 1000.0 * ms / steps;
}

absl::StatusOr<double> MedianPerStep(Mode mode, const Config& c, GraphCache& cache,
                                     TailLauncher& looper, Resources& r, cudaStream_t stream) {
  // Warm-up: first launches upload and page in whatever the driver defers.
  TS_RETURN_IF_ERROR(TimedRun(mode, std::min(c.steps, 50), cache, looper, r, stream).status());
  std::vector<double> per_step;
  for (int32_t i = 0; i < c.reps; ++i) {
    TS_ASSIGN_OR_RETURN(const double us, TimedRun(mode, c.steps, cache, looper, r, stream));
    per_step.push_back(us);
  }
  return Median(per_step);
}

absl::StatusOr<SizeResult> RunSize(int32_t nodes, const Config& c, cudaStream_t stream) {
  Resources r;
  TS_RETURN_IF_ERROR(r.Init(stream));
  GraphCacheOptions opt;
  opt.buckets = {1};
  opt.device = c.device;
  opt.capture = [&r, nodes](const CaptureContext& ctx, cudaStream_t s) -> absl::Status {
    TinyStepParams p{.buf = r.buf,
                     .counter = r.counter,
                     .nodes = nodes,
                     .shift = 1e-3f * static_cast<float>(ctx.regime.attention_num_splits)};
    TS_CUDA_RETURN_IF_ERROR(EnqueueTinyStep(p, s));
    return absl::OkStatus();
  };
  GraphCache cache(std::move(opt));
  TS_RETURN_IF_ERROR(cache.Build(stream));
  if (cache.node_count(0) != nodes) {
    return absl::InternalError(
        absl::StrCat("captured ", cache.node_count(0), " nodes, wanted ", nodes));
  }

  SizeResult res;
  res.nodes = nodes;
  std::vector<double> total, exec, capture;
  for (int32_t i = 0; i < c.updates + 5; ++i) {  // the first 5 are warm-up
    const Regime regime{.attention_num_splits = 1 + i % 2, .max_context_len = 1024 * (i % 4)};
    TS_RETURN_IF_ERROR(cache.UpdateRegime(regime, stream));
    if (i < 5) continue;
    total.push_back(cache.last_update().total_us);
    exec.push_back(cache.last_update().exec_update_us);
    capture.push_back(cache.last_update().capture_us);
  }
  res.update_total_us = Median(total);
  res.update_exec_us = Median(exec);
  res.update_capture_us = Median(capture);

  TailLaunchParams loop{.table = cache.device_table(),
                        .num_buckets = cache.num_buckets(),
                        .bucket_index = r.scalars,
                        .remaining_steps = r.scalars + 1,
                        .status = r.scalars + 2};
  TS_ASSIGN_OR_RETURN(std::unique_ptr<TailLauncher> looper, TailLauncher::Create(loop, stream));
  TS_ASSIGN_OR_RETURN(res.host_us, MedianPerStep(Mode::kHost, c, cache, *looper, r, stream));
  TS_ASSIGN_OR_RETURN(res.host_sync_us,
                      MedianPerStep(Mode::kHostSync, c, cache, *looper, r, stream));
  TS_ASSIGN_OR_RETURN(res.device_us, MedianPerStep(Mode::kDevice, c, cache, *looper, r, stream));
  // The launcher and cache are destroyed next; nothing may still run on `stream`.
  TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return res;
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "GraphCache micro-benchmark: UpdateRegime cost and per-step launch time (host graph "
      "launch, host launch + sync, device tail-launch loop) for graphs of tiny kernels.");
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<Config> config = ParseConfig();
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", std::string(config.status().message()).c_str());
    return 2;
  }
  const Config& c = *config;
  cudaDeviceProp prop{};
  if (cudaSetDevice(c.device) != cudaSuccess ||
      cudaGetDeviceProperties(&prop, c.device) != cudaSuccess) {
    std::fprintf(stderr, "no usable CUDA device %d\n", c.device);
    return 1;
  }
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return 1;

  std::vector<SizeResult> results;
  for (int32_t n : c.nodes) {
    absl::StatusOr<SizeResult> r = RunSize(n, c, stream);
    if (!r.ok()) {
      std::fprintf(stderr, "graph of %d nodes: %s\n", n, r.status().ToString().c_str());
      return 1;
    }
    results.push_back(*r);
  }
  cudaStreamDestroy(stream);

  std::printf(
      "\ntailserve-graph-bench on %s: %d steps per run, median of %d runs; UpdateRegime "
      "median of %d (host clock, 1 bucket)\n",
      prop.name, c.steps, c.reps, c.updates);
  std::printf("%6s | %12s %12s %12s | %12s %12s %12s\n", "nodes", "update us", "exec upd us",
              "capture us", "host us/st", "host+sync", "device tail");
  for (const SizeResult& r : results) {
    std::printf("%6d | %12.1f %12.1f %12.1f | %12.2f %12.2f %12.2f\n", r.nodes, r.update_total_us,
                r.update_exec_us, r.update_capture_us, r.host_us, r.host_sync_us, r.device_us);
  }
  return 0;
}

}  // namespace
}  // namespace ts::graphs::bench

int main(int argc, char** argv) {
  return ts::graphs::bench::Main(argc, argv);
}
