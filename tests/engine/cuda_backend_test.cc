// The CUDA backend on every committed fixture (tests/fixtures/README.md), driven directly through
// the Backend seam (cuda_test_driver.h):
//   - greedy streams equal transformers' reference tokens exactly, alone and batched (batched
//     runs include padding rows of a bucket), and equal the CPU backend's streams;
//   - teacher-forced logits stay close to transformers' fp32 logits (diagnoses a failing stream);
//   - stop rules (stop ids, min_new_tokens, EOS, max_new_tokens) cut the stream where CheckStop
//     says, like the CPU backend, including greedy paths that really meet each EOS id;
//   - seeded sampled streams (with penalties) are reproducible, and identical alone (bucket 1)
//     and among 7 other requests (bucket 8);
//   - Cancel finishes a slot at the next step with a finish-only record, the others go on;
//   - a long request crosses a context regime boundary: the graphs are updated, never
//     re-instantiated; when it finishes the regime shrinks and a short request beside it decodes
//     exactly as alone;
//   - the backend runs from threads other than its creator's, and on device 1 from a thread
//     whose current device is 0 (two GPUs);
//   - the memory plan refuses a KV budget that cannot hold one max-length sequence.
#include "engine/cuda/cuda_backend.h"

#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <unistd.h>
#include <cmath>
#include <fstream>
#include <string>
#include <thread>

#include "engine/cpu_backend.h"
#include "models/checkpoint.h"
#include "models/cpu_model.h"
#include "nlohmann/json.hpp"
#include "tests/common/test_paths.h"
#include "tests/engine/cuda_test_driver.h"

namespace ts {
namespace {

using ::ts::testing::DriverRequest;
using ::ts::testing::DriverResult;
using ::ts::testing::EosPath;
using ::ts::testing::ExpectedAlongPath;
using ::ts::testing::GreedyRequest;
using ::ts::testing::PickEosPath;
using ::ts::testing::ReferencePath;
using ::ts::testing::RunTogether;

constexpr int32_t kMaxContext = 256;  // the fixtures' max_position_embeddings

struct Reference {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::vector<int32_t>> greedy;  // EOS ignored
  std::vector<double> margins;
};

Reference LoadReference(const std::string& variant) {
  std::ifstream f(::ts::testing::FixtureDir() / variant / "reference.json");
  EXPECT_TRUE(f.good()) << "missing fixture " << variant;
  const nlohmann::json j = nlohmann::json::parse(f);
  Reference r;
  r.prompts = j.at("prompts").get<std::vector<std::vector<int32_t>>>();
  r.greedy = j.at("greedy").get<std::vector<std::vector<int32_t>>>();
  r.margins = j.at("greedy_min_margin").get<std::vector<double>>();
  return r;
}

CudaBackendOptions Options(const std::string& variant, int32_t max_slots) {
  CudaBackendOptions o;
  o.model_dir = ::ts::testing::FixtureDir() / variant;
  o.max_slots = max_slots;
  o.kv_block_size = 16;
  o.gpu_memory_fraction = 0.5;
  o.buckets = {1, 2, 4, 8};
  o.max_context = kMaxContext;
  o.prefill_chunk_tokens = 64;  // small, so the 23-token prompts plus others span chunks
  o.ring_capacity = 64;
  o.log_progress = false;
  return o;
}

std::unique_ptr<CudaBackend> MakeCuda(const std::string& variant, int32_t max_slots = 8) {
  auto b = CudaBackend::Create(Options(variant, max_slots));
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

std::unique_ptr<Backend> MakeCpu(const std::string& variant, int32_t max_slots) {
  CpuBackendOptions o;
  o.model_dir = ::ts::testing::FixtureDir() / variant;
  o.max_slots = max_slots;
  o.kv_block_size = 16;
  o.buckets = {1, 2, 4, 8};
  o.num_threads = 2;
  o.ring_capacity = 64;
  auto b = CreateCpuBackend(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

DriverRequest Sampled(std::vector<int32_t> prompt, int32_t max_new, uint64_t seed) {
  DriverRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0.9f;
  r.sampling.top_k = 40;
  r.sampling.top_p = 0.95f;
  r.sampling.repetition_penalty = 1.2f;
  r.sampling.presence_penalty = 0.3f;
  r.sampling.frequency_penalty = 0.2f;
  r.sampling.seed = seed;
  r.stop.max_new_tokens = max_new;
  r.stop.ignore_eos = true;
  return r;
}

class CudaBackendFixtureTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ref_ = LoadReference(GetParam());
    ASSERT_EQ(ref_.prompts.size(), 3u);
    backend_ = MakeCuda(GetParam());
    ASSERT_NE(backend_, nullptr);
  }
  int32_t NumNew() const { return static_cast<int32_t>(ref_.greedy[0].size()); }

  Reference ref_;
  std::unique_ptr<CudaBackend> backend_;
};

TEST_P(CudaBackendFixtureTest, GreedyMatchesTransformersBatchedAndAlone) {
  std::vector<DriverRequest> reqs;
  for (const auto& p : ref_.prompts) reqs.push_back(GreedyRequest(p, NumNew()));
  // 3 requests run in bucket 4: one padding row every step.
  const std::vector<DriverResult> together = RunTogether(*backend_, reqs, kMaxContext);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(together[i].tokens, ref_.greedy[i])
        << GetParam() << " prompt " << i << " (reference min margin " << ref_.margins[i] << ")";
    EXPECT_EQ(together[i].reason, FinishReason::kLength);
  }
  EXPECT_EQ(backend_->last_step().bucket, 4);
  // The same backend again, one request at a time (slot 0 reused: ring and counts reset).
  for (size_t i = 0; i < reqs.size(); ++i) {
    const std::vector<DriverResult> alone = RunTogether(*backend_, {reqs[i]}, kMaxContext);
    EXPECT_EQ(alone[0].tokens, ref_.greedy[i]) << GetParam() << " prompt " << i << " alone";
    EXPECT_EQ(backend_->last_step().bucket, 1);
  }
}

TEST_P(CudaBackendFixtureTest, GreedyMatchesCpuBackend) {
  std::unique_ptr<Backend> cpu = MakeCpu(GetParam(), 8);
  ASSERT_NE(cpu, nullptr);
  std::vector<DriverRequest> reqs;
  for (const auto& p : ref_.prompts) reqs.push_back(GreedyRequest(p, NumNew()));
  const std::vector<DriverResult> want = RunTogether(*cpu, reqs, kMaxContext);
  const std::vector<DriverResult> got = RunTogether(*backend_, reqs, kMaxContext);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i].tokens) << GetParam() << " prompt " << i;
    EXPECT_EQ(got[i].reason, want[i].reason);
    EXPECT_EQ(got[i].records, want[i].records);
  }
}

