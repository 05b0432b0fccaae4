#include "models/cpu_model.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/checkpoint.h"
#include "models/thread_pool.h"
#include "nlohmann/json.hpp"
#include "tests/common/test_paths.h"

namespace ts {
namespace {

using ::testing::HasSubstr;

constexpr double kMaxRelError = 1e-4;
constexpr int32_t kBlockSize = 4;  // small so every sequence crosses several blocks
constexpr size_t kMaxPrompts = 8;

struct Reference {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::vector<int32_t>> greedy;
  std::vector<std::vector<float>> logits;  // [prompt][(prompt_len + n_greedy) * vocab]
};

Reference LoadReference(const std::filesystem::path& dir, int vocab) {
  Reference ref;
  std::ifstream in(dir / "reference.json");
  EXPECT_TRUE(in.good()) << dir;
  const nlohmann::json j = nlohmann::json::parse(in);
  ref.prompts = j.at("prompts").get<std::vector<std::vector<int32_t>>>();
  ref.greedy = j.at("greedy").get<std::vector<std::vector<int32_t>>>();
  auto ckpt = Checkpoint::OpenFile(dir / "reference_logits.safetensors");
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  if (!ckpt.ok()) return ref;
  for (size_t i = 0; i < ref.prompts.size(); ++i) {
    const std::string name = "logits_" + std::to_string(i);
    const TensorView* t = (*ckpt)->Find(name);
    EXPECT_NE(t, nullptr) << name;
    if (t == nullptr) return ref;
    const int64_t rows = static_cast<int64_t>(ref.prompts[i].size() + ref.greedy[i].size());
    EXPECT_THAT(t->shape, ::testing::ElementsAre(rows, vocab)) << name;
    std::vector<float> v(t->numel());
    ConvertToF32(*t, v.data());
    ref.logits.push_back(std::move(v));
  }
  return ref;
}

double RelError(std::span<const float> ours, std::span<const float> ref) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(ours[i]) - ref[i];
    diff += d * d;
    norm += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(diff) / std::sqrt(norm);  // NaN in ours makes this NaN, which fails `<`
}

int32_t Argmax(std::span<const float> row) {
  return static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
}

std::vector<float> Poisoned() {
  return std::vector<float>(7, std::numeric_limits<float>::quiet_NaN());
}

// Poisons the whole expected output, then runs Forward.
absl::Status RunPoisoned(CpuModel& m, std::span<const SeqChunk> chunks, CpuKvPool& kv,
                         LogitsMode mode, std::vector<float>* logits) {
  size_t rows = 0;
  for (const SeqChunk& c : chunks) rows += mode == LogitsMode::kAll ? c.tokens.size() : 1;
  logits->assign(rows * m.config().vocab_size, std::numeric_limits<float>::quiet_NaN());
  return m.Forward(chunks, kv, mode, logits);
}

int32_t BlocksFor(size_t tokens) {
  return static_cast<int32_t>((tokens + kBlockSize - 1) / kBlockSize);
}

// A non-contiguous, shuffled table of `n` distinct blocks out of [0, pool_blocks).
std::vector<int32_t> ShuffledTable(int32_t n, int32_t pool_blocks, uint32_t seed) {
  std::vector<int32_t> all(pool_blocks);
  std::iota(all.begin(), all.end(), 0);
  std::mt19937 rng(seed);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(n);
  return all;
}

class CpuModelFixtureTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = ::ts::testing::FixtureDir() / GetParam();
    // Every parallel region split over 3 threads (uneven on purpose), so the tiny fixtures exercise
    // the threaded GEMM, norm and attention paths.
    CpuModelOptions options;
    options.num_threads = 3;
    options.min_parallel_work = 1;
    auto model = CpuModel::Load(dir_, options);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
    vocab_ = model_->config().vocab_size;
    ref_ = LoadReference(dir_, vocab_);
    ASSERT_FALSE(ref_.prompts.empty());
    ASSERT_EQ(ref_.logits.size(), ref_.prompts.size());
  }
  std::vector<int32_t> Sequence(size_t i) const {
    std::vector<int32_t> s = ref_.prompts[i];
    s.insert(s.end(), ref_.greedy[i].begin(), ref_.greedy[i].end());
    return s;
  }

  std::filesystem::path dir_;
  std::unique_ptr<CpuModel> model_;
  int vocab_ = 0;
  Reference ref_;
};

