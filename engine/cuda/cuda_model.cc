#include "engine/cuda/cuda_model.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <string>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/backend.h"
#include "kernels/cuda_check.h"
#include "kernels/decode_attention.cuh"
#include "kernels/fill_uniform.cuh"
#include "kernels/postprocess.cuh"
#include "kernels/prefill_attention.cuh"
#include "kernels/rope_kv.cuh"
#include "models/llama_weights.h"
#include "models/rope.h"

namespace ts {

using bf16 = __nv_bfloat16;
namespace k = ::ts::kernels;

// ---------------------------------------------------------------------------------------------
// OpTimer

absl::StatusOr<std::unique_ptr<OpTimer>> OpTimer::Create(int32_t max_ops) {
  std::unique_ptr<OpTimer> t(new OpTimer());
  t->events_.resize(2 * static_cast<size_t>(max_ops), nullptr);
  t->names_.resize(max_ops);
  for (cudaEvent_t& e : t->events_) TS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  return t;
}

OpTimer::~OpTimer() {
  for (cudaEvent_t e : events_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
}

absl::Status OpTimer::Begin(const char* op, cudaStream_t stream) {
  if (2 * static_cast<size_t>(used_) + 1 >= events_.size()) {
    return absl::ResourceExhaustedError("OpTimer: more ops than max_ops");
  }
  names_[used_] = op;
  TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[2 * used_], stream));
  return absl::OkStatus();
}

absl::Status OpTimer::End(cudaStream_t stream) {
  TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[2 * used_ + 1], stream));
  ++used_;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::pair<std::string, float>>> OpTimer::Read() const {
  std::vector<std::pair<std::string, float>> out;
  for (int32_t i = 0; i < used_; ++i) {
    float ms = 0;
    TS_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, events_[2 * i], events_[2 * i + 1]));
    out.emplace_back(names_[i], ms);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Setup

