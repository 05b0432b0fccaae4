// The pipeline's TCP transport on loopback (engine/pipeline/tcp_transport.h): messages cross a
// ring of 2 and 3 ranks intact (every field, a payload large enough to need many sends), the
// rendezvous gives every rank every rank's blob, and each way a peer can misbehave ends in an
// error that names it instead of a hang: a rank that never comes, one with another plan, a peer
// that closes mid-message, one that stops mid-message, garbage, and a leader that goes away while
// a worker idles.
#include "engine/pipeline/tcp_transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <memory>
#include <thread>
#include <vector>

#include "engine/pipeline/bootstrap.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ts::pipeline {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

using TransportOr = absl::StatusOr<std::unique_ptr<TcpTransport>>;

// Starts rank 0 in a thread; returns its future once the bootstrap port is known.
struct Leader {
  std::future<TransportOr> transport;
  int32_t port = -1;
};
Leader StartLeader(int32_t world, std::chrono::milliseconds timeout, std::string check = "plan") {
  auto port = std::make_shared<std::promise<int32_t>>();
  std::future<int32_t> port_f = port->get_future();
  Leader l;
  l.transport = std::async(std::launch::async, [=] {
    return TcpTransport::Connect({.rank = 0,
                                  .world_size = world,
                                  .timeout = timeout,
                                  .check = check,
                                  .payload = "from the leader",
                                  .on_listening = [port](int32_t p) { port->set_value(p); }});
  });
  l.port = port_f.wait_for(10s) == std::future_status::ready ? port_f.get() : -1;
  return l;
}

std::future<TransportOr> StartFollower(int32_t rank, int32_t world, int32_t port,
                                       std::chrono::milliseconds timeout,
                                       std::string check = "plan") {
  return std::async(std::launch::async, [=] {
    return TcpTransport::Connect({.rank = rank,
                                  .world_size = world,
                                  .leader_port = port,
                                  .timeout = timeout,
                                  .check = check,
                                  .payload = "rank " + std::to_string(rank),
                                  .on_listening = {}});
  });
}

// A ring of `world` ranks on loopback, index = rank.
std::vector<std::unique_ptr<TcpTransport>> Ring(int32_t world) {
  Leader leader = StartLeader(world, 10s);
  EXPECT_GT(leader.port, 0);
  std::vector<std::future<TransportOr>> followers;
  for (int32_t r = 1; r < world; ++r)
    followers.push_back(StartFollower(r, world, leader.port, 10s));
  std::vector<std::unique_ptr<TcpTransport>> out;
  TransportOr t0 = leader.transport.get();
  EXPECT_TRUE(t0.ok()) << t0.status();
  out.push_back(t0.ok() ? *std::move(t0) : nullptr);
  for (auto& f : followers) {
    TransportOr t = f.get();
    EXPECT_TRUE(t.ok()) << t.status();
    out.push_back(t.ok() ? *std::move(t) : nullptr);
  }
  return out;
}

StageMessage Sample(uint64_t id, size_t floats) {
  StageMessage m;
  m.id = id;
  m.mode = LogitsMode::kLastPerChunk;
  const std::vector<int32_t> a = {5, 6, 7}, b = {9}, blocks_a = {3, 4}, blocks_b = {8};
  const std::vector<SeqChunk> chunks = {{.tokens = a, .start_pos = 16, .block_table = blocks_a},
                                        {.tokens = b, .start_pos = 0, .block_table = blocks_b}};
  PackChunks(chunks, &m);
  m.data.resize(floats);
  for (size_t i = 0; i < floats; ++i) m.data[i] = static_cast<float>(i) * 0.5f - 3.0f;
  return m;
}

void ExpectSame(const StageMessage& got, const StageMessage& want) {
  EXPECT_EQ(got.op, want.op);
  EXPECT_EQ(got.id, want.id);
  EXPECT_EQ(got.mode, want.mode);
  EXPECT_EQ(got.starts, want.starts);
  EXPECT_EQ(got.lengths, want.lengths);
  EXPECT_EQ(got.block_counts, want.block_counts);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.blocks, want.blocks);
  EXPECT_EQ(got.data, want.data);
  EXPECT_EQ(got.status, want.status);
}

