// CudaModel: a Llama model (or one pipeline stage of it) resident on one GPU (bf16 weights, paged
// KV pool, activations and scratch in one arena, see memory_plan.h; the slot table, which the
// stage with the head reads and writes, is the caller's DeviceSlots) and the enqueue of its work
// on a stream:
//   - EnqueueDecodeStep: one decode step for a bucket, graph-capturable:
//       prepare (gather step inputs from the slot table for the bucket's rows) -> embed ->
//       L x (rmsnorm, qkv GEMM, rope + KV write, decode attention + combine, o GEMM, residual
//       add + rmsnorm, gate_up GEMM, silu * up, down GEMM, residual add) -> norm -> lm_head ->
//       fp32 logits (read rounded to bf16) -> sampling -> postprocess (ring append + stop checks
//       + counts). At m <= 8 rows the residual adds, silu * up, RoPE with the K/V write and,
//       for a small enough A (k::GemvNormProloguePays), the norms ride inside the GEMV kernels
//       (qkv, o, gate_up, down): 6 graph nodes per layer with the attention's split and combine
//       kernels (8 with the rmsnorm nodes), 10 on the cuBLASLt path.
//       Every op rounds to bf16 where transformers' bf16 Llama does, so logits track it to fp32
//       summation order.
//   - EnqueuePrefill + EnqueuePrefillSample: the same layers over a packed, chunked prompt
//     batch with causal prefill attention (host-launched, not a graph), then the first token of
//     every prompt through the same sampling and postprocess kernels.
// The slot table rows are written by the caller (CudaBackend, DeviceSlots::Stage) before the
// prefill's postprocess.
//
// Row list contract: decode row r of a bucket holds slot row_slots[r] (device buffer
// dev().decode_head.row_slots, written by the caller before the step), or -1 for a padding row.
// A padding row (or a row whose slot is not ACTIVE) writes no KV, attends to nothing, samples
// from the scratch sampling row and writes no ring record.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/cuda/device_slots.h"
#include "engine/cuda/memory_plan.h"
#include "kernels/decode_attention.cuh"
#include "kernels/gemm.cuh"
#include "kernels/logits_gemm.cuh"
#include "models/checkpoint.h"
#include "models/config.h"

namespace ts {

// What a benchmark injects into the enqueue of a step (production passes none): it hears of
// every op (by name: "prepare", "qkv_rope_gemm", "attention", ...) around its launch, and may
// leave an op out, so that each op's cost inside a captured graph can be measured by difference
// (no profiler sees graph nodes on the GPU machine). A step with an op left out computes
// meaningless tokens.
class OpObserver {
 public:
  virtual ~OpObserver() = default;
  virtual bool Skip(std::string_view /*op*/) { return false; }
  virtual absl::Status Begin(const char* /*op*/, cudaStream_t /*stream*/) {
    return absl::OkStatus();
  }
  virtual absl::Status End(cudaStream_t /*stream*/) { return absl::OkStatus(); }
};

// A device buffer a pipeline transport moves.
struct DeviceBytes {
  void* ptr = nullptr;
  size_t bytes = 0;
};

struct CudaModelOptions {
  ModelConfig config;
  // The layers, embedding and head this GPU holds (a pipeline stage); the default is the whole
  // model. A stage runs prefill chunks (EnqueuePrefill, with the stage before's hidden states in
  // dev().prefill.h; PromptLogits on the last stage) and the pieces of a decode step
  // (EnqueueDecodePrepare, EnqueueStageDecode). EnqueueDecodeStep, and so the decode graphs,
  // and mixed steps need the whole model.
  ModelStage stage;
  int32_t max_slots = 64;
  std::vector<int32_t> buckets;  // ascending, buckets.back() >= max_slots
  int32_t kv_block_size = 16;
  int32_t max_context = 0;  // 0 = config.max_position_embeddings
  int32_t prefill_chunk_tokens = 2048;
  uint32_t ring_capacity = 1024;
  double gpu_memory_fraction = 0.9;
  size_t graph_reserve_bytes = size_t{256} << 20;
  int device = 0;
  bool print_plan = true;  // the budget on stderr at startup
  // Benchmarks only: told of every op of every captured decode step (OpObserver), and may leave
  // ops out of the graphs. Owned by the caller; nullptr in production.
  OpObserver* capture_observer = nullptr;
  // Decode attention's shortest split when a batch leaves SMs idle
  // (SplitChoiceInputs::min_split_tokens).
  int32_t attention_min_split_tokens = 64;
  // Benchmarks only: device timestamps of every decode step (kernels/step_stamps.cuh), written
  // by the captured prepare and postprocess kernels. Owned by the caller; nullptr in production.
  kernels::StepStamps* step_stamps = nullptr;
  // The slot table a stage with the head prepares decode rows from and samples and postprocesses
  // into (required there, of shape CudaModel::SlotShapeFor(options); nullptr elsewhere). Owned by
  // the caller, on this device, and it must outlive the model.
  const DeviceSlots* slots = nullptr;
};

// Times each op of a step separately with CUDA events (the --profile mode of tailserve-bench).
// Events are created up front; Begin/End only record them.
class OpTimer : public OpObserver {
 public:
  static absl::StatusOr<std::unique_ptr<OpTimer>> Create(int32_t max_ops);
  ~OpTimer() override;
  void Reset() { used_ = 0; }
  absl::Status Begin(const char* op, cudaStream_t stream) override;
  absl::Status End(cudaStream_t stream) override;
  // After the stream is synchronised: (op name, milliseconds) in enqueue order.
  absl::StatusOr<std::vector<std::pair<std::string, float>>> Read() const;

