// Which NCCL operations work in which CUDA graphs (docs/gpu-facts.md, Device-launchable graphs:
// they hold only kernel, memcpy, memset and child-graph nodes, so send/recv may be host-graph-only,
// and a device loop across GPUs would need NCCL 2.28's device API). Found out on one GPU with a
// one-rank communicator; each case prints one FINDING line for the record.
//
// An outcome that is the thing being explored (an instantiation or an NCCL call refused) is
// printed and not asserted. Wrong data after any path reports success fails the test, and every
// wait is bounded by NcclComm::Wait, so a hang fails too instead of stalling the suite.
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/pipeline/nccl_comm.h"
#include "graphs/device_graph.h"
#include "gtest/gtest.h"
#include "kernels/cuda_check.h"
#include "tests/engine/nccl_graphs_abi.h"
#include "tests/engine/nccl_graphs_kernels.cuh"

namespace ts::pipeline {
namespace {

using namespace std::chrono_literals;
using testing::DevCommV22803;
using testing::FromV22803;
using testing::Layout;
using testing::LayoutOf;
using testing::LsaStoreArgs;
using testing::Pattern;
using testing::ReqsV22803;

constexpr auto kWait = 10s;           // any single NCCL call or stream wait; seconds of slack
constexpr uint32_t kCount = 1 << 16;  // 256 KiB of uint32 per buffer
constexpr size_t kBytes = kCount * sizeof(uint32_t);

void Finding(const std::string& what) {
  std::printf("FINDING: %s\n", what.c_str());
  std::fflush(stdout);
}

// For failure messages: `ASSERT_TRUE(ok) << Found(...)` evaluates, and so prints, only on failure.
std::string Found(const std::string& what) {
  Finding(what);
  return what;
}

std::string CudaError(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

// "" when dev[0, kCount) holds Pattern(i, seed), else the first wrong element.
std::string Mismatch(const uint32_t* dev, uint32_t seed) {
  std::vector<uint32_t> got(kCount);
  if (const cudaError_t e = cudaMemcpy(got.data(), dev, kBytes, cudaMemcpyDeviceToHost)) {
    return absl::StrCat("read back failed: ", CudaError(e));
  }
  for (uint32_t i = 0; i < kCount; ++i) {
    if (got[i] != Pattern(i, seed)) {
      return absl::StrCat("element ", i, " is 0x", absl::Hex(got[i]), ", want 0x",
                          absl::Hex(Pattern(i, seed)), " (seed ", seed, ")");
    }
  }
  return "";
}

std::string NodeTypeName(cudaGraphNodeType t) {
  static const std::map<cudaGraphNodeType, const char*> kNames = {
      {cudaGraphNodeTypeKernel, "kernel"},          {cudaGraphNodeTypeMemcpy, "memcpy"},
      {cudaGraphNodeTypeMemset, "memset"},          {cudaGraphNodeTypeHost, "host"},
      {cudaGraphNodeTypeGraph, "child graph"},      {cudaGraphNodeTypeEmpty, "empty"},
      {cudaGraphNodeTypeWaitEvent, "event wait"},   {cudaGraphNodeTypeEventRecord, "event record"},
      {cudaGraphNodeTypeMemAlloc, "mem alloc"},     {cudaGraphNodeTypeMemFree, "mem free"},
      {cudaGraphNodeTypeConditional, "conditional"}};
  const auto it = kNames.find(t);
  return it != kNames.end() ? it->second : absl::StrCat("type ", static_cast<int>(t));
}

// "3 nodes: kernel x2, memcpy x1": what NCCL put into the capture, which decides DeviceLaunch.
std::string DescribeNodes(cudaGraph_t graph) {
  size_t n = 0;
  if (cudaGraphGetNodes(graph, nullptr, &n) != cudaSuccess) return "nodes unknown";
  std::vector<cudaGraphNode_t> nodes(n);
  if (cudaGraphGetNodes(graph, nodes.data(), &n) != cudaSuccess) return "nodes unknown";
  std::map<std::string, int> counts;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType t;
    counts[cudaGraphNodeGetType(node, &t) == cudaSuccess ? NodeTypeName(t) : "unknown"]++;
  }
  std::string out = absl::StrCat(n, " nodes:");
  for (const auto& [name, count] : counts) absl::StrAppend(&out, " ", name, " x", count);
  return out;
}

// What the one-thread launcher left in its status word: 0, -1 (never ran) or a cudaError_t.
std::string TailLaunchOutcome(const int32_t* status) {
  int32_t v = -1;
  if (cudaMemcpy(&v, status, sizeof(v), cudaMemcpyDeviceToHost) != cudaSuccess) return "unreadable";
  if (v == 0) return "";
  return v < 0 ? "the launcher never ran" : CudaError(static_cast<cudaError_t>(v));
}

std::string InstantiateResultName(cudaGraphInstantiateResult r) {
  static const std::map<cudaGraphInstantiateResult, const char*> kNames = {
      {cudaGraphInstantiateError, "error"},
      {cudaGraphInstantiateInvalidStructure, "invalid structure"},
      {cudaGraphInstantiateNodeOperationNotSupported, "node operation not supported"},
      {cudaGraphInstantiateMultipleDevicesNotSupported, "multiple devices not supported"}};
  const auto it = kNames.find(r);
  return it != kNames.end() ? it->second : absl::StrCat("result ", static_cast<int>(r));
}

struct GraphDeleter {
  void operator()(cudaGraph_t g) const { (void)cudaGraphDestroy(g); }
};
struct ExecDeleter {
  void operator()(cudaGraphExec_t e) const { (void)cudaGraphExecDestroy(e); }
};
using GraphPtr = std::unique_ptr<CUgraph_st, GraphDeleter>;
using ExecPtr = std::unique_ptr<CUgraphExec_st, ExecDeleter>;

// A one-rank communicator on device 0, a non-blocking stream and three device buffers. Once any
// Settle or Wait has failed the communicator is aborted (freed), so no NCCL call may follow:
// `comm_ok_` tracks that for the cleanups.
class NcclGraphsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::string> id = NcclComm::NewUniqueId();
    ASSERT_TRUE(id.ok()) << id.status();
    absl::StatusOr<std::unique_ptr<NcclComm>> comm = NcclComm::Create(*id, 0, 1, 0, 30s);
    ASSERT_TRUE(comm.ok()) << comm.status();
    comm_ = std::move(*comm);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    for (uint32_t** p : {&send_, &recv_, &aux_}) ASSERT_EQ(cudaMalloc(p, kBytes), cudaSuccess);
  }
  void TearDown() override {
    // After a failed wait a kernel may still run: syncing on it would hang and freeing under it
    // would fault, so the process keeps the little it holds until it exits.
    if (!comm_ok_) return;
    if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
    for (uint32_t* p : {send_, recv_, aux_}) (void)cudaFree(p);
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }

  absl::Status Settle(ncclResult_t r) { return Track(comm_->Settle(r, kWait)); }
  absl::Status Wait() { return Track(comm_->Wait(stream_, kWait)); }
  absl::Status Track(absl::Status s) {
    if (!s.ok()) comm_ok_ = false;
    return s;
  }

  // Copies Pattern(., seed) to `dst` and zeroes `poisoned`, in stream order before what follows.
  absl::Status Stage(uint32_t* dst, uint32_t seed, uint32_t* poisoned) {
    std::vector<uint32_t> host(kCount);
    for (uint32_t i = 0; i < kCount; ++i) host[i] = Pattern(i, seed);
    TS_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, host.data(), kBytes, cudaMemcpyHostToDevice, stream_));
    if (poisoned != nullptr) TS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(poisoned, 0, kBytes, stream_));
    return Wait();  // `host` must outlive the copy
  }

  // ncclSend(send_) + ncclRecv(recv_) to this very rank, grouped as the docs require for a pair.
  absl::Status EnqueueSendRecvToSelf() {
    TS_RETURN_IF_ERROR(Settle(ncclGroupStart()));
    const ncclResult_t s = ncclSend(send_, kCount, ncclUint32, 0, comm_->get(), stream_);
    const ncclResult_t r = ncclRecv(recv_, kCount, ncclUint32, 0, comm_->get(), stream_);
    const ncclResult_t end = ncclGroupEnd();  // always closes the group
    TS_RETURN_IF_ERROR(Settle(s));
    TS_RETURN_IF_ERROR(Settle(r));
    return Settle(end);
  }

  // An eager send/recv first (docs: capturing P2P with no earlier P2P to that peer needs
  // ThreadLocal capture; the engine would warm up before capturing anyway), then the capture.
  absl::StatusOr<GraphPtr> WarmUpAndCaptureSendRecv() {
    TS_RETURN_IF_ERROR(Stage(send_, 1, recv_));
    TS_RETURN_IF_ERROR(EnqueueSendRecvToSelf());
    TS_RETURN_IF_ERROR(Wait());
    if (std::string bad = Mismatch(recv_, 1); !bad.empty()) {
      return absl::InternalError(absl::StrCat("eager send/recv to self: ", bad));
    }
    TS_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    const absl::Status enqueued = EnqueueSendRecvToSelf();
    cudaGraph_t raw = nullptr;
    const cudaError_t end = cudaStreamEndCapture(stream_, &raw);  // ends it even after a failure
    GraphPtr graph(raw);
    TS_RETURN_IF_ERROR(enqueued);
    TS_CUDA_RETURN_IF_ERROR(end);
    return graph;
  }

  std::unique_ptr<NcclComm> comm_;
  bool comm_ok_ = true;
  cudaStream_t stream_ = nullptr;
  uint32_t* send_ = nullptr;
  uint32_t* recv_ = nullptr;
  uint32_t* aux_ = nullptr;  // case 2: launcher status; case 3: the echo of the window
};

