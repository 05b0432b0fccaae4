#include "engine/cuda/stage_link.h"

#include <nccl.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/pipeline/nccl_comm.h"
#include "engine/pipeline/stage_transport.h"
#include "graphs/device_guard.h"
#include "kernels/cuda_check.h"

namespace ts {
namespace {

// `here_from` / `here_to`: whether this process holds the stage (always, in one process). A side
// held elsewhere has no buffers; a side held here has its own.
absl::Status CheckMove(int from, int to, size_t stages, std::span<const DeviceBytes> src,
                       std::span<const DeviceBytes> dst, bool here_from, bool here_to) {
  const int n = static_cast<int>(stages);
  if (from < 0 || from >= n || to < 0 || to >= n || from == to) {
    return absl::InvalidArgumentError(
        absl::StrCat("stage link: move from stage ", from, " to ", to, " of ", n));
  }
  const auto sides = [](int stage, bool here, std::span<const DeviceBytes> bufs) {
    if (here == !bufs.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "stage link: stage ", stage,
        here ? " is held here but has no buffers" : " is held by another process but has buffers"));
  };
  TS_RETURN_IF_ERROR(sides(from, here_from, src));
  TS_RETURN_IF_ERROR(sides(to, here_to, dst));
  if (!src.empty() && !dst.empty()) {
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
                    std::span<const DeviceBytes> dst, cudaStream_t from_stream) override {
    TS_RETURN_IF_ERROR(CheckMove(from, to, stages_.size(), src, dst, true, true));
    const StageQueue& a = stages_[from];
    const StageQueue& b = stages_[to];
    const cudaStream_t sender = from_stream != nullptr ? from_stream : a.stream;
    {
      TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(a.device));
      TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[from], sender));
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
    TS_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(sender, events_[to], 0));
    return absl::OkStatus();
  }

  absl::Status Wait(cudaStream_t stream, std::chrono::milliseconds /*timeout*/) override {
    // Device copies on one host cannot stall on a peer; a failed copy is the stream's error.
    TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  }

  absl::Status WaitEvent(cudaEvent_t event, std::chrono::milliseconds /*timeout*/) override {
    TS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event));
    return absl::OkStatus();
  }

  const char* name() const override { return "copy"; }

 private:
  std::vector<StageQueue> stages_;
  std::vector<cudaEvent_t> events_;  // [stages] on each stage's device
};

// A GPU per stage: NCCL send/recv. In one process one thread drives every rank, each side of a
// move in one group call; across processes each does its own half, in the order every process
// follows (docs/pipeline.md, Across processes), which is what keeps the halves matched. A send
// completes on the sender's stream once its buffer may be reused, and a receive on the receiver's
// once the data is there; both are ordered after each stream's earlier work. That is the ordering
// Move promises.
class NcclLinks final : public StageLinks {
 public:
  // comms[s]: the communicator stage s sends and receives on, null where another process holds
  // it; peers[s]: stage s's rank in it. `ring`: watched while waiting (across processes).
  NcclLinks(std::vector<StageQueue> stages, std::vector<std::unique_ptr<pipeline::NcclComm>> owned,
            std::vector<pipeline::NcclComm*> comms, std::vector<int> peers,
            std::chrono::milliseconds timeout, const pipeline::StageTransport* ring)
      : stages_(std::move(stages)),
        owned_(std::move(owned)),
        comms_(std::move(comms)),
        peers_(std::move(peers)),
        timeout_(timeout),
        ring_(ring) {}

