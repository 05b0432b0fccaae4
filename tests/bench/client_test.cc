// The load client against an in-process fake Generation service: stream bookkeeping with
// coalesced messages, open-loop schedule, closed-loop slots, errors by code, drain cancellation,
// connection failure, and the tailserve-load binary's exit codes.
#include "bench/load/client.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "bench/load/arrivals.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/bench/subprocess.h"

namespace ts::load {
namespace {

namespace v1 = ::tailserve::v1;

constexpr int32_t kVocab = 50;
constexpr int32_t kCoalesce = 3;      // tokens per message from the fake
constexpr int32_t kStallLength = 63;  // requests asking for this many tokens never finish

int64_t IndexOf(const std::string& request_id) {
  return std::stoll(request_id.substr(request_id.rfind('-') + 1));
}

// Streams max_new_tokens tokens in messages of kCoalesce; fails requests whose index % 5 == 3
// when fail_some is set; stalls (until cancelled) requests asking for kStallLength tokens.
class FakeGeneration final : public v1::Generation::Service {
 public:
  std::atomic<bool> fail_some{false};

  grpc::Status GetModelInfo(grpc::ServerContext*, const v1::GetModelInfoRequest*,
                            v1::ModelInfo* info) override {
    info->set_model("fake");
    info->set_backend("fake");
    info->set_vocab_size(kVocab);
    info->set_max_context(128);
    info->set_max_new_tokens(64);
    return grpc::Status::OK;
  }

  grpc::Status Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    InFlight guard(this);
    for (int32_t id : req->prompt_token_ids().ids()) {
      if (id < 0 || id >= kVocab) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "prompt_token_ids out of range");
      }
    }
    if (!req->stop().ignore_eos() || req->sampling().temperature() != 0.0f) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "expected greedy + ignore_eos");
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      prompts_[req->request_id()] = {req->prompt_token_ids().ids().begin(),
                                     req->prompt_token_ids().ids().end()};
    }
    if (fail_some && IndexOf(req->request_id()) % 5 == 3) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "queue full");
    }
    const int32_t n = req->stop().max_new_tokens();
    if (n == kStallLength) {
      while (!ctx->IsCancelled()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    }
    for (int32_t sent = 0; sent < n;) {
      v1::GenerateResponse msg;
      msg.set_request_id(req->request_id());
      for (int32_t k = 0; k < kCoalesce && sent < n; ++k, ++sent) msg.add_token_ids(sent % kVocab);
      if (sent == n) {
        msg.set_finish_reason(v1::FINISH_REASON_LENGTH);
        msg.mutable_usage()->set_completion_tokens(n);
        msg.mutable_usage()->set_prompt_tokens(req->prompt_token_ids().ids_size());
      }
      if (!writer->Write(msg)) return grpc::Status(grpc::StatusCode::CANCELLED, "write failed");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return grpc::Status::OK;
  }

  std::map<std::string, std::vector<int32_t>> prompts() {
    std::lock_guard<std::mutex> lock(mu_);
    return prompts_;
  }
  int max_in_flight() const { return max_in_flight_; }

 private:
  struct InFlight {
    explicit InFlight(FakeGeneration* f) : f(f) {
      const int now = ++f->in_flight_;
      int seen = f->max_in_flight_;
      while (now > seen && !f->max_in_flight_.compare_exchange_weak(seen, now)) {
      }
    }
    ~InFlight() { --f->in_flight_; }
    FakeGeneration* f;
  };

  std::mutex mu_;
  std::map<std::string, std::vector<int32_t>> prompts_;  // request_id -> prompt received
  std::atomic<int> in_flight_{0};
  std::atomic<int> max_in_flight_{0};
};

class LoadClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }

  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }

  LoadOptions Options() const {
    LoadOptions o;
    o.target = target();
    o.seed = 17;
    o.input = {LengthDist::Kind::kUniform, 2, 9};
    o.output = {LengthDist::Kind::kFixed, 7, 0};
    o.drain_timeout_s = 30;
    return o;
  }

  static WorkloadOptions Workload(const LoadOptions& o, const v1::ModelInfo& info) {
    return {.seed = o.seed,
            .input = o.input,
            .output = o.output,
            .vocab_size = info.vocab_size(),
            .max_context = info.max_context(),
            .max_new_tokens = info.max_new_tokens()};
  }

  RunResult RunOrDie(const LoadOptions& o, WorkloadOptions* workload_out = nullptr) {
    auto client = LoadClient::Connect(o);
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return {};
    auto info = (*client)->GetModelInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    if (!info.ok()) return {};
    const WorkloadOptions workload = Workload(o, *info);
    if (workload_out) *workload_out = workload;
    auto result = (*client)->Run(workload);
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *std::move(result) : RunResult{};
  }

  FakeGeneration service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(LoadClientTest, ClosedLoopRecordsEveryStream) {
  LoadOptions o = Options();
  o.mode = LoopMode::kClosed;
  o.concurrency = 3;
  o.num_requests = 10;
  o.warmup_requests = 2;
  o.channels = 2;
  WorkloadOptions workload;
  const RunResult result = RunOrDie(o, &workload);
  ASSERT_EQ(result.records.size(), 10u);
  EXPECT_EQ(result.cancelled_at_drain, 0);
  std::set<double> ends;
  for (const RequestRecord& r : result.records) ends.insert(r.end_ms);
  const auto prompts = service_.prompts();
  EXPECT_EQ(prompts.size(), 12u);  // warmup requests reach the server but are not recorded
  for (size_t i = 0; i < result.records.size(); ++i) {
    const RequestRecord& r = result.records[i];
    SCOPED_TRACE(r.request_id);
    EXPECT_EQ(r.index, static_cast<int64_t>(i));
    EXPECT_TRUE(r.ok()) << r.status_message;
    EXPECT_EQ(r.OutputTokens(), 7);
    EXPECT_EQ(r.message_tokens, (std::vector<int32_t>{3, 3, 1}));
    EXPECT_EQ(r.usage_completion_tokens, 7);
    EXPECT_EQ(r.usage_prompt_tokens, r.input_tokens);
    EXPECT_EQ(r.prompt_entry, -1);
    EXPECT_EQ(r.finish_reason, "LENGTH");
    EXPECT_LE(r.intended_ms, r.send_ms);
    EXPECT_LE(r.send_ms, r.message_ms.front());
    EXPECT_LE(r.message_ms.back(), r.end_ms);
    // The server got exactly the synthetic prompt of this index.
    ASSERT_TRUE(prompts.count(r.request_id));
    EXPECT_EQ(prompts.at(r.request_id), MakeRequestSpec(workload, r.index).prompt_ids);
    EXPECT_EQ(r.input_tokens, static_cast<int32_t>(prompts.at(r.request_id).size()));
    // A closed-loop slot is "intended" when the previous request on it ended.
    if (r.index >= o.concurrency) {
      EXPECT_TRUE(ends.count(r.intended_ms)) << r.intended_ms;
    } else {
      EXPECT_EQ(r.intended_ms, 0.0);
    }
  }
  EXPECT_LE(service_.max_in_flight(), 3);
  const RunMetrics m = ComputeRunMetrics(result.records);
  EXPECT_EQ(m.requests_failed, 0);
  EXPECT_EQ(m.output_tokens, 70);
  EXPECT_EQ(m.itl_ms.count, 10 * 4);  // tokens of messages 2 and 3: {3, 3, 1} -> 3 + 1
}

TEST_F(LoadClientTest, OpenLoopFollowsThePoissonSchedule) {
  LoadOptions o = Options();
  o.mode = LoopMode::kOpen;
  o.rate_per_s = 400;
  o.num_requests = 20;
  const RunResult result = RunOrDie(o);
  ASSERT_EQ(result.records.size(), 20u);
  auto times = IntendedTimes({.rate_per_s = 400, .seed = o.seed}, 20);
  ASSERT_TRUE(times.ok());
  for (const RequestRecord& r : result.records) {
    EXPECT_TRUE(r.ok()) << r.status_message;
    EXPECT_EQ(r.intended_ms, (*times)[static_cast<size_t>(r.index)] * 1000.0);
    EXPECT_GE(r.send_ms, r.intended_ms);
    EXPECT_EQ(r.OutputTokens(), 7);
  }
}

TEST_F(LoadClientTest, DurationBoundEndsTheRun) {
  LoadOptions o = Options();
  o.mode = LoopMode::kClosed;
  o.concurrency = 2;
  o.num_requests = 0;
  o.duration_s = 0.3;
  const RunResult result = RunOrDie(o);
  EXPECT_GT(result.records.size(), 0u);
  for (const RequestRecord& r : result.records) EXPECT_TRUE(r.ok()) << r.status_message;
}

