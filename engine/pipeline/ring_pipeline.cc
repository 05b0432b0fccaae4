#include "engine/pipeline/ring_pipeline.h"

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "engine/pipeline/pipeline_forward.h"
#include "engine/pipeline/tcp_transport.h"

namespace ts::pipeline {
namespace {

absl::Status Prefixed(const absl::Status& s, const std::string& prefix) {
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

// Rows of [vocab] logits a micro-batch of `chunks` returns in `mode`.
size_t LogitRows(std::span<const SeqChunk> chunks, LogitsMode mode) {
  if (mode == LogitsMode::kLastPerChunk) return chunks.size();
  size_t rows = 0;
  for (const SeqChunk& c : chunks) rows += c.tokens.size();
  return rows;
}

// The KV geometry the leader hands out: "<blocks> <block_size>".
std::string EncodeKv(int32_t blocks, int32_t block_size) {
  return absl::StrCat(blocks, " ", block_size);
}

bool DecodeKv(const std::string& text, int32_t* blocks, int32_t* block_size) {
  const std::vector<std::string> parts = absl::StrSplit(text, ' ');
  return parts.size() == 2 && absl::SimpleAtoi(parts[0], blocks) &&
         absl::SimpleAtoi(parts[1], block_size) && *blocks > 0 && *block_size > 0;
}

struct Planned {
  ModelConfig config;
  std::vector<StagePlan> plan;
};

absl::StatusOr<Planned> Plan(const RankOptions& o) {
  Planned p;
  TS_ASSIGN_OR_RETURN(p.config, LoadModelConfig(o.model_dir));
  TS_ASSIGN_OR_RETURN(
      p.plan,
      PlanStages(p.config, {.num_stages = o.world_size, .bytes_per_weight = 4, .bytes_per_kv = 4}));
  return p;
}

TcpTransportOptions TransportOptions(const RankOptions& o, const Planned& p) {
  return TcpTransportOptions{.rank = o.rank,
                             .world_size = o.world_size,
                             .leader_host = o.leader_host,
                             .leader_port = o.leader_port,
                             .timeout = o.timeout,
                             .check = PlanCheck(p.config, p.plan),
                             .payload = "",
                             .on_listening = o.on_listening};
}

void Log(const RankOptions& o, std::string line) {
  while (!line.empty() && line.back() == '\n') line.pop_back();
  if (o.log) o.log(line);
}

}  // namespace

RingForward::RingForward(ModelConfig config, std::unique_ptr<StageRunner> first,
                         std::unique_ptr<StageTransport> transport, int32_t micro_batches,
                         std::chrono::milliseconds timeout)
    : config_(std::move(config)),
      first_(std::move(first)),
      transport_(std::move(transport)),
      micro_batches_(std::max(1, micro_batches)),
      timeout_(timeout) {}

RingForward::~RingForward() {
  // A leader that stops without a word would leave the workers to find out from the closed
  // links and exit non-zero; a clean stop tells them.
  (void)Shutdown();
}

absl::Status RingForward::Break(absl::Status s) {
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_.ok()) broken_ = s;
  return broken_;
}

absl::Status RingForward::health() const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.ok()) return broken_;
  }
  return transport_->health();
}

absl::Status RingForward::Forward(std::span<const SeqChunk> chunks, LogitsMode mode,
                                  std::vector<float>* logits) {
  if (logits == nullptr) return absl::InvalidArgumentError("logits must not be null");
  logits->clear();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.ok()) return broken_;
    if (shut_down_) return absl::FailedPreconditionError("pipeline: shut down");
  }
  const std::vector<MicroBatch> batches =
      SplitMicroBatches(static_cast<int32_t>(chunks.size()), micro_batches_);
  const uint64_t first_id = next_id_;
  // Stage 0 of micro-batch k + 1 runs here while rank 1 works on micro-batch k. The transport's
  // reader drains what comes back meanwhile, so no link of the ring ever waits on a full one.
  for (const MicroBatch& b : batches) {
    const std::span<const SeqChunk> part = chunks.subspan(b.first, b.count);
    StageMessage m;
    m.id = next_id_++;
    m.mode = mode;
    PackChunks(part, &m);
    // A stage-0 error travels round with its micro-batch too, so the results stay in order.
    m.status = first_->Run(part, {}, mode, &m.data);
    if (!m.status.ok()) m.status = Prefixed(m.status, "stage 0: ");
    if (absl::Status s = transport_->Send(m); !s.ok()) return Break(s);
  }
  absl::Status status;
  for (size_t k = 0; k < batches.size(); ++k) {
    StageMessage r;
    if (absl::Status s = transport_->Recv(&r, timeout_); !s.ok()) {
      return Break(Prefixed(s, "waiting for a pipeline result: "));
    }
    const std::span<const SeqChunk> part = chunks.subspan(batches[k].first, batches[k].count);
    if (r.op != StageOp::kForward || r.id != first_id + k) {
      return Break(absl::DataLossError(absl::StrCat("pipeline: expected the result of micro-batch ",
                                                    first_id + k, ", got message ", r.id)));
    }
    if (!r.status.ok()) {
      if (status.ok()) status = r.status;
      continue;
    }
    if (r.data.size() != LogitRows(part, mode) * config_.vocab_size) {
      return Break(absl::DataLossError(
          absl::StrCat("pipeline: micro-batch ", r.id, " came back with ", r.data.size(),
                       " logits, not ", LogitRows(part, mode), " rows of ", config_.vocab_size)));
    }
    logits->insert(logits->end(), r.data.begin(), r.data.end());
  }
  if (!status.ok()) logits->clear();
  return status;
}

