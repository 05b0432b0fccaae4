// CPU reference Llama (fp32 arithmetic; bf16/f16 weights upcast at load). It is the correctness
// oracle for the CUDA kernels and the backend CI serves with, so it is exact rather than clever,
// but it uses every core for the GEMMs so a 1B checkpoint decodes.
//
// KV lives in a paged pool, the same layout idea as the GPU: block b of layer l holds block_size
// tokens. One Forward call runs a batch of chunks (prefill chunks and single decode tokens mixed);
// each chunk appends its tokens' K/V at positions [start_pos, start_pos + tokens.size()).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "models/config.h"

namespace ts {

class CpuKvPool {
 public:
  // num_blocks >= 0 and block_size >= 1 are the caller's invariants (checked).
  CpuKvPool(const ModelConfig& config, int32_t num_blocks, int32_t block_size);
  int32_t num_blocks() const { return num_blocks_; }
  int32_t block_size() const { return block_size_; }
  int32_t num_layers() const { return num_layers_; }
  int32_t num_kv_heads() const { return num_kv_heads_; }
  int32_t head_dim() const { return head_dim_; }
  // [head_dim] slice for (layer, block, slot in block, kv head). Arguments are not range-checked:
  // Forward validates block tables before it touches the pool.
  float* k(int layer, int32_t block, int32_t offset, int kv_head) {
    return k_.data() + Index(layer, block, offset, kv_head);
  }
  float* v(int layer, int32_t block, int32_t offset, int kv_head) {
    return v_.data() + Index(layer, block, offset, kv_head);
  }

 private:
  size_t Index(int layer, int32_t block, int32_t offset, int kv_head) const {
    return (((static_cast<size_t>(layer) * num_blocks_ + block) * block_size_ + offset) *
                num_kv_heads_ +
            kv_head) *
           head_dim_;
  }
  int32_t num_blocks_, block_size_, num_layers_, num_kv_heads_, head_dim_;
  std::vector<float> k_, v_;  // [layers][blocks][block_size][kv_heads][head_dim]
};

struct SeqChunk {
  std::span<const int32_t> tokens;       // [n] tokens to run
  int32_t start_pos = 0;                 // tokens already in the cache for this sequence
  std::span<const int32_t> block_table;  // [ceil((start_pos + n) / block_size)] block ids
};

enum class LogitsMode { kLastPerChunk, kAll };

// The part of the model one pipeline stage holds (docs/pipeline.md): decoder layers
// [first_layer, first_layer + num_layers), and whether it looks up the token embeddings (the first
// stage) and runs the final norm and lm_head (the last). Only those tensors are loaded.
struct CpuStage {
  int32_t first_layer = 0;
  int32_t num_layers = -1;  // -1: through the last layer
  bool embedding = true;
  bool head = true;
};

struct CpuModelOptions {
  int num_threads = 0;  // 0 = hardware concurrency; counts the calling thread
  // Multiply-adds a thread must get before a region is split; 0 = ThreadPool's default (32K).
  // 1 splits every region, so tests exercise the threaded paths on tiny models.
  int64_t min_parallel_work = 0;
  CpuStage stage{};  // the whole model by default
};

class CpuModel {
 public:
  static absl::StatusOr<std::unique_ptr<CpuModel>> Load(const std::filesystem::path& dir,
                                                        CpuModelOptions options = {});
  ~CpuModel();
  const ModelConfig& config() const;
  size_t weight_bytes() const;  // fp32 weights held (the tied lm_head counted once)
  int num_threads() const;

  // logits: resized to [rows][vocab], rows = chunks.size() (kLastPerChunk) or total tokens (kAll),
  // in chunk order. InvalidArgument (naming the chunk) for an empty chunk, a token id outside
  // [0, vocab), a negative start_pos, a position >= max_position_embeddings, a block table shorter
  // than ceil((start_pos + n) / block_size) or holding an id outside [0, num_blocks) or a repeated
  // id, or a pool shaped for another model; nothing is written to `kv` or `logits` then.
  // A token's result does not depend on what else is in the batch (bit-identical).
  // Not thread-safe: one Forward at a time per model (it reuses scratch buffers).
  absl::Status Forward(std::span<const SeqChunk> chunks, CpuKvPool& kv, LogitsMode mode,
                       std::vector<float>* logits);

  // One pipeline stage's part of Forward, with Forward's checks. Input: the chunks' token
  // embeddings (stage.embedding) or `hidden_in` ([total tokens][hidden], the previous stage's
  // output; the chunks still give each token's id, position and blocks). Output: logits as
  // Forward gives them (stage.head), else the residual stream after the stage's last layer,
  // [total tokens][hidden]. `kv` holds the stage's layers only: a CpuKvPool over a config whose
  // num_layers is num_stage_layers(). Chaining the stages gives Forward's result bit for bit.
  absl::Status ForwardStage(std::span<const SeqChunk> chunks, CpuKvPool& kv,
                            std::span<const float> hidden_in, LogitsMode mode,
                            std::vector<float>* out);
  int32_t num_stage_layers() const;

 private:
  CpuModel();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ts
