#include "graphs/device_graph.h"

#include <memory>

#include "common/status.h"
#include "kernels/cuda_check.h"

namespace ts::graphs {
namespace {

struct GraphDeleter {
  void operator()(cudaGraph_t g) const { (void)cudaGraphDestroy(g); }
};

absl::StatusOr<cudaGraphExec_t> CaptureOn(const std::function<cudaError_t(cudaStream_t)>& enqueue,
                                          cudaStream_t capture) {
  TS_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(capture, cudaStreamCaptureModeThreadLocal));
  const cudaError_t launch = enqueue(capture);
  cudaGraph_t raw = nullptr;
  // Ends the capture even after a failed launch, so the stream is usable again.
  const cudaError_t end = cudaStreamEndCapture(capture, &raw);
  const std::unique_ptr<CUgraph_st, GraphDeleter> graph(raw);
  TS_CUDA_RETURN_IF_ERROR(launch);
  TS_CUDA_RETURN_IF_ERROR(end);
  cudaGraphExec_t exec = nullptr;
  TS_CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&exec, raw, cudaGraphInstantiateFlagDeviceLaunch));
  return exec;
}

}  // namespace

absl::StatusOr<cudaGraphExec_t> CaptureForDeviceLaunch(
    const std::function<cudaError_t(cudaStream_t)>& enqueue) {
  cudaStream_t capture = nullptr;
  TS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&capture, cudaStreamNonBlocking));
  absl::StatusOr<cudaGraphExec_t> exec = CaptureOn(enqueue, capture);
  (void)cudaStreamDestroy(capture);
  return exec;
}

}  // namespace ts::graphs
