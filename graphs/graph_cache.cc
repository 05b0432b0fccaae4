#include "graphs/graph_cache.h"

#include <chrono>
#include <cstdio>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "graphs/device_guard.h"
#include "kernels/cuda_check.h"

namespace ts::graphs {
namespace {

using Clock = std::chrono::steady_clock;
double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}
double UsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

struct GraphDeleter {
  void operator()(cudaGraph_t g) const { (void)cudaGraphDestroy(g); }
};
using GraphPtr = std::unique_ptr<CUgraph_st, GraphDeleter>;

struct CapturedGraph {
  GraphPtr graph;
  int64_t nodes = 0;
};

const char* NodeTypeName(cudaGraphNodeType t) {
  switch (t) {
    case cudaGraphNodeTypeKernel:
      return "kernel";
    case cudaGraphNodeTypeMemcpy:
      return "memcpy";
    case cudaGraphNodeTypeMemset:
      return "memset";
    case cudaGraphNodeTypeHost:
      return "host callback";
    case cudaGraphNodeTypeGraph:
      return "child graph";
    case cudaGraphNodeTypeEmpty:
      return "empty";
    case cudaGraphNodeTypeWaitEvent:
      return "event wait";
    case cudaGraphNodeTypeEventRecord:
      return "event record";
    case cudaGraphNodeTypeExtSemaphoreSignal:
      return "external semaphore signal";
    case cudaGraphNodeTypeExtSemaphoreWait:
      return "external semaphore wait";
    case cudaGraphNodeTypeMemAlloc:
      return "memory allocation";
    case cudaGraphNodeTypeMemFree:
      return "memory free";
    case cudaGraphNodeTypeConditional:
      return "conditional";
    default:
      return "unknown";
  }
}

// The node kinds a graph instantiated with cudaGraphInstantiateFlagDeviceLaunch may hold.
bool DeviceLaunchable(cudaGraphNodeType t) {
  return t == cudaGraphNodeTypeKernel || t == cudaGraphNodeTypeMemcpy ||
         t == cudaGraphNodeTypeMemset || t == cudaGraphNodeTypeGraph;
}

const char* UpdateResultName(cudaGraphExecUpdateResult r) {
  switch (r) {
    case cudaGraphExecUpdateSuccess:
      return "success";
    case cudaGraphExecUpdateError:
      return "error";
    case cudaGraphExecUpdateErrorTopologyChanged:
      return "topology changed";
    case cudaGraphExecUpdateErrorNodeTypeChanged:
      return "node type changed";
    case cudaGraphExecUpdateErrorFunctionChanged:
      return "kernel function changed";
    case cudaGraphExecUpdateErrorParametersChanged:
      return "unsupported parameter change";
    case cudaGraphExecUpdateErrorNotSupported:
      return "node not supported";
    case cudaGraphExecUpdateErrorUnsupportedFunctionChange:
      return "unsupported function change";
    case cudaGraphExecUpdateErrorAttributesChanged:
      return "unsupported attribute change";
    default:
      return "unknown result";
  }
}

const char* InstantiateResultName(cudaGraphInstantiateResult r) {
  switch (r) {
    case cudaGraphInstantiateSuccess:
      return "success";
    case cudaGraphInstantiateError:
      return "error";
    case cudaGraphInstantiateInvalidStructure:
      return "invalid structure";
    case cudaGraphInstantiateNodeOperationNotSupported:
      return "node operation not supported";
    case cudaGraphInstantiateMultipleDevicesNotSupported:
      return "multiple devices";
    default:
      return "unknown result";
  }
}

std::string NodeDescription(cudaGraphNode_t node) {
  if (node == nullptr) return "no particular node";
  cudaGraphNodeType type;
  if (cudaGraphNodeGetType(node, &type) != cudaSuccess) {
    (void)cudaGetLastError();
    return "a node of unknown type";
  }
  return absl::StrCat("a ", NodeTypeName(type), " node");
}

absl::Status Annotate(const absl::Status& s, const std::string& prefix) {
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

std::string BucketLabel(int32_t bucket, const Regime& r) {
  return absl::StrFormat("graph bucket %d (%s)", bucket, RegimeDebugString(r));
}

}  // namespace

std::string RegimeDebugString(const Regime& r) {
  return absl::StrFormat("attention_num_splits=%d max_context_len=%d", r.attention_num_splits,
                         r.max_context_len);
}

GraphCache::GraphCache(GraphCacheOptions options)
    : options_(std::move(options)), regime_(options_.initial_regime) {}

GraphCache::~GraphCache() {
  // cudaGraphExecDestroy defers the release of an exec that is still in flight; cudaFree of the
  // table waits for the device. Errors are ignored: a destructor has no one to report to.
  // The owner may destroy the cache on a thread whose current device is another one.
  const DeviceGuard guard = DeviceGuard::SetOrIgnore(options_.device);
  for (Bucket& b : buckets_) {
    for (cudaGraphExec_t& e : b.execs) {
      if (e != nullptr) (void)cudaGraphExecDestroy(e);
      e = nullptr;
    }
  }
  if (flip_event_ != nullptr) (void)cudaEventDestroy(flip_event_);
  if (prepared_event_ != nullptr) (void)cudaEventDestroy(prepared_event_);
  if (device_table_ != nullptr) (void)cudaFree(device_table_);
  if (host_table_ != nullptr) (void)cudaFreeHost(host_table_);
  if (slot_tables_ != nullptr) (void)cudaFree(slot_tables_);
  if (capture_stream_ != nullptr) (void)cudaStreamDestroy(capture_stream_);
}

absl::Status GraphCache::ValidateOptions() const {
  const auto& b = options_.buckets;
  if (b.empty()) return absl::InvalidArgumentError("graph_cache.buckets is empty");
  for (size_t i = 0; i < b.size(); ++i) {
    if (b[i] < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("graph_cache.buckets[", i, "] must be >= 1, got ", b[i]));
    }
    if (i > 0 && b[i] <= b[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat("graph_cache.buckets must be strictly ",
                                                     "increasing, got ", b[i - 1], " then ", b[i],
                                                     " at index ", i));
    }
  }
  if (options_.device < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("graph_cache.device must be >= 0, got ", options_.device));
  }
  if (!options_.capture) return absl::InvalidArgumentError("graph_cache.capture is not set");
  if (options_.initial_regime.attention_num_splits < 1 ||
      options_.initial_regime.max_context_len < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "graph_cache.initial_regime is invalid: ", RegimeDebugString(options_.initial_regime),
        " (attention_num_splits >= 1, max_context_len >= 0)"));
  }
  return absl::OkStatus();
}

