// End to end: the real `tailserve` binary on the tiny CPU fixture, driven by a real gRPC client.
// Expected tokens come from transformers (reference.json) or from the same server answering the
// same request alone, never from this file.
#include <signal.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "health.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "reflection.grpc.pb.h"
#include "tailserve/v1/generation.grpc.pb.h"
#include "tests/common/test_paths.h"
#include "tests/server/child_process.h"

namespace ts::testing {
namespace {

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

Reference LoadReference() {
  std::ifstream in(FixtureDir() / "tiny-gqa-untied" / "reference.json");
  EXPECT_TRUE(in.good()) << "missing tests/fixtures/tiny-gqa-untied/reference.json";
  const nlohmann::json j = nlohmann::json::parse(in);
  Reference r;
  r.prompts = j.at("prompts").get<std::vector<Tokens>>();
  r.greedy = j.at("greedy").get<std::vector<Tokens>>();
  return r;
}

std::chrono::system_clock::time_point In(std::chrono::milliseconds d) {
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

  pb::ServerStats Stats() {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10s));
    pb::ServerStats stats;
    const grpc::Status s = stub_->GetStats(&ctx, pb::GetStatsRequest(), &stats);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return stats;
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
};

void ReadAll(grpc::ClientReader<pb::GenerateResponse>* reader, StreamResult* r) {
  pb::GenerateResponse msg;
  while (reader->Read(&msg)) {
    if (r->messages == 0) {
      r->seed = msg.seed();
      r->request_id = msg.request_id();
    }
    ++r->messages;
    r->tokens.insert(r->tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
    if (msg.finish_reason() != pb::FINISH_REASON_UNSPECIFIED) {
      r->finish = msg.finish_reason();
      r->usage = msg.usage();
    }
  }
  r->status = reader->Finish();
}

StreamResult Generate(pb::Generation::Stub& stub, const pb::GenerateRequest& req) {
  grpc::ClientContext ctx;
  ctx.set_deadline(In(kRpcTimeout));
  StreamResult r;
  ReadAll(stub.Generate(&ctx, req).get(), &r);
  return r;
}

pb::GenerateRequest Greedy(const Tokens& prompt, int32_t max_new_tokens) {
  pb::GenerateRequest r;
  r.mutable_prompt_token_ids()->mutable_ids()->Add(prompt.begin(), prompt.end());
  r.mutable_sampling()->set_temperature(0.0f);
  r.mutable_stop()->set_max_new_tokens(max_new_tokens);
  r.mutable_stop()->set_ignore_eos(true);
  return r;
}

pb::GenerateRequest Sampled(const Tokens& prompt, int32_t max_new_tokens, uint64_t seed) {
  pb::GenerateRequest r = Greedy(prompt, max_new_tokens);
  r.mutable_sampling()->set_temperature(0.8f);
  r.mutable_sampling()->set_top_p(0.9f);
  r.mutable_sampling()->set_seed(seed);
  return r;
}

// One server shared by the tests that leave it healthy. The step delay keeps a long request
// running long enough that "cancelled before the end" is observable.
class ServerE2ETest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ref_ = new Reference(LoadReference());
    server_ = Server::Launch({"--max_batch=16", "--queue_limit=64", "--debug_step_delay_ms=5",
                              "--stats_interval_s=1"})
                  .release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
    delete ref_;
  }
  void SetUp() override { ASSERT_NE(server_, nullptr) << "tailserve did not start"; }
  void TearDown() override {
    // One request's trouble must never take the server down.
    EXPECT_FALSE(server_->process().WaitExit(0ms).has_value()) << "tailserve exited";
  }

  // The reference prompt `i` streamed greedily must give transformers' continuation.
  void ExpectReference(size_t i) {
    const StreamResult r = Generate(server_->stub(), Greedy(ref_->prompts[i], 32));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_THAT(r.tokens, ElementsAreArray(ref_->greedy[i])) << "reference prompt " << i;
  }

  static Server* server_;
  static Reference* ref_;
};
Server* ServerE2ETest::server_ = nullptr;
Reference* ServerE2ETest::ref_ = nullptr;