TEST_P(CudaBackendFixtureTest, TeacherForcedLogitsCloseToTransformers) {
  auto ckpt = Checkpoint::OpenFile(::ts::testing::FixtureDir() / GetParam() /
                                   "reference_logits.safetensors");
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const int32_t vocab = backend_->info().model.vocab_size;
  for (size_t i = 0; i < ref_.prompts.size(); ++i) {
    std::vector<int32_t> seq = ref_.prompts[i];
    seq.insert(seq.end(), ref_.greedy[i].begin(), ref_.greedy[i].end());
    auto got = backend_->PromptLogits(seq);
    ASSERT_TRUE(got.ok()) << got.status();
    const TensorView* t = (*ckpt)->Find("logits_" + std::to_string(i));
    ASSERT_NE(t, nullptr);
    ASSERT_EQ(t->numel(), static_cast<int64_t>(seq.size()) * vocab);
    std::vector<float> want(t->numel());
    ConvertToF32(*t, want.data());
    double max_abs = 0, diff2 = 0, ref2 = 0;
    int32_t argmax_agree = 0, path_agree = 0;
    // Rows [prompt_len - 1, prompt_len + 31) predict the greedy tokens: their top1-top2 margins
    // are >= 0.1 and survive bf16 (tests/fixtures/README.md). Other rows' margins are not
    // controlled; they are only reported.
    const size_t path_begin = ref_.prompts[i].size() - 1, path_end = path_begin + NumNew();
    for (size_t r = 0; r < seq.size(); ++r) {
      int32_t a = 0, b = 0;
      for (int32_t v = 0; v < vocab; ++v) {
        const double g = (*got)[r * vocab + v], w = want[r * vocab + v];
        ASSERT_TRUE(std::isfinite(g)) << "row " << r << " token " << v;
        max_abs = std::max(max_abs, std::abs(g - w));
        diff2 += (g - w) * (g - w);
        ref2 += w * w;
        if (g > (*got)[r * vocab + a]) a = v;
        if (w > want[r * vocab + b]) b = v;
      }
      argmax_agree += a == b;
      if (r >= path_begin && r < path_end) {
        path_agree += a == b;
        EXPECT_EQ(a, ref_.greedy[i][r - path_begin])
            << GetParam() << " prompt " << i << " row " << r;
      }
    }
    const double rel = std::sqrt(diff2 / ref2);
    std::printf(
        "%s prompt %zu: max |logit err| %.4f, rel %.2e, argmax agree %d/%zu (greedy path "
        "%d/%d)\n",
        GetParam().c_str(), i, max_abs, rel, argmax_agree, seq.size(), path_agree, NumNew());
    // bf16 weights and activations against fp32 transformers: a numpy model of our roundings
    // gives 1.5e-2 to 2.4e-2 on these fixtures; a real bug (rope, a norm, a layer) gives > 0.3.
    EXPECT_LT(rel, 4e-2) << GetParam() << " prompt " << i;
    EXPECT_EQ(path_agree, NumNew()) << GetParam() << " prompt " << i;
  }
}

