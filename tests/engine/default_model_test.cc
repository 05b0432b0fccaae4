// The shipped default model on the CPU backend against transformers in fp32 (issue #14): its
// tokenizer gives transformers' prompt ids, its greedy continuations equal transformers' token for
// token, and a teacher-forced pass agrees on the top-1 at >= 99% of the positions.
#include <vector>

#include "engine/cpu_backend.h"
#include "models/cpu_model.h"
#include "models/tokenizer/tokenizer.h"
#include "tests/engine/cuda_test_driver.h"
#include "tests/engine/default_model_reference.h"

namespace ts::testing {
namespace {

constexpr int32_t kMaxContext = 256;

TEST(DefaultModelCpuTest, TokenizerGivesTransformersPromptIds) {
  absl::StatusOr<Tokenizer> tok = Tokenizer::Load(DefaultModelDir());
  ASSERT_TRUE(tok.ok()) << tok.status();
  for (const DefaultCase& c : LoadDefaultReference("fp32")) {
    absl::StatusOr<std::vector<int32_t>> ids = tok->Encode(c.prompt, true);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(*ids, c.prompt_ids) << c.prompt;
    EXPECT_EQ(tok->Decode(c.greedy), c.greedy_text) << c.prompt;
  }
}

TEST(DefaultModelCpuTest, GreedyEqualsTransformersFp32) {
  const std::vector<DefaultCase> cases = LoadDefaultReference("fp32");
  ASSERT_FALSE(cases.empty());
  auto model = CpuModel::Load(DefaultModelDir(), {.num_threads = 2});
  ASSERT_TRUE(model.ok()) << model.status();
  CpuBackendOptions o;
  o.model_dir = DefaultModelDir();
  o.max_slots = 4;
  o.buckets = {1, 2, 4};
  o.num_threads = 2;
  o.num_kv_blocks = 4 * kMaxContext / 16;
  auto backend = CpuBackend::Create(std::move(*model), o);
  ASSERT_TRUE(backend.ok()) << backend.status();
  ExpectGreedyEqualsReference(**backend, cases, kMaxContext);
}

TEST(DefaultModelCpuTest, TeacherForcedTop1AgreesWithTransformersFp32) {
  const std::vector<DefaultCase> cases = LoadDefaultReference("fp32");
  ASSERT_FALSE(cases.empty());
  auto model = CpuModel::Load(DefaultModelDir(), {.num_threads = 2});
  ASSERT_TRUE(model.ok()) << model.status();
  const int32_t vocab = (*model)->config().vocab_size;
  int32_t agree = 0, total = 0;
  std::string misses;
  for (const DefaultCase& c : cases) {
    // The positions predicting generated tokens 0..n-1: the last prompt token onwards.
    const std::vector<int32_t> seq = TeacherForcedInput(c);
    CpuKvPool kv((*model)->config(), (kMaxContext + 15) / 16, 16);
    std::vector<int32_t> table((seq.size() + 15) / 16);
    for (size_t b = 0; b < table.size(); ++b) table[b] = static_cast<int32_t>(b);
    const SeqChunk chunk{.tokens = seq, .start_pos = 0, .block_table = table};
    std::vector<float> logits;
    ASSERT_TRUE((*model)->Forward({&chunk, 1}, kv, LogitsMode::kAll, &logits).ok());
    const size_t skip = (c.prompt_ids.size() - 1) * vocab;
    std::vector<float> generated(logits.begin() + skip, logits.end());
    agree += Top1Agreement(generated, vocab, c, &misses);
    total += static_cast<int32_t>(c.forced_top1.size());
  }
  EXPECT_EQ(total, 256);
  EXPECT_GE(agree, 0.99 * total) << agree << " of " << total << misses;
}

}  // namespace
}  // namespace ts::testing
