// Shared by the end-to-end test files: a running `tailserve` child with client stubs, and stream
// helpers. Expected tokens come from transformers (reference.json) or from the same server
// answering the same request alone, never from these files.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "health.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tailserve/v1/generation.grpc.pb.h"
#include "tests/common/test_paths.h"
#include "tests/server/child_process.h"

namespace ts::testing {

namespace pb = ::tailserve::v1;
namespace health = ::grpc::health::v1;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using Tokens = std::vector<int32_t>;
using namespace std::chrono_literals;

constexpr auto kStartTimeout = 60s;
constexpr auto kRpcTimeout = 60s;
constexpr auto kSettleTimeout = 20s;

struct Reference {
  std::vector<Tokens> prompts;
  std::vector<Tokens> greedy;
};

inline Reference LoadReference() {
  std::ifstream in(FixtureDir() / "tiny-gqa-untied" / "reference.json");
  EXPECT_TRUE(in.good()) << "missing tests/fixtures/tiny-gqa-untied/reference.json";
  const nlohmann::json j = nlohmann::json::parse(in);
  Reference r;
  r.prompts = j.at("prompts").get<std::vector<Tokens>>();
  r.greedy = j.at("greedy").get<std::vector<Tokens>>();
  return r;
}

inline std::chrono::system_clock::time_point In(std::chrono::milliseconds d) {
  return std::chrono::system_clock::now() + d;
}

// A running `tailserve` child plus client stubs.
class Server {
 public:
  // nullptr (with a test failure recorded) when the server does not come up.
  static std::unique_ptr<Server> Launch(const std::vector<std::string>& flags) {
    std::vector<std::string> argv = {
        TS_TAILSERVE_BINARY, "--port=0", "--backend=cpu",
        absl::StrCat("--model_dir=", (FixtureDir() / "tiny-gqa-untied").string()), "--threads=2"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Start(argv);
    if (!child.ok()) {
      ADD_FAILURE() << child.status();
      return nullptr;
    }
    auto s = std::unique_ptr<Server>(new Server());
    s->process_ = *std::move(child);
    absl::StatusOr<std::string> line =
        s->process_->WaitForLine("tailserve listening on ", kStartTimeout);
    if (!line.ok()) {
      ADD_FAILURE() << line.status() << "\n" << s->process_->Output();
      return nullptr;
    }
    s->address_ = line->substr(line->find(" on ") + 4);
    s->channel_ = grpc::CreateChannel(s->address_, grpc::InsecureChannelCredentials());
    if (!s->channel_->WaitForConnected(In(kStartTimeout))) {
      ADD_FAILURE() << "could not connect to " << s->address_;
      return nullptr;
    }
    s->stub_ = pb::Generation::NewStub(s->channel_);
    s->health_ = health::Health::NewStub(s->channel_);
    return s;
  }

  pb::Generation::Stub& stub() { return *stub_; }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }
  ChildProcess& process() { return *process_; }

  health::HealthCheckResponse::ServingStatus Health() {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10s));
    health::HealthCheckRequest req;
    health::HealthCheckResponse resp;
    const grpc::Status s = health_->Check(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp.status();
  }

  // The health RPC's own status too: a server on its way out may no longer answer at all.
  std::pair<grpc::Status, health::HealthCheckResponse::ServingStatus> HealthOrError() {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10s));
    health::HealthCheckResponse resp;
    const grpc::Status s = health_->Check(&ctx, health::HealthCheckRequest(), &resp);
    return {s, resp.status()};
  }

  pb::ServerStats Stats() {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10s));
    pb::ServerStats stats;
    const grpc::Status s = stub_->GetStats(&ctx, pb::GetStatsRequest(), &stats);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return stats;
  }

  // Polls GetStats until `done` holds; the last snapshot either way (a test failure on timeout).
  pb::ServerStats WaitStats(const std::function<bool(const pb::ServerStats&)>& done,
                            const std::string& what) {
    const auto deadline = std::chrono::steady_clock::now() + kSettleTimeout;
    pb::ServerStats s;
    do {
      s = Stats();
      if (done(s)) return s;
      std::this_thread::sleep_for(10ms);
    } while (std::chrono::steady_clock::now() < deadline);
    ADD_FAILURE() << "timed out waiting for " << what << ": " << s.ShortDebugString();
    return s;
  }

  // Polls until nothing runs and every KV block is free again; the last snapshot either way.
  pb::ServerStats WaitSettled() {
    const auto deadline = std::chrono::steady_clock::now() + kSettleTimeout;
    pb::ServerStats s;
    do {
      s = Stats();
      if (s.kv_blocks_total() > 0 && s.kv_blocks_free() == s.kv_blocks_total() &&
          s.running() == 0 && s.queued() == 0 && s.active_streams() == 0) {
        return s;
      }
      std::this_thread::sleep_for(10ms);
    } while (std::chrono::steady_clock::now() < deadline);
    ADD_FAILURE() << "server did not settle: kv free " << s.kv_blocks_free() << "/"
                  << s.kv_blocks_total() << " running " << s.running() << " queued " << s.queued()
                  << " streams " << s.active_streams();
    return s;
  }

 private:
  Server() = default;
  std::unique_ptr<ChildProcess> process_;
  std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Generation::Stub> stub_;
  std::unique_ptr<health::Health::Stub> health_;
};

