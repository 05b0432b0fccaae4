// How a sampling launch behaves, apart from which token it draws (sampling_test.cc): it counts the
// drawn token when asked, flags a bad slot without failing, finishes when two launches at once
// hold more CTAs than the GPU, runs inside a graph, and refuses bad parameters by name.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "tests/common/sanitizer.h"
#include "tests/kernels/sampling_test_util.h"

namespace ts::kernels {
namespace {

using namespace sampling_test;

TEST(SamplingTest, UpdateCountsIncrementsTheDrawnToken) {
  constexpr int kVocab = 5000;
  const auto rows = MixedRows(kVocab);
  RunOptions o;
  o.slots = {3, 0, 6, 1, 7, 2, 4, 5};
  o.num_slots = 8;
  const auto before = RunGpu(rows, kVocab, o);  // counts unchanged: update_counts off
  o.update_counts = true;
  const auto after = RunGpu(rows, kVocab, o);
  EXPECT_EQ(after.tokens, before.tokens);
  for (int r = 0; r < 8; ++r) {
    for (int t = 0; t < kVocab; ++t) {
      const size_t i = size_t(o.slots[r]) * kVocab + t;
      ASSERT_EQ(after.counts[i], before.counts[i] + (t == after.tokens[r] ? 1 : 0))
          << "row " << r << " token " << t;
    }
  }
}

TEST(SamplingTest, BadSlotIsFlaggedNotFatal) {
  constexpr int kVocab = 300;
  auto rows = MixedRows(kVocab);
  rows.resize(2);
  RunOptions o;
  o.slots = {1, 9};  // 9 is outside the pool
  o.num_slots = 2;
  const auto res = RunGpu(rows, kVocab, o);
  EXPECT_EQ(res.flag, 1);
  EXPECT_EQ(res.tokens[0], CpuToken(rows[0]));
}

// The first n rows' logits and parameters without penalties: SamplingBuffers hold no history.
struct Inputs {
  std::vector<float> logits;
  std::vector<SamplingRow> params;
};
Inputs WithoutPenalties(const std::vector<RowCase>& rows, int n) {
  Inputs in;
  for (int r = 0; r < n; ++r) {
    in.logits.insert(in.logits.end(), rows[r].logits.begin(), rows[r].logits.end());
    ts::SamplingParams sp = rows[r].params;
    sp.repetition_penalty = 1.0f, sp.presence_penalty = 0.0f, sp.frequency_penalty = 0.0f;
    in.params.push_back(ToSamplingRow(sp, rows[r].position));
  }
  return in;
}

// A row's CTAs wait for each other between passes. Two launches at once (as the engine's decode
// and prefill heads run) with more CTAs than the GPU holds, half its SMs' worth of split each:
// both must finish (a hang fails by the test's timeout), with the tokens of one launch alone.
TEST(SamplingTest, ConcurrentLaunchesWithMoreCtasThanTheGpuHoldsFinish) {
  constexpr int kVocab = 128256, kRows = 8;
  int num_sms = 0;
  TS_ASSERT_CUDA_OK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
  const int split = std::max(1, std::min(kSamplingMaxSplit, num_sms / 2));
  const auto rows = MixedRows(kVocab);
  const Inputs in = WithoutPenalties(rows, kRows);
  // Each launch its own buffers (workspace and tokens above all), as the two heads have.
  SamplingBuffers buf_a(in.logits, in.params, kRows, kVocab);
  SamplingBuffers buf_b(in.logits, in.params, kRows, kVocab);
  cudaStream_t sa, sb;
  TS_ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking));
  TS_ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking));
  // Twenty pairs for the odds of the interleaving that would hang; under compute-sanitizer, which
  // checks each launch's accesses and not the odds, two (forty outlast a device call there).
  const int pairs = ts::testing::UnderComputeSanitizer() ? 2 : 20;
  for (int rep = 0; rep < pairs; ++rep) {
    ASSERT_TRUE(LaunchSampling(buf_a.Launch(split), sa).ok());
    ASSERT_TRUE(LaunchSampling(buf_b.Launch(split), sb).ok());
  }
  TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
  cudaStreamDestroy(sa);
  cudaStreamDestroy(sb);
  const auto a = buf_a.tokens.Download(), b = buf_b.tokens.Download();
  EXPECT_EQ(a, b);
  RunOptions alone;
  alone.slots = {0, 1, 2, 3, 4, 5, 6, 7};
  alone.split = split;
  std::vector<RowCase> plain = rows;
  for (RowCase& c : plain) {
    c.prompt.clear(), c.output.clear();
    c.params.repetition_penalty = 1.0f, c.params.presence_penalty = 0.0f;
    c.params.frequency_penalty = 0.0f;
  }
  EXPECT_EQ(RunGpu(plain, kVocab, alone).tokens, a);
}

TEST(SamplingTest, CapturesInGraph) {
  constexpr int kVocab = 4096, kRows = 3;
  const auto rows = MixedRows(kVocab);
  const Inputs in = WithoutPenalties(rows, kRows);
  SamplingBuffers buf(in.logits, in.params, kRows, kVocab);
  const SamplingKernelParams p = buf.Launch(4);
  cudaStream_t stream;
  TS_ASSERT_CUDA_OK(cudaStreamCreate(&stream));
  EXPECT_TRUE(testing::RunInGraph(stream, [&](cudaStream_t s) { return LaunchSampling(p, s); }));
  cudaStreamDestroy(stream);
  const auto tokens = buf.tokens.Download();
  for (int r = 0; r < kRows; ++r) {
    RowCase c = rows[r];
    c.prompt.clear();
    c.output.clear();
    ExpectSameDraw(c, tokens[r], "row " + std::to_string(r));
  }
}

TEST(SamplingTest, RejectsBadParams) {
  GuardedBuffer<float> logits(64);
  GuardedBuffer<SamplingRow> params(1);
  GuardedBuffer<int32_t> slots(1), tokens(1);
  GuardedBuffer<uint32_t> counts(64);
  GuardedBuffer<uint32_t> mask(2);
  SamplingKernelParams good;
  good.logits = logits.get();
  good.params = params.get();
  good.row_slots = slots.get();
  good.output_counts = counts.get();
  good.prompt_mask = mask.get();
  good.tokens = tokens.get();
  good.rows = 1;
  good.vocab = 64;
  good.num_slots = 1;
  GuardedBuffer<uint8_t> ws(SamplingWorkspaceBytes(2, 64));
  good.workspace = ws.get();
  good.workspace_bytes = SamplingWorkspaceBytes(1, 64);
  SamplingKernelParams p = good;
  p.vocab = 0;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.vocab");
  p = good;
  p.vocab = kSamplingMaxVocab + 1;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.vocab");
  p = good;
  p.num_slots = 0;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.num_slots");
  p = good;
  p.logits = nullptr;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.logits");
  p = good;
  p.tokens = nullptr;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.tokens");
  p = good;
  p.prompt_mask = nullptr;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.prompt_mask");
  p = good;
  p.rows = -2;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.rows");
  p = good;
  p.split = kSamplingMaxSplit + 1;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.split");
  p = good;
  p.workspace = nullptr;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.workspace");
  p = good;
  p.workspace = ws.get() + 16;
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.workspace");
  p = good;
  p.rows = 2;  // the workspace holds one row's state
  TS_EXPECT_INVALID(LaunchSampling(p, nullptr), "sampling.workspace_bytes");
  TS_ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(tokens.GuardsIntact());
}

}  // namespace
}  // namespace ts::kernels
