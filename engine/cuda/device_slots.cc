#include "engine/cuda/device_slots.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda_check.h"
#include "kernels/kv_layout.cuh"

namespace ts {

absl::StatusOr<std::unique_ptr<DeviceSlots>> DeviceSlots::Create(const SlotShape& shape) {
  if (shape.max_slots < 1 || shape.max_blocks_per_seq < 1 || shape.vocab < 1 ||
      shape.ring_capacity < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceSlots: max_slots ", shape.max_slots, ", max_blocks_per_seq ",
                     shape.max_blocks_per_seq, ", vocab ", shape.vocab, " must be >= 1 and ",
                     "ring_capacity ", shape.ring_capacity, " >= 2"));
  }
  std::unique_ptr<DeviceSlots> s(new DeviceSlots());
  s->shape_ = shape;
  const size_t device_bytes = SlotDeviceBytes(shape);
  const size_t host_bytes = SlotHostBytes(shape);
  if (cudaError_t e = cudaMalloc(&s->device_block_, device_bytes); e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc of the ", device_bytes,
                                                     "-byte slot table failed (",
                                                     cudaGetErrorString(e), ")"));
  }
  TS_CUDA_RETURN_IF_ERROR(cudaMemset(s->device_block_, 0, device_bytes));
  TS_CUDA_RETURN_IF_ERROR(
      cudaHostAlloc(&s->host_block_, host_bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(s->host_block_, 0, host_bytes);
  void* alias = nullptr;
  TS_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&alias, s->host_block_, 0));
  s->dev_ = CarveSlotDevice(shape, s->device_block_);
  s->host_ = CarveSlotHost(shape, s->host_block_);
  s->host_dev_ = CarveSlotHost(shape, alias);
  return s;
}

DeviceSlots::~DeviceSlots() {
  // The owner has synchronised the streams that use the table before destroying it.
  if (device_block_ != nullptr) cudaFree(device_block_);
  if (host_block_ != nullptr) cudaFreeHost(host_block_);
}

absl::Status DeviceSlots::Stage(const kernels::SlotRow& row, std::span<const int32_t> block_table,
                                std::span<const int32_t> prompt, int32_t slot, int32_t index,
                                cudaStream_t stream) const {
  if (slot < 0 || slot >= shape_.max_slots || index < 0 || index >= shape_.max_slots) {
    return absl::InternalError(absl::StrCat("DeviceSlots::Stage: slot ", slot, " or staging row ",
                                            index, " outside ", shape_.max_slots, " slots"));
  }
  const size_t mb = shape_.max_blocks_per_seq;
  const size_t words = shape_.mask_words();
  kernels::SlotRow& staged = host_.slot_rows[index];
  staged = row;
  int32_t* table = host_.block_tables + index * mb;
  const size_t copy = std::min(block_table.size(), mb);
  std::copy_n(block_table.begin(), copy, table);
  std::fill(table + copy, table + mb, kernels::kInvalidKvBlock);
  uint32_t* mask = host_.prompt_mask + index * words;
  std::fill(mask, mask + words, 0u);
  for (int32_t t : prompt) mask[t / 32] |= 1u << (t % 32);

  const size_t s = static_cast<size_t>(slot);
  TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dev_.slots + s, &staged, sizeof(kernels::SlotRow),
                                          cudaMemcpyHostToDevice, stream));
  TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dev_.block_tables + s * mb, table, mb * sizeof(int32_t),
                                          cudaMemcpyHostToDevice, stream));
  TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dev_.prompt_mask + s * words, mask,
                                          words * sizeof(uint32_t), cudaMemcpyHostToDevice,
                                          stream));
  TS_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(dev_.output_counts + s * shape_.vocab, 0,
                      static_cast<size_t>(shape_.vocab) * sizeof(*dev_.output_counts), stream));
  return absl::OkStatus();
}

}  // namespace ts
