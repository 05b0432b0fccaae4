#include "engine/pipeline/nccl_comm.h"

#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"

namespace ts::pipeline {
namespace {

using Clock = std::chrono::steady_clock;

// Polls often enough that a ready communicator costs little, rarely enough not to burn a core.
constexpr auto kPoll = std::chrono::microseconds(200);

std::string NcclError(ncclResult_t r) {
  return absl::StrCat(ncclGetErrorString(r), " (", static_cast<int>(r),
                      "): ", ncclGetLastError(nullptr));
}

// Polls the communicator's asynchronous state until it is no longer in progress, or the deadline.
ncclResult_t PollUntilSettled(ncclComm_t comm, Clock::time_point deadline, bool* timed_out) {
  *timed_out = false;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (Clock::now() >= deadline) {
      *timed_out = true;
      return ncclInProgress;
    }
    std::this_thread::sleep_for(kPoll);
  }
}

}  // namespace

absl::StatusOr<std::string> NcclComm::NewUniqueId() {
  ncclUniqueId id;
  if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
    return absl::InternalError(absl::StrCat("ncclGetUniqueId: ", NcclError(r)));
  }
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<NcclComm>> NcclComm::Create(const std::string& unique_id, int rank,
                                                           int world_size, int device,
                                                           std::chrono::milliseconds timeout) {
  ncclUniqueId id;
  if (unique_id.size() != sizeof(id.internal)) {
    return absl::InvalidArgumentError(absl::StrCat("nccl: a unique id has ", sizeof(id.internal),
                                                   " bytes, got ", unique_id.size()));
  }
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl: rank ", rank, " outside [0, ", world_size, ")"));
  }
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl: device ", device, ": ", cudaGetErrorString(e)));
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // return at once; readiness is polled against the deadline below
  ncclComm_t comm = nullptr;
  const auto deadline = Clock::now() + timeout;
  ncclResult_t r = ncclCommInitRankConfig(&comm, world_size, id, rank, &config);
  bool timed_out = false;
  if (r == ncclInProgress && comm != nullptr) r = PollUntilSettled(comm, deadline, &timed_out);
  if (r == ncclSuccess) return std::unique_ptr<NcclComm>(new NcclComm(comm, rank, world_size));
  if (comm != nullptr) ncclCommAbort(comm);
  if (timed_out) {
    return absl::DeadlineExceededError(absl::StrCat(
        "nccl: rank ", rank, " of ", world_size, ": the communicator was not ready after ",
        timeout.count(), " ms (is every rank up and reachable?)"));
  }
  return absl::InternalError(
      absl::StrCat("nccl: rank ", rank, " of ", world_size, ": init failed: ", NcclError(r)));
}

absl::StatusOr<std::vector<std::unique_ptr<NcclComm>>> NcclComm::CreateGroup(
    const std::vector<int>& devices, std::chrono::milliseconds timeout) {
  const int n = static_cast<int>(devices.size());
  if (n < 1) return absl::InvalidArgumentError("nccl: a group needs at least one device");
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < i; ++j) {
      if (devices[i] == devices[j]) {
        return absl::InvalidArgumentError(absl::StrCat("nccl: ranks ", j, " and ", i,
                                                       " are both on device ", devices[i],
                                                       "; NCCL needs a GPU per rank"));
      }
    }
  }
  ncclUniqueId id;
  if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
    return absl::InternalError(absl::StrCat("ncclGetUniqueId: ", NcclError(r)));
  }
  int previous = 0;
  if (const cudaError_t e = cudaGetDevice(&previous); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("nccl: cudaGetDevice: ", cudaGetErrorString(e)));
  }
  std::vector<ncclComm_t> comms(n, nullptr);
  const auto deadline = Clock::now() + timeout;
  // Every rank joins inside one group: called one after another outside it, the first would wait
  // for the others to join on this same thread.
  ncclResult_t r = ncclGroupStart();
  for (int i = 0; i < n && r == ncclSuccess; ++i) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    if (cudaSetDevice(devices[i]) != cudaSuccess) {
      r = ncclInvalidArgument;
      break;
    }
    r = ncclCommInitRankConfig(&comms[i], n, id, i, &config);
    if (r == ncclInProgress) r = ncclSuccess;
  }
  const ncclResult_t end = ncclGroupEnd();
  if (r == ncclSuccess) r = end == ncclInProgress ? ncclSuccess : end;
  bool timed_out = false;
  for (int i = 0; i < n && r == ncclSuccess; ++i) {
    if (comms[i] == nullptr) {
      r = ncclInternalError;
      break;
    }
    r = PollUntilSettled(comms[i], deadline, &timed_out);
  }
  cudaSetDevice(previous);
  if (r == ncclSuccess) {
    std::vector<std::unique_ptr<NcclComm>> out;
    for (int i = 0; i < n; ++i) {
      out.push_back(std::unique_ptr<NcclComm>(new NcclComm(comms[i], i, n)));
    }
    return out;
  }
  for (ncclComm_t c : comms) {
    if (c != nullptr) ncclCommAbort(c);
  }
  if (timed_out) {
    return absl::DeadlineExceededError(absl::StrCat(
        "nccl: a group of ", n, " communicators was not ready after ", timeout.count(), " ms"));
  }
  return absl::InternalError(
      absl::StrCat("nccl: a group of ", n, " communicators failed: ", NcclError(r)));
}