  absl::Status Move(int from, int to, std::span<const DeviceBytes> src,
                    std::span<const DeviceBytes> dst, cudaStream_t from_stream) override {
    TS_RETURN_IF_ERROR(CheckMove(from, to, stages_.size(), src, dst, comms_[from] != nullptr,
                                 comms_[to] != nullptr));
    const cudaStream_t sender = from_stream != nullptr ? from_stream : stages_[from].stream;
    if (!failure_.ok()) return failure_;
    if (comms_[from] == nullptr && comms_[to] == nullptr) return absl::OkStatus();
    const size_t n = std::max(src.size(), dst.size());
    ncclResult_t r = ncclGroupStart();
    for (size_t i = 0; i < n && (r == ncclSuccess || r == ncclInProgress); ++i) {
      const size_t bytes = src.empty() ? dst[i].bytes : src[i].bytes;
      if (comms_[from] != nullptr) {
        r = ncclSend(src[i].ptr, bytes, ncclUint8, peers_[to], comms_[from]->get(), sender);
      }
      if ((r == ncclSuccess || r == ncclInProgress) && comms_[to] != nullptr) {
        r = ncclRecv(dst[i].ptr, bytes, ncclUint8, peers_[from], comms_[to]->get(),
                     stages_[to].stream);
      }
    }
    if (r == ncclInProgress) r = ncclSuccess;
    const ncclResult_t end = ncclGroupEnd();
    if (r == ncclSuccess) r = end;
    for (const int s : {from, to}) {
      if (comms_[s] != nullptr) TS_RETURN_IF_ERROR(comms_[s]->Settle(r, timeout_));
    }
    return absl::OkStatus();
  }

  absl::Status Wait(cudaStream_t stream, std::chrono::milliseconds timeout) override {
    return Poll([stream] { return cudaStreamQuery(stream); }, timeout);
  }

  absl::Status WaitEvent(cudaEvent_t event, std::chrono::milliseconds timeout) override {
    return Poll([event] { return cudaEventQuery(event); }, timeout);
  }

  const char* name() const override { return "nccl"; }

 private:
  // Polled rather than synchronised, so that a transfer stuck on a failed GPU or a dead peer
  // cannot hold the caller past the timeout. The poll yields instead of sleeping: a decode step
  // is a few milliseconds, and a sleep's granularity would add to every one.
  template <typename Query>
  absl::Status Poll(const Query& query, std::chrono::milliseconds timeout) {
    if (!failure_.ok()) return failure_;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (uint64_t i = 0;; ++i) {
      const cudaError_t q = query();
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) {
        return Fail(absl::InternalError(
            absl::StrCat("pipeline: a stage's stream failed: ", cudaGetErrorString(q))));
      }
      if (i % 256 == 255) {
        for (pipeline::NcclComm* c : comms_) {
          if (c == nullptr) continue;
          if (absl::Status st = c->AsyncError(); !st.ok()) return Fail(st);
        }
        if (ring_ != nullptr) {
          if (absl::Status st = ring_->health(); !st.ok()) return Fail(st);
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

  // Aborts every communicator (releasing kernels stuck in a transfer) and fails from now on.
  absl::Status Fail(absl::Status why) {
    for (pipeline::NcclComm* c : comms_) {
      if (c != nullptr) c->Abort();
    }
    failure_ = why;
    return why;
  }

  std::vector<StageQueue> stages_;
  std::vector<std::unique_ptr<pipeline::NcclComm>> owned_;
  std::vector<pipeline::NcclComm*> comms_;  // [stages], null where another process holds it
  std::vector<int> peers_;                  // [stages] each stage's rank in the communicator
  std::chrono::milliseconds timeout_;
  const pipeline::StageTransport* ring_;  // across processes; else null
  absl::Status failure_;                  // the first Wait failure; every later Wait returns it
};

// Ranks that share a GPU (NCCL refuses them): each move's bytes cross the host over the ranks' TCP
// ring. Every move is between neighbours on the ring (the order every process follows keeps them
// so), and the host waits for each copy, so the ordering Move promises holds trivially.
class HostLinks final : public StageLinks {
 public:
  HostLinks(std::vector<StageQueue> stages, RankLinkOptions o)
      : stages_(std::move(stages)), o_(std::move(o)) {}

  absl::Status Move(int from, int to, std::span<const DeviceBytes> src,
                    std::span<const DeviceBytes> dst, cudaStream_t from_stream) override {
    const bool send = stages_[from].stream != nullptr, recv = stages_[to].stream != nullptr;
    TS_RETURN_IF_ERROR(CheckMove(from, to, stages_.size(), src, dst, send, recv));
    if (!send && !recv) return absl::OkStatus();
    if (send && recv) {
      return absl::InvalidArgumentError("host link: both stages of a move in one process");
    }
    const int32_t world = o_.transport->world_size();
    const int32_t sender = o_.stage_ranks[from], receiver = o_.stage_ranks[to];
    if ((sender + 1) % world != receiver) {
      return absl::InvalidArgumentError(absl::StrCat("host link: a move from rank ", sender, " to ",
                                                     receiver, ", not its successor"));
    }
    pipeline::StageMessage m;
    m.op = pipeline::StageOp::kCudaData;
    const std::span<const DeviceBytes> bufs = send ? src : dst;
    size_t total = 0;
    for (const DeviceBytes& b : bufs) total += b.bytes;
    const cudaStream_t stream =
        send && from_stream != nullptr ? from_stream : stages_[send ? from : to].stream;
    const graphs::DeviceGuard guard =
        graphs::DeviceGuard::SetOrIgnore(stages_[send ? from : to].device);
    if (send) {
      m.data.resize((total + sizeof(float) - 1) / sizeof(float));
      char* p = reinterpret_cast<char*>(m.data.data());
      for (const DeviceBytes& b : bufs) {
        TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(p, b.ptr, b.bytes, cudaMemcpyDeviceToHost, stream));
        p += b.bytes;
      }
      TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
      return o_.transport->Send(m);
    }
    TS_RETURN_IF_ERROR(o_.transport->Recv(&m, o_.timeout));
    if (m.op != pipeline::StageOp::kCudaData ||
        m.data.size() != (total + sizeof(float) - 1) / sizeof(float)) {
      return absl::DataLossError(absl::StrCat("host link: rank ", sender, " sent ",
                                              m.data.size() * sizeof(float), " bytes (op ",
                                              static_cast<uint32_t>(m.op), "), not ", total));
    }
    const char* p = reinterpret_cast<const char*>(m.data.data());
    for (const DeviceBytes& b : bufs) {
      TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b.ptr, p, b.bytes, cudaMemcpyHostToDevice, stream));
      p += b.bytes;
    }
    // m's bytes must outlive the copies.
    TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  }

