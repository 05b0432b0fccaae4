// GraphCache on the GPU: build and host launch per bucket, regime updates that take effect
// without re-instantiation, device-side tail launch through the device table, and the refusals
// (topology change, allocation or synchronisation during capture).
#include "graphs/graph_cache.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "graphs/tail_launch.cuh"
#include "tests/graphs/test_kernels.cuh"

#define TS_ASSERT_CUDA_OK(expr)                                                  \
  do {                                                                           \
    const cudaError_t ts_e_ = (expr);                                            \
    ASSERT_EQ(ts_e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(ts_e_); \
  } while (0)

#define TS_ASSERT_OK(expr)                                        \
  do {                                                            \
    const ::absl::Status ts_s_ = (expr);                          \
    ASSERT_TRUE(ts_s_.ok()) << #expr << ": " << ts_s_.ToString(); \
  } while (0)

namespace ts::graphs {
namespace {

using testing::EnqueueTestStep;
using testing::ExpectedTestValue;
using testing::TestStepNodes;
using testing::TestStepParams;

constexpr int32_t kWidthPerRow = 8;            // each bucket writes bucket * 8 floats
constexpr uint32_t kPoisonBits = 0x7FC0DEADu;  // a NaN no kernel writes

bool IsPoison(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u == kPoisonBits;
}

class GraphCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    offsets_.clear();
    int32_t total = 0;
    for (int32_t b : buckets_) {
      offsets_.push_back(total);
      total += b * kWidthPerRow;
    }
    total_width_ = total;
    ASSERT_EQ(cudaMalloc(&out_, sizeof(float) * total_width_), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&counters_, sizeof(int32_t) * buckets_.size()), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&scalars_, sizeof(int32_t) * 3), cudaSuccess);
  }
  void TearDown() override {
    cache_.reset();  // before the buffers its graphs point at
    if (out_ != nullptr) cudaFree(out_);
    if (counters_ != nullptr) cudaFree(counters_);
    if (scalars_ != nullptr) cudaFree(scalars_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }

  GraphCacheOptions Options(bool combine_only_when_split = false) {
    GraphCacheOptions opt;
    opt.buckets = buckets_;
    opt.capture = [this, combine_only_when_split](const CaptureContext& ctx,
                                                  cudaStream_t s) -> absl::Status {
      ++captures_;
      TestStepParams p;
      p.out = out_ + offsets_[ctx.bucket_index];
      p.counter = counters_ + ctx.bucket_index;
      p.width = ctx.bucket * kWidthPerRow;
      p.bucket = ctx.bucket;
      p.splits = ctx.regime.attention_num_splits;
      p.max_context_len = ctx.regime.max_context_len;
      p.combine_only_when_split = combine_only_when_split;
      const cudaError_t e = EnqueueTestStep(p, s);
      if (e != cudaSuccess) return absl::InternalError(cudaGetErrorString(e));
      return absl::OkStatus();
    };
    return opt;
  }

  void Poison() {
    std::vector<float> host(total_width_);
    float poison;
    std::memcpy(&poison, &kPoisonBits, sizeof(poison));
    for (float& f : host) f = poison;
    ASSERT_EQ(cudaMemcpyAsync(out_, host.data(), sizeof(float) * total_width_,
                              cudaMemcpyHostToDevice, stream_),
              cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(counters_, 0, sizeof(int32_t) * buckets_.size(), stream_),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  }

  // Expects bucket `k` written for `r` (`steps` times) and every other bucket untouched.
  void ExpectOnlyBucket(int32_t k, const Regime& r, int32_t steps = 1) {
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    std::vector<float> host(total_width_);
    std::vector<int32_t> counts(buckets_.size());
    ASSERT_EQ(cudaMemcpy(host.data(), out_, sizeof(float) * total_width_, cudaMemcpyDeviceToHost),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(counts.data(), counters_, sizeof(int32_t) * counts.size(),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (int32_t b = 0; b < static_cast<int32_t>(buckets_.size()); ++b) {
      const int32_t width = buckets_[b] * kWidthPerRow;
      EXPECT_EQ(counts[b], b == k ? steps : 0) << "bucket index " << b;
      for (int32_t i = 0; i < width; ++i) {
        const float got = host[offsets_[b] + i];
        if (b == k) {
          ASSERT_EQ(got,
                    ExpectedTestValue(buckets_[b], r.attention_num_splits, r.max_context_len, i))
              << "bucket " << buckets_[b] << " element " << i << " " << RegimeDebugString(r);
        } else {
          ASSERT_TRUE(IsPoison(got)) << "bucket " << buckets_[b] << " element " << i
                                     << " was written by a launch of bucket index " << k;
        }
      }
    }
  }

  // The device table holds exactly the host's current execs.
  void ExpectDeviceTableMatches() {
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    std::vector<cudaGraphExec_t> table(cache_->num_buckets());
    ASSERT_EQ(cudaMemcpy(table.data(), cache_->device_table(),
                         sizeof(cudaGraphExec_t) * table.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (int32_t b = 0; b < cache_->num_buckets(); ++b) {
      EXPECT_EQ(table[b], cache_->current_exec(b)) << "bucket index " << b;
      EXPECT_NE(table[b], nullptr);
    }
  }

  std::vector<int32_t> buckets_ = {1, 4, 16};
  std::vector<int32_t> offsets_;
  int32_t total_width_ = 0;
  cudaStream_t stream_ = nullptr;
  float* out_ = nullptr;         // [sum(buckets) * kWidthPerRow], bucket b at offsets_[b]
  int32_t* counters_ = nullptr;  // [num_buckets], steps run per bucket
  int32_t* scalars_ = nullptr;   // [3]: bucket_index, remaining_steps, status for TailLauncher
  int64_t captures_ = 0;
  std::unique_ptr<GraphCache> cache_;
};

TEST_F(GraphCacheTest, BuildsAndLaunchesEveryBucket) {
  cache_ = std::make_unique<GraphCache>(Options());
  TS_ASSERT_OK(cache_->Build(stream_));
  EXPECT_EQ(cache_->instantiation_count(), 2 * 3);
  EXPECT_EQ(captures_, 3);
  EXPECT_EQ(cache_->build_stats().total_nodes, 3 * TestStepNodes({}));
  for (int32_t k = 0; k < 3; ++k) {
    EXPECT_EQ(cache_->node_count(k), TestStepNodes({}));
    EXPECT_EQ(cache_->current_slot(k), 0);
    EXPECT_NE(cache_->exec(k, 0), cache_->exec(k, 1)) << "two distinct execs per bucket";
  }
  ExpectDeviceTableMatches();
  for (int32_t k = 0; k < 3; ++k) {
    Poison();
    TS_ASSERT_OK(cache_->Launch(k, stream_));
    ExpectOnlyBucket(k, Regime{});
  }
  EXPECT_EQ(cache_->Launch(3, stream_).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*cache_->BucketIndexFor(3), 1);
  EXPECT_EQ(*cache_->BucketIndexFor(16), 2);
  EXPECT_EQ(cache_->BucketIndexFor(17).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(cache_->Build(stream_).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(GraphCacheTest, UpdateRegimeTakesEffectOnTheNextLaunchWithoutReinstantiation) {
  cache_ = std::make_unique<GraphCache>(Options());
  TS_ASSERT_OK(cache_->Build(stream_));
  const int64_t instantiations = cache_->instantiation_count();
  std::vector<cudaGraphExec_t> before;
  for (int32_t k = 0; k < 3; ++k) before.push_back(cache_->current_exec(k));

  const Regime r1{.attention_num_splits = 4, .max_context_len = 512};
  const Regime r2{.attention_num_splits = 2, .max_context_len = 8192};
  Poison();
  TS_ASSERT_OK(cache_->Launch(2, stream_));
  TS_ASSERT_OK(cache_->UpdateRegime(r1, stream_));
  std::printf(
      "UpdateRegime, 3 buckets x %d nodes: total %.1f us (wait %.1f, capture %.1f, "
      "exec update %.1f, upload %.1f, flip %.1f)\n",
      TestStepNodes({}), cache_->last_update().total_us, cache_->last_update().wait_us,
      cache_->last_update().capture_us, cache_->last_update().exec_update_us,
      cache_->last_update().upload_us, cache_->last_update().flip_us);
  // The launch before the update ran with the old regime; the next one runs with the new one.
  ExpectOnlyBucket(2, Regime{});
  EXPECT_EQ(cache_->regime(), r1);
  EXPECT_EQ(cache_->update_count(), 1);
  EXPECT_EQ(cache_->instantiation_count(), instantiations) << "an update re-instantiated";
  for (int32_t k = 0; k < 3; ++k) {
    EXPECT_EQ(cache_->current_slot(k), 1);
    EXPECT_NE(cache_->current_exec(k), before[k]);
    EXPECT_EQ(cache_->exec(k, 0), before[k]) << "execs are updated in place, never replaced";
  }
  ExpectDeviceTableMatches();
  for (int32_t k = 0; k < 3; ++k) {
    Poison();
    TS_ASSERT_OK(cache_->Launch(k, stream_));
    ExpectOnlyBucket(k, r1);
  }

  // The second update goes into the exec that served Build's regime: it flips back to slot 0.
  TS_ASSERT_OK(cache_->UpdateRegime(r2, stream_));
  std::printf("UpdateRegime again: total %.1f us (exec update %.1f)\n",
              cache_->last_update().total_us, cache_->last_update().exec_update_us);
  EXPECT_EQ(cache_->instantiation_count(), instantiations);
  EXPECT_EQ(cache_->update_count(), 2);
  for (int32_t k = 0; k < 3; ++k) {
    EXPECT_EQ(cache_->current_slot(k), 0);
    EXPECT_EQ(cache_->current_exec(k), before[k]);
  }
  ExpectDeviceTableMatches();
  for (int32_t k = 0; k < 3; ++k) {
    Poison();
    TS_ASSERT_OK(cache_->Launch(k, stream_));
    ExpectOnlyBucket(k, r2);
  }
  EXPECT_EQ(cache_->UpdateRegime(Regime{.attention_num_splits = 0}, stream_).code(),
            absl::StatusCode::kInvalidArgument);
}

// PrepareRegimeStep prepares one bucket per call: the current execs serve the old regime all the
// while, nothing counts as prepared until the last bucket, a switch to another regime part-way
// starts over, and the update afterwards only flips.
TEST_F(GraphCacheTest, StepwisePreparationTakesOneBucketPerCallAndRestartsForAnotherRegime) {
  cache_ = std::make_unique<GraphCache>(Options());
  TS_ASSERT_OK(cache_->Build(stream_));
  const int32_t n = cache_->num_buckets();
  ASSERT_GE(n, 2);
  const Regime r1{.attention_num_splits = 4, .max_context_len = 512};
  const Regime r2{.attention_num_splits = 2, .max_context_len = 8192};

  auto step = [&](const Regime& r) {
    absl::StatusOr<bool> done = cache_->PrepareRegimeStep(r);
    EXPECT_TRUE(done.ok()) << done.status();
    return done.ok() && *done;
  };
  EXPECT_FALSE(step(r1));  // bucket 0 of r1
  EXPECT_FALSE(cache_->prepared().has_value());
  // Another regime part-way: r2 needs every bucket again.
  for (int32_t i = 0; i + 1 < n; ++i) {
    EXPECT_FALSE(step(r2)) << "bucket " << i;
    EXPECT_FALSE(cache_->prepared().has_value());
    for (int32_t k = 0; k < n; ++k) {
      Poison();
      TS_ASSERT_OK(cache_->Launch(k, stream_));
      ExpectOnlyBucket(k, Regime{});  // still Build's regime
    }
  }
  EXPECT_TRUE(step(r2));
  ASSERT_TRUE(cache_->prepared().has_value());
  EXPECT_EQ(*cache_->prepared(), r2);
  EXPECT_TRUE(step(r2));  // a no-op once prepared
  EXPECT_EQ(cache_->update_count(), 0);

  TS_ASSERT_OK(cache_->UpdateRegime(r2, stream_));
  EXPECT_TRUE(cache_->last_update().prepared);
  EXPECT_EQ(cache_->last_update().capture_us, 0);
  EXPECT_EQ(cache_->regime(), r2);
  ExpectDeviceTableMatches();
  for (int32_t k = 0; k < n; ++k) {
    Poison();
    TS_ASSERT_OK(cache_->Launch(k, stream_));
    ExpectOnlyBucket(k, r2);
  }

  // Part-way, then an update to that very regime: the whole update, and the partial work is
  // discarded (the next step starts from bucket 0).
  EXPECT_FALSE(step(r1));
  TS_ASSERT_OK(cache_->UpdateRegime(r1, stream_));
  EXPECT_FALSE(cache_->last_update().prepared);
  EXPECT_EQ(cache_->regime(), r1);
  for (int32_t k = 0; k < n; ++k) {
    Poison();
    TS_ASSERT_OK(cache_->Launch(k, stream_));
    ExpectOnlyBucket(k, r1);
  }
  EXPECT_FALSE(step(r2));
  EXPECT_FALSE(cache_->prepared().has_value());
  EXPECT_EQ(cache_->PrepareRegimeStep(Regime{.attention_num_splits = 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// PrepareRegime does everything but the flip while the current execs keep serving; the update
// to the same regime then only flips (no capture), and an update to another regime discards what
// was prepared and does the whole update.
TEST_F(GraphCacheTest, PreparedRegimeLeavesTheCurrentExecsServingAndTheUpdateOnlyFlips) {
  cache_ = std::make_unique<GraphCache>(Options());
  TS_ASSERT_OK(cache_->Build(stream_));
  const int64_t instantiations = cache_->instantiation_count();
  const Regime r1{.attention_num_splits = 4, .max_context_len = 512};
  const Regime r2{.attention_num_splits = 2, .max_context_len = 8192};
  const Regime r3{.attention_num_splits = 3, .max_context_len = 2048};

  TS_ASSERT_OK(cache_->PrepareRegime(r1));
  ASSERT_TRUE(cache_->prepared().has_value());
  EXPECT_EQ(*cache_->prepared(), r1);
  EXPECT_EQ(cache_->regime(), Regime{});
  EXPECT_EQ(cache_->update_count(), 0);
  for (int32_t k = 0; k < 3; ++k) {
    EXPECT_EQ(cache_->current_slot(k), 0);
    Poison();
    TS_ASSERT_OK(cache_->Launch(k, stream_));
    ExpectOnlyBucket(k, Regime{});  // still Build's regime
  }
  ExpectDeviceTableMatches();

  TS_ASSERT_OK(cache_->UpdateRegime(r1, stream_));
  EXPECT_TRUE(cache_->last_update().prepared);
  EXPECT_EQ(cache_->last_update().capture_us, 0);
  EXPECT_FALSE(cache_->prepared().has_value());
  EXPECT_EQ(cache_->regime(), r1);
  EXPECT_EQ(cache_->instantiation_count(), instantiations);
  ExpectDeviceTableMatches();
  for (int32_t k = 0; k < 3; ++k) {
    EXPECT_EQ(cache_->current_slot(k), 1);
    Poison();
    TS_ASSERT_OK(cache_->Launch(k, stream_));
    ExpectOnlyBucket(k, r1);
  }

  // Prepared, then not the regime asked for: the whole update, into the same idle execs.
  TS_ASSERT_OK(cache_->PrepareRegime(r2));
  TS_ASSERT_OK(cache_->UpdateRegime(r3, stream_));
  EXPECT_FALSE(cache_->last_update().prepared);
  EXPECT_GT(cache_->last_update().capture_us, 0);
  EXPECT_FALSE(cache_->prepared().has_value());
  EXPECT_EQ(cache_->regime(), r3);
  for (int32_t k = 0; k < 3; ++k) {
    EXPECT_EQ(cache_->current_slot(k), 0);
    Poison();
    TS_ASSERT_OK(cache_->Launch(k, stream_));
    ExpectOnlyBucket(k, r3);
  }
  EXPECT_EQ(cache_->instantiation_count(), instantiations) << "an update re-instantiated";
  EXPECT_EQ(cache_->PrepareRegime(Regime{.attention_num_splits = 0}).code(),
            absl::StatusCode::kInvalidArgument);
}

// A running device loop switches regime by itself: PreparedTable hands it the prepared execs
// (fixed per-slot tables), and AdoptDeviceFlip then records the switch as UpdateRegime would have,
// with no capture and no re-instantiation, after which the next regime is prepared into the old
// execs and offered from the other table.
TEST_F(GraphCacheTest, PreparedTableHoldsThePreparedExecsAndAdoptionMakesThemCurrent) {
  cache_ = std::make_unique<GraphCache>(Options());
  TS_ASSERT_OK(cache_->Build(stream_));
  const int64_t instantiations = cache_->instantiation_count();
  EXPECT_EQ(cache_->PreparedTable(stream_).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache_->AdoptDeviceFlip().code(), absl::StatusCode::kFailedPrecondition);
  auto read = [&](const cudaGraphExec_t* table) {
    std::vector<cudaGraphExec_t> host(cache_->num_buckets());
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(host.data(), table, sizeof(cudaGraphExec_t) * host.size(),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  };
  const cudaGraphExec_t* tables[2] = {nullptr, nullptr};
  const Regime regimes[2] = {{.attention_num_splits = 4, .max_context_len = 256},
                             {.attention_num_splits = 2, .max_context_len = 512}};
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round);
    const Regime& r = regimes[round];
    TS_ASSERT_OK(cache_->PrepareRegime(r));
    absl::StatusOr<const cudaGraphExec_t*> table = cache_->PreparedTable(stream_);
    TS_ASSERT_OK(table.status());
    tables[round] = *table;
    const std::vector<cudaGraphExec_t> prepared = read(*table);
    for (int32_t b = 0; b < cache_->num_buckets(); ++b) {
      EXPECT_EQ(prepared[b], cache_->exec(b, cache_->current_slot(b) ^ 1)) << "bucket " << b;
    }
    // What the loop would have launched from it runs the prepared regime.
    for (int32_t k = 0; k < 3; ++k) {
      Poison();
      ASSERT_EQ(cudaGraphLaunch(prepared[k], stream_), cudaSuccess);
      ExpectOnlyBucket(k, r);
    }
    TS_ASSERT_OK(cache_->AdoptDeviceFlip());
    EXPECT_EQ(cache_->regime(), r);
    EXPECT_FALSE(cache_->prepared().has_value());
    ExpectDeviceTableMatches();
    EXPECT_EQ(read(cache_->device_table()), prepared);
    for (int32_t k = 0; k < 3; ++k) {
      EXPECT_EQ(cache_->current_slot(k), (round + 1) % 2);
      Poison();
      TS_ASSERT_OK(cache_->Launch(k, stream_));
      ExpectOnlyBucket(k, r);
    }
  }
  EXPECT_NE(tables[0], tables[1]);
  EXPECT_EQ(cache_->instantiation_count(), instantiations) << "a device flip re-instantiated";
}

TEST_F(GraphCacheTest, DeviceTailLaunchRunsTheCurrentExecFromTheTable) {
  cache_ = std::make_unique<GraphCache>(Options());
  TS_ASSERT_OK(cache_->Build(stream_));
  int32_t* bucket_index = scalars_;
  int32_t* remaining = scalars_ + 1;
  int32_t* status = scalars_ + 2;
  TailLaunchParams once{.table = cache_->device_table(),
                        .num_buckets = cache_->num_buckets(),
                        .bucket_index = bucket_index,
                        .remaining_steps = nullptr,
                        .status = status};
  auto launcher = TailLauncher::Create(once, stream_);
  TS_ASSERT_OK(launcher.status());
  TailLaunchParams loop = once;
  loop.remaining_steps = remaining;
  auto looper = TailLauncher::Create(loop, stream_);
  TS_ASSERT_OK(looper.status());

  auto set_scalars = [&](int32_t b, int32_t steps) {
    const int32_t host[3] = {b, steps, 0};
    ASSERT_EQ(cudaMemcpyAsync(scalars_, host, sizeof(host), cudaMemcpyHostToDevice, stream_),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);  // `host` dies with this scope
  };
  auto read_scalars = [&](int32_t* host) {
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(host, scalars_, sizeof(int32_t) * 3, cudaMemcpyDeviceToHost), cudaSuccess);
  };

  Regime regime;
  for (int pass = 0; pass < 2; ++pass) {
    for (int32_t k = 0; k < 3; ++k) {
      Poison();
      set_scalars(k, 0);
      TS_ASSERT_OK((*launcher)->Launch(stream_));
      int32_t s[3];
      read_scalars(s);
      ASSERT_EQ(s[2], 0) << "device-side cudaGraphLaunch failed: "
                         << cudaGetErrorString(static_cast<cudaError_t>(s[2]));
      ExpectOnlyBucket(k, regime);
    }
    // Second pass: the device reads the flipped table and launches the updated execs.
    regime = Regime{.attention_num_splits = 3, .max_context_len = 100};
    TS_ASSERT_OK(cache_->UpdateRegime(regime, stream_));
  }

  // Loop mode: the scheduler graph tail-launches the step, then itself, 5 times.
  constexpr int32_t kSteps = 5;
  Poison();
  set_scalars(1, kSteps);
  TS_ASSERT_OK((*looper)->Launch(stream_));
  int32_t s[3];
  read_scalars(s);
  EXPECT_EQ(s[1], 0) << "remaining steps";
  ASSERT_EQ(s[2], 0) << cudaGetErrorString(static_cast<cudaError_t>(s[2]));
  ExpectOnlyBucket(1, regime, kSteps);

  // An out-of-range bucket is reported, and nothing runs.
  Poison();
  set_scalars(7, 0);
  TS_ASSERT_OK((*launcher)->Launch(stream_));
  read_scalars(s);
  EXPECT_EQ(s[2], kTailLaunchBadBucket);
  ExpectOnlyBucket(-1, regime);

  EXPECT_EQ(TailLauncher::Create(TailLaunchParams{}, stream_).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(GraphCacheTest, TopologyChangeIsAnErrorNotARebuild) {
  cache_ = std::make_unique<GraphCache>(Options(/*combine_only_when_split=*/true));
  TS_ASSERT_OK(cache_->Build(stream_));
  const int64_t instantiations = cache_->instantiation_count();
  const absl::Status s =
      cache_->UpdateRegime(Regime{.attention_num_splits = 2, .max_context_len = 0}, stream_);
  ASSERT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(std::string(s.message()).find("topology"), std::string::npos) << s;
  std::printf("refused update: %s\n", std::string(s.message()).c_str());
  EXPECT_EQ(cache_->instantiation_count(), instantiations);
  EXPECT_EQ(cache_->update_count(), 0);
  EXPECT_EQ(cache_->regime(), Regime{});
  for (int32_t k = 0; k < 3; ++k) EXPECT_EQ(cache_->current_slot(k), 0);
  ExpectDeviceTableMatches();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "a refused update leaked a CUDA error";

  // The cache keeps serving the old regime, and a topology-preserving update still works.
  Poison();
  TS_ASSERT_OK(cache_->Launch(0, stream_));
  ExpectOnlyBucket(0, Regime{});
  const Regime same_shape{.attention_num_splits = 1, .max_context_len = 64};
  TS_ASSERT_OK(cache_->UpdateRegime(same_shape, stream_));
  Poison();
  TS_ASSERT_OK(cache_->Launch(2, stream_));
  ExpectOnlyBucket(2, same_shape);
}

// The capture contract is enforced, not trusted: allocation, synchronisation, a failing callback
// and an empty capture each fail Build with a status naming the bucket.
TEST_F(GraphCacheTest, CaptureContractViolationsFailBuild) {
  struct Case {
    const char* name;
    CaptureFn fn;
    absl::StatusCode code;
    const char* needle;
  };
  void* leaked = nullptr;
  const std::vector<Case> cases = {
      {"cudaMallocAsync in capture",
       [&](const CaptureContext&, cudaStream_t s) -> absl::Status {
         if (cudaMallocAsync(&leaked, 256, s) != cudaSuccess) return absl::InternalError("alloc");
         return absl::OkStatus();
       },
       absl::StatusCode::kInvalidArgument, "memory allocation"},
      {"stream sync in capture",
       [&](const CaptureContext&, cudaStream_t s) -> absl::Status {
         (void)cudaStreamSynchronize(s);  // illegal while capturing: invalidates the capture
         return absl::OkStatus();
       },
       absl::StatusCode::kFailedPrecondition, "invalidated"},
      {"callback error",
       [](const CaptureContext&, cudaStream_t) -> absl::Status {
         return absl::NotFoundError("no weights for layer 3");
       },
       absl::StatusCode::kNotFound, "no weights for layer 3"},
      {"empty capture",
       [](const CaptureContext&, cudaStream_t) -> absl::Status { return absl::OkStatus(); },
       absl::StatusCode::kInvalidArgument, "no work"},
  };
  for (const Case& c : cases) {
    GraphCacheOptions opt;
    opt.buckets = {2, 8};
    opt.capture = c.fn;
    GraphCache cache(std::move(opt));
    const absl::Status s = cache.Build(stream_);
    EXPECT_EQ(s.code(), c.code) << c.name << ": " << s;
    EXPECT_NE(std::string(s.message()).find(c.needle), std::string::npos) << c.name << ": " << s;
    EXPECT_NE(std::string(s.message()).find("graph bucket 2"), std::string::npos) << s;
    EXPECT_FALSE(cache.built());
    EXPECT_EQ(cache.Launch(0, stream_).code(), absl::StatusCode::kFailedPrecondition);
    (void)cudaGetLastError();  // the refused calls above set it; the cache already cleared its own
  }
  // Every capture was ended: this thread captures and launches normally after the refusals.
  cache_ = std::make_unique<GraphCache>(Options());
  TS_ASSERT_OK(cache_->Build(stream_));
  Poison();
  TS_ASSERT_OK(cache_->Launch(1, stream_));
  ExpectOnlyBucket(1, Regime{});
}

}  // namespace
}  // namespace ts::graphs
