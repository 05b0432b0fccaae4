#include "server/generation_service.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/backend.h"
#include "models/tokenizer/text_stream.h"
#include "server/grpc_status.h"

namespace ts::server {

class GenerateReactor;

// The engine thread (and CutOpenStreams) reach the reactor only through this link. OnDone clears
// `reactor` under `mu` before the reactor is deleted, so a notification that races with the end of
// the call finds nullptr instead of a dangling pointer. The link lives as long as the
// RequestStream's notifier.
struct ReactorLink {
  std::mutex mu;
  GenerateReactor* reactor = nullptr;  // guarded by mu
};

namespace {

namespace pb = ::tailserve::v1;

pb::FinishReason ToProto(FinishReason r) {
  switch (r) {
    case FinishReason::kEos:
      return pb::FINISH_REASON_EOS;
    case FinishReason::kStopToken:
      return pb::FINISH_REASON_STOP_TOKEN;
    case FinishReason::kLength:
      return pb::FINISH_REASON_LENGTH;
    case FinishReason::kCancelled:
      return pb::FINISH_REASON_CANCELLED;
    case FinishReason::kNone:
    case FinishReason::kError:
    case FinishReason::kDeadline:  // these end the call with a non-OK status instead
      break;
  }
  return pb::FINISH_REASON_UNSPECIFIED;
}

// Where the call's time went (the proto's Timing), from its arrival and the engine's times. A
// point the engine never reached counts as reached at the next one (the prefill's start: at
// `scheduled`), and each is kept within its neighbours, so the five parts always add up to
// `end` - `received`. `end`: the engine's finish, or now for a stream the server ended itself (a
// stop string matched before the engine stopped).
void SetTiming(const RequestTimes& t, RequestTimes::Clock::time_point received, pb::Timing* out) {
  using TimePoint = RequestTimes::Clock::time_point;
  const TimePoint end = t.finished != TimePoint{} ? t.finished : RequestTimes::Clock::now();
  const TimePoint first = t.first_token != TimePoint{} ? t.first_token : end;
  const TimePoint scheduled = t.scheduled != TimePoint{} ? t.scheduled : first;
  const TimePoint started = t.prefill_started != TimePoint{}
                                ? std::max(scheduled, std::min(t.prefill_started, first))
                                : scheduled;
  auto us = [](TimePoint from, TimePoint to) -> int64_t {
    return to > from ? std::chrono::duration_cast<std::chrono::microseconds>(to - from).count() : 0;
  };
  out->set_preprocess_us(us(received, t.submitted));
  out->set_queue_us(us(t.submitted, scheduled));
  out->set_prefill_wait_us(us(scheduled, started));
  out->set_prefill_us(us(started, first));
  out->set_decode_us(us(first, end));
}

// A Generate call that failed before reaching the engine: finishes at once with `status`.
class RejectReactor final : public grpc::ServerWriteReactor<pb::GenerateResponse> {
 public:
  explicit RejectReactor(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace

class GenerateReactor final : public grpc::ServerWriteReactor<pb::GenerateResponse> {
 public:
  enum class Action { kNone, kWrite, kWriteAndFinish, kFinish };

  // `text` is null when the model has no tokenizer.
  // `received`: when the call arrived, for its Timing.
  GenerateReactor(GenerationService* service, Engine* engine, std::shared_ptr<RequestStream> stream,
                  RequestTimes::Clock::time_point received, uint64_t seed,
                  std::shared_ptr<IdClaim> claim, StopParams stop,
                  std::vector<int32_t> eos_token_ids, std::unique_ptr<TextStream> text)
      : service_(service),
        engine_(engine),
        stream_(std::move(stream)),
        received_(received),
        seed_(seed),
        claim_(std::move(claim)),
        stop_(std::move(stop)),
        eos_token_ids_(std::move(eos_token_ids)),
        text_(std::move(text)) {}

  // Separate from the constructor: the notifier may fire at once, and the reactor must be fully
  // built by then.
  void Start() {
    link_ = std::make_shared<ReactorLink>();
    link_->reactor = this;
    stream_->SetNotifier([link = link_] {
      std::lock_guard<std::mutex> lock(link->mu);
      if (link->reactor != nullptr) link->reactor->Pump();
    });
    service_->StreamStarted(link_);
    Pump();
  }

  // Ends the call now with `status`; false when it was already finishing. The caller holds
  // link_->mu, which keeps `this` alive.
  bool Cut(const grpc::Status& status) {
    engine_->Cancel(stream_->id());
    bool finish = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finish_called_ || cut_.has_value()) return false;
      cut_ = status;
      // A write in flight finishes the call from OnWriteDone.
      if (!write_in_flight_) finish_called_ = finish = true;
    }
    if (finish) FinishCall(status);
    return true;
  }