TEST_P(CudaBackendFixtureTest, StopRulesCutTheGreedyPath) {
  const std::vector<int32_t>& path = ref_.greedy[2];
  const std::vector<int32_t>& eos = backend_->info().model.eos_token_ids;
  std::vector<StopParams> cases;
  cases.push_back({.stop_token_ids = {path[5]}, .max_new_tokens = NumNew()});
  cases.push_back(
      {.stop_token_ids = {path[3], path[1]}, .max_new_tokens = NumNew(), .min_new_tokens = 8});
  cases.push_back({.stop_token_ids = {}, .max_new_tokens = 10});
  cases.push_back({.stop_token_ids = {}, .max_new_tokens = NumNew(), .ignore_eos = false});
  cases.push_back({.stop_token_ids = {path[0]}, .max_new_tokens = 1});
  std::vector<DriverRequest> reqs;
  for (const StopParams& stop : cases) {
    DriverRequest r = GreedyRequest(ref_.prompts[2], 1);
    r.stop = stop;
    reqs.push_back(r);
  }
  const std::vector<DriverResult> got = RunTogether(*backend_, reqs, kMaxContext);
  for (size_t c = 0; c < cases.size(); ++c) {
    const DriverResult want = ExpectedAlongPath(path, cases[c], eos);
    EXPECT_EQ(got[c].tokens, want.tokens) << GetParam() << " case " << c;
    EXPECT_EQ(got[c].reason, want.reason)
        << GetParam() << " case " << c << ": " << FinishReasonName(got[c].reason) << " vs "
        << FinishReasonName(want.reason);
  }
}