TEST_P(CpuModelFixtureTest, TeacherForcedLogitsMatchTransformers) {
  for (size_t i = 0; i < ref_.prompts.size(); ++i) {
    const std::vector<int32_t> seq = Sequence(i);
    CpuKvPool kv(model_->config(), BlocksFor(seq.size()) + 3, kBlockSize);
    const std::vector<int32_t> table = ShuffledTable(BlocksFor(seq.size()), kv.num_blocks(), 1 + i);
    const SeqChunk chunk{.tokens = seq, .start_pos = 0, .block_table = table};
    std::vector<float> logits;
    ASSERT_TRUE(RunPoisoned(*model_, {&chunk, 1}, kv, LogitsMode::kAll, &logits).ok());
    ASSERT_EQ(logits.size(), ref_.logits[i].size());
    const double err = RelError(logits, ref_.logits[i]);
    EXPECT_LT(err, kMaxRelError) << GetParam() << " prompt " << i;
  }
}

TEST_P(CpuModelFixtureTest, IncrementalDecodeReproducesGreedy) {
  for (size_t i = 0; i < ref_.prompts.size(); ++i) {
    const std::vector<int32_t>& prompt = ref_.prompts[i];
    const std::vector<int32_t>& greedy = ref_.greedy[i];
    const size_t total = prompt.size() + greedy.size();
    CpuKvPool kv(model_->config(), BlocksFor(total) + 5, kBlockSize);
    const std::vector<int32_t> table = ShuffledTable(BlocksFor(total), kv.num_blocks(), 100 + i);
    std::vector<float> logits;
    const SeqChunk prefill{.tokens = prompt, .start_pos = 0, .block_table = table};
    ASSERT_TRUE(RunPoisoned(*model_, {&prefill, 1}, kv, LogitsMode::kLastPerChunk, &logits).ok());
    // Each step's row also has to agree with the teacher-forced reference row it predicts from.
    auto check_row = [&](size_t pos) {
      const std::span<const float> ref_row(&ref_.logits[i][pos * vocab_], vocab_);
      EXPECT_LT(RelError(logits, ref_row), kMaxRelError) << "prompt " << i << " position " << pos;
    };
    check_row(prompt.size() - 1);
    for (size_t j = 0; j < greedy.size(); ++j) {
      ASSERT_EQ(Argmax(logits), greedy[j]) << GetParam() << " prompt " << i << " step " << j;
      if (j + 1 == greedy.size()) break;
      const SeqChunk step{.tokens = {&greedy[j], 1},
                          .start_pos = static_cast<int32_t>(prompt.size() + j),
                          .block_table = table};
      ASSERT_TRUE(RunPoisoned(*model_, {&step, 1}, kv, LogitsMode::kLastPerChunk, &logits).ok());
      check_row(prompt.size() + j);
    }
  }
}

TEST_P(CpuModelFixtureTest, MixedBatchEqualsPerPromptRuns) {
  const size_t n = ref_.prompts.size();
  // Per prompt, alone: prefill (all rows), then one decode step.
  std::vector<float> alone_prefill[kMaxPrompts], alone_decode[kMaxPrompts];
  ASSERT_LE(n, kMaxPrompts);
  for (size_t i = 0; i < n; ++i) {
    const std::vector<int32_t>& prompt = ref_.prompts[i];
    CpuKvPool kv(model_->config(), BlocksFor(prompt.size() + 1), kBlockSize);
    std::vector<int32_t> table(kv.num_blocks());
    std::iota(table.begin(), table.end(), 0);
    const SeqChunk prefill{.tokens = prompt, .start_pos = 0, .block_table = table};
    ASSERT_TRUE(RunPoisoned(*model_, {&prefill, 1}, kv, LogitsMode::kAll, &alone_prefill[i]).ok());
    const SeqChunk step{.tokens = {&ref_.greedy[i][0], 1},
                        .start_pos = static_cast<int32_t>(prompt.size()),
                        .block_table = table};
    ASSERT_TRUE(
        RunPoisoned(*model_, {&step, 1}, kv, LogitsMode::kLastPerChunk, &alone_decode[i]).ok());
  }

  // Together, in one shared pool with interleaved shuffled tables; a single-thread model must
  // give the same bits as the split-everything one too.
  CpuModelOptions one_thread;
  one_thread.num_threads = 1;
  auto single = CpuModel::Load(dir_, one_thread);
  ASSERT_TRUE(single.ok()) << single.status();
  for (CpuModel* m : {model_.get(), single->get()}) {
    int32_t pool_blocks = 0;
    for (size_t i = 0; i < n; ++i) pool_blocks += BlocksFor(ref_.prompts[i].size() + 1);
    CpuKvPool kv(m->config(), pool_blocks, kBlockSize);
    const std::vector<int32_t> all = ShuffledTable(pool_blocks, pool_blocks, 7);
    std::vector<std::vector<int32_t>> tables(n);
    for (int32_t b = 0, i = 0; b < pool_blocks; ++b) {
      while (static_cast<int32_t>(tables[i].size()) >= BlocksFor(ref_.prompts[i].size() + 1)) {
        i = (i + 1) % static_cast<int32_t>(n);
      }
      tables[i].push_back(all[b]);
      i = (i + 1) % static_cast<int32_t>(n);
    }
    std::vector<SeqChunk> chunks;
    for (size_t i = 0; i < n; ++i) chunks.push_back({ref_.prompts[i], 0, tables[i]});
    std::vector<float> logits;
    ASSERT_TRUE(RunPoisoned(*m, chunks, kv, LogitsMode::kAll, &logits).ok());
    size_t row = 0;
    for (size_t i = 0; i < n; ++i) {
      const std::vector<float> got(logits.begin() + row * vocab_,
                                   logits.begin() + (row + ref_.prompts[i].size()) * vocab_);
      EXPECT_EQ(got, alone_prefill[i]) << "prefill of prompt " << i;
      row += ref_.prompts[i].size();
    }
    std::vector<SeqChunk> steps;
    for (size_t i = 0; i < n; ++i) {
      steps.push_back(
          {{&ref_.greedy[i][0], 1}, static_cast<int32_t>(ref_.prompts[i].size()), tables[i]});
    }
    // Reverse the order: a chunk's result must not depend on its place in the batch either.
    std::reverse(steps.begin(), steps.end());
    ASSERT_TRUE(RunPoisoned(*m, steps, kv, LogitsMode::kLastPerChunk, &logits).ok());
    for (size_t i = 0; i < n; ++i) {
      const size_t r = n - 1 - i;
      const std::vector<float> got(logits.begin() + r * vocab_, logits.begin() + (r + 1) * vocab_);
      EXPECT_EQ(got, alone_decode[i]) << "decode step of prompt " << i;
    }
  }
}

