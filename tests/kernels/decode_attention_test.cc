// Paged decode attention (static split and work queue) + combine against a CPU reference computed
// in double from the same bf16 inputs, elementwise, with a bound derived from the kernel's
// rounding. The cache past every context (the tail of each last block, spare blocks) is NaN and
// unused table entries are an invalid block id, so any read outside a context shows.
//
// The bound, per output element o = sum_t w_t v_t (w = softmax weights, n = context):
//  1. Scores: q is on a 1/16 grid (|q| <= 4) and K on a 1/64 grid (|k| <= 1), so every partial sum
//     of q.k (D <= 128) is a multiple of 2^-10 below 2^9, 19 bits: exact in fp32 in any order, on
//     the tensor cores too.
//     Left are the scale multiply and exp2f (a few fp32 ulps per weight), folded into term 3.
//  2. P to bf16: the kernel rounds each unnormalised weight p_t to bf16 before the PV mma but sums
//     the denominator from the fp32 p_t, so o_kernel = sum_t w_t (1 + e_t) v_t with |e_t| <= 2^-8
//     (bf16 keeps 8 significant bits). The error sum_t w_t e_t v_t is at most 2^-8 A, A = sum_t
//     w_t |v_t|; its terms are independent roundings in [-b_t, b_t], b_t = 2^-8 w_t |v_t|, so by
//     Hoeffding it exceeds 6 sqrt(sum_t b_t^2) = 6 * 2^-8 R (R = sqrt(sum_t (w_t v_t)^2)) with
//     probability <= 2 e^-18 = 3e-8 per element. A rounding error is near uniform on its range,
//     so that is ~10 true standard deviations. Term: 2^-8 min(A, 6 R).
//  3. fp32 accumulation: per warp one mma (16 keys, up to ~4 internal roundings or truncations)
//     and one rescale per 64 tokens of its split, then the warp merge, the split combine and the
//     log2/exp2 of the LSEs: at most (4 ceil(n / 64) + 64) fp32 ulps of A, counted as if every
//     error had the same sign (tensor-core truncation is biased). The split is taken as the
//     whole context, the worst case. Term: (4 ceil(n / 64) + 64) 2^-23 A.
//  4. The output rounding to bf16: 2^-8 of |o_kernel| <= 2^-8 (|o| + terms 2 and 3).
// tol = 2^-8 |o| + (1 + 2^-8) (term 2 + term 3). Rows of empty sequences (context 0) must be
// exactly zero. At a 4k context tol ~ 5e-4 + 2^-8 |o|, against 2e-2 of the row maximum before.
// A host emulation of the kernel's arithmetic (4 warps of 16-key chunks, per-warp running max, P
// rounded to bf16, fp32 sums, the combine) on these inputs stays below 0.6 of the bound at 1 to
// 32k tokens; the output rounding is most of that. A wrong head, block or split moves elements by
// O(|o|); one key dropped or doubled inside the context by ~w |v - o|, which this bound catches up
// to contexts of ~1-2k. Reads outside a context are caught at any length by the NaN poison.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/decode_attention.cuh"
#include "kernels/prepare_decode.cuh"
#include "kernels/rope_kv.cuh"
#include "models/rope.h"
#include "tests/kernels/attention_test_util.h"

