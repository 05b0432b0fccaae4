#include "engine/engine.h"

#include <thread>

#include "common/status.h"
#include "engine/scheduler.h"

namespace ts {

struct Engine::Impl {
  std::unique_ptr<Scheduler> scheduler;
  std::thread thread;

  void Loop() {
    while (scheduler->WaitForWork()) scheduler->Step();
  }
};

Engine::Engine() : impl_(std::make_unique<Impl>()) {}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(EngineOptions options,
                                                       std::unique_ptr<Backend> backend) {
  TS_ASSIGN_OR_RETURN(std::unique_ptr<Scheduler> scheduler,
                      Scheduler::Create(std::move(options), std::move(backend)));
  std::unique_ptr<Engine> engine(new Engine());
  engine->impl_->scheduler = std::move(scheduler);
  Impl* impl = engine->impl_.get();
  impl->thread = std::thread([impl] { impl->Loop(); });
  return engine;
}

Engine::~Engine() {
  if (impl_ == nullptr || impl_->scheduler == nullptr) return;
  impl_->scheduler->Stop();
  if (impl_->thread.joinable()) impl_->thread.join();
  // The engine thread is gone, so this thread now owns request state.
  impl_->scheduler->AbortAll(absl::UnavailableError("engine stopped"));
}

absl::StatusOr<std::shared_ptr<RequestStream>> Engine::Submit(GenerateRequest request) {
  return impl_->scheduler->Submit(std::move(request));
}

void Engine::Cancel(const std::string& request_id) {
  impl_->scheduler->Cancel(request_id);
}

void Engine::BeginDrain() {
  impl_->scheduler->BeginDrain();
}

bool Engine::Idle() const {
  return impl_->scheduler->Idle();
}

ModelInfo Engine::model_info() const {
  return impl_->scheduler->model_info();
}

EngineStats Engine::stats() const {
  return impl_->scheduler->stats();
}

absl::Status Engine::health() const {
  return impl_->scheduler->health();
}

}  // namespace ts
