// CudaModel's forward pass: the kernels of one decode step (also reused by prefill's chunks), in
// data-flow order, each launched with the parameters a graph node keeps.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/backend.h"
#include "engine/cuda/cuda_model.h"
#include "kernels/cuda_check.h"
#include "kernels/decode_attention.cuh"
#include "kernels/embedding.cuh"
#include "kernels/gather_rows.cuh"
#include "kernels/gemv.cuh"
#include "kernels/postprocess.cuh"
#include "kernels/prefill_attention.cuh"
#include "kernels/prepare_decode.cuh"
#include "kernels/rmsnorm.cuh"
#include "kernels/rope_kv.cuh"
#include "kernels/sampling.cuh"
#include "kernels/silu_mul.cuh"

namespace ts {

using bf16 = __nv_bfloat16;
namespace k = ::ts::kernels;

namespace {

// Launches one op, told to a benchmark's observer (OpObserver), which may leave it out.
template <typename Fn>
absl::Status RunOp(OpObserver* observer, const char* name, cudaStream_t stream, Fn&& fn) {
  if (observer == nullptr) return fn();
  if (observer->Skip(name)) return absl::OkStatus();
  TS_RETURN_IF_ERROR(observer->Begin(name, stream));
  TS_RETURN_IF_ERROR(fn());
  return observer->End(stream);
}

}  // namespace

absl::Status CudaModel::LaunchLinear(const k::Gemm& gemm, const k::GemmParams& p,
                                     cudaStream_t stream) const {
  // Measured on the H200 (bench/results/2026-11-29-h200.md, tailserve-gemv-bench): at m <= 8 the
  // GEMV streams the 8-50 MB matrices (qkv, o, down) 10-35% faster than cuBLASLt, while
  // cuBLASLt stays at the roof on the large ones (gate_up of 8B, lm_head), so only small W moves.
  constexpr int64_t kGemvMaxWeightBytes = int64_t{64} << 20;
  const int64_t weight_bytes = int64_t{p.n} * p.k * 2;
  if (p.m <= k::kGemvRegisterMaxM && weight_bytes <= kGemvMaxWeightBytes && p.k % 8 == 0 &&
      k::ChooseGemvSplitK(p.m, p.n, p.k, num_sms_) == 1) {
    // pdl: the GEMV starts streaming W while the kernel before it finishes; nothing in the step
    // writes weights, and A and C are touched only after griddepcontrol.wait.
    return k::LaunchGemv(
        {.a = p.a,
         .w = p.w,
         .c = p.c,
         .m = p.m,
         .n = p.n,
         .k = p.k,
         .epilogue = p.accumulate ? k::GemvEpilogue::kAccumulate : k::GemvEpilogue::kStore,
         .pdl = true,
         .warp_tiles = k::GemvWarpTiles::kAuto},
        stream);
  }
  return gemm.Launch(p, stream);
}

bool CudaModel::FusedDecodeLayers(int32_t rows) const {
  const ModelDims& d = dims();
  return rows <= k::kGemvRegisterMaxM && k::GemvCanFuseNorm(rows, d.hidden) && d.hidden % 8 == 0 &&
         d.q_dim() % 8 == 0 && d.intermediate_padded % 8 == 0;
}

bool CudaModel::GemvEpilogueLayers(const ModelDims& d, int32_t rows) {
  return rows > k::kGemvRegisterMaxM && rows <= k::kGemvMaxM && d.head_dim % 16 == 0 &&
         k::kGemvTcTileN % d.head_dim == 0 && d.hidden % 8 == 0 && d.q_dim() % 8 == 0 &&
         d.intermediate_padded % 8 == 0;
}

absl::Status CudaModel::EnqueueAttention(const ForwardBuffers& f, int32_t rows,
                                         const LayerBuffers& layer, const Attention& at,
                                         const k::DecodeAttentionRope* rope,
                                         cudaStream_t stream) const {
  if (at.decode) return DecodeAttention(f, rows, layer, at, rope, stream);
  if (rope != nullptr) return absl::InternalError("attention: a fused RoPE in a prefill step");
  if (at.decode_rows == 0) return PrefillAttention(f, 0, layer, at, stream);
  // A mixed step: the decode rows' attention on the side stream, beside the prompt rows'. The
  // two write disjoint rows of f.attn and disjoint parts of the attention workspace, and only
  // read the cache. The prefill kernel alone fills under half the SMs at a 256-row step
  // (bench/results/2026-12-06-h100-mixed-step-trace.txt).
  TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(attention_fork_, stream));
  TS_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(attention_side_, attention_fork_));
  TS_RETURN_IF_ERROR(PrefillAttention(f, at.decode_rows, layer, at, stream));
  TS_RETURN_IF_ERROR(
      DecodeAttention(f, at.decode_rows, layer, at, nullptr, attention_side_, /*pdl=*/false));
  TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(attention_join_, attention_side_));
  TS_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, attention_join_));
  return absl::OkStatus();
}

