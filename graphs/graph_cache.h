// GraphCache: one device-launchable CUDA graph per batch-size bucket, two execs per bucket
// (docs/architecture.md, Graph updates), and a device table of the current exec handles that a
// kernel scheduler reads before it tail-launches a step.
//
//   GraphCacheOptions opt;
//   opt.buckets = {1, 4, 16, 64};
//   opt.capture = [&](const CaptureContext& ctx, cudaStream_t s) { return EnqueueStep(ctx, s); };
//   GraphCache cache(std::move(opt));
//   TS_RETURN_IF_ERROR(cache.Build(stream));            // capture, instantiate x2, upload
//   TS_RETURN_IF_ERROR(cache.Launch(bucket_index, stream));  // host-driven mode: one per step
//   TS_RETURN_IF_ERROR(cache.UpdateRegime(new_regime, stream));  // exec update, never
//   re-instantiate
//   TS_RETURN_IF_ERROR(cache.PrepareRegime(next));  // the same minus the flip, ahead of time
//
// Capture contract (checked where the runtime lets us): the capture callback only ENQUEUES work
// on the stream it is given (and on streams forked from it with events) over buffers that were
// allocated before Build. It must not allocate (cudaMalloc is refused inside a thread-local
// capture; cudaMallocAsync would record an allocation node, which device-launchable graphs cannot
// hold and Build/UpdateRegime reject), synchronise, or enqueue host callbacks. It must produce
// the same graph topology for every regime of a bucket: a regime may change kernel arguments and
// grid sizes, never the number or order of nodes (e.g. keep the attention combine kernel in the
// graph and let it pass through when num_splits == 1). A topology change makes UpdateRegime fail
// with FailedPrecondition; the cache never re-instantiates behind the caller's back.
//
// Threading: one owner thread. Not copyable or movable (the device table address is handed out).
// Lifetime: destroy the cache only once nothing launched from it (host launches, or a device
// loop reading device_table()) can still run; exec destruction is deferred by the driver, the
// table's cudaFree waits for the device.
// Device loop: UpdateRegime is ordered on the stream it is given. A device loop that runs on that
// stream makes UpdateRegime wait until the loop has exited (it must pause at a step boundary
// first); updating while a loop runs on another stream is not safe with this API. A running loop
// changes regime by itself instead: PrepareRegime, PreparedTable handed to the loop, then
// AdoptDeviceFlip once it has switched (docs/device-loop.md, The attention regime).
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ts::graphs {

// Launch parameters that change with the serving regime without changing the graph's shape.
// UpdateRegime re-captures every bucket with new values and updates the execs in place.
struct Regime {
  int32_t attention_num_splits = 1;  // split-K factor of paged decode attention, >= 1
  int32_t max_context_len = 0;       // tokens the split count was chosen for; 0 = unspecified
  bool operator==(const Regime&) const = default;
};
std::string RegimeDebugString(const Regime& r);

// What the capture callback is building.
struct CaptureContext {
  int32_t bucket = 0;        // batch size of this graph (options.buckets[bucket_index])
  int32_t bucket_index = 0;  // index into options.buckets and into the device table
  Regime regime;
};

using CaptureFn = std::function<absl::Status(const CaptureContext& ctx, cudaStream_t stream)>;

struct GraphCacheOptions {
  std::vector<int32_t> buckets;  // batch sizes, strictly increasing, each >= 1
  int32_t device = 0;            // CUDA device ordinal every graph and the table live on
  Regime initial_regime;         // regime of the graphs Build captures
  CaptureFn capture;             // see the capture contract above
  bool log_progress = true;      // one line per bucket and a total on stderr during Build
};

struct BuildStats {
  int64_t total_nodes = 0;    // summed over buckets (one graph each; the second exec is a copy)
  double capture_ms = 0;      // host time inside the capture callbacks and stream capture
  double instantiate_ms = 0;  // host time of 2 x num_buckets cudaGraphInstantiate calls
  double upload_ms = 0;       // from the first upload enqueue until the build stream drained
  int64_t graph_memory_bytes = 0;  // cudaMemGetInfo delta over Build: device-wide, an estimate
};

// Host-clock cost of the last successful UpdateRegime, in microseconds.
struct UpdateStats {
  double wait_us = 0;         // host wait until the previous flip completed (idle execs idle)
  double capture_us = 0;      // re-capturing every bucket with the new regime
  double exec_update_us = 0;  // cudaGraphExecUpdate of every idle exec
  double upload_us = 0;       // enqueueing cudaGraphUpload of every idle exec (asynchronous)
  double flip_us = 0;         // enqueueing the device-table write and the flip event
  double total_us = 0;        // all of the above
  bool prepared = false;      // PrepareRegime had done all but the flip (the rest are then 0)
};

class GraphCache {
 public:
  // Stores the options; nothing touches the GPU until Build.
  explicit GraphCache(GraphCacheOptions options);
  ~GraphCache();
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;

  // Validates the options (InvalidArgument naming the field), then per bucket: captures the
  // callback (thread-local capture mode) on a private stream, checks that every node is one a
  // device graph may hold, instantiates two execs with cudaGraphInstantiateFlagDeviceLaunch,
  // uploads both on `stream`, and writes the device table on `stream`. Synchronises `stream` at
  // the end (startup only) so the memory estimate covers the uploads. Call once.
  absl::Status Build(cudaStream_t stream);

  // Host-driven mode: host-launches bucket `bucket_index`'s current exec on `stream`. Use the
  // same stream as UpdateRegime (or order the two yourself): the idle exec is known to be idle
  // only through that stream's order.
  absl::Status Launch(int32_t bucket_index, cudaStream_t stream);

  // Re-captures every bucket with `regime`, cudaGraphExecUpdate's each IDLE exec in place (never
  // re-instantiates), uploads it on `stream`, then flips current for every bucket at once and
  // writes the whole device table with one cudaMemcpyAsync on `stream`, so any work enqueued on
  // `stream` after this call (host launches, or a device loop started after it) sees the new
  // execs, and work before it the old ones. Before touching an idle exec it waits on the host
  // for the previous flip's event: the idle exec was last launched before that flip on `stream`.
  // On any failure no bucket flips and regime() is unchanged: FailedPrecondition for a topology
  // change (the capture contract), InvalidArgument for a node a device graph cannot hold.
  absl::Status UpdateRegime(const Regime& regime, cudaStream_t stream);

  // Does all of UpdateRegime(regime) but the flip, ahead of time: re-captures every bucket,
  // updates each idle exec in place and uploads it on a private stream. The current execs, and a
  // device loop running them on any stream, are untouched (the idle execs were last launched
  // before the previous flip, which this waits for). A later UpdateRegime with the same regime
  // then only waits for those uploads on its stream and flips, so a device loop that exits for a
  // regime change can be relaunched at once. Another UpdateRegime, or a PrepareRegime with
  // another regime, replaces what was prepared. The graphs in the execs are the same as
  // UpdateRegime's would be, so results do not depend on whether a regime was prepared.
  absl::Status PrepareRegime(const Regime& regime);
  // PrepareRegime one bucket per call, so that a caller with other work (the engine thread
  // draining the streams beside a running device loop) is never held for the whole capture:
  // returns true once every bucket is prepared (prepared() == regime then), false while buckets
  // remain. A call with another regime, or an UpdateRegime, starts over. On error nothing counts
  // as prepared and the current execs are untouched.
  absl::StatusOr<bool> PrepareRegimeStep(const Regime& regime);
  // The regime PrepareRegime left in the idle execs, if it has not been flipped to since.
  const std::optional<Regime>& prepared() const { return prepared_; }

  // A flip made on the device by a running loop's scheduler (docs/device-loop.md, The attention
  // regime). PreparedTable: [num_buckets] in device memory, the prepared execs, at an address
  // fixed for the cache's life (one table per exec slot, written by Build); `stream` is made to
  // wait for their uploads, so work enqueued on it afterwards may hand the table to a running
  // scheduler. FailedPrecondition unless prepared().
  absl::StatusOr<const cudaGraphExec_t*> PreparedTable(cudaStream_t stream);
  // Records that a scheduler switched to PreparedTable() by itself: the prepared execs become the
  // current ones and prepared() the regime, as after UpdateRegime, and device_table() is
  // rewritten on the cache's private stream. The caller guarantees that no old current exec runs
  // or will be launched (the step after the switch has started). FailedPrecondition unless
  // prepared().
  absl::Status AdoptDeviceFlip();

  // Smallest bucket index whose batch size holds `batch_size`; OutOfRange above the last bucket.
  absl::StatusOr<int32_t> BucketIndexFor(int32_t batch_size) const;

  bool built() const { return built_; }
  int32_t num_buckets() const { return static_cast<int32_t>(options_.buckets.size()); }
  const std::vector<int32_t>& buckets() const { return options_.buckets; }
  int32_t device() const { return options_.device; }
  const Regime& regime() const { return regime_; }

  // [num_buckets] in device memory: the current exec of each bucket, rewritten by UpdateRegime
  // (stream-ordered). What a device scheduler passes to cudaGraphLaunch(.., TailLaunch).
  const cudaGraphExec_t* device_table() const { return device_table_; }
  // Host copies of the handles. slot is 0 or 1; current_slot says which one the table holds.
  cudaGraphExec_t exec(int32_t bucket_index, int32_t slot) const;
  cudaGraphExec_t current_exec(int32_t bucket_index) const;
  int32_t current_slot(int32_t bucket_index) const;
  int64_t node_count(int32_t bucket_index) const;

  const BuildStats& build_stats() const { return build_stats_; }
  const UpdateStats& last_update() const { return last_update_; }
  // Counters that let tests prove updates never re-instantiate.
  int64_t instantiation_count() const { return instantiation_count_; }
  int64_t update_count() const { return update_count_; }

 private:
  struct Bucket {
    std::array<cudaGraphExec_t, 2> execs{nullptr, nullptr};
    int32_t current = 0;
    int64_t nodes = 0;
  };

  absl::Status ValidateOptions() const;
  absl::Status EnsureBuilt(const char* what) const;
  absl::Status ValidateRegime(const Regime& regime) const;
  // Waits for the previous flip, re-captures every bucket with `regime` and updates each idle
  // exec in place (UpdateRegime's and PrepareRegime's common part; no upload, no flip).
  absl::Status UpdateIdleExecs(const Regime& regime, UpdateStats* st);
  absl::Status CheckBucketIndex(int32_t bucket_index) const;
  // Captures options_.capture for one bucket into a new graph the caller owns.
  absl::StatusOr<cudaGraph_t> Capture(int32_t bucket_index, const Regime& regime);
  absl::Status BuildBucket(int32_t bucket_index, cudaStream_t stream);
  // Updates bucket `bucket_index`'s idle exec from `graph`; never instantiates.
  absl::Status UpdateIdleExec(int32_t bucket_index, cudaGraph_t graph);
  // Writes the current handles into host_table_ and enqueues the table copy + flip event.
  absl::Status PublishTable(cudaStream_t stream);

  GraphCacheOptions options_;
  Regime regime_;
  bool built_ = false;
  bool build_attempted_ = false;
  std::vector<Bucket> buckets_;
  cudaStream_t capture_stream_ = nullptr;    // private: callers' streams may be the legacy stream
  cudaGraphExec_t* device_table_ = nullptr;  // [num_buckets], device memory
  cudaGraphExec_t* host_table_ = nullptr;    // [num_buckets], pinned staging for the table copy
  cudaGraphExec_t* slot_tables_ = nullptr;   // [2][num_buckets], device: execs[slot] per bucket
  cudaEvent_t flip_event_ = nullptr;         // recorded on the update stream after each table write
  cudaEvent_t prepared_event_ = nullptr;     // recorded on capture_stream_ after PrepareRegime
  std::optional<Regime> prepared_;           // what the idle execs hold, see prepared()
  std::optional<Regime> preparing_;          // PrepareRegimeStep's regime, buckets < prepare_next_
  int32_t prepare_next_ = 0;                 //   of it in the idle execs and uploaded
  BuildStats build_stats_;
  UpdateStats last_update_;
  int64_t instantiation_count_ = 0;
  int64_t update_count_ = 0;
};

}  // namespace ts::graphs
