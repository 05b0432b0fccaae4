// End to end: the API's edges as a new user meets them (issue #14, item 6): a busy port, flags out
// of range, --help, an unset max_new_tokens, the shape of a stream's last message and its Timing, a
// request that arrives after its deadline, and a request id reused right after DEADLINE_EXCEEDED.
// Waits use the server's gates and log lines, never a guess at how long something takes.
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "tests/server/e2e_util.h"

namespace ts::testing {
namespace {

std::string ModelFlag() {
  return absl::StrCat("--model_dir=", (FixtureDir() / "tiny-gqa-untied").string());
}

// Starts tailserve with `flags` and expects it to refuse: exit code 1 and a line containing
// `message`. A server that starts instead fails the test at once rather than at a timeout.
void ExpectRefusal(const std::vector<std::string>& flags, const std::string& message) {
  SCOPED_TRACE(message);
  std::vector<std::string> argv = {TS_TAILSERVE_BINARY, ModelFlag(), "--backend=cpu",
                                   "--threads=1"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Start(argv);
  ASSERT_TRUE(child.ok()) << child.status();
  // NotFound once the child exits without printing it.
  if ((*child)->WaitForLine("tailserve listening on ", kStartTimeout).ok()) {
    ADD_FAILURE() << "tailserve started:\n" << (*child)->Output();
    return;
  }
  const std::optional<int> rc = (*child)->WaitExit(10s);
  ASSERT_TRUE(rc.has_value()) << "tailserve kept running";
  EXPECT_EQ(*rc, 1) << (*child)->Output();
  EXPECT_TRUE((*child)->WaitForLine(message, 1s).ok()) << (*child)->Output();
}

TEST(ServerEdgeTest, ATokenizerThatCannotServeTheModelRefusesToStart) {
  // Named explicitly but absent: refused rather than silently serving ids only.
  ExpectRefusal({"--tokenizer_dir=/nonexistent-tailserve-tokenizer"},
                "--tokenizer_dir: no tokenizer.json or tokenizer.model in");
  // Llama-3's pre-tokenizer fixture has more tokens than this model's 311 ids.
  ExpectRefusal(
      {absl::StrCat("--tokenizer_dir=",
                    (BinaryDir() / "tests/models/tokenizer_fixtures/bytelevel-llama3").string())},
      "exceed the model's vocab_size 311");
}

// The fixture's weights under a config that claims Llama-3.1's 131072 positions: what a real
// checkpoint's default context asks of the CPU backend's fp32 KV pool.
std::filesystem::path LongContextFixture() {
  const auto src = FixtureDir() / "tiny-gqa-untied";
  const auto dir =
      std::filesystem::temp_directory_path() / absl::StrCat("tailserve-long-context-", getpid());
  std::filesystem::create_directories(dir);
  std::ifstream in(src / "config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  config["max_position_embeddings"] = 131072;
  std::ofstream(dir / "config.json") << config.dump(1);
  std::filesystem::remove(dir / "model.safetensors");
  std::filesystem::create_symlink(src / "model.safetensors", dir / "model.safetensors");
  return dir;
}

TEST(ServerEdgeTest, ALongContextModelStartsOnTheCpuWithItsBudgetPrinted) {
  const auto dir = LongContextFixture();
  const std::string model = absl::StrCat("--model_dir=", dir.string());
  // 0.01 GiB hold 873 blocks of 16 tokens (12288 bytes each: 3 layers, 2 kv heads, head_dim 16).
  std::unique_ptr<Server> server = Server::Launch({model, "--cpu_kv_gib=0.01", "--max_batch=16"});
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(server->process()
                  .WaitForLine("KV pool capped by --cpu_kv_gib 0.01: 873 blocks (13968 tokens)", 1s)
                  .ok())
      << server->process().Output();
  EXPECT_TRUE(server->process()
                  .WaitForLine("max_context lowered from the model's 131072 to the KV pool's "
                               "13968 tokens",
                               1s)
                  .ok())
      << server->process().Output();
  grpc::ClientContext ctx;
  pb::ModelInfo info;
  ASSERT_TRUE(server->stub().GetModelInfo(&ctx, pb::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.max_context(), 13968);
  const StreamResult r = Generate(server->stub(), Greedy({1, 15, 27}, 8));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens.size(), 8u);
  server.reset();

  // Asked for explicitly, a context or pool that does not fit is refused naming the flags.
  ExpectRefusal({model, "--cpu_kv_gib=0.01", "--max_context=131072"},
                "--max_context: 131072 tokens do not fit the KV pool of 13968 tokens");
  ExpectRefusal({model, "--cpu_kv_gib=0.01", "--kv_blocks=100000"},
                "--kv_blocks: 100000 blocks of 16 tokens need 1171 MiB of fp32 KV, above "
                "--cpu_kv_gib 0.01 (873 blocks fit)");
  std::filesystem::remove_all(dir);
}

TEST(ServerEdgeTest, SecondServerOnABusyPortRefusesToStart) {
  std::unique_ptr<Server> first = Server::Launch({});
  ASSERT_NE(first, nullptr);
  const pb::ServerStats before = first->Stats();
  const std::string address = first->process().WaitForLine("listening on ", 1s).value();
  const std::string port = address.substr(address.rfind(':') + 1);
  // gRPC sets SO_REUSEPORT by default: without turning it off, the second bind succeeds and the
  // kernel splits new connections between the two servers.
  ExpectRefusal({absl::StrCat("--port=", port)}, absl::StrCat("127.0.0.1:", port));
  EXPECT_EQ(first->Health(), health::HealthCheckResponse::SERVING);
  EXPECT_EQ(first->Stats().kv_blocks_total(), before.kv_blocks_total());
}

TEST(ServerEdgeTest, OutOfRangeFlagsFailNamingTheFlag) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--port=70000", "--port"},
      {"--port=-1", "--port"},
      {"--threads=-3", "--threads"},
      {"--kv_block_size=1000000", "--kv_block_size"},
      {"--kv_block_size=0", "--kv_block_size"},
      {"--drain_timeout_s=-1", "--drain_timeout_s"},
      {"--watchdog_s=-5", "--watchdog_s"},
      {"--stats_interval_s=-1", "--stats_interval_s"},
      {"--queue_limit=-1", "--queue_limit"},
      {"--max_context=-2", "--max_context"},
      {"--kv_blocks=-1", "--kv_blocks"},
      {"--stream_buffer_tokens=0", "--stream_buffer_tokens"},
      {"--gpu_memory_fraction=1.5", "--gpu_memory_fraction"},
      {"--max_batch=100000", "--max_batch"},
      {"--debug_step_delay_ms=-1", "--debug_step_delay_ms"},
      {"--prefill_step_tokens=0", "--prefill_step_tokens"},
      {"--prefill_catchup_tokens=0", "--prefill_catchup_tokens"},
      {"--prefill_catchup_ms=-1", "--prefill_catchup_ms"},
  };
  for (const auto& [flag, name] : cases) {
    SCOPED_TRACE(flag);
    ExpectRefusal({flag}, name);
  }
}

TEST(ServerEdgeTest, HelpListsTheFlags) {
  absl::StatusOr<std::unique_ptr<ChildProcess>> child =
      ChildProcess::Start({TS_TAILSERVE_BINARY, "--help"});
  ASSERT_TRUE(child.ok()) << child.status();
  ASSERT_TRUE((*child)->WaitExit(30s).has_value()) << "tailserve --help kept running";
  const std::string out = (*child)->Output();
  EXPECT_THAT(out, HasSubstr("--max_batch")) << out;
  EXPECT_THAT(out, HasSubstr("--model_dir")) << out;
  EXPECT_THAT(out, ::testing::Not(HasSubstr("No flags matched"))) << out;
}

// The `default: ...` absl prints for `--flag` in `binary --help`.
std::string HelpDefault(const char* binary, const std::string& flag) {
  absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Start({binary, "--help"});
  EXPECT_TRUE(child.ok()) << child.status();
  if (!child.ok()) return "";
  EXPECT_TRUE((*child)->WaitExit(30s).has_value()) << binary << " --help kept running";
  const std::string out = (*child)->Output();
  const size_t at = out.find("--" + flag + " (");  // the flag's entry, not a usage line
  EXPECT_NE(at, std::string::npos) << binary << " --help does not list --" << flag << ":\n" << out;
  if (at == std::string::npos) return "";
  const size_t d = out.find("default: ", at);
  EXPECT_NE(d, std::string::npos) << out.substr(at, 200);
  if (d == std::string::npos) return "";
  const size_t end = out.find(';', d);
  std::string v = out.substr(d + 9, end - d - 9);
  std::erase(v, '"');
  return v;
}

// A new user starts `tailserve` and then a client, both without flags: they must meet.
TEST(ServerEdgeTest, ServerAndClientsAgreeOnTheDefaultPort) {
  const std::string port = HelpDefault(TS_TAILSERVE_BINARY, "port");
  ASSERT_FALSE(port.empty());
  EXPECT_NE(port, "0") << "the server's default port is a random one";
  for (const char* client : {TS_CLIENT_BINARY, TS_LOAD_BINARY}) {
    const std::string target = HelpDefault(client, "target");
    EXPECT_TRUE(target.ends_with(":" + port))
        << client << " defaults to " << target << ", the server to port " << port;
  }
}

// One server without step delays: the tests here read whole streams.
class EdgeStreamTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ref_ = new Reference(LoadReference());
    server_ = Server::Launch({"--max_batch=8"}).release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
    delete ref_;
  }
  void SetUp() override { ASSERT_NE(server_, nullptr) << "tailserve did not start"; }