  absl::Status Wait(cudaStream_t stream, std::chrono::milliseconds /*timeout*/) override {
    // Every cross-process dependency was met on the host, inside Move: the stream's own work
    // cannot stall on a peer.
    TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return o_.transport->health();
  }

  absl::Status WaitEvent(cudaEvent_t event, std::chrono::milliseconds /*timeout*/) override {
    TS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event));
    return o_.transport->health();
  }

  const char* name() const override { return "host"; }

 private:
  std::vector<StageQueue> stages_;
  RankLinkOptions o_;
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
  std::vector<pipeline::NcclComm*> raw;
  std::vector<int> peers;
  for (size_t s = 0; s < comms.size(); ++s) {
    raw.push_back(comms[s].get());
    peers.push_back(static_cast<int>(s));
  }
  return std::unique_ptr<StageLinks>(
      new NcclLinks(stages, std::move(comms), std::move(raw), std::move(peers), timeout, nullptr));
}

absl::StatusOr<std::unique_ptr<StageLinks>> StageLinks::CreateAcrossProcesses(
    const std::vector<StageQueue>& stages, RankLinkOptions o) {
  if (stages.size() < 2 || o.stage_ranks.size() != stages.size() || o.transport == nullptr) {
    return absl::InvalidArgumentError(
        "stage link: a pipeline across processes needs 2 stages or more, a rank for each and the "
        "ranks' ring");
  }
  for (size_t s = 0; s < stages.size(); ++s) {
    if ((stages[s].stream != nullptr) != (o.stage_ranks[s] == o.rank)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stage link: stage ", s, " is held by rank ", o.stage_ranks[s], "; this is rank ", o.rank,
          stages[s].stream != nullptr ? ", with" : ", without", " its stream"));
    }
  }
  if (o.comm == nullptr) return std::unique_ptr<StageLinks>(new HostLinks(stages, std::move(o)));
  std::vector<pipeline::NcclComm*> comms(stages.size(), nullptr);
  std::vector<int> peers(o.stage_ranks.begin(), o.stage_ranks.end());
  for (size_t s = 0; s < stages.size(); ++s) {
    if (stages[s].stream != nullptr) comms[s] = o.comm.get();
  }
  std::vector<std::unique_ptr<pipeline::NcclComm>> owned;
  owned.push_back(std::move(o.comm));
  return std::unique_ptr<StageLinks>(new NcclLinks(stages, std::move(owned), std::move(comms),
                                                   std::move(peers), o.timeout, o.transport));
}

}  // namespace ts