// Case 1: the documented path (NCCL's "Using NCCL with CUDA Graphs"): expected to work, and the
// pipeline's host-driven transport depends on it, so a failure here fails the test.
TEST_F(NcclGraphsTest, SendRecvToSelfCapturedInAHostLaunchedGraph) {
  absl::StatusOr<GraphPtr> graph = WarmUpAndCaptureSendRecv();
  ASSERT_TRUE(graph.ok()) << Found(
      absl::StrCat("ncclSend/ncclRecv to self: capture fails: ", graph.status().ToString()));
  Finding(absl::StrCat("ncclSend/ncclRecv to self captured (ThreadLocal, after one eager run): ",
                       DescribeNodes(graph->get())));
  cudaGraphExec_t raw = nullptr;
  const cudaError_t inst = cudaGraphInstantiate(&raw, graph->get(), 0);
  ASSERT_EQ(inst, cudaSuccess) << Found(
      absl::StrCat("ncclSend/ncclRecv graph: cudaGraphInstantiate fails: ", CudaError(inst)));
  ExecPtr exec(raw);
  // A new send pattern before every launch: the graph must move the buffer's current contents.
  for (uint32_t seed : {11u, 12u, 13u}) {
    ASSERT_TRUE(Stage(send_, seed, recv_).ok());
    ASSERT_EQ(cudaGraphLaunch(exec.get(), stream_), cudaSuccess);
    const absl::Status waited = Wait();
    ASSERT_TRUE(waited.ok()) << Found("ncclSend/ncclRecv graph launch: " + waited.ToString());
    const std::string bad = Mismatch(recv_, seed);
    ASSERT_EQ(bad, "") << Found("ncclSend/ncclRecv graph launch: wrong data: " + bad);
  }
  Finding(
      "ncclSend/ncclRecv to self captured in a host-launched graph: works (data ok over 3 "
      "launches, the send buffer changed before each)");
}