  void OnWriteDone(bool ok) override {
    grpc::Status finish_status;
    bool finish = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      write_in_flight_ = false;
      if (!ok || finish_after_write_.has_value() || cancelled_ || cut_.has_value()) {
        // !ok: the client is gone; OnCancel (or OnDone) stops the engine side.
        finish = !finish_called_;
        finish_called_ = true;
        if (cut_.has_value()) {
          finish_status = *cut_;
        } else {
          finish_status = ok && finish_after_write_.has_value() ? *finish_after_write_
                                                                : grpc::Status::CANCELLED;
        }
      }
    }
    if (finish) {
      FinishCall(finish_status);
      return;
    }
    Pump();
  }

  void OnCancel() override {
    // Client cancel or deadline: free the slot and KV blocks now, not when the stream would end.
    // The client already has its final status, so its id is free for a retry.
    service_->ReleaseId(*claim_);
    engine_->Cancel(stream_->id());
    bool finish = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_ = true;
      if (!write_in_flight_ && !finish_called_) {
        finish_called_ = true;
        finish = true;
      }
    }
    if (finish) FinishCall(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    {
      std::lock_guard<std::mutex> lock(link_->mu);
      link_->reactor = nullptr;
    }
    // A write failure without OnCancel also ends here; Cancel is idempotent.
    bool final_taken;
    {
      std::lock_guard<std::mutex> lock(mu_);
      final_taken = final_taken_;
    }
    if (!final_taken) engine_->Cancel(stream_->id());
    service_->ReleaseId(*claim_);
    service_->StreamDone(link_);
    delete this;
  }

  // Sends whatever the engine has produced if no write is in flight. Called from the engine
  // thread (notifier) and from gRPC threads (OnWriteDone, Start). Never blocks: the decision is
  // made under mu_, and the gRPC call happens after releasing it because gRPC may run reactor
  // callbacks on the calling thread.
  void Pump() {
    Action action = Action::kNone;
    grpc::Status status;
    bool stop_engine = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (write_in_flight_ || finish_called_) return;
      if (cancelled_) {
        finish_called_ = true;
        status = grpc::Status::CANCELLED;
        action = Action::kFinish;
      }
      if (action == Action::kNone) PrepareLocked(&action, &status, &stop_engine);
    }
    // A stop string ended the stream here, before the engine did: free its slot now. Outside mu_,
    // like every call into the engine.
    if (stop_engine) engine_->Cancel(stream_->id());
    // `this` may be deleted as soon as these return (OnDone on another thread).
    switch (action) {
      case Action::kWrite:
        StartWrite(&response_);
        break;
      case Action::kWriteAndFinish:
        service_->ReleaseId(*claim_);
        StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
        break;
      case Action::kFinish:
        FinishCall(status);
        break;
      case Action::kNone:
        break;
    }
  }

 private:
  // The id is released before the status goes out, so a client that has it can reuse the id.
  void FinishCall(const grpc::Status& status) {
    service_->ReleaseId(*claim_);
    Finish(status);
  }