absl::Status CudaModel::DecodeAttention(const ForwardBuffers& f, int32_t rows,
                                        const LayerBuffers& layer, const Attention& at,
                                        const k::DecodeAttentionRope* rope, cudaStream_t stream,
                                        bool pdl) const {
  const ModelDims& d = dims();
  const ArenaShape& s = plan_.shape;
  k::DecodeAttentionParams p;
  p.q = rope == nullptr ? f.q : nullptr;
  if (rope != nullptr) p.rope = *rope;
  p.k_cache = layer.k_cache;
  p.v_cache = layer.v_cache;
  p.block_tables = at.decode_block_tables;
  p.context_lens = at.context_lens;
  p.out = f.attn;
  p.workspace = dev_.attention_workspace;
  p.workspace_bytes = plan_.attention_workspace_bytes;
  p.error_flag = host_dev_.error_flag;
  p.num_seqs = rows;
  p.num_q_heads = d.num_heads;
  p.num_kv_heads = d.num_kv_heads;
  p.head_dim = d.head_dim;
  p.block_size = s.kv_block_size;
  p.num_blocks = s.num_kv_blocks;
  p.max_blocks_per_seq = s.max_blocks_per_seq;
  p.scale = 1.0f / std::sqrt(static_cast<float>(d.head_dim));
  p.mode = k::DecodeAttentionMode::kStaticSplit;
  p.max_splits = at.max_splits;
  p.num_splits = at.num_splits;
  p.pdl = pdl;
  // A bucket whose split count is 1 even at the longest context (the large batches) needs no
  // combine node in any regime; decided per bucket, so exec updates never change the nodes.
  p.no_combine = at.max_splits == 1;
  return k::LaunchDecodeAttention(p, stream);
}

absl::Status CudaModel::PrefillAttention(const ForwardBuffers& f, int32_t first_row,
                                         const LayerBuffers& layer, const Attention& at,
                                         cudaStream_t stream) const {
  const ModelDims& d = dims();
  const ArenaShape& s = plan_.shape;
  const size_t offset = static_cast<size_t>(first_row) * d.q_dim();
  k::PrefillAttentionParams p;
  p.q = f.q + offset;
  p.k_cache = layer.k_cache;
  p.v_cache = layer.v_cache;
  p.block_tables = at.block_tables;
  p.cu_seqlens = at.cu_seqlens;
  p.start_pos = at.start_pos;
  p.out = f.attn + offset;
  p.error_flag = host_dev_.error_flag;
  p.num_seqs = at.num_seqs;
  p.total_tokens = at.total_tokens;
  p.max_q_len = at.max_q_len;
  p.num_q_heads = d.num_heads;
  p.num_kv_heads = d.num_kv_heads;
  p.head_dim = d.head_dim;
  p.block_size = s.kv_block_size;
  p.num_blocks = s.num_kv_blocks;
  p.max_blocks_per_seq = s.max_blocks_per_seq;
  p.scale = 1.0f / std::sqrt(static_cast<float>(d.head_dim));
  p.num_splits =
      k::PrefillAttentionSplits(at.total_tokens, at.max_q_len, at.num_seqs, d.num_heads,
                                d.num_kv_heads, at.max_kv_len, num_sms_, kPrefillSplitRows);
  char* partials = static_cast<char*>(dev_.attention_workspace) + prefill_partials_offset_;
  p.partial_out = reinterpret_cast<float*>(partials);
  p.partial_lse = reinterpret_cast<float*>(
      partials + k::PrefillAttentionLseOffset(kPrefillSplitRows, d.num_heads, d.head_dim));
  return k::LaunchPrefillAttention(p, stream);
}

