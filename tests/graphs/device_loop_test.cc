// The device loop's scheduler kernel (graphs/device_loop.cuh) over stand-in bucket graphs that
// log the row list they get and count each slot's steps down: every step decodes exactly the
// ACTIVE slots in ascending order in the smallest bucket that holds them, padded with -1;
// READY slots join at the next boundary and PREFILL ones never; the loop exits on its own when
// none is left, stops at a boundary when paused, and resumes on a relaunch.
#include "graphs/device_loop.cuh"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <thread>
#include <vector>

#include "graphs/graph_cache.h"
#include "tests/common/eventually.h"
#include "tests/graphs/loop_test_kernels.cuh"
#include "tests/kernels/kernel_test_util.h"

namespace ts::graphs {
namespace {

namespace k = ::ts::kernels;
using testing::SimStepParams;
using ::ts::testing::Eventually;

constexpr int32_t kSlots = 40;
constexpr int32_t kMaxSteps = 4096;
const std::vector<int32_t> kBuckets = {1, 2, 4, 8, 16, 24, 48};

class DeviceLoopTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TS_ASSERT_CUDA_OK(cudaSetDevice(0));
    TS_ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    TS_ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&control_, cudaStreamNonBlocking));
    TS_ASSERT_CUDA_OK(cudaMalloc(&slots_, kSlots * sizeof(k::SlotRow)));
    TS_ASSERT_CUDA_OK(cudaMalloc(&remaining_, kSlots * sizeof(int32_t)));
    TS_ASSERT_CUDA_OK(cudaMalloc(&rows_, kBuckets.back() * sizeof(int32_t)));
    TS_ASSERT_CUDA_OK(cudaMalloc(&log_, kMaxSteps * (1 + kBuckets.back()) * sizeof(int32_t)));
    TS_ASSERT_CUDA_OK(cudaMalloc(&log_count_, sizeof(int32_t)));
    TS_ASSERT_CUDA_OK(cudaMemset(rows_, 0x7F, kBuckets.back() * sizeof(int32_t)));  // poison
    // The loop first: every stand-in step graph ends with its scheduler node.
    DeviceLoopParams p;
    p.num_buckets = static_cast<int32_t>(kBuckets.size());
    std::copy(kBuckets.begin(), kBuckets.end(), p.buckets);
    p.slots = slots_;
    p.num_slots = kSlots;
    p.row_slots = rows_;
    auto loop = DeviceLoop::Create(p, stream_);
    TS_ASSERT_OK(loop.status());
    loop_ = std::move(*loop);
    EXPECT_FALSE(loop_->Launch(stream_).ok());  // no table bound yet
    GraphCacheOptions o;
    o.buckets = kBuckets;
    o.log_progress = false;
    o.capture = [this](const CaptureContext& ctx, cudaStream_t s) -> absl::Status {
      SimStepParams p{.row_slots = rows_,
                      .slots = slots_,
                      .remaining = remaining_,
                      .log = log_,
                      .log_count = log_count_,
                      .bucket = ctx.bucket,
                      .max_bucket = kBuckets.back(),
                      .max_steps = kMaxSteps};
      const cudaError_t e = testing::EnqueueSimStep(p, s);
      if (e != cudaSuccess) return absl::InternalError(cudaGetErrorString(e));
      return loop_->EnqueueScheduler(s);
    };
    cache_ = std::make_unique<GraphCache>(std::move(o));
    TS_ASSERT_OK(cache_->Build(stream_));
    TS_ASSERT_OK(loop_->BindTable(cache_->device_table()));
  }
  void TearDown() override {
    if (loop_ != nullptr) (void)loop_->Wait();
    loop_.reset();
    cache_.reset();
    cudaFree(slots_);
    cudaFree(remaining_);
    cudaFree(rows_);
    cudaFree(log_);
    cudaFree(log_count_);
    cudaStreamDestroy(stream_);
    cudaStreamDestroy(control_);
  }

  // Host mirrors of the slot states and step budgets, uploaded whole.
  void Upload() {
    std::vector<k::SlotRow> rows(kSlots);
    for (int32_t i = 0; i < kSlots; ++i) {
      rows[i].state = state_[i];
      rows[i].prompt_len = prompt_len_[i];
    }
    ASSERT_EQ(cudaMemcpy(slots_, rows.data(), kSlots * sizeof(k::SlotRow), cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(remaining_, remaining_host_.data(), kSlots * sizeof(int32_t),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    const int32_t zero = 0;
    ASSERT_EQ(cudaMemcpy(log_count_, &zero, sizeof(zero), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<int32_t> DeviceStates() {
    std::vector<k::SlotRow> rows(kSlots);
    EXPECT_EQ(cudaMemcpy(rows.data(), slots_, kSlots * sizeof(k::SlotRow), cudaMemcpyDeviceToHost),
              cudaSuccess);
    std::vector<int32_t> out;
    for (const k::SlotRow& r : rows) out.push_back(r.state);
    return out;
  }
  std::vector<int32_t> Log(int32_t* steps) {
    EXPECT_EQ(cudaMemcpy(steps, log_count_, sizeof(int32_t), cudaMemcpyDeviceToHost), cudaSuccess);
    std::vector<int32_t> log(static_cast<size_t>(std::min(*steps, kMaxSteps)) *
                             (1 + kBuckets.back()));
    EXPECT_EQ(cudaMemcpy(log.data(), log_, log.size() * sizeof(int32_t), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return log;
  }
  // The pause test asks for steps, not a time: under compute-sanitizer a step takes milliseconds.
  bool RunsPast(uint64_t steps) {
    return Eventually([&] { return loop_->steps() > steps; }, std::chrono::seconds(30));
  }

  cudaStream_t stream_ = nullptr, control_ = nullptr;
  k::SlotRow* slots_ = nullptr;
  int32_t* remaining_ = nullptr;
  int32_t* rows_ = nullptr;
  int32_t* log_ = nullptr;
  int32_t* log_count_ = nullptr;
  std::unique_ptr<GraphCache> cache_;
  std::unique_ptr<DeviceLoop> loop_;
  std::vector<int32_t> state_ = std::vector<int32_t>(kSlots, k::kSlotFree);
  std::vector<int32_t> remaining_host_ = std::vector<int32_t>(kSlots, 0);
  std::vector<int32_t> prompt_len_ = std::vector<int32_t>(kSlots, 1);
};

TEST_F(DeviceLoopTest, EveryStepDecodesTheActiveSlotsInTheSmallestBucket) {
  std::mt19937 rng(3);
  for (int32_t i = 0; i < kSlots; ++i) {
    const int32_t states[] = {k::kSlotActive,  k::kSlotActive,   k::kSlotReady,
                              k::kSlotPrefill, k::kSlotFinished, k::kSlotFree};
    state_[i] = states[rng() % 6];
    remaining_host_[i] = 1 + static_cast<int32_t>(rng() % 60);  // FREE etc. too: must not move
  }
  Upload();
  TS_ASSERT_OK(loop_->Launch(stream_));
  TS_ASSERT_OK(loop_->Wait());
  TS_ASSERT_OK(loop_->status());
  EXPECT_EQ(loop_->exit_reason(), kLoopExitIdle);
  EXPECT_FALSE(loop_->Running());

  // The host's model of the same steps.
  std::vector<int32_t> left(kSlots, 0);
  int32_t want_steps = 0;
  for (int32_t i = 0; i < kSlots; ++i) {
    if (state_[i] == k::kSlotActive || state_[i] == k::kSlotReady) {
      left[i] = remaining_host_[i];
      want_steps = std::max(want_steps, left[i]);
    }
  }
  int32_t steps = 0;
  const std::vector<int32_t> log = Log(&steps);
  ASSERT_EQ(steps, want_steps);
  EXPECT_EQ(loop_->steps(), static_cast<uint64_t>(want_steps));
  const size_t stride = 1 + kBuckets.back();
  int32_t buckets_seen = 0, last_bucket = -1;
  for (int32_t t = 0; t < steps; ++t) {
    std::vector<int32_t> want;
    for (int32_t i = 0; i < kSlots; ++i) {
      if (left[i] > 0) want.push_back(i);
    }
    const int32_t n = static_cast<int32_t>(want.size());
    const int32_t bucket = *std::lower_bound(kBuckets.begin(), kBuckets.end(), n);
    const int32_t* entry = log.data() + t * stride;
    ASSERT_EQ(entry[0], bucket) << "step " << t << ", " << n << " rows";
    for (int32_t r = 0; r < bucket; ++r) {
      ASSERT_EQ(entry[1 + r], r < n ? want[r] : -1) << "step " << t << " row " << r;
    }
    for (int32_t s : want) --left[s];
    buckets_seen += bucket != last_bucket;
    last_bucket = bucket;
  }
  EXPECT_GE(buckets_seen, 3);  // the batch shrank through several buckets
  const std::vector<int32_t> states = DeviceStates();
  for (int32_t i = 0; i < kSlots; ++i) {
    const bool decoded = state_[i] == k::kSlotActive || state_[i] == k::kSlotReady;
    EXPECT_EQ(states[i], decoded ? k::kSlotFinished : state_[i]) << "slot " << i;
  }
}

TEST_F(DeviceLoopTest, NothingActiveExitsAtOnceAndAReadySlotRelaunches) {
  state_[5] = k::kSlotPrefill;  // a prefill still running: not the loop's yet
  remaining_host_[5] = 9;
  Upload();
  TS_ASSERT_OK(loop_->Launch(stream_));
  TS_ASSERT_OK(loop_->Wait());
  EXPECT_EQ(loop_->exit_reason(), kLoopExitIdle);
  EXPECT_EQ(loop_->steps(), 0u);
  // The prefill publishes: the next launch promotes it and decodes its 9 steps.
  const int32_t ready = k::kSlotReady;
  TS_ASSERT_CUDA_OK(cudaMemcpy(&slots_[5].state, &ready, sizeof(ready), cudaMemcpyHostToDevice));
  TS_ASSERT_OK(loop_->Launch(stream_));
  TS_ASSERT_OK(loop_->Wait());
  EXPECT_EQ(loop_->steps(), 9u);
  EXPECT_EQ(DeviceStates()[5], k::kSlotFinished);
}

// The host-driven mode launches the same bucket graphs, whose last node is the scheduler: with no
// loop running it must not continue, so a host launch is exactly one step.
TEST_F(DeviceLoopTest, AHostLaunchedStepIsOneStepBeforeAndAfterALoop) {
  state_[4] = k::kSlotActive;
  remaining_host_[4] = 30;
  Upload();
  const int32_t four = 4;
  TS_ASSERT_CUDA_OK(cudaMemcpy(rows_, &four, sizeof(four), cudaMemcpyHostToDevice));
  TS_ASSERT_OK(cache_->Launch(0, stream_));  // bucket 1, row list {4}
  TS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  int32_t steps = 0;
  Log(&steps);
  EXPECT_EQ(steps, 1);
  EXPECT_EQ(loop_->steps(), 0u);
  TS_ASSERT_OK(loop_->Launch(stream_));  // the other 29
  TS_ASSERT_OK(loop_->Wait());
  EXPECT_EQ(loop_->exit_reason(), kLoopExitIdle);
  EXPECT_EQ(loop_->steps(), 29u);
  Log(&steps);
  EXPECT_EQ(steps, 30);
  EXPECT_EQ(DeviceStates()[4], k::kSlotFinished);
  // After the exit, a host launch is one step again: slot 9's first of 5.
  state_[9] = k::kSlotActive;
  remaining_host_[9] = 5;
  Upload();
  const int32_t nine = 9;
  TS_ASSERT_CUDA_OK(cudaMemcpy(rows_, &nine, sizeof(nine), cudaMemcpyHostToDevice));
  TS_ASSERT_OK(cache_->Launch(0, stream_));
  TS_ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  Log(&steps);
  EXPECT_EQ(steps, 1);
  EXPECT_EQ(loop_->steps(), 29u);
  std::vector<int32_t> left(kSlots);
  TS_ASSERT_CUDA_OK(
      cudaMemcpy(left.data(), remaining_, kSlots * sizeof(int32_t), cudaMemcpyDeviceToHost));
  EXPECT_EQ(left[9], 4);
}

TEST_F(DeviceLoopTest, ExitsAtTheStepWhereTheLongestContextLeavesTheWindow) {
  state_[3] = k::kSlotActive;  // context 100 + generated, 50 steps
  prompt_len_[3] = 100;
  remaining_host_[3] = 50;
  state_[9] = k::kSlotActive;  // context 10 + generated, 60 steps
  prompt_len_[9] = 10;
  remaining_host_[9] = 60;
  Upload();
  // Steps run while the longest context is in (0, 120]: contexts 100..120, 21 steps.
  TS_ASSERT_OK(loop_->Launch(stream_, 0, 120));
  TS_ASSERT_OK(loop_->Wait());
  EXPECT_EQ(loop_->exit_reason(), kLoopExitContext);
  EXPECT_EQ(loop_->steps(), 21u);
  // A window above it exits before any step.
  TS_ASSERT_OK(loop_->Launch(stream_, 130, 256));
  TS_ASSERT_OK(loop_->Wait());
  EXPECT_EQ(loop_->exit_reason(), kLoopExitContext);
  EXPECT_EQ(loop_->steps(), 21u);
  // The next window holds the rest: slot 3's 29 steps, then slot 9's last 10 alone, whose
  // contexts (41..50 by then) are still above 0.
  TS_ASSERT_OK(loop_->Launch(stream_, 0, 256));
  TS_ASSERT_OK(loop_->Wait());
  EXPECT_EQ(loop_->exit_reason(), kLoopExitIdle);
  EXPECT_EQ(loop_->steps(), 60u);
  EXPECT_FALSE(loop_->Launch(stream_, 5, 5).ok());  // an empty window
}

// The scheduler switches to an offered regime only at a step whose longest context has left the
// window and lies in the offer's take range, which is where the host-driven mode would choose
// exactly that regime; a shrink works as a grow does, and a withdrawn offer is never taken.
TEST_F(DeviceLoopTest, AnOfferIsTakenOnlyInItsTakeRangeAndNeverOnceWithdrawn) {
  TS_ASSERT_OK(cache_->PrepareRegime(Regime{.attention_num_splits = 2, .max_context_len = 4096}));
  absl::StatusOr<const cudaGraphExec_t*> table = cache_->PreparedTable(control_);
  TS_ASSERT_OK(table.status());
  // Slot 3: contexts 6000..7999 over steps 1..2000; slot 9: context 9 + step, 2,500 steps. From
  // step 2001 the longest context is slot 9's 2010, far below the launch's window.
  enum class Offer { kTaken, kOutsideTakeRange, kWithdrawn };
  for (Offer offer : {Offer::kTaken, Offer::kOutsideTakeRange, Offer::kWithdrawn}) {
    SCOPED_TRACE(static_cast<int>(offer));
    state_[3] = k::kSlotActive;
    prompt_len_[3] = 6000;
    remaining_host_[3] = 2000;
    state_[9] = k::kSlotActive;
    prompt_len_[9] = 10;
    remaining_host_[9] = 2500;
    Upload();
    const uint64_t steps0 = loop_->steps();
    const int32_t flips0 = loop_->flips();
    TS_ASSERT_OK(loop_->Launch(stream_, 4096, 8192));
    // Launch clears any offer on the loop's stream: offer once its first step has run.
    while (loop_->steps() == steps0 && loop_->Running()) std::this_thread::yield();
    ASSERT_LT(loop_->steps(), steps0 + 1000) << "the offer would land too late to mean anything";
    const int32_t take_lo = offer == Offer::kOutsideTakeRange ? 2048 : 1024;
    TS_ASSERT_OK(loop_->OfferFlip(*table, take_lo, 512, 4096, control_));
    if (offer == Offer::kWithdrawn) TS_ASSERT_OK(loop_->WithdrawOffer(control_));
    TS_ASSERT_OK(loop_->Wait());
    TS_ASSERT_OK(loop_->status());
    if (offer == Offer::kTaken) {
      // Switched at step 2001 and ran slot 9 to its end in the offered window (512, 4096].
      EXPECT_EQ(loop_->flips(), flips0 + 1);
      EXPECT_EQ(loop_->flip_step(), steps0 + 2001);
      EXPECT_EQ(loop_->exit_reason(), kLoopExitIdle);
      EXPECT_EQ(loop_->steps(), steps0 + 2500);
    } else {
      EXPECT_EQ(loop_->flips(), flips0);
      EXPECT_EQ(loop_->exit_reason(), kLoopExitContext);
      EXPECT_EQ(loop_->steps(), steps0 + 2000);
    }
  }
  EXPECT_FALSE(loop_->OfferFlip(*table, 4096, 512, 4096, control_).ok());  // empty take range
  EXPECT_FALSE(loop_->OfferFlip(*table, 256, 512, 4096, control_).ok());   // below the window
  EXPECT_FALSE(loop_->OfferFlip(nullptr, 1024, 512, 4096, control_).ok());
}

TEST_F(DeviceLoopTest, PauseStopsAtABoundaryAndALaunchResumes) {
  state_[2] = k::kSlotActive;
  remaining_host_[2] = 1 << 30;  // would run for hours
  state_[7] = k::kSlotActive;
  remaining_host_[7] = 1 << 30;
  Upload();
  TS_ASSERT_OK(loop_->Launch(stream_));
  EXPECT_FALSE(loop_->Launch(stream_).ok());  // one loop at a time
  ASSERT_TRUE(RunsPast(10));
  EXPECT_TRUE(loop_->Running());
  TS_ASSERT_OK(loop_->RequestPause(control_));
  TS_ASSERT_OK(loop_->Wait());
  TS_ASSERT_CUDA_OK(cudaStreamSynchronize(control_));
  EXPECT_EQ(loop_->exit_reason(), kLoopExitPaused);
  const uint64_t first = loop_->steps();
  EXPECT_GT(first, 10u);
  // Both slots were decoded in every step: a pause never splits one.
  std::vector<int32_t> left(kSlots);
  TS_ASSERT_CUDA_OK(
      cudaMemcpy(left.data(), remaining_, kSlots * sizeof(int32_t), cudaMemcpyDeviceToHost));
  EXPECT_EQ(left[2], (1 << 30) - static_cast<int32_t>(first));
  EXPECT_EQ(left[7], left[2]);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(loop_->steps(), first);  // nothing runs while paused
  TS_ASSERT_OK(loop_->Launch(stream_));
  ASSERT_TRUE(RunsPast(first + 10));
  TS_ASSERT_OK(loop_->RequestPause(control_));
  TS_ASSERT_OK(loop_->Wait());
  TS_ASSERT_CUDA_OK(cudaStreamSynchronize(control_));
  EXPECT_GT(loop_->steps(), first + 10);
  TS_ASSERT_OK(loop_->status());
  EXPECT_EQ(DeviceStates()[2], k::kSlotActive);
}

TEST(DeviceLoopParamsTest, RejectsBadParamsNamingTheField) {
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  DeviceLoopParams good;
  good.num_buckets = 2;
  good.buckets[0] = 4;
  good.buckets[1] = 8;
  good.slots = reinterpret_cast<kernels::SlotRow*>(0x200);
  good.num_slots = 8;
  good.row_slots = reinterpret_cast<int32_t*>(0x300);
  struct Case {
    const char* field;
    void (*mutate)(DeviceLoopParams&);
  };
  const Case cases[] = {
      {"device_loop.num_buckets", [](DeviceLoopParams& p) { p.num_buckets = 0; }},
      {"device_loop.num_buckets", [](DeviceLoopParams& p) { p.num_buckets = 33; }},
      {"device_loop.buckets[1]", [](DeviceLoopParams& p) { p.buckets[1] = 4; }},
      {"device_loop.num_slots", [](DeviceLoopParams& p) { p.num_slots = 9; }},
      {"device_loop.num_slots", [](DeviceLoopParams& p) { p.num_slots = 0; }},
      {"device_loop.slots", [](DeviceLoopParams& p) { p.slots = nullptr; }},
      {"device_loop.row_slots", [](DeviceLoopParams& p) { p.row_slots = nullptr; }},
  };
  for (const Case& c : cases) {
    DeviceLoopParams p = good;
    c.mutate(p);
    auto loop = DeviceLoop::Create(p, nullptr);
    ASSERT_FALSE(loop.ok()) << c.field;
    EXPECT_EQ(loop.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(loop.status().message().find(c.field), std::string::npos) << loop.status();
  }
  auto loop = DeviceLoop::Create(good, nullptr);
  TS_ASSERT_OK(loop.status());
  const absl::Status bind = (*loop)->BindTable(nullptr);
  EXPECT_EQ(bind.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bind.message().find("device_loop.table"), std::string::npos) << bind;
}

}  // namespace
}  // namespace ts::graphs
