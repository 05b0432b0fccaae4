// The CUDA pipeline across processes, what needs no GPU (engine/cuda/cuda_ranks.h): the control
// messages cross a loopback ring of two TcpTransports and come back as the same calls, malformed
// ones are refused, every stage has its rank, and the ranks' check string changes with everything
// that sizes a stage. The ranks themselves run in engine_cuda_pipeline_test (GPU).
#include "engine/cuda/cuda_ranks.h"

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
#include <random>
#include <vector>

#include "engine/pipeline/tcp_transport.h"

namespace ts::testing {
namespace {

using pipeline::StageMessage;
using pipeline::TcpTransport;
using TransportOr = absl::StatusOr<std::unique_ptr<TcpTransport>>;

// Ranks 0 and 1 on loopback, as CudaBackend and RunCudaWorker join them.
std::vector<std::unique_ptr<TcpTransport>> Pair() {
  auto port = std::make_shared<std::promise<int32_t>>();
  std::future<int32_t> listening = port->get_future();
  std::future<TransportOr> leader = std::async(std::launch::async, [port] {
    return TcpTransport::Connect({.rank = 0,
                                  .world_size = 2,
                                  .timeout = std::chrono::seconds(10),
                                  .check = "cuda",
                                  .payload = "",
                                  .on_listening = [port](int32_t p) { port->set_value(p); }});
  });
  std::vector<std::unique_ptr<TcpTransport>> out;
  if (listening.wait_for(std::chrono::seconds(10)) != std::future_status::ready) return out;
  const int32_t p = listening.get();
  TransportOr worker = TcpTransport::Connect({.rank = 1,
                                              .world_size = 2,
                                              .leader_port = p,
                                              .timeout = std::chrono::seconds(10),
                                              .check = "cuda",
                                              .payload = "",
                                              .on_listening = {}});
  TransportOr lead = leader.get();
  EXPECT_TRUE(lead.ok()) << lead.status();
  EXPECT_TRUE(worker.ok()) << worker.status();
  if (!lead.ok() || !worker.ok()) return out;
  out.push_back(*std::move(lead));
  out.push_back(*std::move(worker));
  return out;
}

TEST(CudaRanksMessagesTest, StageRanksPutTheLastStageOnRankZero) {
  EXPECT_EQ(StageRanks(2), (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(StageRanks(4), (std::vector<int32_t>{1, 2, 3, 0}));
}

TEST(CudaRanksMessagesTest, PrefillChunksComeBackAsTheSamePieces) {
  const std::vector<std::unique_ptr<TcpTransport>> ring = Pair();
  ASSERT_EQ(ring.size(), 2u);
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 5);
    std::vector<std::vector<int32_t>> prompts(n), tables(n);
    std::vector<PrefillPiece> pieces(n);
    for (int i = 0; i < n; ++i) {
      const int32_t len = 1 + static_cast<int32_t>(rng() % 300);
      for (int32_t t = 0; t < len; ++t) prompts[i].push_back(1 + static_cast<int32_t>(rng() % 999));
      for (int32_t b = 0; b < (len + 15) / 16; ++b)
        tables[i].push_back(static_cast<int32_t>(rng() % 4096));
      const int32_t start = static_cast<int32_t>(rng() % len);
      const int32_t rows = 1 + static_cast<int32_t>(rng() % (len - start));
      pieces[i] = {.tokens = prompts[i],
                   .block_table = tables[i],
                   .start = start,
                   .len = rows,
                   .head_row = start + rows == len ? i : -1};
    }
    StageMessage sent;
    PackPrefillChunk(pieces, &sent);
    // Across the ring and back into pieces, as a worker reads them.
    ASSERT_TRUE(ring[0]->Send(sent).ok());
    StageMessage m;
    ASSERT_TRUE(ring[1]->Recv(&m, std::chrono::seconds(10)).ok());
    ReceivedChunk got;
    ASSERT_TRUE(UnpackPrefillChunk(m, &got).ok());
    ASSERT_EQ(got.pieces.size(), pieces.size());
    int32_t rows = 0;
    for (int i = 0; i < n; ++i) {
      const PrefillPiece& a = pieces[i];
      const PrefillPiece& b = got.pieces[i];
      EXPECT_EQ(b.start, a.start);
      EXPECT_EQ(b.len, a.len);
      EXPECT_EQ(b.head_row, a.head_row);
      EXPECT_EQ(b.tokens.size(), a.tokens.size());
      EXPECT_TRUE(std::equal(a.tokens.begin() + a.start, a.tokens.begin() + a.start + a.len,
                             b.tokens.begin() + b.start));
      EXPECT_TRUE(std::equal(a.block_table.begin(), a.block_table.end(), b.block_table.begin(),
                             b.block_table.end()));
      rows += a.len;
    }
    EXPECT_EQ(got.rows, rows);
  }
}

TEST(CudaRanksMessagesTest, DecodeStepsRegimesAndBytesCrossTheRing) {
  const std::vector<std::unique_ptr<TcpTransport>> ring = Pair();
  ASSERT_EQ(ring.size(), 2u);
  StageMessage data;
  data.op = pipeline::StageOp::kCudaData;
  data.data = {1.5f, -2.0f, 3.25f};
  const graphs::Regime regime{.attention_num_splits = 4, .max_context_len = 1024};
  for (const StageMessage& m : {DecodeMessage(5), RegimeMessage(regime), data}) {
    ASSERT_TRUE(ring[0]->Send(m).ok());
  }
  StageMessage got;
  ASSERT_TRUE(ring[1]->Recv(&got, std::chrono::seconds(10)).ok());
  absl::StatusOr<int32_t> index = UnpackDecode(got, 9);
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(*index, 5);
  ASSERT_TRUE(ring[1]->Recv(&got, std::chrono::seconds(10)).ok());
  absl::StatusOr<graphs::Regime> r = UnpackRegime(got);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, regime);
  ASSERT_TRUE(ring[1]->Recv(&got, std::chrono::seconds(10)).ok());
  EXPECT_EQ(got.op, pipeline::StageOp::kCudaData);
  EXPECT_EQ(got.data, data.data);
}

TEST(CudaRanksMessagesTest, MalformedMessagesAreRefused) {
  const std::vector<int32_t> prompt = {4, 5, 6, 7, 8};
  const std::vector<int32_t> table = {3};
  const PrefillPiece piece{
      .tokens = prompt, .block_table = table, .start = 1, .len = 4, .head_row = 0};
  StageMessage good;
  PackPrefillChunk({&piece, 1}, &good);
  ReceivedChunk out;
  ASSERT_TRUE(UnpackPrefillChunk(good, &out).ok());
  StageMessage m = good;
  m.tokens.pop_back();  // a row short
  EXPECT_EQ(UnpackPrefillChunk(m, &out).code(), absl::StatusCode::kInvalidArgument);
  m = good;
  m.tokens.push_back(9);  // a token too many
  EXPECT_EQ(UnpackPrefillChunk(m, &out).code(), absl::StatusCode::kInvalidArgument);
  m = good;
  m.tokens[0] = 3;  // the rows run past the prompt
  EXPECT_EQ(UnpackPrefillChunk(m, &out).code(), absl::StatusCode::kInvalidArgument);
  m = good;
  m.block_counts[0] = 2;  // more table entries than sent
  EXPECT_EQ(UnpackPrefillChunk(m, &out).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(UnpackPrefillChunk(DecodeMessage(0), &out).code(), absl::StatusCode::kInvalidArgument);

  absl::StatusOr<int32_t> index = UnpackDecode(DecodeMessage(3), 4);
  ASSERT_TRUE(index.ok());
  EXPECT_EQ(*index, 3);
  EXPECT_FALSE(UnpackDecode(DecodeMessage(4), 4).ok());
  EXPECT_FALSE(UnpackDecode(good, 4).ok());
  const graphs::Regime r{.attention_num_splits = 6, .max_context_len = 512};
  absl::StatusOr<graphs::Regime> back = UnpackRegime(RegimeMessage(r));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, r);
  EXPECT_FALSE(UnpackRegime(RegimeMessage({.attention_num_splits = 0, .max_context_len = 8})).ok());
  EXPECT_FALSE(UnpackRegime(DecodeMessage(1)).ok());
}

TEST(CudaRanksMessagesTest, TheCheckNamesWhatSizesAStage) {
  ModelConfig c;
  c.num_layers = 4;
  c.hidden_size = 64;
  c.vocab_size = 100;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  std::vector<CudaStageOptions> plan = {
      {.stage = {.first_layer = 0, .num_layers = 2, .has_embedding = true, .has_head = false}},
      {.stage = {.first_layer = 2, .num_layers = 2, .has_embedding = false, .has_head = true}}};
  CudaBackendOptions o;
  const std::string base = CudaRankCheck(c, plan, o);
  EXPECT_NE(base.find("stages 0-1 2-3"), std::string::npos) << base;
  auto differs = [&](const CudaBackendOptions& other) {
    return CudaRankCheck(c, plan, other) != base;
  };
  CudaBackendOptions x = o;
  x.max_slots = 32;
  EXPECT_TRUE(differs(x));
  x = o;
  x.buckets = {1, 2, 64};
  EXPECT_TRUE(differs(x));
  x = o;
  x.kv_block_size = 32;
  EXPECT_TRUE(differs(x));
  x = o;
  x.max_context = 4096;
  EXPECT_TRUE(differs(x));
  x = o;
  x.prefill_chunk_tokens = 512;
  EXPECT_TRUE(differs(x));
  x = o;
  x.device = 3;  // each rank's own
  x.gpu_memory_fraction = 0.5;
  EXPECT_FALSE(differs(x));
  plan[0].stage.num_layers = 1;
  plan[1].stage.first_layer = 1;
  plan[1].stage.num_layers = 3;
  EXPECT_NE(CudaRankCheck(c, plan, o), base);
}

}  // namespace
}  // namespace ts::testing
