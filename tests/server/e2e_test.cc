// End to end: the real `tailserve` binary on the tiny CPU fixture, driven by a real gRPC client.
// Expected tokens come from transformers (reference.json) or from the same server answering the
// same request alone, never from this file.
#include <algorithm>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "reflection.grpc.pb.h"
#include "tests/server/e2e_util.h"

namespace ts::testing {
namespace {

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

// The reference streams were computed with EOS ignored, so where one holds an EOS id the server,
// asked to honour EOS, must stop right there (EOS included) and say FINISH_REASON_EOS; the fixture
// has one (reference prompt 1), and this test fails if a regenerated fixture loses it.
TEST_F(ServerE2ETest, EosEndsTheStreamAtTheReferencesFirstEos) {
  grpc::ClientContext ctx;
  ctx.set_deadline(In(10s));
  pb::ModelInfo info;
  ASSERT_TRUE(server_->stub().GetModelInfo(&ctx, pb::GetModelInfoRequest(), &info).ok());
  ASSERT_GT(info.eos_token_ids_size(), 0);
  int hits = 0;
  for (size_t i = 0; i < ref_->prompts.size(); ++i) {
    SCOPED_TRACE(i);
    const Tokens& want = ref_->greedy[i];
    const auto eos = std::find_first_of(want.begin(), want.end(), info.eos_token_ids().begin(),
                                        info.eos_token_ids().end());
    pb::GenerateRequest req = Greedy(ref_->prompts[i], static_cast<int32_t>(want.size()));
    req.mutable_stop()->set_ignore_eos(false);
    const StreamResult r = Generate(server_->stub(), req);
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    const size_t n = eos == want.end() ? want.size() : static_cast<size_t>(eos - want.begin()) + 1;
    EXPECT_THAT(r.tokens, ElementsAreArray(Prefix(want, n)));
    EXPECT_EQ(r.finish, eos == want.end() ? pb::FINISH_REASON_LENGTH : pb::FINISH_REASON_EOS);
    EXPECT_EQ(r.usage.completion_tokens(), static_cast<int32_t>(n));
    hits += eos != want.end();
  }
  EXPECT_GE(hits, 1) << "no reference stream holds an EOS id: EOS is not tested";
  server_->WaitSettled();
}

// A stop id taken from the reference stream itself (its first token not seen before position 3)
// ends the stream there, the stop token included, with FINISH_REASON_STOP_TOKEN; min_new_tokens
// past that position makes the server run on to the next occurrence or the length limit.
TEST_F(ServerE2ETest, StopTokenEndsTheStreamAtItsFirstOccurrence) {
  for (size_t i = 0; i < ref_->prompts.size(); ++i) {
    SCOPED_TRACE(i);
    const Tokens& want = ref_->greedy[i];
    size_t k = 3;
    while (k < want.size() &&
           std::find(want.begin(), want.begin() + k, want[k]) != want.begin() + k) {
      ++k;
    }
    ASSERT_LT(k, want.size());
    pb::GenerateRequest req = Greedy(ref_->prompts[i], static_cast<int32_t>(want.size()));
    req.mutable_stop()->add_stop_token_ids(want[k]);
    const StreamResult r = Generate(server_->stub(), req);
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_THAT(r.tokens, ElementsAreArray(Prefix(want, k + 1)));
    EXPECT_EQ(r.finish, pb::FINISH_REASON_STOP_TOKEN);
    EXPECT_EQ(r.usage.completion_tokens(), static_cast<int32_t>(k + 1));

    req.mutable_stop()->set_min_new_tokens(static_cast<int32_t>(k + 1));
    const StreamResult late = Generate(server_->stub(), req);
    ASSERT_TRUE(late.status.ok()) << late.status.error_message();
    const auto next = std::find(want.begin() + k + 1, want.end(), want[k]);
    const size_t n =
        next == want.end() ? want.size() : static_cast<size_t>(next - want.begin()) + 1;
    EXPECT_THAT(late.tokens, ElementsAreArray(Prefix(want, n)));
    EXPECT_EQ(late.finish,
              next == want.end() ? pb::FINISH_REASON_LENGTH : pb::FINISH_REASON_STOP_TOKEN);
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

// Sixteen greedy and seeded requests, each alone and then all at once: the batch must not change
// anyone's tokens, and the greedy reference prompts follow transformers.
void CheckConcurrentStreams(Server& server, const Reference& ref) {
  std::vector<pb::GenerateRequest> reqs;
  std::mt19937 rng(1234);
  for (int i = 0; i < 16; ++i) {
    Tokens prompt;
    if (i < static_cast<int>(ref.prompts.size())) {
      prompt = ref.prompts[i];
    } else {
      prompt.resize(1 + rng() % 40);
      for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % 311);
    }
    const int32_t n = 16 + i * 3;
    reqs.push_back(i % 2 == 0 ? Greedy(prompt, n) : Sampled(prompt, n, 100 + i));
  }
  std::vector<Tokens> solo;
  for (const auto& req : reqs) {
    const StreamResult r = Generate(server.stub(), req);
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    ASSERT_EQ(r.tokens.size(), static_cast<size_t>(req.stop().max_new_tokens()));
    solo.push_back(r.tokens);
  }
  for (size_t i = 0; i < ref.prompts.size(); ++i) {
    // Greedy (even i) reference prompts also match transformers on their common prefix.
    if (i % 2 == 0) {
      EXPECT_THAT(Tokens(solo[i].begin(), solo[i].begin() + 16),
                  ElementsAreArray(ref.greedy[i].begin(), ref.greedy[i].begin() + 16));
    }
  }
  std::vector<StreamResult> together(reqs.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < reqs.size(); ++i) {
    threads.emplace_back([&, i] { together[i] = Generate(server.stub(), reqs[i]); });
  }
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(together[i].status.ok()) << i << ": " << together[i].status.error_message();
    EXPECT_EQ(together[i].tokens, solo[i]) << "stream " << i;
  }
  server.WaitSettled();
}

TEST_F(ServerE2ETest, SixteenConcurrentStreamsEachGetTheirOwnTokens) {
  CheckConcurrentStreams(*server_, *ref_);
}

// --decode_loop=loop on the CPU backend: the engine thread admits, streams and retires beside the
// backend's loop thread (docs/device-loop.md), through the whole server.
// --pipeline_stages=2 on the CPU backend: two stage threads, micro-batches in flight, the same
// tokens as one stage (the reference is transformers').
TEST(ServerPipelineTest, TwoStagesServeAsOneDoes) {
  const Reference ref = LoadReference();
  std::unique_ptr<Server> server = Server::Launch({"--max_batch=8", "--pipeline_stages=2"});
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(server->process().WaitForLine("pipeline of 2 stages", 5s).ok())
      << server->process().Output();
  CheckConcurrentStreams(*server, ref);
  server->WaitSettled();
}

TEST(ServerLoopTest, LoopModeStreamsAsTheHostDrivenModeDoes) {
  const Reference ref = LoadReference();
  std::unique_ptr<Server> server = Server::Launch({"--max_batch=8", "--decode_loop=loop"});
  ASSERT_NE(server, nullptr);
  CheckConcurrentStreams(*server, ref);
  // A client cancel while the loop runs (or just after the stream ended: the tiny model is fast
  // and no debug delay slows a loop) leaves no slot, KV block or stream behind.
  OpenStream open;
  StartLong(*server, ref.prompts[0], &open);
  open.ctx.TryCancel();
  ReadAll(open.reader.get(), &open.result);
  EXPECT_TRUE(open.result.status.ok() ||
              open.result.status.error_code() == grpc::StatusCode::CANCELLED)
      << open.result.status.error_message();
  server->WaitSettled();
  // GetStats carries the loop's counters: the CPU loop thread started with the backend, and the
  // engine never pauses it; it has no mixed steps or attention regimes.
  const pb::ServerStats s = server->Stats();
  EXPECT_GT(s.steps(), 0u);
  EXPECT_EQ(s.loop_launches(), 1u);
  EXPECT_EQ(s.mixed_steps(), 0u);
  EXPECT_EQ(s.regime_changes_on_device() + s.regime_changes_by_exit(), 0u);
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
      {"prompt_text", [](auto* r) { r->set_prompt_text(std::string("hi\xFF", 3)); },
       grpc::StatusCode::INVALID_ARGUMENT, "prompt_text"},
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
      {{TS_TAILSERVE_BINARY, model, "--decode_loop=sometimes"}, "--decode_loop"},
      {{TS_TAILSERVE_BINARY, model, "--pipeline_stages=4"}, "--pipeline_stages: 4"},
      {{TS_TAILSERVE_BINARY, model, "--decode_loop=loop", "--debug_step_delay_ms=5"},
       "host-driven steps only"},
      // No GPU here (CI), or one: two stages want two unless --pipeline_devices says otherwise.
      {{TS_TAILSERVE_BINARY, model, "--backend=cuda", "--pipeline_stages=2"},
       "--pipeline_stages: 2 stages need 2 GPUs"},
      {{TS_TAILSERVE_BINARY, model, "--backend=cuda", "--pipeline_stages=2", "--decode_loop=loop"},
       "--decode_loop: a CUDA pipeline runs host-driven steps"},
      {{TS_TAILSERVE_BINARY, model, "--backend=cuda", "--pipeline_stages=2",
        "--pipeline_devices=0"},
       "--pipeline_devices: 1 devices for --pipeline_stages 2"},
      {{TS_TAILSERVE_BINARY, model, "--backend=cuda", "--pipeline_stages=2",
        "--pipeline_devices=0,gpu1"},
       "--pipeline_devices: 'gpu1' is not a device ordinal"},
      {{TS_TAILSERVE_BINARY, model, "--pipeline_stages=2", "--pipeline_devices=0,1"},
       "--pipeline_devices: only for a CUDA pipeline"},
      {{TS_TAILSERVE_BINARY, model, "--backend=cuda", "--pipeline_stages=2", "--device=1"},
       "--device: a CUDA pipeline puts its stages on --pipeline_devices"},
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