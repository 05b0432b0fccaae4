#include "bench/graphs/while_switch.h"

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda_check.h"

namespace ts::graphs::bench {
namespace {

struct SchedulerArgs {
  WhileSwitchParams p;
  cudaGraphConditionalHandle loop = 0;  // the WHILE node's
  cudaGraphConditionalHandle body = 0;  // the SWITCH node's
};

// One thread, once per WHILE iteration, before the SWITCH. Both handles are set on every path:
// a WHILE handle left at 1 would spin the GPU forever.
__global__ void WhileSwitchScheduler(SchedulerArgs a) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  unsigned int body = static_cast<unsigned int>(a.p.num_bodies);  // >= size: the SWITCH runs none
  bool more = false;
  if (*a.p.remaining_steps > 0) {
    const int32_t b = *a.p.body_index;
    if (b >= 0 && b < a.p.num_bodies) {
      body = static_cast<unsigned int>(b);
      *a.p.remaining_steps -= 1;
      more = *a.p.remaining_steps > 0;
    } else if (*a.p.status == 0) {
      *a.p.status = kWhileSwitchBadBody;
    }
  }
  cudaGraphSetConditional(a.body, body);
  cudaGraphSetConditional(a.loop, more ? 1u : 0u);
}

struct GraphDeleter {
  void operator()(cudaGraph_t g) const { (void)cudaGraphDestroy(g); }
};

absl::Status Validate(const WhileSwitchParams& p) {
  if (p.body_index == nullptr) return absl::InvalidArgumentError("while_switch.body_index is null");
  if (p.remaining_steps == nullptr) {
    return absl::InvalidArgumentError("while_switch.remaining_steps is null");
  }
  if (p.status == nullptr) return absl::InvalidArgumentError("while_switch.status is null");
  if (p.num_bodies < 1 || p.num_bodies > kWhileSwitchMaxBodies) {
    return absl::InvalidArgumentError(absl::StrCat("while_switch.num_bodies must be in [1, ",
                                                   kWhileSwitchMaxBodies, "], got ", p.num_bodies));
  }
  return absl::OkStatus();
}

cudaGraphNodeParams ConditionalNode(cudaGraphConditionalHandle handle,
                                    cudaGraphConditionalNodeType type, int32_t size) {
  cudaGraphNodeParams n = {};  // the reserved fields must be zero
  n.type = cudaGraphNodeTypeConditional;
  n.conditional.handle = handle;
  n.conditional.type = type;
  n.conditional.size = static_cast<unsigned int>(size);
  return n;
}

absl::StatusOr<cudaGraph_t> BodyGraph(const cudaGraphNodeParams& node, int32_t i) {
  if (node.conditional.phGraph_out == nullptr || node.conditional.phGraph_out[i] == nullptr) {
    return absl::InternalError(absl::StrCat("conditional node returned no body graph ", i));
  }
  return node.conditional.phGraph_out[i];
}

absl::Status CaptureBody(cudaGraph_t graph, int32_t body, const WhileSwitchBodyFn& enqueue,
                         cudaStream_t capture) {
  TS_CUDA_RETURN_IF_ERROR(cudaStreamBeginCaptureToGraph(capture, graph, nullptr, nullptr, 0,
                                                        cudaStreamCaptureModeThreadLocal));
  const absl::Status enqueued = enqueue(body, capture);
  cudaGraph_t captured = nullptr;
  // Ends the capture even after a failed enqueue, so the stream is usable again.
  const cudaError_t end = cudaStreamEndCapture(capture, &captured);
  TS_RETURN_IF_ERROR(enqueued);
  TS_CUDA_RETURN_IF_ERROR(end);
  if (captured != graph) {
    return absl::InternalError(
        absl::StrCat("capture of SWITCH body ", body, " ended in another graph than the body's"));
  }
  return absl::OkStatus();
}

// Adds WHILE { scheduler -> SWITCH { bodies } } to the empty `root`; returns each body's node
// count. The graphs the conditional nodes hand out belong to `root`.
absl::StatusOr<std::vector<int64_t>> Populate(cudaGraph_t root, const WhileSwitchParams& p,
                                              const WhileSwitchBodyFn& enqueue,
                                              cudaStream_t capture) {
  // Default 1, re-applied at every launch: each launch enters the loop, the scheduler decides.
  cudaGraphConditionalHandle loop = 0;
  TS_CUDA_RETURN_IF_ERROR(
      cudaGraphConditionalHandleCreate(&loop, root, 1, cudaGraphCondAssignDefault));
  cudaGraphNodeParams while_params = ConditionalNode(loop, cudaGraphCondTypeWhile, 1);
  cudaGraphNode_t while_node = nullptr;
  TS_CUDA_RETURN_IF_ERROR(cudaGraphAddNode(&while_node, root, nullptr, nullptr, 0, &while_params));
  TS_ASSIGN_OR_RETURN(cudaGraph_t loop_body, BodyGraph(while_params, 0));

  // On the graph that holds the SWITCH. No default: the scheduler, upstream of the SWITCH in the
  // same iteration, sets it every time.
  cudaGraphConditionalHandle body = 0;
  TS_CUDA_RETURN_IF_ERROR(cudaGraphConditionalHandleCreate(&body, loop_body, 0, 0));
  SchedulerArgs args{.p = p, .loop = loop, .body = body};
  void* kernel_args[] = {&args};  // copied by cudaGraphAddNode
  cudaGraphNodeParams kernel = {};
  kernel.type = cudaGraphNodeTypeKernel;
  kernel.kernel.func = reinterpret_cast<void*>(&WhileSwitchScheduler);
  kernel.kernel.gridDim = dim3(1, 1, 1);
  kernel.kernel.blockDim = dim3(1, 1, 1);
  kernel.kernel.sharedMemBytes = 0;
  kernel.kernel.kernelParams = kernel_args;
  kernel.kernel.extra = nullptr;
  cudaGraphNode_t scheduler = nullptr;
  TS_CUDA_RETURN_IF_ERROR(cudaGraphAddNode(&scheduler, loop_body, nullptr, nullptr, 0, &kernel));

  cudaGraphNodeParams switch_params = ConditionalNode(body, cudaGraphCondTypeSwitch, p.num_bodies);
  cudaGraphNode_t switch_node = nullptr;
  TS_CUDA_RETURN_IF_ERROR(
      cudaGraphAddNode(&switch_node, loop_body, &scheduler, nullptr, 1, &switch_params));
  std::vector<cudaGraph_t> bodies;
  for (int32_t i = 0; i < p.num_bodies; ++i) {
    TS_ASSIGN_OR_RETURN(cudaGraph_t g, BodyGraph(switch_params, i));
    bodies.push_back(g);
  }
  std::vector<int64_t> nodes;
  for (int32_t i = 0; i < p.num_bodies; ++i) {
    TS_RETURN_IF_ERROR(CaptureBody(bodies[i], i, enqueue, capture));
    size_t n = 0;
    TS_CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(bodies[i], nullptr, &n));
    nodes.push_back(static_cast<int64_t>(n));
  }
  return nodes;
}

