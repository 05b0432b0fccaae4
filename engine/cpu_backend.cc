#include "engine/cpu_backend.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "models/sampling.h"

namespace ts {

namespace {

class WholeModel final : public CpuForward {
 public:
  WholeModel(std::unique_ptr<CpuModel> model, int32_t num_kv_blocks, int32_t block_size)
      : model_(std::move(model)), kv_(model_->config(), num_kv_blocks, block_size) {}
  const ModelConfig& config() const override { return model_->config(); }
  absl::Status Forward(std::span<const SeqChunk> chunks, LogitsMode mode,
                       std::vector<float>* logits) override {
    return model_->Forward(chunks, kv_, mode, logits);
  }

 private:
  std::unique_ptr<CpuModel> model_;
  CpuKvPool kv_;
};

}  // namespace

std::unique_ptr<CpuForward> WholeModelForward(std::unique_ptr<CpuModel> model,
                                              int32_t num_kv_blocks, int32_t block_size) {
  return std::make_unique<WholeModel>(std::move(model), num_kv_blocks, block_size);
}

absl::StatusOr<int32_t> CpuKvBlocks(const ModelConfig& config, const CpuBackendOptions& options) {
  if (options.max_slots < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_slots: must be >= 1, got ", options.max_slots));
  }
  if (options.kv_block_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_block_size: must be >= 1, got ", options.kv_block_size));
  }
  if (options.num_kv_blocks < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_kv_blocks: must be >= 0, got ", options.num_kv_blocks));
  }
  int64_t blocks = options.num_kv_blocks;
  if (blocks == 0) {
    const int64_t per_seq =
        (config.max_position_embeddings + options.kv_block_size - 1) / options.kv_block_size;
    blocks = per_seq * options.max_slots;
  }
  if (blocks < 1 || blocks > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("num_kv_blocks: ", blocks, " out of range"));
  }
  // K and V, fp32, every layer and kv head (summed over the stages of a pipeline).
  const int64_t bytes_per_block = int64_t{2} * sizeof(float) * config.num_layers *
                                  config.num_kv_heads * config.head_dim * options.kv_block_size;
  if (blocks * bytes_per_block > options.max_kv_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "num_kv_blocks: ", blocks, " blocks of ", options.kv_block_size, " tokens need ",
        blocks * bytes_per_block, " bytes of fp32 KV, above max_kv_bytes ", options.max_kv_bytes,
        "; set num_kv_blocks (", options.max_kv_bytes / bytes_per_block, " fit)"));
  }
  return static_cast<int32_t>(blocks);
}

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(std::unique_ptr<CpuModel> model,
                                                               const CpuBackendOptions& options) {
  if (model == nullptr) return absl::InvalidArgumentError("model: null");
  TS_ASSIGN_OR_RETURN(const int32_t blocks, CpuKvBlocks(model->config(), options));
  return Create(WholeModelForward(std::move(model), blocks, options.kv_block_size), options);
}

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(std::unique_ptr<CpuForward> forward,
                                                               const CpuBackendOptions& options) {
  if (forward == nullptr) return absl::InvalidArgumentError("forward: null");
  TS_ASSIGN_OR_RETURN(const int32_t blocks, CpuKvBlocks(forward->config(), options));
  if (options.ring_capacity < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring_capacity: must be >= 2, got ", options.ring_capacity));
  }
  TS_RETURN_IF_ERROR(ValidateBuckets(options.buckets));
  if (options.buckets.back() < options.max_slots) {
    return absl::InvalidArgumentError(absl::StrCat(
        "buckets: largest bucket ", options.buckets.back(), " < max_slots ", options.max_slots));
  }
  return std::unique_ptr<CpuBackend>(new CpuBackend(std::move(forward), options, blocks));
}

CpuBackend::CpuBackend(std::unique_ptr<CpuForward> forward, const CpuBackendOptions& options,
                       int32_t num_kv_blocks)
    : forward_(std::move(forward)),
      buckets_(options.buckets),
      slots_(options.max_slots),
      table_(options.max_slots, options.ring_capacity) {
  info_.model = forward_->config();
  info_.max_slots = options.max_slots;
  info_.kv_block_size = options.kv_block_size;
  info_.num_kv_blocks = num_kv_blocks;
  info_.ring_capacity = options.ring_capacity;
  info_.name = "cpu";
  if (options.loop_thread) {
    loop_launches_ = 1;
    loop_ = std::thread([this] { LoopMain(); });
  }
}