// The reference prompts' greedy streams hold one EOS (tiny-gqa-untied prompt 1, index 14), so the
// CPU reference searches every single-token prompt for greedy paths that meet an EOS id, one per
// id: on a model with several, a postprocess that checks only the first would pass with one.
// Only steps whose fp32 top1-top2 gap is >= 0.1 are held to exact equality (the fixtures' rule
// for paths a bf16 engine reproduces, tests/fixtures/README.md).
TEST_P(CudaBackendFixtureTest, StopsOnEachEosIdWhereTheReferenceDoes) {
  constexpr int32_t kSearch = 24;
  constexpr float kMinMargin = 0.1f;
  auto cpu_model = CpuModel::Load(::ts::testing::FixtureDir() / GetParam());
  ASSERT_TRUE(cpu_model.ok()) << cpu_model.status();
  const std::vector<int32_t>& eos = backend_->info().model.eos_token_ids;
  ASSERT_FALSE(eos.empty());
  std::vector<std::vector<int32_t>> prompts;
  for (int32_t t = 0; t < backend_->info().model.vocab_size; ++t) prompts.push_back({t});
  const std::vector<ReferencePath> paths =
      ::ts::testing::CpuGreedyPaths(**cpu_model, prompts, kSearch);
  std::unique_ptr<Backend> cpu = MakeCpu(GetParam(), 8);
  ASSERT_NE(cpu, nullptr);
  int32_t found = 0, found_later_id = 0;
  for (size_t e = 0; e < eos.size(); ++e) {
    // An EOS at index >= 1 is sampled by a decode graph, not by the prefill.
    const std::optional<EosPath> hit =
        PickEosPath(paths, eos, kMinMargin, 1, [&](int32_t t) { return t == eos[e]; });
    if (!hit.has_value()) continue;
    ++found;
    found_later_id += e > 0;
    const std::vector<int32_t>& path = hit->path.tokens;
    const int32_t j = hit->eos_index, robust = hit->robust_len;
    std::printf("%s eos id %d: prompt {%d} meets it at index %d, exact for %d tokens\n",
                GetParam().c_str(), eos[e], hit->path.prompt[0], j, robust);
    const std::vector<int32_t> exact(path.begin(), path.begin() + robust);
    std::vector<StopParams> cases;
    cases.push_back({.stop_token_ids = {}, .max_new_tokens = robust});
    // The EOS is the stop id's token too, but the reason is EOS unless EOS is ignored.
    cases.push_back({.stop_token_ids = {eos[e]}, .max_new_tokens = robust, .ignore_eos = true});
    if (robust > j + 1) {
      cases.push_back({.stop_token_ids = {}, .max_new_tokens = robust, .min_new_tokens = j + 1});
      cases.push_back({.stop_token_ids = {}, .max_new_tokens = robust, .ignore_eos = true});
    }
    std::vector<DriverRequest> reqs;
    for (const StopParams& stop : cases) {
      DriverRequest r = GreedyRequest(hit->path.prompt, 1);
      r.stop = stop;
      reqs.push_back(r);
    }
    const std::vector<DriverResult> got = RunTogether(*backend_, reqs, kMaxContext);
    const std::vector<DriverResult> twin = RunTogether(*cpu, reqs, kMaxContext);
    for (size_t c = 0; c < cases.size(); ++c) {
      const DriverResult want = ExpectedAlongPath(exact, cases[c], eos);
      if (c == 0) {
        ASSERT_EQ(want.reason, FinishReason::kEos);  // the case this test exists for
      }
      if (c == 1) {
        ASSERT_EQ(want.reason, FinishReason::kStopToken);
      }
      EXPECT_EQ(got[c].tokens, want.tokens) << GetParam() << " eos " << eos[e] << " case " << c;
      EXPECT_EQ(got[c].reason, want.reason)
          << GetParam() << " eos " << eos[e] << " case " << c << ": "
          << FinishReasonName(got[c].reason) << " vs " << FinishReasonName(want.reason);
      EXPECT_EQ(twin[c].tokens, want.tokens)
          << GetParam() << " CPU eos " << eos[e] << " case " << c;
      EXPECT_EQ(twin[c].reason, want.reason)
          << GetParam() << " CPU eos " << eos[e] << " case " << c;
    }
  }
  ASSERT_GE(found, 1) << GetParam() << ": no single-token prompt's greedy path meets an EOS id "
                      << "within " << kSearch << " tokens with margins >= " << kMinMargin;
  // tiny-oldstyle-sharded's greedy paths meet its third id (6). tiny-llama3-rope's never emit
  // its second (7): none of 1,280 one- and two-token prompts does within 32 tokens.
  if (GetParam() == "tiny-oldstyle-sharded") {
    EXPECT_GE(found_later_id, 1) << GetParam() << " has " << eos.size()
                                 << " EOS ids but no path meets one other than the first";
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaBackendFixtureTest,
                         ::testing::Values("tiny-mha-tied", "tiny-gqa-untied", "tiny-llama3-rope",
                                           "tiny-oldstyle-sharded"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s) c = c == '-' ? '_' : c;
                           return s;
                         });

TEST(CudaBackendTest, SeededSamplingReproducibleAloneAndAmongOthers) {
  const Reference ref = LoadReference("tiny-gqa-untied");
  auto backend = MakeCuda("tiny-gqa-untied");
  ASSERT_NE(backend, nullptr);
  const DriverRequest probe = Sampled(ref.prompts[1], 40, 1234);
  const std::vector<int32_t> alone1 = RunTogether(*backend, {probe}, kMaxContext)[0].tokens;
  const std::vector<int32_t> alone2 = RunTogether(*backend, {probe}, kMaxContext)[0].tokens;
  ASSERT_EQ(alone1.size(), 40u);
  EXPECT_EQ(alone1, alone2);

  // Among 7 others with other prompts and seeds, in slot 3 of bucket 8.
  std::vector<DriverRequest> reqs;
  for (int i = 0; i < 8; ++i) {
    if (i == 3) {
      reqs.push_back(probe);
      continue;
    }
    reqs.push_back(Sampled(ref.prompts[i % 3], 20 + 3 * i, 777 + i));
  }
  const std::vector<DriverResult> together = RunTogether(*backend, reqs, kMaxContext);
  EXPECT_EQ(together[3].tokens, alone1);
  // The sampler really samples: the same prompt under another seed takes another path.
  const std::vector<int32_t> other =
      RunTogether(*backend, {Sampled(ref.prompts[1], 40, 99)}, kMaxContext)[0].tokens;
  EXPECT_NE(other, alone1);
  // Greedy is not what we sampled either.
  const std::vector<int32_t> greedy =
      RunTogether(*backend, {GreedyRequest(ref.prompts[1], 40)}, kMaxContext)[0].tokens;
  EXPECT_NE(greedy, alone1);
}

