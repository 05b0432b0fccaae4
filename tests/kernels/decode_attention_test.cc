// Paged decode attention (static split and work queue) + combine against the CPU reference of
// tests/kernels/decode_attention_harness.h (its comment derives the per-element bound) over a grid
// of head shapes and contexts, in every launch mode, plus graph replays, exec updates, PDL and bad
// block tables. The fused RoPE is tested in decode_attention_rope_test.cc.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/decode_attention.cuh"
#include "kernels/rope_kv.cuh"
#include "models/rope.h"
#include "tests/kernels/attention_test_util.h"
#include "tests/kernels/decode_attention_harness.h"

namespace ts::kernels::testing {
namespace {

struct GridParam {
  Heads heads;
  int head_dim;
};

class DecodeAttentionGridTest : public ::testing::TestWithParam<GridParam> {};

TEST_P(DecodeAttentionGridTest, MatchesReferenceInEveryMode) {
  const GridParam gp = GetParam();
  uint32_t seed = 11 * gp.head_dim + gp.heads.q;
  for (int num_seqs : {1, 3, 8, 33}) {
    SCOPED_TRACE(absl::StrCat("num_seqs=", num_seqs));
    ++seed;
    const DecodeHarness h(gp.heads, gp.head_dim, Contexts(num_seqs, seed), seed);
    for (const ModeConfig& m : AllModes(h)) h.RunAndCheck(m);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodeAttentionGridTest,
    ::testing::Values(GridParam{{4, 4}, 16}, GridParam{{8, 2}, 16}, GridParam{{32, 8}, 16},
                      GridParam{{4, 4}, 64}, GridParam{{8, 2}, 64}, GridParam{{32, 8}, 64},
                      GridParam{{4, 4}, 128}, GridParam{{8, 2}, 128}, GridParam{{32, 8}, 128},
                      // group sizes 2, 8 and 16 (16 = two head chunks per kv head)
                      GridParam{{4, 2}, 128}, GridParam{{16, 2}, 64}, GridParam{{32, 2}, 128}),
    [](const ::testing::TestParamInfo<GridParam>& info) {
      return absl::StrCat("Hq", info.param.heads.q, "_Hkv", info.param.heads.kv, "_D",
                          info.param.head_dim);
    });

// The kernel walks each split in 16-key chunks and looks up every key's block: blocks of 1-8
// split a chunk over several blocks, 32-256 hold several chunks (and a long poisoned tail). One
// test per block size, so that a compute-sanitizer run can take them one at a time
// (tests/gpu/run-bundle.sh, SANITIZE_SHARD).
class DecodeAttentionBlockSizeTest : public ::testing::TestWithParam<int> {};

TEST_P(DecodeAttentionBlockSizeTest, MatchesReferenceAroundTheKeyChunk) {
  const int block_size = GetParam();
  for (int head_dim : {16, 64, 128}) {
    SCOPED_TRACE(absl::StrCat("head_dim=", head_dim));
    const uint32_t seed = 300 + block_size + head_dim;
    const DecodeHarness h({32, 8}, head_dim, Contexts(9, seed), seed, block_size);
    for (const ModeConfig& m : AllModes(h)) h.RunAndCheck(m);
  }
}

INSTANTIATE_TEST_SUITE_P(BlockSizes, DecodeAttentionBlockSizeTest,
                         ::testing::Values(1, 2, 4, 8, 32, 64, 256),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat("Block", info.param);
                         });

TEST(DecodeAttentionTest, EachEdgeLengthAlone) {
  for (int n : {1, 15, 16, 17, 255, 1000, 4000}) {
    SCOPED_TRACE(absl::StrCat("context=", n));
    const DecodeHarness h({32, 8}, 128, {n}, 1000 + n);
    for (const ModeConfig& m : AllModes(h)) h.RunAndCheck(m);
  }
}

// Long contexts at the Llama-3 8B head shape, one sequence each: every mode of AllModes, so the
// production split count (ChooseNumSplits: 32-49 splits on an H200), one split over the whole
// context, several splits through the combine kernel and the work queue. One context and mode a
// test: racecheck takes minutes over one 32k context in one mode (tests/gpu/run-bundle.sh,
// SANITIZE_SHARD runs each test as its own job).
class DecodeAttentionLongTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(DecodeAttentionLongTest, MatchesReferenceInEachMode) {
  const auto [n, mode] = GetParam();
  const DecodeHarness h({32, 8}, 128, {n}, 2000 + n);
  const std::vector<ModeConfig> modes = AllModes(h);
  ASSERT_EQ(modes.size(), size_t{kAllModesCount}) << "instantiate every mode of AllModes";
  h.RunAndCheck(modes[mode], /*report=*/true);
}

INSTANTIATE_TEST_SUITE_P(Contexts, DecodeAttentionLongTest,
                         ::testing::Combine(::testing::Values(4096, 16384, 32768),
                                            ::testing::Range(0, kAllModesCount)),
                         [](const ::testing::TestParamInfo<std::tuple<int, int>>& info) {
                           return absl::StrCat("Context", std::get<0>(info.param), "_Mode",
                                               std::get<1>(info.param));
                         });

// A ragged batch of long and short contexts off the block boundaries, with a padding row.
TEST(DecodeAttentionTest, RaggedLongBatch) {
  for (int head_dim : {64, 128}) {
    SCOPED_TRACE(absl::StrCat("head_dim=", head_dim));
    const DecodeHarness h({8, 2}, head_dim, {4095, 32768, 17, 0, 16385, 1}, 77 + head_dim);
    for (const ModeConfig& m : AllModes(h)) h.RunAndCheck(m, /*report=*/true);
  }
}

// Captures the work-queue launch once and replays it: each replay must reproduce the first one
// bit for bit, which only works if the last CTA reset the work counter inside the graph. With pdl
// the split and combine kernels are chained by a programmatic edge: the combine launches early
// and must still wait for every partial.
TEST(DecodeAttentionTest, WorkQueueGraphReplaysAreIdentical) {
  const DecodeHarness h({32, 8}, 128, Contexts(33, 5), 5);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (bool pdl : {false, true}) {
    SCOPED_TRACE(absl::StrCat("pdl ", pdl));
    const ModeConfig m{DecodeAttentionMode::kWorkQueue, 1, 128, 2 * NumSms(), 4};
    DecodeAttentionParams params = h.Params(m);
    params.pdl = pdl;
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    const absl::Status st = LaunchDecodeAttention(params, stream);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_TRUE(st.ok()) << st;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    std::vector<float> first;
    for (int replay = 0; replay < 3; ++replay) {
      SCOPED_TRACE(absl::StrCat("replay ", replay));
      h.Poison(stream);
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      const std::vector<float> out = h.Output();
      EXPECT_TRUE(h.Matches(out));
      h.ExpectCountersReset();
      if (replay == 0) {
        first = out;
      } else {
        EXPECT_EQ(std::memcmp(first.data(), out.data(), out.size() * sizeof(float)), 0);
      }
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  h.ExpectGuards();
  cudaStreamDestroy(stream);
}

// With one split the split kernel's own normalisation is what the combine kernel would compute
// (a weight of exactly 1), so skipping the combine must not change a single bit. The poisoned
// workspace also shows that nothing reads partials that were never written.
TEST(DecodeAttentionTest, NoCombineIsBitwiseTheCombinedOutput) {
  for (int head_dim : {16, 64, 128}) {
    SCOPED_TRACE(absl::StrCat("head_dim ", head_dim));
    const DecodeHarness h({32, 8}, head_dim, Contexts(33, 40 + head_dim), 40 + head_dim);
    ModeConfig m{DecodeAttentionMode::kStaticSplit, 1};
    h.RunAndCheck(m);
    const std::vector<float> combined = h.Output();
    m.no_combine = true;
    h.RunAndCheck(m);
    const std::vector<float> direct = h.Output();
    ASSERT_EQ(direct.size(), combined.size());
    EXPECT_EQ(std::memcmp(direct.data(), combined.data(), direct.size() * sizeof(float)), 0);
  }
}

// The graph cache changes num_splits (a grid dimension and a kernel argument) with
// cudaGraphExecUpdate when the context regime changes; the updated exec must compute the same.
TEST(DecodeAttentionTest, ExecUpdateChangesSplitCount) {
  const DecodeHarness h({8, 2}, 64, Contexts(8, 9), 9);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  auto capture = [&](const ModeConfig& m, cudaGraph_t* g) {
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    const absl::Status st = LaunchDecodeAttention(h.Params(m), stream);
    ASSERT_EQ(cudaStreamEndCapture(stream, g), cudaSuccess);
    ASSERT_TRUE(st.ok()) << st;
  };
  for (auto mode : {DecodeAttentionMode::kStaticSplit, DecodeAttentionMode::kWorkQueue}) {
    const ModeConfig before{mode, 2, 64, NumSms(), 1};
    const ModeConfig after{mode, 7, 256, 3 * NumSms(), 2};
    SCOPED_TRACE(after.Name());
    cudaGraph_t g1 = nullptr, g2 = nullptr;
    capture(before, &g1);
    capture(after, &g2);
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, g1, 0), cudaSuccess);
    cudaGraphExecUpdateResultInfo info;
    ASSERT_EQ(cudaGraphExecUpdate(exec, g2, &info), cudaSuccess);
    EXPECT_EQ(info.result, cudaGraphExecUpdateSuccess);
    h.Poison(stream);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_TRUE(h.Matches(h.Output()));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g1);
    cudaGraphDestroy(g2);
  }
  cudaStreamDestroy(stream);
}

// With pdl both kernels may start while the kernel before them still runs. Here that kernel is
// rope_kv at position 0 (an exact copy: cos 1, sin 0), writing q and each sequence's current K/V
// (position context - 1) over NaN poison before every replay, as the decode step's qkv GEMV does:
// a read of either before griddepcontrol.wait leaves a NaN or a wrong row. head_dim 16 puts the
// current token in the same 128-byte line as the one before it.
TEST(DecodeAttentionTest, PdlReadsTheCurrentTokenOnlyAfterTheWait) {
  for (const auto& [heads, d] : {std::pair{Heads{32, 8}, 128}, std::pair{Heads{4, 2}, 16}}) {
    SCOPED_TRACE(absl::StrCat("head_dim ", d));
    const DecodeHarness h(heads, d, {1, 17, 300, 1000, 64}, 11 + d);
    const PagedKv& kv = h.kv();
    const int n = h.num_seqs(), width = (heads.q + 2 * heads.kv) * d;
    std::vector<float> qkv(size_t(n) * width);
    std::vector<int32_t> positions(n, 0), slots(n);
    for (int s = 0; s < n; ++s) {
      const int cur = h.contexts()[s] - 1;
      float* row = qkv.data() + size_t(s) * width;
      std::copy_n(h.q().data() + size_t(s) * heads.q * d, heads.q * d, row);
      for (int kvh = 0; kvh < heads.kv; ++kvh) {
        std::copy_n(kv.KRow(s, kvh, cur), d, row + (heads.q + kvh) * d);
        std::copy_n(kv.VRow(s, kvh, cur), d, row + (heads.q + heads.kv + kvh) * d);
      }
      slots[s] = kv.tables[size_t(s) * kv.max_blocks_per_seq + cur / kBlockSize] * kBlockSize +
                 cur % kBlockSize;
    }
    GuardedBuffer<__nv_bfloat16> dqkv(qkv.size());
    GuardedBuffer<int32_t> dpos(n), dslots(n);
    ModelConfig config;
    config.head_dim = d;
    config.rope_theta = 500000.0f;
    const absl::StatusOr<std::vector<float>> inv = ts::RopeInvFreq(config);
    ASSERT_TRUE(inv.ok()) << inv.status();
    GuardedBuffer<float> dinv(inv->size());
    dqkv.Upload(ToBf16(qkv));
    dpos.Upload(positions);
    dslots.Upload(slots);
    dinv.Upload(*inv);
    RopeKvParams rope;
    rope.qkv = dqkv.get();
    rope.q_out = h.q_device();
    rope.positions = dpos.get();
    rope.slot_mapping = dslots.get();
    rope.inv_freq = dinv.get();
    rope.k_cache = h.k_device();
    rope.v_cache = h.v_device();
    rope.layout = KvLayout{kv.num_blocks, heads.kv, kBlockSize, d};
    rope.rows = n;
    rope.num_q_heads = heads.q;

    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    for (int splits : {1, 3, 16}) {
      SCOPED_TRACE(absl::StrCat("splits ", splits));
      DecodeAttentionParams p = h.Params({DecodeAttentionMode::kStaticSplit, splits});
      p.pdl = true;
      cudaGraph_t graph = nullptr;
      ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
      absl::Status st = LaunchRopeKv(rope, stream);
      if (st.ok()) st = LaunchDecodeAttention(p, stream);
      ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
      ASSERT_TRUE(st.ok()) << st;
      cudaGraphExec_t exec = nullptr;
      ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      for (int replay = 0; replay < 10; ++replay) {
        // The poison goes on the graph's own stream. A plain cudaMemset runs on the legacy
        // default stream, which a cudaStreamNonBlocking stream does not wait for: the last
        // sequence's memsets could land after rope_kv's writes (seen under compute-sanitizer
        // initcheck, which slows memsets down: "row 4 wrong on replay 1").
        ASSERT_EQ(cudaMemsetAsync(h.q_device(), 0xFF, h.q().size() * sizeof(__nv_bfloat16), stream),
                  cudaSuccess);
        for (int s = 0; s < n; ++s) {
          const int cur = h.contexts()[s] - 1;
          for (int kvh = 0; kvh < heads.kv; ++kvh) {
            const size_t off = kv.Offset(s, kvh, cur);
            ASSERT_EQ(cudaMemsetAsync(h.k_device() + off, 0xFF, d * sizeof(__nv_bfloat16), stream),
                      cudaSuccess);
            ASSERT_EQ(cudaMemsetAsync(h.v_device() + off, 0xFF, d * sizeof(__nv_bfloat16), stream),
                      cudaSuccess);
          }
        }
        h.Poison(stream);
        ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        ASSERT_TRUE(h.Matches(h.Output())) << "replay " << replay;
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    }
    h.ExpectGuards();
    cudaStreamDestroy(stream);
  }
}

// Every test here and in decode_attention_rope_test.cc pads the tables with kInvalidKvBlock and
// checks that the flag stays 0: no entry past a context is even looked up. Here an invalid id
// (padding, a negative id, one past the pool) sits inside sequence 0's context, as an engine
// off-by-one would leave it: the kernel must flag it and stay in bounds (no illegal address; the
// launch and the sync succeed), and the other sequences' rows are still right. Sequence 0's own
// output is then meaningless and not checked.
TEST(DecodeAttentionTest, InvalidBlockWithinAContextIsFlagged) {
  const DecodeHarness h({8, 2}, 64, {300, 40, 17}, 21);
  const int d = h.head_dim(), hq = h.heads().q;
  for (const int32_t bad : {kInvalidKvBlock, int32_t{-1}, h.kv().num_blocks}) {
    for (const ModeConfig& m : {ModeConfig{DecodeAttentionMode::kStaticSplit, 1},
                                ModeConfig{DecodeAttentionMode::kStaticSplit, 3},
                                ModeConfig{DecodeAttentionMode::kWorkQueue, 1, 64, 8, 1}}) {
      SCOPED_TRACE(absl::StrCat("id ", bad, ", ", m.Name()));
      h.SetDeviceTableEntry(0, 300 / kBlockSize, bad);  // the block of the current token
      h.ResetFlag();
      h.Poison(nullptr);
      ASSERT_TRUE(LaunchDecodeAttention(h.Params(m), nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(h.Flag(), 1);
      const std::vector<float> out = h.Output();
      const size_t seq0 = static_cast<size_t>(hq) * d;
      const std::vector<float> rest(out.begin() + seq0, out.end());
      const std::vector<double> ref(h.ref().begin() + seq0, h.ref().end());
      const std::vector<double> tol(h.tol().begin() + seq0, h.tol().end());
      EXPECT_TRUE(ElementsWithin(rest, ref, tol, d));
    }
  }
  h.ExpectGuards();
}

TEST(DecodeAttentionTest, RejectsUnsupportedHeadDimWithoutLaunching) {
  const DecodeHarness h({8, 2}, 64, {17, 5}, 3);
  DecodeAttentionParams p = h.Params({DecodeAttentionMode::kStaticSplit, 2});
  p.head_dim = 96;
  p.workspace_bytes = DecodeAttentionWorkspaceBytes(p.num_seqs, p.num_q_heads, 96, kMaxSplits);
  TS_EXPECT_INVALID(LaunchDecodeAttention(p, nullptr), "head_dim");
  p.head_dim = 64;
  p.num_kv_heads = 3;
  TS_EXPECT_INVALID(LaunchDecodeAttention(p, nullptr), "num_q_heads");
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace ts::kernels::testing