namespace ts::kernels::testing {
namespace {

constexpr int kBlockSize = 16;
constexpr int kMaxSplits = 64;

struct Heads {
  int q;
  int kv;
};

struct ModeConfig {
  DecodeAttentionMode mode;
  int num_splits = 1;       // static
  int chunk_tokens = 0;     // queue
  int ctas = 0;             // queue
  int claim = 1;            // queue
  bool no_combine = false;  // static, one split
  std::string Name() const {
    return mode == DecodeAttentionMode::kStaticSplit
               ? absl::StrCat("static splits=", num_splits, no_combine ? " no combine" : "")
               : absl::StrCat("queue chunk=", chunk_tokens, " ctas=", ctas, " claim=", claim);
  }
};

int NumSms() {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return std::max(sms, 1);
}

struct DecodeRef {
  std::vector<double> out;  // [num_seqs, num_q_heads, head_dim]
  std::vector<double> tol;  // the bound of the file comment, per element
};

// out[s, h, :] = softmax_t(scale * q[s, h] . k[s, t]) v[s, t], in double, with its bound.
DecodeRef Reference(const std::vector<float>& q, const PagedKv& kv, const std::vector<int32_t>& ctx,
                    int num_q_heads, float scale) {
  const int d = kv.head_dim;
  const int group = num_q_heads / kv.num_kv_heads;
  DecodeRef r{std::vector<double>(q.size(), 0.0), std::vector<double>(q.size(), 0.0)};
  std::vector<double> abs_sum(d), sq_sum(d);
  for (size_t s = 0; s < ctx.size(); ++s) {
    const int n = ctx[s];
    if (n == 0) continue;
    const double accum_ulps = 4.0 * ((n + 63) / 64) + 64;
    for (int kvh = 0; kvh < kv.num_kv_heads; ++kvh) {
      for (int g = 0; g < group; ++g) {
        const size_t row = (s * num_q_heads + kvh * group + g) * d;
        const float* qr = q.data() + row;
        std::vector<double> w(n);
        double mx = -INFINITY, sum = 0;
        for (int t = 0; t < n; ++t) {
          const float* k = kv.KRow(s, kvh, t);
          double dot = 0;
          for (int i = 0; i < d; ++i) dot += static_cast<double>(qr[i]) * k[i];
          w[t] = dot * scale;
          mx = std::max(mx, w[t]);
        }
        for (int t = 0; t < n; ++t) sum += (w[t] = std::exp(w[t] - mx));
        std::fill(abs_sum.begin(), abs_sum.end(), 0.0);
        std::fill(sq_sum.begin(), sq_sum.end(), 0.0);
        double* o = r.out.data() + row;
        for (int t = 0; t < n; ++t) {
          const float* v = kv.VRow(s, kvh, t);
          const double wt = w[t] / sum;
          for (int i = 0; i < d; ++i) {
            const double x = wt * v[i];
            o[i] += x;
            abs_sum[i] += std::fabs(x);
            sq_sum[i] += x * x;
          }
        }
        for (int i = 0; i < d; ++i) {
          const double p_round = std::ldexp(std::min(abs_sum[i], 6 * std::sqrt(sq_sum[i])), -8);
          const double accum = std::ldexp(accum_ulps * abs_sum[i], -23);
          r.tol[row + i] =
              std::ldexp(std::fabs(o[i]), -8) + (1 + std::ldexp(1.0, -8)) * (p_round + accum);
        }
      }
    }
  }
  return r;
}

// Edge lengths first (1, 15, 16, 17 around a block boundary, then long), then a ragged random mix;
// batches above 8 also carry one padding row (context 0).
std::vector<int32_t> Contexts(int num_seqs, uint32_t seed) {
  static const int kEdge[] = {1, 15, 16, 17, 255, 1000, 4000};
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> dist(1, 4000);
  std::vector<int32_t> ctx(num_seqs);
  for (int i = 0; i < num_seqs; ++i) ctx[i] = i < 7 ? kEdge[(i + seed) % 7] : dist(gen);
  if (num_seqs > 8) ctx[num_seqs / 2] = 0;
  return ctx;
}

class DecodeHarness {
 public:
  DecodeHarness(Heads heads, int head_dim, std::vector<int32_t> ctx, uint32_t seed,
                int block_size = kBlockSize)
      : heads_(heads), head_dim_(head_dim), block_size_(block_size), ctx_(std::move(ctx)) {
    num_seqs_ = static_cast<int>(ctx_.size());
    kv_ = MakePagedKv(ctx_, heads.kv, block_size, head_dim, seed);
    QuantizeTo(kv_.k, 1.f / 64);  // exact fp32 dot products (file comment)
    PoisonPastContexts(kv_, ctx_);
    // |q| up to 4 makes the softmax peaked enough that a wrong max shift would show.
    q_ = HashedValues(static_cast<size_t>(num_seqs_) * heads.q * head_dim, seed + 7, 4.f);
    QuantizeTo(q_, 1.f / 16);
    scale_ = 1.f / std::sqrt(static_cast<float>(head_dim));
    ref_ = Reference(q_, kv_, ctx_, heads.q, scale_);

    dq_ = std::make_unique<GuardedBuffer<__nv_bfloat16>>(q_.size());
    dk_ = std::make_unique<GuardedBuffer<__nv_bfloat16>>(kv_.k.size());
    dv_ = std::make_unique<GuardedBuffer<__nv_bfloat16>>(kv_.v.size());
    dtables_ = std::make_unique<GuardedBuffer<int32_t>>(kv_.tables.size());
    dctx_ = std::make_unique<GuardedBuffer<int32_t>>(ctx_.size());
    dout_ = std::make_unique<GuardedBuffer<__nv_bfloat16>>(q_.size());
    dflag_ = std::make_unique<GuardedBuffer<int32_t>>(1);
    ws_bytes_ = DecodeAttentionWorkspaceBytes(num_seqs_, heads.q, head_dim, kMaxSplits);
    dws_ = std::make_unique<GuardedBuffer<uint8_t>>(ws_bytes_);
    dq_->Upload(ToBf16(q_));
    dk_->Upload(ToBf16(kv_.k));
    dv_->Upload(ToBf16(kv_.v));
    dtables_->Upload(kv_.tables);
    dctx_->Upload(ctx_);
    dflag_->Upload({0});
    EXPECT_TRUE(ResetDecodeAttentionWorkspace(dws_->get(), ws_bytes_, nullptr).ok());
  }