// Case 2: the same capture instantiated for device launch. Expected to be refused (NCCL's nodes);
// recorded either way. If it instantiates, a device kernel tail-launches it and the data must hold.
TEST_F(NcclGraphsTest, SendRecvGraphInstantiatedForDeviceLaunch) {
  absl::StatusOr<GraphPtr> graph = WarmUpAndCaptureSendRecv();
  ASSERT_TRUE(graph.ok()) << graph.status();
  cudaGraphInstantiateParams params{};
  params.flags = cudaGraphInstantiateFlagDeviceLaunch;
  cudaGraphExec_t raw = nullptr;
  const cudaError_t inst = cudaGraphInstantiateWithParams(&raw, graph->get(), &params);
  if (inst != cudaSuccess) {
    (void)cudaGetLastError();
    cudaGraphNodeType t{};
    const bool typed = params.errNode_out != nullptr &&
                       cudaGraphNodeGetType(params.errNode_out, &t) == cudaSuccess;
    Finding(absl::StrCat("ncclSend/ncclRecv graph (", DescribeNodes(graph->get()),
                         "): cudaGraphInstantiate(DeviceLaunch) fails: ", CudaError(inst), ", ",
                         InstantiateResultName(params.result_out), " at ",
                         typed ? absl::StrCat("a ", NodeTypeName(t), " node") : "no named node"));
    return;  // the exploratory outcome; nothing to check
  }
  ExecPtr exec(raw);
  Finding("ncclSend/ncclRecv graph: cudaGraphInstantiate(DeviceLaunch) succeeds");
  ASSERT_EQ(cudaGraphUpload(exec.get(), stream_), cudaSuccess);
  int32_t* status = reinterpret_cast<int32_t*>(aux_);
  // A device graph can be launched only from a kernel running in a device graph: the launcher.
  absl::StatusOr<cudaGraphExec_t> launcher = graphs::CaptureForDeviceLaunch(
      [&](cudaStream_t s) { return testing::EnqueueTailLaunch(exec.get(), status, s); });
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  ExecPtr launcher_exec(*launcher);
  ASSERT_EQ(cudaGraphUpload(launcher_exec.get(), stream_), cudaSuccess);
  for (uint32_t seed : {21u, 22u}) {
    ASSERT_TRUE(Stage(send_, seed, recv_).ok());
    ASSERT_EQ(cudaMemsetAsync(status, 0xff, sizeof(int32_t), stream_), cudaSuccess);  // -1: not run
    ASSERT_EQ(cudaGraphLaunch(launcher_exec.get(), stream_), cudaSuccess);
    const absl::Status waited = Wait();  // a hang or a fault in the device-launched NCCL kernel
    ASSERT_TRUE(waited.ok()) << Found("... tail-launched from a device kernel: " +
                                      waited.ToString());
    if (const std::string refused = TailLaunchOutcome(status); !refused.empty()) {
      Finding("... the device-side cudaGraphLaunch(tail) of it fails: " + refused);
      return;
    }
    const std::string bad = Mismatch(recv_, seed);
    ASSERT_EQ(bad, "") << Found("... device-launched send/recv: wrong data: " + bad);
  }
  Finding(
      "ncclSend/ncclRecv to self in a DeviceLaunch graph tail-launched from a device kernel: works "
      "(data ok over 2 launches)");
}

// ---- Case 3: NCCL 2.28's device API (nccl_device.h). ----

// Small device words beside the buffers: the kernel reads the seed when it runs (so a graph's
// relaunch writes new data), the launcher writes its status, the store kernel its LSA pointer.
struct Scratch {
  uint32_t seed;
  int32_t status;
  unsigned long long lsa_address;
};

// The window and device communicator over an ncclMemAlloc buffer, torn down in reverse order.
class DeviceApiTest : public NcclGraphsTest {
 protected:
  void TearDown() override {
    if (comm_ok_ && dev_created_) {
      if (layout_ == Layout::kV22803) {
        (void)ncclDevCommDestroy(comm_->get(), reinterpret_cast<const ncclDevComm*>(&dev_v22803_));
      } else {
        (void)ncclDevCommDestroy(comm_->get(), &args_.dev);
      }
    }
    if (comm_ok_ && args_.window != nullptr) {
      (void)Settle(ncclCommWindowDeregister(comm_->get(), args_.window));
    }
    if (comm_ok_ && buffer_ != nullptr) (void)ncclMemFree(buffer_);
    if (comm_ok_ && scratch_ != nullptr) (void)cudaFree(scratch_);
    NcclGraphsTest::TearDown();
  }

