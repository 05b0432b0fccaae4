// tailserve.v1.Generation over gRPC's callback API. Generate is a ServerWriteReactor fed by the
// engine's RequestStream: the engine thread only pokes a notifier, and the reactor sends the
// coalesced tokens whenever no write is in flight, so one slow client never stalls the engine.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <random>
#include <string>

#include "engine/engine.h"
#include "grpcpp/grpcpp.h"
#include "server/validate.h"
#include "tailserve/v1/generation.grpc.pb.h"

namespace ts::server {

struct GenerationServiceOptions {
  std::string model_name;  // reported by GetModelInfo
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

  // From now on Generate answers UNAVAILABLE; streams already open run to completion.
  void BeginDrain() { draining_.store(true); }
  bool draining() const { return draining_.load(); }
  // Generate calls whose reactor has not yet finished (OnDone not yet run).
  int32_t active_streams() const { return active_streams_.load(); }

  // Called by the reactors only.
  void StreamDone() { active_streams_.fetch_sub(1); }

 private:
  uint64_t DrawSeed();

  Engine* const engine_;
  const GenerationServiceOptions options_;
  const ModelInfo model_info_;
  const ValidationLimits limits_;
  std::atomic<bool> draining_{false};
  std::atomic<int32_t> active_streams_{0};
  std::mutex seed_mu_;
  std::mt19937_64 seed_rng_;  // guarded by seed_mu_
};

}  // namespace ts::server
