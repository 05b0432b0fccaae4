#include "engine/pipeline/tcp_transport.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "engine/pipeline/bootstrap.h"
#include "engine/pipeline/socket.h"

namespace ts::pipeline {
namespace {

constexpr uint32_t kLinkMagic = 0x4b4c5354;   // "TSLK": a link's first bytes
constexpr uint32_t kFrameMagic = 0x524d5354;  // "TSMR": every message's first bytes
constexpr uint32_t kLinkVersion = 1;

// Bounds a frame may announce; above them it is malformed, not a reason to allocate.
constexpr uint32_t kMaxChunks = 1 << 20;
constexpr uint32_t kMaxInts = 1 << 28;  // tokens, blocks
constexpr uint32_t kMaxMessage = 1 << 16;
constexpr uint64_t kMaxData = uint64_t{1} << 32;  // floats

struct LinkHello {
  uint32_t magic, version;
  int32_t rank, world_size;
};

// Every rank is one build, so the header crosses the wire as it sits in memory.
struct FrameHeader {
  uint32_t magic;
  uint32_t op;
  uint64_t id;
  uint64_t data;  // floats
  uint32_t mode;
  int32_t code;  // absl::StatusCode of the message's status
  uint32_t chunks, tokens, blocks, message;
};
static_assert(sizeof(FrameHeader) == 48);

template <typename T>
void Append(std::string* buf, const std::vector<T>& v) {
  buf->append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

}  // namespace

bool wire::ParseRendezvousBlob(const std::string& blob, int32_t* port, std::string* check,
                               std::string* payload) {
  uint32_t head[2];
  if (blob.size() < sizeof(head)) return false;
  std::memcpy(head, blob.data(), sizeof(head));
  if (blob.size() - sizeof(head) < head[1]) return false;
  *port = static_cast<int32_t>(head[0]);
  *check = blob.substr(sizeof(head), head[1]);
  *payload = blob.substr(sizeof(head) + head[1]);
  return true;
}

namespace {

// TCP keepalive and a user timeout of about `timeout`: a peer whose host vanishes sends no FIN,
// and this is what still ends the wait for it.
void Tune(int fd, std::chrono::milliseconds timeout) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  const int secs = static_cast<int>(std::max<int64_t>(1, timeout.count() / 1000));
  const int idle = std::max(1, secs / 2), interval = std::max(1, secs / 6), count = 3;
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  const unsigned user = static_cast<unsigned>(std::max<int64_t>(1000, timeout.count()));
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user, sizeof(user));
}

// A listener on every interface and a free port: the predecessor may be on another host. IPv6
// with IPv4 mapped where the host has it, else IPv4.
absl::StatusOr<Fd> Listen(int32_t* port) {
  Fd fd(socket(AF_INET6, SOCK_STREAM, 0));
  if (fd.get() >= 0) {
    const int zero = 0;
    setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    if (bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) fd = Fd();
  }
  if (fd.get() < 0) {
    fd = Fd(socket(AF_INET, SOCK_STREAM, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    if (fd.get() < 0 || bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      return absl::UnavailableError(
          absl::StrCat("pipeline: cannot bind a listener: ", std::strerror(errno)));
    }
  }
  if (listen(fd.get(), 8) != 0) {
    return absl::UnavailableError(absl::StrCat("pipeline: cannot listen: ", std::strerror(errno)));
  }
  SetNonBlocking(fd.get());
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return fd;
}

// A frame without its data: the header, the chunk arrays and the status message.
absl::StatusOr<std::string> FrameHead(const StageMessage& m) {
  const absl::string_view message = m.status.message();
  FrameHeader h{.magic = kFrameMagic,
                .op = static_cast<uint32_t>(m.op),
                .id = m.id,
                .data = m.data.size(),
                .mode = static_cast<uint32_t>(m.mode),
                .code = static_cast<int32_t>(m.status.code()),
                .chunks = static_cast<uint32_t>(m.starts.size()),
                .tokens = static_cast<uint32_t>(m.tokens.size()),
                .blocks = static_cast<uint32_t>(m.blocks.size()),
                .message = static_cast<uint32_t>(std::min<size_t>(message.size(), kMaxMessage))};
  if (m.lengths.size() != h.chunks || m.block_counts.size() != h.chunks || h.chunks > kMaxChunks ||
      m.tokens.size() > kMaxInts || m.blocks.size() > kMaxInts || h.data > kMaxData) {
    return absl::InvalidArgumentError(
        absl::StrCat(": message ", m.id, " has inconsistent or oversized fields"));
  }
  std::string buf(reinterpret_cast<const char*>(&h), sizeof(h));
  Append(&buf, m.starts);
  Append(&buf, m.lengths);
  Append(&buf, m.block_counts);
  Append(&buf, m.tokens);
  Append(&buf, m.blocks);
  buf.append(message.data(), h.message);
  return buf;
}

absl::Status Prefixed(const absl::Status& s, const std::string& context) {
  return absl::Status(s.code(), absl::StrCat(context, s.message()));
}

}  // namespace

struct TcpTransport::Links {
  Fd next;              // to rank + 1: written by Send only
  Fd prev;              // from rank - 1: read by the reader thread only
  std::string context;  // "pipeline rank r", the start of every error
  std::string next_name, prev_name;
  std::thread reader;

  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<StageMessage> inbox;  // guarded by mu
  absl::Status error;              // guarded by mu: the first link failure, sticky
  bool ended = false;              // guarded by mu: the predecessor sent its shutdown
};

namespace {

// Connects to `host:port`, retrying until the deadline (the listener exists before the
// rendezvous ends, so the first attempt normally succeeds), and says who this is.
absl::StatusOr<Fd> ConnectLink(const std::string& host, int32_t port, const LinkHello& hello,
                               Clock::time_point deadline, const std::string& context,
                               const std::string& peer) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  std::string last = "no attempt";
  while (Clock::now() < deadline) {
    addrinfo* res = nullptr;
    if (const int rc = getaddrinfo(host.c_str(), absl::StrCat(port).c_str(), &hints, &res);
        rc != 0) {
      return absl::UnavailableError(absl::StrCat(context, ": cannot resolve ", peer, "'s host ",
                                                 host, ": ", gai_strerror(rc)));
    }
    Fd fd;
    bool connected = false;
    for (const addrinfo* a = res; a != nullptr && !connected; a = a->ai_next) {
      connected = TryConnect(a, std::min(deadline, Clock::now() + std::chrono::seconds(1)), &fd);
      if (!connected) last = std::strerror(errno);
    }
    freeaddrinfo(res);
    if (connected) {
      if (absl::Status s = SendAll(fd.get(), &hello, sizeof(hello), deadline, context, peer);
          !s.ok()) {
        return s;
      }
      return fd;
    }
    std::this_thread::sleep_for(std::min<std::chrono::milliseconds>(
        std::chrono::milliseconds(100), std::chrono::milliseconds(MillisLeft(deadline))));
  }
  return absl::DeadlineExceededError(absl::StrCat(context, ": could not connect to ", peer, " at ",
                                                  host, ":", port, " in time (", last, ")"));
}

// Accepts the link from rank `from`; connections that are not it are dropped.
absl::StatusOr<Fd> AcceptLink(const Fd& listener, int32_t from, int32_t world,
                              Clock::time_point deadline, std::chrono::milliseconds timeout,
                              const std::string& context) {
  for (;;) {
    if (!WaitFor(listener.get(), POLLIN, deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(
          context, ": rank ", from, " never connected its link within ", timeout.count(), " ms"));
    }
    Fd conn(accept(listener.get(), nullptr, nullptr));
    if (conn.get() < 0) continue;
    SetNonBlocking(conn.get());
    LinkHello h{};
    const auto hello_by = std::min(deadline, Clock::now() + std::chrono::seconds(5));
    if (!RecvAll(conn.get(), &h, sizeof(h), hello_by, context, "a connecting peer").ok() ||
        h.magic != kLinkMagic) {
      continue;
    }
    if (h.version != kLinkVersion || h.world_size != world || h.rank != from) {
      return absl::FailedPreconditionError(absl::StrCat(
          context, ": expected rank ", from, " of ", world, " (link protocol ", kLinkVersion,
          "), got rank ", h.rank, " of ", h.world_size, " (link protocol ", h.version, ")"));
    }
    return conn;
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<TcpTransport>> TcpTransport::Connect(const TcpTransportOptions& o) {
  if (o.world_size < 2 || o.rank < 0 || o.rank >= o.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline transport: rank ", o.rank,
                                                   " of world size ", o.world_size,
                                                   " (a transport needs 2 ranks or more)"));
  }
  if (o.timeout.count() <= 0) {
    return absl::InvalidArgumentError("pipeline transport: the timeout must be positive");
  }
  const Clock::time_point deadline = Clock::now() + o.timeout;
  auto links = std::make_unique<Links>();
  links->context = absl::StrCat("pipeline rank ", o.rank);
  const int32_t next = (o.rank + 1) % o.world_size;
  const int32_t prev = (o.rank + o.world_size - 1) % o.world_size;
  links->next_name = absl::StrCat("rank ", next);
  links->prev_name = absl::StrCat("rank ", prev);

  int32_t port = 0;
  absl::StatusOr<Fd> listener = Listen(&port);
  if (!listener.ok()) return listener.status();
  absl::StatusOr<std::vector<BootstrapPeer>> table =
      GatherBootstrap({.rank = o.rank,
                       .world_size = o.world_size,
                       .leader_host = o.leader_host,
                       .port = o.leader_port,
                       .timeout = o.timeout},
                      wire::RendezvousBlob(port, o.check, o.payload), o.on_listening);
  if (!table.ok()) return table.status();

  std::vector<std::string> payloads(o.world_size);
  std::vector<int32_t> ports(o.world_size);
  for (int32_t r = 0; r < o.world_size; ++r) {
    std::string check;
    if (!wire::ParseRendezvousBlob((*table)[r].blob, &ports[r], &check, &payloads[r])) {
      return absl::UnavailableError(
          absl::StrCat(links->context, ": rank ", r, " sent a malformed rendezvous blob"));
    }
    if (check != o.check) {
      return absl::FailedPreconditionError(
          absl::StrCat(links->context, ": rank ", r, " disagrees: it has \"", check,
                       "\", this rank \"", o.check, "\" (same model and flags on every rank?)"));
    }
  }
  const LinkHello hello{kLinkMagic, kLinkVersion, o.rank, o.world_size};
  absl::StatusOr<Fd> to_next = ConnectLink((*table)[next].host, ports[next], hello, deadline,
                                           links->context, links->next_name);
  if (!to_next.ok()) return to_next.status();
  absl::StatusOr<Fd> from_prev =
      AcceptLink(*listener, prev, o.world_size, deadline, o.timeout, links->context);
  if (!from_prev.ok()) return from_prev.status();
  links->next = *std::move(to_next);
  links->prev = *std::move(from_prev);
  Tune(links->next.get(), o.timeout);
  Tune(links->prev.get(), o.timeout);
  return std::unique_ptr<TcpTransport>(new TcpTransport(o, std::move(links), std::move(payloads)));
}

TcpTransport::TcpTransport(const TcpTransportOptions& o, std::unique_ptr<Links> links,
                           std::vector<std::string> payloads)
    : rank_(o.rank),
      world_size_(o.world_size),
      timeout_(o.timeout),
      payloads_(std::move(payloads)),
      links_(std::move(links)) {
  links_->reader = std::thread([this] { ReadLoop(); });
}

TcpTransport::~TcpTransport() {
  // Wakes the reader (its recv returns 0), then both connections close: each peer sees its link
  // end, which is how a rank learns that this one is gone.
  shutdown(links_->prev.get(), SHUT_RDWR);
  links_->reader.join();
}

void TcpTransport::Break(const absl::Status& status) {
  {
    std::lock_guard<std::mutex> lock(links_->mu);
    if (links_->error.ok()) links_->error = status;
  }
  links_->cv.notify_all();
}

absl::Status TcpTransport::health() const {
  std::lock_guard<std::mutex> lock(links_->mu);
  return links_->error;
}

absl::Status TcpTransport::Send(const StageMessage& m) {
  if (absl::Status h = health(); !h.ok()) return h;
  absl::StatusOr<std::string> head = FrameHead(m);
  if (!head.ok()) return Prefixed(head.status(), links_->context);
  const Clock::time_point deadline = Clock::now() + timeout_;
  absl::Status s = SendAll(links_->next.get(), head->data(), head->size(), deadline,
                           links_->context, links_->next_name);
  if (s.ok()) {
    s = SendAll(links_->next.get(), m.data.data(), m.data.size() * sizeof(float), deadline,
                links_->context, links_->next_name);
  }
  if (!s.ok()) Break(s);
  return s;
}

absl::Status TcpTransport::Recv(StageMessage* m, std::optional<std::chrono::milliseconds> timeout) {
  std::unique_lock<std::mutex> lock(links_->mu);
  const auto ready = [&] { return !links_->inbox.empty() || !links_->error.ok() || links_->ended; };
  if (timeout) {
    if (!links_->cv.wait_for(lock, *timeout, ready)) {
      return absl::DeadlineExceededError(absl::StrCat(links_->context, ": nothing from ",
                                                      links_->prev_name, " within ",
                                                      timeout->count(), " ms"));
    }
  } else {
    links_->cv.wait(lock, ready);
  }
  // What arrived before a failure is still delivered: a peer's last message (its shutdown) may
  // be followed at once by its link closing.
  if (!links_->inbox.empty()) {
    *m = std::move(links_->inbox.front());
    links_->inbox.pop_front();
    return absl::OkStatus();
  }
  if (!links_->error.ok()) return links_->error;
  return absl::UnavailableError(
      absl::StrCat(links_->context, ": ", links_->prev_name, " has shut down"));
}

void TcpTransport::ReadLoop() {
  const int fd = links_->prev.get();
  const std::string& peer = links_->prev_name;
  for (;;) {
    // Idle for as long as it takes (a peer that dies ends the wait, see Tune); once a frame
    // starts, the rest is due within the timeout.
    WaitFor(fd, POLLIN, Clock::time_point::max());
    const Clock::time_point deadline = Clock::now() + timeout_;
    const auto recv = [&](void* p, size_t n) {
      return RecvAll(fd, p, n, deadline, links_->context, peer);
    };
    FrameHeader h{};
    absl::Status s = recv(&h, sizeof(h));
    if (s.ok() && (h.magic != kFrameMagic || h.chunks > kMaxChunks || h.tokens > kMaxInts ||
                   h.blocks > kMaxInts || h.message > kMaxMessage || h.data > kMaxData ||
                   h.op < static_cast<uint32_t>(StageOp::kForward) || h.op > kLastStageOp)) {
      s = absl::DataLossError(absl::StrCat(links_->context, ": ", peer, " sent a malformed frame"));
    }
    StageMessage m;
    if (s.ok()) {
      m.op = static_cast<StageOp>(h.op);
      m.id = h.id;
      m.mode = static_cast<LogitsMode>(h.mode);
      m.starts.resize(h.chunks);
      m.lengths.resize(h.chunks);
      m.block_counts.resize(h.chunks);
      m.tokens.resize(h.tokens);
      m.blocks.resize(h.blocks);
      m.data.resize(h.data);
      std::string message(h.message, '\0');
      for (auto* v : {&m.starts, &m.lengths, &m.block_counts, &m.tokens, &m.blocks}) {
        if (s.ok()) s = recv(v->data(), v->size() * sizeof(int32_t));
      }
      if (s.ok()) s = recv(message.data(), message.size());
      if (s.ok()) s = recv(m.data.data(), m.data.size() * sizeof(float));
      m.status = absl::Status(static_cast<absl::StatusCode>(h.code), message);
    }
    if (!s.ok()) {
      Break(s);
      return;
    }
    const bool last = m.op == StageOp::kShutdown;
    {
      std::lock_guard<std::mutex> lock(links_->mu);
      links_->inbox.push_back(std::move(m));
      links_->ended = last;
    }
    links_->cv.notify_all();
    // Nothing follows a shutdown but the link closing, which is not an error.
    if (last) return;
  }
}

namespace wire {

std::string RendezvousBlob(int32_t port, const std::string& check, const std::string& payload) {
  const uint32_t head[2] = {static_cast<uint32_t>(port), static_cast<uint32_t>(check.size())};
  std::string out(reinterpret_cast<const char*>(head), sizeof(head));
  return out + check + payload;
}

std::string LinkHelloBytes(int32_t rank, int32_t world_size) {
  const LinkHello h{kLinkMagic, kLinkVersion, rank, world_size};
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

absl::StatusOr<std::string> Frame(const StageMessage& m) {
  absl::StatusOr<std::string> out = FrameHead(m);
  if (out.ok()) {
    out->append(reinterpret_cast<const char*>(m.data.data()), m.data.size() * sizeof(float));
  }
  return out;
}

}  // namespace wire
}  // namespace ts::pipeline
