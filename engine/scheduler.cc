#include "engine/scheduler.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace ts {
namespace {

// Sorted, deduplicated, positive; trimmed so the largest bucket is the first one >= max_batch.
absl::StatusOr<std::vector<int32_t>> NormaliseBuckets(std::vector<int32_t> buckets,
                                                      int32_t max_batch) {
  std::sort(buckets.begin(), buckets.end());
  buckets.erase(std::unique(buckets.begin(), buckets.end()), buckets.end());
  TS_RETURN_IF_ERROR(ValidateBuckets(buckets));
  auto cover = std::lower_bound(buckets.begin(), buckets.end(), max_batch);
  if (cover != buckets.end()) buckets.erase(cover + 1, buckets.end());
  return buckets;
}

absl::Status ValidateBackendInfo(const BackendInfo& info) {
  if (info.max_slots < 1) return absl::InvalidArgumentError("backend: max_slots must be >= 1");
  if (info.kv_block_size < 1) return absl::InvalidArgumentError("backend: kv_block_size < 1");
  if (info.num_kv_blocks < 1) return absl::InvalidArgumentError("backend: num_kv_blocks < 1");
  if (info.ring_capacity < 2) return absl::InvalidArgumentError("backend: ring_capacity < 2");
  if (info.model.vocab_size < 1) return absl::InvalidArgumentError("backend: vocab_size < 1");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Scheduler>> Scheduler::Create(EngineOptions options,
                                                             std::unique_ptr<Backend> backend) {
  if (backend == nullptr) return absl::InvalidArgumentError("backend: null");
  const BackendInfo& info = backend->info();
  TS_RETURN_IF_ERROR(ValidateBackendInfo(info));
  if (options.max_batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_batch: must be >= 1, got ", options.max_batch));
  }
  if (options.queue_limit < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("queue_limit: must be >= 1, got ", options.queue_limit));
  }
  if (options.max_stop_ids < 0) return absl::InvalidArgumentError("max_stop_ids: negative");
  if (options.loop_poll_us < 1 || options.loop_poll_us > 1000000) {
    return absl::InvalidArgumentError(
        absl::StrCat("loop_poll_us: must be in [1, 1000000], got ", options.loop_poll_us));
  }
  if (options.stream_buffer_tokens < 1) {
    return absl::InvalidArgumentError("stream_buffer_tokens: must be >= 1");
  }
  // The batch can never exceed the slot table nor the largest bucket.
  options.max_batch = std::min(options.max_batch, info.max_slots);
  std::sort(options.buckets.begin(), options.buckets.end());
  if (!options.buckets.empty()) {
    options.max_batch = std::min(options.max_batch, options.buckets.back());
  }
  TS_ASSIGN_OR_RETURN(options.buckets,
                      NormaliseBuckets(std::move(options.buckets), options.max_batch));

  const int32_t model_max = info.model.max_position_embeddings;
  if (options.max_context == 0) options.max_context = model_max;
  if (options.max_context < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_context: must be >= 2 (one prompt and one new token), got ", options.max_context));
  }
  if (model_max > 0 && options.max_context > model_max) {
    return absl::InvalidArgumentError(absl::StrCat("max_context: ", options.max_context,
                                                   " exceeds the model's max_position_embeddings ",
                                                   model_max));
  }
  // v1 never evicts, so one max-length request must fit in the whole pool (docs/architecture.md,
  // Memory).
  const int64_t pool_tokens = static_cast<int64_t>(info.num_kv_blocks) * info.kv_block_size;
  if (options.max_context > pool_tokens) {
    return absl::FailedPreconditionError(
        absl::StrCat("max_context: ", options.max_context, " tokens do not fit the KV pool (",
                     info.num_kv_blocks, " blocks x ", info.kv_block_size, " = ", pool_tokens,
                     " tokens); raise num_kv_blocks or lower max_context"));
  }
  RequestLimits limits{.vocab_size = info.model.vocab_size,
                       .max_context = options.max_context,
                       .max_stop_ids = options.max_stop_ids};
  return std::unique_ptr<Scheduler>(new Scheduler(std::move(options), std::move(backend), limits));
}

Scheduler::Scheduler(EngineOptions options, std::unique_ptr<Backend> backend, RequestLimits limits)
    : options_(std::move(options)),
      limits_(limits),
      backend_(std::move(backend)),
      blocks_(backend_->info().num_kv_blocks, backend_->info().kv_block_size),
      slot_used_(backend_->info().max_slots, false) {
  PublishStats();
}

Scheduler::~Scheduler() = default;

std::string Scheduler::NewRequestIdLocked() {
  std::string id;
  do {
    id = absl::StrCat("req-", next_id_++);
  } while (inflight_ids_.count(id) != 0);
  return id;
}

absl::StatusOr<std::shared_ptr<RequestStream>> Scheduler::Submit(GenerateRequest request) {
  // Validation needs no lock: the limits never change.
  TS_RETURN_IF_ERROR(ValidateRequest(request, limits_));
  auto r = std::make_unique<Request>();
  r->prompt = std::move(request.prompt);
  r->sampling = request.sampling;
  r->stop = std::move(request.stop);
  std::shared_ptr<RequestStream> stream;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_ || !fatal_.ok()) return absl::UnavailableError("engine is stopped");
    if (draining_) return absl::UnavailableError("engine is draining; not accepting requests");
    if (static_cast<int32_t>(queue_.size()) >= options_.queue_limit) {
      return absl::ResourceExhaustedError(absl::StrCat("request queue is full (queue_limit ",
                                                       options_.queue_limit, "); retry later"));
    }
    if (request.request_id.empty()) {
      r->id = NewRequestIdLocked();
    } else if (inflight_ids_.count(request.request_id) != 0) {
      return absl::AlreadyExistsError(
          absl::StrCat("request_id: \"", request.request_id, "\" is already in flight"));
    } else {
      r->id = std::move(request.request_id);
    }
    stream = std::make_shared<RequestStream>(r->id, static_cast<int32_t>(r->prompt.size()));
    r->stream = stream;
    inflight_ids_.insert(r->id);
    queue_.push_back(std::move(r));
  }
  cv_.notify_one();
  return stream;
}