namespace {

std::vector<uint16_t> ToBf16(const TensorView& t) {
  std::vector<uint16_t> out(static_cast<size_t>(t.numel()));
  switch (t.dtype) {
    case DType::kBF16:
      std::memcpy(out.data(), t.data, out.size() * 2);
      break;
    case DType::kF16:
      for (size_t i = 0; i < out.size(); ++i) {
        uint16_t bits;
        std::memcpy(&bits, t.data + 2 * i, 2);
        out[i] = F32ToBf16(F16ToF32(bits));
      }
      break;
    case DType::kF32:
      for (size_t i = 0; i < out.size(); ++i) {
        float f;
        std::memcpy(&f, t.data + 4 * i, 4);
        out[i] = F32ToBf16(f);
      }
      break;
  }
  return out;
}

// Copies tensor `t` ([rows, cols] row-major) into `dst` whose rows are `dst_pitch` elements.
absl::Status UploadMatrix(const TensorView& t, bf16* dst, int64_t dst_pitch) {
  const std::vector<uint16_t> host = ToBf16(t);
  const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
  const int64_t cols = t.shape.size() < 2 ? t.numel() / std::max<int64_t>(rows, 1) : t.shape[1];
  TS_CUDA_RETURN_IF_ERROR(cudaMemcpy2D(dst, dst_pitch * sizeof(bf16), host.data(),
                                       cols * sizeof(uint16_t), cols * sizeof(uint16_t), rows,
                                       cudaMemcpyHostToDevice));
  return absl::OkStatus();
}

absl::Status UploadVector(const TensorView& t, bf16* dst) {
  const std::vector<uint16_t> host = ToBf16(t);
  TS_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(dst, host.data(), host.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
  return absl::OkStatus();
}

}  // namespace

SlotShape CudaModel::SlotShapeFor(const CudaModelOptions& o) {
  const int32_t context = o.max_context > 0 ? o.max_context : o.config.max_position_embeddings;
  const int32_t block = std::max(o.kv_block_size, 1);
  return SlotShape{.max_slots = o.max_slots,
                   .max_blocks_per_seq = (context + block - 1) / block,
                   .vocab = o.config.vocab_size,
                   .ring_capacity = o.ring_capacity};
}

absl::StatusOr<const DeviceSlots*> CudaModel::Slots() const {
  if (slots_ == nullptr) {
    return absl::FailedPreconditionError(
        "the slot table: a pipeline stage without the head holds none, so it cannot prepare, "
        "sample or postprocess decode rows");
  }
  return slots_;
}

absl::StatusOr<std::unique_ptr<CudaModel>> CudaModel::Create(const CudaModelOptions& o) {
  TS_RETURN_IF_ERROR(ValidateBuckets(o.buckets));
  if (o.config.eos_token_ids.size() > static_cast<size_t>(k::kMaxEosIds)) {
    return absl::InvalidArgumentError(
        absl::StrCat("config eos_token_ids: ", o.config.eos_token_ids.size(),
                     " ids, the CUDA backend supports up to ", k::kMaxEosIds));
  }
  if (o.attention_min_split_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("attention_min_split_tokens must be >= 1, got ",
                                                   o.attention_min_split_tokens));
  }
  const bool head = o.stage.has_head;
  if (head != (o.slots != nullptr)) {
    return absl::InvalidArgumentError(
        head ? "slots: a model that holds the head needs the slot table (DeviceSlots)"
             : "slots: a stage without the head holds no slot table");
  }
  if (head && !(o.slots->shape() == SlotShapeFor(o))) {
    return absl::InvalidArgumentError(
        "slots: the slot table's shape is not CudaModel::SlotShapeFor(options)");
  }
  std::unique_ptr<CudaModel> m(new CudaModel());
  m->config_ = o.config;
  m->attention_min_split_tokens_ = o.attention_min_split_tokens;
  m->capture_observer_ = o.capture_observer;
  m->step_stamps_ = o.step_stamps;
  m->slots_ = o.slots;
  m->buckets_ = o.buckets;
  m->device_ = o.device;
  m->max_context_ = o.max_context > 0 ? o.max_context : o.config.max_position_embeddings;
  if (o.config.max_position_embeddings > 0 && m->max_context_ > o.config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("max_context: ", m->max_context_,
                                                   " exceeds max_position_embeddings ",
                                                   o.config.max_position_embeddings));
  }
  TS_CUDA_RETURN_IF_ERROR(cudaSetDevice(o.device));
  TS_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&m->num_sms_, cudaDevAttrMultiProcessorCount, o.device));
  size_t free_bytes = 0, total_bytes = 0;
  TS_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));

  TS_ASSIGN_OR_RETURN(ModelDims dims, MakeModelDims(o.config));
  TS_ASSIGN_OR_RETURN(
      m->attention_ctas_per_sm_,
      k::DecodeAttentionCtasPerSm(dims.head_dim, dims.num_heads, dims.num_kv_heads));
  // Attention partials: each bucket's split count at the longest context is its capacity.
  size_t attention_ws = 0;
  for (int32_t b : o.buckets) {
    const int32_t splits =
        k::ChooseNumSplits(k::SplitChoiceInputs{.num_seqs = b,
                                                .num_q_heads = dims.num_heads,
                                                .num_kv_heads = dims.num_kv_heads,
                                                .max_context_len = m->max_context_,
                                                .num_sms = m->num_sms_,
                                                .max_splits = 256,
                                                .ctas_per_sm = m->attention_ctas_per_sm_,
                                                .min_split_tokens = o.attention_min_split_tokens});
    m->max_splits_.push_back(splits);
    attention_ws = std::max(
        attention_ws, k::DecodeAttentionWorkspaceBytes(b, dims.num_heads, dims.head_dim, splits));
  }
  // The prefill's key-split partials follow, apart from the decode part (whose counters must stay
  // zero): a mixed step runs the two attentions at once (EnqueueAttention).
  m->prefill_partials_offset_ = (attention_ws + 255) / 256 * 256;
  attention_ws =
      m->prefill_partials_offset_ +
      k::PrefillAttentionWorkspaceBytes(kPrefillSplitRows, dims.num_heads, dims.head_dim);
  const k::GemmOptions gemm_options;
  TS_ASSIGN_OR_RETURN(
      m->plan_, PlanMemory(MemoryPlanOptions{.model = o.config,
                                             .stage = o.stage,
                                             .max_slots = o.max_slots,
                                             .buckets = o.buckets,
                                             .kv_block_size = o.kv_block_size,
                                             .max_context = m->max_context_,
                                             .prefill_chunk_tokens = o.prefill_chunk_tokens,
                                             .ring_capacity = o.ring_capacity,
                                             .gpu_memory_fraction = o.gpu_memory_fraction,
                                             .total_device_bytes = total_bytes,
                                             .gemm_workspace_bytes = gemm_options.workspace_bytes,
                                             .attention_workspace_bytes = attention_ws,
                                             .graph_reserve_bytes = o.graph_reserve_bytes}));
  if (o.print_plan) std::fprintf(stderr, "%s", m->plan_.Summary().c_str());
  m->prefill_sizes_ = PrefillGemmRows(o.prefill_chunk_tokens);

  // The one device allocation of the arena; zeroed so no kernel ever reads uninitialised bytes.
  if (cudaError_t e = cudaMalloc(&m->arena_, m->plan_.arena_bytes); e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc of the ", m->plan_.arena_bytes,
                                                     "-byte arena failed (", cudaGetErrorString(e),
                                                     "); ", free_bytes, " bytes were free"));
  }
  TS_CUDA_RETURN_IF_ERROR(cudaMemset(m->arena_, 0, m->plan_.arena_bytes));
  TS_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&m->host_block_, m->plan_.host_bytes,
                                        cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(m->host_block_, 0, m->plan_.host_bytes);
  void* host_alias = nullptr;
  TS_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&host_alias, m->host_block_, 0));
  m->dev_ = CarveArena(m->plan_.shape, m->arena_);
  m->host_ = CarveHost(m->plan_.shape, m->host_block_);
  m->host_dev_ = CarveHost(m->plan_.shape, host_alias);

  TS_ASSIGN_OR_RETURN(m->decode_gemm_, k::Gemm::Create(gemm_options));
  TS_ASSIGN_OR_RETURN(m->prefill_gemm_, k::Gemm::Create(gemm_options));
  TS_ASSIGN_OR_RETURN(m->decode_logits_,
                      k::LogitsGemm::Create(m->dev_.decode_logits_workspace,
                                            m->plan_.shape.logits_workspace_bytes));
  TS_ASSIGN_OR_RETURN(m->prefill_logits_,
                      k::LogitsGemm::Create(m->dev_.prefill_logits_workspace,
                                            m->plan_.shape.logits_workspace_bytes));
  TS_RETURN_IF_ERROR(m->PlanAndWarmUpGemms(nullptr));  // synchronised below
  TS_RETURN_IF_ERROR(k::ResetDecodeAttentionWorkspace(m->dev_.attention_workspace,
                                                      m->plan_.attention_workspace_bytes, nullptr));
  TS_ASSIGN_OR_RETURN(std::vector<float> inv_freq, RopeInvFreq(o.config));
  TS_CUDA_RETURN_IF_ERROR(cudaMemcpy(m->dev_.inv_freq, inv_freq.data(),
                                     inv_freq.size() * sizeof(float), cudaMemcpyHostToDevice));
  TS_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&m->staging_free_, cudaEventDisableTiming));
  TS_CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&m->sample_staging_free_, cudaEventDisableTiming));
  // The lowest priority: when both attentions are ready, the prefill kernel's CTAs (one an SM at
  // head_dim 128) are placed first and the decode kernel's fill the other SMs.
  int least = 0, greatest = 0;
  TS_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  TS_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithPriority(&m->attention_side_, cudaStreamNonBlocking, least));
  TS_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&m->attention_fork_, cudaEventDisableTiming));
  TS_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&m->attention_join_, cudaEventDisableTiming));
  TS_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return m;
}