 private:
  OpTimer() = default;
  std::vector<cudaEvent_t> events_;  // [2 * max_ops]
  std::vector<std::string> names_;   // [max_ops]
  int32_t used_ = 0;
};

// One sequence of a prefill batch.
struct PrefillSeq {
  std::span<const int32_t> tokens;       // [n] prompt tokens, n >= 1
  std::span<const int32_t> block_table;  // [>= ceil(n / block_size)] KV block ids
};

// The first tokens to sample after a chunk: slots[i] is the slot whose prompt's last hidden row
// is head row i (PrefillPiece::head_row), params[i] its sampling row (position = prompt length).
// The slots are in device state from_state (kernels/postprocess.cuh); one that does not finish
// on its first token moves to to_state: ACTIVE to ACTIVE for a host-driven prefill, PREFILL to
// READY for a chunk the device loop's scheduler admits, PREFILL to ACTIVE for a mixed step's
// prompts (the loop is not running, and the next mixed step decodes them).
struct FirstTokens {
  std::span<const int32_t> slots;
  std::span<const kernels::SamplingRow> params;
  int32_t from_state = 0;
  int32_t to_state = 0;
};

// One prompt's rows [start, start + len) in a prefill chunk. Its rows before start are in the
// KV cache already, written by earlier chunks through the same block table.
struct PrefillPiece {
  std::span<const int32_t> tokens;       // [n] the whole prompt, n >= 1
  std::span<const int32_t> block_table;  // [>= ceil(n / block_size)] KV block ids
  int32_t start = 0;
  int32_t len = 0;  // >= 1
  // >= 0 exactly when the piece ends its prompt: the prompt's last hidden row goes to row
  // head_row of dev().prefill_head.hidden, where EnqueuePrefillSample reads it.
  int32_t head_row = -1;
};

// The chunks EnqueuePrefill runs `seqs` in: prompts packed in order, cut so no chunk has more than
// chunk_tokens rows; a piece that ends its prompt has head_row = its sequence's index. A pipeline
// runs each chunk through every stage before the next (CudaBackend).
std::vector<std::vector<PrefillPiece>> ChunkPrefill(std::span<const PrefillSeq> seqs,
                                                    int32_t chunk_tokens);

class CudaModel {
 public:
  // Plans memory (prints the budget), allocates the arena, the pinned host block and the two
  // cuBLASLt Gemms, and plans every GEMM shape it will launch. Weights are not loaded yet.
  static absl::StatusOr<std::unique_ptr<CudaModel>> Create(const CudaModelOptions& options);
  // The DeviceSlots shape a model made from `options` needs (options.max_context 0 resolved as
  // Create resolves it).
  static SlotShape SlotShapeFor(const CudaModelOptions& options);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  // Copies a checkpoint's weights (bf16; f16/f32 converted on upload), fusing q/k/v and gate/up.
  absl::Status UploadWeights(const Checkpoint& ckpt, cudaStream_t stream);
  // Random weights generated on the device (benchmarks): linear weights U(-scale, scale) around
  // a per-tensor seed, norm weights U(0.5, 1.5). Same seed, same weights.
  absl::Status InitRandomWeights(uint64_t seed, float scale, cudaStream_t stream);