absl::StatusOr<cudaGraphExec_t> Instantiate(cudaGraph_t root) {
  cudaGraphInstantiateParams ip = {};  // flags 0: host launch; conditional nodes allow no other
  cudaGraphExec_t exec = nullptr;
  const cudaError_t rc = cudaGraphInstantiateWithParams(&exec, root, &ip);
  if (rc != cudaSuccess || ip.result_out != cudaGraphInstantiateSuccess) {
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
    const absl::Status s =
        ::ts::kernels::CudaErrorToStatus(rc == cudaSuccess ? cudaErrorUnknown : rc,
                                         "cudaGraphInstantiateWithParams", __FILE__, __LINE__);
    return absl::Status(s.code(), absl::StrCat(s.message(), ", cudaGraphInstantiateResult ",
                                               static_cast<int>(ip.result_out)));
  }
  return exec;
}

}  // namespace

absl::StatusOr<std::unique_ptr<WhileSwitchLoop>> WhileSwitchLoop::Create(
    const WhileSwitchParams& params, const WhileSwitchBodyFn& body, cudaStream_t stream) {
  TS_RETURN_IF_ERROR(Validate(params));
  cudaGraph_t raw = nullptr;
  TS_CUDA_RETURN_IF_ERROR(cudaGraphCreate(&raw, 0));
  const std::unique_ptr<CUgraph_st, GraphDeleter> root(raw);
  // Private: capture-to-graph needs a stream nothing else enqueues on.
  cudaStream_t capture = nullptr;
  TS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&capture, cudaStreamNonBlocking));
  absl::StatusOr<std::vector<int64_t>> nodes = Populate(raw, params, body, capture);
  (void)cudaStreamDestroy(capture);
  if (!nodes.ok()) return nodes.status();
  TS_ASSIGN_OR_RETURN(cudaGraphExec_t exec, Instantiate(raw));
  // The exec is independent of `root` from here on; the unique_ptr frees the graph.
  std::unique_ptr<WhileSwitchLoop> loop(new WhileSwitchLoop(exec, std::move(*nodes)));
  TS_CUDA_RETURN_IF_ERROR(cudaGraphUpload(loop->exec_, stream));
  return loop;
}

WhileSwitchLoop::~WhileSwitchLoop() {
  if (exec_ != nullptr) (void)cudaGraphExecDestroy(exec_);
}

absl::Status WhileSwitchLoop::Launch(cudaStream_t stream) {
  TS_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec_, stream));
  return absl::OkStatus();
}

}  // namespace ts::graphs::bench
