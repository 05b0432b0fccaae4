// The while_switch mode of tailserve-graph-bench: the step loop as ONE host-launched graph,
//   WHILE (loop handle) { scheduler kernel (one thread) -> SWITCH (body handle) { K step bodies } }
// the alternative to the device tail-launch loop that conditional nodes offer (issue #13). It
// cannot replace the tail-launch loop inside a device graph: conditional nodes refuse
// cudaGraphInstantiateFlagDeviceLaunch (docs/gpu-facts.md), so this graph is host-launched once
// per run and the loop lives in the conditional node.
//
// The scheduler mirrors TailLaunchKernel (graphs/tail_launch.cu): it reads the body index from
// device memory every step, decrements *remaining_steps, and stops when it reaches 0; a bad index
// stops the loop and lands in *status instead of running nothing forever. Every path through it
// sets both handles, so the WHILE node ends after at most *remaining_steps + 1 iterations.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ts::graphs::bench {

// Written to WhileSwitchParams::status when *body_index is outside [0, num_bodies).
inline constexpr int32_t kWhileSwitchBadBody = -1;
inline constexpr int32_t kWhileSwitchMaxBodies = 64;

struct WhileSwitchParams {
  const int32_t* body_index = nullptr;  // [1], device: the SWITCH body to run, read every step
  int32_t* remaining_steps = nullptr;   // [1], device: steps left; the loop runs while > 0
  int32_t* status = nullptr;            // [1], device: 0, or kWhileSwitchBadBody; caller zeroes it
  int32_t num_bodies = 0;               // in [1, kWhileSwitchMaxBodies]
};

// Enqueues SWITCH body `body` on `stream`, which is capturing into that body's graph. Must only
// enqueue kernels (and memsets/copies): conditional bodies hold nothing else.
using WhileSwitchBodyFn = std::function<absl::Status(int32_t body, cudaStream_t stream)>;

class WhileSwitchLoop {
 public:
  // Builds the graph (explicit nodes for the WHILE, the scheduler and the SWITCH; each body
  // captured with cudaStreamBeginCaptureToGraph on a private stream), instantiates it for host
  // launch and uploads it on `stream`. Any failing CUDA call comes back as a status that names
  // the call and carries cudaGetErrorString.
  static absl::StatusOr<std::unique_ptr<WhileSwitchLoop>> Create(const WhileSwitchParams& params,
                                                                 const WhileSwitchBodyFn& body,
                                                                 cudaStream_t stream);
  ~WhileSwitchLoop();
  WhileSwitchLoop(const WhileSwitchLoop&) = delete;
  WhileSwitchLoop& operator=(const WhileSwitchLoop&) = delete;

  // One host launch runs the whole loop: *remaining_steps steps of the body *body_index.
  absl::Status Launch(cudaStream_t stream);

  // Nodes each body graph got from its capture, [num_bodies].
  const std::vector<int64_t>& body_nodes() const { return body_nodes_; }

 private:
  WhileSwitchLoop(cudaGraphExec_t exec, std::vector<int64_t> body_nodes)
      : exec_(exec), body_nodes_(std::move(body_nodes)) {}
  cudaGraphExec_t exec_;
  std::vector<int64_t> body_nodes_;
};

}  // namespace ts::graphs::bench
