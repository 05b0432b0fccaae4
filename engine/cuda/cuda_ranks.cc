#include "engine/cuda/cuda_ranks.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <optional>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "engine/pipeline/nccl_comm.h"
#include "engine/pipeline/tcp_transport.h"
#include "graphs/device_guard.h"
#include "kernels/cuda_check.h"
#include "models/checkpoint.h"

namespace ts {
namespace {

using pipeline::StageMessage;
using pipeline::StageOp;

void Log(const CudaRankOptions& r, const std::string& line) {
  if (r.log) {
    r.log(line);
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

// What a rank announces at the rendezvous: its KV pool, its GPU (PCI bus id at host name: two
// ranks with the same one share a GPU) and, on rank 0, the NCCL unique id in hex.
struct RankPayload {
  int32_t kv_blocks = 0;
  std::string gpu;
  std::string nccl_id;
};

std::string EncodePayload(const RankPayload& p) {
  return absl::StrCat(p.kv_blocks, " ", p.gpu, " ", absl::BytesToHexString(p.nccl_id));
}

absl::StatusOr<RankPayload> DecodePayload(const std::string& text, int32_t rank) {
  const std::vector<std::string> parts = absl::StrSplit(text, ' ');
  RankPayload p;
  const auto hex = [](const std::string& h) {
    return h.size() % 2 == 0 && std::all_of(h.begin(), h.end(), [](char c) {
             return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
           });
  };
  if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &p.kv_blocks) || p.kv_blocks < 1 ||
      !hex(parts[2])) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline: rank ", rank, " announced \"", text,
                                                   "\", not its KV pool and GPU"));
  }
  p.gpu = parts[1];
  p.nccl_id = absl::HexStringToBytes(parts[2]);
  return p;
}

absl::StatusOr<std::string> GpuId(int device) {
  char bus[64] = {};
  TS_CUDA_RETURN_IF_ERROR(cudaDeviceGetPCIBusId(bus, sizeof(bus), device));
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '?';
  return absl::StrCat(bus, "@", host);
}

struct Joined {
  std::unique_ptr<pipeline::TcpTransport> transport;
  std::unique_ptr<StageLinks> links;
  int32_t kv_blocks = 0;  // the smallest rank's
};

// Every rank, once its stage is built: the rendezvous, then the links (NCCL unless two ranks
// share a GPU). `queue` is this rank's stage.
absl::StatusOr<Joined> JoinRanks(const CudaBackendOptions& o, const std::string& check,
                                 int32_t kv_blocks, StageQueue queue) {
  const CudaRankOptions& r = o.ranks;
  RankPayload mine;
  mine.kv_blocks = kv_blocks;
  TS_ASSIGN_OR_RETURN(mine.gpu, GpuId(queue.device));
  if (r.rank == 0) {
    // Made before anyone knows whether NCCL is needed; a host that cannot make one can still run
    // host links.
    absl::StatusOr<std::string> id = pipeline::NcclComm::NewUniqueId();
    if (id.ok()) mine.nccl_id = *id;
  }
  Log(r, absl::StrCat("pipeline rank ", r.rank, " of ", r.world_size, ": waiting up to ",
                      o.link_timeout.count(), " ms for the other ranks"));
  Joined j;
  TS_ASSIGN_OR_RETURN(j.transport,
                      pipeline::TcpTransport::Connect({.rank = r.rank,
                                                       .world_size = r.world_size,
                                                       .leader_host = r.leader_host,
                                                       .leader_port = r.leader_port,
                                                       .timeout = o.link_timeout,
                                                       .check = check,
                                                       .payload = EncodePayload(mine),
                                                       .on_listening = r.on_listening}));
  std::vector<RankPayload> all;
  bool shared = false;
  j.kv_blocks = kv_blocks;
  for (int32_t k = 0; k < r.world_size; ++k) {
    TS_ASSIGN_OR_RETURN(RankPayload p, DecodePayload(j.transport->payload(k), k));
    for (const RankPayload& q : all) shared |= q.gpu == p.gpu;
    j.kv_blocks = std::min(j.kv_blocks, p.kv_blocks);
    all.push_back(std::move(p));
  }
  const std::vector<int32_t> ranks = StageRanks(r.world_size);
  std::vector<StageQueue> queues(r.world_size);
  for (int32_t s = 0; s < r.world_size; ++s) {
    if (ranks[s] == r.rank) queues[s] = queue;
  }
  RankLinkOptions lo{.rank = r.rank,
                     .stage_ranks = ranks,
                     .transport = j.transport.get(),
                     .comm = nullptr,
                     .timeout = o.link_timeout};
  if (!shared) {
    if (all[0].nccl_id.empty()) {
      return absl::UnavailableError("pipeline: rank 0 could not make an NCCL unique id");
    }
    TS_ASSIGN_OR_RETURN(lo.comm, pipeline::NcclComm::Create(all[0].nccl_id, r.rank, r.world_size,
                                                            queue.device, o.link_timeout));
  }
  TS_ASSIGN_OR_RETURN(j.links, StageLinks::CreateAcrossProcesses(queues, std::move(lo)));
  Log(r,
      absl::StrCat("pipeline rank ", r.rank, ": all ", r.world_size, " ranks connected, linked by ",
                   j.links->name(), shared ? " (ranks share a GPU)" : "",
                   "; the KV pool is the smallest rank's, ", j.kv_blocks, " blocks"));
  return j;
}