absl::Status GraphCache::EnsureBuilt(const char* what) const {
  if (built_) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("GraphCache::", what, " before a successful Build"));
}

absl::Status GraphCache::CheckBucketIndex(int32_t bucket_index) const {
  if (bucket_index >= 0 && bucket_index < num_buckets()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("bucket_index must be in [0, ", num_buckets(), "), got ", bucket_index));
}

absl::StatusOr<int32_t> GraphCache::BucketIndexFor(int32_t batch_size) const {
  if (batch_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("batch_size must be >= 1, got ", batch_size));
  }
  for (int32_t i = 0; i < num_buckets(); ++i) {
    if (options_.buckets[i] >= batch_size) return i;
  }
  return absl::OutOfRangeError(absl::StrCat("batch_size ", batch_size, " exceeds the largest ",
                                            "graph bucket ", options_.buckets.back()));
}

cudaGraphExec_t GraphCache::exec(int32_t bucket_index, int32_t slot) const {
  TS_CHECK(CheckBucketIndex(bucket_index).ok());
  TS_CHECK(slot == 0 || slot == 1);
  return built_ ? buckets_[bucket_index].execs[slot] : nullptr;
}

cudaGraphExec_t GraphCache::current_exec(int32_t bucket_index) const {
  return exec(bucket_index, current_slot(bucket_index));
}

int32_t GraphCache::current_slot(int32_t bucket_index) const {
  TS_CHECK(CheckBucketIndex(bucket_index).ok());
  return built_ ? buckets_[bucket_index].current : 0;
}

int64_t GraphCache::node_count(int32_t bucket_index) const {
  TS_CHECK(CheckBucketIndex(bucket_index).ok());
  return built_ ? buckets_[bucket_index].nodes : 0;
}