TEST(CudaBackendTest, CancelFinishesAtTheNextStep) {
  const Reference ref = LoadReference("tiny-gqa-untied");
  auto backend = MakeCuda("tiny-gqa-untied");
  ASSERT_NE(backend, nullptr);
  const int32_t n = static_cast<int32_t>(ref.greedy[0].size());
  std::vector<DriverRequest> reqs = {GreedyRequest(ref.prompts[0], n),
                                     GreedyRequest(ref.prompts[1], n)};
  // Prefill emits token 0; steps 0..3 emit tokens 1..4; the cancel lands before step 4.
  const std::vector<DriverResult> got = RunTogether(*backend, reqs, kMaxContext, [&](int32_t step) {
    if (step == 4) backend->Cancel(0);
  });
  EXPECT_EQ(got[0].reason, FinishReason::kCancelled);
  EXPECT_EQ(got[0].tokens, std::vector<int32_t>(ref.greedy[0].begin(), ref.greedy[0].begin() + 5));
  EXPECT_EQ(got[0].records, 6);  // 5 tokens + the finish-only record
  EXPECT_EQ(got[1].reason, FinishReason::kLength);
  EXPECT_EQ(got[1].tokens, ref.greedy[1]);
  // Cancelling a FREE slot is harmless, and the next request in it is not cancelled.
  backend->Cancel(0);
  const std::vector<DriverResult> again =
      RunTogether(*backend, {GreedyRequest(ref.prompts[0], n)}, kMaxContext);
  EXPECT_EQ(again[0].tokens, ref.greedy[0]);
}

TEST(CudaBackendTest, LongRequestCrossesARegimeWithoutReinstantiating) {
  const Reference ref = LoadReference("tiny-gqa-untied");
  auto backend = MakeCuda("tiny-gqa-untied");
  ASSERT_NE(backend, nullptr);
  const int64_t inst = backend->graph_cache().instantiation_count();
  const int32_t first_bound = backend->graph_cache().regime().max_context_len;
  const int32_t n = kMaxContext - static_cast<int32_t>(ref.prompts[2].size());
  const std::vector<DriverResult> got =
      RunTogether(*backend, {GreedyRequest(ref.prompts[2], n)}, kMaxContext);
  ASSERT_EQ(got[0].tokens.size(), static_cast<size_t>(n));
  EXPECT_EQ(std::vector<int32_t>(got[0].tokens.begin(), got[0].tokens.begin() + 32), ref.greedy[2]);
  EXPECT_GT(backend->graph_cache().regime().max_context_len, first_bound);
  EXPECT_GE(backend->graph_cache().update_count(), 1);
  EXPECT_EQ(backend->graph_cache().instantiation_count(), inst);
  // After the regime change the short prompt still decodes exactly.
  const std::vector<DriverResult> again =
      RunTogether(*backend, {GreedyRequest(ref.prompts[0], 32)}, kMaxContext);
  EXPECT_EQ(again[0].tokens, ref.greedy[0]);
}