absl::Status Malformed(const StageMessage& m, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("pipeline: control message ", m.id, " (op ",
                                                 static_cast<uint32_t>(m.op), "): ", why));
}

}  // namespace

std::vector<int32_t> StageRanks(int32_t world_size) {
  std::vector<int32_t> ranks(world_size);
  for (int32_t s = 0; s + 1 < world_size; ++s) ranks[s] = s + 1;
  if (world_size > 0) ranks[world_size - 1] = 0;
  return ranks;
}

void PackPrefillChunk(std::span<const PrefillPiece> pieces, StageMessage* m) {
  m->op = StageOp::kCudaPrefill;
  m->starts.clear();
  m->lengths.clear();
  m->block_counts.clear();
  m->tokens.clear();
  m->blocks.clear();
  for (const PrefillPiece& p : pieces) {
    m->starts.push_back(p.start);
    m->lengths.push_back(p.len);
    m->block_counts.push_back(static_cast<int32_t>(p.block_table.size()));
    m->tokens.push_back(static_cast<int32_t>(p.tokens.size()));
    m->tokens.push_back(p.head_row);
    m->tokens.insert(m->tokens.end(), p.tokens.begin() + p.start,
                     p.tokens.begin() + p.start + p.len);
    m->blocks.insert(m->blocks.end(), p.block_table.begin(), p.block_table.end());
  }
}

absl::Status UnpackPrefillChunk(const StageMessage& m, ReceivedChunk* out) {
  if (m.op != StageOp::kCudaPrefill) return Malformed(m, "not a prefill chunk");
  const size_t n = m.starts.size();
  if (m.lengths.size() != n || m.block_counts.size() != n) {
    return Malformed(m, "piece counts differ");
  }
  out->prompts.assign(n, {});
  out->tables.assign(n, {});
  out->pieces.assign(n, {});
  out->rows = 0;
  size_t t = 0, b = 0;
  for (size_t i = 0; i < n; ++i) {
    const int32_t start = m.starts[i], len = m.lengths[i], blocks = m.block_counts[i];
    if (t + 2 > m.tokens.size()) return Malformed(m, "tokens end early");
    const int32_t prompt_len = m.tokens[t], head_row = m.tokens[t + 1];
    t += 2;
    if (start < 0 || len < 1 || prompt_len < start + len || blocks < 0 ||
        m.tokens.size() - t < static_cast<size_t>(len) ||
        m.blocks.size() - b < static_cast<size_t>(blocks)) {
      return Malformed(m, absl::StrCat("piece ", i, " does not fit"));
    }
    out->prompts[i].assign(prompt_len, 0);
    std::copy_n(m.tokens.begin() + t, len, out->prompts[i].begin() + start);
    out->tables[i].assign(m.blocks.begin() + b, m.blocks.begin() + b + blocks);
    t += len;
    b += blocks;
    out->pieces[i] = PrefillPiece{.tokens = out->prompts[i],
                                  .block_table = out->tables[i],
                                  .start = start,
                                  .len = len,
                                  .head_row = head_row};
    out->rows += len;
  }
  if (t != m.tokens.size() || b != m.blocks.size()) return Malformed(m, "trailing entries");
  return absl::OkStatus();
}

