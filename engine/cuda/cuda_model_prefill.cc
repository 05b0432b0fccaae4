// CudaModel's prefill: prompts packed into chunks of at most prefill_chunk_tokens rows, run
// through the same layers as a decode step with causal prefill attention (host-launched, not a
// graph), then the first token of each prompt through the decode step's sampling and
// postprocess kernels.
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/backend.h"
#include "engine/cuda/cuda_model.h"
#include "kernels/cuda_check.h"
#include "kernels/gather_rows.cuh"
#include "kernels/kv_layout.cuh"
#include "kernels/postprocess.cuh"

namespace ts {

namespace k = ::ts::kernels;

std::vector<std::vector<PrefillPiece>> ChunkPrefill(std::span<const PrefillSeq> seqs,
                                                    int32_t chunk_tokens) {
  std::vector<std::vector<PrefillPiece>> chunks(1);
  int32_t rows_used = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int32_t len = static_cast<int32_t>(seqs[i].tokens.size());
    for (int32_t start = 0; start < len;) {
      const int32_t take = std::min(len - start, chunk_tokens - rows_used);
      chunks.back().push_back(PrefillPiece{.tokens = seqs[i].tokens,
                                           .block_table = seqs[i].block_table,
                                           .start = start,
                                           .len = take,
                                           .head_row = start + take == len ? int32_t(i) : -1});
      rows_used += take;
      start += take;
      if (rows_used == chunk_tokens) {
        chunks.emplace_back();
        rows_used = 0;
      }
    }
  }
  if (chunks.back().empty()) chunks.pop_back();
  return chunks;
}

absl::Status CudaModel::EnqueuePrefill(std::span<const PrefillSeq> seqs, cudaStream_t stream) {
  const int32_t n = static_cast<int32_t>(seqs.size());
  if (n > plan_.shape.max_slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill: ", n, " sequences exceed max_slots ", plan_.shape.max_slots));
  }
  for (int32_t i = 0; i < n; ++i) {
    if (seqs[i].tokens.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("prefill seq ", i, ": empty"));
    }
  }
  for (const std::vector<PrefillPiece>& pieces : ChunkPrefill(seqs, plan_.shape.prefill_rows)) {
    TS_RETURN_IF_ERROR(EnqueuePrefillChunk(pieces, FirstTokens{}, stream));
  }
  return absl::OkStatus();
}

