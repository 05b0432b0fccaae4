// The gRPC side of tailserve-load: channels, GetModelInfo, and the request driver. Calls use the
// callback API (one ClientReadReactor per stream), so thousands of in-flight streams need no
// threads of their own; one driver thread paces the sends.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/load/options.h"
#include "bench/load/stats.h"
#include "bench/load/workload.h"
#include "nlohmann/json.hpp"
#include "tailserve/v1/generation.grpc.pb.h"

namespace ts::load {

struct RunResult {
  std::vector<RequestRecord> records;  // measured requests, ascending index
  double wall_s = 0;                   // measured phase, first send to last stream end
  int64_t cancelled_at_drain = 0;      // in flight when drain_timeout_s ran out
  bool interrupted = false;            // RequestStop() was called
  // The server's GetStats just before the measured phase (after the warmup) and just after it;
  // absent where a call failed. Its counters are published once per engine step, so a delta may
  // miss or include the tokens of a step at either edge.
  std::optional<tailserve::v1::ServerStats> server_before, server_after;
};

class LoadClient {
 public:
  // Opens options.channels connections to options.target and waits until all are ready, up to
  // options.connect_timeout_s. UNAVAILABLE (naming the target) when the server cannot be reached.
  static absl::StatusOr<std::unique_ptr<LoadClient>> Connect(const LoadOptions& options);

  absl::StatusOr<tailserve::v1::ModelInfo> GetModelInfo();
  absl::StatusOr<tailserve::v1::ServerStats> GetStats();

  // Sends options.warmup_requests (closed loop, not recorded), then the measured run. Per-request
  // failures are recorded, not returned; an error here means the run itself could not proceed.
  absl::StatusOr<RunResult> Run(const WorkloadOptions& workload);

  tailserve::v1::Generation::Stub* stub(size_t i) { return stubs_[i % stubs_.size()].get(); }
  const LoadOptions& options() const { return options_; }

 private:
  explicit LoadClient(const LoadOptions& options) : options_(options) {}

  LoadOptions options_;
  std::vector<std::unique_ptr<tailserve::v1::Generation::Stub>> stubs_;  // [channels]
};

// Stops sending and cancels in-flight requests; safe to call from a signal handler.
void RequestStop();
bool StopRequested();

// "OK", "UNAVAILABLE", ... for a grpc::StatusCode value.
std::string StatusCodeName(int code);

nlohmann::json ModelInfoToJson(const tailserve::v1::ModelInfo& info);
// What the server's counters moved by between two GetStats (docs/load-client.md, Server counters).
nlohmann::json ServerCountersToJson(const tailserve::v1::ServerStats& before,
                                    const tailserve::v1::ServerStats& after);

}  // namespace ts::load