  const ModelConfig& config() const { return config_; }
  const ModelDims& dims() const { return plan_.shape.dims; }  // the whole model's
  const ModelStage& stage() const { return plan_.shape.stage; }
  bool whole_model() const;
  const MemoryPlan& plan() const { return plan_; }
  const DeviceLayout& dev() const { return dev_; }
  const HostLayout& host() const { return host_; }          // CPU addresses
  const HostLayout& host_dev() const { return host_dev_; }  // device aliases of the same block
  const std::vector<int32_t>& buckets() const { return buckets_; }
  int32_t max_context() const { return max_context_; }
  int32_t num_sms() const { return num_sms_; }
  OpObserver* capture_observer() const { return capture_observer_; }
  // Bytes of weights one decode step reads (every matrix once, the embedding rows excluded).
  size_t step_weight_bytes() const;

  // Attention split count for `bucket` rows when the longest context is `max_context_len`.
  int32_t NumSplits(int32_t bucket, int32_t max_context_len) const;

  // One decode step over `bucket` rows (a planned bucket). Graph-capturable. An observer hears
  // of each op (an OpTimer brackets them with events, never while capturing); the graphs'
  // capture passes capture_observer.
  absl::Status EnqueueDecodeStep(int32_t bucket, int32_t num_splits, cudaStream_t stream,
                                 OpObserver* observer = nullptr) const;
  // The same step in a pipeline's pieces (docs/pipeline.md, CUDA stages), for a model that
  // holds one stage. The last stage owns the slot table:
  //  1. the last stage's EnqueueDecodePrepare builds the rows' inputs (DecodeRowInputs) from its
  //     slot table and the row list in dev().decode_head.row_slots; the caller copies them to the
  //     same buffers of every other stage;
  //  2. each stage's EnqueueStageDecode runs its part: the embedding (first stage), its layers,
  //     and on the last stage lm_head, sampling and postprocess; the caller copies each stage's
  //     DecodeHidden to the next one's before that one runs.
  // On a whole model, prepare then EnqueueStageDecode is EnqueueDecodeStep.
  // `feed`: into the decode feed instead (AddDecodeFeed), from the row list in feed_row_slots().
  absl::Status EnqueueDecodePrepare(int32_t bucket, cudaStream_t stream, bool feed = false) const;
  // A second set of the rows' inputs on the last stage, for a pipeline's row groups
  // (docs/pipeline.md, Micro-batches in decode): the next group's prepare fills it on a stream of
  // its own and it is sent upstream from there, while this stage's graph still reads the
  // dev().decode inputs of the other group. Its sampling rows are written and never read.
  absl::Status AddDecodeFeed();
  int32_t* feed_row_slots() const { return feed_.row_slots; }  // [max_bucket] device
  absl::Status EnqueueStageDecode(int32_t bucket, int32_t num_splits, cudaStream_t stream,
                                  OpObserver* observer = nullptr) const;
  // Device buffers, the same on every stage of one plan: the rows' inputs (tokens, positions,
  // KV slots, context lengths, block tables) and the hidden states of `bucket` rows.
  std::vector<DeviceBytes> DecodeRowInputs(int32_t bucket, bool feed = false) const;
  DeviceBytes DecodeHidden(int32_t bucket) const;
  // The hidden rows a prefill chunk of `tokens` prompt rows leaves in dev().prefill.h (its
  // planned GEMM rows, padding included): what the next stage reads as that chunk's input.
  DeviceBytes PrefillHidden(int32_t tokens) const;

