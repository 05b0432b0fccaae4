#include "bench/load/client.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "bench/common/grpc_code.h"
#include "bench/load/arrivals.h"
#include "common/status.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"

namespace ts::load {
namespace {

namespace v1 = ::tailserve::v1;
using SteadyClock = std::chrono::steady_clock;

std::atomic<bool> g_stop{false};

// How often a waiting driver re-checks the stop flag.
constexpr auto kPollSlice = std::chrono::milliseconds(50);
// Warmup requests use indices far from the measured ones, so they draw different prompts.
constexpr uint64_t kWarmupIndexBase = uint64_t{1} << 48;
// After TryCancel gRPC still owes each call its OnDone; waiting longer than this means a bug.
constexpr auto kCancelGrace = std::chrono::seconds(30);

class RunClock {
 public:
  RunClock() : t0_(SteadyClock::now()) {}
  double NowMs() const {
    return std::chrono::duration<double, std::milli>(SteadyClock::now() - t0_).count();
  }
  SteadyClock::time_point At(double ms) const {
    return t0_ + std::chrono::duration_cast<SteadyClock::duration>(
                     std::chrono::duration<double, std::milli>(ms));
  }

 private:
  SteadyClock::time_point t0_;
};

std::string FinishReasonName(v1::FinishReason r) {
  std::string name = v1::FinishReason_Name(r);
  constexpr std::string_view kPrefix = "FINISH_REASON_";
  if (name.starts_with(kPrefix)) name.erase(0, kPrefix.size());
  return name;
}

struct PhaseSpec {
  LoopMode mode = LoopMode::kClosed;
  double rate_per_s = 0;
  int32_t concurrency = 1;
  int64_t num_requests = 0;
  double duration_s = 0;
  uint64_t index_base = 0;
  std::string id_prefix;
};

class Phase;

// One Generate stream. Owns its request and record; deletes itself in OnDone.
class GenerateCall final : public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  GenerateCall(Phase* phase, const RunClock* clock, v1::GenerateRequest request,
               RequestRecord record, double timeout_s)
      : phase_(phase), clock_(clock), request_(std::move(request)), record_(std::move(record)) {
    if (timeout_s > 0) {
      context_.set_deadline(std::chrono::system_clock::now() +
                            std::chrono::duration_cast<std::chrono::system_clock::duration>(
                                std::chrono::duration<double>(timeout_s)));
    }
  }

  void Start(v1::Generation::Stub* stub) {
    stub->async()->Generate(&context_, &request_, this);
    StartRead(&response_);
    record_.send_ms = clock_->NowMs();
    StartCall();
  }

  // Only called by Phase while holding its lock and while this call is still registered live
  // (OnDone detaches it before deleting it).
  void Cancel() { context_.TryCancel(); }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // stream over; OnDone follows with the status
    const double now_ms = clock_->NowMs();
    if (response_.token_ids_size() > 0) {
      record_.message_ms.push_back(now_ms);
      record_.message_tokens.push_back(response_.token_ids_size());
    }
    if (response_.has_usage()) {
      record_.usage_completion_tokens = response_.usage().completion_tokens();
      record_.usage_prompt_tokens = response_.usage().prompt_tokens();
    }
    if (response_.has_timing()) {
      const v1::Timing& t = response_.timing();
      record_.server = ServerTiming{.has = true,
                                    .preprocess_ms = t.preprocess_us() / 1000.0,
                                    .queue_ms = t.queue_us() / 1000.0,
                                    .prefill_wait_ms = t.prefill_wait_us() / 1000.0,
                                    .prefill_ms = t.prefill_us() / 1000.0,
                                    .decode_ms = t.decode_us() / 1000.0};
    }
    if (response_.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      record_.finish_reason = FinishReasonName(response_.finish_reason());
    }
    if (record_.request_id.empty()) record_.request_id = response_.request_id();
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override;

 private:
  Phase* phase_;
  const RunClock* clock_;
  grpc::ClientContext context_;
  v1::GenerateRequest request_;
  v1::GenerateResponse response_;
  RequestRecord record_;
};

// Drives one phase (warmup or measured): paces sends, tracks live calls, drains at the end.
class Phase {
 public:
  Phase(LoadClient* client, const PhaseSpec& spec, const WorkloadOptions& workload)
      : client_(client), spec_(spec), workload_(workload) {
    for (int32_t s = 0; s < spec_.concurrency; ++s) free_since_ms_.push_back(0.0);
  }