  static Server* server_;
  static Reference* ref_;
};
Server* EdgeStreamTest::server_ = nullptr;
Reference* EdgeStreamTest::ref_ = nullptr;

// Reads a stream and checks its shape: only the last message carries a finish reason, and it
// carries the last tokens with it.
struct Shape {
  StreamResult result;
  std::vector<int> sizes;  // token count of each message
  bool finish_before_last = false;
};

Shape ReadShape(pb::Generation::Stub& stub, const pb::GenerateRequest& req) {
  grpc::ClientContext ctx;
  ctx.set_deadline(In(kRpcTimeout));
  auto reader = stub.Generate(&ctx, req);
  Shape s;
  pb::GenerateResponse msg;
  while (reader->Read(&msg)) {
    if (s.result.finish != pb::FINISH_REASON_UNSPECIFIED) s.finish_before_last = true;
    ++s.result.messages;
    s.sizes.push_back(msg.token_ids_size());
    s.result.tokens.insert(s.result.tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
    s.result.finish = msg.finish_reason();
    s.result.usage = msg.usage();
  }
  s.result.status = reader->Finish();
  return s;
}

TEST_F(EdgeStreamTest, LastMessageCarriesTheLastTokensAndTheFinishReason) {
  const Tokens& prompt = ref_->prompts[1];
  const Tokens& want = ref_->greedy[1];
  for (int32_t n : {1, 2, 3, 5, 8}) {
    const int reps = n == 1 ? 50 : 10;
    for (int rep = 0; rep < reps; ++rep) {
      SCOPED_TRACE(absl::StrCat("max_new_tokens ", n, " rep ", rep));
      const Shape s = ReadShape(server_->stub(), Greedy(prompt, n));
      ASSERT_TRUE(s.result.status.ok()) << s.result.status.error_message();
      EXPECT_THAT(s.result.tokens, ElementsAreArray(Prefix(want, n)));
      ASSERT_FALSE(s.sizes.empty());
      EXPECT_FALSE(s.finish_before_last);
      EXPECT_EQ(s.result.finish, pb::FINISH_REASON_LENGTH);
      EXPECT_GT(s.sizes.back(), 0)
          << "the final message came without tokens (" << s.result.messages << " messages)";
      EXPECT_EQ(s.result.usage.completion_tokens(), n);
      EXPECT_EQ(s.result.usage.prompt_tokens(), static_cast<int32_t>(prompt.size()));
    }
  }
  // A stop token ends the stream the same way: the stop token rides on the final message.
  const int32_t stop = want[3];
  const auto first = std::find(want.begin(), want.end(), stop) - want.begin();
  for (int rep = 0; rep < 10; ++rep) {
    SCOPED_TRACE(absl::StrCat("stop token rep ", rep));
    pb::GenerateRequest req = Greedy(prompt, 32);
    req.mutable_stop()->add_stop_token_ids(stop);
    const Shape s = ReadShape(server_->stub(), req);
    ASSERT_TRUE(s.result.status.ok()) << s.result.status.error_message();
    EXPECT_THAT(s.result.tokens, ElementsAreArray(Prefix(want, first + 1)));
    EXPECT_FALSE(s.finish_before_last);
    EXPECT_EQ(s.result.finish, pb::FINISH_REASON_STOP_TOKEN);
    ASSERT_FALSE(s.sizes.empty());
    EXPECT_GT(s.sizes.back(), 0);
  }
}

TEST_F(EdgeStreamTest, UnsetMaxNewTokensMeansWhatIsLeftOfTheContext) {
  // 250 prompt tokens leave 6 positions of the fixture's 256: the old default of 16 was refused
  // with an error naming stop.max_new_tokens, a field this client never set.
  Tokens prompt;
  for (int i = 0; i < 250; ++i) prompt.push_back(3 + (i * 37) % 300);
  pb::GenerateRequest req = Greedy(prompt, 1);
  req.mutable_stop()->clear_max_new_tokens();
  const StreamResult r = Generate(server_->stub(), req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens.size(), 6u);
  EXPECT_EQ(r.finish, pb::FINISH_REASON_LENGTH);
  EXPECT_EQ(r.usage.completion_tokens(), 6);
  // The same prompt with max_new_tokens = 6 set explicitly gives the same tokens.
  const StreamResult explicit6 = Generate(server_->stub(), Greedy(prompt, 6));
  ASSERT_TRUE(explicit6.status.ok()) << explicit6.status.error_message();
  EXPECT_THAT(r.tokens, ElementsAreArray(explicit6.tokens));
}

TEST(ServerEdgeTest, RequestArrivingAfterItsDeadlineNeverReachesTheEngine) {
  // Generate sleeps 1.5 s before looking at a request: one sent with a 300 ms deadline is read
  // after it has expired, as behind a loaded proxy. The hook's line says when it was handled.
  std::unique_ptr<Server> server = Server::Launch({"--debug_generate_delay_ms=1500"});
  ASSERT_NE(server, nullptr);
  const pb::ServerStats before = server->WaitSettled();
  grpc::ClientContext ctx;
  ctx.set_deadline(In(300ms));
  StreamResult r;
  ReadAll(server->stub().Generate(&ctx, Greedy(LoadReference().prompts[2], 32)).get(), &r);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  ASSERT_TRUE(server->process().WaitForLine("debug_generate_delay: handled", kSettleTimeout).ok())
      << server->process().Output();
  const pb::ServerStats after = server->WaitSettled();
  EXPECT_EQ(after.requests_finished(), before.requests_finished())
      << "the expired request reached the engine";
  EXPECT_EQ(after.tokens_generated(), before.tokens_generated());
}

// The Timing on a stream's last message says where the call waited. Every prefill waits on a
// gate that the test holds shut for `kHeld` after both requests are inside the server, so the
// first request's prefill and the second's queue (one slot: --max_batch=1) each last at least that.
TEST(ServerEdgeTest, TimingSaysWhereTheCallWaited) {
  constexpr auto kHeld = 300ms;
  const Reference ref = LoadReference();
  Gate gate;
  std::unique_ptr<Server> server =
      Server::Launch({gate.flag(), "--debug_gate_prefill", "--max_batch=1"});
  ASSERT_NE(server, nullptr);
  struct Call {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<pb::GenerateResponse>> reader;
    std::chrono::steady_clock::time_point sent;
    StreamResult result;
    std::chrono::microseconds wall{};
  };
  Call calls[2];
  auto send = [&](Call& c, size_t prompt) {
    c.ctx.set_deadline(In(kRpcTimeout));
    c.sent = std::chrono::steady_clock::now();
    c.reader = server->stub().Generate(&c.ctx, Greedy(ref.prompts[prompt], 8));
  };
  send(calls[0], 0);
  server->WaitStats([](const pb::ServerStats& s) { return s.running() == 1; },
                    "the first request in its prefill");
  send(calls[1], 2);
  server->WaitStats([](const pb::ServerStats& s) { return s.queued() == 1; },
                    "the second request queued behind it");
  std::this_thread::sleep_for(kHeld);
  gate.Open();
  for (Call& c : calls) {
    ReadAll(c.reader.get(), &c.result);
    c.wall = std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::steady_clock::now() - c.sent);
  }
  const int64_t held_us = std::chrono::microseconds(kHeld).count();
  for (int i = 0; i < 2; ++i) {
    SCOPED_TRACE(absl::StrCat("call ", i));
    const StreamResult& r = calls[i].result;
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_THAT(r.tokens, ElementsAreArray(Prefix(ref.greedy[i == 0 ? 0 : 2], 8)));
    ASSERT_EQ(r.timing_messages, 1) << "Timing belongs on the last message only";
    const pb::Timing& t = r.timing;
    EXPECT_GE(t.preprocess_us(), 0);
    EXPECT_GE(t.queue_us(), 0);
    EXPECT_GE(t.prefill_us(), 0);
    // The CPU backend prefills inside Prefill: no wait behind other prompts of its own.
    EXPECT_EQ(t.prefill_wait_us(), 0);
    EXPECT_GT(t.decode_us(), 0) << "7 tokens came after the first";
    // The server's interval lies inside the client's, on the same monotonic clock.
    EXPECT_LE(
        t.preprocess_us() + t.queue_us() + t.prefill_wait_us() + t.prefill_us() + t.decode_us(),
        calls[i].wall.count());
  }
  EXPECT_GE(calls[0].result.timing.prefill_us(), held_us);
  EXPECT_GE(calls[1].result.timing.queue_us(), held_us);
}

