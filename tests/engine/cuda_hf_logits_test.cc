// Teacher-forced logits of the CUDA path against transformers, in the real Llama-3.2-1B shape
// (random bf16 weights). tests/gpu/make_llama1b_reference.py writes the checkpoint, the prompts
// and transformers' bf16 logits on the GPU machine into one directory; point TS_LLAMA1B_DIR at
// it. Without it the test exits 77 (CTest: skipped).
//
// Both sides compute in bf16 with different kernels, so logits differ by bf16 rounding; what
// must hold is that the top-1 token agrees almost everywhere. Reports max abs and relative
// error per prompt, and every disagreement with both sides' logits for the two tokens.
//
// With random weights the logits are flat (top-1 gap ~0.16 at logits ~4, where a bf16 ulp is
// 1/64), so some rows are exact bf16 ties on one side or the other, and the first-index argmax
// then reports a disagreement that is only tie order. The test therefore checks three things:
// first-index top-1 agreement >= 99% (the literal target), the same with a row counted
// as agreeing when either side's pick attains the other side's maximum exactly, and on every row
// that our pick is within 2 bf16 ulps of transformers' maximum (a real bug moves it further).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "engine/cuda_backend.h"
#include "models/checkpoint.h"
#include "nlohmann/json.hpp"

namespace ts {
namespace {

TEST(CudaHfLogitsTest, Llama1bShapeTeacherForcedLogitsAgreeWithTransformers) {
  const char* env = std::getenv("TS_LLAMA1B_DIR");
  if (env == nullptr || *env == '\0') {
    std::printf("SKIPPED: TS_LLAMA1B_DIR is not set (tests/gpu/make_llama1b_reference.py)\n");
    std::fflush(stdout);
    std::exit(77);
  }
  const std::filesystem::path dir(env);
  std::ifstream f(dir / "prompts.json");
  ASSERT_TRUE(f.good()) << "missing " << (dir / "prompts.json");
  const nlohmann::json j = nlohmann::json::parse(f);
  const auto prompts = j.at("prompts").get<std::vector<std::vector<int32_t>>>();
  ASSERT_FALSE(prompts.empty());
  auto ref = Checkpoint::OpenFile(dir / "reference_logits.safetensors");
  ASSERT_TRUE(ref.ok()) << ref.status();

  int32_t longest = 0;
  for (const auto& p : prompts) longest = std::max<int32_t>(longest, p.size());
  CudaBackendOptions o;
  o.model_dir = dir;
  o.max_slots = 1;
  o.buckets = {1, 64};  // the logits head runs 64 rows at a time
  o.max_context = std::max(longest, 64);
  o.prefill_chunk_tokens = std::max(longest, 64);
  o.gpu_memory_fraction = 0.5;
  o.ring_capacity = 16;
  auto backend = CudaBackend::Create(o);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const int32_t vocab = (*backend)->info().model.vocab_size;

  int64_t rows = 0, agree = 0, agree_or_tie = 0;
  double worst_rel = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto& p = prompts[i];
    auto got = (*backend)->PromptLogits(p);
    ASSERT_TRUE(got.ok()) << got.status();
    const TensorView* t = (*ref)->Find("logits_" + std::to_string(i));
    ASSERT_NE(t, nullptr) << "logits_" << i;
    ASSERT_EQ(t->numel(), static_cast<int64_t>(p.size()) * vocab);
    std::vector<float> want(t->numel());
    ConvertToF32(*t, want.data());
    double max_abs = 0, diff2 = 0, ref2 = 0;
    int32_t prompt_agree = 0;
    for (size_t r = 0; r < p.size(); ++r) {
      const float* g = got->data() + r * vocab;
      const float* w = want.data() + r * vocab;
      int32_t ga = 0, wa = 0;
      for (int32_t v = 0; v < vocab; ++v) {
        ASSERT_TRUE(std::isfinite(g[v])) << "prompt " << i << " row " << r << " token " << v;
        const double d = static_cast<double>(g[v]) - w[v];
        max_abs = std::max(max_abs, std::abs(d));
        diff2 += d * d;
        ref2 += static_cast<double>(w[v]) * w[v];
        if (g[v] > g[ga]) ga = v;
        if (w[v] > w[wa]) wa = v;
      }
      prompt_agree += ga == wa;
      if (ga == wa) {
        ++agree_or_tie;
        continue;
      }
      // Exact ties: our pick attains transformers' max, or theirs attains ours.
      agree_or_tie += w[ga] == w[wa] || g[wa] == g[ga];
      std::printf(
          "  row %zu: transformers picks %d (%.5f; ours %.5f), we pick %d (%.5f; ours "
          "%.5f)\n",
          r, wa, w[wa], g[wa], ga, w[ga], g[ga]);
      // bf16 keeps 8 significant bits: one ulp at x is 2^(floor(log2 |x|) - 7).
      const float ulp = std::ldexp(1.0f, std::ilogb(std::max(std::abs(w[wa]), 1e-30f)) - 7);
      EXPECT_LE(w[wa] - w[ga], 2 * ulp)
          << "prompt " << i << " row " << r << ": our top-1 is more than 2 bf16 ulps below "
          << "transformers' maximum";
    }
    const double rel = std::sqrt(diff2 / ref2);
    worst_rel = std::max(worst_rel, rel);
    rows += p.size();
    agree += prompt_agree;
    std::printf("prompt %zu (%zu tokens): max |err| %.4f, rel err %.3e, top-1 agree %d/%zu\n", i,
                p.size(), max_abs, rel, prompt_agree, p.size());
  }
  const double frac = static_cast<double>(agree) / static_cast<double>(rows);
  const double frac_ties = static_cast<double>(agree_or_tie) / static_cast<double>(rows);
  std::printf(
      "overall: top-1 agreement %.2f%% (%lld/%lld), %.2f%% counting exact bf16 ties (%lld), "
      "worst rel err %.3e\n",
      100 * frac, static_cast<long long>(agree), static_cast<long long>(rows), 100 * frac_ties,
      static_cast<long long>(agree_or_tie), worst_rel);
  EXPECT_GE(frac, 0.99);
  EXPECT_GE(frac_ties, 0.99);
  // A sanity bound far above bf16 rounding and far below a broken model (rel ~ 1).
  EXPECT_LT(worst_rel, 0.1);
}

}  // namespace
}  // namespace ts