  // Takes the pending update and decides what to send. Caller holds mu_. *stop_engine: a stop
  // string matched, so the engine's request must be cancelled.
  void PrepareLocked(Action* action, grpc::Status* status, bool* stop_engine) {
    StreamUpdate update;
    if (!stream_->Take(&update)) return;
    if (!held_.empty()) {
      update.tokens.insert(update.tokens.begin(), held_.begin(), held_.end());
      held_.clear();
    }
    if (update.tokens.empty() && !update.finished) return;
    // The engine appends a request's last token and then finishes it, and the notifier fires on
    // each: sent at once, the last token and the finish reason went out as two messages, the
    // final one empty. A token that ends the request (the engine's own CheckStop says so) is held
    // back for the Finish that follows it in the same engine step.
    if (!update.finished && CheckStop(stop_, eos_token_ids_, update.tokens.back(),
                                      update.completion_tokens - 1) != FinishReason::kNone) {
      held_ = std::move(update.tokens);
      return;
    }
    std::string text;
    pb::FinishReason reason = ToProto(update.reason);
    std::string matched_stop;
    if (text_ != nullptr) {
      const int32_t first = update.completion_tokens - static_cast<int32_t>(update.tokens.size());
      for (size_t i = 0; i < update.tokens.size(); ++i) {
        const int32_t generated = first + static_cast<int32_t>(i) + 1;
        TextStream::Delta d = text_->Next(update.tokens[i], generated >= stop_.min_new_tokens);
        text += d.text;
        if (!d.stop_index) continue;
        // The stream ends with this token. What the engine produced after it is dropped, and
        // what it sends later is never read: the call is finished before then.
        update.tokens.resize(i + 1);
        update.completion_tokens = generated;
        update.finished = true;
        update.status = absl::OkStatus();
        reason = pb::FINISH_REASON_STOP_STRING;
        matched_stop = text_->stop_strings()[*d.stop_index];
        *stop_engine = true;
        break;
      }
      if (update.finished && !*stop_engine) text += text_->Finish();
    }
    if (update.finished && update.reason == FinishReason::kStopToken && !*stop_engine &&
        !update.tokens.empty()) {
      matched_stop = absl::StrCat(update.tokens.back());
    }
    BuildResponse(update, reason, text, matched_stop);
    if (!update.finished) {
      write_in_flight_ = true;
      *action = Action::kWrite;
    } else if (update.status.ok()) {
      final_taken_ = true;
      finish_called_ = true;
      *action = Action::kWriteAndFinish;
    } else {
      // The request failed (slow reader, engine shutdown, backend error): deliver the tokens
      // produced so far, then the error.
      final_taken_ = true;
      if (!engine_->health().ok()) service_->BackendFailed();
      *status = ToGrpcStatus(update.status);
      if (update.tokens.empty()) {
        finish_called_ = true;
        *action = Action::kFinish;
      } else {
        finish_after_write_ = *status;
        write_in_flight_ = true;
        *action = Action::kWrite;
      }
    }
  }

  void BuildResponse(const StreamUpdate& update, pb::FinishReason reason, std::string text,
                     std::string matched_stop) {
    response_.Clear();
    response_.set_request_id(claim_->client_id);
    response_.mutable_token_ids()->Add(update.tokens.begin(), update.tokens.end());
    response_.set_text(std::move(text));
    if (first_message_) {
      response_.set_seed(seed_);
      first_message_ = false;
    }
    if (update.finished) {
      response_.set_finish_reason(reason);
      response_.set_matched_stop(std::move(matched_stop));
      response_.mutable_usage()->set_prompt_tokens(update.prompt_tokens);
      response_.mutable_usage()->set_completion_tokens(update.completion_tokens);
      if (update.status.ok()) SetTiming(update.times, received_, response_.mutable_timing());
    }
  }

