// tailserve-graph-bench: what GraphCache costs and what the device loop buys, on graphs of tiny
// kernels (the 8- and 65-node steps of docs/gpu-facts.md, Per-step launch cost, were measured the
// same way).
//   per graph size N: the host cost of UpdateRegime (median of --updates), and the time per step
//   of host graph launches, host launches with a per-step sync (the host-driven mode), a device
//   scheduler graph that tail-launches the step and itself (TailLauncher loop mode: two graph
//   boundaries a step), the serving loop (graphs/device_loop.cuh: the step graph ends with the
//   scheduler kernel, which tail-launches the next step: one boundary a step, plus that node), and
//   one host-launched graph whose conditional WHILE node runs a one-thread scheduler kernel and a
//   SWITCH over --switch_bodies copies of the step each iteration (while+switch, issue #13: the
//   conditional-node alternative to the tail-launch loop; bench/graphs/while_switch.h).
// Steps are timed with CUDA events around --steps steps after warm-up, median of --reps. Every
// timed run is checked: the step counter in the graph must advance by exactly --steps.
// while+switch runs last for each size, once the other modes have their numbers.
// If the conditional-node API fails (build, instantiate, launch), its column says n/a and a note
// under the table gives the error; the other modes are still measured and the exit code is
// unaffected. A while+switch run that never ends is reported after a deadline instead of hanging.
//
// Exit codes: 0 done; 1 a CUDA or cache error, a step count that does not match (while+switch
// included), or a while+switch run past its deadline; 2 bad flags.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/graphs/tiny_kernels.cuh"
#include "bench/graphs/while_switch.h"
#include "common/status.h"
#include "graphs/device_loop.cuh"
#include "graphs/graph_cache.h"
#include "graphs/tail_launch.cuh"
#include "kernels/cuda_check.h"

ABSL_FLAG(std::string, nodes, "8,73,289", "comma-separated graph sizes in nodes (each >= 1)");
ABSL_FLAG(int32_t, steps, 200, "steps per timed run (device loop: <= 2^31-1)");
ABSL_FLAG(int32_t, reps, 20, "timed runs per mode; the median is reported");
ABSL_FLAG(int32_t, updates, 50, "timed UpdateRegime calls per size; the median is reported");
ABSL_FLAG(int32_t, device, 0, "CUDA device ordinal");
ABSL_FLAG(int32_t, switch_bodies, 4,
          "while+switch: bodies of the SWITCH node (copies of the step; the last one runs), "
          "1..64");

