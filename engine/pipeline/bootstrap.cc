#include "engine/pipeline/bootstrap.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/pipeline/socket.h"

namespace ts::pipeline {
namespace {

constexpr uint32_t kHelloMagic = 0x53425354;  // "TSBS"
constexpr uint32_t kAckMagic = 0x4b4f5354;    // "TSOK"
constexpr uint32_t kVersion = 2;              // 2: every rank contributes a blob
constexpr uint32_t kMaxBlob = 1 << 16;

constexpr char kContext[] = "pipeline bootstrap";

absl::Status SendAll(int fd, const void* data, size_t n, Clock::time_point deadline,
                     const std::string& peer) {
  return pipeline::SendAll(fd, data, n, deadline, kContext, peer);
}

absl::Status RecvAll(int fd, void* data, size_t n, Clock::time_point deadline,
                     const std::string& peer) {
  return pipeline::RecvAll(fd, data, n, deadline, kContext, peer);
}

// A follower's first message, followed by `blob_size` bytes of its own blob.
struct Hello {
  uint32_t magic, version;
  int32_t rank, world_size;
  uint32_t blob_size;
};

// One u32 length and the bytes.
absl::Status SendString(int fd, std::string_view s, Clock::time_point deadline,
                        const std::string& peer) {
  const uint32_t size = static_cast<uint32_t>(s.size());
  if (absl::Status st = SendAll(fd, &size, sizeof(size), deadline, peer); !st.ok()) return st;
  return SendAll(fd, s.data(), s.size(), deadline, peer);
}

absl::StatusOr<std::string> RecvString(int fd, Clock::time_point deadline,
                                       const std::string& peer) {
  uint32_t size = 0;
  if (absl::Status s = RecvAll(fd, &size, sizeof(size), deadline, peer); !s.ok()) return s;
  if (size > kMaxBlob) {
    return absl::UnavailableError(absl::StrCat("pipeline bootstrap: ", peer, " announced ", size,
                                               " bytes, more than ", kMaxBlob));
  }
  std::string out(size, '\0');
  if (absl::Status s = RecvAll(fd, out.data(), size, deadline, peer); !s.ok()) return s;
  return out;
}

// The numeric host of a connected peer, as the leader sees it (an IPv4-mapped IPv6 address is
// given as the IPv4 one), so a follower need not know which of its addresses reaches the others.
std::string PeerHost(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "";
  char host[NI_MAXHOST] = {};
  if (getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof(host), nullptr, 0,
                  NI_NUMERICHOST) != 0) {
    return "";
  }
  std::string h = host;
  if (h.rfind("::ffff:", 0) == 0 && h.find('.') != std::string::npos) h = h.substr(7);
  return h;
}

absl::StatusOr<addrinfo*> Resolve(const BootstrapOptions& o, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string port = absl::StrCat(o.port);
  if (const int rc = getaddrinfo(o.leader_host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("pipeline bootstrap: cannot resolve ", o.leader_host, ": ", gai_strerror(rc)));
  }
  return res;
}

absl::StatusOr<std::vector<BootstrapPeer>> Lead(const BootstrapOptions& o, std::string_view blob,
                                                const std::function<void(int32_t)>& on_listening,
                                                Clock::time_point deadline) {
  const std::string where = absl::StrCat(o.leader_host, ":", o.port);
  absl::StatusOr<addrinfo*> res = Resolve(o, /*passive=*/true);
  if (!res.ok()) return res.status();
  Fd listener(socket((*res)->ai_family, SOCK_STREAM, 0));
  const int one = 1;
  setsockopt(listener.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool bound = listener.get() >= 0 &&
                     bind(listener.get(), (*res)->ai_addr, (*res)->ai_addrlen) == 0 &&
                     listen(listener.get(), o.world_size) == 0;
  freeaddrinfo(*res);
  if (!bound) {
    return absl::UnavailableError(absl::StrCat("pipeline bootstrap: rank 0 cannot listen on ",
                                               where, ": ", std::strerror(errno)));
  }
  SetNonBlocking(listener.get());
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  const int32_t port =
      ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                       : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  if (on_listening) on_listening(port);

  std::map<int32_t, Fd> peers;  // rank -> connection
  std::vector<BootstrapPeer> table(o.world_size);
  table[0] = {.host = o.leader_host, .blob = std::string(blob)};
  while (static_cast<int32_t>(peers.size()) < o.world_size - 1) {
    if (!WaitFor(listener.get(), POLLIN, deadline)) {
      std::vector<int32_t> missing;
      for (int32_t r = 1; r < o.world_size; ++r) {
        if (peers.count(r) == 0) missing.push_back(r);
      }
      return absl::DeadlineExceededError(absl::StrCat(
          "pipeline bootstrap: rank 0 of ", o.world_size, " waited ", o.timeout.count(),
          " ms on port ", port, "; rank", missing.size() > 1 ? "s " : " ",
          absl::StrJoin(missing, ", "), " never connected"));
    }
    Fd conn(accept(listener.get(), nullptr, nullptr));
    if (conn.get() < 0) continue;
    SetNonBlocking(conn.get());
    Hello h{};
    // A peer sends its hello at once; one that does not (a port scanner, a stale client) is
    // dropped after a few seconds rather than holding up the others until the deadline.
    const auto hello_by = std::min(deadline, Clock::now() + std::chrono::seconds(5));
    if (!RecvAll(conn.get(), &h, sizeof(h), hello_by, "a connecting peer").ok() ||
        h.magic != kHelloMagic) {
      continue;
    }
    std::string peer_blob;
    if (h.version == kVersion) {
      if (h.blob_size > kMaxBlob) continue;
      peer_blob.resize(h.blob_size);
      if (!RecvAll(conn.get(), peer_blob.data(), h.blob_size, hello_by, "a connecting peer").ok()) {
        continue;
      }
    }
    if (h.version != kVersion || h.world_size != o.world_size) {
      return absl::FailedPreconditionError(absl::StrCat(
          "pipeline bootstrap: rank ", h.rank, " says world size ", h.world_size, " (protocol ",
          h.version, "); rank 0 has ", o.world_size, " (protocol ", kVersion, ")"));
    }
    if (h.rank < 1 || h.rank >= o.world_size || peers.count(h.rank) != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "pipeline bootstrap: a peer claims rank ", h.rank,
          peers.count(h.rank) != 0 ? ", which another peer already holds"
                                   : absl::StrCat(", outside [1, ", o.world_size, ")")));
    }
    table[h.rank] = {.host = PeerHost(conn.get()), .blob = std::move(peer_blob)};
    peers.emplace(h.rank, std::move(conn));
  }
  for (auto& [rank, fd] : peers) {
    const std::string peer = absl::StrCat("rank ", rank);
    for (const BootstrapPeer& entry : table) {
      if (absl::Status s = SendString(fd.get(), entry.host, deadline, peer); !s.ok()) return s;
      if (absl::Status s = SendString(fd.get(), entry.blob, deadline, peer); !s.ok()) return s;
    }
  }
  for (auto& [rank, fd] : peers) {
    uint32_t ack = 0;
    const std::string peer = absl::StrCat("rank ", rank);
    if (absl::Status s = RecvAll(fd.get(), &ack, sizeof(ack), deadline, peer); !s.ok()) return s;
    if (ack != kAckMagic) {
      return absl::UnavailableError(absl::StrCat("pipeline bootstrap: ", peer, " sent a bad ack"));
    }
  }
  return table;
}

