// The CPU pipeline with one stage per rank (engine/pipeline/ring_pipeline.h), each rank a thread
// owning its own TcpTransport on loopback, as separate processes would: the leader's CPU backend
// over RingForward, the workers in RunWorker. Through the Engine, with requests arriving while
// others decode and cancels, every stream equals the single-stage backend's for 2 and 3 ranks
// (untied and tied embeddings, host-driven and with the backend's loop thread), every slot and KV
// block comes back, and the workers return OK once the leader shuts down. A worker that dies
// mid-run fails the leader's requests with an error naming the link, and the ranks after it end
// with errors too: nothing waits forever.
#include "engine/pipeline/ring_pipeline.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <future>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "engine/cpu_backend.h"
#include "engine/engine.h"
#include "engine/pipeline/pipeline_forward.h"
#include "engine/pipeline/tcp_transport.h"
#include "gmock/gmock.h"
#include "tests/common/test_paths.h"
#include "tests/engine/stream_reader.h"
#include "tests/engine/waves.h"

namespace ts::testing {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

constexpr int32_t kSlots = 4;
constexpr int32_t kBlock = 16;
constexpr int32_t kContext = 160;
constexpr int32_t kBlocks = kSlots * ((kContext + kBlock - 1) / kBlock);

CpuBackendOptions Options(const std::string& variant, bool loop) {
  CpuBackendOptions o;
  o.model_dir = FixtureDir() / variant;
  o.max_slots = kSlots;
  o.kv_block_size = kBlock;
  o.num_kv_blocks = kBlocks;
  o.buckets = {1, 2, 4};
  o.num_threads = 1;
  o.loop_thread = loop;
  return o;
}

std::unique_ptr<Engine> MakeEngine(std::unique_ptr<Backend> backend, bool loop) {
  return MakeWaveEngine(std::move(backend), loop, kSlots, kContext);
}

pipeline::RankOptions Rank(const std::string& variant, int32_t rank, int32_t world, int32_t port) {
  return pipeline::RankOptions{.model_dir = FixtureDir() / variant,
                               .rank = rank,
                               .world_size = world,
                               .leader_port = port,
                               .timeout = 20s,
                               .threads = 1,
                               .on_listening = {},
                               .log = {}};
}

// The leader of a ring whose workers are threads; `worker(rank, port)` runs each one.
struct Ring {
  std::unique_ptr<Engine> engine;
  std::vector<std::future<absl::Status>> workers;  // [world - 1], rank 1 first
};

Ring StartRing(const std::string& variant, int32_t world, bool loop,
               const std::function<absl::Status(int32_t rank, int32_t port)>& worker) {
  Ring ring;
  auto port = std::make_shared<std::promise<int32_t>>();
  std::future<int32_t> port_f = port->get_future();
  pipeline::RankOptions lead = Rank(variant, 0, world, 0);
  lead.on_listening = [port](int32_t p) { port->set_value(p); };
  auto leader = std::async(std::launch::async, [lead] {
    // Two micro-batches: a batch of 2-4 rows really splits, so the ranks overlap.
    return pipeline::ConnectLeader(lead, kBlocks, kBlock, 2);
  });
  if (port_f.wait_for(20s) != std::future_status::ready) {
    ADD_FAILURE() << "the leader never listened";
    return ring;
  }
  const int32_t p = port_f.get();
  for (int32_t r = 1; r < world; ++r) {
    ring.workers.push_back(
        std::async(std::launch::async, [&worker, r, p] { return worker(r, p); }));
  }
  auto forward = leader.get();
  EXPECT_TRUE(forward.ok()) << forward.status();
  if (!forward.ok()) return ring;
  auto backend = CpuBackend::Create(*std::move(forward), Options(variant, loop));
  EXPECT_TRUE(backend.ok()) << backend.status();
  if (backend.ok()) ring.engine = MakeEngine(*std::move(backend), loop);
  return ring;
}

std::vector<GenerateRequest> Requests(int32_t vocab) {
  return MixedRequests(vocab, 23, "r", 700);
}

using Result = WaveResult;

std::vector<Result> SingleStage(const std::string& variant, int32_t* vocab) {
  auto b = CreateCpuBackend(Options(variant, false));
  EXPECT_TRUE(b.ok()) << b.status();
  if (!b.ok()) return {};
  auto engine = MakeEngine(std::move(*b), false);
  *vocab = engine->model_info().vocab_size;
  return RunWaves(*engine, Requests(*vocab), {});
}

class RingPipelineTest : public ::testing::TestWithParam<std::tuple<std::string, int32_t, bool>> {};

TEST_P(RingPipelineTest, StreamsEqualTheSingleStageBackend) {
  const auto& [variant, world, loop] = GetParam();
  int32_t vocab = 0;
  const std::vector<Result> want = SingleStage(variant, &vocab);
  ASSERT_FALSE(want.empty());
  Ring ring = StartRing(variant, world, loop, [&](int32_t rank, int32_t port) {
    return pipeline::RunWorker(Rank(variant, rank, world, port));
  });
  ASSERT_NE(ring.engine, nullptr);
  const std::vector<int> cancel = {5, 8};
  const std::vector<GenerateRequest> reqs = Requests(vocab);
  const std::vector<Result> got = RunWaves(*ring.engine, reqs, cancel);
  WaitIdle(*ring.engine);
  EXPECT_EQ(ring.engine->stats().kv_blocks_free, ring.engine->stats().kv_blocks_total);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(reqs[i].request_id);
    EXPECT_TRUE(got[i].status.ok()) << got[i].status;
    EXPECT_EQ(want[i].tokens.size(), static_cast<size_t>(reqs[i].stop.max_new_tokens));
    const bool cancelled = std::count(cancel.begin(), cancel.end(), static_cast<int>(i)) > 0;
    if (cancelled && got[i].reason == FinishReason::kCancelled) {
      ASSERT_LE(got[i].tokens.size(), want[i].tokens.size());
      EXPECT_TRUE(std::equal(got[i].tokens.begin(), got[i].tokens.end(), want[i].tokens.begin()));
      continue;
    }
    EXPECT_EQ(got[i].tokens, want[i].tokens);
    EXPECT_EQ(got[i].reason, want[i].reason);
  }
  // The leader's backend shuts the ring down as it goes; every worker then ends cleanly.
  ring.engine.reset();
  for (auto& w : ring.workers) {
    ASSERT_EQ(w.wait_for(20s), std::future_status::ready);
    EXPECT_TRUE(w.get().ok());
  }
}