namespace ts::graphs::bench {
namespace {

struct Config {
  std::vector<int32_t> nodes;
  int32_t steps = 0, reps = 0, updates = 0, device = 0, switch_bodies = 0;
};

struct SizeResult {
  int32_t nodes = 0;
  double update_total_us = 0, update_exec_us = 0, update_capture_us = 0;
  double host_us = 0, host_sync_us = 0, device_us = 0, loop_us = 0;  // per step
  // while+switch: per step where while_switch_error is empty, else not measured.
  double while_switch_us = 0;
  std::string while_switch_error;
  bool while_switch_check_failed = false;  // the error is a failed step check, not the API
};

// Marks a status as a failed step check (wrong count, or a device-side status), which
// while+switch turns into exit code 1 where an API failure only gets a note.
constexpr char kStepCheckPayload[] = "tailserve.graph_bench/step_check";

absl::Status StepCheckError(std::string message) {
  absl::Status s = absl::InternalError(std::move(message));
  s.SetPayload(kStepCheckPayload, absl::Cord("1"));
  return s;
}

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
  c.switch_bodies = absl::GetFlag(FLAGS_switch_bodies);
  if (c.steps < 1) return absl::InvalidArgumentError("--steps must be >= 1");
  if (c.reps < 1) return absl::InvalidArgumentError("--reps must be >= 1");
  if (c.updates < 1) return absl::InvalidArgumentError("--updates must be >= 1");
  if (c.device < 0) return absl::InvalidArgumentError("--device must be >= 0");
  if (c.switch_bodies < 1 || c.switch_bodies > kWhileSwitchMaxBodies) {
    return absl::InvalidArgumentError(
        absl::StrCat("--switch_bodies must be in [1, ", kWhileSwitchMaxBodies, "]"));
  }
  return c;
}

// Device buffers, events and a pinned scalar for one graph size; freed on scope exit.
struct Resources {
  float* buf = nullptr;        // [kTinyWidth]
  int32_t* counter = nullptr;  // [1]
  int32_t* scalars = nullptr;  // [3]: bucket_index, remaining_steps, status
  int32_t* pinned = nullptr;   // [3], host staging for scalars
  // The serving loop's one slot, its step budget and row list; pinned staging for the first two.
  kernels::SlotRow* slot = nullptr;
  int32_t* remaining = nullptr;
  int32_t* rows = nullptr;
  kernels::SlotRow* slot_pinned = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  ~Resources() {
    if (slot != nullptr) cudaFree(slot);
    if (remaining != nullptr) cudaFree(remaining);
    if (rows != nullptr) cudaFree(rows);
    if (slot_pinned != nullptr) cudaFreeHost(slot_pinned);
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
    TS_CUDA_RETURN_IF_ERROR(cudaMalloc(&slot, sizeof(kernels::SlotRow)));
    TS_CUDA_RETURN_IF_ERROR(cudaMalloc(&remaining, sizeof(int32_t)));
    TS_CUDA_RETURN_IF_ERROR(cudaMalloc(&rows, sizeof(int32_t)));
    TS_CUDA_RETURN_IF_ERROR(cudaMallocHost(&slot_pinned, sizeof(kernels::SlotRow)));
    TS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(slot, 0, sizeof(kernels::SlotRow), stream));
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

enum class Mode { kHost, kHostSync, kDevice, kLoop, kWhileSwitch };

// What the timed runs launch; while_switch is null until its graph is built.
struct Launchers {
  GraphCache* cache = nullptr;
  TailLauncher* looper = nullptr;
  DeviceLoop* loop = nullptr;  // over its own cache, whose step graphs end with its scheduler
  WhileSwitchLoop* while_switch = nullptr;
  int32_t while_switch_body = 0;    // the SWITCH body every step runs
  double while_switch_step_us = 0;  // generous per-step allowance for its deadline
};

// Polls instead of cudaEventSynchronize: a WHILE loop that never ends would otherwise hang the
// bench. The deadline bounds the loop.
absl::Status WaitWithDeadline(cudaEvent_t event, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    const cudaError_t q = cudaEventQuery(event);
    if (q == cudaSuccess) return absl::OkStatus();
    if (q != cudaErrorNotReady) {
      return ::ts::kernels::CudaErrorToStatus(q, "cudaEventQuery(stop)", __FILE__, __LINE__);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("while+switch run still not done after ", timeout_s, " s"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// One timed run of `steps` steps; returns microseconds per step and checks the step counter.
absl::StatusOr<double> TimedRun(Mode mode, int32_t steps, const Launchers& l, Resources& r,
                                cudaStream_t stream) {
  if (mode == Mode::kWhileSwitch && l.while_switch == nullptr) {
    return absl::FailedPreconditionError("while+switch graph not built");
  }
  TS_ASSIGN_OR_RETURN(const int32_t before, r.Counter());
  // Both device loops read the same scalars: the body/bucket index, the steps left, a status.
  const bool device_loop = mode == Mode::kDevice || mode == Mode::kWhileSwitch;
  if (device_loop) {
    r.pinned[0] = mode == Mode::kWhileSwitch ? l.while_switch_body : 0;
    r.pinned[1] = steps;
    r.pinned[2] = 0;
    TS_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(r.scalars, r.pinned, sizeof(int32_t) * 3, cudaMemcpyHostToDevice, stream));
  }
  if (mode == Mode::kLoop) {
    // One ACTIVE slot that the step's counter kernel finishes after `steps` steps.
    *r.slot_pinned = kernels::SlotRow{};
    r.slot_pinned->state = kernels::kSlotActive;
    r.slot_pinned->prompt_len = 1;
    r.pinned[1] = steps;
    TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r.slot, r.slot_pinned, sizeof(kernels::SlotRow),
                                            cudaMemcpyHostToDevice, stream));
    TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r.remaining, r.pinned + 1, sizeof(int32_t),
                                            cudaMemcpyHostToDevice, stream));
  }
  TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(r.start, stream));
  switch (mode) {
    case Mode::kHost:
      for (int32_t i = 0; i < steps; ++i) TS_RETURN_IF_ERROR(l.cache->Launch(0, stream));
      break;
    case Mode::kHostSync:
      for (int32_t i = 0; i < steps; ++i) {
        TS_RETURN_IF_ERROR(l.cache->Launch(0, stream));
        // The host-driven mode's per-step sync on the step stream (it reads the tokens after).
        TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
      }
      break;
    case Mode::kDevice:
      TS_RETURN_IF_ERROR(l.looper->Launch(stream));
      break;
    case Mode::kLoop:
      TS_RETURN_IF_ERROR(l.loop->Launch(stream));
      break;
    case Mode::kWhileSwitch:
      TS_RETURN_IF_ERROR(l.while_switch->Launch(stream));
      break;
  }
  TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(r.stop, stream));
  if (mode == Mode::kWhileSwitch) {
    TS_RETURN_IF_ERROR(WaitWithDeadline(r.stop, 5.0 + 1e-6 * l.while_switch_step_us * steps));
  } else {
    TS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(r.stop));
  }
  float ms = 0;
  TS_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, r.start, r.stop));
  TS_ASSIGN_OR_RETURN(const int32_t after, r.Counter());
  if (mode == Mode::kLoop) {
    if (absl::Status s = l.loop->status(); !s.ok()) return StepCheckError(s.ToString());
    if (l.loop->exit_reason() != kLoopExitIdle) {
      return StepCheckError(absl::StrCat("device loop exited with reason ", l.loop->exit_reason()));
    }
  }
  if (device_loop) {
    TS_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(r.pinned, r.scalars, sizeof(int32_t) * 3, cudaMemcpyDeviceToHost));
    if (r.pinned[2] != 0) {
      return StepCheckError(absl::StrCat(
          mode == Mode::kDevice ? "device-side graph launch" : "while+switch scheduler",
          " failed with status ", r.pinned[2]));
    }
  }
  if (after - before != steps) {
    return StepCheckError(
        absl::StrCat("expected ", steps, " steps to run, the counter says ", after - before));
  }
  return 1000.0 * ms / steps;
}