// Both paths round where transformers' bf16 Llama rounds (kernels/bf16_vec.cuh): every Linear's
// output is bf16 before the residual add, the add is rounded, and so on.
absl::Status CudaModel::EnqueueLayers(const ForwardBuffers& f, int32_t rows, const Attention& at,
                                      const k::Gemm& gemm, cudaStream_t stream,
                                      OpObserver* observer) const {
  const ModelDims& d = dims();
  const ArenaShape& s = plan_.shape;
  const float eps = config_.rms_norm_eps;
  const bool fused = at.decode && FusedDecodeLayers(rows);
  const k::KvLayout kv_layout{s.num_kv_blocks, d.num_kv_heads, s.kv_block_size, d.head_dim};
  auto rope_kv = [&](const LayerBuffers& layer) {
    return RunOp(observer, "rope_kv", stream, [&] {
      k::RopeKvParams p;
      p.qkv = f.qkv;
      p.q_out = f.q;
      p.positions = f.positions;
      p.slot_mapping = f.slot_mapping;
      p.inv_freq = dev_.inv_freq;
      p.k_cache = layer.k_cache;
      p.v_cache = layer.v_cache;
      p.error_flag = host_dev_.error_flag;
      p.layout = kv_layout;
      p.rows = rows;
      p.num_q_heads = d.num_heads;
      p.pdl = true;  // launches while the qkv GEMM drains; waits for it before reading
      return k::LaunchRopeKv(p, stream);
    });
  };
  // Where a qkv GEMV's kRopeKv epilogue writes rotated k and v.
  auto rope_targets = [&](const LayerBuffers& layer) {
    return k::GemvRopeKv{.positions = f.positions,
                         .slot_mapping = f.slot_mapping,
                         .inv_freq = dev_.inv_freq,
                         .k_cache = layer.k_cache,
                         .v_cache = layer.v_cache,
                         .error_flag = host_dev_.error_flag,
                         .layout = kv_layout,
                         .num_q_heads = d.num_heads};
  };
  auto attention = [&](const LayerBuffers& layer, const k::DecodeAttentionRope* rope = nullptr) {
    return RunOp(observer, "attention", stream,
                 [&] { return EnqueueAttention(f, rows, layer, at, rope, stream); });
  };

  if (fused) {
    // Decode at m <= 8: four GEMV nodes per layer carry the residual adds, SwiGLU, (head_dim a
    // multiple of 16) RoPE with the K/V write and, where A is small enough that normalising it in
    // every CTA costs less than a node (k::GemvNormProloguePays), the norms: a layer is 6 graph
    // nodes with the attention's split and combine, or 8 with rmsnorm nodes, instead of 10 (each
    // node costs ~1.7 us at batch 1, docs/gpu-facts.md, Per-step launch cost). Each fusion was
    // measured against the separate nodes (bench/results/2026-11-29*-h200.md, 2026-12-03-h200.md).
    const bool norm_prologue = k::GemvNormProloguePays(rows, d.hidden);
    auto gemv = [&](const char* name, k::GemvParams p) {
      p.m = rows;
      p.warp_tiles = k::GemvWarpTiles::kAuto;
      p.pdl = true;  // nothing in the step writes weights; A and C are read after the wait
      return RunOp(observer, name, stream, [&] { return k::LaunchGemv(p, stream); });
    };
    // A GEMV of RMSNorm(h) by `norm_weight`: the prologue, or a rmsnorm node into xn first (the
    // GEMVs add into h themselves, so no output waits to be added).
    auto normed_gemv = [&](const char* norm_name, const bf16* norm_weight, const char* name,
                           k::GemvParams p) {
      p.a = f.h;
      if (norm_prologue) {
        p.norm_weight = norm_weight;
        p.norm_eps = eps;
        return gemv(name, p);
      }
      TS_RETURN_IF_ERROR(RunOp(observer, norm_name, stream, [&] {
        return k::LaunchRmsNorm({.residual = f.h,
                                 .weight = norm_weight,
                                 .out = f.xn,
                                 .rows = rows,
                                 .hidden = d.hidden,
                                 .eps = eps,
                                 .pdl = true},
                                stream);
      }));
      p.a = f.xn;
      return gemv(name, p);
    };
    for (const LayerBuffers& layer : dev_.layers) {
      k::GemvParams qkv{.w = layer.qkv, .c = f.qkv, .n = d.qkv_dim(), .k = d.hidden};
      if (d.head_dim % 16 == 0) {
        qkv.c = f.q;  // rotated q only; k and v go straight to the cache
        qkv.epilogue = k::GemvEpilogue::kRopeKv;
        qkv.rope = rope_targets(layer);
        TS_RETURN_IF_ERROR(normed_gemv("attn_norm", layer.attn_norm, "qkv_rope_gemm", qkv));
      } else {
        TS_RETURN_IF_ERROR(normed_gemv("attn_norm", layer.attn_norm, "qkv_gemm", qkv));
        TS_RETURN_IF_ERROR(rope_kv(layer));
      }
      TS_RETURN_IF_ERROR(attention(layer));
      TS_RETURN_IF_ERROR(gemv("o_gemm", {.a = f.attn,
                                         .w = layer.o,
                                         .c = f.h,
                                         .n = d.hidden,
                                         .k = d.q_dim(),
                                         .epilogue = k::GemvEpilogue::kAccumulate}));
      TS_RETURN_IF_ERROR(normed_gemv("mlp_norm", layer.mlp_norm, "gate_up_gemm",
                                     {.w = layer.gate_up,
                                      .c = f.act,
                                      .n = d.intermediate_padded,
                                      .k = d.hidden,
                                      .epilogue = k::GemvEpilogue::kSiluMul}));
      TS_RETURN_IF_ERROR(gemv("down_gemm", {.a = f.act,
                                            .w = layer.down,
                                            .c = f.h,
                                            .n = d.hidden,
                                            .k = d.intermediate_padded,
                                            .epilogue = k::GemvEpilogue::kAccumulate}));
    }
    return absl::OkStatus();
  }

  // cuBLASLt path (prefill, batches above 16) and the shared-memory GEMV path (decode at 8 < rows
  // <= 16). On cuBLASLt, o_proj and down_proj write their bf16 output to xn and the next rmsnorm
  // adds it into the residual (x), as transformers rounds: bf16(h + bf16(o)); down_proj's output
  // is added by the next layer's attn_norm; in a decode step the attention kernel rotates q and
  // writes the current token's K/V (k::DecodeAttentionRope, with the cos/sin the step's prepare
  // kernel left in f.rope_angles), so only prefill and mixed steps have a rope_kv node. The GEMV
  // adds into h itself (kAccumulate, the same rounding) and carries RoPE with the K/V write and
  // SwiGLU, so its layer has no rope_kv or silu_mul node and no split-K reduce node (reduced
  // inside the kernel). Its down GEMV also leaves h's row sums of squares in h_sumsq, and the
  // next layer's qkv GEMV normalises h from them, so only the stage's first attn_norm is a node.
  // PDL (kernels/pdl.cuh) only behind a kernel of this sequence: its overlap and its wait are
  // defined against the kernel before, and a later pipeline stage's first norm follows the copy
  // of its input instead.
  const bool epilogues = at.decode && GemvEpilogueLayers(d, rows);
  bool behind_kernel = stage().has_embedding;
  auto norm = [&](const char* name, const bf16* pending, const bf16* weight) {
    const bool pdl = behind_kernel;
    behind_kernel = true;
    return RunOp(observer, name, stream, [&] {
      return k::LaunchRmsNorm({.x = pending,
                               .residual = f.h,
                               .weight = weight,
                               .out = f.xn,
                               .rows = rows,
                               .hidden = d.hidden,
                               .eps = eps,
                               .pdl = pdl},
                              stream);
    });
  };
  auto linear = [&](const char* name, const bf16* a, const bf16* w, bf16* c, int32_t n,
                    int32_t kdim) {
    return RunOp(observer, name, stream, [&] {
      return LaunchLinear(gemm, {.a = a, .w = w, .c = c, .m = rows, .n = n, .k = kdim}, stream);
    });
  };
  // Split-K at m > 8 needs no workspace (reduced across a cluster, kernels/gemv.cuh).
  auto gemv = [&](const char* name, k::GemvParams p) {
    p.m = rows;
    p.split_k = k::ChooseGemvSplitK(rows, p.n, p.k, num_sms_, p.epilogue);
    p.pdl = true;  // behind a norm, attention or GEMV kernel; nothing in the step writes weights
    return RunOp(observer, name, stream, [&] { return k::LaunchGemv(p, stream); });
  };
  bool h_sumsq = false;           // h_sumsq holds the sums of squares of h as it stands
  const bf16* pending = nullptr;  // xn once a cuBLASLt o/down_proj output waits to be added
  for (const LayerBuffers& layer : dev_.layers) {
    if (epilogues) {
      k::GemvParams qkv{.w = layer.qkv,
                        .c = f.q,
                        .n = d.qkv_dim(),
                        .k = d.hidden,
                        .epilogue = k::GemvEpilogue::kRopeKv,
                        .rope = rope_targets(layer)};
      if (h_sumsq) {  // h as the last layer's down GEMV left it, normalised inside qkv
        qkv.a = f.h;
        qkv.norm_weight = layer.attn_norm;
        qkv.norm_eps = eps;
        qkv.a_sumsq = f.h_sumsq;
      } else {
        TS_RETURN_IF_ERROR(norm("attn_norm", nullptr, layer.attn_norm));
        qkv.a = f.xn;
      }
      TS_RETURN_IF_ERROR(gemv("qkv_rope_gemm", qkv));
      TS_RETURN_IF_ERROR(attention(layer));
      TS_RETURN_IF_ERROR(gemv("o_gemm", {.a = f.attn,
                                         .w = layer.o,
                                         .c = f.h,
                                         .n = d.hidden,
                                         .k = d.q_dim(),
                                         .epilogue = k::GemvEpilogue::kAccumulate}));
      // mlp_norm stays a node: folded into gate_up the same way, it put gate_up straight behind
      // o under PDL, which cost 8B 6-9% of the step (1B gained 2.5-3.5%;
      // bench/results/2026-12-04-h200.md).
      TS_RETURN_IF_ERROR(norm("mlp_norm", nullptr, layer.mlp_norm));
      TS_RETURN_IF_ERROR(gemv("gate_up_gemm", {.a = f.xn,
                                               .w = layer.gate_up,
                                               .c = f.act,
                                               .n = d.intermediate_padded,
                                               .k = d.hidden,
                                               .epilogue = k::GemvEpilogue::kSiluMul}));
      TS_RETURN_IF_ERROR(gemv("down_gemm", {.a = f.act,
                                            .w = layer.down,
                                            .c = f.h,
                                            .n = d.hidden,
                                            .k = d.intermediate_padded,
                                            .epilogue = k::GemvEpilogue::kAccumulate,
                                            .sumsq_out = f.h_sumsq}));
      h_sumsq = true;
      continue;
    }
    TS_RETURN_IF_ERROR(norm("attn_norm", pending, layer.attn_norm));
    TS_RETURN_IF_ERROR(linear("qkv_gemm", f.xn, layer.qkv, f.qkv, d.qkv_dim(), d.hidden));
    if (at.decode) {  // the attention kernel rotates q and writes K/V: no rope_kv node
      const k::DecodeAttentionRope rope{.qkv = f.qkv,
                                        .angles = f.rope_angles,
                                        .slot_mapping = f.slot_mapping,
                                        .k_cache = layer.k_cache,
                                        .v_cache = layer.v_cache,
                                        .error_flag = host_dev_.error_flag};
      TS_RETURN_IF_ERROR(attention(layer, &rope));
    } else {
      TS_RETURN_IF_ERROR(rope_kv(layer));
      TS_RETURN_IF_ERROR(attention(layer));
    }
    TS_RETURN_IF_ERROR(linear("o_gemm", f.attn, layer.o, f.xn, d.hidden, d.q_dim()));
    TS_RETURN_IF_ERROR(norm("mlp_norm", f.xn, layer.mlp_norm));
    TS_RETURN_IF_ERROR(linear("gate_up_gemm", f.xn, layer.gate_up, f.gate_up,
                              2 * d.intermediate_padded, d.hidden));
    TS_RETURN_IF_ERROR(RunOp(observer, "silu_mul", stream, [&] {
      return k::LaunchSiluMul({.in = f.gate_up,
                               .out = f.act,
                               .rows = rows,
                               .intermediate = d.intermediate_padded,
                               .pdl = true},
                              stream);
    }));
    TS_RETURN_IF_ERROR(
        linear("down_gemm", f.act, layer.down, f.xn, d.hidden, d.intermediate_padded));
    pending = f.xn;
  }
  // The last down_proj output joins the residual here, so callers (the prefill's row gather, the
  // final norm, the next pipeline stage) see the finished hidden state in h; the norm output
  // itself is discarded, so any weight of the right size does (a stage may hold no final norm).
  if (pending == nullptr) return absl::OkStatus();
  return norm("residual_add", pending, dev_.layers.back().mlp_norm);
}

