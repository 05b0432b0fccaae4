// tailserve.v1.Generation over gRPC's callback API. Generate is a ServerWriteReactor fed by the
// engine's RequestStream: the engine thread only pokes a notifier, and the reactor sends the
// coalesced tokens whenever no write is in flight, so one slow client never stalls the engine.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "engine/engine.h"
#include "grpcpp/grpcpp.h"
#include "server/validate.h"
#include "tailserve/v1/generation.grpc.pb.h"

namespace ts::server {

struct GenerationServiceOptions {
  std::string model_name;  // reported by GetModelInfo
  // Text prompts, text deltas, stop strings and Tokenize; null: the model has none. Outlives the
  // service. Its vocab fits the model's (the caller checks).
  const Tokenizer* tokenizer = nullptr;
  // Called before a stream that a backend failure ended sends its INTERNAL, so that a client who
  // saw the error never finds the server SERVING afterwards. Any thread; must not block.
  std::function<void()> on_backend_failure;
  // Testing only: Generate sleeps this long before it looks at a request, then logs
  // "debug_generate_delay: handled" (a request that reaches the handler after its deadline).
  std::chrono::milliseconds debug_generate_delay{0};
};

struct ReactorLink;  // an open Generate call, as the engine thread and CutOpenStreams reach it

// A client request id held by one open call. The engine sees a different id per call
// (`engine_id`), so a late cancel of an old call can never reach a later one that reuses the id.
struct IdClaim {
  std::string client_id;
  std::string engine_id;
  std::chrono::system_clock::time_point deadline;  // the call's, as this server computed it
};

class GenerationService final : public tailserve::v1::Generation::CallbackService {
 public:
  // `engine` must outlive the grpc::Server this service is registered with.
  GenerationService(Engine* engine, GenerationServiceOptions options);

  grpc::ServerWriteReactor<tailserve::v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const tailserve::v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const tailserve::v1::GetModelInfoRequest* request,
                                         tailserve::v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const tailserve::v1::GetStatsRequest* request,
                                     tailserve::v1::ServerStats* response) override;
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* context,
                                     const tailserve::v1::TokenizeRequest* request,
                                     tailserve::v1::TokenizeResponse* response) override;

  // From now on Generate answers UNAVAILABLE; streams already open run to completion.
  void BeginDrain() { draining_.store(true); }
  bool draining() const { return draining_.load(); }
  // Generate calls whose reactor has not yet finished (OnDone not yet run).
  int32_t active_streams() const { return active_streams_.load(); }

  // Ends every open Generate call now with `status` and cancels its request in the engine (the
  // drain timed out, or a second signal came). Returns how many calls it cut.
  int32_t CutOpenStreams(const grpc::Status& status);

  // Called by the reactors only.
  void StreamStarted(std::shared_ptr<ReactorLink> link);
  void StreamDone(const std::shared_ptr<ReactorLink>& link);
  void BackendFailed() {
    if (options_.on_backend_failure) options_.on_backend_failure();
  }
  // Frees the claim's id once the call's client has (or is about to get) its final status; a no-op
  // when a later call has already taken the id over. Idempotent; a leaf lock.
  void ReleaseId(const IdClaim& claim);

 private:
  uint64_t DrawSeed();
  // ALREADY_EXISTS while another open call holds `id` and its client may still be reading. An
  // empty `id` gets a fresh "req-N".
  absl::StatusOr<std::shared_ptr<IdClaim>> ClaimId(std::string id,
                                                   std::chrono::system_clock::time_point deadline);
  absl::Status TokenizeInto(const tailserve::v1::TokenizeRequest& request,
                            tailserve::v1::TokenizeResponse* response) const;
  grpc::ServerWriteReactor<tailserve::v1::GenerateResponse>* StartGenerate(
      grpc::CallbackServerContext* context, const tailserve::v1::GenerateRequest* request);

  Engine* const engine_;
  const GenerationServiceOptions options_;
  const ModelInfo model_info_;
  const ValidationLimits limits_;
  std::atomic<bool> draining_{false};
  std::atomic<int32_t> active_streams_{0};
  std::mutex links_mu_;
  std::unordered_set<std::shared_ptr<ReactorLink>> links_;  // guarded by links_mu_
  std::mutex ids_mu_;
  std::unordered_map<std::string, std::shared_ptr<IdClaim>> ids_;  // guarded by ids_mu_
  uint64_t next_call_ = 1;                                         // guarded by ids_mu_
  std::mutex seed_mu_;
  std::mt19937_64 seed_rng_;  // guarded by seed_mu_
};

}  // namespace ts::server
