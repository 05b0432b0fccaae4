// End to end, the multi-process pipeline: `tailserve --world_size 2 --rank 0` (the leader: gRPC,
// scheduler, stage 0) and `--rank 1` (a worker: the last stage, no port) as separate processes on
// loopback, and 3 processes too. Their tokens equal a single-process server's; SIGTERM on the
// leader stops every rank with exit 0; a worker killed mid-request fails the leader's request and
// the leader exits non-zero; a leader killed ends its worker with a message; a rank alone fails
// startup within
// --pipeline_timeout_ms naming the one missing. Every wait is bounded, so a hang fails the test.
#include <signal.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/server/e2e_util.h"

namespace ts::testing {
namespace {

constexpr auto kExitTimeout = 30s;

std::vector<std::string> RankFlags(int32_t rank, int32_t port, const std::string& timeout_ms,
                                   int32_t world = 2) {
  return {absl::StrCat("--world_size=", world), absl::StrCat("--rank=", rank),
          absl::StrCat("--leader_address=127.0.0.1:", port),
          absl::StrCat("--pipeline_timeout_ms=", timeout_ms)};
}

std::unique_ptr<ChildProcess> StartWorker(int32_t port, const std::string& timeout_ms = "30000",
                                          int32_t rank = 1, int32_t world = 2) {
  std::vector<std::string> argv = {
      TS_TAILSERVE_BINARY, "--backend=cpu",
      absl::StrCat("--model_dir=", (FixtureDir() / "tiny-gqa-untied").string()), "--threads=1"};
  for (std::string& f : RankFlags(rank, port, timeout_ms, world)) argv.push_back(std::move(f));
  absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Start(argv);
  EXPECT_TRUE(child.ok()) << child.status();
  return child.ok() ? *std::move(child) : nullptr;
}

// The leader and its workers, all up.
struct Pipeline {
  std::unique_ptr<ChildProcess> worker;             // rank 1
  std::vector<std::unique_ptr<ChildProcess>> more;  // ranks 2..world-1
  std::unique_ptr<Server> leader;
};

Pipeline StartPipeline(std::vector<std::string> leader_flags = {}, int32_t world = 2) {
  Pipeline p;
  const int32_t port = FreeLoopbackPort();
  // The workers first: they retry until the leader listens, as pods started early would.
  p.worker = StartWorker(port, "30000", 1, world);
  if (p.worker == nullptr) return p;
  for (int32_t r = 2; r < world; ++r) {
    p.more.push_back(StartWorker(port, "30000", r, world));
    if (p.more.back() == nullptr) return p;
  }
  std::vector<std::string> flags = RankFlags(0, port, "30000", world);
  flags.insert(flags.end(), leader_flags.begin(), leader_flags.end());
  p.leader = Server::Launch(flags);
  return p;
}

class PipelineTokensTest : public ::testing::TestWithParam<int32_t> {};

TEST_P(PipelineTokensTest, TokensEqualASingleProcessServerAndSigtermStopsEveryRank) {
  const int32_t world = GetParam();
  const Reference ref = LoadReference();
  std::vector<pb::GenerateRequest> reqs;
  for (size_t i = 0; i < ref.prompts.size(); ++i) {
    reqs.push_back(i % 2 == 0 ? Greedy(ref.prompts[i], 24) : Sampled(ref.prompts[i], 24, 40 + i));
  }
  std::vector<StreamResult> want(reqs.size());
  {
    std::unique_ptr<Server> single = Server::Launch({});
    ASSERT_NE(single, nullptr);
    for (size_t i = 0; i < reqs.size(); ++i) want[i] = Generate(single->stub(), reqs[i]);
  }
  Pipeline p = StartPipeline({}, world);
  ASSERT_NE(p.leader, nullptr);
  ASSERT_NE(p.worker, nullptr);
  EXPECT_EQ(p.leader->Health(), health::HealthCheckResponse::SERVING);
  // All at once, so the leader batches them and the ring carries several rows per step.
  std::vector<StreamResult> got(reqs.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < reqs.size(); ++i) {
    clients.emplace_back([&, i] { got[i] = Generate(p.leader->stub(), reqs[i]); });
  }
  for (std::thread& t : clients) t.join();
  for (size_t i = 0; i < reqs.size(); ++i) {
    SCOPED_TRACE(i);
    ASSERT_TRUE(want[i].status.ok()) << want[i].status.error_message();
    ASSERT_TRUE(got[i].status.ok()) << got[i].status.error_message();
    EXPECT_EQ(want[i].tokens.size(), 24u);
    EXPECT_EQ(got[i].tokens, want[i].tokens);
  }
  // The greedy ones are transformers' tokens too.
  EXPECT_THAT(got[0].tokens, ElementsAreArray(Prefix(ref.greedy[0], 24)));

  ASSERT_TRUE(p.leader->process().Signal(SIGTERM));
  EXPECT_EQ(p.leader->process().WaitExit(kExitTimeout), 0) << p.leader->process().Output();
  p.more.push_back(std::move(p.worker));
  for (auto& w : p.more) {
    EXPECT_EQ(w->WaitExit(kExitTimeout), 0) << w->Output();
    EXPECT_TRUE(w->WaitForLine("the leader shut the pipeline down", 1s).ok());
  }
}

// The fixture has 3 layers: 2 processes split them 2 + 1, 3 processes one each.
INSTANTIATE_TEST_SUITE_P(Ranks, PipelineTokensTest, ::testing::Values(2, 3));

TEST(PipelineRanksTest, AWorkerKilledMidRequestFailsItAndTheLeaderExits) {
  const Reference ref = LoadReference();
  Gate gate;
  // Decode step 1 waits at the gate: the first token (the prefill's) reaches the client before
  // that step runs, so the worker dies while the request is surely mid-run and the engine holds.
  Pipeline p = StartPipeline({gate.flag(), "--debug_gate_step=1"});
  ASSERT_NE(p.leader, nullptr);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(kRpcTimeout));
  auto reader = p.leader->stub().Generate(&ctx, Greedy(ref.prompts[0], 40));
  pb::GenerateResponse first;
  ASSERT_TRUE(reader->Read(&first));
  ASSERT_TRUE(p.worker->Signal(SIGKILL));
  EXPECT_EQ(p.worker->WaitExit(kExitTimeout), -SIGKILL);
  // The leader stops serving at once, and stays up while its request is still running.
  ASSERT_TRUE(p.leader->process().WaitForLine("pipeline failed", kExitTimeout).ok())
      << p.leader->process().Output();
  EXPECT_EQ(p.leader->Health(), health::HealthCheckResponse::NOT_SERVING);
  gate.Open();
  StreamResult r;
  ReadAll(reader.get(), &r);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INTERNAL) << r.status.error_message();
  EXPECT_THAT(r.status.error_message(), HasSubstr("pipeline rank 0: rank 1"));
  const std::optional<int> rc = p.leader->process().WaitExit(kExitTimeout);
  EXPECT_EQ(rc, 1) << p.leader->process().Output();
  EXPECT_TRUE(p.leader->process().WaitForLine("backend failed", 1s).ok())
      << p.leader->process().Output();
}