absl::Status CudaModel::EnqueueLogits(bf16* hidden_in, const HeadBuffers& head, int32_t padded_rows,
                                      const k::LogitsGemm& gemm, cudaStream_t stream,
                                      OpObserver* observer) const {
  const ModelDims& d = dims();
  TS_RETURN_IF_ERROR(RunOp(observer, "final_norm", stream, [&] {
    return k::LaunchRmsNorm({.x = nullptr,
                             .residual = hidden_in,
                             .weight = dev_.final_norm,
                             .out = head.normed,
                             .rows = padded_rows,
                             .hidden = d.hidden,
                             .eps = config_.rms_norm_eps},
                            stream);
  }));
  return RunOp(observer, "lm_head_gemm", stream, [&] {
    return gemm.Launch(head.normed, dev_.lm_head, head.logits_f32, padded_rows, d.vocab, d.hidden,
                       stream);
  });
}

absl::Status CudaModel::EnqueueSampleAndPost(const HeadBuffers& head, int32_t rows,
                                             int32_t from_state, int32_t to_state,
                                             k::StepStamps* stamps, cudaStream_t stream,
                                             OpObserver* observer) const {
  const ModelDims& d = dims();
  const ArenaShape& s = plan_.shape;
  TS_ASSIGN_OR_RETURN(const DeviceSlots* slots, Slots());
  TS_RETURN_IF_ERROR(RunOp(observer, "sampling", stream, [&] {
    k::SamplingKernelParams p;
    p.logits = head.logits_f32;
    p.params = head.params;
    p.row_slots = head.sample_slots;
    p.output_counts = slots->dev().output_counts;
    p.prompt_mask = slots->dev().prompt_mask;
    p.tokens = head.sampled;
    p.error_flag = host_dev_.error_flag;
    p.rows = rows;
    p.vocab = d.vocab;
    p.num_slots = s.count_rows();
    p.params_by_slot = false;
    p.update_counts = false;        // postprocess counts only tokens it emits
    p.round_logits_to_bf16 = true;  // the model's dtype: greedy agrees with transformers' argmax
    // Enough CTAs per row to spread a small batch's passes over the GPU (and no more than half
    // of it, LaunchSampling's limit).
    p.split = std::clamp(num_sms_ / std::max(rows, 1), 1,
                         std::max(1, std::min(k::kSamplingMaxSplit, num_sms_ / 2)));
    p.workspace = head.sampling_workspace;
    p.workspace_bytes = head.sampling_workspace_bytes;
    return k::LaunchSampling(p, stream);
  }));
  return RunOp(observer, "postprocess", stream, [&] {
    k::PostprocessParams p;
    p.row_slots = head.row_slots;
    p.tokens = head.sampled;
    p.slots = slots->dev().slots;
    p.cancel = slots->host_dev().cancel;
    p.done = slots->host_dev().done;
    p.rings = slots->host_dev().rings;
    p.output_counts = slots->dev().output_counts;
    p.num_eos = static_cast<int32_t>(config_.eos_token_ids.size());
    for (int32_t i = 0; i < p.num_eos; ++i) p.eos_ids[i] = config_.eos_token_ids[i];
    p.rows = rows;
    p.num_slots = s.max_slots;
    p.vocab = d.vocab;
    p.ring_capacity = s.ring_capacity;
    p.from_state = from_state;
    p.to_state = to_state;
    p.stamps = stamps;
    return k::LaunchPostprocess(p, stream);
  });
}