void Scheduler::Cancel(const std::string& request_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (inflight_ids_.count(request_id) == 0) return;
    cancels_.push_back(request_id);
  }
  cv_.notify_one();
}

void Scheduler::BeginDrain() {
  std::lock_guard<std::mutex> lock(mu_);
  draining_ = true;
}

void Scheduler::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
  }
  cv_.notify_all();
}

bool Scheduler::Idle() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.empty() && stats_.running == 0;
}

ModelInfo Scheduler::model_info() const {
  const BackendInfo& info = backend_->info();
  ModelInfo m;
  m.vocab_size = info.model.vocab_size;
  m.max_context = options_.max_context;
  m.max_new_tokens = options_.max_context - 1;
  m.eos_token_ids = info.model.eos_token_ids;
  m.bos_token_ids = info.model.bos_token_ids;
  m.buckets = options_.buckets;
  m.max_batch = options_.max_batch;
  m.max_stop_ids = options_.max_stop_ids;
  m.backend = info.name;
  return m;
}

EngineStats Scheduler::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  EngineStats s = stats_;
  s.queued = static_cast<int32_t>(queue_.size());
  return s;
}

absl::Status Scheduler::health() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fatal_;
}

bool Scheduler::WaitForWork() {
  std::unique_lock<std::mutex> lock(mu_);
  // A non-empty queue with nothing running is always admissible (Create checked that one
  // max-length request fits the pool), so this never wakes into a step that cannot progress.
  auto new_work = [&] { return stopped_ || !cancels_.empty() || !queue_.empty(); };
  if (running_.empty() || options_.run_mode == RunMode::kOneStep) {
    // Host-driven, every Step blocks in its decode step, so running requests are work at once.
    cv_.wait(lock, [&] { return new_work() || !running_.empty(); });
  } else {
    // The loop decodes without us: wake for new requests and cancels at once, else every
    // poll interval to stream what the rings hold and to retire finished requests.
    cv_.wait_for(lock, std::chrono::microseconds(options_.loop_poll_us), new_work);
  }
  return !stopped_;
}