TEST_F(LoadClientTest, FailuresAreRecordedByStatusCode) {
  service_.fail_some = true;
  LoadOptions o = Options();
  o.concurrency = 4;
  o.num_requests = 10;
  const RunResult result = RunOrDie(o);
  ASSERT_EQ(result.records.size(), 10u);
  for (const RequestRecord& r : result.records) {
    EXPECT_EQ(r.ok(), r.index % 5 != 3) << r.request_id;
    if (!r.ok()) {
      EXPECT_EQ(r.status_name, "RESOURCE_EXHAUSTED");
      EXPECT_EQ(r.status_message, "queue full");
    }
  }
  const RunMetrics m = ComputeRunMetrics(result.records);
  EXPECT_EQ(m.requests_failed, 2);
  EXPECT_EQ(m.errors_by_code.at("RESOURCE_EXHAUSTED"), 2);
}

TEST_F(LoadClientTest, DrainTimeoutCancelsStuckStreams) {
  LoadOptions o = Options();
  o.concurrency = 2;
  o.num_requests = 2;
  o.output = {LengthDist::Kind::kFixed, kStallLength, 0};
  o.drain_timeout_s = 0.2;
  const RunResult result = RunOrDie(o);
  EXPECT_EQ(result.cancelled_at_drain, 2);
  ASSERT_EQ(result.records.size(), 2u);
  for (const RequestRecord& r : result.records) EXPECT_EQ(r.status_name, "CANCELLED");
}

TEST(LoadClientConnectTest, UnreachableServerIsUnavailable) {
  LoadOptions o;
  o.target = "127.0.0.1:1";  // privileged port nobody listens on
  o.connect_timeout_s = 1;
  const auto client = LoadClient::Connect(o);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(client.status().message().find("127.0.0.1:1"), std::string::npos);
}

// The binary: summary on stdout, files in --out_dir, and the documented exit codes.
class LoadBinaryTest : public LoadClientTest {
 protected:
  void SetUp() override {
    const char* bin = std::getenv("TS_LOAD_BIN");
    ASSERT_NE(bin, nullptr) << "TS_LOAD_BIN must name the tailserve-load binary";
    bin_ = bin;
    dir_ =
        std::filesystem::temp_directory_path() / ("ts_load_bin_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    LoadClientTest::SetUp();
  }
  void TearDown() override {
    LoadClientTest::TearDown();
    std::filesystem::remove_all(dir_);
  }
  test::CommandResult Run(std::vector<std::string> flags) {
    flags.insert(flags.begin(), bin_);
    return test::RunCommand(flags, (dir_ / "log.txt").string(), std::chrono::seconds(60));
  }

  std::string bin_;
  std::filesystem::path dir_;
};

TEST_F(LoadBinaryTest, ExitCodes) {
  const std::string out = (dir_ / "run").string();
  const std::vector<std::string> base = {"--target=" + target(), "--rate=300", "--num_requests=10",
                                         "--input_dist=uniform:1:5", "--output_len=4"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> f = base;
    f.insert(f.end(), extra.begin(), extra.end());
    return f;
  };
  test::CommandResult ok = Run(with({"--out_dir=" + out}));
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("TTFT"), std::string::npos) << ok.output;
  EXPECT_TRUE(std::filesystem::exists(out + "/results.jsonl"));
  EXPECT_TRUE(std::filesystem::exists(out + "/summary.json"));
  EXPECT_TRUE(std::filesystem::exists(out + "/report.html"));

  service_.fail_some = true;
  test::CommandResult failed = Run(base);
  EXPECT_EQ(failed.exit_code, 1) << failed.output;
  EXPECT_NE(failed.output.find("RESOURCE_EXHAUSTED=2"), std::string::npos) << failed.output;
  test::CommandResult allowed = Run(with({"--allow_errors"}));
  EXPECT_EQ(allowed.exit_code, 0) << allowed.output;

  test::CommandResult unreachable =
      Run({"--target=127.0.0.1:1", "--num_requests=1", "--connect_timeout_s=1"});
  EXPECT_EQ(unreachable.exit_code, 3) << unreachable.output;
  EXPECT_NE(unreachable.output.find("cannot connect to 127.0.0.1:1"), std::string::npos);

  test::CommandResult bad = Run(with({"--concurrency=2"}));  // both loops at once
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  test::CommandResult too_long = Run({"--target=" + target(), "--num_requests=1",
                                      "--output_len=65"});  // over the fake's max_new_tokens
  EXPECT_EQ(too_long.exit_code, 2) << too_long.output;
}

}  // namespace
}  // namespace ts::load