  absl::StatusOr<RunResult> Run() {
    absl::Status driven = spec_.mode == LoopMode::kOpen ? DriveOpenLoop() : DriveClosedLoop();
    if (!driven.ok()) {
      // Requests already started still reference this phase; let them finish first.
      (void)Drain(0);
      return driven;
    }
    return Drain(client_->options().drain_timeout_s);
  }

  // OnDone, step 1: from now on nobody may Cancel() this call.
  void Detach(GenerateCall* call) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(call);
  }

  // OnDone, step 2, after the call object (and with it its ClientContext's reference to the
  // channel) is gone. Draining waits for this, so the channel's last reference is never dropped
  // on a gRPC callback thread, which gRPC 1.51 cannot survive (grpc/grpc#32584).
  void Finish(RequestRecord record) {
    std::lock_guard<std::mutex> lock(mu_);
    --outstanding_;
    free_since_ms_.push_back(record.end_ms);
    done_.push_back(std::move(record));
    cv_.notify_all();
  }

 private:
  struct Prepared {
    v1::GenerateRequest request;
    RequestRecord record;
  };

  Prepared Prepare(int64_t i) const {
    const RequestSpec spec =
        MakeRequestSpec(workload_, spec_.index_base + static_cast<uint64_t>(i));
    const LoadOptions& o = client_->options();
    Prepared p;
    p.record.index = i;
    p.record.request_id = absl::StrCat(spec_.id_prefix, "-", i);
    p.record.input_tokens = spec.input_len;
    p.record.prompt_entry = spec.prompt_entry;
    p.record.requested_output_tokens = spec.output_len;
    v1::GenerateRequest& r = p.request;
    r.set_request_id(p.record.request_id);
    if (workload_.text) {
      r.set_prompt_text(spec.prompt_text);
      r.mutable_text()->set_add_special_tokens(o.add_special_tokens);
    } else {
      r.mutable_prompt_token_ids()->mutable_ids()->Assign(spec.prompt_ids.begin(),
                                                          spec.prompt_ids.end());
    }
    v1::SamplingParams* s = r.mutable_sampling();
    s->set_temperature(o.sampling.temperature);
    if (o.sampling.top_k) s->set_top_k(*o.sampling.top_k);
    if (o.sampling.top_p) s->set_top_p(*o.sampling.top_p);
    if (o.sampling.min_p) s->set_min_p(*o.sampling.min_p);
    if (o.sampling.repetition_penalty) s->set_repetition_penalty(*o.sampling.repetition_penalty);
    if (o.sampling.presence_penalty) s->set_presence_penalty(*o.sampling.presence_penalty);
    if (o.sampling.frequency_penalty) s->set_frequency_penalty(*o.sampling.frequency_penalty);
    if (o.sampling.send_seed) s->set_seed(spec.sampling_seed);
    r.mutable_stop()->set_max_new_tokens(spec.output_len);
    r.mutable_stop()->set_ignore_eos(true);
    return p;
  }

  void Launch(Prepared p, double intended_ms) {
    p.record.intended_ms = intended_ms;
    auto* call = new GenerateCall(this, &clock_, std::move(p.request), std::move(p.record),
                                  client_->options().request_timeout_s);
    {
      // Registered before StartCall, so OnDone always finds it.
      std::lock_guard<std::mutex> lock(mu_);
      live_.insert(call);
      ++outstanding_;
    }
    call->Start(client_->stub(next_stub_++));
  }

  bool SendingOver(int64_t i) const {
    if (StopRequested()) return true;
    if (spec_.num_requests > 0 && i >= spec_.num_requests) return true;
    return spec_.duration_s > 0 && clock_.NowMs() >= spec_.duration_s * 1000.0;
  }

  absl::Status DriveOpenLoop() {
    TS_ASSIGN_OR_RETURN(
        PoissonArrivals arrivals,
        PoissonArrivals::Create({.rate_per_s = spec_.rate_per_s, .seed = client_->options().seed}));
    for (int64_t i = 0; !SendingOver(i); ++i) {
      const double intended_ms = arrivals.Next() * 1000.0;
      if (spec_.duration_s > 0 && intended_ms >= spec_.duration_s * 1000.0) break;
      Prepared p = Prepare(i);  // built ahead of its send time, so it adds no send lag
      std::unique_lock<std::mutex> lock(mu_);
      const auto when = clock_.At(intended_ms);
      while (!StopRequested() && SteadyClock::now() < when) {
        cv_.wait_until(lock, std::min(when, SteadyClock::now() + kPollSlice));
      }
      lock.unlock();
      if (StopRequested()) break;
      Launch(std::move(p), intended_ms);
    }
    return absl::OkStatus();
  }

