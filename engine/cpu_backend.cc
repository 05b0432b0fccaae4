#include "engine/cpu_backend.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "models/sampling.h"

namespace ts {

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(std::unique_ptr<CpuModel> model,
                                                               const CpuBackendOptions& options) {
  if (model == nullptr) return absl::InvalidArgumentError("model: null");
  if (options.max_slots < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_slots: must be >= 1, got ", options.max_slots));
  }
  if (options.kv_block_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_block_size: must be >= 1, got ", options.kv_block_size));
  }
  if (options.ring_capacity < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring_capacity: must be >= 2, got ", options.ring_capacity));
  }
  if (options.num_kv_blocks < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_kv_blocks: must be >= 0, got ", options.num_kv_blocks));
  }
  TS_RETURN_IF_ERROR(ValidateBuckets(options.buckets));
  if (options.buckets.back() < options.max_slots) {
    return absl::InvalidArgumentError(absl::StrCat(
        "buckets: largest bucket ", options.buckets.back(), " < max_slots ", options.max_slots));
  }
  const ModelConfig& config = model->config();
  int64_t blocks = options.num_kv_blocks;
  if (blocks == 0) {
    const int64_t per_seq =
        (config.max_position_embeddings + options.kv_block_size - 1) / options.kv_block_size;
    blocks = per_seq * options.max_slots;
  }
  if (blocks < 1 || blocks > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("num_kv_blocks: ", blocks, " out of range"));
  }
  // K and V, fp32, every layer and kv head.
  const int64_t bytes_per_block = int64_t{2} * sizeof(float) * config.num_layers *
                                  config.num_kv_heads * config.head_dim * options.kv_block_size;
  if (blocks * bytes_per_block > options.max_kv_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "num_kv_blocks: ", blocks, " blocks of ", options.kv_block_size, " tokens need ",
        blocks * bytes_per_block, " bytes of fp32 KV, above max_kv_bytes ", options.max_kv_bytes,
        "; set num_kv_blocks (", options.max_kv_bytes / bytes_per_block, " fit)"));
  }
  return std::unique_ptr<CpuBackend>(
      new CpuBackend(std::move(model), options, static_cast<int32_t>(blocks)));
}

CpuBackend::CpuBackend(std::unique_ptr<CpuModel> model, const CpuBackendOptions& options,
                       int32_t num_kv_blocks)
    : model_(std::move(model)),
      kv_(model_->config(), num_kv_blocks, options.kv_block_size),
      buckets_(options.buckets),
      slots_(options.max_slots),
      storage_(static_cast<size_t>(options.max_slots) * options.ring_capacity) {
  info_.model = model_->config();
  info_.max_slots = options.max_slots;
  info_.kv_block_size = options.kv_block_size;
  info_.num_kv_blocks = num_kv_blocks;
  info_.ring_capacity = options.ring_capacity;
  info_.name = "cpu";
  for (int32_t i = 0; i < options.max_slots; ++i) {
    slots_[i].ring = TokenRing(storage_.data() + static_cast<size_t>(i) * options.ring_capacity,
                               options.ring_capacity);
  }
}

CpuBackend::~CpuBackend() = default;