CudaModel::RowInputs CudaModel::DecodeInputs(const ForwardBuffers& f) const {
  const HeadBuffers& head = dev_.decode_head;
  return RowInputs{.row_slots = head.row_slots,
                   .tokens = f.tokens,
                   .positions = f.positions,
                   .slot_mapping = f.slot_mapping,
                   .context_lens = dev_.decode_context_lens,
                   .sample_slots = head.sample_slots,
                   .block_tables = dev_.decode_block_tables,
                   .sampling = head.params,
                   .rope_angles = f.rope_angles};
}

absl::Status CudaModel::EnqueuePrepare(const RowInputs& in, int32_t rows, k::StepStamps* stamps,
                                       cudaStream_t stream) const {
  const ArenaShape& s = plan_.shape;
  TS_ASSIGN_OR_RETURN(const DeviceSlots* slots, Slots());
  k::PrepareDecodeParams p;
  p.row_slots = in.row_slots;
  p.slots = slots->dev().slots;
  p.slot_block_tables = slots->dev().block_tables;
  p.tokens = in.tokens;
  p.positions = in.positions;
  p.slot_mapping = in.slot_mapping;
  p.context_lens = in.context_lens;
  p.block_tables = in.block_tables;
  p.sampling = in.sampling;
  p.sample_slots = in.sample_slots;
  p.rows = rows;
  p.num_slots = s.max_slots;
  p.max_blocks = s.max_blocks_per_seq;
  p.block_size = s.kv_block_size;
  p.rope_angles = in.rope_angles;
  p.inv_freq = dev_.inv_freq;
  p.rope_pairs = dims().head_dim / 2;
  p.stamps = stamps;
  return k::LaunchPrepareDecode(p, stream);
}