// Connects to the leader, retrying while it is not up yet. Every address the name resolves to is
// tried ("localhost" may give ::1 first while the leader listens on 127.0.0.1).
absl::StatusOr<Fd> Connect(const BootstrapOptions& o, Clock::time_point deadline) {
  const std::string where = absl::StrCat(o.leader_host, ":", o.port);
  std::string last = "no attempt";
  while (Clock::now() < deadline) {
    absl::StatusOr<addrinfo*> res = Resolve(o, /*passive=*/false);
    if (!res.ok()) return res.status();
    Fd fd;
    bool connected = false;
    for (const addrinfo* a = *res; a != nullptr && !connected; a = a->ai_next) {
      connected = TryConnect(a, std::min(deadline, Clock::now() + std::chrono::seconds(1)), &fd);
      if (!connected) last = std::strerror(errno);
    }
    freeaddrinfo(*res);
    if (connected) return fd;
    std::this_thread::sleep_for(std::min<std::chrono::milliseconds>(
        std::chrono::milliseconds(100), std::chrono::milliseconds(MillisLeft(deadline))));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("pipeline bootstrap: rank ", o.rank, " could not reach the leader at ", where,
                   " within ", o.timeout.count(), " ms (", last, ")"));
}

absl::StatusOr<std::vector<BootstrapPeer>> Follow(const BootstrapOptions& o, std::string_view blob,
                                                  Clock::time_point deadline) {
  absl::StatusOr<Fd> fd = Connect(o, deadline);
  if (!fd.ok()) return fd.status();
  const std::string leader = absl::StrCat("the leader at ", o.leader_host, ":", o.port);
  const Hello h{kHelloMagic, kVersion, o.rank, o.world_size, static_cast<uint32_t>(blob.size())};
  if (absl::Status s = SendAll(fd->get(), &h, sizeof(h), deadline, leader); !s.ok()) return s;
  if (absl::Status s = SendAll(fd->get(), blob.data(), blob.size(), deadline, leader); !s.ok()) {
    return s;
  }
  std::vector<BootstrapPeer> table(o.world_size);
  for (BootstrapPeer& entry : table) {
    absl::StatusOr<std::string> host = RecvString(fd->get(), deadline, leader);
    if (!host.ok()) return host.status();
    absl::StatusOr<std::string> peer_blob = RecvString(fd->get(), deadline, leader);
    if (!peer_blob.ok()) return peer_blob.status();
    entry = {.host = *std::move(host), .blob = *std::move(peer_blob)};
  }
  // The leader's own entry names the address it listens on, which may be a wildcard; this rank
  // reached it at o.leader_host.
  table[0].host = o.leader_host;
  const uint32_t ack = kAckMagic;
  if (absl::Status s = SendAll(fd->get(), &ack, sizeof(ack), deadline, leader); !s.ok()) return s;
  return table;
}

}  // namespace

