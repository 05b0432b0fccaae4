#include "engine/pipeline/local_pipeline.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"

namespace ts::pipeline {
namespace {

// A micro-batch on its way through the stages.
struct Work {
  std::span<const SeqChunk> chunks;  // the caller's, alive until Forward returns
  LogitsMode mode = LogitsMode::kAll;
  std::vector<float> data;  // the hidden state between stages; the logits at the end
  absl::Status status;      // the first stage error; later stages pass the item on untouched
};

// An unbounded multi-producer queue; Pop returns nullopt once closed and empty.
class Channel {
 public:
  void Push(Work w) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      items_.push_back(std::move(w));
    }
    cv_.notify_one();
  }
  std::optional<Work> Pop() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return closed_ || !items_.empty(); });
    if (items_.empty()) return std::nullopt;
    Work w = std::move(items_.front());
    items_.pop_front();
    return w;
  }
  void Close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Work> items_;  // guarded by mu_
  bool closed_ = false;     // guarded by mu_
};

}  // namespace

CpuStageRunner::CpuStageRunner(std::unique_ptr<CpuModel> model, int32_t num_blocks,
                               int32_t block_size)
    : model_(std::move(model)),
      kv_(
          [&] {
            ModelConfig c = model_->config();
            c.num_layers = model_->num_stage_layers();
            return c;
          }(),
          num_blocks, block_size) {}

absl::Status CpuStageRunner::Run(std::span<const SeqChunk> chunks, std::span<const float> hidden_in,
                                 LogitsMode mode, std::vector<float>* out) {
  return model_->ForwardStage(chunks, kv_, hidden_in, mode, out);
}

std::vector<MicroBatch> SplitMicroBatches(int32_t sequences, int32_t micro_batches) {
  std::vector<MicroBatch> out;
  const int32_t m = std::max(1, std::min(micro_batches, sequences));
  int32_t first = 0;
  for (int32_t k = 0; k < m && sequences > 0; ++k) {
    const int32_t count = sequences / m + (k < sequences % m ? 1 : 0);
    out.push_back({first, count});
    first += count;
  }
  return out;
}

struct LocalPipeline::Impl {
  std::vector<std::unique_ptr<StageRunner>> stages;
  std::vector<std::unique_ptr<Channel>> inbox;  // [stages + 1]: the last one holds results
  std::vector<std::thread> threads;

  void StageLoop(size_t s) {
    while (std::optional<Work> w = inbox[s]->Pop()) {
      if (w->status.ok()) {
        std::vector<float> out;
        w->status = stages[s]->Run(w->chunks, w->data, w->mode, &out);
        if (!w->status.ok()) {
          w->status =
              absl::Status(w->status.code(), absl::StrCat("stage ", s, ": ", w->status.message()));
        }
        w->data = std::move(out);
      }
      inbox[s + 1]->Push(*std::move(w));
    }
  }
};

LocalPipeline::LocalPipeline(std::vector<std::unique_ptr<StageRunner>> stages)
    : impl_(std::make_unique<Impl>()) {
  impl_->stages = std::move(stages);
  for (size_t s = 0; s <= impl_->stages.size(); ++s) {
    impl_->inbox.push_back(std::make_unique<Channel>());
  }
  for (size_t s = 0; s < impl_->stages.size(); ++s) {
    impl_->threads.emplace_back([this, s] { impl_->StageLoop(s); });
  }
}

LocalPipeline::~LocalPipeline() {
  // Closing stage 0's inbox lets each stage finish what it holds, then end; its successor's
  // inbox is closed once it has.
  for (size_t s = 0; s < impl_->threads.size(); ++s) {
    impl_->inbox[s]->Close();
    impl_->threads[s].join();
  }
}

absl::Status LocalPipeline::Forward(std::span<const SeqChunk> chunks, LogitsMode mode,
                                    int32_t micro_batches, std::vector<float>* out) {
  if (out == nullptr) return absl::InvalidArgumentError("out must not be null");
  out->clear();
  if (impl_->stages.empty()) return absl::FailedPreconditionError("the pipeline has no stage");
  const std::vector<MicroBatch> batches =
      SplitMicroBatches(static_cast<int32_t>(chunks.size()), micro_batches);
  for (const MicroBatch& b : batches) {
    Work w;
    w.chunks = chunks.subspan(b.first, b.count);
    w.mode = mode;
    impl_->inbox[0]->Push(std::move(w));
  }
  // Every stage is one thread reading one FIFO, so results come back in the order sent.
  absl::Status status;
  for (size_t k = 0; k < batches.size(); ++k) {
    std::optional<Work> w = impl_->inbox.back()->Pop();
    if (!w) return absl::InternalError("the pipeline shut down mid-batch");
    if (!w->status.ok()) {
      if (status.ok()) status = w->status;
      continue;
    }
    out->insert(out->end(), w->data.begin(), w->data.end());
  }
  if (!status.ok()) out->clear();
  return status;
}

}  // namespace ts::pipeline