absl::Status CudaModel::EnqueueEmbedding(const ForwardBuffers& f, int32_t rows,
                                         cudaStream_t stream) const {
  return k::LaunchEmbedding({.tokens = f.tokens,
                             .table = dev_.embed,
                             .out = f.h,
                             .error_flag = host_dev_.error_flag,
                             .rows = rows,
                             .hidden = dims().hidden,
                             .vocab = dims().vocab},
                            stream);
}

absl::Status CudaModel::GatherPromptEnds(int32_t gathers, cudaStream_t stream) const {
  return k::LaunchGatherRows({.src = dev_.prefill.h,
                              .src_rows = dev_.gather_src,
                              .dst = dev_.prefill_head.hidden,
                              .dst_rows = dev_.gather_dst,
                              .n = gathers,
                              .width = dims().hidden},
                             stream);
}

absl::StatusOr<int32_t> CudaModel::BucketIndex(const char* what, int32_t bucket) const {
  const auto it = std::lower_bound(buckets_.begin(), buckets_.end(), bucket);
  if (it == buckets_.end() || *it != bucket) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": bucket ", bucket, " is not one of the planned buckets"));
  }
  return static_cast<int32_t>(it - buckets_.begin());
}

absl::Status CudaModel::EnqueueDecodeStep(int32_t bucket, int32_t num_splits, cudaStream_t stream,
                                          OpObserver* observer) const {
  TS_RETURN_IF_ERROR(BucketIndex("decode step", bucket).status());
  if (!whole_model()) {
    return absl::FailedPreconditionError("decode step: this model holds one pipeline stage");
  }
  TS_RETURN_IF_ERROR(RunOp(observer, "prepare", stream, [&] {
    return EnqueuePrepare(DecodeInputs(dev_.decode), bucket, step_stamps_, stream);
  }));
  return EnqueueStageDecode(bucket, num_splits, stream, observer);
}