const Request* Scheduler::FindRunning(const std::string& id) const {
  for (const auto& r : running_) {
    if (r->id == id) return r.get();
  }
  return nullptr;
}

StepTrace Scheduler::Step() {
  StepTrace trace;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!fatal_.ok()) return trace;
  }
  ProcessCancels(&trace);
  std::vector<Request*> admitted = Admit();
  if (!admitted.empty()) {
    trace.did_work = true;
    for (Request* r : admitted) trace.admitted.push_back(r->id);
    if (absl::Status s = Prefill(admitted); !s.ok()) {
      Fail(s);
      return trace;
    }
  }
  // Stream what the rings hold before the backend runs, not only after: Run may hold this thread
  // for up to a step (host-driven, the decode step itself; in the CUDA loop, staging the next
  // mixed step waits for the one before it on the GPU), and the first tokens Prefill just wrote,
  // or the tokens a step wrote just before, would reach their clients that much later.
  Drain();
  if (absl::Status s = RunBackend(&trace); !s.ok()) {
    Fail(s);
    return trace;
  }
  Drain();
  Retire(&trace);
  PublishStats();
  return trace;
}

void Scheduler::ProcessCancels(StepTrace* trace) {
  std::vector<std::string> ids;
  std::vector<std::unique_ptr<Request>> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ids.swap(cancels_);
    for (const std::string& id : ids) {
      auto it = std::find_if(queue_.begin(), queue_.end(),
                             [&](const std::unique_ptr<Request>& r) { return r->id == id; });
      if (it == queue_.end()) continue;
      inflight_ids_.erase(id);
      dropped.push_back(std::move(*it));
      queue_.erase(it);
    }
  }
  for (auto& r : dropped) {
    r->stream->Finish(FinishReason::kCancelled, absl::OkStatus());
    ++requests_finished_;
    trace->did_work = true;
  }
  for (const std::string& id : ids) {
    for (auto& r : running_) {
      if (r->id == id && r->state == RequestState::kDecoding) {
        CancelRunning(r.get(), absl::OkStatus());
        trace->did_work = true;
      }
    }
  }
}

void Scheduler::CancelRunning(Request* r, absl::Status why) {
  if (r->cancel_sent) return;
  r->cancel_sent = true;
  r->cancel_status = std::move(why);
  backend_->Cancel(r->slot);
}

std::vector<Request*> Scheduler::Admit() {
  std::vector<Request*> admitted;
  std::vector<std::unique_ptr<Request>> expired;
  std::unique_lock<std::mutex> lock(mu_);
  // A request whose deadline passed while it queued ends here, before it takes KV or a prefill.
  const auto now = std::chrono::steady_clock::now();
  for (auto it = queue_.begin(); it != queue_.end();) {
    const auto deadline = (*it)->stop.deadline;
    if (deadline == std::chrono::steady_clock::time_point{} || deadline > now) {
      ++it;
      continue;
    }
    inflight_ids_.erase((*it)->id);
    expired.push_back(std::move(*it));
    it = queue_.erase(it);
  }
  // Strict FIFO: the head waits for room rather than letting smaller requests overtake it forever.
  while (!queue_.empty() && static_cast<int32_t>(running_.size()) < options_.max_batch) {
    Request& head = *queue_.front();
    const int32_t need =
        blocks_.BlocksFor(static_cast<int64_t>(head.prompt.size()) + head.stop.max_new_tokens);
    if (!blocks_.CanAllocate(need)) break;
    auto slot = std::find(slot_used_.begin(), slot_used_.end(), false);
    if (slot == slot_used_.end()) break;
    absl::StatusOr<std::vector<int32_t>> blocks = blocks_.Allocate(need);
    TS_CHECK(blocks.ok());
    head.blocks = std::move(*blocks);
    head.slot = static_cast<SlotId>(slot - slot_used_.begin());
    *slot = true;
    head.state = RequestState::kDecoding;
    // Before the stats below publish it as running. A stream's lock is never held while this one
    // is taken, so the nesting cannot deadlock.
    head.stream->MarkScheduled();
    running_.push_back(std::move(queue_.front()));
    queue_.pop_front();
    admitted.push_back(running_.back().get());
  }
  // Published under the same lock that emptied the queue, so Idle() never sees a gap, and with
  // the blocks just reserved: the prefill streams a first token before the step's PublishStats,
  // and a client reading it must not see a running request that holds no KV.
  requests_finished_ += expired.size();
  PublishStatsLocked();
  lock.unlock();
  for (auto& r : expired) {
    r->stream->Finish(FinishReason::kDeadline,
                      absl::DeadlineExceededError("the request's deadline passed while it queued"));
  }
  return admitted;
}