TEST(TcpTransportTest, MessagesGoRoundARingIntact) {
  for (int32_t world : {2, 3}) {
    SCOPED_TRACE(world);
    std::vector<std::unique_ptr<TcpTransport>> ring = Ring(world);
    ASSERT_EQ(ring.size(), static_cast<size_t>(world));
    for (const auto& t : ring) ASSERT_NE(t, nullptr);
    for (int32_t r = 0; r < world; ++r) {
      EXPECT_EQ(ring[r]->rank(), r);
      EXPECT_EQ(ring[r]->payload(0), "from the leader");
      if (r > 0) {
        EXPECT_EQ(ring[0]->payload(r), "rank " + std::to_string(r));
      }
    }
    // 4M floats (16 MiB) need many partial sends and receives; a stage error travels as it is.
    std::vector<StageMessage> sent = {Sample(1, 1 << 22), Sample(2, 0), Sample(3, 7)};
    sent[2].status = absl::ResourceExhaustedError("stage 1: out of blocks");
    // The sender is not blocked by the ring being full: every rank's reader drains its link.
    for (const StageMessage& m : sent) ASSERT_TRUE(ring[0]->Send(m).ok());
    for (int32_t r = 1; r < world; ++r) {
      for (size_t k = 0; k < sent.size(); ++k) {
        StageMessage m;
        ASSERT_TRUE(ring[r]->Recv(&m, 10s).ok());
        ExpectSame(m, sent[k]);
        ASSERT_TRUE(ring[r]->Send(m).ok());
      }
    }
    for (const StageMessage& want : sent) {
      StageMessage m;
      ASSERT_TRUE(ring[0]->Recv(&m, 10s).ok());
      ExpectSame(m, want);
    }
    for (const auto& t : ring) EXPECT_TRUE(t->health().ok());
  }
}

TEST(TcpTransportTest, UnpackGivesBackTheChunks) {
  const StageMessage m = Sample(1, 0);
  std::vector<SeqChunk> chunks;
  ASSERT_TRUE(UnpackChunks(m, &chunks).ok());
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(std::vector<int32_t>(chunks[0].tokens.begin(), chunks[0].tokens.end()),
            std::vector<int32_t>({5, 6, 7}));
  EXPECT_EQ(chunks[0].start_pos, 16);
  EXPECT_EQ(std::vector<int32_t>(chunks[1].block_table.begin(), chunks[1].block_table.end()),
            std::vector<int32_t>({8}));
  StageMessage bad = m;
  bad.lengths[1] = 5;  // past the tokens
  EXPECT_FALSE(UnpackChunks(bad, &chunks).ok());
  bad = m;
  bad.tokens.push_back(1);  // one left over
  EXPECT_FALSE(UnpackChunks(bad, &chunks).ok());
}

TEST(TcpTransportTest, ARecvTimesOutAndTheLinkStaysUsable) {
  std::vector<std::unique_ptr<TcpTransport>> ring = Ring(2);
  ASSERT_NE(ring[1], nullptr);
  StageMessage m;
  const auto start = Clock::now();
  const absl::Status s = ring[1]->Recv(&m, 200ms);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("nothing from rank 0 within 200 ms"));
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_TRUE(ring[1]->health().ok());
  ASSERT_TRUE(ring[0]->Send(Sample(9, 3)).ok());
  ASSERT_TRUE(ring[1]->Recv(&m, 10s).ok());
  EXPECT_EQ(m.id, 9u);
}

TEST(TcpTransportTest, AWorkerIdlingLearnsTheLeaderIsGone) {
  std::vector<std::unique_ptr<TcpTransport>> ring = Ring(2);
  ASSERT_NE(ring[1], nullptr);
  auto idle = std::async(std::launch::async, [&] {
    StageMessage m;
    return ring[1]->Recv(&m, std::nullopt);  // no timeout: only the link ending stops it
  });
  ring[0].reset();
  ASSERT_EQ(idle.wait_for(10s), std::future_status::ready);
  const absl::Status s = idle.get();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank 0 closed the connection"));
  EXPECT_FALSE(ring[1]->Send(Sample(1, 1)).ok());  // broken for good
}