TEST_F(ServerE2ETest, HealthIsServingAndModelInfoDescribesFixture) {
  EXPECT_EQ(server_->Health(), health::HealthCheckResponse::SERVING);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(10s));
  pb::ModelInfo info;
  ASSERT_TRUE(server_->stub().GetModelInfo(&ctx, pb::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.model(), "tiny-gqa-untied");
  EXPECT_EQ(info.vocab_size(), 311);
  EXPECT_EQ(info.max_context(), 256);
  EXPECT_EQ(info.max_batch(), 16);
  EXPECT_THAT(info.eos_token_ids(), ElementsAreArray({2}));
  const pb::ServerStats s = server_->Stats();
  EXPECT_GT(s.kv_blocks_total(), 0);
  EXPECT_FALSE(s.draining());
}

TEST_F(ServerE2ETest, ReflectionListsTheServices) {
  namespace refl = ::grpc::reflection::v1alpha;
  auto stub = refl::ServerReflection::NewStub(server_->channel());
  grpc::ClientContext ctx;
  ctx.set_deadline(In(10s));
  auto stream = stub->ServerReflectionInfo(&ctx);
  refl::ServerReflectionRequest list;
  list.set_list_services("");
  ASSERT_TRUE(stream->Write(list));
  refl::ServerReflectionResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  std::vector<std::string> names;
  for (const auto& svc : resp.list_services_response().service()) names.push_back(svc.name());
  EXPECT_THAT(names, ::testing::IsSupersetOf({"tailserve.v1.Generation", "grpc.health.v1.Health"}));

  refl::ServerReflectionRequest file;
  file.set_file_containing_symbol("tailserve.v1.Generation");
  ASSERT_TRUE(stream->Write(file));
  ASSERT_TRUE(stream->Read(&resp));
  ASSERT_EQ(resp.file_descriptor_response().file_descriptor_proto_size(), 1);
  EXPECT_THAT(resp.file_descriptor_response().file_descriptor_proto(0), HasSubstr("GetStats"));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(ServerE2ETest, GreedyStreamsMatchTransformers) {
  ASSERT_EQ(ref_->prompts.size(), ref_->greedy.size());
  for (size_t i = 0; i < ref_->prompts.size(); ++i) {
    const StreamResult r = Generate(server_->stub(), Greedy(ref_->prompts[i], 32));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_THAT(r.tokens, ElementsAreArray(ref_->greedy[i])) << "prompt " << i;
    EXPECT_EQ(r.finish, pb::FINISH_REASON_LENGTH);
    EXPECT_EQ(r.usage.prompt_tokens(), static_cast<int32_t>(ref_->prompts[i].size()));
    EXPECT_EQ(r.usage.completion_tokens(), 32);
    EXPECT_FALSE(r.request_id.empty());
  }
  server_->WaitSettled();
}

TEST_F(ServerE2ETest, SeededSamplingRepeatsAndDrawnSeedIsReported) {
  const Tokens& prompt = ref_->prompts[1];
  const StreamResult a = Generate(server_->stub(), Sampled(prompt, 48, 42));
  const StreamResult b = Generate(server_->stub(), Sampled(prompt, 48, 42));
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  EXPECT_EQ(a.seed, 42u);
  EXPECT_EQ(a.tokens.size(), 48u);
  EXPECT_EQ(a.tokens, b.tokens);

  // No seed: the server draws one and reports it; asking again with that seed repeats the stream.
  pb::GenerateRequest unseeded = Sampled(prompt, 48, 0);
  unseeded.mutable_sampling()->clear_seed();
  const StreamResult c = Generate(server_->stub(), unseeded);
  ASSERT_TRUE(c.status.ok()) << c.status.error_message();
  const StreamResult d = Generate(server_->stub(), Sampled(prompt, 48, c.seed));
  ASSERT_TRUE(d.status.ok()) << d.status.error_message();
  EXPECT_EQ(d.seed, c.seed);
  EXPECT_EQ(c.tokens, d.tokens);
  server_->WaitSettled();
}

TEST_F(ServerE2ETest, SixteenConcurrentStreamsEachGetTheirOwnTokens) {
  std::vector<pb::GenerateRequest> reqs;
  std::mt19937 rng(1234);
  for (int i = 0; i < 16; ++i) {
    Tokens prompt;
    if (i < static_cast<int>(ref_->prompts.size())) {
      prompt = ref_->prompts[i];
    } else {
      prompt.resize(1 + rng() % 40);
      for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % 311);
    }
    const int32_t n = 16 + i * 3;
    reqs.push_back(i % 2 == 0 ? Greedy(prompt, n) : Sampled(prompt, n, 100 + i));
  }
  // Each request alone first: the batch must not change anyone's tokens.
  std::vector<Tokens> solo;
  for (const auto& req : reqs) {
    const StreamResult r = Generate(server_->stub(), req);
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    ASSERT_EQ(r.tokens.size(), static_cast<size_t>(req.stop().max_new_tokens()));
    solo.push_back(r.tokens);
  }
  for (size_t i = 0; i < ref_->prompts.size(); ++i) {
    // Greedy (even i) reference prompts also match transformers on their common prefix.
    if (i % 2 == 0) {
      EXPECT_THAT(Tokens(solo[i].begin(), solo[i].begin() + 16),
                  ElementsAreArray(ref_->greedy[i].begin(), ref_->greedy[i].begin() + 16));
    }
  }
  std::vector<StreamResult> together(reqs.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < reqs.size(); ++i) {
    threads.emplace_back([&, i] { together[i] = Generate(server_->stub(), reqs[i]); });
  }
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(together[i].status.ok()) << i << ": " << together[i].status.error_message();
    EXPECT_EQ(together[i].tokens, solo[i]) << "stream " << i;
  }
  server_->WaitSettled();
}