  // Sets `ready_`, or prints a FINDING naming what refused (the comm may then be aborted).
  void SetUpDeviceApi() {
    int library = 0;
    (void)ncclGetVersion(&library);
    layout_ = LayoutOf(library);
    const std::string versions =
        absl::StrCat("NCCL library ", library, ", header ", NCCL_VERSION_CODE);
    if (layout_ == Layout::kUnknown) {
      Finding(absl::StrCat("device API: not tried: ", versions,
                           " have device-API structs this test does not know"));
      return;
    }
    ASSERT_EQ(cudaMalloc(&scratch_, sizeof(Scratch)), cudaSuccess);
    if (ncclResult_t r = ncclMemAlloc(&buffer_, kBytes); r != ncclSuccess) {
      buffer_ = nullptr;
      Finding(absl::StrCat("device API: ncclMemAlloc fails: ", ncclGetErrorString(r), ": ",
                           ncclGetLastError(comm_->get())));
      return;
    }
    const absl::Status reg = Settle(ncclCommWindowRegister(comm_->get(), buffer_, kBytes,
                                                           &args_.window, NCCL_WIN_COLL_SYMMETRIC));
    if (!reg.ok()) {
      args_.window = nullptr;
      Finding(absl::StrCat("device API: ncclCommWindowRegister fails: ", reg.ToString()));
      return;
    }
    // Without symmetric-memory support NCCL answers success with no window, or with a host-side
    // registration handle: a kernel must not dereference either.
    cudaPointerAttributes attr{};
    if (args_.window == nullptr || cudaPointerGetAttributes(&attr, args_.window) != cudaSuccess ||
        attr.type != cudaMemoryTypeDevice) {
      (void)cudaGetLastError();
      Finding("device API: ncclCommWindowRegister gave no device window (no symmetric memory)");
      return;
    }
    absl::Status created;
    if (layout_ == Layout::kV22803) {
      ReqsV22803 reqs{};
      reqs.lsaBarrierCount = 1;
      created = Settle(ncclDevCommCreate(comm_->get(),
                                         reinterpret_cast<const ncclDevCommRequirements*>(&reqs),
                                         reinterpret_cast<ncclDevComm*>(&dev_v22803_)));
      if (created.ok()) args_.dev = FromV22803(dev_v22803_);
    } else {
      ncclDevCommRequirements reqs;
      std::memset(&reqs, 0, sizeof(reqs));  // 2.28 has no initializer macro; zero means "none"
      reqs.lsaBarrierCount = 1;
      created = Settle(ncclDevCommCreate(comm_->get(), &reqs, &args_.dev));
    }
    if (!created.ok()) {
      Finding(absl::StrCat("device API: ncclDevCommCreate(lsaBarrierCount 1) fails: ",
                           created.ToString()));
      return;
    }
    dev_created_ = true;
    const ncclDevComm& d = args_.dev;
    const std::string fields =
        absl::StrCat("devComm rank ", d.rank, " of ", d.nRanks, ", lsaRank ", d.lsaRank, " of ",
                     d.lsaSize, ", lsaBarrier ", d.lsaBarrier.nBarriers);
    // A struct read in the wrong layout shows here, before a kernel trusts it.
    if (d.rank != 0 || d.nRanks != 1 || d.lsaRank != 0 || d.lsaSize != 1 ||
        d.lsaBarrier.nBarriers != 1) {
      Finding(absl::StrCat("device API (", versions, "): ncclDevCommCreate gave unexpected ",
                           fields, ": not launching"));
      ADD_FAILURE() << fields;
      return;
    }
    args_.barrier = true;
    args_.seed = &scratch_->seed;
    args_.n = kCount;
    args_.echo = aux_;
    args_.lsa_address = &scratch_->lsa_address;
    Finding(absl::StrCat("device API (", versions,
                         layout_ == Layout::kV22803 ? ", structs in 2.28.3's layout" : "",
                         "): ncclMemAlloc + ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC) + "
                         "ncclDevCommCreate(lsaBarrierCount 1) ok: ",
                         fields));
    ready_ = true;
  }

  // The seed for the next run; the window and the echo zeroed.
  absl::Status SetSeed(uint32_t seed) {
    TS_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(&scratch_->seed, &seed, sizeof(seed), cudaMemcpyHostToDevice, stream_));
    TS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(aux_, 0, kBytes, stream_));
    TS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(buffer_, 0, kBytes, stream_));
    return Wait();  // `seed` must outlive the copy
  }

  // After a run that reported success: the window (through the registered pointer) and the echo
  // (through ncclGetLocalPointer) must both hold the pattern; "" if so.
  std::string CheckRun(uint32_t seed) {
    std::string bad = Mismatch(static_cast<uint32_t*>(buffer_), seed);
    if (!bad.empty()) return absl::StrCat("the window: ", bad);
    bad = Mismatch(aux_, seed);
    if (!bad.empty()) return absl::StrCat("the local read-back: ", bad);
    unsigned long long lsa = 0;
    (void)cudaMemcpy(&lsa, &scratch_->lsa_address, sizeof(lsa), cudaMemcpyDeviceToHost);
    lsa_is_user_pointer_ = lsa == reinterpret_cast<uintptr_t>(buffer_);
    return "";
  }

  Layout layout_ = Layout::kUnknown;
  void* buffer_ = nullptr;
  Scratch* scratch_ = nullptr;
  DevCommV22803 dev_v22803_{};
  bool dev_created_ = false;
  bool ready_ = false;
  bool lsa_is_user_pointer_ = false;
  LsaStoreArgs args_;
};