namespace {

// Captures one bucket on `stream` (thread-local mode) and checks every node is device-launchable.
absl::StatusOr<CapturedGraph> CaptureOne(const CaptureFn& capture, const CaptureContext& ctx,
                                         cudaStream_t stream) {
  const std::string label = BucketLabel(ctx.bucket, ctx.regime);
  TS_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const absl::Status cb = capture(ctx, stream);
  cudaGraph_t raw = nullptr;
  // Always end the capture, also after a callback error, so the stream is usable again.
  const cudaError_t end = cudaStreamEndCapture(stream, &raw);
  GraphPtr graph(raw);
  if (!cb.ok()) {
    (void)cudaGetLastError();  // a refused call inside the callback; the callback's status says it
    return Annotate(cb, absl::StrCat(label, ": capture callback failed: "));
  }
  if (end != cudaSuccess || raw == nullptr) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        label, ": stream capture was invalidated (", cudaGetErrorName(end),
        "): the capture callback made a call that is illegal during capture (allocation, "
        "synchronisation, use of the legacy stream, or work joined from an uncaptured stream)"));
  }
  size_t n = 0;
  TS_CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(raw, nullptr, &n));
  if (n == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(label,
                     ": the capture callback enqueued no work; a device-launchable graph "
                     "needs at least one kernel, memcpy or memset node"));
  }
  std::vector<cudaGraphNode_t> nodes(n);
  TS_CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(raw, nodes.data(), &n));
  for (size_t i = 0; i < n; ++i) {
    cudaGraphNodeType type;
    TS_CUDA_RETURN_IF_ERROR(cudaGraphNodeGetType(nodes[i], &type));
    if (!DeviceLaunchable(type)) {
      return absl::InvalidArgumentError(
          absl::StrCat(label, ": the capture callback recorded a ", NodeTypeName(type),
                       " node (node ", i, " of ", n,
                       "); a device-launchable graph holds only kernel, memcpy, memset and "
                       "child-graph nodes: allocate before Build, and do not record events or host "
                       "callbacks during capture"));
    }
  }
  return CapturedGraph{std::move(graph), static_cast<int64_t>(n)};
}

}  // namespace

absl::StatusOr<cudaGraph_t> GraphCache::Capture(int32_t bucket_index, const Regime& regime) {
  const CaptureContext ctx{options_.buckets[bucket_index], bucket_index, regime};
  TS_ASSIGN_OR_RETURN(CapturedGraph g, CaptureOne(options_.capture, ctx, capture_stream_));
  return g.graph.release();
}

absl::Status GraphCache::BuildBucket(int32_t bucket_index, cudaStream_t stream) {
  Bucket& b = buckets_[bucket_index];
  const int32_t bucket = options_.buckets[bucket_index];
  const auto t_capture = Clock::now();
  TS_ASSIGN_OR_RETURN(cudaGraph_t raw, Capture(bucket_index, regime_));
  GraphPtr graph(raw);
  const double capture_ms = MsSince(t_capture);
  size_t n = 0;
  TS_CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(raw, nullptr, &n));
  b.nodes = static_cast<int64_t>(n);

  const auto t_inst = Clock::now();
  for (int slot = 0; slot < 2; ++slot) {
    cudaGraphInstantiateParams params{};
    params.flags = cudaGraphInstantiateFlagDeviceLaunch;
    const cudaError_t e = cudaGraphInstantiateWithParams(&b.execs[slot], raw, &params);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      b.execs[slot] = nullptr;
      return absl::InternalError(absl::StrCat(
          BucketLabel(bucket, regime_), ": cudaGraphInstantiate(DeviceLaunch) of exec ", slot,
          " failed: ", cudaGetErrorName(e), ", ", InstantiateResultName(params.result_out), " at ",
          NodeDescription(params.errNode_out)));
    }
    ++instantiation_count_;
  }
  const double inst_ms = MsSince(t_inst);
  // A device graph must be uploaded before a kernel may launch it (a host launch would do it
  // implicitly; the device loop never host-launches).
  TS_CUDA_RETURN_IF_ERROR(cudaGraphUpload(b.execs[0], stream));
  TS_CUDA_RETURN_IF_ERROR(cudaGraphUpload(b.execs[1], stream));
  b.current = 0;

  build_stats_.total_nodes += b.nodes;
  build_stats_.capture_ms += capture_ms;
  build_stats_.instantiate_ms += inst_ms;
  if (options_.log_progress) {
    std::fprintf(stderr, "graph bucket %d: %lld nodes, captured in %.1f ms, 2 execs in %.1f ms\n",
                 bucket, static_cast<long long>(b.nodes), capture_ms, inst_ms);
  }
  return absl::OkStatus();
}