absl::Status RingForward::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return absl::OkStatus();
    shut_down_ = true;
    if (!broken_.ok()) return broken_;
  }
  StageMessage m;
  m.op = StageOp::kShutdown;
  m.id = next_id_++;
  if (absl::Status s = transport_->Send(m); !s.ok()) return Break(s);
  StageMessage back;
  if (absl::Status s = transport_->Recv(&back, timeout_); !s.ok()) {
    return Break(Prefixed(s, "waiting for the shutdown to come round: "));
  }
  if (back.op != StageOp::kShutdown) {
    return Break(absl::DataLossError("pipeline: a result came back instead of the shutdown"));
  }
  return absl::OkStatus();
}

absl::Status ServeStage(StageTransport& t, StageRunner& stage) {
  const bool last = t.rank() == t.world_size() - 1;
  const std::string prefix = absl::StrCat("stage ", t.rank(), ": ");
  std::vector<SeqChunk> chunks;
  for (;;) {
    StageMessage m;
    // Idle as long as the leader is; a peer that goes away ends the wait with an error.
    TS_RETURN_IF_ERROR(t.Recv(&m, std::nullopt));
    if (m.op == StageOp::kShutdown) return t.Send(m);
    if (m.status.ok()) {
      std::vector<float> out;
      absl::Status s = UnpackChunks(m, &chunks);
      if (s.ok()) s = stage.Run(chunks, m.data, m.mode, &out);
      if (!s.ok()) m.status = Prefixed(s, prefix);
      m.data = std::move(out);
    } else {
      m.data.clear();
    }
    if (last) PackChunks({}, &m);  // the leader has them
    TS_RETURN_IF_ERROR(t.Send(m));
  }
}

std::string PlanCheck(const ModelConfig& c, const std::vector<StagePlan>& plan) {
  std::string out = absl::StrCat("layers ", c.num_layers, " hidden ", c.hidden_size, " vocab ",
                                 c.vocab_size, " heads ", c.num_heads, "/", c.num_kv_heads,
                                 c.tie_word_embeddings ? " tied" : " untied", "; stages");
  for (const StagePlan& p : plan) {
    absl::StrAppend(&out, " ", p.first_layer, "-", p.first_layer + p.num_layers - 1);
  }
  return out;
}

absl::StatusOr<std::unique_ptr<RingForward>> ConnectLeader(const RankOptions& o,
                                                           int32_t num_kv_blocks,
                                                           int32_t block_size,
                                                           int32_t micro_batches) {
  if (o.rank != 0) return absl::InvalidArgumentError("ConnectLeader: rank 0 only");
  TS_ASSIGN_OR_RETURN(const Planned p, Plan(o));
  Log(o, absl::StrCat("pipeline of ", o.world_size, " processes, this is rank 0 (stage 0):\n",
                      DescribePlan(p.plan, 0, block_size)));
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CpuModel> model,
                      LoadStageModel(o.model_dir, p.plan[0], o.threads));
  ModelConfig config = model->config();
  auto first = std::make_unique<CpuStageRunner>(std::move(model), num_kv_blocks, block_size);
  TcpTransportOptions t = TransportOptions(o, p);
  t.payload = EncodeKv(num_kv_blocks, block_size);
  Log(o, absl::StrCat("pipeline: rank 0 waiting up to ", o.timeout.count(), " ms for ",
                      o.world_size == 2 ? "rank 1" : absl::StrCat("ranks 1-", o.world_size - 1)));
  TS_ASSIGN_OR_RETURN(std::unique_ptr<TcpTransport> transport, TcpTransport::Connect(t));
  Log(o, absl::StrCat("pipeline: all ", o.world_size, " ranks connected"));
  return std::make_unique<RingForward>(std::move(config), std::move(first), std::move(transport),
                                       micro_batches, o.timeout);
}

absl::Status RunWorker(const RankOptions& o) {
  if (o.rank < 1 || o.rank >= o.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("RunWorker: rank ", o.rank, " is not a worker of ", o.world_size));
  }
  TS_ASSIGN_OR_RETURN(const Planned p, Plan(o));
  const StagePlan& mine = p.plan[o.rank];
  Log(o, absl::StrCat("pipeline rank ", o.rank, " of ", o.world_size, ": stage ", mine.stage,
                      ", layers ", mine.first_layer, "-", mine.first_layer + mine.num_layers - 1,
                      mine.has_head ? " and the head" : ""));
  // The weights load before the rendezvous, so the timeout covers only the ranks' skew.
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CpuModel> model,
                      LoadStageModel(o.model_dir, mine, o.threads));
  TS_ASSIGN_OR_RETURN(std::unique_ptr<TcpTransport> transport,
                      TcpTransport::Connect(TransportOptions(o, p)));
  int32_t blocks = 0, block_size = 0;
  if (!DecodeKv(transport->payload(0), &blocks, &block_size)) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline rank ", o.rank,
                                                   ": the leader's KV geometry \"",
                                                   transport->payload(0), "\" is malformed"));
  }
  Log(o, absl::StrCat("pipeline rank ", o.rank, ": connected; KV pool of ", blocks, " blocks of ",
                      block_size, " tokens for this stage's layers"));
  CpuStageRunner runner(std::move(model), blocks, block_size);
  return ServeStage(*transport, runner);
}

}  // namespace ts::pipeline