// 3a: a normal kernel launch.
TEST_F(DeviceApiTest, LsaStoreAndBarrierFromANormalLaunch) {
  SetUpDeviceApi();
  if (!ready_) return;
  for (uint32_t seed : {31u, 32u}) {
    ASSERT_TRUE(SetSeed(seed).ok());
    ASSERT_EQ(testing::EnqueueLsaStore(args_, stream_), cudaSuccess);
    const absl::Status waited = Wait();
    ASSERT_TRUE(waited.ok()) << Found("device API, normal launch: " + waited.ToString());
    const std::string bad = CheckRun(seed);
    ASSERT_EQ(bad, "") << Found("device API, normal launch: wrong data: " + bad);
  }
  Finding(absl::StrCat(
      "LSA store to self (ncclGetLsaPointer) + ncclLsaBarrierSession sync from a normal kernel "
      "launch: works (data ok over 2 launches; the LSA pointer ",
      lsa_is_user_pointer_ ? "is" : "is not", " the registered pointer)"));
}

// 3b: the same kernel captured into a DeviceLaunch graph, launched from the host (as
// TailLauncher::Launch does) and tail-launched from a device kernel (as the device loop would).
TEST_F(DeviceApiTest, LsaStoreAndBarrierInADeviceLaunchedGraph) {
  SetUpDeviceApi();
  if (!ready_) return;
  absl::StatusOr<cudaGraphExec_t> exec = graphs::CaptureForDeviceLaunch(
      [&](cudaStream_t s) { return testing::EnqueueLsaStore(args_, s); });
  if (!exec.ok()) {
    Finding("device API kernel: capture + instantiate(DeviceLaunch) fails: " +
            exec.status().ToString());
    return;
  }
  ExecPtr store(*exec);
  ASSERT_EQ(cudaGraphUpload(store.get(), stream_), cudaSuccess);
  ASSERT_TRUE(SetSeed(41).ok());
  ASSERT_EQ(cudaGraphLaunch(store.get(), stream_), cudaSuccess);
  absl::Status waited = Wait();
  ASSERT_TRUE(waited.ok()) << Found("device API, DeviceLaunch graph from host: " +
                                    waited.ToString());
  std::string bad = CheckRun(41);
  ASSERT_EQ(bad, "") << Found("device API, DeviceLaunch graph from host: wrong data: " + bad);
  Finding(
      "LSA store + barrier in a DeviceLaunch-instantiated graph, host-launched: works (data ok)");

  int32_t* status = &scratch_->status;
  absl::StatusOr<cudaGraphExec_t> launcher = graphs::CaptureForDeviceLaunch(
      [&](cudaStream_t s) { return testing::EnqueueTailLaunch(store.get(), status, s); });
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  ExecPtr launcher_exec(*launcher);
  ASSERT_EQ(cudaGraphUpload(launcher_exec.get(), stream_), cudaSuccess);
  for (uint32_t seed : {42u, 43u}) {
    ASSERT_TRUE(SetSeed(seed).ok());
    ASSERT_EQ(cudaMemsetAsync(status, 0xff, sizeof(int32_t), stream_), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(launcher_exec.get(), stream_), cudaSuccess);
    waited = Wait();
    ASSERT_TRUE(waited.ok()) << Found("device API, tail-launched: " + waited.ToString());
    if (const std::string refused = TailLaunchOutcome(status); !refused.empty()) {
      Finding("device API: the device-side cudaGraphLaunch(tail) fails: " + refused);
      return;
    }
    bad = CheckRun(seed);
    ASSERT_EQ(bad, "") << Found("device API, tail-launched: wrong data: " + bad);
  }
  Finding(
      "LSA store + barrier in a DeviceLaunch graph tail-launched from a device kernel: works "
      "(data ok over 2 launches, the seed changed before each)");
}

}  // namespace
}  // namespace ts::pipeline