CudaModel::~CudaModel() {
  // Whoever launched work on this model has synchronised before destroying it (CudaBackend
  // does); the frees below would wait for the device anyway.
  decode_gemm_.reset();
  prefill_gemm_.reset();
  decode_logits_.reset();
  prefill_logits_.reset();
  if (staging_free_ != nullptr) cudaEventDestroy(staging_free_);
  if (sample_staging_free_ != nullptr) cudaEventDestroy(sample_staging_free_);
  if (attention_fork_ != nullptr) cudaEventDestroy(attention_fork_);
  if (attention_join_ != nullptr) cudaEventDestroy(attention_join_);
  if (attention_side_ != nullptr) cudaStreamDestroy(attention_side_);
  if (arena_ != nullptr) cudaFree(arena_);
  if (feed_base_ != nullptr) cudaFree(feed_base_);
  if (host_block_ != nullptr) cudaFreeHost(host_block_);
}

// CUDA loads a kernel at its first launch (CUDA_MODULE_LOADING=LAZY, the default), and loading
// one of cuBLASLt's blocks the launching thread for milliseconds. The decode graphs need no
// warm-up (instantiating a graph loads its kernels), but prefill chunks and mixed steps launch
// their GEMMs directly, each row count its own cuBLASLt kernel: the first mixed step of a new size
// stalled every decoding stream (measured on the H200: the longest time without a step beside a
// 32k-token prefill was 28.8 ms lazily, 11.4 ms with CUDA_MODULE_LOADING=EAGER). So every planned
// GEMM runs once here, before any request, on whatever the buffers hold. EAGER would load every
// kernel of cuBLAS as well: seconds of startup and device memory for kernels never launched.
// Planning and the warm-up walk one list of shapes, so no planned GEMM goes unloaded.
absl::Status CudaModel::PlanAndWarmUpGemms(cudaStream_t stream) {
  const ModelDims& d = dims();
  const LayerBuffers& l = dev_.layers.front();
  auto run = [&](k::Gemm& g, const k::GemmParams& p) -> absl::Status {
    TS_RETURN_IF_ERROR(g.Plan({p.m, p.n, p.k}));
    return g.Launch(p, stream);
  };
  auto layers = [&](k::Gemm& g, const ForwardBuffers& f, int32_t m) -> absl::Status {
    const int32_t inter = d.intermediate_padded;
    TS_RETURN_IF_ERROR(
        run(g, {.a = f.xn, .w = l.qkv, .c = f.qkv, .m = m, .n = d.qkv_dim(), .k = d.hidden}));
    TS_RETURN_IF_ERROR(
        run(g, {.a = f.attn, .w = l.o, .c = f.xn, .m = m, .n = d.hidden, .k = d.q_dim()}));
    TS_RETURN_IF_ERROR(
        run(g, {.a = f.xn, .w = l.gate_up, .c = f.gate_up, .m = m, .n = 2 * inter, .k = d.hidden}));
    return run(g, {.a = f.act, .w = l.down, .c = f.xn, .m = m, .n = d.hidden, .k = inter});
  };
  for (int32_t b : buckets_) {
    TS_RETURN_IF_ERROR(layers(*decode_gemm_, dev_.decode, b));
    // Only the stage with the head runs lm_head.
    if (!stage().has_head) continue;
    for (const auto& [gemm, head] : {std::pair{decode_logits_.get(), &dev_.decode_head},
                                     std::pair{prefill_logits_.get(), &dev_.prefill_head}}) {
      TS_RETURN_IF_ERROR(gemm->Plan(b, d.vocab, d.hidden));
      TS_RETURN_IF_ERROR(
          gemm->Launch(head->normed, dev_.lm_head, head->logits_f32, b, d.vocab, d.hidden, stream));
    }
  }
  for (int32_t m : prefill_sizes_) TS_RETURN_IF_ERROR(layers(*prefill_gemm_, dev_.prefill, m));
  return absl::OkStatus();
}