TEST(TcpTransportTest, AShutdownIsDeliveredBeforeTheLinkCloses) {
  std::vector<std::unique_ptr<TcpTransport>> ring = Ring(2);
  ASSERT_NE(ring[1], nullptr);
  StageMessage bye;
  bye.op = StageOp::kShutdown;
  ASSERT_TRUE(ring[0]->Send(bye).ok());
  ring[0].reset();
  StageMessage m;
  ASSERT_TRUE(ring[1]->Recv(&m, 10s).ok());
  EXPECT_EQ(m.op, StageOp::kShutdown);
  // The link ending after a shutdown is no failure.
  EXPECT_TRUE(ring[1]->health().ok());
}

TEST(TcpTransportTest, ARankThatNeverComesFailsStartupNamingIt) {
  Leader leader = StartLeader(3, 1500ms);
  auto one = StartFollower(1, 3, leader.port, 1500ms);
  const auto start = Clock::now();
  TransportOr t0 = leader.transport.get();
  ASSERT_FALSE(t0.ok());
  EXPECT_EQ(t0.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(t0.status().message()), HasSubstr("rank 2 never connected"));
  EXPECT_LT(Clock::now() - start, 10s);
  EXPECT_FALSE(one.get().ok());
}

TEST(TcpTransportTest, RanksWithAnotherPlanAreRefused) {
  Leader leader = StartLeader(2, 5s, "stages 0-1 2-3");
  auto one = StartFollower(1, 2, leader.port, 5s, "stages 0-2 3-3");
  TransportOr t0 = leader.transport.get();
  TransportOr t1 = one.get();
  ASSERT_FALSE(t0.ok());
  ASSERT_FALSE(t1.ok());
  EXPECT_EQ(t0.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(t0.status().message()), HasSubstr("rank 1 disagrees"));
  EXPECT_THAT(std::string(t1.status().message()), HasSubstr("rank 0 disagrees"));
}

