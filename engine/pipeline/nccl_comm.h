// An NCCL communicator that never hangs (docs/pipeline.md, Communicators): created non-blocking
// and polled against a deadline, and every wait on its work bounded too. A peer that never comes
// or dies mid-collective ends in an error naming the rank and the wait, after which the
// communicator is aborted (which also releases kernels stuck in a collective).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ts::pipeline {

class NcclComm {
 public:
  // A fresh ncclUniqueId as bytes, for rank 0 to hand out (ExchangeBootstrapBlob).
  static absl::StatusOr<std::string> NewUniqueId();

  // Joins the communicator named by `unique_id` (the bytes of an ncclUniqueId) as `rank` of
  // `world_size` on CUDA device `device`. DeadlineExceeded when it is not ready within `timeout`
  // (a rank missing); Internal for an NCCL error. Either way nothing is left behind.
  static absl::StatusOr<std::unique_ptr<NcclComm>> Create(const std::string& unique_id, int rank,
                                                          int world_size, int device,
                                                          std::chrono::milliseconds timeout);
  // One process over several GPUs: a communicator per device, rank r on devices[r], created
  // together in one NCCL group (as ncclCommInitAll does, but non-blocking and bounded by
  // `timeout`). The devices must be distinct: NCCL refuses two ranks on one GPU.
  static absl::StatusOr<std::vector<std::unique_ptr<NcclComm>>> CreateGroup(
      const std::vector<int>& devices, std::chrono::milliseconds timeout);
  ~NcclComm();  // destroys it, or, after a failure, has already aborted it

  // Waits for everything enqueued on `stream`, collectives on this communicator included.
  // Past `timeout`, or on an asynchronous NCCL error (a peer died), aborts the communicator and
  // returns DeadlineExceeded or Internal; the communicator is unusable afterwards.
  absl::Status Wait(cudaStream_t stream, std::chrono::milliseconds timeout);

  // After each call that enqueues NCCL work (non-blocking mode may answer ncclInProgress):
  // polls until NCCL has taken the call, or aborts past `timeout`.
  absl::Status Settle(ncclResult_t issued, std::chrono::milliseconds timeout);

  // Non-blocking: OK while the communicator is healthy (or still working); Internal after an
  // asynchronous NCCL error (a peer failed), and the communicator is aborted.
  absl::Status AsyncError();
  // Aborts the communicator now (kernels stuck in its calls are released); later calls fail.
  void Abort();

  ncclComm_t get() const { return comm_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

 private:
  NcclComm(ncclComm_t comm, int rank, int world_size)
      : comm_(comm), rank_(rank), world_size_(world_size) {}
  absl::Status Fail(absl::Status why);  // aborts, remembers, returns `why`

  ncclComm_t comm_ = nullptr;
  int rank_ = 0;
  int world_size_ = 0;
  bool aborted_ = false;
};

}  // namespace ts::pipeline
