#include "server/server.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"

namespace ts::server {

absl::StatusOr<std::unique_ptr<TailServer>> TailServer::Start(const ServerOptions& options,
                                                              Engine* engine) {
  std::unique_ptr<TailServer> s(new TailServer());
  s->engine_ = engine;
  TailServer* raw = s.get();
  s->service_ = std::make_unique<GenerationService>(
      engine, GenerationServiceOptions{.model_name = options.model_name,
                                       .tokenizer = options.tokenizer,
                                       .on_backend_failure = [raw] { raw->SetServing(false); },
                                       .debug_generate_delay = options.debug_generate_delay});

  // Both must be set before the builder is created: they register through global hooks.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  const bool ipv6 = options.host.find(':') != std::string::npos;
  const std::string host = ipv6 ? absl::StrCat("[", options.host, "]") : options.host;
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--port: ", options.port, " is outside [0, 65535]"));
  }
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default: a second tailserve on a busy port would then bind too and
  // silently take part of the first one's connections. Without it the second bind fails.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  int bound_port = 0;
  const std::string address = absl::StrCat(host, ":", options.port);
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &bound_port);
  builder.RegisterService(s->service_.get());
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || bound_port == 0) {
    return absl::UnavailableError(absl::StrCat(
        "could not listen on ", address,
        ": the port is in use (is another tailserve running there?) or the address is not local"));
  }
  s->port_ = bound_port;
  s->address_ = absl::StrCat(host, ":", bound_port);
  s->SetServing(true);
  return s;
}

TailServer::~TailServer() {
  Shutdown(std::chrono::milliseconds(0));
}

void TailServer::SetServing(bool serving) {
  if (shut_down_.load()) return;
  // A failed engine never serves again; this also wins a race with a watchdog recovery.
  if (serving && !engine_->health().ok()) serving = false;
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus(serving);  // "" (the whole server) and every registered service
}

void TailServer::BeginDrain() {
  SetServing(false);
  service_->BeginDrain();
  engine_->BeginDrain();
}

bool TailServer::Drained() const {
  return service_->active_streams() == 0 && engine_->Idle();
}

void TailServer::Shutdown(std::chrono::milliseconds grace) {
  if (server_ == nullptr || shut_down_.exchange(true)) return;
  // The health service answers NOT_SERVING from here on.
  server_->Shutdown(std::chrono::system_clock::now() + grace);
  server_->Wait();
}

}  // namespace ts::server