StageMessage DecodeMessage(int32_t index) {
  StageMessage m;
  m.op = StageOp::kCudaDecode;
  m.starts = {index};
  m.lengths = {0};
  m.block_counts = {0};
  return m;
}

absl::StatusOr<int32_t> UnpackDecode(const StageMessage& m, int32_t num_buckets) {
  if (m.op != StageOp::kCudaDecode || m.starts.size() != 1 || m.starts[0] < 0 ||
      m.starts[0] >= num_buckets) {
    return Malformed(m, absl::StrCat("not a decode step of one of ", num_buckets, " buckets"));
  }
  return m.starts[0];
}

StageMessage RegimeMessage(const graphs::Regime& regime) {
  StageMessage m;
  m.op = StageOp::kCudaRegime;
  m.starts = {regime.attention_num_splits, regime.max_context_len};
  m.lengths = {0, 0};
  m.block_counts = {0, 0};
  return m;
}

absl::StatusOr<graphs::Regime> UnpackRegime(const StageMessage& m) {
  if (m.op != StageOp::kCudaRegime || m.starts.size() != 2 || m.starts[0] < 1 || m.starts[1] < 0) {
    return Malformed(m, "not an attention regime");
  }
  return graphs::Regime{.attention_num_splits = m.starts[0], .max_context_len = m.starts[1]};
}