absl::Status CudaModel::UploadWeights(const Checkpoint& ckpt, cudaStream_t stream) {
  TS_ASSIGN_OR_RETURN(LlamaTensors t, BindLlamaTensors(ckpt, config_));
  const ModelDims& d = dims();
  const ModelStage& st = stage();
  const int64_t h = d.hidden;
  // Only the stage's own tensors leave the checkpoint.
  if (dev_.embed != nullptr) TS_RETURN_IF_ERROR(UploadMatrix(*t.embed, dev_.embed, h));
  if (st.has_head) {
    if (d.separate_lm_head()) TS_RETURN_IF_ERROR(UploadMatrix(*t.lm_head, dev_.lm_head, h));
    TS_RETURN_IF_ERROR(UploadVector(*t.final_norm, dev_.final_norm));
  }
  for (int32_t l = 0; l < st.num_layers; ++l) {
    const LlamaLayerTensors& src = t.layers[st.first_layer + l];
    const LayerBuffers& dst = dev_.layers[l];
    TS_RETURN_IF_ERROR(UploadVector(*src.attn_norm, dst.attn_norm));
    TS_RETURN_IF_ERROR(UploadVector(*src.mlp_norm, dst.mlp_norm));
    // Fused [q; k; v] rows: one GEMM produces a row laid out as rope_kv expects.
    TS_RETURN_IF_ERROR(UploadMatrix(*src.q_proj, dst.qkv, h));
    TS_RETURN_IF_ERROR(UploadMatrix(*src.k_proj, dst.qkv + static_cast<int64_t>(d.q_dim()) * h, h));
    TS_RETURN_IF_ERROR(
        UploadMatrix(*src.v_proj, dst.qkv + static_cast<int64_t>(d.q_dim() + d.kv_dim()) * h, h));
    TS_RETURN_IF_ERROR(UploadMatrix(*src.o_proj, dst.o, d.q_dim()));
    // Fused [gate; up] rows, each block intermediate_padded rows (padding rows stay zero).
    TS_RETURN_IF_ERROR(UploadMatrix(*src.gate_proj, dst.gate_up, h));
    TS_RETURN_IF_ERROR(UploadMatrix(
        *src.up_proj, dst.gate_up + static_cast<int64_t>(d.intermediate_padded) * h, h));
    TS_RETURN_IF_ERROR(UploadMatrix(*src.down_proj, dst.down, d.intermediate_padded));
  }
  (void)stream;  // uploads are synchronous cudaMemcpy: startup only
  return absl::OkStatus();
}