// Starts a long stream, reads its first message, and returns with KV in use.
struct OpenStream {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<pb::GenerateResponse>> reader;
  StreamResult result;
};

void StartLong(Server& server, const Tokens& prompt, OpenStream* s) {
  const int32_t max_new = 256 - static_cast<int32_t>(prompt.size());
  s->ctx.set_deadline(In(kRpcTimeout));
  s->reader = server.stub().Generate(&s->ctx, Greedy(prompt, max_new));
  pb::GenerateResponse first;
  ASSERT_TRUE(s->reader->Read(&first));
  s->result.messages = 1;
  s->result.tokens.assign(first.token_ids().begin(), first.token_ids().end());
}

TEST_F(ServerE2ETest, ClientCancelFreesKvBlocks) {
  const pb::ServerStats before = server_->WaitSettled();
  OpenStream s;
  ASSERT_NO_FATAL_FAILURE(StartLong(*server_, ref_->prompts[0], &s));
  const pb::ServerStats during = server_->Stats();
  EXPECT_LT(during.kv_blocks_free(), during.kv_blocks_total()) << "the stream holds no KV blocks?";
  EXPECT_EQ(during.running(), 1);

  s.ctx.TryCancel();
  ReadAll(s.reader.get(), &s.result);
  EXPECT_EQ(s.result.status.error_code(), grpc::StatusCode::CANCELLED);
  const pb::ServerStats after = server_->WaitSettled();
  EXPECT_EQ(after.kv_blocks_free(), after.kv_blocks_total());
  // Cancel stopped generation early rather than the request running to its end.
  EXPECT_LT(after.tokens_generated() - before.tokens_generated(), 255u);
  ExpectReference(0);
}

TEST_F(ServerE2ETest, DeadlineFreesKvBlocks) {
  const pb::ServerStats before = server_->WaitSettled();
  grpc::ClientContext ctx;
  ctx.set_deadline(In(300ms));
  StreamResult r;
  ReadAll(server_->stub().Generate(&ctx, Greedy(ref_->prompts[2], 200)).get(), &r);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  const pb::ServerStats after = server_->WaitSettled();
  EXPECT_LT(after.tokens_generated() - before.tokens_generated(), 200u);
  ExpectReference(2);
}

TEST_F(ServerE2ETest, DuplicateRequestIdIsRejectedWhileTheFirstRuns) {
  grpc::ClientContext ctx;
  ctx.set_deadline(In(kRpcTimeout));
  pb::GenerateRequest named = Greedy(ref_->prompts[1], 200);
  named.set_request_id("e2e-duplicate");
  auto first = server_->stub().Generate(&ctx, named);
  pb::GenerateResponse msg;
  ASSERT_TRUE(first->Read(&msg));
  EXPECT_EQ(msg.request_id(), "e2e-duplicate");
  pb::GenerateRequest again = Greedy(ref_->prompts[0], 8);
  again.set_request_id("e2e-duplicate");
  const StreamResult r = Generate(server_->stub(), again);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::ALREADY_EXISTS) << r.status.error_message();
  ctx.TryCancel();
  StreamResult ignored;
  ReadAll(first.get(), &ignored);
  server_->WaitSettled();
  ExpectReference(1);
}