  // Runs the layers over every prompt (chunks of at most prefill_chunk_tokens tokens), writing
  // their KV and leaving sequence i's last hidden row in dev().prefill_head.hidden row i.
  // seqs.size() <= max_slots. Synchronises `stream` between chunks only to reuse the staging.
  absl::Status EnqueuePrefill(std::span<const PrefillSeq> seqs, cudaStream_t stream);
  // One chunk: the pieces' rows (at most prefill_chunk_tokens in all, at most max_slots pieces)
  // through the layers in one pass, then the first tokens of the prompts it completes (first;
  // none when empty). Waits on the host only until the previous chunk's staging copies have run.
  absl::Status EnqueuePrefillChunk(std::span<const PrefillPiece> pieces, const FirstTokens& first,
                                   cudaStream_t stream);
  // A mixed step (docs/device-loop.md, Mixed steps): one decode step over `bucket` rows (the row
  // list in dev().decode_head.row_slots, as for EnqueueDecodeStep) with a prefill chunk's pieces
  // riding in the same layer GEMMs, so the weights are read once for both. Rows [0, bucket) of
  // the prefill buffers decode, rows [bucket, bucket + prompt rows) prefill; bucket plus the
  // pieces' rows must fit prefill_chunk_tokens. The decode rows are sampled and postprocessed as
  // in a decode step, then the prompts it completes get their first tokens (first, through
  // EnqueuePrefillSample). Host-launched, not a graph; it shares the chunk staging with
  // EnqueuePrefillChunk (see StagingFree).
  absl::Status EnqueueMixedStep(int32_t bucket, int32_t num_splits,
                                std::span<const PrefillPiece> pieces, const FirstTokens& first,
                                cudaStream_t stream);
  // Whether the staging of the last chunk, mixed step and first-token sample has been copied, so
  // the next can be staged without waiting on the host. A mixed step's caller writes
  // host().row_slots only once this is true.
  absl::StatusOr<bool> StagingFree() const;
  // Samples the first token of the rows left by EnqueuePrefill (head row i = sequence i; its
  // slot table row, counts and mask already written).
  absl::Status EnqueuePrefillSample(const FirstTokens& first, cudaStream_t stream);
  // Teacher-forced fp32 logits [tokens.size(), vocab] of one prompt (tests). Writes KV through
  // block_table; synchronises `stream`.
  absl::StatusOr<std::vector<float>> PromptLogits(std::span<const int32_t> tokens,
                                                  std::span<const int32_t> block_table,
                                                  cudaStream_t stream);

