// Where this process sits in a multi-process pipeline: its rank, the world size and the leader
// (rank 0) that hands out the NCCL id (bootstrap.h). From flags, or from the environment a
// launcher sets: tailserve's own TS_RANK / TS_WORLD_SIZE / TS_LEADER_ADDRESS, or the coordinates a
// Kubernetes LeaderWorkerSet gives every pod (LWS_WORKER_INDEX, LWS_GROUP_SIZE,
// LWS_LEADER_ADDRESS), so a deployment needs no wrapper script (docs/pipeline.md, Topology).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace ts::pipeline {

// What the command line said; nullopt = not given.
struct TopologyFlags {
  std::optional<int32_t> rank = std::nullopt;        // --rank
  std::optional<int32_t> world_size = std::nullopt;  // --world_size
  // --leader_address: "host", "host:port" or "[v6]:port"
  std::optional<std::string> leader_address = std::nullopt;
  int32_t default_port = 29500;  // when the address names no port
};

struct Topology {
  int32_t rank = 0;
  int32_t world_size = 1;   // 1: a single process (no bootstrap)
  std::string leader_host;  // empty when world_size == 1
  int32_t leader_port = 0;
  // Where each value came from ("--rank", "LWS_WORKER_INDEX", "default"), for the startup log.
  std::string source;
};

// A flag wins over TS_*, which wins over LWS_*. Errors (InvalidArgument) name the flag or the
// variable the bad value came from: a non-number, a rank outside [0, world size), a world size
// < 1, a missing leader when world size > 1, a malformed address.
absl::StatusOr<Topology> ResolveTopology(
    const TopologyFlags& flags,
    const std::function<std::optional<std::string>(const char* name)>& getenv);

// The process environment, for ResolveTopology.
std::optional<std::string> ProcessEnv(const char* name);

}  // namespace ts::pipeline