absl::Status CpuBackend::ValidateInit(const SlotInit& in) const {
  TS_RETURN_IF_ERROR(ValidateSlotInit(in, info_));
  if (slots_[in.slot].state != SlotState::kFree) {
    return absl::FailedPreconditionError(absl::StrCat("prefill slot ", in.slot, ": not FREE"));
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Prefill(std::span<const SlotInit> inits) {
  if (inits.empty()) return absl::OkStatus();
  std::vector<SeqChunk> chunks;
  chunks.reserve(inits.size());
  for (size_t i = 0; i < inits.size(); ++i) {
    TS_RETURN_IF_ERROR(ValidateInit(inits[i]));
    for (size_t j = 0; j < i; ++j) {
      if (inits[j].slot == inits[i].slot) {
        return absl::InvalidArgumentError(
            absl::StrCat("prefill slot ", inits[i].slot, ": listed twice"));
      }
    }
    chunks.push_back(
        SeqChunk{.tokens = inits[i].prompt, .start_pos = 0, .block_table = inits[i].block_table});
  }
  // One Forward over every new prompt; a failure leaves all these slots FREE.
  TS_RETURN_IF_ERROR(model_->Forward(chunks, kv_, LogitsMode::kLastPerChunk, &logits_));
  const size_t vocab = static_cast<size_t>(info_.model.vocab_size);
  for (size_t i = 0; i < inits.size(); ++i) {
    const SlotInit& in = inits[i];
    Slot& s = slots_[in.slot];
    s.prompt.assign(in.prompt.begin(), in.prompt.end());
    s.output.clear();
    s.output.reserve(in.stop.max_new_tokens);
    s.block_table.assign(in.block_table.begin(), in.block_table.end());
    s.sampling = in.sampling;
    s.stop = in.stop;
    s.seq = 0;
    s.cancel.store(false, std::memory_order_relaxed);
    s.state = SlotState::kActive;
    SampleAndPush(s, std::span<float>(logits_.data() + i * vocab, vocab));
  }
  return absl::OkStatus();
}

void CpuBackend::SampleAndPush(Slot& s, std::span<float> logits) {
  // SampleToken samples at position prompt_len + generated, the token's absolute position.
  const int32_t token = SampleToken(logits, s.sampling, s.prompt, s.output);
  const int32_t index = static_cast<int32_t>(s.output.size());
  s.output.push_back(token);
  const FinishReason reason = CheckStop(s.stop, info_.model.eos_token_ids, token, index);
  s.ring.Push(++s.seq, token, RingFlags(reason));
  if (reason != FinishReason::kNone) s.state = SlotState::kFinished;
}

absl::Status CpuBackend::OneStep() {
  std::vector<SlotId> decode;
  for (SlotId i = 0; i < info_.max_slots; ++i) {
    Slot& s = slots_[i];
    if (s.state != SlotState::kActive) continue;
    if (s.cancel.load(std::memory_order_relaxed)) {
      s.ring.Push(++s.seq, -1, RingFlags(FinishReason::kCancelled));
      s.state = SlotState::kFinished;
      continue;
    }
    decode.push_back(i);
  }
  const int32_t n = static_cast<int32_t>(decode.size());
  last_ = StepReport{.active = n, .bucket = PickBucket(buckets_, n)};
  if (n == 0) return absl::OkStatus();
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
  TS_RETURN_IF_ERROR(model_->Forward(chunks, kv_, LogitsMode::kLastPerChunk, &logits_));
  const size_t vocab = static_cast<size_t>(info_.model.vocab_size);
  for (int32_t r = 0; r < n; ++r) {
    SampleAndPush(slots_[decode[r]], std::span<float>(logits_.data() + r * vocab, vocab));
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Run(RunMode mode) {
  do {
    TS_RETURN_IF_ERROR(OneStep());
  } while (mode == RunMode::kUntilIdle && last_.active > 0);
  return absl::OkStatus();
}

void CpuBackend::Cancel(SlotId slot) {
  TS_CHECK_GE(slot, 0);
  TS_CHECK_LT(slot, info_.max_slots);
  // A FREE or FINISHED slot has nothing to stop; Prefill clears the flag for the next request.
  slots_[slot].cancel.store(true, std::memory_order_relaxed);
}

const TokenRing& CpuBackend::Ring(SlotId slot) const {
  TS_CHECK_GE(slot, 0);
  TS_CHECK_LT(slot, info_.max_slots);
  return slots_[slot].ring;
}

void CpuBackend::Release(SlotId slot) {
  TS_CHECK_GE(slot, 0);
  TS_CHECK_LT(slot, info_.max_slots);
  Slot& s = slots_[slot];
  s.state = SlotState::kFree;
  s.cancel.store(false, std::memory_order_relaxed);
  s.seq = 0;
  s.output.clear();
  s.ring.Reset();
}

int32_t CpuBackend::num_free_slots() const {
  return static_cast<int32_t>(std::count_if(
      slots_.begin(), slots_.end(), [](const Slot& s) { return s.state == SlotState::kFree; }));
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
