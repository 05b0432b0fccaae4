// The rendezvous a multi-process pipeline needs before NCCL can start: rank 0 hands every other
// rank the same opaque blob (an ncclUniqueId) over a TCP side channel. Everything has a deadline,
// so a peer that never shows up, or a leader that is not there, ends in a clear error instead of
// a hang (docs/pipeline.md, Bootstrap).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace ts::pipeline {

struct BootstrapOptions {
  int32_t rank = 0;        // in [0, world_size)
  int32_t world_size = 1;  // >= 1
  // Rank 0 listens here ("0.0.0.0" or "::" for every interface); the others connect to it.
  std::string leader_host = "127.0.0.1";
  int32_t port = 0;  // rank 0: 0 picks a free port (see on_listening); the others: the leader's
  // The whole exchange, for every rank: connecting (retried while the leader is not up yet),
  // waiting for the other ranks, and the transfer.
  std::chrono::milliseconds timeout{60000};
};

// What every rank learns about rank r from the rendezvous.
struct BootstrapPeer {
  // Where rank r can be reached: for r > 0 the address rank 0 saw its connection come from; for
  // rank 0 the leader address this rank used.
  std::string host;
  std::string blob;  // what rank r contributed
};

// The rendezvous with every rank's contribution: each rank passes its own `blob` (at most 64 KiB)
// and gets back world_size entries indexed by rank, the same on every rank but for entry 0's host.
// The pipeline transport (tcp_transport.h) exchanges its listen ports this way. Deadlines, errors
// and `on_listening` as ExchangeBootstrapBlob below.
absl::StatusOr<std::vector<BootstrapPeer>> GatherBootstrap(
    const BootstrapOptions& options, std::string_view blob,
    const std::function<void(int32_t)>& on_listening = {});

// Rank 0 returns `blob` once every other rank has received it and said so; rank r > 0 returns the
// blob rank 0 sent (its own `blob` is ignored). `on_listening(port)` runs on rank 0 once it
// listens (tests use it to learn a picked port). Errors:
//   DeadlineExceeded: the timeout passed; the message names the ranks that never connected, or
//     the leader's address and why connecting failed;
//   FailedPrecondition: a peer disagrees on the world size, or two peers claim one rank;
//   InvalidArgument: bad options; Unavailable: the address cannot be bound or resolved, or the
//     other side hung up.
absl::StatusOr<std::string> ExchangeBootstrapBlob(
    const BootstrapOptions& options, std::string_view blob,
    const std::function<void(int32_t)>& on_listening = {});

}  // namespace ts::pipeline
