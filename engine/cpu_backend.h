// The fp32 CPU backend: the Backend seam over models/' CpuModel, CpuKvPool and SampleToken. It
// keeps the slot table and ring semantics of the GPU design (docs/architecture.md, The decode
// loop), so CI exercises the whole engine without CUDA: Prefill samples each first token,
// Run(kOneStep) decodes every ACTIVE slot in one batched Forward, and the stop rule (CheckStop)
// runs after every token like the GPU's postprocess kernel. A token's logits never depend on its
// batch neighbours (CpuModel guarantees bit-identical rows), and sampling depends only on (seed,
// position), so streams are reproducible whatever the batch composition.
//
// With loop_thread, a thread of the backend's own plays the device-resident loop: Prefill only
// validates and hands the request over, and the thread runs the same prefill and step code at
// each step boundary while the engine thread admits, cancels and drains rings beside it. The two
// threads share only what the GPU loop shares with the host: rings, cancel flags, slot states.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/slot_table.h"
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
  // Decode on a loop thread of the backend's own (RunMode::kLoop only): Prefill returns before
  // the prompt is processed and tokens arrive in the rings while the engine thread works.
  bool loop_thread = false;
};

// What the CPU backend runs a batch through, KV included: the whole model with one pool
// (WholeModelForward), or pipeline stages each holding its own layers' KV
// (engine/pipeline/pipeline_forward.h). CpuModel::Forward's contract: rows in chunk order, a row
// never depends on its batch neighbours. One call at a time.
class CpuForward {
 public:
  virtual ~CpuForward() = default;
  virtual const ModelConfig& config() const = 0;
  virtual absl::Status Forward(std::span<const SeqChunk> chunks, LogitsMode mode,
                               std::vector<float>* logits) = 0;
};

// The whole model over a KV pool of `num_kv_blocks` blocks of `block_size` tokens.
std::unique_ptr<CpuForward> WholeModelForward(std::unique_ptr<CpuModel> model,
                                              int32_t num_kv_blocks, int32_t block_size);

// Checks `options` and returns the KV blocks a backend over a model of `config` holds
// (options.num_kv_blocks, or max_slots full-length sequences), or the error Create gives.
absl::StatusOr<int32_t> CpuKvBlocks(const ModelConfig& config, const CpuBackendOptions& options);

class CpuBackend : public Backend {
 public:
  // Takes ownership of a loaded model (tests share nothing; the server loads once).
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(std::unique_ptr<CpuModel> model,
                                                            const CpuBackendOptions& options);
  // Over any CpuForward, whose KV must hold CpuKvBlocks(forward->config(), options) blocks of
  // options.kv_block_size tokens.
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(std::unique_ptr<CpuForward> forward,
                                                            const CpuBackendOptions& options);
  ~CpuBackend() override;  // stops and joins the loop thread; a step in progress completes

  const BackendInfo& info() const override { return info_; }
  absl::Status Prefill(std::span<const SlotInit> slots) override;
  absl::Status Run(RunMode mode) override;
  absl::Status Pause() override;
  absl::StatusOr<LoopStatus> Poll() override;
  void Cancel(SlotId slot) override;
  const TokenRing& Ring(SlotId slot) const override;
  void Release(SlotId slot) override;
  StepReport last_step() const override;

  int32_t num_free_slots() const;
  // Test hook, set before the first Prefill: runs on the decoding thread at every step boundary,
  // before the cancel check, with the number of steps done so far and no lock held (it may call
  // Poll), so a test can park the loop at a known step.
  void set_step_hook(std::function<void(uint64_t steps)> hook) { step_hook_ = std::move(hook); }

 private:
  // A slot's request, beside its state, ring and cancel flag in table_ (engine/slot_table.h).
  // States are written by the decoding thread except FREE -> QUEUED (Prefill, with a loop thread;
  // host-driven the slot goes FREE -> ACTIVE) and FINISHED -> FREE (Release).
  struct Slot {
    // The decoding thread's own (the engine thread's when host-driven).
    std::vector<int32_t> prompt;       // [prompt_len]
    std::vector<int32_t> output;       // [generated]
    std::vector<int32_t> block_table;  // [ceil((prompt_len + max_new_tokens) / block_size)]
    SamplingParams sampling;
    StopParams stop;
    uint32_t seq = 0;  // last seq pushed to the ring
  };
  // A prefill with its own copy of the request (SlotInit's spans point into the caller's memory).
  struct PrefillJob {
    SlotId slot = -1;
    std::vector<int32_t> prompt;
    std::vector<int32_t> block_table;
    SamplingParams sampling;
    StopParams stop;
  };
  enum class PauseState : uint8_t { kRunning, kPausing, kPaused };

  CpuBackend(std::unique_ptr<CpuForward> forward, const CpuBackendOptions& options,
             int32_t num_kv_blocks);
  absl::Status ValidateInits(std::span<const SlotInit> inits) const;
  // One Forward over the new prompts, then each slot ACTIVE with its first token in the ring.
  absl::Status StartSlots(std::span<PrefillJob> jobs);
  // Samples the next token from `logits` ([vocab]), pushes it and applies the stop rule.
  void SampleAndPush(SlotId slot, std::span<float> logits);
  // One decode step over the ACTIVE slots; cancelled ones get their finish-only entry instead.
  absl::StatusOr<int32_t> OneStep();  // rows decoded
  void LoopMain();
  bool LoopHasWorkLocked() const;  // mu_ held
  bool AnyActive() const;

  std::unique_ptr<CpuForward> forward_;
  std::vector<int32_t> buckets_;
  BackendInfo info_;
  std::vector<Slot> slots_;  // [max_slots]
  SlotTable table_;
  std::vector<float> logits_;  // [rows][vocab], reused by the decoding thread
  std::function<void(uint64_t)> step_hook_;
  std::atomic<uint64_t> steps_{0};  // decode steps with at least one row

  // Shared between the engine thread and the loop thread.
  mutable std::mutex mu_;
  std::condition_variable work_cv_;    // the loop thread waits here for work or a pause request
  std::condition_variable paused_cv_;  // Pause waits here for the loop to reach a boundary
  std::vector<PrefillJob> pending_;    // handed over by Prefill, taken at the next step boundary
  PauseState pause_ = PauseState::kRunning;
  uint64_t loop_launches_ = 0;  // the loop thread's start, then each Run(kLoop) after a Pause
  absl::Status loop_error_;     // sticky: the first failed Forward on the loop thread
  bool stop_ = false;
  StepReport last_;

  std::thread loop_;  // last: started once everything above exists
};

// Loads options.model_dir and builds the backend.
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(const CpuBackendOptions& options);

}  // namespace ts