absl::StatusOr<CudaModel::Attention> CudaModel::StagePieces(std::span<const PrefillPiece> pieces,
                                                            int32_t row_offset, cudaStream_t stream,
                                                            int32_t* rows_out, int32_t* gathers) {
  const ArenaShape& s = plan_.shape;
  const int32_t bs = s.kv_block_size;
  const int32_t mb = s.max_blocks_per_seq;
  if (static_cast<int32_t>(pieces.size()) > s.max_slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill chunk: ", pieces.size(), " pieces exceed max_slots ", s.max_slots));
  }
  int32_t rows = 0;
  for (size_t j = 0; j < pieces.size(); ++j) {
    const PrefillPiece& p = pieces[j];
    const int32_t len = static_cast<int32_t>(p.tokens.size());
    if (len < 1) return absl::InvalidArgumentError(absl::StrCat("prefill piece ", j, ": empty"));
    const int64_t need = (static_cast<int64_t>(len) + bs - 1) / bs;
    if (static_cast<int64_t>(p.block_table.size()) < need || len > max_context_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prefill piece ", j, ": ", len, " tokens need ", need, " blocks (max_context ",
          max_context_, "), block_table has ", p.block_table.size()));
    }
    if (p.len < 1 || p.start < 0 || p.start + p.len > len) {
      return absl::InvalidArgumentError(absl::StrCat("prefill piece ", j, ": rows [", p.start, ", ",
                                                     p.start + p.len, ") outside the ", len,
                                                     "-token prompt"));
    }
    if ((p.head_row >= 0) != (p.start + p.len == len) || p.head_row >= s.max_slots) {
      return absl::InvalidArgumentError(
          absl::StrCat("prefill piece ", j, ": head_row ", p.head_row,
                       " must be in [0, max_slots) exactly when the piece ends its prompt"));
    }
    rows += p.len;
  }
  if (row_offset + rows > s.prefill_rows) {
    return absl::InvalidArgumentError(absl::StrCat("prefill chunk: ", row_offset, " + ", rows,
                                                   " rows exceed prefill rows ", s.prefill_rows));
  }

  // The staging is reused per chunk: wait until the previous chunk's copies have read it.
  TS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(staging_free_));
  const HostLayout& h = host_;
  int32_t row = 0, gathered = 0, max_q = 0, max_kv = 0;
  for (size_t j = 0; j < pieces.size(); ++j) {
    const PrefillPiece& p = pieces[j];
    h.cu_seqlens[j] = row;
    h.start_pos[j] = p.start;
    const size_t copy = std::min<size_t>(p.block_table.size(), mb);
    int32_t* table = h.block_tables + j * mb;
    std::copy_n(p.block_table.begin(), copy, table);
    std::fill(table + copy, table + mb, k::kInvalidKvBlock);
    for (int32_t t = 0; t < p.len; ++t, ++row) {
      const int32_t pos = p.start + t;
      h.tokens[row] = p.tokens[pos];
      h.positions[row] = pos;
      h.slot_mapping[row] = k::KvSlotFor(table, mb, bs, pos);
    }
    max_q = std::max(max_q, p.len);
    max_kv = std::max(max_kv, p.start + p.len);
    if (p.head_row >= 0) {
      h.gather_src[gathered] = row_offset + row - 1;
      h.gather_dst[gathered] = p.head_row;
      ++gathered;
    }
  }
  const int32_t num_pieces = static_cast<int32_t>(pieces.size());
  h.cu_seqlens[num_pieces] = row;
  // Staged rows [0, padded - row_offset) land at device rows [row_offset, padded).
  const int32_t padded = PrefillRowsFor(row_offset + row);
  const int32_t staged = padded - row_offset;
  for (int32_t r = row; r < staged; ++r) {
    h.tokens[r] = 0;
    h.positions[r] = 0;
    h.slot_mapping[r] = k::kNoKvWrite;  // padding rows
  }
  const DeviceLayout& dv = dev_;
  auto h2d = [&](void* dst, const void* src, size_t bytes) {
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream);
  };
  const size_t ib = sizeof(int32_t);
  TS_CUDA_RETURN_IF_ERROR(h2d(dv.prefill.tokens + row_offset, h.tokens, staged * ib));
  TS_CUDA_RETURN_IF_ERROR(h2d(dv.prefill.positions + row_offset, h.positions, staged * ib));
  TS_CUDA_RETURN_IF_ERROR(h2d(dv.prefill.slot_mapping + row_offset, h.slot_mapping, staged * ib));
  TS_CUDA_RETURN_IF_ERROR(h2d(dv.prefill_cu_seqlens, h.cu_seqlens, (num_pieces + 1) * ib));
  TS_CUDA_RETURN_IF_ERROR(h2d(dv.prefill_start_pos, h.start_pos, num_pieces * ib));
  TS_CUDA_RETURN_IF_ERROR(
      h2d(dv.prefill_block_tables, h.block_tables, static_cast<size_t>(num_pieces) * mb * ib));
  TS_CUDA_RETURN_IF_ERROR(h2d(dv.gather_src, h.gather_src, gathered * ib));
  TS_CUDA_RETURN_IF_ERROR(h2d(dv.gather_dst, h.gather_dst, gathered * ib));

  Attention at;
  at.decode = false;
  at.block_tables = dv.prefill_block_tables;
  at.cu_seqlens = dv.prefill_cu_seqlens;
  at.start_pos = dv.prefill_start_pos;
  at.num_seqs = num_pieces;
  at.total_tokens = row;
  at.max_q_len = max_q;
  at.max_kv_len = max_kv;
  *rows_out = padded;
  *gathers = gathered;
  return at;
}