absl::Status CudaModel::EnqueueDecodePrepare(int32_t bucket, cudaStream_t stream, bool feed) const {
  TS_RETURN_IF_ERROR(BucketIndex("decode prepare", bucket).status());
  if (!stage().has_head) {
    return absl::FailedPreconditionError(
        "decode prepare: the slot table is the last pipeline stage's");
  }
  // A benchmark's stamps: the step starts here, as in EnqueueDecodeStep.
  if (!feed) return EnqueuePrepare(DecodeInputs(dev_.decode), bucket, step_stamps_, stream);
  if (feed_base_ == nullptr) return absl::FailedPreconditionError("decode prepare: no feed");
  return EnqueuePrepare(feed_, bucket, nullptr, stream);
}

absl::Status CudaModel::AddDecodeFeed() {
  if (feed_base_ != nullptr) return absl::OkStatus();
  const ArenaShape& s = plan_.shape;
  const size_t rows = static_cast<size_t>(s.max_bucket), i = sizeof(int32_t);
  const size_t ints = rows * (6 + static_cast<size_t>(s.max_blocks_per_seq));
  const size_t sampling_at = (ints * i + 255) / 256 * 256;
  const size_t angles_at = (sampling_at + rows * sizeof(k::SamplingRow) + 255) / 256 * 256;
  const size_t bytes = angles_at + rows * dims().head_dim * sizeof(float);
  TS_CUDA_RETURN_IF_ERROR(cudaMalloc(&feed_base_, bytes));
  int32_t* p = static_cast<int32_t*>(feed_base_);
  for (int32_t** b : {&feed_.row_slots, &feed_.tokens, &feed_.positions, &feed_.slot_mapping,
                      &feed_.context_lens, &feed_.sample_slots}) {
    *b = p;
    p += rows;
  }
  feed_.block_tables = p;
  feed_.sampling = reinterpret_cast<k::SamplingRow*>(static_cast<char*>(feed_base_) + sampling_at);
  feed_.rope_angles = reinterpret_cast<float*>(static_cast<char*>(feed_base_) + angles_at);
  return absl::OkStatus();
}

