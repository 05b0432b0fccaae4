// The pipeline's transport between processes on the CPU: one TCP connection from each rank to the
// next, ring-wise (stage_transport.h). Startup reuses the bootstrap's rendezvous (bootstrap.h):
// every rank opens a listener on a free port and announces it through GatherBootstrap, then
// connects to its successor and accepts its predecessor. Everything is bounded by one timeout, so
// a rank that never comes fails startup naming it (docs/pipeline.md, Processes).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/pipeline/stage_transport.h"

namespace ts::pipeline {

struct TcpTransportOptions {
  int32_t rank = 0;
  int32_t world_size = 2;  // >= 2
  // The bootstrap's: rank 0 listens there (port 0 picks one, see on_listening), the others
  // connect to it.
  std::string leader_host = "127.0.0.1";
  int32_t leader_port = 0;
  // Startup as a whole (rendezvous and links); then each Send, and the rest of a message once
  // its first bytes have come. Also the keepalive's limit, so a peer whose host vanishes (no
  // FIN) breaks the link within about this long.
  std::chrono::milliseconds timeout{60000};
  // Must be equal on every rank (the stage plan, say): a rank whose check differs fails startup
  // on every rank, named, instead of computing with another split.
  std::string check;
  // This rank's contribution to the rendezvous, readable on every rank as payload(rank): the
  // leader hands out what all ranks must agree on (the KV pool's geometry).
  std::string payload;
  std::function<void(int32_t port)> on_listening;  // rank 0, once its bootstrap port is known
};

class TcpTransport final : public StageTransport {
 public:
  // Returns once this rank's two links are up. DeadlineExceeded naming the rank that is missing,
  // FailedPrecondition when the ranks disagree (world size, check), as GatherBootstrap otherwise.
  static absl::StatusOr<std::unique_ptr<TcpTransport>> Connect(const TcpTransportOptions& options);
  ~TcpTransport() override;  // closes both links (the peers see them end) and joins the reader

  int32_t rank() const override { return rank_; }
  int32_t world_size() const override { return world_size_; }
  absl::Status Send(const StageMessage& m) override;
  absl::Status Recv(StageMessage* m, std::optional<std::chrono::milliseconds> timeout) override;
  absl::Status health() const override;
  const std::string& payload(int32_t rank) const { return payloads_[rank]; }

 private:
  struct Links;
  TcpTransport(const TcpTransportOptions& options, std::unique_ptr<Links> links,
               std::vector<std::string> payloads);
  void ReadLoop();  // the reader thread: frames from the predecessor into the inbox
  void Break(const absl::Status& status);

  const int32_t rank_;
  const int32_t world_size_;
  const std::chrono::milliseconds timeout_;
  std::vector<std::string> payloads_;  // [world_size]
  std::unique_ptr<Links> links_;
};

// The wire format, for tests that play a misbehaving peer: the rendezvous blob a rank contributes,
// the first bytes of a link, and one message's frame (the header as it sits in memory: every rank
// runs one build).
namespace wire {
std::string RendezvousBlob(int32_t port, const std::string& check, const std::string& payload);
bool ParseRendezvousBlob(const std::string& blob, int32_t* port, std::string* check,
                         std::string* payload);
std::string LinkHelloBytes(int32_t rank, int32_t world_size);
absl::StatusOr<std::string> Frame(const StageMessage& m);
}  // namespace wire

}  // namespace ts::pipeline