absl::StatusOr<double> MedianPerStep(Mode mode, const Config& c, const Launchers& l, Resources& r,
                                     cudaStream_t stream) {
  // Warm-up: first launches upload and page in whatever the driver defers.
  TS_RETURN_IF_ERROR(TimedRun(mode, std::min(c.steps, 50), l, r, stream).status());
  std::vector<double> per_step;
  for (int32_t i = 0; i < c.reps; ++i) {
    TS_ASSIGN_OR_RETURN(const double us, TimedRun(mode, c.steps, l, r, stream));
    per_step.push_back(us);
  }
  return Median(per_step);
}

// Every SWITCH body is bucket 0's step captured at the cache's current regime, i.e. the graph the
// other modes launch. Returns the loop, or the error that stopped it being built.
absl::StatusOr<std::unique_ptr<WhileSwitchLoop>> BuildWhileSwitch(int32_t nodes, const Config& c,
                                                                  const CaptureFn& step,
                                                                  const GraphCache& cache,
                                                                  Resources& r,
                                                                  cudaStream_t stream) {
  const WhileSwitchParams params{.body_index = r.scalars,
                                 .remaining_steps = r.scalars + 1,
                                 .status = r.scalars + 2,
                                 .num_bodies = c.switch_bodies};
  const CaptureContext ctx{
      .bucket = cache.buckets()[0], .bucket_index = 0, .regime = cache.regime()};
  TS_ASSIGN_OR_RETURN(std::unique_ptr<WhileSwitchLoop> loop,
                      WhileSwitchLoop::Create(
                          params, [&](int32_t, cudaStream_t s) { return step(ctx, s); }, stream));
  for (size_t i = 0; i < loop->body_nodes().size(); ++i) {
    if (loop->body_nodes()[i] != nodes) {
      return StepCheckError(absl::StrCat("SWITCH body ", i, " captured ", loop->body_nodes()[i],
                                         " nodes, wanted ", nodes));
    }
  }
  return loop;
}