absl::Status CudaModel::InitRandomWeights(uint64_t seed, float scale, cudaStream_t stream) {
  const ModelDims& d = dims();
  const ModelStage& st = stage();
  const size_t h = d.hidden;
  // Tensor ids are the model's, not the stage's: a stage's random weights are exactly the whole
  // model's tensors it holds, so chained stages compute what the whole model does.
  uint64_t tensor = 0;
  auto fill = [&](bf16* p, size_t n, float lo, float hi) {
    return k::LaunchFillUniform(
        {.out = p,
         .n = n,
         .seed = seed * 0x9E3779B97F4A7C15ull + (++tensor) * 0x10000000000ull,
         .lo = lo,
         .hi = hi},
        stream);
  };
  auto matrix = [&](bf16* p, size_t rows, size_t cols) {
    return fill(p, rows * cols, -scale, scale);
  };
  if (dev_.embed != nullptr) {
    TS_RETURN_IF_ERROR(matrix(dev_.embed, d.vocab, h));
  } else {
    ++tensor;
  }
  if (st.has_head) {
    if (d.separate_lm_head()) TS_RETURN_IF_ERROR(matrix(dev_.lm_head, d.vocab, h));
    TS_RETURN_IF_ERROR(fill(dev_.final_norm, h, 0.5f, 1.5f));
  } else {
    tensor += d.separate_lm_head() ? 2 : 1;
  }
  constexpr uint64_t kTensorsPerLayer = 7;  // the fills and matrices of one layer below
  tensor += kTensorsPerLayer * st.first_layer;
  const size_t ip = d.intermediate_padded;
  for (const LayerBuffers& l : dev_.layers) {
    TS_RETURN_IF_ERROR(fill(l.attn_norm, h, 0.5f, 1.5f));
    TS_RETURN_IF_ERROR(fill(l.mlp_norm, h, 0.5f, 1.5f));
    TS_RETURN_IF_ERROR(matrix(l.qkv, d.qkv_dim(), h));
    TS_RETURN_IF_ERROR(matrix(l.o, h, d.q_dim()));
    TS_RETURN_IF_ERROR(matrix(l.gate_up, d.intermediate, h));
    TS_RETURN_IF_ERROR(matrix(l.gate_up + ip * h, d.intermediate, h));
    TS_RETURN_IF_ERROR(matrix(l.down, h, ip));
    if (ip != static_cast<size_t>(d.intermediate)) {
      // Padded input columns of down must stay zero (they meet silu(0) * 0 = 0 anyway).
      TS_CUDA_RETURN_IF_ERROR(cudaMemset2DAsync(l.down + d.intermediate, ip * sizeof(bf16), 0,
                                                (ip - d.intermediate) * sizeof(bf16), h, stream));
    }
  }
  TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));  // startup only
  return absl::OkStatus();
}

size_t CudaModel::step_weight_bytes() const {
  const ModelDims& d = dims();
  const size_t h = d.hidden;
  const size_t per_layer = 2 * h + static_cast<size_t>(d.qkv_dim()) * h + h * d.q_dim() +
                           3 * h * static_cast<size_t>(d.intermediate_padded);
  const size_t head = stage().has_head ? h + static_cast<size_t>(d.vocab) * h : 0;
  return (per_layer * stage().num_layers + head) * sizeof(bf16);
}

bool CudaModel::whole_model() const {
  const ModelStage& st = stage();
  return st.has_embedding && st.has_head && st.num_layers == dims().num_layers;
}

int32_t CudaModel::NumSplits(int32_t bucket, int32_t max_context_len) const {
  const auto it = std::lower_bound(buckets_.begin(), buckets_.end(), bucket);
  TS_CHECK(it != buckets_.end() && *it == bucket);
  return k::ChooseNumSplits(
      k::SplitChoiceInputs{.num_seqs = bucket,
                           .num_q_heads = dims().num_heads,
                           .num_kv_heads = dims().num_kv_heads,
                           .max_context_len = std::min(max_context_len, max_context_),
                           .num_sms = num_sms_,
                           .max_splits = max_splits_[it - buckets_.begin()],
                           .ctas_per_sm = attention_ctas_per_sm_,
                           .min_split_tokens = attention_min_split_tokens_});
}

int32_t CudaModel::PrefillRowsFor(int32_t tokens) const {
  const auto it = std::lower_bound(prefill_sizes_.begin(), prefill_sizes_.end(), tokens);
  TS_CHECK(it != prefill_sizes_.end());
  return *it;
}

}  // namespace ts