std::vector<DeviceBytes> CudaModel::DecodeRowInputs(int32_t bucket, bool feed) const {
  const size_t rows = static_cast<size_t>(bucket), i = sizeof(int32_t);
  const size_t tables = rows * plan_.shape.max_blocks_per_seq * i;
  const size_t angles = rows * dims().head_dim * sizeof(float);
  if (feed) {
    return {{feed_.tokens, rows * i},       {feed_.positions, rows * i},
            {feed_.slot_mapping, rows * i}, {feed_.context_lens, rows * i},
            {feed_.block_tables, tables},   {feed_.rope_angles, angles}};
  }
  const DeviceLayout& d = dev_;
  return {{d.decode.tokens, rows * i},       {d.decode.positions, rows * i},
          {d.decode.slot_mapping, rows * i}, {d.decode_context_lens, rows * i},
          {d.decode_block_tables, tables},   {d.decode.rope_angles, angles}};
}

DeviceBytes CudaModel::DecodeHidden(int32_t bucket) const {
  return {dev_.decode.h, static_cast<size_t>(bucket) * dims().hidden * sizeof(bf16)};
}

DeviceBytes CudaModel::PrefillHidden(int32_t tokens) const {
  return {dev_.prefill.h,
          static_cast<size_t>(PrefillRowsFor(tokens)) * dims().hidden * sizeof(bf16)};
}

absl::Status CudaModel::EnqueueStageDecode(int32_t bucket, int32_t num_splits, cudaStream_t stream,
                                           OpObserver* observer) const {
  TS_ASSIGN_OR_RETURN(const int32_t index, BucketIndex("decode step", bucket));
  const ForwardBuffers& f = dev_.decode;
  const HeadBuffers& head = dev_.decode_head;
  const ModelStage& st = stage();
  if (st.has_embedding) {
    TS_RETURN_IF_ERROR(
        RunOp(observer, "embedding", stream, [&] { return EnqueueEmbedding(f, bucket, stream); }));
  }
  Attention at;
  at.decode = true;
  at.num_splits = num_splits;
  at.max_splits = max_splits_[index];
  at.context_lens = dev_.decode_context_lens;
  at.decode_block_tables = dev_.decode_block_tables;
  TS_RETURN_IF_ERROR(EnqueueLayers(f, bucket, at, *decode_gemm_, stream, observer));
  if (!st.has_head) return absl::OkStatus();  // f.h is the next stage's input
  TS_RETURN_IF_ERROR(EnqueueLogits(f.h, head, bucket, *decode_logits_, stream, observer));
  return EnqueueSampleAndPost(head, bucket, k::kSlotActive, k::kSlotActive, step_stamps_, stream,
                              observer);
}

}  // namespace ts