  GenerationService* const service_;
  Engine* const engine_;
  const std::shared_ptr<RequestStream> stream_;
  const RequestTimes::Clock::time_point received_;
  const uint64_t seed_;
  const std::shared_ptr<IdClaim> claim_;
  const StopParams stop_;
  const std::vector<int32_t> eos_token_ids_;
  const std::unique_ptr<TextStream> text_;  // used under mu_
  std::shared_ptr<ReactorLink> link_;

  std::mutex mu_;
  pb::GenerateResponse response_;  // guarded by mu_; read by gRPC while a write is in flight
  bool write_in_flight_ = false;   // guarded by mu_
  bool finish_called_ = false;     // guarded by mu_
  bool cancelled_ = false;         // guarded by mu_
  bool first_message_ = true;      // guarded by mu_
  bool final_taken_ = false;       // guarded by mu_; read in OnDone once every op is over
  std::optional<grpc::Status> finish_after_write_;  // guarded by mu_
  std::optional<grpc::Status> cut_;                 // guarded by mu_; set by Cut
  std::vector<int32_t> held_;  // guarded by mu_; the last tokens, waiting for the finish
};

GenerationService::GenerationService(Engine* engine, GenerationServiceOptions options)
    : engine_(engine),
      options_(std::move(options)),
      model_info_(engine->model_info()),
      limits_{.vocab_size = model_info_.vocab_size,
              .max_context = model_info_.max_context,
              .max_new_tokens = model_info_.max_new_tokens,
              .max_stop_ids = model_info_.max_stop_ids},
      seed_rng_(std::random_device{}()) {}

void GenerationService::StreamStarted(std::shared_ptr<ReactorLink> link) {
  std::lock_guard<std::mutex> lock(links_mu_);
  links_.insert(std::move(link));
}

void GenerationService::StreamDone(const std::shared_ptr<ReactorLink>& link) {
  {
    std::lock_guard<std::mutex> lock(links_mu_);
    links_.erase(link);
  }
  active_streams_.fetch_sub(1);
}

int32_t GenerationService::CutOpenStreams(const grpc::Status& status) {
  std::vector<std::shared_ptr<ReactorLink>> links;
  {
    // Copied so that no reactor callback runs under links_mu_ (OnDone takes it).
    std::lock_guard<std::mutex> lock(links_mu_);
    links.assign(links_.begin(), links_.end());
  }
  int32_t cut = 0;
  for (const auto& link : links) {
    std::lock_guard<std::mutex> lock(link->mu);
    if (link->reactor != nullptr && link->reactor->Cut(status)) ++cut;
  }
  return cut;
}

namespace {
// A client's deadline can come a little before this server's (the server counts the timeout from
// the request's arrival), so a retry sent the moment the client saw DEADLINE_EXCEEDED may arrive
// just before the old call expires here. Within this margin the old call counts as over.
constexpr auto kDeadlineSkew = std::chrono::milliseconds(50);
}  // namespace

absl::StatusOr<std::shared_ptr<IdClaim>> GenerationService::ClaimId(
    std::string id, std::chrono::system_clock::time_point deadline) {
  auto claim = std::make_shared<IdClaim>();
  claim->deadline = deadline;
  std::shared_ptr<IdClaim> expired;
  {
    std::lock_guard<std::mutex> lock(ids_mu_);
    const uint64_t call = next_call_++;
    if (id.empty()) {
      uint64_t n = call;
      do {
        id = absl::StrCat("req-", n++);
      } while (ids_.count(id) != 0);
    }
    auto it = ids_.find(id);
    if (it != ids_.end()) {
      if (std::chrono::system_clock::now() + kDeadlineSkew < it->second->deadline) {
        return absl::AlreadyExistsError(
            absl::StrCat("request_id: \"", id, "\" is already in flight"));
      }
      // Its client has already seen DEADLINE_EXCEEDED; gRPC's OnCancel for it may simply not
      // have run yet.
      expired = std::move(it->second);
      ids_.erase(it);
    }
    claim->client_id = id;
    claim->engine_id = absl::StrCat(id, "#", call);
    ids_.emplace(id, claim);
  }
  if (expired != nullptr) engine_->Cancel(expired->engine_id);
  return claim;
}