 private:
  CudaModel() = default;
  // Index of a planned bucket; InvalidArgument ("<what>: bucket ...") for any other.
  absl::StatusOr<int32_t> BucketIndex(const char* what, int32_t bucket) const;
  // Plans every GEMM shape the model launches and launches each once, on the arena's buffers
  // (docs/device-loop.md, warm-up).
  absl::Status PlanAndWarmUpGemms(cudaStream_t stream);
  // Which attention a forward runs, and its inputs. A mixed step runs both: decode attention
  // over rows [0, decode_rows), prefill attention over the rows after them.
  struct Attention {
    bool decode = true;
    int32_t decode_rows = 0;  // !decode: the mixed step's decode rows, 0 for a plain chunk
    // decode rows
    int32_t num_splits = 1;
    int32_t max_splits = 1;
    const int32_t* context_lens = nullptr;         // [decode rows]
    const int32_t* decode_block_tables = nullptr;  // [decode rows, max_blocks_per_seq]
    // prefill rows
    const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq]
    const int32_t* cu_seqlens = nullptr;    // [num_seqs + 1], from the first prefill row
    const int32_t* start_pos = nullptr;     // [num_seqs]
    int32_t num_seqs = 0;
    int32_t total_tokens = 0;
    int32_t max_q_len = 0;
    int32_t max_kv_len = 0;  // the longest sequence's keys: start + its rows
  };
  // The layers of one forward over `f` (decode or prefill buffers).
  // C = A W^T (+ C): kernels/gemv for decode-sized m and small W, else the planned cuBLASLt GEMM.
  absl::Status LaunchLinear(const kernels::Gemm& gemm, const kernels::GemmParams& p,
                            cudaStream_t stream) const;
  absl::Status EnqueueLayers(const ForwardBuffers& f, int32_t rows, const Attention& attn,
                             const kernels::Gemm& gemm, cudaStream_t stream,
                             OpObserver* observer) const;
  // Decode with `rows` rows runs the fused GEMV layers (norms, residual adds, SwiGLU and RoPE
  // with the K/V write inside the GEMVs) rather than rmsnorm + cuBLASLt + silu_mul nodes.
  bool FusedDecodeLayers(int32_t rows) const;
  // Decode with 8 < `rows` <= 16 runs the shared-memory GEMV (kernels/gemv.cuh) with RoPE and the
  // K/V write, the residual adds and SwiGLU in its epilogues; the norms stay rmsnorm nodes.
  static bool GemvEpilogueLayers(const ModelDims& d, int32_t rows);
  // `rope` (decode steps only): q is still unrotated in f.qkv, and the decode attention kernel
  // applies RoPE and writes the current token's K/V itself, in place of a rope_kv node.
  absl::Status EnqueueAttention(const ForwardBuffers& f, int32_t rows, const LayerBuffers& layer,
                                const Attention& attn, const kernels::DecodeAttentionRope* rope,
                                cudaStream_t stream) const;
  // Decode attention over q rows [0, rows) of f; prefill attention over the q rows from
  // first_row on.
  absl::Status DecodeAttention(const ForwardBuffers& f, int32_t rows, const LayerBuffers& layer,
                               const Attention& attn, const kernels::DecodeAttentionRope* rope,
                               cudaStream_t stream, bool pdl = true) const;
  absl::Status PrefillAttention(const ForwardBuffers& f, int32_t first_row,
                                const LayerBuffers& layer, const Attention& attn,
                                cudaStream_t stream) const;
  // final norm -> lm_head (fp32 logits) over head rows [0, padded_rows).
  absl::Status EnqueueLogits(__nv_bfloat16* hidden_in, const HeadBuffers& head, int32_t padded_rows,
                             const kernels::LogitsGemm& gemm, cudaStream_t stream,
                             OpObserver* observer) const;
  // Postprocess moves rows in from_state to to_state (kernels::PostprocessParams); `stamps`
  // (decode steps of a benchmark) records the step's end.
  absl::Status EnqueueSampleAndPost(const HeadBuffers& head, int32_t rows, int32_t from_state,
                                    int32_t to_state, kernels::StepStamps* stamps,
                                    cudaStream_t stream, OpObserver* observer) const;
  // Where a decode prepare writes the rows' inputs: a step's own (DecodeInputs) or the feed.
  struct RowInputs {
    int32_t *row_slots = nullptr, *tokens = nullptr, *positions = nullptr, *slot_mapping = nullptr,
            *context_lens = nullptr, *sample_slots = nullptr;  // [max_bucket]
    int32_t* block_tables = nullptr;                           // [max_bucket, max_blocks_per_seq]
    kernels::SamplingRow* sampling = nullptr;                  // [max_bucket]
    float* rope_angles = nullptr;                              // [max_bucket, head_dim / 2, 2]
  };
  // The decode step's: the row list, sampling rows, context lengths and block tables of the
  // decode head, and f's tokens, positions and KV slots.
  RowInputs DecodeInputs(const ForwardBuffers& f) const;
  // The decode rows' inputs from the slot table (prepare kernel; the row list in in.row_slots)
  // into rows [0, rows) of `in`.
  absl::Status EnqueuePrepare(const RowInputs& in, int32_t rows, kernels::StepStamps* stamps,
                              cudaStream_t stream) const;
  absl::Status EnqueueEmbedding(const ForwardBuffers& f, int32_t rows, cudaStream_t stream) const;
  // The prompt-ending rows of dev().prefill.h to dev().prefill_head.hidden (the staged gathers).
  absl::Status GatherPromptEnds(int32_t gathers, cudaStream_t stream) const;
  // The planned prefill GEMM row count for `tokens` rows (>= tokens).
  int32_t PrefillRowsFor(int32_t tokens) const;
  // Checks the pieces and stages their rows as rows [row_offset, ...) of dev().prefill (tokens,
  // positions, KV slots; the pieces' sequence table; the last-row gathers), padding up to the
  // planned GEMM size, on `stream`. Returns the attention inputs; rows_out = padded rows.
  absl::StatusOr<Attention> StagePieces(std::span<const PrefillPiece> pieces, int32_t row_offset,
                                        cudaStream_t stream, int32_t* rows_out, int32_t* gathers);

