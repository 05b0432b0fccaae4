// The decode attention tests' harness (tests/kernels/decode_attention_test.cc and
// decode_attention_rope_test.cc, one binary): inputs on exact grids, the CPU reference with its
// per-element bound, and every launch mode.
//
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
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/decode_attention.cuh"
#include "tests/kernels/attention_test_util.h"

namespace ts::kernels::testing {

inline constexpr int kBlockSize = 16;
inline constexpr int kMaxSplits = 64;

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

inline int NumSms() {
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
inline DecodeRef Reference(const std::vector<float>& q, const PagedKv& kv,
                           const std::vector<int32_t>& ctx, int num_q_heads, float scale) {
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
inline std::vector<int32_t> Contexts(int num_seqs, uint32_t seed) {
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

// The count AllModes returns, for tests that take its modes one per test (a sanitizer shard each).
inline constexpr int kAllModesCount = 9;

inline std::vector<ModeConfig> AllModes(const DecodeHarness& h) {
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

}  // namespace ts::kernels::testing