  DecodeAttentionParams Params(const ModeConfig& m) const {
    DecodeAttentionParams p;
    p.q = dq_->get();
    p.k_cache = dk_->get();
    p.v_cache = dv_->get();
    p.block_tables = dtables_->get();
    p.context_lens = dctx_->get();
    p.out = dout_->get();
    p.workspace = dws_->get();
    p.workspace_bytes = ws_bytes_;
    p.error_flag = dflag_->get();
    p.num_seqs = num_seqs_;
    p.num_q_heads = heads_.q;
    p.num_kv_heads = heads_.kv;
    p.head_dim = head_dim_;
    p.block_size = block_size_;
    p.num_blocks = kv_.num_blocks;
    p.max_blocks_per_seq = kv_.max_blocks_per_seq;
    p.scale = scale_;
    p.mode = m.mode;
    p.max_splits = kMaxSplits;
    p.num_splits = m.num_splits;
    p.chunk_tokens = m.chunk_tokens;
    p.persistent_ctas = m.ctas;
    p.tiles_per_claim = m.claim;
    p.no_combine = m.no_combine;
    return p;
  }

  // Poisons the output and every workspace byte except the counters, so a split that is read but
  // was not written this launch, or a counter that was not reset, shows up as NaN.
  void Poison(cudaStream_t stream) const {
    cudaMemsetAsync(dout_->get(), 0xFF, q_.size() * sizeof(__nv_bfloat16), stream);
    cudaMemsetAsync(dws_->get() + kDecodeAttentionCounterBytes, 0xFF,
                    ws_bytes_ - kDecodeAttentionCounterBytes, stream);
  }

  std::vector<float> Output() const { return FromBf16(dout_->Download()); }