// A copy of tiny-gqa-untied that admits `max_positions` tokens. Its default RoPE does not depend on
// max_position_embeddings, so the reference paths still hold. At 256 the regimes are 128 and 256
// only, and the shrink (two levels, 4x) can never happen.
std::filesystem::path LongContextCopy(int32_t max_positions) {
  const std::filesystem::path src = ::ts::testing::FixtureDir() / "tiny-gqa-untied";
  const std::filesystem::path dst =
      std::filesystem::path(::testing::TempDir()) /
      ("tiny-gqa-untied-" + std::to_string(max_positions) + "-" + std::to_string(getpid()));
  std::filesystem::create_directories(dst);
  for (const char* f : {"model.safetensors", "generation_config.json"}) {
    std::filesystem::copy_file(src / f, dst / f, std::filesystem::copy_options::overwrite_existing);
  }
  std::ifstream in(src / "config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  config["max_position_embeddings"] = max_positions;
  std::ofstream(dst / "config.json") << config.dump(2);
  return dst;
}

// The regime grows for a long request and shrinks when it finishes, and the short request beside
// it decodes exactly throughout. With min_split_tokens 4096 the 128-token regime runs one split
// (the attention kernel writes the output, the combine node passes through) and the 1024-token one
// eight, merged by the combine (of up to 16 at this max_context).
void RegimeShrinksWhenTheLongRequestFinishes(int32_t min_split_tokens) {
  constexpr int32_t kLong = 2048;
  const Reference ref = LoadReference("tiny-gqa-untied");
  CudaBackendOptions o = Options("tiny-gqa-untied", 8);
  o.model_dir = LongContextCopy(kLong);
  o.max_context = kLong;
  o.attention_min_split_tokens = min_split_tokens;
  auto created = CudaBackend::Create(o);
  ASSERT_TRUE(created.ok()) << created.status();
  CudaBackend& backend = **created;
  const graphs::GraphCache& cache = backend.graph_cache();
  const int32_t n = static_cast<int32_t>(ref.greedy[0].size());
  const DriverRequest short_req = GreedyRequest(ref.prompts[0], n);
  const int32_t first = cache.regime().max_context_len;
  ASSERT_EQ(first, 128);
  const std::vector<DriverResult> alone = RunTogether(backend, {short_req}, kLong);
  EXPECT_EQ(alone[0].tokens, ref.greedy[0]);
  EXPECT_EQ(cache.regime().max_context_len, first) << "a 33-token context left the first regime";

  // A 600-token prompt (regime 1024) that finishes after 8 tokens while the short one goes on.
  std::vector<int32_t> long_prompt;
  for (int32_t i = 0; i < 600; ++i) long_prompt.push_back((i * 37 + 11) % 311);
  constexpr int32_t kLongNew = 8;
  const int64_t updates = cache.update_count(), inst = cache.instantiation_count();
  std::vector<int32_t> regimes;  // the regime each decode step ran in
  const std::vector<DriverResult> together = RunTogether(
      backend, {short_req, GreedyRequest(long_prompt, kLongNew)}, kLong, {}, [&](int32_t step) {
        if (step >= 0) regimes.push_back(cache.regime().max_context_len);
      });
  ASSERT_EQ(together[1].tokens.size(), static_cast<size_t>(kLongNew));
  EXPECT_EQ(together[0].tokens, alone[0].tokens);
  EXPECT_EQ(together[0].tokens, ref.greedy[0]);
  // Steps 0..6 decode the long request's tokens 2..8 (contexts 601..607: regime 1024). From
  // step 7 only the short one runs (context 9): the regime drops to 128 at once and stays.
  ASSERT_EQ(regimes.size(), static_cast<size_t>(n - 1));
  for (int32_t step = 0; step < n - 1; ++step) {
    EXPECT_EQ(regimes[step], step < kLongNew - 1 ? 1024 : first) << "step " << step;
  }
  EXPECT_EQ(cache.update_count() - updates, 2) << "one grow and one shrink";
  EXPECT_EQ(cache.instantiation_count(), inst);
  EXPECT_EQ(backend.max_active_context(), 0);
}

TEST(CudaBackendTest, RegimeShrinksWhenTheLongRequestFinishes) {
  RegimeShrinksWhenTheLongRequestFinishes(64);
}

TEST(CudaBackendTest, RegimeShrinksThroughOneSplitAndBack) {
  RegimeShrinksWhenTheLongRequestFinishes(4096);
}

// The engine decodes on its own thread, not the one that created the backend (docs/architecture.md,
// The decode loop).
TEST(CudaBackendTest, RunsFromAThreadOtherThanItsCreator) {
  const Reference ref = LoadReference("tiny-gqa-untied");
  std::unique_ptr<CudaBackend> backend = MakeCuda("tiny-gqa-untied");
  ASSERT_NE(backend, nullptr);
  std::vector<DriverRequest> reqs;
  for (const auto& p : ref.prompts) reqs.push_back(GreedyRequest(p, 32));
  std::vector<DriverResult> got;
  std::thread engine([&] {
    got = RunTogether(*backend, reqs, kMaxContext);
    backend.reset();  // the destructor too runs off the creating thread
  });
  engine.join();
  ASSERT_EQ(got.size(), reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[i].tokens, ref.greedy[i]) << i;
}

// --device N: created on device 1, driven by a thread whose current device is 0. Before every
// entry set the device itself, prefill and decode launched onto device 1's stream from device 0.
TEST(CudaBackendTest, OnDeviceOneRunsFromAThreadOnDeviceZero) {
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  if (count < 2) {
    GTEST_SKIP() << "needs 2 GPUs to put the backend on device 1 (this machine has " << count
                 << "); the one-GPU case is RunsFromAThreadOtherThanItsCreator";
  }
  const Reference ref = LoadReference("tiny-gqa-untied");
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  CudaBackendOptions o = Options("tiny-gqa-untied", 8);
  o.device = 1;
  auto created = CudaBackend::Create(o);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<CudaBackend> backend = std::move(*created);
  int current = -1;
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, 0) << "Create left the caller's current device changed";
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, backend->model().dev().decode.h), cudaSuccess);
  EXPECT_EQ(attr.device, 1) << "the arena is not on device 1";
  ASSERT_EQ(cudaPointerGetAttributes(&attr, backend->slot_table().dev().slots), cudaSuccess);
  EXPECT_EQ(attr.device, 1) << "the slot table is not on device 1";

  std::vector<DriverRequest> reqs;
  for (const auto& p : ref.prompts) reqs.push_back(GreedyRequest(p, 32));
  std::vector<DriverResult> got;
  absl::Status logits_status;
  int thread_device = -1;
  std::thread engine([&] {
    if (cudaSetDevice(0) != cudaSuccess) return;
    got = RunTogether(*backend, reqs, kMaxContext);
    logits_status = backend->PromptLogits(ref.prompts[2]).status();
    backend.reset();
    (void)cudaGetDevice(&thread_device);
  });
  engine.join();
  ASSERT_EQ(got.size(), reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[i].tokens, ref.greedy[i]) << i;
  EXPECT_TRUE(logits_status.ok()) << logits_status;
  EXPECT_EQ(thread_device, 0) << "the backend left the engine thread on another device";
}