struct BadInput {
  std::string name;
  std::function<void(pb::GenerateRequest*)> mutate;
  grpc::StatusCode code;
  std::string field;
};

TEST_F(ServerE2ETest, EveryBadInputGetsItsCodeAndTheServerStaysWhole) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<BadInput> cases = {
      {"empty prompt", [](auto* r) { r->mutable_prompt_token_ids()->clear_ids(); },
       grpc::StatusCode::INVALID_ARGUMENT, "prompt_token_ids"},
      {"no prompt", [](auto* r) { r->clear_prompt(); }, grpc::StatusCode::INVALID_ARGUMENT,
       "prompt_token_ids"},
      {"id >= vocab", [](auto* r) { r->mutable_prompt_token_ids()->add_ids(311); },
       grpc::StatusCode::INVALID_ARGUMENT, "prompt_token_ids["},
      {"negative id", [](auto* r) { r->mutable_prompt_token_ids()->set_ids(0, -3); },
       grpc::StatusCode::INVALID_ARGUMENT, "prompt_token_ids[0]"},
      {"prompt_text", [](auto* r) { r->set_prompt_text("hi"); }, grpc::StatusCode::UNIMPLEMENTED,
       "prompt_text"},
      {"over context", [](auto* r) { r->mutable_stop()->set_max_new_tokens(256); },
       grpc::StatusCode::INVALID_ARGUMENT, "stop.max_new_tokens"},
      {"nan temperature", [nan](auto* r) { r->mutable_sampling()->set_temperature(nan); },
       grpc::StatusCode::INVALID_ARGUMENT, "sampling.temperature"},
      {"negative temperature", [](auto* r) { r->mutable_sampling()->set_temperature(-1.0f); },
       grpc::StatusCode::INVALID_ARGUMENT, "sampling.temperature"},
      {"top_p 0", [](auto* r) { r->mutable_sampling()->set_top_p(0.0f); },
       grpc::StatusCode::INVALID_ARGUMENT, "sampling.top_p"},
      {"top_k > vocab", [](auto* r) { r->mutable_sampling()->set_top_k(1000); },
       grpc::StatusCode::INVALID_ARGUMENT, "sampling.top_k"},
      {"min_p > 1", [](auto* r) { r->mutable_sampling()->set_min_p(2.0f); },
       grpc::StatusCode::INVALID_ARGUMENT, "sampling.min_p"},
      {"repetition 0", [](auto* r) { r->mutable_sampling()->set_repetition_penalty(0.0f); },
       grpc::StatusCode::INVALID_ARGUMENT, "sampling.repetition_penalty"},
      {"presence 3", [](auto* r) { r->mutable_sampling()->set_presence_penalty(3.0f); },
       grpc::StatusCode::INVALID_ARGUMENT, "sampling.presence_penalty"},
      {"frequency -3", [](auto* r) { r->mutable_sampling()->set_frequency_penalty(-3.0f); },
       grpc::StatusCode::INVALID_ARGUMENT, "sampling.frequency_penalty"},
      {"max_new 0", [](auto* r) { r->mutable_stop()->set_max_new_tokens(0); },
       grpc::StatusCode::INVALID_ARGUMENT, "stop.max_new_tokens"},
      {"min_new > max", [](auto* r) { r->mutable_stop()->set_min_new_tokens(100); },
       grpc::StatusCode::INVALID_ARGUMENT, "stop.min_new_tokens"},
      {"too many stop ids",
       [](auto* r) {
         for (int i = 0; i < 1000; ++i) r->mutable_stop()->add_stop_token_ids(i % 300);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "stop.stop_token_ids"},
      {"stop id out of vocab", [](auto* r) { r->mutable_stop()->add_stop_token_ids(99999); },
       grpc::StatusCode::INVALID_ARGUMENT, "stop.stop_token_ids[0]"},
  };
  for (const BadInput& c : cases) {
    SCOPED_TRACE(c.name);
    pb::GenerateRequest req = Greedy(ref_->prompts[1], 16);
    c.mutate(&req);
    const StreamResult r = Generate(server_->stub(), req);
    EXPECT_EQ(r.status.error_code(), c.code) << r.status.error_message();
    EXPECT_THAT(r.status.error_message(), HasSubstr(c.field));
    EXPECT_EQ(r.messages, 0);
    ExpectReference(1);
    const pb::ServerStats s = server_->WaitSettled();
    EXPECT_EQ(s.kv_blocks_free(), s.kv_blocks_total());
  }
}