absl::Status Scheduler::Prefill(const std::vector<Request*>& admitted) {
  std::vector<SlotInit> inits;
  inits.reserve(admitted.size());
  for (Request* r : admitted) {
    inits.push_back(SlotInit{.slot = r->slot,
                             .prompt = r->prompt,
                             .block_table = r->blocks,
                             .sampling = r->sampling,
                             .stop = r->stop});
  }
  return backend_->Prefill(inits);
}

absl::Status Scheduler::RunBackend(StepTrace* trace) {
  for (const auto& r : running_) {
    if (r->state == RequestState::kDecoding) trace->decoded.push_back(r->id);
  }
  if (trace->decoded.empty()) return absl::OkStatus();
  trace->did_work = true;
  TS_RETURN_IF_ERROR(backend_->Run(options_.run_mode));
  if (options_.run_mode == RunMode::kOneStep) trace->report = backend_->last_step();
  TS_ASSIGN_OR_RETURN(const LoopStatus loop, backend_->Poll());
  loop_ = loop;
  return absl::OkStatus();
}

void Scheduler::Drain() {
  for (auto& r : running_) {
    if (r->state == RequestState::kDecoding) DrainOne(r.get());
  }
}

void Scheduler::DrainOne(Request* r) {
  // After an overrun only the finish mark matters: tokens the loop wrote after the gap belong to
  // a stream the client can no longer trust, in this drain and every later one.
  const bool broken_before = !r->error.ok();
  const TokenRing& ring = backend_->Ring(r->slot);
  drain_buf_.clear();
  token_buf_.clear();
  if (!ring.Drain(&r->next_seq, &drain_buf_)) {
    // The producer overwrote entries we never read. The stream is broken; stop the slot and
    // resynchronise on the newest entry so its FINISHED mark is still seen and the slot freed.
    if (r->error.ok()) {
      r->error = absl::InternalError(
          absl::StrCat("token ring overrun for request ", r->id, " (slot ", r->slot, ", capacity ",
                       ring.capacity(), ", expected seq ", r->next_seq, ")"));
    }
    CancelRunning(r, absl::OkStatus());
    const size_t valid = drain_buf_.size();
    r->next_seq = ring.LatestSeq();
    ring.Drain(&r->next_seq, &drain_buf_);
    // Entries after the gap belong to a stream the client can no longer trust: keep only flags.
    for (size_t i = valid; i < drain_buf_.size(); ++i) drain_buf_[i].token = -1;
  }
  bool finished = false;
  FinishReason reason = FinishReason::kNone;
  for (const RingEntry& e : drain_buf_) {
    if (e.token >= 0) token_buf_.push_back(e.token);
    if (e.flags & kRingFinished) {
      finished = true;
      reason = RingReason(e.flags);
      break;
    }
  }
  if (broken_before) token_buf_.clear();
  if (!token_buf_.empty()) {
    // With the first tokens, when the backend began the prompt's prefill (for the Timing).
    r->stream->Append(token_buf_, r->generated == 0 ? backend_->PrefillStarted(r->slot)
                                                    : RequestTimes::Clock::time_point{});
    r->generated += static_cast<int32_t>(token_buf_.size());
    tokens_generated_ += token_buf_.size();
  }
  if (finished) {
    r->state = RequestState::kFinished;
    if (!r->error.ok()) {
      r->stream->Finish(FinishReason::kError, r->error);
    } else if (reason == FinishReason::kCancelled) {
      r->stream->Finish(reason, r->cancel_status);
    } else if (reason == FinishReason::kDeadline) {
      r->stream->Finish(
          reason, absl::DeadlineExceededError(absl::StrCat("the request's deadline passed after ",
                                                           r->generated, " generated tokens")));
    } else if (reason == FinishReason::kError) {
      r->stream->Finish(reason, absl::InternalError(
                                    absl::StrCat("backend reported an error for request ", r->id)));
    } else {
      r->stream->Finish(reason, absl::OkStatus());
    }
    return;
  }
  // A reader that fell too far behind is cut off instead of buffering without bound.
  const int32_t unread = r->stream->unread();
  if (unread > options_.stream_buffer_tokens) {
    CancelRunning(r, absl::ResourceExhaustedError(
                         absl::StrCat("stream reader too slow: ", unread, " unread tokens exceed ",
                                      "stream_buffer_tokens ", options_.stream_buffer_tokens)));
  }
}