NcclComm::~NcclComm() {
  if (comm_ == nullptr || aborted_) return;
  // Finalize flushes outstanding work; bounded like everything else, then destroy.
  bool timed_out = false;
  const ncclResult_t r = ncclCommFinalize(comm_);
  if (r == ncclSuccess || r == ncclInProgress) {
    PollUntilSettled(comm_, Clock::now() + std::chrono::seconds(10), &timed_out);
  }
  if (timed_out || (r != ncclSuccess && r != ncclInProgress)) {
    ncclCommAbort(comm_);
  } else {
    ncclCommDestroy(comm_);
  }
}

absl::Status NcclComm::Fail(absl::Status why) {
  if (!aborted_) {
    ncclCommAbort(comm_);
    aborted_ = true;
  }
  return why;
}

absl::Status NcclComm::AsyncError() {
  if (aborted_) return absl::FailedPreconditionError("nccl: the communicator was aborted");
  ncclResult_t state = ncclSuccess;
  const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
  if (r != ncclSuccess) state = r;
  if (state == ncclSuccess || state == ncclInProgress) return absl::OkStatus();
  return Fail(absl::InternalError(
      absl::StrCat("nccl: rank ", rank_, " of ", world_size_, ": ", NcclError(state))));
}

void NcclComm::Abort() {
  (void)Fail(absl::OkStatus());
}

absl::Status NcclComm::Settle(ncclResult_t issued, std::chrono::milliseconds timeout) {
  if (aborted_) return absl::FailedPreconditionError("nccl: the communicator was aborted");
  if (issued == ncclSuccess) return absl::OkStatus();
  if (issued != ncclInProgress) {
    return Fail(absl::InternalError(absl::StrCat("nccl: rank ", rank_, ": ", NcclError(issued))));
  }
  bool timed_out = false;
  const ncclResult_t r = PollUntilSettled(comm_, Clock::now() + timeout, &timed_out);
  if (r == ncclSuccess) return absl::OkStatus();
  if (timed_out) {
    return Fail(absl::DeadlineExceededError(absl::StrCat(
        "nccl: rank ", rank_, ": a call was still in progress after ", timeout.count(), " ms")));
  }
  return Fail(absl::InternalError(absl::StrCat("nccl: rank ", rank_, ": ", NcclError(r))));
}

absl::Status NcclComm::Wait(cudaStream_t stream, std::chrono::milliseconds timeout) {
  if (aborted_) return absl::FailedPreconditionError("nccl: the communicator was aborted");
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) return absl::OkStatus();
    if (q != cudaErrorNotReady) {
      return Fail(absl::InternalError(
          absl::StrCat("nccl: rank ", rank_, ": the stream failed: ", cudaGetErrorString(q))));
    }
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(comm_, &state);
    if (state != ncclSuccess && state != ncclInProgress) {
      return Fail(absl::InternalError(
          absl::StrCat("nccl: rank ", rank_, ": a peer failed: ", NcclError(state))));
    }
    if (Clock::now() >= deadline) {
      return Fail(absl::DeadlineExceededError(absl::StrCat(
          "nccl: rank ", rank_, " of ", world_size_, ": work on the stream did not finish in ",
          timeout.count(), " ms (a peer stalled or died)")));
    }
    std::this_thread::sleep_for(kPoll);
  }
}

}  // namespace ts::pipeline