absl::StatusOr<bool> CudaModel::StagingFree() const {
  for (cudaEvent_t e : {staging_free_, sample_staging_free_}) {
    const cudaError_t q = cudaEventQuery(e);
    if (q == cudaErrorNotReady) return false;
    TS_CUDA_RETURN_IF_ERROR(q);
  }
  return true;
}

absl::Status CudaModel::EnqueuePrefillChunk(std::span<const PrefillPiece> pieces,
                                            const FirstTokens& first, cudaStream_t stream) {
  if (pieces.empty()) return absl::OkStatus();
  if (!first.slots.empty() && !stage().has_head) {
    return absl::FailedPreconditionError("first tokens: this pipeline stage holds no head");
  }
  int32_t padded = 0, gathers = 0;
  TS_ASSIGN_OR_RETURN(const Attention at, StagePieces(pieces, 0, stream, &padded, &gathers));
  TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(staging_free_, stream));
  const DeviceLayout& dv = dev_;
  const ForwardBuffers& f = dv.prefill;
  // A later pipeline stage finds its input, the stage before's output, in f.h already.
  if (stage().has_embedding) TS_RETURN_IF_ERROR(EnqueueEmbedding(f, padded, stream));
  TS_RETURN_IF_ERROR(EnqueueLayers(f, padded, at, *prefill_gemm_, stream, nullptr));
  if (!stage().has_head) return absl::OkStatus();  // f.h is the next stage's input
  TS_RETURN_IF_ERROR(GatherPromptEnds(gathers, stream));
  return EnqueuePrefillSample(first, stream);
}

absl::Status CudaModel::EnqueueMixedStep(int32_t bucket, int32_t num_splits,
                                         std::span<const PrefillPiece> pieces,
                                         const FirstTokens& first, cudaStream_t stream) {
  TS_ASSIGN_OR_RETURN(const int32_t index, BucketIndex("mixed step", bucket));
  if (pieces.empty()) return absl::InvalidArgumentError("mixed step: no prefill piece");
  if (!whole_model()) {
    return absl::FailedPreconditionError("mixed step: this model holds one pipeline stage");
  }
  const DeviceLayout& dv = dev_;
  const ForwardBuffers& f = dv.prefill;
  const HeadBuffers& head = dv.decode_head;
  int32_t padded = 0, gathers = 0;
  TS_ASSIGN_OR_RETURN(Attention at, StagePieces(pieces, bucket, stream, &padded, &gathers));
  // The row list the caller staged in host().row_slots rides with the chunk's staging.
  TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(head.row_slots, host_.row_slots, bucket * sizeof(int32_t),
                                          cudaMemcpyHostToDevice, stream));
  TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(staging_free_, stream));
  // The decode rows' inputs, from the slot table, into rows [0, bucket) of the prefill buffers.
  TS_RETURN_IF_ERROR(EnqueuePrepare(DecodeInputs(f), bucket, nullptr, stream));
  TS_RETURN_IF_ERROR(EnqueueEmbedding(f, padded, stream));
  at.decode_rows = bucket;
  at.num_splits = num_splits;
  at.max_splits = max_splits_[index];
  at.context_lens = dv.decode_context_lens;
  at.decode_block_tables = dv.decode_block_tables;
  TS_RETURN_IF_ERROR(EnqueueLayers(f, padded, at, *prefill_gemm_, stream, nullptr));
  TS_RETURN_IF_ERROR(GatherPromptEnds(gathers, stream));
  // The decode rows' hidden states are rows [0, bucket) of f.h: the head reads them in place.
  TS_RETURN_IF_ERROR(EnqueueLogits(f.h, head, bucket, *decode_logits_, stream, nullptr));
  TS_RETURN_IF_ERROR(
      EnqueueSampleAndPost(head, bucket, k::kSlotActive, k::kSlotActive, nullptr, stream, nullptr));
  return EnqueuePrefillSample(first, stream);
}