void GenerationService::ReleaseId(const IdClaim& claim) {
  std::lock_guard<std::mutex> lock(ids_mu_);
  auto it = ids_.find(claim.client_id);
  if (it != ids_.end() && it->second.get() == &claim) ids_.erase(it);
}

uint64_t GenerationService::DrawSeed() {
  std::lock_guard<std::mutex> lock(seed_mu_);
  return seed_rng_();
}

grpc::ServerWriteReactor<pb::GenerateResponse>* GenerationService::Generate(
    grpc::CallbackServerContext* context, const pb::GenerateRequest* request) {
  if (options_.debug_generate_delay.count() <= 0) return StartGenerate(context, request);
  std::this_thread::sleep_for(options_.debug_generate_delay);
  auto* reactor = StartGenerate(context, request);
  std::fprintf(stderr, "tailserve debug_generate_delay: handled\n");
  return reactor;
}

grpc::ServerWriteReactor<pb::GenerateResponse>* GenerationService::StartGenerate(
    grpc::CallbackServerContext* context, const pb::GenerateRequest* request) {
  const auto received = RequestTimes::Clock::now();
  if (draining()) {
    return new RejectReactor(
        grpc::Status(grpc::StatusCode::UNAVAILABLE, "server is draining; retry elsewhere"));
  }
  // Its client has given up already: admitting it would spend a prefill on nobody.
  const auto deadline = context->deadline();
  if (deadline <= std::chrono::system_clock::now() || context->IsCancelled()) {
    return new RejectReactor(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                                          "the request's deadline passed before it was read"));
  }
  // A text prompt is tokenized here, on the gRPC thread, never on the engine's.
  absl::StatusOr<ValidatedRequest> converted =
      ValidateAndConvert(*request, limits_, options_.tokenizer, DrawSeed());
  if (!converted.ok()) return new RejectReactor(ToGrpcStatus(converted.status()));
  GenerateRequest& engine_request = converted->engine;
  // The engine ends the stream at the first decode step past the client's deadline (on the GPU,
  // docs/device-loop.md), so a stream nobody waits for stops using the batch at once. gRPC's
  // "no deadline" is a time_point far in the future.
  const auto now_sys = std::chrono::system_clock::now();
  if (deadline - now_sys < std::chrono::hours(24 * 365)) {
    engine_request.stop.deadline =
        std::chrono::steady_clock::now() +
        std::chrono::duration_cast<std::chrono::steady_clock::duration>(deadline - now_sys);
  }
  absl::StatusOr<std::shared_ptr<IdClaim>> claim = ClaimId(engine_request.request_id, deadline);
  if (!claim.ok()) return new RejectReactor(ToGrpcStatus(claim.status()));
  engine_request.request_id = (*claim)->engine_id;
  const uint64_t seed = engine_request.sampling.seed;
  StopParams stop = engine_request.stop;
  std::unique_ptr<TextStream> text;
  if (options_.tokenizer != nullptr) {
    text = std::make_unique<TextStream>(
        *options_.tokenizer, std::move(converted->text.stop_strings), converted->text.decode);
  }
  absl::StatusOr<std::shared_ptr<RequestStream>> stream =
      engine_->Submit(std::move(engine_request));
  if (!stream.ok()) {
    ReleaseId(**claim);
    return new RejectReactor(ToGrpcStatus(stream.status()));
  }
  active_streams_.fetch_add(1);
  auto* reactor =
      new GenerateReactor(this, engine_, *std::move(stream), received, seed, *std::move(claim),
                          std::move(stop), model_info_.eos_token_ids, std::move(text));
  reactor->Start();
  return reactor;
}