absl::StatusOr<std::vector<BootstrapPeer>> GatherBootstrap(
    const BootstrapOptions& o, std::string_view blob,
    const std::function<void(int32_t)>& on_listening) {
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline bootstrap: rank ", o.rank, " is outside [0, world size ", o.world_size, ")"));
  }
  if (o.port < 0 || o.port > 65535 || (o.rank > 0 && o.port == 0)) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline bootstrap: port ", o.port, " (rank ",
                                                   o.rank, ") is not a leader port"));
  }
  if (o.timeout.count() <= 0) {
    return absl::InvalidArgumentError("pipeline bootstrap: the timeout must be positive");
  }
  if (blob.size() > kMaxBlob) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline bootstrap: ", blob.size(), " bytes exceed ", kMaxBlob));
  }
  const Clock::time_point deadline = Clock::now() + o.timeout;
  if (o.rank == 0) return Lead(o, blob, on_listening, deadline);
  return Follow(o, blob, deadline);
}

absl::StatusOr<std::string> ExchangeBootstrapBlob(
    const BootstrapOptions& o, std::string_view blob,
    const std::function<void(int32_t)>& on_listening) {
  // Only the leader's blob matters here; the followers contribute none.
  absl::StatusOr<std::vector<BootstrapPeer>> table =
      GatherBootstrap(o, o.rank == 0 ? blob : std::string_view(), on_listening);
  if (!table.ok()) return table.status();
  return std::move((*table)[0].blob);
}

}  // namespace ts::pipeline