absl::Status GraphCache::PublishTable(cudaStream_t stream) {
  for (int32_t i = 0; i < num_buckets(); ++i)
    host_table_[i] = buckets_[i].execs[buckets_[i].current];
  TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device_table_, host_table_,
                                          sizeof(cudaGraphExec_t) * num_buckets(),
                                          cudaMemcpyHostToDevice, stream));
  TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(flip_event_, stream));
  return absl::OkStatus();
}

absl::Status GraphCache::Build(cudaStream_t stream) {
  if (build_attempted_) {
    return absl::FailedPreconditionError("GraphCache::Build may be called once");
  }
  build_attempted_ = true;
  TS_RETURN_IF_ERROR(ValidateOptions());
  TS_ASSIGN_OR_RETURN(DeviceGuard guard, DeviceGuard::Set(options_.device));
  size_t free_before = 0, free_after = 0, total = 0;
  TS_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_before, &total));

  const int32_t n = num_buckets();
  buckets_.assign(n, Bucket{});
  TS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&capture_stream_, cudaStreamNonBlocking));
  TS_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&flip_event_, cudaEventDisableTiming));
  TS_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&prepared_event_, cudaEventDisableTiming));
  TS_CUDA_RETURN_IF_ERROR(cudaMalloc(&device_table_, sizeof(cudaGraphExec_t) * n));
  TS_CUDA_RETURN_IF_ERROR(cudaMallocHost(&host_table_, sizeof(cudaGraphExec_t) * n));

  for (int32_t i = 0; i < n; ++i) TS_RETURN_IF_ERROR(BuildBucket(i, stream));
  const auto t_upload = Clock::now();
  TS_RETURN_IF_ERROR(PublishTable(stream));
  // The execs never change handle (updates are in place), so the per-slot tables are written once.
  std::vector<cudaGraphExec_t> slots(2 * static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    slots[i] = buckets_[i].execs[0];
    slots[n + i] = buckets_[i].execs[1];
  }
  TS_CUDA_RETURN_IF_ERROR(cudaMalloc(&slot_tables_, sizeof(cudaGraphExec_t) * slots.size()));
  TS_CUDA_RETURN_IF_ERROR(cudaMemcpy(
      slot_tables_, slots.data(), sizeof(cudaGraphExec_t) * slots.size(), cudaMemcpyHostToDevice));
  // Startup only: waits for the uploads and the table write on `stream`, so the memory estimate
  // covers the uploaded graphs and a device scheduler started on any stream finds the table.
  TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  build_stats_.upload_ms = MsSince(t_upload);
  TS_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_after, &total));
  build_stats_.graph_memory_bytes =
      static_cast<int64_t>(free_before) - static_cast<int64_t>(free_after);
  built_ = true;
  if (options_.log_progress) {
    std::fprintf(stderr,
                 "graph cache: %d buckets, %lld nodes, capture %.1f ms + instantiate %.1f ms "
                 "(2 execs per bucket), graph memory ~%.1f MiB (cudaMemGetInfo delta)\n",
                 n, static_cast<long long>(build_stats_.total_nodes), build_stats_.capture_ms,
                 build_stats_.instantiate_ms,
                 static_cast<double>(build_stats_.graph_memory_bytes) / (1024.0 * 1024.0));
  }
  return absl::OkStatus();
}

absl::Status GraphCache::Launch(int32_t bucket_index, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(EnsureBuilt("Launch"));
  TS_RETURN_IF_ERROR(CheckBucketIndex(bucket_index));
  const Bucket& b = buckets_[bucket_index];
  // The exec belongs to options_.device; the calling thread may have another device current.
  TS_ASSIGN_OR_RETURN(DeviceGuard guard, DeviceGuard::Set(options_.device));
  TS_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(b.execs[b.current], stream));
  return absl::OkStatus();
}

