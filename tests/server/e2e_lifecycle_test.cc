// End to end, the server's life beyond single requests: the watchdog, the drain on SIGTERM (its
// timeout, a second signal, queued requests), a sticky backend failure and a client cancel.
// Every test that needs "the engine is stuck here" holds it at a --debug_gate_file gate that the
// test opens, so no assertion races the wall clock on a loaded machine.
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/server/e2e_util.h"

namespace ts::testing {
namespace {

TEST(ServerWatchdogTest, StalledStepGoesNotServingAndItsEndRestoresServing) {
  const Reference ref = LoadReference();
  // One 4 s step against a 1 s watchdog: NOT_SERVING from ~1 s until the step ends at ~4 s, and
  // nothing left to run after it, so each state holds for seconds while the test checks it. Two
  // tokens: the prefill gives the first, so only a second one takes a decode step.
  std::unique_ptr<Server> server = Server::Launch({"--watchdog_s=1", "--debug_step_delay_ms=4000"});
  ASSERT_NE(server, nullptr);
  ASSERT_EQ(server->Health(), health::HealthCheckResponse::SERVING);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(kRpcTimeout));
  auto reader = server->stub().Generate(&ctx, Greedy(ref.prompts[0], 2));

  ASSERT_TRUE(server->process().WaitForLine("NOT_SERVING", 10s).ok()) << server->process().Output();
  EXPECT_EQ(server->Health(), health::HealthCheckResponse::NOT_SERVING);
  // A stall is reported, not acted on: the request still finishes with the right token.
  StreamResult r;
  ReadAll(reader.get(), &r);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_THAT(r.tokens, ElementsAreArray(Tokens(ref.greedy[0].begin(), ref.greedy[0].begin() + 2)));
  ASSERT_TRUE(server->process().WaitForLine("progress resumed; SERVING", 10s).ok());
  EXPECT_EQ(server->Health(), health::HealthCheckResponse::SERVING);
}

// One-token requests never reach a decode step: the engine does nothing but prefill them, 300 ms
// each, for longer than the 2 s watchdog. Counting only decode steps declared this server dead.
TEST(ServerWatchdogTest, ABacklogOfPrefillsIsProgress) {
  const Reference ref = LoadReference();
  std::unique_ptr<Server> server = Server::Launch(
      {"--watchdog_s=2", "--max_batch=1", "--debug_prefill_delay_ms=300", "--stats_interval_s=1"});
  ASSERT_NE(server, nullptr);
  const int stats_before = server->process().CountLines("tailserve stats:");
  std::atomic<bool> stop{false};
  struct Done {
    size_t prompt;
    StreamResult result;
  };
  std::vector<std::vector<Done>> done(4);
  std::vector<std::thread> clients;
  for (size_t c = 0; c < done.size(); ++c) {
    clients.emplace_back([&, c] {
      for (size_t n = 0; !stop.load(); ++n) {
        const size_t i = (c + n) % ref.prompts.size();
        done[c].push_back({i, Generate(server->stub(), Greedy(ref.prompts[i], 1))});
      }
    });
  }
  // Four stats lines, a second apart, after the backlog began: more than 3 s of prefills only.
  const absl::Status waited =
      server->process().WaitForLineCount("tailserve stats:", stats_before + 4, 60s);
  const pb::ServerStats s = server->Stats();
  const auto health = server->Health();
  stop.store(true);
  for (std::thread& t : clients) t.join();
  ASSERT_TRUE(waited.ok()) << waited;
  EXPECT_EQ(health, health::HealthCheckResponse::SERVING);
  EXPECT_EQ(server->process().CountLines("NOT_SERVING"), 0) << server->process().Output();
  EXPECT_EQ(s.steps(), 0u) << "a decode step ran: this no longer tests prefill-only progress";
  size_t total = 0;
  for (const auto& per_client : done) {
    for (const Done& d : per_client) {
      ASSERT_TRUE(d.result.status.ok()) << d.result.status.error_message();
      EXPECT_THAT(d.result.tokens, ElementsAreArray(Prefix(ref.greedy[d.prompt], 1)));
      EXPECT_EQ(d.result.finish, pb::FINISH_REASON_LENGTH);
      ++total;
    }
  }
  EXPECT_GE(total, 4u);
}

// One prefill held at the gate with another request queued behind it: nothing completes, so the
// server is NOT_SERVING; a prefill that long cannot be told from a hung device (docs/serving.md).
TEST(ServerWatchdogTest, AHeldPrefillWithRequestsQueuedGoesNotServing) {
  const Reference ref = LoadReference();
  Gate gate;
  std::unique_ptr<Server> server =
      Server::Launch({"--watchdog_s=1", "--max_batch=1", "--debug_gate_prefill", gate.flag()});
  ASSERT_NE(server, nullptr);
  StreamResult a, b;
  std::thread ta([&] { a = Generate(server->stub(), Greedy(ref.prompts[0], 4)); });
  server->WaitStats([](const pb::ServerStats& s) { return s.running() == 1; }, "a admitted");
  std::thread tb([&] { b = Generate(server->stub(), Greedy(ref.prompts[2], 4)); });
  const pb::ServerStats held = server->WaitStats(
      [](const pb::ServerStats& s) { return s.running() == 1 && s.queued() == 1; }, "b queued");
  const absl::StatusOr<std::string> line =
      server->process().WaitForLine("NOT_SERVING", kSettleTimeout);
  const auto during = server->Health();
  gate.Open();
  ta.join();
  tb.join();
  ASSERT_TRUE(line.ok()) << line.status() << "\n" << server->process().Output();
  EXPECT_EQ(during, health::HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(held.tokens_generated(), 0u);
  // A stall is reported, not acted on: both requests finish with the right tokens.
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  EXPECT_THAT(a.tokens, ElementsAreArray(Prefix(ref.greedy[0], 4)));
  EXPECT_THAT(b.tokens, ElementsAreArray(Prefix(ref.greedy[2], 4)));
  ASSERT_TRUE(server->process().WaitForLine("progress resumed; SERVING", kSettleTimeout).ok());
  EXPECT_EQ(server->Health(), health::HealthCheckResponse::SERVING);
}

TEST(ServerWatchdogTest, ZeroTurnsItOff) {
  const Reference ref = LoadReference();
  Gate gate;
  std::unique_ptr<Server> server = Server::Launch(
      {"--watchdog_s=0", "--debug_gate_prefill", gate.flag(), "--stats_interval_s=1"});
  ASSERT_NE(server, nullptr);
  StreamResult a;
  std::thread ta([&] { a = Generate(server->stub(), Greedy(ref.prompts[0], 4)); });
  // Three stats lines a second apart, all while the prefill is held: over 2 s of stall, where a
  // 1 s watchdog goes NOT_SERVING within 1.2 s (the loop checks it before each stats line).
  const absl::Status waited =
      server->process().WaitForLineCount("queued 0 running 1 ", 3, kSettleTimeout * 2);
  const auto during = server->Health();
  gate.Open();
  ta.join();
  ASSERT_TRUE(waited.ok()) << waited << "\n" << server->process().Output();
  EXPECT_EQ(during, health::HealthCheckResponse::SERVING);
  EXPECT_EQ(server->process().CountLines("watchdog"), 0) << server->process().Output();
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  EXPECT_THAT(a.tokens, ElementsAreArray(Prefix(ref.greedy[0], 4)));
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

// Requests still queued when the drain starts were accepted and hold open streams: they are
// admitted and finish like the running ones, and the exit is 0.
TEST(ServerDrainTest, RequestsQueuedWhenTheDrainStartsStillFinish) {
  const Reference ref = LoadReference();
  Gate gate;
  std::unique_ptr<Server> server =
      Server::Launch({"--max_batch=1", "--debug_gate_step=3", gate.flag(), "--drain_timeout_s=60"});
  ASSERT_NE(server, nullptr);
  OpenStream a;
  ASSERT_NO_FATAL_FAILURE(StartLong(*server, ref.prompts[0], &a));
  grpc::ClientContext b_ctx;
  b_ctx.set_deadline(In(kRpcTimeout));
  auto b_reader = server->stub().Generate(&b_ctx, Greedy(ref.prompts[2], 32));
  server->WaitStats([](const pb::ServerStats& s) { return s.queued() == 1; }, "b queued");

  ASSERT_TRUE(server->process().Signal(SIGTERM));
  const absl::StatusOr<std::string> line =
      server->process().WaitForLine("tailserve draining", kSettleTimeout);
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_THAT(*line, HasSubstr("(1 running, 1 queued)"));
  EXPECT_EQ(server->Health(), health::HealthCheckResponse::NOT_SERVING);
  gate.Open();

  ReadAll(a.reader.get(), &a.result);
  StreamResult b;
  ReadAll(b_reader.get(), &b);
  ASSERT_TRUE(a.result.status.ok()) << a.result.status.error_message();
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  EXPECT_THAT(Prefix(a.result.tokens, 32), ElementsAreArray(ref.greedy[0]));
  EXPECT_THAT(b.tokens, ElementsAreArray(ref.greedy[2]));
  EXPECT_EQ(b.finish, pb::FINISH_REASON_LENGTH);
  EXPECT_EQ(server->process().WaitExit(60s), std::optional<int>(0));
}

// The gate never opens, so the running stream (and the one queued behind it) can never finish:
// the drain times out, both are cut with UNAVAILABLE, and the exit code says so.
TEST(ServerDrainTest, DrainTimeoutCutsOpenStreamsWithUnavailableAndExitsThree) {
  const Reference ref = LoadReference();
  Gate gate;
  std::unique_ptr<Server> server =
      Server::Launch({"--max_batch=1", "--debug_gate_step=3", gate.flag(), "--drain_timeout_s=1"});
  ASSERT_NE(server, nullptr);
  OpenStream a;
  ASSERT_NO_FATAL_FAILURE(StartLong(*server, ref.prompts[0], &a));
  grpc::ClientContext b_ctx;
  b_ctx.set_deadline(In(kRpcTimeout));
  auto b_reader = server->stub().Generate(&b_ctx, Greedy(ref.prompts[2], 32));
  server->WaitStats([](const pb::ServerStats& s) { return s.queued() == 1; }, "b queued");

  ASSERT_TRUE(server->process().Signal(SIGTERM));
  ReadAll(a.reader.get(), &a.result);
  StreamResult b;
  ReadAll(b_reader.get(), &b);
  EXPECT_EQ(a.result.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(a.result.status.error_message(), HasSubstr("drain timeout (1 s) expired"));
  // The tokens it got before the cut are the right ones.
  EXPECT_LT(a.result.tokens.size(), 32u);
  EXPECT_THAT(a.result.tokens, ElementsAreArray(Prefix(ref.greedy[0], a.result.tokens.size())));
  EXPECT_EQ(b.status.error_code(), grpc::StatusCode::UNAVAILABLE) << b.status.error_message();
  EXPECT_THAT(b.status.error_message(), HasSubstr("drain timeout"));
  EXPECT_TRUE(b.tokens.empty());
  EXPECT_EQ(server->process().WaitExit(30s), std::optional<int>(3)) << server->process().Output();
  EXPECT_TRUE(server->process()
                  .WaitForLine("drain timed out: cut 2 open streams with UNAVAILABLE", 1s)
                  .ok())
      << server->process().Output();
}

// A second signal during the drain is an operator asking for an immediate stop: open streams are
// cut at once, long before the 120 s drain timeout, and the exit is 128 + the signal.
TEST(ServerDrainTest, SecondSignalCutsAtOnceAndExits128PlusTheSignal) {
  const Reference ref = LoadReference();
  Gate gate;
  std::unique_ptr<Server> server =
      Server::Launch({"--debug_gate_step=3", gate.flag(), "--drain_timeout_s=120"});
  ASSERT_NE(server, nullptr);
  OpenStream a;
  ASSERT_NO_FATAL_FAILURE(StartLong(*server, ref.prompts[0], &a));
  ASSERT_TRUE(server->process().Signal(SIGTERM));
  ASSERT_TRUE(server->process().WaitForLine("tailserve draining", kSettleTimeout).ok());
  ASSERT_TRUE(server->process().Signal(SIGINT));
  ReadAll(a.reader.get(), &a.result);
  EXPECT_EQ(a.result.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(a.result.status.error_message(), HasSubstr("second"));
  EXPECT_THAT(a.result.tokens, ElementsAreArray(Prefix(ref.greedy[0], a.result.tokens.size())));
  EXPECT_EQ(server->process().WaitExit(30s), std::optional<int>(128 + SIGINT))
      << server->process().Output();
  EXPECT_TRUE(server->process().WaitForLine("second signal during drain: cut 1", 1s).ok());
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
  // The INTERNAL left only after NOT_SERVING was set, so from here the server never answers
  // SERVING; it may already be gone, which a health checker reads the same way.
  const auto [health_rpc, serving] = server->HealthOrError();
  if (health_rpc.ok()) {
    EXPECT_EQ(serving, health::HealthCheckResponse::NOT_SERVING);
  } else {
    std::fprintf(stderr, "health after the failure: rpc %d (%s), the server is on its way out\n",
                 static_cast<int>(health_rpc.error_code()), health_rpc.error_message().c_str());
  }
  // Nothing new is served: the engine refuses it, or the listener is already closed.
  const StreamResult late = Generate(server->stub(), Greedy(ref.prompts[1], 4));
  EXPECT_EQ(late.status.error_code(), grpc::StatusCode::UNAVAILABLE) << late.status.error_message();
  EXPECT_EQ(late.messages, 0);
  // Staying up would only answer errors: the process exits non-zero for its supervisor.
  EXPECT_EQ(server->process().WaitExit(30s), std::optional<int>(1));
  EXPECT_TRUE(server->process().WaitForLine("tailserve: backend failed, exiting", 1s).ok())
      << server->process().Output();
}

// The stream is held inside decode step 3 of 200 when the client cancels, so it is surely
// mid-generation; the gate opens only once the server has seen the cancel.
TEST(ServerCancelTest, ClientCancelMidGenerationEndsItAndFreesTheSlotWithinOneStep) {
  const Reference ref = LoadReference();
  Gate gate;
  constexpr uint64_t kGateStep = 3;
  std::unique_ptr<Server> server =
      Server::Launch({"--max_batch=1", absl::StrCat("--debug_gate_step=", kGateStep), gate.flag()});
  ASSERT_NE(server, nullptr);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(kRpcTimeout));
  auto reader = server->stub().Generate(&ctx, Greedy(ref.prompts[0], 200));
  pb::GenerateResponse first;
  ASSERT_TRUE(reader->Read(&first));
  const pb::ServerStats held = server->WaitStats(
      [](const pb::ServerStats& s) { return s.steps() == kGateStep - 1; }, "the held step");
  EXPECT_EQ(held.running(), 1);
  EXPECT_LT(held.kv_blocks_free(), held.kv_blocks_total());

  ctx.TryCancel();
  StreamResult r;
  r.tokens.assign(first.token_ids().begin(), first.token_ids().end());
  ReadAll(reader.get(), &r);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_THAT(r.tokens, ElementsAreArray(Prefix(ref.greedy[0], r.tokens.size())));
  // The call is over on the server side, so the engine has the cancel before the step ends.
  server->WaitStats([](const pb::ServerStats& s) { return s.active_streams() == 0; },
                    "the server to end the call");
  gate.Open();
  const pb::ServerStats after = server->WaitSettled();
  EXPECT_EQ(after.kv_blocks_free(), after.kv_blocks_total());
  EXPECT_EQ(after.requests_finished(), held.requests_finished() + 1);
  // Only the held step's own token is produced; the next step ends the request (docs/serving.md,
  // Rules).
  EXPECT_LE(after.tokens_generated() - held.tokens_generated(), 1u);
  // max_batch 1: the next request can only run in the slot the cancel freed.
  const StreamResult next = Generate(server->stub(), Greedy(ref.prompts[1], 32));
  ASSERT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_THAT(next.tokens, ElementsAreArray(ref.greedy[1]));
}

}  // namespace
}  // namespace ts::testing