grpc::ServerUnaryReactor* GenerationService::GetModelInfo(grpc::CallbackServerContext* context,
                                                          const pb::GetModelInfoRequest* request,
                                                          pb::ModelInfo* response) {
  (void)request;
  const ModelInfo& m = model_info_;
  response->set_model(options_.model_name);
  response->set_backend(m.backend);
  response->set_vocab_size(m.vocab_size);
  response->set_max_context(m.max_context);
  response->set_max_new_tokens(m.max_new_tokens);
  response->mutable_eos_token_ids()->Add(m.eos_token_ids.begin(), m.eos_token_ids.end());
  response->mutable_bos_token_ids()->Add(m.bos_token_ids.begin(), m.bos_token_ids.end());
  response->mutable_buckets()->Add(m.buckets.begin(), m.buckets.end());
  response->set_max_batch(m.max_batch);
  response->set_max_stop_token_ids(m.max_stop_ids);
  response->set_has_tokenizer(options_.tokenizer != nullptr);
  response->set_max_stop_strings(limits_.max_stop_strings);
  response->set_max_stop_string_bytes(limits_.max_stop_string_bytes);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* GenerationService::GetStats(grpc::CallbackServerContext* context,
                                                      const pb::GetStatsRequest* request,
                                                      pb::ServerStats* response) {
  (void)request;
  const EngineStats s = engine_->stats();
  response->set_queued(s.queued);
  response->set_running(s.running);
  response->set_kv_blocks_total(s.kv_blocks_total);
  response->set_kv_blocks_free(s.kv_blocks_free);
  response->set_steps(s.steps);
  response->set_tokens_generated(s.tokens_generated);
  response->set_requests_finished(s.requests_finished);
  response->set_loop_launches(s.loop_launches);
  response->set_mixed_steps(s.mixed_steps);
  response->set_regime_changes_on_device(s.regime_changes_on_device);
  response->set_regime_changes_by_exit(s.regime_changes_by_exit);
  response->set_active_streams(active_streams());
  response->set_draining(draining());
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* GenerationService::Tokenize(grpc::CallbackServerContext* context,
                                                      const pb::TokenizeRequest* request,
                                                      pb::TokenizeResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(TokenizeInto(*request, response)));
  return reactor;
}

absl::Status GenerationService::TokenizeInto(const pb::TokenizeRequest& request,
                                             pb::TokenizeResponse* response) const {
  const Tokenizer* tok = options_.tokenizer;
  if (tok == nullptr) {
    return absl::FailedPreconditionError(
        "this model has no tokenizer (no tokenizer.json or tokenizer.model beside it)");
  }
  switch (request.input_case()) {
    case pb::TokenizeRequest::kText: {
      TS_RETURN_IF_ERROR(CheckUtf8("text", request.text()));
      const bool add_special =
          !request.params().has_add_special_tokens() || request.params().add_special_tokens();
      absl::StatusOr<std::vector<int32_t>> ids = tok->Encode(request.text(), add_special);
      if (!ids.ok())
        return absl::InvalidArgumentError(absl::StrCat("text: ", ids.status().message()));
      response->mutable_token_ids()->Add(ids->begin(), ids->end());
      response->set_count(static_cast<int32_t>(ids->size()));
      return absl::OkStatus();
    }
    case pb::TokenizeRequest::kTokenIds: {
      const auto& ids = request.token_ids().ids();
      for (int i = 0; i < ids.size(); ++i) {
        if (ids[i] < 0 || ids[i] >= limits_.vocab_size) {
          return absl::InvalidArgumentError(absl::StrCat("token_ids[", i, "]: token id ", ids[i],
                                                         " is outside [0, ", limits_.vocab_size,
                                                         ")"));
        }
      }
      DecodeOptions options;
      options.skip_special_tokens =
          !request.params().has_skip_special_tokens() || request.params().skip_special_tokens();
      response->set_text(tok->Decode(std::vector<int32_t>(ids.begin(), ids.end()), options));
      response->set_count(ids.size());
      return absl::OkStatus();
    }
    case pb::TokenizeRequest::INPUT_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError("input: set text or token_ids");
}

}  // namespace ts::server