INSTANTIATE_TEST_SUITE_P(RanksAndModes, RingPipelineTest,
                         ::testing::Values(std::make_tuple("tiny-gqa-untied", 2, false),
                                           std::make_tuple("tiny-gqa-untied", 3, false),
                                           std::make_tuple("tiny-gqa-untied", 3, true),
                                           std::make_tuple("tiny-mha-tied", 2, true)),
                         FixtureStagesModeName);

// A rank's transport that dies (its sockets close, as when the process is killed) on its
// `die_at`-th send.
class DyingTransport final : public pipeline::StageTransport {
 public:
  DyingTransport(std::unique_ptr<pipeline::TcpTransport> inner, int die_at)
      : rank_(inner->rank()),
        world_(inner->world_size()),
        inner_(std::move(inner)),
        left_(die_at) {}
  int32_t rank() const override { return rank_; }
  int32_t world_size() const override { return world_; }
  absl::Status Send(const pipeline::StageMessage& m) override {
    if (inner_ != nullptr && --left_ <= 0) inner_.reset();
    return inner_ == nullptr ? absl::UnavailableError("killed") : inner_->Send(m);
  }
  absl::Status Recv(pipeline::StageMessage* m,
                    std::optional<std::chrono::milliseconds> timeout) override {
    return inner_ == nullptr ? absl::UnavailableError("killed") : inner_->Recv(m, timeout);
  }
  absl::Status health() const override {
    return inner_ == nullptr ? absl::UnavailableError("killed") : inner_->health();
  }