std::string CudaRankCheck(const ModelConfig& c, std::span<const CudaStageOptions> plan,
                          const CudaBackendOptions& o) {
  std::string out = absl::StrCat(
      "cuda; layers ", c.num_layers, " hidden ", c.hidden_size, " vocab ", c.vocab_size, " heads ",
      c.num_heads, "/", c.num_kv_heads, c.tie_word_embeddings ? " tied" : " untied", "; stages");
  for (const CudaStageOptions& s : plan) {
    absl::StrAppend(&out, " ", s.stage.first_layer, "-",
                    s.stage.first_layer + s.stage.num_layers - 1);
  }
  absl::StrAppend(&out, "; slots ", o.max_slots, " buckets ", absl::StrJoin(o.buckets, ","),
                  " kv_block_size ", o.kv_block_size, " max_context ", o.max_context,
                  " prefill_chunk ", o.prefill_chunk_tokens);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Rank 0's side

absl::Status CudaBackend::ConnectRanks(const std::vector<CudaStageOptions>& plan) {
  const std::string check = CudaRankCheck(info_.model, plan, options_);
  TS_ASSIGN_OR_RETURN(Joined j, JoinRanks(options_, check, model_->plan().shape.num_kv_blocks,
                                          {.device = options_.device, .stream = stream_}));
  ring_ = std::move(j.transport);
  links_ = std::move(j.links);
  info_.num_kv_blocks = std::min(info_.num_kv_blocks, j.kv_blocks);
  std::vector<PipelineStage> views(plan.size());
  views.back() = {options_.device, stream_, model_.get(), graphs_.get()};
  pipeline_ = std::make_unique<StagePipeline>(std::move(views), links_.get());
  LogStages();
  return InitGroups();
}

absl::Status CudaBackend::SendControl(StageMessage m) {
  m.id = ++control_id_;
  return ring_->Send(m);
}

void CudaBackend::ShutdownRanks() {
  if (ring_ == nullptr || !ring_->health().ok()) return;
  // A rank 0 that stops without a word leaves the workers to find out from the closed links and
  // exit non-zero; a clean stop tells them, and waits for the word to come round.
  StageMessage m;
  m.op = StageOp::kShutdown;
  if (!SendControl(m).ok()) return;
  for (;;) {
    StageMessage back;
    if (!ring_->Recv(&back, options_.link_timeout).ok()) return;
    if (back.op == StageOp::kShutdown) return;
  }
}

absl::Status CudaBackend::pipeline_health() const {
  return ring_ != nullptr ? ring_->health() : absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// A worker's side

absl::Status RunCudaWorker(const CudaBackendOptions& o) {
  const CudaRankOptions& r = o.ranks;
  if (r.world_size < 2 || r.rank < 1 || r.rank >= r.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("RunCudaWorker: rank ", r.rank, " is not a worker of ", r.world_size));
  }
  if (o.device_loop || !o.stages.empty()) {
    return absl::InvalidArgumentError(
        "RunCudaWorker: one stage per process, host-driven (device_loop off, stages empty)");
  }
  TS_RETURN_IF_ERROR(ValidateBuckets(o.buckets));
  TS_ASSIGN_OR_RETURN(const ModelConfig config, LoadModelConfig(o.model_dir));
  const std::vector<int> devices(r.world_size, o.device);
  std::string description;
  TS_ASSIGN_OR_RETURN(const std::vector<CudaStageOptions> plan,
                      PlanCudaStages(config, devices, o.kv_block_size, &description));
  const int32_t stage = r.rank - 1;
  const ModelStage& mine = plan[stage].stage;
  Log(r, absl::StrCat("pipeline rank ", r.rank, " of ", r.world_size, ": stage ", stage,
                      ", layers ", mine.first_layer, "-", mine.first_layer + mine.num_layers - 1,
                      mine.has_embedding ? " and the embedding" : "", ", on device ", o.device));

  TS_ASSIGN_OR_RETURN(graphs::DeviceGuard guard, graphs::DeviceGuard::Set(o.device));
  cudaStream_t stream = nullptr;
  TS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct StreamCloser {
    cudaStream_t s;
    ~StreamCloser() { cudaStreamDestroy(s); }
  } closer{stream};
  // The weights load before the rendezvous, so the timeout covers only the ranks' skew.
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CudaModel> model,
                      CudaModel::Create(CudaBackend::StageModelOptions(o, config, plan[stage])));
  {
    TS_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(o.model_dir));
    TS_RETURN_IF_ERROR(model->UploadWeights(*ckpt, stream));
  }
  TS_ASSIGN_OR_RETURN(std::unique_ptr<graphs::GraphCache> graphs,
                      CudaBackend::BuildGraphs(o, *model, o.device, stream));
  TS_ASSIGN_OR_RETURN(
      Joined j, JoinRanks(o, CudaRankCheck(config, plan, o), model->plan().shape.num_kv_blocks,
                          {.device = o.device, .stream = stream}));
  std::vector<PipelineStage> views(r.world_size);
  views[stage] = {o.device, stream, model.get(), graphs.get()};
  StagePipeline pipe(std::move(views), j.links.get());
  pipeline::StageTransport& ring = *j.transport;
  const bool forwards = r.rank + 1 < r.world_size;  // rank 0 already knows what it sent
  const int32_t num_buckets = static_cast<int32_t>(o.buckets.size());
  ReceivedChunk chunk;
  for (;;) {
    StageMessage m;
    // Idle as long as rank 0 is; a peer that goes away ends the wait with an error.
    TS_RETURN_IF_ERROR(ring.Recv(&m, std::nullopt));
    if (m.op == StageOp::kShutdown) {
      TS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
      return ring.Send(m);
    }
    // On before the work: the next rank's half of each move must be able to start.
    if (forwards) TS_RETURN_IF_ERROR(ring.Send(m));
    switch (m.op) {
      case StageOp::kCudaDecode: {
        TS_ASSIGN_OR_RETURN(const int32_t index, UnpackDecode(m, num_buckets));
        TS_RETURN_IF_ERROR(pipe.Decode(index, o.buckets[index]));
        break;
      }
      case StageOp::kCudaPrefill:
        TS_RETURN_IF_ERROR(UnpackPrefillChunk(m, &chunk));
        TS_RETURN_IF_ERROR(pipe.PrefillChunk(chunk.pieces, chunk.rows));
        break;
      case StageOp::kCudaRegime: {
        TS_ASSIGN_OR_RETURN(const graphs::Regime regime, UnpackRegime(m));
        TS_RETURN_IF_ERROR(pipe.UpdateRegime(regime));
        break;
      }
      default:
        return Malformed(m, "not a call of the CUDA pipeline");
    }
    // The chunk's host buffers and the step's are reused by the next call.
    TS_RETURN_IF_ERROR(j.links->Wait(stream, o.link_timeout));
    if (std::atomic_ref<int32_t>(model->host().error_flag[0]).load(std::memory_order_acquire)) {
      return absl::InternalError(
          absl::StrCat("pipeline rank ", r.rank,
                       ": a kernel flagged an out-of-range token id, KV slot or "
                       "block-table entry"));
    }
  }
}

}  // namespace ts
