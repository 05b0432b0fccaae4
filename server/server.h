// Assembles the gRPC server around an Engine: the Generation service, the standard
// grpc.health.v1 health service and server reflection. Owns the drain sequence's server half.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "grpcpp/grpcpp.h"
#include "server/generation_service.h"

namespace ts::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int32_t port = 0;  // 0 = let the OS pick a free port
  std::string model_name;
  const Tokenizer* tokenizer = nullptr;               // GenerationServiceOptions's
  std::chrono::milliseconds debug_generate_delay{0};  // GenerationServiceOptions's
};

class TailServer {
 public:
  // Binds and starts serving; health reports SERVING once this returns. `engine` must outlive the
  // TailServer. UNAVAILABLE naming the address when it cannot bind.
  static absl::StatusOr<std::unique_ptr<TailServer>> Start(const ServerOptions& options,
                                                           Engine* engine);
  ~TailServer();  // Shutdown() with no grace if not yet called

  int32_t port() const { return port_; }
  const std::string& address() const { return address_; }  // "host:port" actually bound

  // Health NOT_SERVING, new Generate calls UNAVAILABLE, the engine stops admitting. Open streams
  // keep running.
  void BeginDrain();
  bool draining() const { return service_->draining(); }
  // True when no stream is open and the engine has nothing queued or running.
  bool Drained() const;
  // Marks the server unhealthy without draining (the watchdog); reversible, except that SERVING is
  // refused once the engine has failed. Any thread.
  void SetServing(bool serving);
  // Stops the gRPC server; calls still open after `grace` are cancelled. Idempotent.
  void Shutdown(std::chrono::milliseconds grace);

  GenerationService& service() { return *service_; }

 private:
  TailServer() = default;

  Engine* engine_ = nullptr;
  std::unique_ptr<GenerationService> service_;
  std::unique_ptr<grpc::Server> server_;
  int32_t port_ = 0;
  std::string address_;
  std::atomic<bool> shut_down_{false};
};

}  // namespace ts::server
