// The fp32 CPU backend: the Backend seam over models/' CpuModel, CpuKvPool and SampleToken. It
// keeps the slot table and ring semantics of the GPU design (docs/architecture.md, The decode
// loop), so CI exercises the whole engine without CUDA: Prefill samples each first token,
// Run(kOneStep) decodes every ACTIVE slot in one batched Forward, and the stop rule (CheckStop)
// runs after every token like the GPU's postprocess kernel. A token's logits never depend on its
// batch neighbours (CpuModel guarantees bit-identical rows), and sampling depends only on (seed,
// position), so streams are reproducible whatever the batch composition.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "models/cpu_model.h"

namespace ts {

struct CpuBackendOptions {
  std::filesystem::path model_dir;
  int32_t max_slots = 64;
  // 0 = enough for max_slots sequences of max_position_embeddings tokens each.
  int32_t num_kv_blocks = 0;
  int32_t kv_block_size = 16;
  // Sorted ascending; the largest must be >= max_slots (reported through last_step()).
  std::vector<int32_t> buckets = {1, 2, 4, 8, 16, 24, 32, 48, 64};
  int num_threads = 0;  // CpuModel threads; 0 = hardware concurrency
  uint32_t ring_capacity = 1024;
  // The fp32 KV pool is allocated up front; a pool above this is refused with a message instead of
  // failing the allocation (a long-context model's default pool can be hundreds of GiB).
  int64_t max_kv_bytes = int64_t{8} << 30;
};

class CpuBackend : public Backend {
 public:
  // Takes ownership of a loaded model (tests share nothing; the server loads once).
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(std::unique_ptr<CpuModel> model,
                                                            const CpuBackendOptions& options);
  ~CpuBackend() override;

  const BackendInfo& info() const override { return info_; }
  absl::Status Prefill(std::span<const SlotInit> slots) override;
  absl::Status Run(RunMode mode) override;
  void Cancel(SlotId slot) override;
  const TokenRing& Ring(SlotId slot) const override;
  void Release(SlotId slot) override;
  StepReport last_step() const override { return last_; }

  int32_t num_free_slots() const;

 private:
  enum class SlotState : uint8_t { kFree, kActive, kFinished };
  struct Slot {
    SlotState state = SlotState::kFree;
    std::atomic<bool> cancel{false};
    std::vector<int32_t> prompt;       // [prompt_len]
    std::vector<int32_t> output;       // [generated]
    std::vector<int32_t> block_table;  // [ceil((prompt_len + max_new_tokens) / block_size)]
    SamplingParams sampling;
    StopParams stop;
    uint32_t seq = 0;  // last seq pushed to the ring
    TokenRing ring;
  };

  CpuBackend(std::unique_ptr<CpuModel> model, const CpuBackendOptions& options,
             int32_t num_kv_blocks);
  absl::Status ValidateInit(const SlotInit& init) const;
  // Samples the next token from `logits` ([vocab]), pushes it and applies the stop rule.
  void SampleAndPush(Slot& s, std::span<float> logits);
  absl::Status OneStep();

  std::unique_ptr<CpuModel> model_;
  CpuKvPool kv_;
  std::vector<int32_t> buckets_;
  BackendInfo info_;
  std::vector<Slot> slots_;         // [max_slots]
  std::vector<RingEntry> storage_;  // [max_slots][ring_capacity]
  std::vector<float> logits_;       // [rows][vocab], reused
  StepReport last_;
};

// Loads options.model_dir and builds the backend.
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(const CpuBackendOptions& options);

}  // namespace ts