absl::Status GraphCache::UpdateIdleExec(int32_t bucket_index, cudaGraph_t graph) {
  const Bucket& b = buckets_[bucket_index];
  cudaGraphExec_t idle = b.execs[b.current ^ 1];
  cudaGraphExecUpdateResultInfo info{};
  const cudaError_t e = cudaGraphExecUpdate(idle, graph, &info);
  if (e == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();  // not sticky: keep it out of the caller's next error check
  if (e != cudaErrorGraphExecUpdateFailure) {
    return kernels::CudaErrorToStatus(e, "cudaGraphExecUpdate", __FILE__, __LINE__);
  }
  size_t new_nodes = 0;
  (void)cudaGraphGetNodes(graph, nullptr, &new_nodes);
  return absl::FailedPreconditionError(absl::StrFormat(
      "%s: cudaGraphExecUpdate refused the update (%s, at %s; the new capture has %d nodes, the "
      "exec %d). The capture callback must keep a bucket's topology fixed across regimes; the "
      "cache does not re-instantiate (docs/architecture.md, Graph updates), and no bucket was "
      "flipped",
      BucketLabel(options_.buckets[bucket_index], regime_), UpdateResultName(info.result),
      NodeDescription(info.errorNode), static_cast<int64_t>(new_nodes), b.nodes));
}

absl::Status GraphCache::ValidateRegime(const Regime& regime) const {
  if (regime.attention_num_splits < 1) {
    return absl::InvalidArgumentError(absl::StrCat("regime.attention_num_splits must be >= 1, got ",
                                                   regime.attention_num_splits));
  }
  if (regime.max_context_len < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("regime.max_context_len must be >= 0, got ", regime.max_context_len));
  }
  return absl::OkStatus();
}

absl::Status GraphCache::UpdateIdleExecs(const Regime& regime, UpdateStats* st) {
  // Waits on the previous flip (Build's or the last update's table write on its stream): every
  // launch of a now-idle exec was enqueued before it, so once it completed no idle exec runs,
  // and a device graph must not be updated while it runs. Also frees host_table_ for reuse.
  auto t = Clock::now();
  TS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(flip_event_));
  st->wait_us = UsSince(t);

  // Capture every bucket first: a capture error then leaves every exec untouched.
  t = Clock::now();
  const int32_t n = num_buckets();
  std::vector<GraphPtr> graphs;
  graphs.reserve(n);
  for (int32_t i = 0; i < n; ++i) {
    TS_ASSIGN_OR_RETURN(cudaGraph_t g, Capture(i, regime));
    graphs.emplace_back(g);
  }
  st->capture_us = UsSince(t);

  // From here on the idle execs hold neither the old prepared regime (nor a part of one) nor, on
  // failure, the new.
  prepared_.reset();
  preparing_.reset();
  t = Clock::now();
  for (int32_t i = 0; i < n; ++i) TS_RETURN_IF_ERROR(UpdateIdleExec(i, graphs[i].get()));
  st->exec_update_us = UsSince(t);
  return absl::OkStatus();
}

absl::Status GraphCache::PrepareRegime(const Regime& regime) {
  for (;;) {
    TS_ASSIGN_OR_RETURN(const bool done, PrepareRegimeStep(regime));
    if (done) return absl::OkStatus();
  }
}