absl::Status CudaModel::EnqueuePrefillSample(const FirstTokens& first, cudaStream_t stream) {
  const int32_t n = static_cast<int32_t>(first.slots.size());
  if (n == 0) return absl::OkStatus();
  if (!stage().has_head) {
    return absl::FailedPreconditionError("first tokens: this pipeline stage holds no head");
  }
  TS_CHECK_EQ(first.slots.size(), first.params.size());
  TS_CHECK_LE(n, plan_.shape.max_slots);
  TS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(sample_staging_free_));
  const HostLayout& h = host_;
  for (int32_t i = 0; i < n; ++i) {
    h.sample_params[i] = first.params[i];
    h.sample_slots[i] = first.slots[i];
    h.head_row_slots[i] = first.slots[i];
  }
  const HeadBuffers& head = dev_.prefill_head;
  TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(head.params, h.sample_params, n * sizeof(k::SamplingRow),
                                          cudaMemcpyHostToDevice, stream));
  TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(head.sample_slots, h.sample_slots, n * sizeof(int32_t),
                                          cudaMemcpyHostToDevice, stream));
  TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(head.row_slots, h.head_row_slots, n * sizeof(int32_t),
                                          cudaMemcpyHostToDevice, stream));
  TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(sample_staging_free_, stream));
  const int32_t padded = PickBucket(buckets_, n);
  TS_RETURN_IF_ERROR(EnqueueLogits(head.hidden, head, padded, *prefill_logits_, stream, nullptr));
  return EnqueueSampleAndPost(head, n, first.from_state, first.to_state, nullptr, stream, nullptr);
}

absl::StatusOr<std::vector<float>> CudaModel::PromptLogits(std::span<const int32_t> tokens,
                                                           std::span<const int32_t> block_table,
                                                           cudaStream_t stream) {
  const int32_t n = static_cast<int32_t>(tokens.size());
  if (!stage().has_head) {
    return absl::FailedPreconditionError("PromptLogits: this pipeline stage holds no head");
  }
  if (n < 1 || n > plan_.shape.prefill_rows) {
    return absl::InvalidArgumentError(absl::StrCat("PromptLogits: ", n,
                                                   " tokens; must be in [1, prefill rows ",
                                                   plan_.shape.prefill_rows, "]"));
  }
  const PrefillSeq seq{tokens, block_table};
  TS_RETURN_IF_ERROR(EnqueuePrefill(std::span<const PrefillSeq>(&seq, 1), stream));
  const ModelDims& d = dims();
  const HeadBuffers& head = dev_.prefill_head;
  std::vector<float> out(static_cast<size_t>(n) * d.vocab);
  for (int32_t first = 0; first < n; first += head.rows) {
    const int32_t m = std::min(head.rows, n - first);
    TS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(staging_free_));
    for (int32_t i = 0; i < m; ++i) {
      host_.gather_src[i] = first + i;
      host_.gather_dst[i] = i;
    }
    TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dev_.gather_src, host_.gather_src, m * sizeof(int32_t),
                                            cudaMemcpyHostToDevice, stream));
    TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dev_.gather_dst, host_.gather_dst, m * sizeof(int32_t),
                                            cudaMemcpyHostToDevice, stream));
    TS_CUDA_RETURN_IF_ERROR(cudaEventRecord(staging_free_, stream));
    TS_RETURN_IF_ERROR(k::LaunchGatherRows({.src = dev_.prefill.h,
                                            .src_rows = dev_.gather_src,
                                            .dst = head.hidden,
                                            .dst_rows = dev_.gather_dst,
                                            .n = m,
                                            .width = d.hidden},
                                           stream));
    TS_RETURN_IF_ERROR(EnqueueLogits(head.hidden, head, PickBucket(buckets_, m), *prefill_logits_,
                                     stream, nullptr));
    TS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        out.data() + static_cast<size_t>(first) * d.vocab, head.logits_f32,
        static_cast<size_t>(m) * d.vocab * sizeof(float), cudaMemcpyDeviceToHost, stream));
    // Pageable destination: wait before the next group overwrites the device logits (and so
    // the caller can read `out`).
    TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  }
  // The values the sampler uses (SamplingKernelParams::round_logits_to_bf16): a bf16 model's
  // logits, as transformers returns them.
  for (float& v : out) v = Bf16ToF32(F32ToBf16(v));
  return out;
}

}  // namespace ts