absl::StatusOr<SizeResult> RunSize(int32_t nodes, const Config& c, cudaStream_t stream) {
  // Heap-held so that a while+switch run past its deadline can leak them: freeing buffers or
  // execs that a running graph still uses would block forever.
  auto r = std::make_unique<Resources>();
  TS_RETURN_IF_ERROR(r->Init(stream));
  Resources* rp = r.get();
  const CaptureFn step = [rp, nodes](const CaptureContext& ctx, cudaStream_t s) -> absl::Status {
    TinyStepParams p{.buf = rp->buf,
                     .counter = rp->counter,
                     .nodes = nodes,
                     .shift = 1e-3f * static_cast<float>(ctx.regime.attention_num_splits)};
    TS_CUDA_RETURN_IF_ERROR(EnqueueTinyStep(p, s));
    return absl::OkStatus();
  };
  GraphCacheOptions opt;
  opt.buckets = {1};
  opt.device = c.device;
  opt.capture = step;
  auto cache = std::make_unique<GraphCache>(std::move(opt));
  TS_RETURN_IF_ERROR(cache->Build(stream));
  if (cache->node_count(0) != nodes) {
    return absl::InternalError(
        absl::StrCat("captured ", cache->node_count(0), " nodes, wanted ", nodes));
  }

  SizeResult res;
  res.nodes = nodes;
  std::vector<double> total, exec, capture;
  for (int32_t i = 0; i < c.updates + 5; ++i) {  // the first 5 are warm-up
    const Regime regime{.attention_num_splits = 1 + i % 2, .max_context_len = 1024 * (i % 4)};
    TS_RETURN_IF_ERROR(cache->UpdateRegime(regime, stream));
    if (i < 5) continue;
    total.push_back(cache->last_update().total_us);
    exec.push_back(cache->last_update().exec_update_us);
    capture.push_back(cache->last_update().capture_us);
  }
  res.update_total_us = Median(total);
  res.update_exec_us = Median(exec);
  res.update_capture_us = Median(capture);

  // The serving loop's graphs: the same step with the counter counting the slot down, ending with
  // the scheduler node (one node more than `nodes`).
  DeviceLoopParams lp;
  lp.num_buckets = 1;
  lp.buckets[0] = 1;
  lp.slots = r->slot;
  lp.num_slots = 1;
  lp.row_slots = r->rows;
  TS_ASSIGN_OR_RETURN(std::unique_ptr<DeviceLoop> device_loop, DeviceLoop::Create(lp, stream));
  GraphCacheOptions lopt;
  lopt.buckets = {1};
  lopt.device = c.device;
  lopt.log_progress = false;
  DeviceLoop* dl = device_loop.get();
  lopt.capture = [rp, nodes, dl](const CaptureContext&, cudaStream_t s) -> absl::Status {
    TinyStepParams p{.buf = rp->buf,
                     .counter = rp->counter,
                     .nodes = nodes,
                     .shift = 1e-3f,
                     .remaining = rp->remaining,
                     .slot_state = &rp->slot->state};
    TS_CUDA_RETURN_IF_ERROR(EnqueueTinyStep(p, s));
    return dl->EnqueueScheduler(s);
  };
  auto loop_cache = std::make_unique<GraphCache>(std::move(lopt));
  TS_RETURN_IF_ERROR(loop_cache->Build(stream));
  TS_RETURN_IF_ERROR(device_loop->BindTable(loop_cache->device_table()));

  TailLaunchParams loop{.table = cache->device_table(),
                        .num_buckets = cache->num_buckets(),
                        .bucket_index = r->scalars,
                        .remaining_steps = r->scalars + 1,
                        .status = r->scalars + 2};
  TS_ASSIGN_OR_RETURN(std::unique_ptr<TailLauncher> looper, TailLauncher::Create(loop, stream));
  Launchers l{.cache = cache.get(),
              .looper = looper.get(),
              .loop = device_loop.get(),
              // The last body, so that the SWITCH has to dispatch on a non-zero value.
              .while_switch_body = c.switch_bodies - 1,
              // About 10x the 1.7 us a graph node costs (docs/gpu-facts.md), plus the scheduler.
              .while_switch_step_us = 100.0 + 20.0 * nodes};
  TS_ASSIGN_OR_RETURN(res.host_us, MedianPerStep(Mode::kHost, c, l, *r, stream));
  TS_ASSIGN_OR_RETURN(res.host_sync_us, MedianPerStep(Mode::kHostSync, c, l, *r, stream));
  TS_ASSIGN_OR_RETURN(res.device_us, MedianPerStep(Mode::kDevice, c, l, *r, stream));
  TS_ASSIGN_OR_RETURN(res.loop_us, MedianPerStep(Mode::kLoop, c, l, *r, stream));

  absl::StatusOr<std::unique_ptr<WhileSwitchLoop>> ws =
      BuildWhileSwitch(nodes, c, step, *cache, *r, stream);
  absl::Status ws_status = ws.status();
  if (ws.ok()) {
    l.while_switch = ws->get();
    absl::StatusOr<double> us = MedianPerStep(Mode::kWhileSwitch, c, l, *r, stream);
    if (us.ok()) res.while_switch_us = *us;
    ws_status = us.status();
  }
  if (absl::IsDeadlineExceeded(ws_status)) {
    if (ws.ok()) (void)ws->release();
    (void)looper.release();
    (void)device_loop.release();
    (void)loop_cache.release();
    (void)cache.release();
    (void)r.release();
    return ws_status;
  }
  if (!ws_status.ok()) {
    // A failed runtime call stays the thread's last error, and the next launch check (the next
    // size's capture) would report it as its own. A sticky error survives this and stops the run.
    (void)cudaGetLastError();
    res.while_switch_error =
        absl::StrCat(absl::StatusCodeToString(ws_status.code()), ": ", ws_status.message());
    res.while_switch_check_failed = ws_status.GetPayload(kStepCheckPayload).has_value();
  }
  // The launchers and cache are destroyed next; nothing may still run on `stream`.
  TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return res;
}

