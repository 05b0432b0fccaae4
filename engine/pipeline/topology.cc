#include "engine/pipeline/topology.h"

#include <cstdlib>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ts::pipeline {
namespace {

// A value and the name of where it came from.
template <typename T>
struct Sourced {
  std::optional<T> value;
  std::string from = "default";
};

using Env = std::function<std::optional<std::string>(const char*)>;

absl::StatusOr<Sourced<int32_t>> PickInt(const std::optional<int32_t>& flag, const char* flag_name,
                                         std::initializer_list<const char*> vars, const Env& env) {
  Sourced<int32_t> out;
  if (flag) {
    out.value = *flag;
    out.from = flag_name;
    return out;
  }
  for (const char* var : vars) {
    const std::optional<std::string> v = env(var);
    if (!v || v->empty()) continue;
    int32_t n = 0;
    if (!absl::SimpleAtoi(*v, &n)) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag_name, " (from ", var, "=\"", *v, "\"): not a number"));
    }
    out.value = n;
    out.from = var;
    return out;
  }
  return out;
}

Sourced<std::string> PickString(const std::optional<std::string>& flag, const char* flag_name,
                                std::initializer_list<const char*> vars, const Env& env) {
  Sourced<std::string> out;
  if (flag) {
    out.value = *flag;
    out.from = flag_name;
    return out;
  }
  for (const char* var : vars) {
    std::optional<std::string> v = env(var);
    if (!v || v->empty()) continue;
    out.value = std::move(v);
    out.from = var;
    return out;
  }
  return out;
}

// "host", "host:port" or "[v6]:port" (a bare v6 address has colons and no port).
absl::Status ParseAddress(const std::string& address, const std::string& from, int32_t default_port,
                          std::string* host, int32_t* port) {
  const auto bad = [&](const char* why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--leader_address (from ", from, "=\"", address, "\"): ", why));
  };
  std::string port_text;
  if (!address.empty() && address[0] == '[') {
    const size_t close = address.find(']');
    if (close == std::string::npos) return bad("an IPv6 address needs its closing ]");
    *host = address.substr(1, close - 1);
    if (close + 1 < address.size()) {
      if (address[close + 1] != ':') return bad("expected :port after the ]");
      port_text = address.substr(close + 2);
    }
  } else if (const size_t colon = address.rfind(':');
             colon != std::string::npos && address.find(':') == colon) {
    *host = address.substr(0, colon);
    port_text = address.substr(colon + 1);
  } else {
    *host = address;  // a name, an IPv4 address or a bare IPv6 one
  }
  if (host->empty()) return bad("no host");
  *port = default_port;
  if (!port_text.empty() && (!absl::SimpleAtoi(port_text, port) || *port < 1 || *port > 65535)) {
    return bad("the port must be a number in [1, 65535]");
  }
  return absl::OkStatus();
}

}  // namespace

std::optional<std::string> ProcessEnv(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::nullopt : std::optional<std::string>(v);
}

absl::StatusOr<Topology> ResolveTopology(const TopologyFlags& flags, const Env& env) {
  absl::StatusOr<Sourced<int32_t>> world =
      PickInt(flags.world_size, "--world_size", {"TS_WORLD_SIZE", "LWS_GROUP_SIZE"}, env);
  if (!world.ok()) return world.status();
  absl::StatusOr<Sourced<int32_t>> rank =
      PickInt(flags.rank, "--rank", {"TS_RANK", "LWS_WORKER_INDEX"}, env);
  if (!rank.ok()) return rank.status();
  const Sourced<std::string> leader = PickString(flags.leader_address, "--leader_address",
                                                 {"TS_LEADER_ADDRESS", "LWS_LEADER_ADDRESS"}, env);

  Topology t;
  t.world_size = world->value.value_or(1);
  t.rank = rank->value.value_or(0);
  if (t.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--world_size (from ", world->from, "): ", t.world_size, " must be >= 1"));
  }
  if (t.rank < 0 || t.rank >= t.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("--rank (from ", rank->from, "): ", t.rank,
                                                   " is outside [0, ", t.world_size,
                                                   ") (world size from ", world->from, ")"));
  }
  std::vector<std::string> sources = {absl::StrCat("rank from ", rank->from),
                                      absl::StrCat("world size from ", world->from)};
  if (t.world_size > 1) {
    if (!leader.value) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--leader_address: a world of ", t.world_size,
          " processes needs the leader's address (--leader_address, TS_LEADER_ADDRESS or "
          "LWS_LEADER_ADDRESS)"));
    }
    if (absl::Status s = ParseAddress(*leader.value, leader.from, flags.default_port,
                                      &t.leader_host, &t.leader_port);
        !s.ok()) {
      return s;
    }
    sources.push_back(absl::StrCat("leader from ", leader.from));
  }
  t.source = absl::StrJoin(sources, ", ");
  return t;
}

}  // namespace ts::pipeline