  void ExpectCountersReset() const {
    uint32_t c[2] = {1, 1};
    ASSERT_EQ(cudaMemcpy(c, dws_->get(), sizeof(c), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(c[0], 0u) << "work counter not reset";
    EXPECT_EQ(c[1], 0u) << "done counter not reset";
  }

  void ExpectGuards() const {
    EXPECT_TRUE(dout_->GuardsIntact()) << "out";
    EXPECT_TRUE(dws_->GuardsIntact()) << "workspace";
    EXPECT_TRUE(dq_->GuardsIntact()) << "q";
  }

  // `report`: print the worst err/tol on success too, to show the bound's margin.
  void RunAndCheck(const ModeConfig& m, bool report = false) const {
    SCOPED_TRACE(m.Name());
    Poison(nullptr);
    ASSERT_TRUE(LaunchDecodeAttention(Params(m), nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const ::testing::AssertionResult match = Matches(Output());
    EXPECT_TRUE(match);
    EXPECT_EQ(Flag(), 0) << "a block-table entry within a context was flagged invalid";
    if (report && match) {
      std::printf("  longest context %d, %s: %s\n", max_context(), m.Name().c_str(),
                  match.message());
    }
    ExpectGuards();
    if (m.mode == DecodeAttentionMode::kWorkQueue) ExpectCountersReset();
  }

  int32_t Flag() const { return dflag_->Download()[0]; }

  // Overwrites table entry `block` of sequence `seq` on the device only (the reference keeps the
  // real one).
  void SetDeviceTableEntry(int seq, int block, int32_t id) const {
    std::vector<int32_t> t = kv_.tables;
    t[static_cast<size_t>(seq) * kv_.max_blocks_per_seq + block] = id;
    dtables_->Upload(t);
  }

  ::testing::AssertionResult Matches(const std::vector<float>& out) const {
    return ElementsWithin(out, ref_.out, ref_.tol, head_dim_);
  }
  const std::vector<double>& ref() const { return ref_.out; }
  const std::vector<double>& tol() const { return ref_.tol; }
  void ResetFlag() const { dflag_->Upload({0}); }
  const std::vector<float>& q() const { return q_; }
  const PagedKv& kv() const { return kv_; }
  const std::vector<int32_t>& contexts() const { return ctx_; }
  __nv_bfloat16* q_device() const { return dq_->get(); }
  __nv_bfloat16* k_device() const { return dk_->get(); }
  __nv_bfloat16* v_device() const { return dv_->get(); }
  int head_dim() const { return head_dim_; }
  int max_context() const { return *std::max_element(ctx_.begin(), ctx_.end()); }
  int num_seqs() const { return num_seqs_; }
  Heads heads() const { return heads_; }
  int block_size() const { return block_size_; }

 private:
  Heads heads_;
  int head_dim_;
  int block_size_;
  std::vector<int32_t> ctx_;
  int num_seqs_ = 0;
  PagedKv kv_;
  std::vector<float> q_;
  float scale_ = 0;
  DecodeRef ref_;
  size_t ws_bytes_ = 0;
  std::unique_ptr<GuardedBuffer<__nv_bfloat16>> dq_, dk_, dv_, dout_;
  std::unique_ptr<GuardedBuffer<int32_t>> dtables_, dctx_, dflag_;
  std::unique_ptr<GuardedBuffer<uint8_t>> dws_;
};

std::vector<ModeConfig> AllModes(const DecodeHarness& h) {
  const int sms = NumSms();
  SplitChoiceInputs in;
  in.num_seqs = h.num_seqs();
  in.num_q_heads = h.heads().q;
  in.num_kv_heads = h.heads().kv;
  in.max_context_len = h.max_context();
  in.num_sms = sms;
  in.max_splits = kMaxSplits;
  const absl::StatusOr<int32_t> per_sm =
      DecodeAttentionCtasPerSm(h.head_dim(), h.heads().q, h.heads().kv);
  EXPECT_TRUE(per_sm.ok()) << per_sm.status();
  in.ctas_per_sm = per_sm.ok() ? *per_sm : 0;
  const WorkQueueConfig wq = ChooseWorkQueueConfig(in, h.block_size());
  using M = DecodeAttentionMode;
  return {
      {M::kStaticSplit, 1},
      {M::kStaticSplit, 3},
      {M::kStaticSplit, 16},  // more splits than blocks for the short sequences
      {M::kStaticSplit, kMaxSplits},
      {M::kStaticSplit, ChooseNumSplits(in)},
      {M::kStaticSplit, 1, 0, 0, 1, /*no_combine=*/true},
      // Tiny chunks force the "more tiles than max_splits" widening; few CTAs force many claims.
      {M::kWorkQueue, 1, 16, 7, 4},
      {M::kWorkQueue, 1, 256, 4 * sms, 1},
      {M::kWorkQueue, 1, wq.chunk_tokens, wq.persistent_ctas, wq.tiles_per_claim},
  };
}

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
// split a chunk over several blocks, 32-256 hold several chunks (and a long poisoned tail).
TEST(DecodeAttentionTest, BlockSizesAroundTheKeyChunk) {
  for (int block_size : {1, 2, 4, 8, 32, 64, 256}) {
    for (int head_dim : {16, 64, 128}) {
      SCOPED_TRACE(absl::StrCat("block_size=", block_size, " head_dim=", head_dim));
      const uint32_t seed = 300 + block_size + head_dim;
      const DecodeHarness h({32, 8}, head_dim, Contexts(9, seed), seed, block_size);
      for (const ModeConfig& m : AllModes(h)) h.RunAndCheck(m);
    }
  }
}

TEST(DecodeAttentionTest, EachEdgeLengthAlone) {
  for (int n : {1, 15, 16, 17, 255, 1000, 4000}) {
    SCOPED_TRACE(absl::StrCat("context=", n));
    const DecodeHarness h({32, 8}, 128, {n}, 1000 + n);
    for (const ModeConfig& m : AllModes(h)) h.RunAndCheck(m);
  }
}

// Long contexts at the Llama-3 8B head shape, one sequence each: every mode of AllModes, so the
// production split count (ChooseNumSplits: 32-49 splits on an H200), one split over the whole
// context, several splits through the combine kernel and the work queue.
TEST(DecodeAttentionTest, LongContexts) {
  for (int n : {4096, 16384, 32768}) {
    SCOPED_TRACE(absl::StrCat("context=", n));
    const DecodeHarness h({32, 8}, 128, {n}, 2000 + n);
    for (const ModeConfig& m : AllModes(h)) h.RunAndCheck(m, /*report=*/true);
  }
}

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

std::vector<__nv_bfloat16> DownloadBf16(const __nv_bfloat16* p, size_t n) {
  std::vector<__nv_bfloat16> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return v;
}

// The RoPE angles of `positions` as a decode step gets them: from the prepare kernel, row s being
// an active slot at positions[s]. [rows, pairs, 2] floats.
std::unique_ptr<GuardedBuffer<float>> AnglesFromPrepare(const std::vector<int32_t>& positions,
                                                        const float* inv_freq, int32_t pairs) {
  const int32_t n = static_cast<int32_t>(positions.size());
  std::vector<SlotRow> slots(n);
  std::vector<int32_t> row_slots(n);
  for (int32_t s = 0; s < n; ++s) {
    slots[s].state = kSlotActive;
    slots[s].prompt_len = positions[s];  // position = prompt_len + generated - 1
    slots[s].generated = 1;
    row_slots[s] = s;
  }
  GuardedBuffer<SlotRow> d_slots(n);
  GuardedBuffer<int32_t> d_rows(n), tables(n), tokens(n), pos(n), mapping(n), ctx(n), out_tables(n),
      sample_slots(n);
  GuardedBuffer<SamplingRow> sampling(n);
  auto angles = std::make_unique<GuardedBuffer<float>>(static_cast<size_t>(n) * pairs * 2);
  d_slots.Upload(slots);
  d_rows.Upload(row_slots);
  tables.Upload(std::vector<int32_t>(n, 0));
  const PrepareDecodeParams p{.row_slots = d_rows.get(),
                              .slots = d_slots.get(),
                              .slot_block_tables = tables.get(),
                              .tokens = tokens.get(),
                              .positions = pos.get(),
                              .slot_mapping = mapping.get(),
                              .context_lens = ctx.get(),
                              .block_tables = out_tables.get(),
                              .sampling = sampling.get(),
                              .sample_slots = sample_slots.get(),
                              .rows = n,
                              .num_slots = n,
                              .max_blocks = 1,
                              .block_size = kBlockSize,
                              .rope_angles = angles->get(),
                              .inv_freq = inv_freq,
                              .rope_pairs = pairs};
  EXPECT_TRUE(LaunchPrepareDecode(p, nullptr).ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return angles;
}

// h's launch in mode m with the fused RoPE: q from qkv, the current K/V into h's cache.
DecodeAttentionParams FusedRopeParams(const DecodeHarness& h, const ModeConfig& m,
                                      const __nv_bfloat16* qkv, const float* angles,
                                      const int32_t* slot_mapping, int32_t* error_flag) {
  DecodeAttentionParams p = h.Params(m);
  p.q = nullptr;
  p.rope = DecodeAttentionRope{.qkv = qkv,
                               .angles = angles,
                               .slot_mapping = slot_mapping,
                               .k_cache = h.k_device(),
                               .v_cache = h.v_device(),
                               .error_flag = error_flag};
  return p;
}

// The fused RoPE (DecodeAttentionParams::rope) against the two kernels it replaces: rope_kv (q into
// its own buffer, K/V into a copy of the cache) then attention on that q. The output and the whole
// cache must match bit for bit in every mode, with the fused side's current K/V slots set to NaN
// before each launch, so a tile that read its current token from the cache instead of its own
// copy shows. The angles come from the prepare kernel, as in a step. Positions run far past the
// contexts (accurate sincosf's slow path), a padding row writes nothing (kNoKvWrite), and 32 query
// heads on 2 kv heads give two tiles per kv head that both write.
TEST(DecodeAttentionTest, FusedRopeIsBitwiseRopeKvThenAttention) {
  for (const auto& [heads, d] : {std::pair{Heads{32, 8}, 128}, std::pair{Heads{32, 2}, 128},
                                 std::pair{Heads{8, 2}, 64}, std::pair{Heads{4, 4}, 16}}) {
    SCOPED_TRACE(absl::StrCat("Hq ", heads.q, " Hkv ", heads.kv, " head_dim ", d));
    const std::vector<int32_t> ctx = {1, 15, 16, 17, 0, 64, 65, 300, 1000, 2049};
    const DecodeHarness h(heads, d, ctx, 500 + d + heads.kv);
    const PagedKv& kv = h.kv();
    const int n = h.num_seqs(), width = (heads.q + 2 * heads.kv) * d;
    std::vector<float> qkv = HashedValues(size_t(n) * width, 900 + d, 2.f);
    std::vector<int32_t> positions(n), slots(n);
    for (int s = 0; s < n; ++s) {
      const int cur = ctx[s] - 1;
      positions[s] = s % 2 == 0 ? std::max(cur, 0) : 100000 + 37 * s;
      slots[s] =
          cur < 0 ? kNoKvWrite
                  : kv.tables[size_t(s) * kv.max_blocks_per_seq + cur / kBlockSize] * kBlockSize +
                        cur % kBlockSize;
    }
    ModelConfig config;
    config.head_dim = d;
    config.rope_theta = 500000.0f;
    const absl::StatusOr<std::vector<float>> inv = ts::RopeInvFreq(config);
    ASSERT_TRUE(inv.ok()) << inv.status();
    // rope_kv rotates k in place: it gets a copy of qkv, the fused kernel the original.
    GuardedBuffer<__nv_bfloat16> dqkv(qkv.size()), ref_qkv(qkv.size()), ref_q(h.q().size());
    GuardedBuffer<__nv_bfloat16> ref_k(kv.k.size()), ref_v(kv.v.size());
    GuardedBuffer<int32_t> dpos(n), dslots(n), rope_flag(1);
    GuardedBuffer<float> dinv(inv->size());
    dqkv.Upload(ToBf16(qkv));
    ref_qkv.Upload(ToBf16(qkv));
    dpos.Upload(positions);
    dslots.Upload(slots);
    dinv.Upload(*inv);
    rope_flag.Upload({0});
    const size_t cache_bytes = kv.k.size() * sizeof(__nv_bfloat16);
    ASSERT_EQ(cudaMemcpy(ref_k.get(), h.k_device(), cache_bytes, cudaMemcpyDeviceToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(ref_v.get(), h.v_device(), cache_bytes, cudaMemcpyDeviceToDevice),
              cudaSuccess);
    const KvLayout layout{kv.num_blocks, heads.kv, kBlockSize, d};
    RopeKvParams r;
    r.qkv = ref_qkv.get();
    r.q_out = ref_q.get();
    r.positions = dpos.get();
    r.slot_mapping = dslots.get();
    r.inv_freq = dinv.get();
    r.k_cache = ref_k.get();
    r.v_cache = ref_v.get();
    r.layout = layout;
    r.rows = n;
    r.num_q_heads = heads.q;
    ASSERT_TRUE(LaunchRopeKv(r, nullptr).ok());
    const std::vector<__nv_bfloat16> want_k = ref_k.Download(), want_v = ref_v.Download();
    const std::unique_ptr<GuardedBuffer<float>> angles =
        AnglesFromPrepare(positions, dinv.get(), d / 2);

    for (const ModeConfig& m : AllModes(h)) {
      SCOPED_TRACE(m.Name());
      DecodeAttentionParams p = h.Params(m);
      p.q = ref_q.get();
      p.k_cache = ref_k.get();
      p.v_cache = ref_v.get();
      h.Poison(nullptr);
      ASSERT_TRUE(LaunchDecodeAttention(p, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> want = h.Output();

      for (int s = 0; s < n; ++s) {
        for (int kvh = 0; kvh < heads.kv && ctx[s] > 0; ++kvh) {
          const size_t off = kv.Offset(s, kvh, ctx[s] - 1);
          ASSERT_EQ(cudaMemset(h.k_device() + off, 0xFF, d * sizeof(__nv_bfloat16)), cudaSuccess);
          ASSERT_EQ(cudaMemset(h.v_device() + off, 0xFF, d * sizeof(__nv_bfloat16)), cudaSuccess);
        }
      }
      p = FusedRopeParams(h, m, dqkv.get(), angles->get(), dslots.get(), rope_flag.get());
      h.Poison(nullptr);
      ASSERT_TRUE(LaunchDecodeAttention(p, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> got = h.Output();
      ASSERT_EQ(got.size(), want.size());
      EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
      EXPECT_EQ(
          std::memcmp(DownloadBf16(h.k_device(), kv.k.size()).data(), want_k.data(), cache_bytes),
          0)
          << "k cache";
      EXPECT_EQ(
          std::memcmp(DownloadBf16(h.v_device(), kv.v.size()).data(), want_v.data(), cache_bytes),
          0)
          << "v cache";
      EXPECT_EQ(h.Flag(), 0);
      EXPECT_EQ(rope_flag.Download()[0], 0);
    }
    h.ExpectGuards();
    EXPECT_TRUE(angles->GuardsIntact());
  }
}

// A current token's slot outside the pool (kBadKvSlot, or one past the last slot) is an engine bug:
// the fused RoPE raises rope.error_flag and writes nothing, as rope_kv does.
TEST(DecodeAttentionTest, FusedRopeFlagsABadSlotAndWritesNothing) {
  const Heads heads{8, 2};
  const int d = 64;
  const DecodeHarness h(heads, d, {40, 17, 300}, 31);
  const PagedKv& kv = h.kv();
  const int n = h.num_seqs();
  GuardedBuffer<__nv_bfloat16> dqkv(size_t(n) * (heads.q + 2 * heads.kv) * d);
  dqkv.Upload(ToBf16(HashedValues(dqkv.size(), 8, 2.f)));
  ModelConfig config;
  config.head_dim = d;
  const absl::StatusOr<std::vector<float>> inv = ts::RopeInvFreq(config);
  ASSERT_TRUE(inv.ok()) << inv.status();
  GuardedBuffer<float> dinv(inv->size());
  dinv.Upload(*inv);
  GuardedBuffer<int32_t> dslots(n), rope_flag(1);
  const std::unique_ptr<GuardedBuffer<float>> angles =
      AnglesFromPrepare({39, 16, 299}, dinv.get(), d / 2);
  const std::vector<__nv_bfloat16> k0 = DownloadBf16(h.k_device(), kv.k.size());
  const std::vector<__nv_bfloat16> v0 = DownloadBf16(h.v_device(), kv.v.size());
  for (const int32_t bad : {kBadKvSlot, kv.num_blocks * kBlockSize}) {
    SCOPED_TRACE(absl::StrCat("slot ", bad));
    dslots.Upload({kNoKvWrite, bad, kNoKvWrite});
    rope_flag.Upload({0});
    const DecodeAttentionParams p =
        FusedRopeParams(h, {DecodeAttentionMode::kStaticSplit, 3}, dqkv.get(), angles->get(),
                        dslots.get(), rope_flag.get());
    ASSERT_TRUE(LaunchDecodeAttention(p, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(rope_flag.Download()[0], 1);
    EXPECT_EQ(h.Flag(), 0);
    const size_t bytes = kv.k.size() * sizeof(__nv_bfloat16);
    EXPECT_EQ(std::memcmp(DownloadBf16(h.k_device(), kv.k.size()).data(), k0.data(), bytes), 0);
    EXPECT_EQ(std::memcmp(DownloadBf16(h.v_device(), kv.v.size()).data(), v0.data(), bytes), 0);
  }
  h.ExpectGuards();
}

// Every test above pads the tables with kInvalidKvBlock and checks that the flag stays 0: no entry
// past a context is even looked up. Here an invalid id (padding, a negative id, one past the pool)
// sits inside sequence 0's context, as an engine off-by-one would leave it: the kernel must flag
// it and stay in bounds (no illegal address; the launch and the sync succeed), and the other
// sequences' rows are still right. Sequence 0's own output is then meaningless and not checked.
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