  ModelConfig config_;
  int32_t attention_min_split_tokens_ = 64;
  OpObserver* capture_observer_ = nullptr;
  kernels::StepStamps* step_stamps_ = nullptr;
  const DeviceSlots* slots_ = nullptr;
  // The slot table, or FailedPrecondition on a stage without the head (which holds none).
  absl::StatusOr<const DeviceSlots*> Slots() const;
  // (token, split) pairs the prefill attention's key-split partials hold (PrefillAttentionSplits).
  static constexpr int32_t kPrefillSplitRows = 2048;
  size_t prefill_partials_offset_ = 0;  // into dev_.attention_workspace
  int32_t attention_ctas_per_sm_ = 0;   // resident decode-attention CTAs per SM (0: default)
  MemoryPlan plan_;
  std::vector<int32_t> buckets_;
  std::vector<int32_t> prefill_sizes_;  // planned prefill GEMM row counts, ascending
  std::vector<int32_t> max_splits_;     // [buckets] attention workspace capacity per bucket
  int32_t max_context_ = 0;
  int32_t num_sms_ = 0;
  int32_t device_ = 0;
  void* arena_ = nullptr;  // [plan_.arena_bytes] device
  RowInputs feed_;         // AddDecodeFeed's, in one allocation at feed_base_
  void* feed_base_ = nullptr;
  void* host_block_ = nullptr;  // [plan_.host_bytes] pinned, mapped
  DeviceLayout dev_;
  HostLayout host_;
  HostLayout host_dev_;
  std::unique_ptr<kernels::Gemm> decode_gemm_;   // captured into the decode graphs
  std::unique_ptr<kernels::Gemm> prefill_gemm_;  // host-launched prefill (its own workspace)
  std::unique_ptr<kernels::LogitsGemm> decode_logits_;
  std::unique_ptr<kernels::LogitsGemm> prefill_logits_;
  cudaEvent_t staging_free_ = nullptr;  // recorded after a chunk's staging copies
  // Recorded after a first-token sample's staging copies (sample_params, sample_slots,
  // head_row_slots), so staging a sample never waits for the chunk before it to start.
  cudaEvent_t sample_staging_free_ = nullptr;
  // A mixed step's decode attention runs on attention_side_ beside the prefill attention on the
  // step's stream (EnqueueAttention): forked after rope_kv, joined before the o GEMM.
  cudaStream_t attention_side_ = nullptr;
  cudaEvent_t attention_fork_ = nullptr;
  cudaEvent_t attention_join_ = nullptr;
};

}  // namespace ts