  absl::Status DriveClosedLoop() {
    for (int64_t i = 0; !SendingOver(i); ++i) {
      Prepared p = Prepare(i);
      std::unique_lock<std::mutex> lock(mu_);
      while (free_since_ms_.empty() && !SendingOver(i)) cv_.wait_for(lock, kPollSlice);
      if (free_since_ms_.empty() || SendingOver(i)) break;
      // The slot's request is "intended" the moment the previous one on it finished.
      const double intended_ms = free_since_ms_.front();
      free_since_ms_.pop_front();
      lock.unlock();
      Launch(std::move(p), intended_ms);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<RunResult> Drain(double timeout_s) {
    RunResult result;
    std::unique_lock<std::mutex> lock(mu_);
    const auto deadline = SteadyClock::now() + std::chrono::duration_cast<SteadyClock::duration>(
                                                   std::chrono::duration<double>(timeout_s));
    while (outstanding_ > 0 && !StopRequested() && SteadyClock::now() < deadline) {
      cv_.wait_until(lock, std::min(deadline, SteadyClock::now() + kPollSlice));
    }
    if (outstanding_ > 0) {
      result.cancelled_at_drain = static_cast<int64_t>(live_.size());
      for (GenerateCall* call : live_) call->Cancel();
      if (!cv_.wait_for(lock, kCancelGrace, [&] { return outstanding_ == 0; })) {
        return absl::InternalError(
            absl::StrCat(outstanding_, " cancelled requests never completed; giving up"));
      }
    }
    result.interrupted = StopRequested();
    result.records = std::move(done_);
    std::sort(result.records.begin(), result.records.end(),
              [](const RequestRecord& a, const RequestRecord& b) { return a.index < b.index; });
    double first = 0, last = 0;
    for (size_t k = 0; k < result.records.size(); ++k) {
      first = k == 0 ? result.records[k].send_ms : std::min(first, result.records[k].send_ms);
      last = std::max(last, result.records[k].end_ms);
    }
    result.wall_s = (last - first) / 1000.0;
    return result;
  }

  LoadClient* client_;
  PhaseSpec spec_;
  WorkloadOptions workload_;
  RunClock clock_;
  size_t next_stub_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_set<GenerateCall*> live_;  // started, OnDone not yet run: may be cancelled
  int64_t outstanding_ = 0;                 // started, Finish not yet run
  std::deque<double> free_since_ms_;        // closed loop: when each free slot became free
  std::vector<RequestRecord> done_;
};

void GenerateCall::OnDone(const grpc::Status& status) {
  record_.end_ms = clock_->NowMs();
  record_.status_code = static_cast<int>(status.error_code());
  record_.status_name = StatusCodeName(record_.status_code);
  record_.status_message = status.error_message();
  Phase* phase = phase_;
  RequestRecord record = std::move(record_);
  phase->Detach(this);
  delete this;
  phase->Finish(std::move(record));
}

}  // namespace

void RequestStop() {
  g_stop.store(true, std::memory_order_relaxed);
}
bool StopRequested() {
  return g_stop.load(std::memory_order_relaxed);
}

std::string StatusCodeName(int code) {
  return GrpcCodeName(code);
}

nlohmann::json ModelInfoToJson(const v1::ModelInfo& info) {
  google::protobuf::util::JsonPrintOptions print;
  print.always_print_primitive_fields = true;
  print.preserve_proto_field_names = true;
  std::string text;
  if (!google::protobuf::util::MessageToJsonString(info, &text, print).ok()) {
    return nlohmann::json{{"error", "ModelInfo could not be converted to JSON"}};
  }
  return nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
}

nlohmann::json ServerCountersToJson(const v1::ServerStats& before, const v1::ServerStats& after) {
  // A counter that went backwards means another server answered (a restart): no delta then.
  auto delta = [](uint64_t b, uint64_t a) -> nlohmann::json {
    if (a < b) return nullptr;
    return a - b;
  };
  return {{"steps", delta(before.steps(), after.steps())},
          {"mixed_steps", delta(before.mixed_steps(), after.mixed_steps())},
          {"tokens_generated", delta(before.tokens_generated(), after.tokens_generated())},
          {"requests_finished", delta(before.requests_finished(), after.requests_finished())},
          {"loop_launches", delta(before.loop_launches(), after.loop_launches())},
          {"regime_changes_on_device",
           delta(before.regime_changes_on_device(), after.regime_changes_on_device())},
          {"regime_changes_by_exit",
           delta(before.regime_changes_by_exit(), after.regime_changes_by_exit())}};
}

absl::StatusOr<std::unique_ptr<LoadClient>> LoadClient::Connect(const LoadOptions& options) {
  std::unique_ptr<LoadClient> client(new LoadClient(options));
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::duration_cast<std::chrono::system_clock::duration>(
                            std::chrono::duration<double>(options.connect_timeout_s));
  for (int32_t c = 0; c < options.channels; ++c) {
    grpc::ChannelArguments args;
    // Without a local pool, channels to one target share one subchannel (one TCP connection).
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetMaxReceiveMessageSize(-1);
    std::shared_ptr<grpc::Channel> channel =
        grpc::CreateCustomChannel(options.target, grpc::InsecureChannelCredentials(), args);
    if (!channel->WaitForConnected(deadline)) {
      return absl::UnavailableError(absl::StrCat("cannot connect to ", options.target, " within ",
                                                 options.connect_timeout_s,
                                                 " s (--target, --connect_timeout_s): is "
                                                 "tailserve running there?"));
    }
    client->stubs_.push_back(v1::Generation::NewStub(channel));
  }
  return client;
}

namespace {

// A unary call on `stub` under --connect_timeout_s; UNAVAILABLE naming the call and the target.
template <typename Response, typename Call>
absl::StatusOr<Response> UnaryCall(const LoadOptions& options, const char* name, Call call) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::duration_cast<std::chrono::system_clock::duration>(
                           std::chrono::duration<double>(options.connect_timeout_s)));
  Response response;
  const grpc::Status s = call(&context, &response);
  if (!s.ok()) {
    return absl::UnavailableError(absl::StrCat(name, " on ", options.target,
                                               " failed: ", StatusCodeName(s.error_code()), ": ",
                                               s.error_message()));
  }
  return response;
}

}  // namespace