TEST(ServerEdgeTest, RequestIdIsFreeOnceTheClientHasItsDeadlineExceeded) {
  // Decode step 1 waits on the gate: the engine thread is stuck, so the first request cannot be
  // retired (nor its cancel processed) before the retry arrives.
  const Reference ref = LoadReference();
  Gate gate;
  std::unique_ptr<Server> server = Server::Launch({gate.flag(), "--debug_gate_step=1"});
  ASSERT_NE(server, nullptr);
  pb::GenerateRequest req = Greedy(ref.prompts[2], 32);
  req.set_request_id("retry-me");
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(500ms));
    StreamResult r;
    ReadAll(server->stub().Generate(&ctx, req).get(), &r);
    ASSERT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
        << r.status.error_message();
  }
  grpc::ClientContext retry_ctx;
  retry_ctx.set_deadline(In(kRpcTimeout));
  auto retry = server->stub().Generate(&retry_ctx, req);
  // The retry waits in the queue behind the stuck step; the first request still runs there, and
  // its cancel is still pending when the gate opens.
  server->WaitStats([](const pb::ServerStats& s) { return s.queued() == 1 && s.running() == 1; },
                    "the retry queued behind the first request");
  gate.Open();
  StreamResult r;
  ReadAll(retry.get(), &r);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.request_id, "retry-me");
  // The first request's late cancel carried the same id: it must not have cut the retry short.
  EXPECT_THAT(r.tokens, ElementsAreArray(ref.greedy[2]));
  EXPECT_EQ(r.finish, pb::FINISH_REASON_LENGTH);
  server->WaitSettled();
  // Reused once more after a normal finish.
  const StreamResult again = Generate(server->stub(), req);
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_THAT(again.tokens, ElementsAreArray(ref.greedy[2]));
}

}  // namespace
}  // namespace ts::testing
