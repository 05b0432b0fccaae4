#include "engine/cuda/stage_link.h"

#include <nccl.h>

#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/pipeline/nccl_comm.h"
#include "graphs/device_guard.h"
#include "kernels/cuda_check.h"

namespace ts {
namespace {

absl::Status CheckMove(int from, int to, size_t stages, std::span<const DeviceBytes> src,
                       std::span<const DeviceBytes> dst) {
  const int n = static_cast<int>(stages);
  if (from < 0 || from >= n || to < 0 || to >= n || from == to) {
    return absl::InvalidArgumentError(
        absl::StrCat("stage link: move from stage ", from, " to ", to, " of ", n));
  }
  if (src.size() != dst.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("stage link: ", src.size(), " sources for ", dst.size(), " destinations"));
  }
  for (size_t i = 0; i < src.size(); ++i) {
    if (dst[i].bytes < src[i].bytes) {
      return absl::InvalidArgumentError(absl::StrCat("stage link: buffer ", i, " has ",
                                                     src[i].bytes, " bytes for ", dst[i].bytes));
    }
  }
  return absl::OkStatus();
}

// Stages that share a GPU: copies on the receiver's stream, fenced both ways with events.
class CopyLinks final : public StageLinks {
 public:
  explicit CopyLinks(std::vector<StageQueue> stages) : stages_(std::move(stages)) {}
  ~CopyLinks() override {
    for (size_t s = 0; s < events_.size(); ++s) {
      const graphs::DeviceGuard guard = graphs::DeviceGuard::SetOrIgnore(stages_[s].device);
      if (events_[s] != nullptr) cudaEventDestroy(events_[s]);
    }
  }

  absl::Status Init() {
    events_.assign(stages_.size(), nullptr);
    for (size_t s = 0; s < stages_.size(); ++s) {
      TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(stages_[s].device));
      TS_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&events_[s], cudaEventDisableTiming));
      // Direct copies over NVLink or PCIe where the GPUs allow it; cudaMemcpyPeerAsync stages
      // through the host where they do not.
      for (const StageQueue& other : stages_) {
        if (other.device == stages_[s].device) continue;
        int can = 0;
        TS_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can, stages_[s].device, other.device));
        if (can == 0) continue;
        const cudaError_t e = cudaDeviceEnablePeerAccess(other.device, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();
        } else if (e != cudaSuccess) {
          return absl::InternalError(absl::StrCat("stage link: peer access from device ",
                                                  stages_[s].device, " to ", other.device, ": ",
                                                  cudaGetErrorString(e)));
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status Move(int from, int to, std::span<const DeviceBytes> src,
                    std::span<const DeviceBytes> dst) override {
    TS_RETURN_IF_ERROR(CheckMove(from, to, stages_.size(), src, dst));
    const StageQueue& a = stages_[from];
    const StageQueue& b = stages_[to];
    {
      TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(a.device));
      TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[from], a.stream));
    }
    {
      TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(b.device));
      TS_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(b.stream, events_[from], 0));
      for (size_t i = 0; i < src.size(); ++i) {
        TS_CUDA_RETURN_IF_ERROR(cudaMemcpyPeerAsync(dst[i].ptr, b.device, src[i].ptr, a.device,
                                                    src[i].bytes, b.stream));
      }
      TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[to], b.stream));
    }
    // The sender's next writes to src wait for the copy. A wait captures the event as recorded
    // when it is enqueued, so the events can be recorded again by the next move at once.
    TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(a.device));
    TS_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(a.stream, events_[to], 0));
    return absl::OkStatus();
  }

  absl::Status Wait(cudaStream_t stream, std::chrono::milliseconds /*timeout*/) override {
    // Device copies on one host cannot stall on a peer; a failed copy is the stream's error.
    TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  }

  const char* name() const override { return "copy"; }

 private:
  std::vector<StageQueue> stages_;
  std::vector<cudaEvent_t> events_;  // [stages] on each stage's device
};