absl::StatusOr<v1::ModelInfo> LoadClient::GetModelInfo() {
  return UnaryCall<v1::ModelInfo>(options_, "GetModelInfo", [&](auto* context, auto* info) {
    return stubs_.front()->GetModelInfo(context, v1::GetModelInfoRequest(), info);
  });
}

absl::StatusOr<v1::ServerStats> LoadClient::GetStats() {
  return UnaryCall<v1::ServerStats>(options_, "GetStats", [&](auto* context, auto* stats) {
    return stubs_.front()->GetStats(context, v1::GetStatsRequest(), stats);
  });
}

absl::StatusOr<RunResult> LoadClient::Run(const WorkloadOptions& workload) {
  const std::string pid = std::to_string(::getpid());
  if (options_.warmup_requests > 0) {
    PhaseSpec warm{.mode = LoopMode::kClosed,
                   .concurrency = options_.mode == LoopMode::kClosed ? options_.concurrency : 1,
                   .num_requests = options_.warmup_requests,
                   .index_base = kWarmupIndexBase,
                   .id_prefix = absl::StrCat("warmup-", pid)};
    Phase phase(this, warm, workload);
    TS_ASSIGN_OR_RETURN(RunResult warm_result, phase.Run());
    if (warm_result.interrupted) return warm_result;
    for (const RequestRecord& r : warm_result.records) {
      if (!r.ok()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "warmup request ", r.request_id, " failed: ", r.status_name, ": ", r.status_message));
      }
    }
  }
  PhaseSpec spec{.mode = options_.mode,
                 .rate_per_s = options_.rate_per_s,
                 .concurrency = options_.concurrency,
                 .num_requests = options_.num_requests,
                 .duration_s = options_.duration_s,
                 .index_base = 0,
                 .id_prefix = absl::StrCat("load-", pid)};
  absl::StatusOr<v1::ServerStats> before = GetStats();
  Phase phase(this, spec, workload);
  TS_ASSIGN_OR_RETURN(RunResult result, phase.Run());
  absl::StatusOr<v1::ServerStats> after = GetStats();
  if (before.ok() && after.ok()) {
    result.server_before = *std::move(before);
    result.server_after = *std::move(after);
  }
  return result;
}

}  // namespace ts::load