void PrintTable(const cudaDeviceProp& prop, const Config& c,
                const std::vector<SizeResult>& results) {
  std::printf(
      "\ntailserve-graph-bench on %s: %d steps per run, median of %d runs; UpdateRegime "
      "median of %d (host clock, 1 bucket)\n",
      prop.name, c.steps, c.reps, c.updates);
  std::printf(
      "while+switch: one host launch per run of WHILE { scheduler kernel; SWITCH over %d copies "
      "of the step }, body %d every step\n",
      c.switch_bodies, c.switch_bodies - 1);
  std::printf("%6s | %12s %12s %12s | %12s %12s %12s %12s %12s\n", "nodes", "update us",
              "exec upd us", "capture us", "host us/st", "host+sync", "device tail", "loop",
              "while+switch");
  for (const SizeResult& r : results) {
    char ws[32] = "n/a";
    if (r.while_switch_error.empty()) {
      std::snprintf(ws, sizeof(ws), "%.2f", r.while_switch_us);
    }
    std::printf("%6d | %12.1f %12.1f %12.1f | %12.2f %12.2f %12.2f %12.2f %12s\n", r.nodes,
                r.update_total_us, r.update_exec_us, r.update_capture_us, r.host_us, r.host_sync_us,
                r.device_us, r.loop_us, ws);
  }
  for (const SizeResult& r : results) {
    if (r.while_switch_error.empty()) continue;
    std::printf("note: while+switch not measured at %d nodes (%s): %s\n", r.nodes,
                r.while_switch_check_failed ? "step check failed, exit code 1"
                                            : "build or launch failed, exit code unaffected",
                r.while_switch_error.c_str());
  }
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "GraphCache micro-benchmark: UpdateRegime cost and per-step launch time (host graph "
      "launch, host launch + sync, a scheduler graph that tail-launches the step and itself, the "
      "serving DeviceLoop whose step graphs end with its scheduler, host-launched conditional "
      "WHILE + SWITCH loop) for graphs of tiny kernels.");
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
    if (absl::IsDeadlineExceeded(r.status())) {
      // A graph may still be running: no cleanup (it would wait for it); the driver tears the
      // context down at process exit.
      PrintTable(prop, c, results);
      std::fflush(stdout);
      std::fprintf(stderr, "graph of %d nodes: %s\n", n, r.status().ToString().c_str());
      std::fflush(nullptr);
      std::_Exit(1);
    }
    if (!r.ok()) {
      std::fprintf(stderr, "graph of %d nodes: %s\n", n, r.status().ToString().c_str());
      return 1;
    }
    results.push_back(*r);
  }
  cudaStreamDestroy(stream);

  PrintTable(prop, c, results);
  for (const SizeResult& r : results) {
    if (r.while_switch_check_failed) return 1;
  }
  return 0;
}

}  // namespace
}  // namespace ts::graphs::bench

int main(int argc, char** argv) {
  return ts::graphs::bench::Main(argc, argv);
}