CpuBackend::~CpuBackend() {
  if (!loop_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  paused_cv_.notify_all();
  loop_.join();
}

absl::Status CpuBackend::ValidateInits(std::span<const SlotInit> inits) const {
  for (size_t i = 0; i < inits.size(); ++i) {
    const SlotInit& in = inits[i];
    TS_RETURN_IF_ERROR(ValidateSlotInit(in, info_));
    if (table_.state(in.slot) != SlotState::kFree) {
      return absl::FailedPreconditionError(absl::StrCat("prefill slot ", in.slot, ": not FREE"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (inits[j].slot == in.slot) {
        return absl::InvalidArgumentError(absl::StrCat("prefill slot ", in.slot, ": listed twice"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Prefill(std::span<const SlotInit> inits) {
  if (inits.empty()) return absl::OkStatus();
  TS_RETURN_IF_ERROR(ValidateInits(inits));
  std::vector<PrefillJob> jobs;
  jobs.reserve(inits.size());
  for (const SlotInit& in : inits) {
    // The slot is FREE, so no thread writes its ring: the engine may read it from seq 1 at once.
    table_.ResetForRequest(in.slot);
    jobs.push_back(PrefillJob{.slot = in.slot,
                              .prompt = {in.prompt.begin(), in.prompt.end()},
                              .block_table = {in.block_table.begin(), in.block_table.end()},
                              .sampling = in.sampling,
                              .stop = in.stop});
  }
  if (!loop_.joinable()) return StartSlots(jobs);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!loop_error_.ok()) return loop_error_;
    for (PrefillJob& job : jobs) {
      table_.set_state(job.slot, SlotState::kQueued);
      pending_.push_back(std::move(job));
    }
  }
  work_cv_.notify_one();
  return absl::OkStatus();
}

absl::Status CpuBackend::StartSlots(std::span<PrefillJob> jobs) {
  if (jobs.empty()) return absl::OkStatus();
  std::vector<SeqChunk> chunks;
  chunks.reserve(jobs.size());
  for (const PrefillJob& job : jobs) {
    chunks.push_back(
        SeqChunk{.tokens = job.prompt, .start_pos = 0, .block_table = job.block_table});
  }
  // One Forward over every new prompt; host-driven, a failure leaves all these slots FREE.
  TS_RETURN_IF_ERROR(forward_->Forward(chunks, LogitsMode::kLastPerChunk, &logits_));
  const size_t vocab = static_cast<size_t>(info_.model.vocab_size);
  for (size_t i = 0; i < jobs.size(); ++i) {
    PrefillJob& job = jobs[i];
    Slot& s = slots_[job.slot];
    s.prompt = std::move(job.prompt);
    s.output.clear();
    s.output.reserve(job.stop.max_new_tokens);
    s.block_table = std::move(job.block_table);
    s.sampling = job.sampling;
    s.stop = std::move(job.stop);
    s.seq = 0;
    table_.set_state(job.slot, SlotState::kActive);
    SampleAndPush(job.slot, std::span<float>(logits_.data() + i * vocab, vocab));
  }
  return absl::OkStatus();
}

void CpuBackend::SampleAndPush(SlotId slot, std::span<float> logits) {
  Slot& s = slots_[slot];
  // SampleToken samples at position prompt_len + generated, the token's absolute position.
  const int32_t token = SampleToken(logits, s.sampling, s.prompt, s.output);
  const int32_t index = static_cast<int32_t>(s.output.size());
  s.output.push_back(token);
  const FinishReason reason = CheckStop(s.stop, info_.model.eos_token_ids, token, index);
  if (reason != FinishReason::kNone) table_.set_state(slot, SlotState::kFinished);
  table_.ring(slot).Push(++s.seq, token, RingFlags(reason));
}

absl::StatusOr<int32_t> CpuBackend::OneStep() {
  if (step_hook_) step_hook_(steps_.load(std::memory_order_relaxed));
  std::vector<SlotId> decode;
  for (SlotId i = 0; i < info_.max_slots; ++i) {
    Slot& s = slots_[i];
    if (table_.state(i) != SlotState::kActive) continue;
    if (table_.cancelled(i)) {
      table_.set_state(i, SlotState::kFinished);
      table_.ring(i).Push(++s.seq, -1, RingFlags(FinishReason::kCancelled));
      continue;
    }
    if (s.stop.deadline != std::chrono::steady_clock::time_point{} &&
        std::chrono::steady_clock::now() >= s.stop.deadline) {
      table_.set_state(i, SlotState::kFinished);
      table_.ring(i).Push(++s.seq, -1, RingFlags(FinishReason::kDeadline));
      continue;
    }
    decode.push_back(i);
  }
  const int32_t n = static_cast<int32_t>(decode.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    last_ = StepReport{.active = n, .bucket = PickBucket(buckets_, n)};
  }
  if (n == 0) return 0;
  std::vector<SeqChunk> chunks;
  chunks.reserve(n);
  for (SlotId i : decode) {
    const Slot& s = slots_[i];
    // The last sampled token is not in the cache yet; it goes in at its own position.
    chunks.push_back(
        SeqChunk{.tokens = std::span<const int32_t>(&s.output.back(), 1),
                 .start_pos = static_cast<int32_t>(s.prompt.size() + s.output.size() - 1),
                 .block_table = s.block_table});
  }
  TS_RETURN_IF_ERROR(forward_->Forward(chunks, LogitsMode::kLastPerChunk, &logits_));
  // Counted before the tokens are pushed: whoever has read a step's token sees the step counted.
  steps_.fetch_add(1, std::memory_order_relaxed);
  const size_t vocab = static_cast<size_t>(info_.model.vocab_size);
  for (int32_t r = 0; r < n; ++r) {
    SampleAndPush(decode[r], std::span<float>(logits_.data() + r * vocab, vocab));
  }
  return n;
}

bool CpuBackend::AnyActive() const {
  return table_.Any(SlotState::kActive);
}

bool CpuBackend::LoopHasWorkLocked() const {
  if (!loop_error_.ok() || pause_ == PauseState::kPaused) return false;
  // A pause request wakes the loop even when idle, so that Pause has a boundary to wait for.
  return pause_ == PauseState::kPausing || !pending_.empty() || AnyActive();
}

// The loop thread. Each pass is one step boundary: take every pending prefill, run it, then one
// decode step unless a pause was asked for. Only the loop thread makes slots ACTIVE or FINISHED,
// so AnyActive() read under mu_ is exact here and the wait cannot miss work.
void CpuBackend::LoopMain() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [&] { return stop_ || LoopHasWorkLocked(); });
    if (stop_) return;
    std::vector<PrefillJob> jobs = std::exchange(pending_, {});
    const bool pausing = pause_ == PauseState::kPausing;
    lock.unlock();
    absl::Status status = StartSlots(jobs);
    if (status.ok() && !pausing) status = OneStep().status();
    lock.lock();
    if (!status.ok()) loop_error_ = status;
    if (pausing && pause_ == PauseState::kPausing) pause_ = PauseState::kPaused;
    if (pausing || !status.ok()) paused_cv_.notify_all();
  }
}

absl::Status CpuBackend::Run(RunMode mode) {
  if (loop_.joinable()) {
    if (mode != RunMode::kLoop) {
      return absl::FailedPreconditionError(
          "cpu backend: Run(kOneStep) on a loop_thread backend; its loop decodes (kLoop)");
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!loop_error_.ok()) return loop_error_;
      if (pause_ == PauseState::kPaused) ++loop_launches_;
      pause_ = PauseState::kRunning;
    }
    work_cv_.notify_one();
    return absl::OkStatus();
  }
  // Host-driven: one step, or (kLoop with no loop thread) steps until no slot decodes.
  int32_t decoded = 0;
  do {
    TS_ASSIGN_OR_RETURN(decoded, OneStep());
  } while (mode == RunMode::kLoop && decoded > 0);
  return absl::OkStatus();
}

absl::Status CpuBackend::Pause() {
  if (!loop_.joinable()) return absl::OkStatus();
  std::unique_lock<std::mutex> lock(mu_);
  if (pause_ == PauseState::kRunning) pause_ = PauseState::kPausing;
  work_cv_.notify_one();
  paused_cv_.wait(lock, [&] { return pause_ == PauseState::kPaused || !loop_error_.ok(); });
  return loop_error_;
}

absl::StatusOr<LoopStatus> CpuBackend::Poll() {
  LoopStatus status{.steps = steps_.load(std::memory_order_relaxed)};
  if (!loop_.joinable()) return status;
  std::lock_guard<std::mutex> lock(mu_);
  if (!loop_error_.ok()) return loop_error_;
  status.running = pause_ == PauseState::kRunning && (!pending_.empty() || AnyActive());
  status.launches = loop_launches_;
  return status;
}

StepReport CpuBackend::last_step() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_;
}

void CpuBackend::Cancel(SlotId slot) {
  TS_CHECK_GE(slot, 0);
  TS_CHECK_LT(slot, info_.max_slots);
  // A FREE or FINISHED slot has nothing to stop; Prefill clears the flag for the next request.
  table_.set_cancelled(slot, true);
}

const TokenRing& CpuBackend::Ring(SlotId slot) const {
  TS_CHECK_GE(slot, 0);
  TS_CHECK_LT(slot, info_.max_slots);
  return table_.ring(slot);
}

void CpuBackend::Release(SlotId slot) {
  TS_CHECK_GE(slot, 0);
  TS_CHECK_LT(slot, info_.max_slots);
  // A loop thread may still be decoding a slot that is not FINISHED: releasing it would race.
  const SlotState state = table_.state(slot);
  TS_CHECK(!loop_.joinable() || state == SlotState::kFinished || state == SlotState::kFree);
  table_.set_cancelled(slot, false);
  table_.set_state(slot, SlotState::kFree);
}

int32_t CpuBackend::num_free_slots() const {
  return table_.Count(SlotState::kFree);
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(const CpuBackendOptions& options) {
  TS_ASSIGN_OR_RETURN(
      std::unique_ptr<CpuModel> model,
      CpuModel::Load(options.model_dir, CpuModelOptions{.num_threads = options.num_threads}));
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CpuBackend> backend,
                      CpuBackend::Create(std::move(model), options));
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace ts
