// End to end, the server's life beyond single requests: the watchdog, the drain on SIGTERM and a
// sticky backend failure.
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

}  // namespace
}  // namespace ts::testing