// Rank 1 of 2 played by hand over raw sockets, so it can break the protocol.
class FakeRank1 {
 public:
  // Joins rank 0's rendezvous and links; false on failure (with a test failure recorded).
  bool Join(int32_t leader_port) {
    listener_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (bind(listener_, reinterpret_cast<sockaddr*>(&a), len) != 0 || listen(listener_, 1) != 0 ||
        getsockname(listener_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      ADD_FAILURE() << "listen";
      return false;
    }
    auto table = GatherBootstrap({.rank = 1, .world_size = 2, .port = leader_port, .timeout = 5s},
                                 wire::RendezvousBlob(ntohs(a.sin_port), "plan", ""));
    if (!table.ok()) {
      ADD_FAILURE() << table.status();
      return false;
    }
    int32_t port0 = 0;
    std::string check, payload;
    EXPECT_TRUE(wire::ParseRendezvousBlob((*table)[0].blob, &port0, &check, &payload));
    // Rank 0 connects to us first, then accepts our link.
    from0_ = accept(listener_, nullptr, nullptr);
    to0_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in b{};
    b.sin_family = AF_INET;
    b.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    b.sin_port = htons(static_cast<uint16_t>(port0));
    if (from0_ < 0 || connect(to0_, reinterpret_cast<sockaddr*>(&b), sizeof(b)) != 0) {
      ADD_FAILURE() << "link";
      return false;
    }
    return Write(wire::LinkHelloBytes(1, 2));
  }
  bool Write(const std::string& bytes) {
    return send(to0_, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
           static_cast<ssize_t>(bytes.size());
  }
  void CloseLink() {
    close(to0_);
    to0_ = -1;
  }
  ~FakeRank1() {
    for (int fd : {listener_, from0_, to0_}) {
      if (fd >= 0) close(fd);
    }
  }

 private:
  int listener_ = -1, from0_ = -1, to0_ = -1;
};

// Rank 0 of 2 (transport timeout `timeout`) against a FakeRank1 that has joined.
struct AgainstFake {
  std::unique_ptr<TcpTransport> rank0;
  FakeRank1 fake;
};
bool JoinFake(AgainstFake* s, std::chrono::milliseconds timeout) {
  Leader leader = StartLeader(2, timeout);
  if (leader.port <= 0 || !s->fake.Join(leader.port)) return false;
  TransportOr t = leader.transport.get();
  EXPECT_TRUE(t.ok()) << t.status();
  if (!t.ok()) return false;
  s->rank0 = *std::move(t);
  return true;
}

TEST(TcpTransportTest, APeerThatClosesMidMessageBreaksTheLink) {
  AgainstFake s;
  ASSERT_TRUE(JoinFake(&s, 5s));
  absl::StatusOr<std::string> frame = wire::Frame(Sample(4, 1000));
  ASSERT_TRUE(frame.ok());
  ASSERT_TRUE(s.fake.Write(frame->substr(0, frame->size() / 2)));
  s.fake.CloseLink();
  StageMessage m;
  const absl::Status r = s.rank0->Recv(&m, 5s);
  EXPECT_EQ(r.code(), absl::StatusCode::kUnavailable) << r;
  EXPECT_THAT(std::string(r.message()), HasSubstr("pipeline rank 0: rank 1 closed the connection"));
  EXPECT_EQ(s.rank0->health(), r);
  EXPECT_EQ(s.rank0->Send(Sample(5, 1)), r);
}

TEST(TcpTransportTest, APeerThatStopsMidMessageTimesOut) {
  AgainstFake s;
  ASSERT_TRUE(JoinFake(&s, 1s));
  absl::StatusOr<std::string> frame = wire::Frame(Sample(4, 1000));
  ASSERT_TRUE(frame.ok());
  ASSERT_TRUE(s.fake.Write(frame->substr(0, 100)));  // and then nothing, the link left open
  StageMessage m;
  const auto start = Clock::now();
  const absl::Status r = s.rank0->Recv(&m, 10s);
  EXPECT_EQ(r.code(), absl::StatusCode::kDeadlineExceeded) << r;
  EXPECT_THAT(std::string(r.message()), HasSubstr("rank 1 sent nothing in time"));
  EXPECT_LT(Clock::now() - start, 5s);
}

TEST(TcpTransportTest, GarbageIsAMalformedFrame) {
  AgainstFake s;
  ASSERT_TRUE(JoinFake(&s, 5s));
  ASSERT_TRUE(s.fake.Write(std::string(48, 'x')));
  StageMessage m;
  const absl::Status r = s.rank0->Recv(&m, 5s);
  EXPECT_EQ(r.code(), absl::StatusCode::kDataLoss) << r;
  EXPECT_THAT(std::string(r.message()), HasSubstr("rank 1 sent a malformed frame"));
}

TEST(TcpTransportTest, GatherGivesEveryRankEveryBlob) {
  auto port = std::make_shared<std::promise<int32_t>>();
  auto port_f = port->get_future();
  auto lead = std::async(std::launch::async, [&] {
    return GatherBootstrap({.rank = 0, .world_size = 3, .timeout = 5s}, "zero",
                           [port](int32_t p) { port->set_value(p); });
  });
  ASSERT_EQ(port_f.wait_for(10s), std::future_status::ready);
  const int32_t p = port_f.get();
  auto one = std::async(std::launch::async, [&] {
    return GatherBootstrap({.rank = 1, .world_size = 3, .port = p, .timeout = 5s}, "one");
  });
  auto two = std::async(std::launch::async, [&] {
    return GatherBootstrap({.rank = 2, .world_size = 3, .port = p, .timeout = 5s}, "two");
  });
  for (auto* f : {&lead, &one, &two}) {
    absl::StatusOr<std::vector<BootstrapPeer>> t = f->get();
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_EQ(t->size(), 3u);
    EXPECT_EQ((*t)[0].blob, "zero");
    EXPECT_EQ((*t)[1].blob, "one");
    EXPECT_EQ((*t)[2].blob, "two");
    EXPECT_EQ((*t)[1].host, "127.0.0.1");  // where rank 0 saw it connect from
    EXPECT_EQ((*t)[0].host, "127.0.0.1");
  }
}

}  // namespace
}  // namespace ts::pipeline