TEST(PipelineRanksTest, AWorkerKilledWhileIdleTakesTheLeaderOutOfService) {
  Pipeline p = StartPipeline();
  ASSERT_NE(p.leader, nullptr);
  ASSERT_TRUE(p.worker->Signal(SIGKILL));
  // No request ran, yet the leader notices the lost link and stops serving.
  EXPECT_EQ(p.leader->process().WaitExit(kExitTimeout), 1) << p.leader->process().Output();
  EXPECT_TRUE(p.leader->process().WaitForLine("pipeline failed", 1s).ok())
      << p.leader->process().Output();
}

TEST(PipelineRanksTest, ALeaderKilledEndsItsWorker) {
  Pipeline p = StartPipeline();
  ASSERT_NE(p.leader, nullptr);
  ASSERT_TRUE(p.leader->process().Signal(SIGKILL));
  EXPECT_EQ(p.worker->WaitExit(kExitTimeout), 1) << p.worker->Output();
  EXPECT_TRUE(p.worker->WaitForLine("rank 0 closed the connection", 1s).ok()) << p.worker->Output();
}

TEST(PipelineRanksTest, ALeaderAloneExitsWithinTheTimeoutNamingRank1) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::string> argv = {
      TS_TAILSERVE_BINARY, "--backend=cpu", "--port=0",
      absl::StrCat("--model_dir=", (FixtureDir() / "tiny-gqa-untied").string()), "--threads=1"};
  for (std::string& f : RankFlags(0, FreeLoopbackPort(), "2000")) argv.push_back(std::move(f));
  absl::StatusOr<std::unique_ptr<ChildProcess>> leader = ChildProcess::Start(argv);
  ASSERT_TRUE(leader.ok()) << leader.status();
  EXPECT_EQ((*leader)->WaitExit(kExitTimeout), 1) << (*leader)->Output();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s);
  EXPECT_TRUE((*leader)->WaitForLine("rank 1 never connected", 1s).ok()) << (*leader)->Output();
  EXPECT_EQ((*leader)->CountLines("tailserve listening on"), 0);
}

TEST(PipelineRanksTest, AWorkerAloneExitsWithinTheTimeoutNamingTheLeader) {
  const auto start = std::chrono::steady_clock::now();
  const int32_t port = FreeLoopbackPort();
  std::unique_ptr<ChildProcess> worker = StartWorker(port, "2000");
  ASSERT_NE(worker, nullptr);
  EXPECT_EQ(worker->WaitExit(kExitTimeout), 1) << worker->Output();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s);
  EXPECT_TRUE(
      worker->WaitForLine(absl::StrCat("could not reach the leader at 127.0.0.1:", port), 1s).ok())
      << worker->Output();
}

TEST(PipelineRanksTest, FlagsThatCannotWorkAreRefused) {
  const std::string model = (FixtureDir() / "tiny-gqa-untied").string();
  const auto refused = [&](std::vector<std::string> flags, const std::string& why) {
    std::vector<std::string> argv = {TS_TAILSERVE_BINARY, "--port=0",
                                     absl::StrCat("--model_dir=", model)};
    argv.insert(argv.end(), flags.begin(), flags.end());
    absl::StatusOr<std::unique_ptr<ChildProcess>> c = ChildProcess::Start(argv);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ((*c)->WaitExit(kExitTimeout), 1) << (*c)->Output();
    EXPECT_TRUE((*c)->WaitForLine(why, 1s).ok()) << (*c)->Output();
  };
  refused({"--world_size=2", "--rank=2", "--leader_address=127.0.0.1:1"}, "outside [0, 2)");
  refused({"--world_size=2"}, "needs the leader's address");
  // A CUDA pipeline is host-driven, on every rank.
  refused(
      {"--backend=cuda", "--world_size=2", "--leader_address=127.0.0.1:1", "--decode_loop=loop"},
      "runs host-driven steps");
  refused({"--backend=cuda", "--world_size=2", "--rank=1", "--leader_address=127.0.0.1:1",
           "--decode_loop=loop"},
          "runs host-driven steps");
  refused({"--world_size=2", "--pipeline_stages=3", "--leader_address=127.0.0.1:1",
           "--pipeline_timeout_ms=100"},
          "one stage per process");
}

}  // namespace
}  // namespace ts::testing