struct StreamResult {
  grpc::Status status;
  Tokens tokens;
  int messages = 0;
  uint64_t seed = 0;
  std::string request_id;
  pb::FinishReason finish = pb::FINISH_REASON_UNSPECIFIED;
  pb::Usage usage;
  std::string text;  // every message's text delta, in order
  std::string matched_stop;
  std::vector<std::string> deltas;
  pb::Timing timing;        // from the message that carried one
  int timing_messages = 0;  // messages that carried one
};

inline void ReadAll(grpc::ClientReader<pb::GenerateResponse>* reader, StreamResult* r) {
  pb::GenerateResponse msg;
  while (reader->Read(&msg)) {
    if (r->messages == 0) {
      r->seed = msg.seed();
      r->request_id = msg.request_id();
    }
    ++r->messages;
    r->tokens.insert(r->tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
    r->text += msg.text();
    r->deltas.push_back(msg.text());
    if (msg.finish_reason() != pb::FINISH_REASON_UNSPECIFIED) {
      r->finish = msg.finish_reason();
      r->usage = msg.usage();
      r->matched_stop = msg.matched_stop();
    }
    if (msg.has_timing()) {
      r->timing = msg.timing();
      ++r->timing_messages;
    }
  }
  r->status = reader->Finish();
}

inline StreamResult Generate(pb::Generation::Stub& stub, const pb::GenerateRequest& req) {
  grpc::ClientContext ctx;
  ctx.set_deadline(In(kRpcTimeout));
  StreamResult r;
  ReadAll(stub.Generate(&ctx, req).get(), &r);
  return r;
}

inline pb::GenerateRequest Greedy(const Tokens& prompt, int32_t max_new_tokens) {
  pb::GenerateRequest r;
  r.mutable_prompt_token_ids()->mutable_ids()->Add(prompt.begin(), prompt.end());
  r.mutable_sampling()->set_temperature(0.0f);
  r.mutable_stop()->set_max_new_tokens(max_new_tokens);
  r.mutable_stop()->set_ignore_eos(true);
  return r;
}

inline pb::GenerateRequest Sampled(const Tokens& prompt, int32_t max_new_tokens, uint64_t seed) {
  pb::GenerateRequest r = Greedy(prompt, max_new_tokens);
  r.mutable_sampling()->set_temperature(0.8f);
  r.mutable_sampling()->set_top_p(0.9f);
  r.mutable_sampling()->set_seed(seed);
  return r;
}

// A file that opens the server's --debug_gate_file gate when created; removed at the end.
class Gate {
 public:
  Gate()
      : path_(std::filesystem::temp_directory_path() /
              absl::StrCat("tailserve-gate-", getpid(), "-", next_++)) {
    std::filesystem::remove(path_);
  }
  ~Gate() { std::filesystem::remove(path_); }
  std::string flag() const { return absl::StrCat("--debug_gate_file=", path_.string()); }
  void Open() { std::ofstream(path_) << "open\n"; }

 private:
  static inline int next_ = 0;
  std::filesystem::path path_;
};

// The first `n` tokens of `tokens`.
inline Tokens Prefix(const Tokens& tokens, size_t n) {
  return Tokens(tokens.begin(), tokens.begin() + std::min(n, tokens.size()));
}

// Starts a long stream, reads its first message, and returns with KV in use.
struct OpenStream {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<pb::GenerateResponse>> reader;
  StreamResult result;
};

inline void StartLong(Server& server, const Tokens& prompt, OpenStream* s) {
  const int32_t max_new = 256 - static_cast<int32_t>(prompt.size());
  s->ctx.set_deadline(In(kRpcTimeout));
  s->reader = server.stub().Generate(&s->ctx, Greedy(prompt, max_new));
  pb::GenerateResponse first;
  ASSERT_TRUE(s->reader->Read(&first));
  s->result.messages = 1;
  s->result.tokens.assign(first.token_ids().begin(), first.token_ids().end());
}

}  // namespace ts::testing