void Scheduler::Retire(StepTrace* trace) {
  std::vector<std::string> retired;
  for (auto it = running_.begin(); it != running_.end();) {
    Request& r = **it;
    if (r.state != RequestState::kFinished) {
      ++it;
      continue;
    }
    backend_->Release(r.slot);
    blocks_.Free(r.blocks);
    slot_used_[r.slot] = false;
    retired.push_back(r.id);
    ++requests_finished_;
    it = running_.erase(it);
  }
  if (retired.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& id : retired) inflight_ids_.erase(id);
  }
  trace->did_work = true;
  trace->retired = std::move(retired);
}

void Scheduler::Fail(const absl::Status& cause) {
  const absl::Status status =
      absl::InternalError(absl::StrCat("backend failed: ", cause.message()));
  std::deque<std::unique_ptr<Request>> queued;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fatal_ = status;
    queued.swap(queue_);
    inflight_ids_.clear();
    cancels_.clear();
  }
  // The backend is no longer trusted, so slots are not released through it; the engine is done.
  for (auto& r : running_) {
    r->stream->Finish(FinishReason::kError, status);
    blocks_.Free(r->blocks);
    slot_used_[r->slot] = false;
  }
  running_.clear();
  for (auto& r : queued) r->stream->Finish(FinishReason::kError, status);
  PublishStats();
}

void Scheduler::AbortAll(const absl::Status& status) {
  std::deque<std::unique_ptr<Request>> queued;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    queued.swap(queue_);
    inflight_ids_.clear();
    cancels_.clear();
  }
  for (auto& r : queued) r->stream->Finish(FinishReason::kCancelled, status);
  for (auto& r : running_) {
    if (r->state == RequestState::kDecoding && fatal_.ok()) backend_->Cancel(r->slot);
    r->stream->Finish(FinishReason::kCancelled, status);
    blocks_.Free(r->blocks);
    slot_used_[r->slot] = false;
  }
  running_.clear();
  PublishStats();
}

void Scheduler::PublishStats() {
  std::lock_guard<std::mutex> lock(mu_);
  PublishStatsLocked();
}

void Scheduler::PublishStatsLocked() {
  stats_.running = static_cast<int32_t>(running_.size());
  stats_.kv_blocks_total = blocks_.num_blocks();
  stats_.kv_blocks_free = blocks_.num_free();
  stats_.steps = loop_.steps;
  stats_.tokens_generated = tokens_generated_;
  stats_.requests_finished = requests_finished_;
  stats_.loop_launches = loop_.launches;
  stats_.mixed_steps = loop_.mixed_steps;
  stats_.regime_changes_on_device = loop_.regime_changes_on_device;
  stats_.regime_changes_by_exit = loop_.regime_changes_by_exit;
}

}  // namespace ts