 private:
  const int32_t rank_, world_;
  std::unique_ptr<pipeline::TcpTransport> inner_;
  int left_;
};

// What RunWorker does, with the transport wrapped so it dies.
absl::Status DyingWorker(const std::string& variant, int32_t rank, int32_t world, int32_t port,
                         int die_at) {
  const pipeline::RankOptions o = Rank(variant, rank, world, port);
  auto config = LoadModelConfig(o.model_dir);
  if (!config.ok()) return config.status();
  auto plan = pipeline::PlanStages(*config,
                                   {.num_stages = world, .bytes_per_weight = 4, .bytes_per_kv = 4});
  if (!plan.ok()) return plan.status();
  auto model = pipeline::LoadStageModel(o.model_dir, (*plan)[rank], 1);
  if (!model.ok()) return model.status();
  auto t = pipeline::TcpTransport::Connect({.rank = rank,
                                            .world_size = world,
                                            .leader_port = port,
                                            .timeout = o.timeout,
                                            .check = pipeline::PlanCheck(*config, *plan),
                                            .payload = "",
                                            .on_listening = {}});
  if (!t.ok()) return t.status();
  DyingTransport dying(*std::move(t), die_at);
  pipeline::CpuStageRunner runner(*std::move(model), kBlocks, kBlock);
  return pipeline::ServeStage(dying, runner);
}

TEST(RingPipelineFailureTest, AWorkerThatDiesFailsTheLeadersRequests) {
  for (int32_t world : {2, 3}) {
    SCOPED_TRACE(world);
    const std::string variant = "tiny-gqa-untied";
    // Rank 1 dies on its 10th send: mid-run, with requests decoding.
    Ring ring = StartRing(variant, world, false, [&](int32_t rank, int32_t port) {
      if (rank == 1) return DyingWorker(variant, rank, world, port, 10);
      return pipeline::RunWorker(Rank(variant, rank, world, port));
    });
    ASSERT_NE(ring.engine, nullptr);
    // One wave: once the ring is broken the engine takes no new request.
    std::vector<GenerateRequest> reqs = Requests(ring.engine->model_info().vocab_size);
    reqs.resize(kSlots);
    const std::vector<Result> got = RunWaves(*ring.engine, reqs, {});
    int failed = 0;
    for (const Result& r : got) {
      if (r.status.ok()) continue;
      ++failed;
      EXPECT_EQ(r.reason, FinishReason::kError);
      // The leader's link to rank 1 (2 ranks), or from rank 2, which lost rank 1 (3 ranks).
      EXPECT_THAT(std::string(r.status.message()), HasSubstr("pipeline rank 0: rank ")) << r.status;
    }
    EXPECT_GT(failed, 0);
    EXPECT_FALSE(ring.engine->health().ok());
    ring.engine.reset();
    for (size_t k = 0; k < ring.workers.size(); ++k) {
      ASSERT_EQ(ring.workers[k].wait_for(20s), std::future_status::ready);
      const absl::Status s = ring.workers[k].get();
      EXPECT_FALSE(s.ok()) << "rank " << k + 1;
      if (k == 1) {
        EXPECT_THAT(std::string(s.message()), HasSubstr("rank 1")) << s;
      }
    }
  }
}

TEST(RingPipelineFailureTest, ALeaderWithoutItsWorkersFailsInTime) {
  pipeline::RankOptions lead = Rank("tiny-gqa-untied", 0, 2, 0);
  lead.timeout = 1s;
  const auto start = std::chrono::steady_clock::now();
  auto forward = pipeline::ConnectLeader(lead, kBlocks, kBlock, 1);
  ASSERT_FALSE(forward.ok());
  EXPECT_EQ(forward.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(forward.status().message()), HasSubstr("rank 1 never connected"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
}

}  // namespace
}  // namespace ts::testing