// max_batch 1 and queue_limit 1: one running, one queued, everything else is turned away at once.
TEST(ServerQueueTest, FullQueueIsResourceExhausted) {
  const Reference ref = LoadReference();
  std::unique_ptr<Server> server =
      Server::Launch({"--max_batch=1", "--queue_limit=1", "--debug_step_delay_ms=20"});
  ASSERT_NE(server, nullptr);
  OpenStream running;
  ASSERT_NO_FATAL_FAILURE(StartLong(*server, ref.prompts[0], &running));
  // The second request waits in the queue behind the running one.
  grpc::ClientContext queued_ctx;
  queued_ctx.set_deadline(In(kRpcTimeout));
  auto queued = server->stub().Generate(&queued_ctx, Greedy(ref.prompts[2], 32));
  const auto deadline = std::chrono::steady_clock::now() + kSettleTimeout;
  while (server->Stats().queued() != 1 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(server->Stats().queued(), 1);

  std::vector<StreamResult> flood(6);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < flood.size(); ++i) {
    threads.emplace_back(
        [&, i] { flood[i] = Generate(server->stub(), Greedy(ref.prompts[1], 32)); });
  }
  for (std::thread& t : threads) t.join();
  for (const StreamResult& r : flood) {
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << r.status.error_message();
  }
  // Rejected without waiting: the first request is still running.
  EXPECT_EQ(server->Stats().running(), 1);

  running.ctx.TryCancel();
  ReadAll(running.reader.get(), &running.result);
  EXPECT_EQ(running.result.status.error_code(), grpc::StatusCode::CANCELLED);
  // Once the running request is gone, the queued one runs to completion with the right tokens.
  StreamResult q;
  ReadAll(queued.get(), &q);
  ASSERT_TRUE(q.status.ok()) << q.status.error_message();
  EXPECT_THAT(q.tokens, ElementsAreArray(ref.greedy[2]));
  server->WaitSettled();
}

TEST(ServerDrainTest, SigtermFinishesOpenStreamsRejectsNewOnesAndExitsZero) {
  const Reference ref = LoadReference();
  std::unique_ptr<Server> server =
      Server::Launch({"--debug_step_delay_ms=20", "--drain_timeout_s=60"});
  ASSERT_NE(server, nullptr);
  ASSERT_EQ(server->Health(), health::HealthCheckResponse::SERVING);
  // 200 tokens at >= 20 ms a step: the stream is still open while the checks below run.
  grpc::ClientContext ctx;
  ctx.set_deadline(In(kRpcTimeout));
  auto reader = server->stub().Generate(&ctx, Greedy(ref.prompts[0], 200));
  pb::GenerateResponse first;
  ASSERT_TRUE(reader->Read(&first));

  ASSERT_TRUE(server->process().Signal(SIGTERM));
  ASSERT_TRUE(server->process().WaitForLine("tailserve draining", 10s).ok());
  EXPECT_EQ(server->Health(), health::HealthCheckResponse::NOT_SERVING);
  const StreamResult rejected = Generate(server->stub(), Greedy(ref.prompts[1], 8));
  EXPECT_EQ(rejected.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(rejected.status.error_message(), HasSubstr("draining"));
  EXPECT_TRUE(server->Stats().draining());

  StreamResult r;
  r.messages = 1;
  r.seed = first.seed();
  r.tokens.assign(first.token_ids().begin(), first.token_ids().end());
  ReadAll(reader.get(), &r);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(r.tokens.size(), 200u);
  EXPECT_EQ(r.finish, pb::FINISH_REASON_LENGTH);
  EXPECT_THAT(Tokens(r.tokens.begin(), r.tokens.begin() + 32), ElementsAreArray(ref.greedy[0]));

  EXPECT_EQ(server->process().WaitExit(60s), std::optional<int>(0));
  EXPECT_TRUE(server->process().WaitForLine("tailserve stopped", 1s).ok());
}

TEST(ServerWatchdogTest, StalledStepGoesNotServingAndItsEndRestoresServing) {
  const Reference ref = LoadReference();
  // One 4 s step against a 1 s watchdog: NOT_SERVING from ~1 s until the step ends at ~4 s, and
  // nothing left to run after it, so each state holds for seconds while the test checks it.
  std::unique_ptr<Server> server = Server::Launch({"--watchdog_s=1", "--debug_step_delay_ms=4000"});
  ASSERT_NE(server, nullptr);
  ASSERT_EQ(server->Health(), health::HealthCheckResponse::SERVING);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(kRpcTimeout));
  auto reader = server->stub().Generate(&ctx, Greedy(ref.prompts[0], 1));

  ASSERT_TRUE(server->process().WaitForLine("NOT_SERVING", 10s).ok()) << server->process().Output();
  EXPECT_EQ(server->Health(), health::HealthCheckResponse::NOT_SERVING);
  // A stall is reported, not acted on: the request still finishes with the right token.
  StreamResult r;
  ReadAll(reader.get(), &r);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_THAT(r.tokens, ElementsAreArray(Tokens(ref.greedy[0].begin(), ref.greedy[0].begin() + 1)));
  ASSERT_TRUE(server->process().WaitForLine("progress resumed; SERVING", 10s).ok());
  EXPECT_EQ(server->Health(), health::HealthCheckResponse::SERVING);
}