// A GPU per stage: NCCL send/recv, both sides in one group call (one thread drives every rank).
// A send completes on the sender's stream once its buffer may be reused, and a receive on the
// receiver's once the data is there; both are ordered after each stream's earlier work. That is
// the ordering Move promises.
class NcclLinks final : public StageLinks {
 public:
  NcclLinks(std::vector<StageQueue> stages, std::vector<std::unique_ptr<pipeline::NcclComm>> comms,
            std::chrono::milliseconds timeout)
      : stages_(std::move(stages)), comms_(std::move(comms)), timeout_(timeout) {}

  absl::Status Move(int from, int to, std::span<const DeviceBytes> src,
                    std::span<const DeviceBytes> dst) override {
    TS_RETURN_IF_ERROR(CheckMove(from, to, stages_.size(), src, dst));
    if (!failure_.ok()) return failure_;
    ncclResult_t r = ncclGroupStart();
    for (size_t i = 0; i < src.size() && r == ncclSuccess; ++i) {
      r = ncclSend(src[i].ptr, src[i].bytes, ncclUint8, to, comms_[from]->get(),
                   stages_[from].stream);
      if (r == ncclSuccess || r == ncclInProgress) {
        r = ncclRecv(dst[i].ptr, src[i].bytes, ncclUint8, from, comms_[to]->get(),
                     stages_[to].stream);
      }
      if (r == ncclInProgress) r = ncclSuccess;
    }
    const ncclResult_t end = ncclGroupEnd();
    if (r == ncclSuccess) r = end;
    TS_RETURN_IF_ERROR(comms_[from]->Settle(r, timeout_));
    return comms_[to]->Settle(r, timeout_);
  }

  absl::Status Wait(cudaStream_t stream, std::chrono::milliseconds timeout) override {
    if (!failure_.ok()) return failure_;
    // Polled rather than synchronised, so that a transfer stuck on a failed GPU cannot hold the
    // caller past the timeout. The poll yields instead of sleeping: a decode step is a few
    // milliseconds, and a sleep's granularity would add to every one.
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (uint64_t i = 0;; ++i) {
      const cudaError_t q = cudaStreamQuery(stream);
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) {
        return Fail(absl::InternalError(
            absl::StrCat("pipeline: a stage's stream failed: ", cudaGetErrorString(q))));
      }
      if (i % 256 == 255) {
        for (const auto& c : comms_) {
          if (absl::Status st = c->AsyncError(); !st.ok()) return Fail(st);
        }
        if (std::chrono::steady_clock::now() >= deadline) {
          return Fail(absl::DeadlineExceededError(
              absl::StrCat("pipeline: a step's work did not finish in ", timeout.count(),
                           " ms; the stages' NCCL communicators were aborted")));
        }
      }
      std::this_thread::yield();
    }
  }

  const char* name() const override { return "nccl"; }

 private:
  // Aborts every communicator (releasing kernels stuck in a transfer) and fails from now on.
  absl::Status Fail(absl::Status why) {
    for (const auto& c : comms_) c->Abort();
    failure_ = why;
    return why;
  }

  std::vector<StageQueue> stages_;
  std::vector<std::unique_ptr<pipeline::NcclComm>> comms_;  // [stages], rank s on stage s's GPU
  std::chrono::milliseconds timeout_;
  absl::Status failure_;  // the first Wait failure; every later Wait returns it
};

}  // namespace

absl::StatusOr<std::unique_ptr<StageLinks>> StageLinks::Create(
    const std::vector<StageQueue>& stages, std::chrono::milliseconds timeout) {
  if (stages.size() < 2) {
    return absl::InvalidArgumentError("stage link: a pipeline needs at least 2 stages");
  }
  std::vector<int> devices;
  bool shared = false;
  for (const StageQueue& s : stages) {
    for (int d : devices) shared |= d == s.device;
    devices.push_back(s.device);
  }
  if (shared) {
    auto links = std::make_unique<CopyLinks>(stages);
    TS_RETURN_IF_ERROR(links->Init());
    return std::unique_ptr<StageLinks>(std::move(links));
  }
  TS_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<pipeline::NcclComm>> comms,
                      pipeline::NcclComm::CreateGroup(devices, timeout));
  return std::unique_ptr<StageLinks>(new NcclLinks(stages, std::move(comms), timeout));
}

}  // namespace ts