TEST(CudaBackendTest, RefusesAKvBudgetBelowOneSequence) {
  CudaBackendOptions o = Options("tiny-gqa-untied", 8);
  o.gpu_memory_fraction = 1e-6;  // ~140 KB of an H200: not even the activations fit
  auto b = CudaBackend::Create(o);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition) << b.status();
  EXPECT_NE(b.status().message().find("max_context"), std::string::npos) << b.status();
  EXPECT_NE(b.status().message().find("gpu_memory_fraction"), std::string::npos) << b.status();
}

TEST(CudaBackendTest, RejectsBadSlotInits) {
  auto backend = MakeCuda("tiny-gqa-untied");
  ASSERT_NE(backend, nullptr);
  const std::vector<int32_t> prompt = {1, 5, 9};
  const std::vector<int32_t> table = {0};
  SlotInit in{.slot = 0, .prompt = prompt, .block_table = table, .sampling = {}, .stop = {}};
  in.stop.max_new_tokens = 4;
  SlotInit bad = in;
  bad.slot = 8;
  EXPECT_EQ(backend->Prefill({&bad, 1}).code(), absl::StatusCode::kInvalidArgument);
  const std::vector<int32_t> bad_prompt = {1, 100000};
  bad = in;
  bad.prompt = bad_prompt;
  EXPECT_EQ(backend->Prefill({&bad, 1}).code(), absl::StatusCode::kInvalidArgument);
  const std::vector<int32_t> bad_table = {1 << 30};
  bad = in;
  bad.block_table = bad_table;
  EXPECT_EQ(backend->Prefill({&bad, 1}).code(), absl::StatusCode::kInvalidArgument);
  bad = in;
  bad.stop.max_new_tokens = kMaxContext;
  EXPECT_EQ(backend->Prefill({&bad, 1}).code(), absl::StatusCode::kInvalidArgument);
  // Nothing was published: the good init still works and the slot decodes.
  ASSERT_TRUE(backend->Prefill({&in, 1}).ok());
  EXPECT_EQ(backend->num_active(), 1);
}

}  // namespace
}  // namespace ts
