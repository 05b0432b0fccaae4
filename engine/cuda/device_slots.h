// The slot table on the GPU (engine/README.md, the slot states and the ring protocol), apart from
// any model: the device slot rows the step kernels read and write (state, lengths, stop rule,
// sampling), each slot's block table, sampling counts and prompt mask, and in pinned host-mapped
// memory the token rings, the cancel and done flags and the staging a slot is published from.
//
// One per backend, on the GPU of the stage that holds the head (its prepare, sampling and
// postprocess kernels are the only ones that touch it); the other stages of a pipeline get each
// step's row inputs from that stage (docs/pipeline.md). Its device bytes count in that stage's
// memory plan (MemoryPlan::state_bytes), so the KV pool leaves room for it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/cuda/memory_plan.h"
#include "kernels/postprocess.cuh"

namespace ts {

class DeviceSlots {
 public:
  // Allocates and zeroes both blocks on the current device: every slot FREE, every ring empty.
  static absl::StatusOr<std::unique_ptr<DeviceSlots>> Create(const SlotShape& shape);
  ~DeviceSlots();
  DeviceSlots(const DeviceSlots&) = delete;
  DeviceSlots& operator=(const DeviceSlots&) = delete;

  const SlotShape& shape() const { return shape_; }
  const SlotDeviceLayout& dev() const { return dev_; }
  const SlotHostLayout& host() const { return host_; }          // CPU addresses
  const SlotHostLayout& host_dev() const { return host_dev_; }  // device aliases, for kernels

  // Publishes a slot's request to the device on `stream`: `row`, the block table (padded with
  // kInvalidKvBlock, since block 0 is someone's live block) and the prompt's token mask are
  // written into staging row `index` and copied to slot `slot`'s device rows, and its output
  // counts are zeroed. Staging row `index` must not be reused until the copies have run.
  absl::Status Stage(const kernels::SlotRow& row, std::span<const int32_t> block_table,
                     std::span<const int32_t> prompt, int32_t slot, int32_t index,
                     cudaStream_t stream) const;

 private:
  DeviceSlots() = default;
  SlotShape shape_;
  void* device_block_ = nullptr;  // [SlotDeviceBytes(shape_)]
  void* host_block_ = nullptr;    // [SlotHostBytes(shape_)] pinned, mapped
  SlotDeviceLayout dev_;
  SlotHostLayout host_;
  SlotHostLayout host_dev_;
};

}  // namespace ts
