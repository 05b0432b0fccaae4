// NcclComm on one GPU: a one-rank communicator runs an all-reduce; a communicator whose other rank
// never comes times out and is aborted instead of hanging; a wait on a stalled stream does too.
#include "engine/pipeline/nccl_comm.h"

#include <chrono>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ts::pipeline {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

TEST(NcclCommTest, OneRankAllReduceCompletes) {
  absl::StatusOr<std::string> id = NcclComm::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<std::unique_ptr<NcclComm>> comm = NcclComm::Create(*id, 0, 1, 0, 30s);
  ASSERT_TRUE(comm.ok()) << comm.status();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  std::vector<float> host(1024);
  for (size_t i = 0; i < host.size(); ++i) host[i] = 0.5f * static_cast<float>(i) - 3.0f;
  float *in = nullptr, *out = nullptr;
  ASSERT_EQ(cudaMalloc(&in, host.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&out, host.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(in, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemset(out, 0xff, host.size() * sizeof(float)), cudaSuccess);  // poison
  ASSERT_TRUE(
      (*comm)
          ->Settle(ncclAllReduce(in, out, host.size(), ncclFloat, ncclSum, (*comm)->get(), stream),
                   10s)
          .ok());
  ASSERT_TRUE((*comm)->Wait(stream, 10s).ok());
  std::vector<float> got(host.size());
  ASSERT_EQ(cudaMemcpy(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(got, host);  // the sum over one rank
  cudaFree(in);
  cudaFree(out);
  cudaStreamDestroy(stream);
}

TEST(NcclCommTest, AMissingRankTimesOutInsteadOfHanging) {
  absl::StatusOr<std::string> id = NcclComm::NewUniqueId();
  ASSERT_TRUE(id.ok());
  const auto t0 = Clock::now();
  absl::StatusOr<std::unique_ptr<NcclComm>> comm = NcclComm::Create(*id, 0, 2, 0, 3s);
  const auto waited = Clock::now() - t0;
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(comm.status().message()),
              HasSubstr("rank 0 of 2: the communicator was not ready after 3000 ms"));
  EXPECT_LT(waited, 10s);
}

TEST(NcclCommTest, AStalledStreamTimesOutAndAbortsTheCommunicator) {
  absl::StatusOr<std::string> id = NcclComm::NewUniqueId();
  ASSERT_TRUE(id.ok());
  absl::StatusOr<std::unique_ptr<NcclComm>> comm = NcclComm::Create(*id, 0, 1, 0, 30s);
  ASSERT_TRUE(comm.ok()) << comm.status();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  // A host function that sleeps keeps the stream busy, as a collective waiting on a dead peer does.
  ASSERT_EQ(
      cudaLaunchHostFunc(
          stream, [](void*) { std::this_thread::sleep_for(std::chrono::seconds(2)); }, nullptr),
      cudaSuccess);
  const absl::Status s = (*comm)->Wait(stream, 200ms);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(s.message()), HasSubstr("did not finish in 200 ms"));
  EXPECT_EQ((*comm)->Wait(stream, 10s).code(), absl::StatusCode::kFailedPrecondition);
  cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
}

TEST(NcclCommTest, BadArgumentsAreRefused) {
  EXPECT_EQ(NcclComm::Create("short", 0, 1, 0, 1s).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::string> id = NcclComm::NewUniqueId();
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(NcclComm::Create(*id, 2, 2, 0, 1s).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ts::pipeline