TEST_P(CpuModelFixtureTest, PrefillMixedWithDecodeMatchesReference) {
  ASSERT_GE(ref_.prompts.size(), 2u);
  const std::vector<int32_t>& a = ref_.prompts[0];
  const std::vector<int32_t>& b = ref_.prompts.back();
  const int32_t a_blocks = BlocksFor(a.size() + 1), b_blocks = BlocksFor(b.size());
  CpuKvPool kv(model_->config(), a_blocks + b_blocks, kBlockSize);
  const std::vector<int32_t> all = ShuffledTable(a_blocks + b_blocks, a_blocks + b_blocks, 3);
  const std::vector<int32_t> ta(all.begin(), all.begin() + a_blocks);
  const std::vector<int32_t> tb(all.begin() + a_blocks, all.end());
  std::vector<float> logits;
  const SeqChunk prefill_a{a, 0, ta};
  ASSERT_TRUE(RunPoisoned(*model_, {&prefill_a, 1}, kv, LogitsMode::kLastPerChunk, &logits).ok());
  // One batch: A's decode step and B's whole prompt.
  const std::vector<SeqChunk> mixed = {
      {{&ref_.greedy[0][0], 1}, static_cast<int32_t>(a.size()), ta}, {b, 0, tb}};
  ASSERT_TRUE(RunPoisoned(*model_, mixed, kv, LogitsMode::kAll, &logits).ok());
  const std::span<const float> a_row(&logits[0], vocab_);
  const std::span<const float> b_rows(&logits[vocab_], b.size() * vocab_);
  EXPECT_LT(RelError(a_row, {&ref_.logits[0][a.size() * vocab_], size_t(vocab_)}), kMaxRelError);
  EXPECT_LT(RelError(b_rows, {ref_.logits.back().data(), b.size() * vocab_}), kMaxRelError);
  // A's decode row predicts its second greedy token, B's last row its first.
  ASSERT_GT(ref_.greedy[0].size(), 1u);
  EXPECT_EQ(Argmax(a_row), ref_.greedy[0][1]);
  EXPECT_EQ(Argmax(b_rows.subspan((b.size() - 1) * vocab_, vocab_)), ref_.greedy.back()[0]);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CpuModelFixtureTest,
                         ::testing::Values("tiny-mha-tied", "tiny-gqa-untied", "tiny-llama3-rope",
                                           "tiny-oldstyle-sharded"),
                         [](const auto& info) {
                           std::string s = info.param;
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

class CpuModelValidationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto model = CpuModel::Load(::ts::testing::FixtureDir() / "tiny-gqa-untied");
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
  }
  absl::Status Forward(const SeqChunk& chunk, CpuKvPool& kv) {
    logits_ = Poisoned();
    return model_->Forward({&chunk, 1}, kv, LogitsMode::kLastPerChunk, &logits_);
  }
  void ExpectRejected(const SeqChunk& chunk, CpuKvPool& kv, const std::string& what) {
    const absl::Status s = Forward(chunk, kv);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(std::string(s.message()), HasSubstr(what));
    EXPECT_EQ(logits_.size(), Poisoned().size()) << "logits touched on error";
  }
  std::unique_ptr<CpuModel> model_;
  std::vector<float> logits_;
};