TEST(ServerFailureTest, StickyBackendErrorEndsStreamsWithInternalAndExitsNonZero) {
  const Reference ref = LoadReference();
  std::unique_ptr<Server> server =
      Server::Launch({"--debug_step_delay_ms=20", "--debug_fail_step=5"});
  ASSERT_NE(server, nullptr);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(kRpcTimeout));
  auto reader = server->stub().Generate(&ctx, Greedy(ref.prompts[0], 32));
  StreamResult r;
  ReadAll(reader.get(), &r);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INTERNAL) << r.status.error_message();
  EXPECT_THAT(r.status.error_message(), HasSubstr("injected failure at step 5"));
  // The tokens streamed before the failure are the right ones, and the stream ended early.
  ASSERT_LT(r.tokens.size(), 32u);
  EXPECT_THAT(r.tokens, ElementsAreArray(Tokens(ref.greedy[0].begin(),
                                                ref.greedy[0].begin() + r.tokens.size())));
  // Staying up would only answer errors: the process exits non-zero for its supervisor.
  EXPECT_EQ(server->process().WaitExit(30s), std::optional<int>(1));
  EXPECT_TRUE(server->process().WaitForLine("tailserve: backend failed, exiting", 1s).ok())
      << server->process().Output();
}

TEST(ServerStartupTest, DefaultBucketsFollowTheEngineListUpToMaxBatch) {
  const std::vector<std::pair<int32_t, std::vector<int32_t>>> cases = {
      {48, {1, 2, 4, 8, 16, 24, 32, 48}},
      {20, {1, 2, 4, 8, 16, 20}},
  };
  for (const auto& [max_batch, want] : cases) {
    SCOPED_TRACE(max_batch);
    std::unique_ptr<Server> server = Server::Launch({absl::StrCat("--max_batch=", max_batch)});
    ASSERT_NE(server, nullptr);
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10s));
    pb::ModelInfo info;
    ASSERT_TRUE(server->stub().GetModelInfo(&ctx, pb::GetModelInfoRequest(), &info).ok());
    EXPECT_EQ(info.max_batch(), max_batch);
    EXPECT_THAT(info.buckets(), ElementsAreArray(want));
  }
}

TEST(ServerStartupTest, BadFlagsFailWithAClearMessage) {
  struct Case {
    std::vector<std::string> argv;
    std::string message;
  };
  const std::string model =
      absl::StrCat("--model_dir=", (FixtureDir() / "tiny-gqa-untied").string());
  const std::vector<Case> cases = {
      {{TS_TAILSERVE_BINARY, "--model_dir=/nonexistent/model"}, "/nonexistent/model"},
      {{TS_TAILSERVE_BINARY, model, "--backend=cuda"}, "--backend cuda"},
      {{TS_TAILSERVE_BINARY, model, "--max_batch=8", "--buckets=1,2,4"}, "--buckets"},
      {{TS_TAILSERVE_BINARY}, "--model_dir"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Start(c.argv);
    ASSERT_TRUE(child.ok()) << child.status();
    const std::optional<int> rc = (*child)->WaitExit(30s);
    ASSERT_TRUE(rc.has_value()) << "tailserve kept running";
    EXPECT_EQ(*rc, 1);
    EXPECT_TRUE((*child)->WaitForLine(c.message, 5s).ok()) << (*child)->Output();
  }
}

}  // namespace
}  // namespace ts::testing