absl::StatusOr<bool> GraphCache::PrepareRegimeStep(const Regime& regime) {
  TS_RETURN_IF_ERROR(EnsureBuilt("PrepareRegime"));
  TS_RETURN_IF_ERROR(ValidateRegime(regime));
  if (prepared_ == regime) return true;
  TS_ASSIGN_OR_RETURN(DeviceGuard guard, DeviceGuard::Set(options_.device));
  if (preparing_ != regime) {
    // As in UpdateIdleExecs: the idle execs are idle once the previous flip has completed.
    TS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(flip_event_));
    prepared_.reset();
    preparing_ = regime;
    prepare_next_ = 0;
  }
  const int32_t i = prepare_next_;
  absl::Status s = [&]() -> absl::Status {
    TS_ASSIGN_OR_RETURN(cudaGraph_t g, Capture(i, regime));
    GraphPtr graph(g);
    TS_RETURN_IF_ERROR(UpdateIdleExec(i, graph.get()));
    // On the private stream, beside whatever runs the current execs; UpdateRegime orders its
    // flip after these uploads through prepared_event_.
    TS_CUDA_RETURN_IF_ERROR(
        cudaGraphUpload(buckets_[i].execs[buckets_[i].current ^ 1], capture_stream_));
    return absl::OkStatus();
  }();
  if (!s.ok()) {
    preparing_.reset();
    return s;
  }
  if (++prepare_next_ < num_buckets()) return false;
  TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(prepared_event_, capture_stream_));
  preparing_.reset();
  prepared_ = regime;
  return true;
}

absl::Status GraphCache::UpdateRegime(const Regime& regime, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(EnsureBuilt("UpdateRegime"));
  TS_RETURN_IF_ERROR(ValidateRegime(regime));
  TS_ASSIGN_OR_RETURN(DeviceGuard guard, DeviceGuard::Set(options_.device));
  UpdateStats st;
  const auto t0 = Clock::now();
  if (prepared_ == regime) {
    // PrepareRegime did the capture, the exec updates and the uploads: only the flip is left,
    // after those uploads.
    TS_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, prepared_event_, 0));
    st.prepared = true;
  } else {
    TS_RETURN_IF_ERROR(UpdateIdleExecs(regime, &st));
    // An updated device graph takes effect only after it is uploaded again.
    const auto t = Clock::now();
    for (int32_t i = 0; i < num_buckets(); ++i) {
      TS_CUDA_RETURN_IF_ERROR(cudaGraphUpload(buckets_[i].execs[buckets_[i].current ^ 1], stream));
    }
    st.upload_us = UsSince(t);
  }

  const auto t = Clock::now();
  for (Bucket& b : buckets_) b.current ^= 1;
  if (absl::Status s = PublishTable(stream); !s.ok()) {
    for (Bucket& b : buckets_) b.current ^= 1;  // nothing was published: keep serving the old
    return s;
  }
  prepared_.reset();  // the prepared execs are current now
  st.flip_us = UsSince(t);
  st.total_us = UsSince(t0);
  regime_ = regime;
  last_update_ = st;
  ++update_count_;
  return absl::OkStatus();
}

absl::StatusOr<const cudaGraphExec_t*> GraphCache::PreparedTable(cudaStream_t stream) {
  TS_RETURN_IF_ERROR(EnsureBuilt("PreparedTable"));
  if (!prepared_) return absl::FailedPreconditionError("GraphCache::PreparedTable: none prepared");
  TS_ASSIGN_OR_RETURN(DeviceGuard guard, DeviceGuard::Set(options_.device));
  TS_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, prepared_event_, 0));
  // Every bucket flips together, so bucket 0's idle slot is every bucket's.
  return slot_tables_ + static_cast<size_t>(buckets_[0].current ^ 1) * num_buckets();
}

absl::Status GraphCache::AdoptDeviceFlip() {
  TS_RETURN_IF_ERROR(EnsureBuilt("AdoptDeviceFlip"));
  if (!prepared_)
    return absl::FailedPreconditionError("GraphCache::AdoptDeviceFlip: none prepared");
  TS_ASSIGN_OR_RETURN(DeviceGuard guard, DeviceGuard::Set(options_.device));
  // host_table_ is free once the previous table write has run.
  TS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(flip_event_));
  for (Bucket& b : buckets_) b.current ^= 1;
  // On the private stream: the running loop reads the table it switched to, not this one, and the
  // next launch on any stream is enqueued after this copy has been waited for (flip_event_, which
  // the next update or preparation waits on too).
  if (absl::Status s = PublishTable(capture_stream_); !s.ok()) {
    for (Bucket& b : buckets_) b.current ^= 1;
    return s;
  }
  TS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(flip_event_));
  regime_ = *prepared_;
  prepared_.reset();
  ++update_count_;
  return absl::OkStatus();
}

}  // namespace ts::graphs