TEST_F(CpuModelValidationTest, RejectsBadChunks) {
  const ModelConfig& c = model_->config();
  CpuKvPool kv(c, 8, kBlockSize);
  const std::vector<int32_t> table = {3, 1, 0};
  const std::vector<int32_t> out_of_vocab = {1, c.vocab_size, 2};
  ExpectRejected({out_of_vocab, 0, table}, kv, "tokens[1]");
  const std::vector<int32_t> negative = {-1};
  ExpectRejected({negative, 0, table}, kv, "tokens[0]");
  const std::vector<int32_t> nine(9, 5);  // needs 3 blocks
  ExpectRejected({nine, 0, {table.data(), 2}}, kv, "block_table");
  ExpectRejected({nine, 4, table}, kv, "block_table");  // positions up to 12 need 4 blocks
  const std::vector<int32_t> bad_id = {3, 8, 0};
  ExpectRejected({nine, 0, bad_id}, kv, "block_table[1]");
  const std::vector<int32_t> repeated = {3, 1, 3};
  ExpectRejected({nine, 0, repeated}, kv, "repeats");
  ExpectRejected({{}, 0, table}, kv, "empty");
  ExpectRejected({nine, -1, table}, kv, "start_pos");
  std::vector<int32_t> big_table(c.max_position_embeddings / kBlockSize + 1);
  std::iota(big_table.begin(), big_table.end(), 0);
  CpuKvPool big(c, static_cast<int32_t>(big_table.size()), kBlockSize);
  const std::vector<int32_t> one = {5};
  ExpectRejected({one, c.max_position_embeddings, big_table}, big, "max_position_embeddings");
  // The last valid position is accepted.
  EXPECT_TRUE(Forward({one, c.max_position_embeddings - 1, big_table}, big).ok());
  EXPECT_EQ(logits_.size(), static_cast<size_t>(c.vocab_size));

  ModelConfig other = c;
  other.num_layers += 1;
  CpuKvPool wrong(other, 8, kBlockSize);
  ExpectRejected({one, 0, table}, wrong, "kv pool");
}

TEST_F(CpuModelValidationTest, ValidChunkAfterRejectionStillWorks) {
  CpuKvPool kv(model_->config(), 4, kBlockSize);
  const std::vector<int32_t> table = {2, 0};
  const std::vector<int32_t> bad = {1, -5};
  EXPECT_FALSE(Forward({bad, 0, table}, kv).ok());
  const std::vector<int32_t> good = {1, 5, 9};
  ASSERT_TRUE(Forward({good, 0, table}, kv).ok());
  for (float v : logits_) ASSERT_TRUE(std::isfinite(v));
}

TEST(ThreadPoolTest, EveryIndexRunsExactlyOnceOnGrainBoundaries) {
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads, /*min_work=*/1);
    for (int64_t n : {1, 3, 4, 17, 64, 1001}) {
      for (int64_t grain : {1, 4, 7}) {
        std::vector<int> hits(n, 0);
        std::vector<std::pair<int64_t, int64_t>> ranges(threads + 1, {-1, -1});
        std::atomic<int> calls{0};
        pool.ParallelFor(n, grain, [&](int64_t b, int64_t e) {
          ranges[calls.fetch_add(1)] = {b, e};
          for (int64_t i = b; i < e; ++i) ++hits[i];
        });
        EXPECT_LE(calls.load(), threads);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i], 1) << threads << " " << n << " " << i;
        for (int c = 0; c < calls.load(); ++c) {
          EXPECT_EQ(ranges[c].first % grain, 0) << "range start off the grain";
          EXPECT_TRUE(ranges[c].second % grain == 0 || ranges[c].second == n);
        }
      }
    }
  }
}

TEST(ThreadPoolTest, GrainKeepsSmallJobsInline) {
  ThreadPool pool(2);
  EXPECT_EQ(pool.Grain(ThreadPool::kDefaultMinWork), 1);
  EXPECT_EQ(pool.Grain(64, 4), ThreadPool::kDefaultMinWork / 64);
  EXPECT_EQ(pool.Grain(ThreadPool::kDefaultMinWork / 3, 4), 4);
  ThreadPool eager(2, 1);
  EXPECT_EQ(eager.Grain(1000), 1);
}

TEST(CpuModelLoadTest, MissingDirectoryIsAnError) {
  auto model = CpuModel::Load(::ts::testing::FixtureDir() / "no-such-model");
  EXPECT_FALSE(model.ok());
}

}  // namespace
}  // namespace ts
