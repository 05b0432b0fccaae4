// Where a pipeline process sits: flags over TS_* over LeaderWorkerSet's LWS_* variables, and every
// bad value refused naming the flag or variable it came from.
#include "engine/pipeline/topology.h"

#include <map>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ts::pipeline {
namespace {

using ::testing::HasSubstr;

struct FakeEnv {
  std::map<std::string, std::string> vars;
  std::optional<std::string> operator()(const char* name) const {
    auto it = vars.find(name);
    return it == vars.end() ? std::nullopt : std::optional<std::string>(it->second);
  }
};

TEST(TopologyTest, NothingGivenIsOneProcess) {
  absl::StatusOr<Topology> t = ResolveTopology({}, FakeEnv{});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->rank, 0);
  EXPECT_EQ(t->world_size, 1);
  EXPECT_TRUE(t->leader_host.empty());
}

TEST(TopologyTest, ALeaderWorkerSetPodNeedsNoFlags) {
  const FakeEnv env{{{"LWS_WORKER_INDEX", "2"},
                     {"LWS_GROUP_SIZE", "4"},
                     {"LWS_LEADER_ADDRESS", "tailserve-0.tailserve.default"}}};
  absl::StatusOr<Topology> t = ResolveTopology({}, env);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->rank, 2);
  EXPECT_EQ(t->world_size, 4);
  EXPECT_EQ(t->leader_host, "tailserve-0.tailserve.default");
  EXPECT_EQ(t->leader_port, 29500);
  EXPECT_EQ(t->source,
            "rank from LWS_WORKER_INDEX, world size from LWS_GROUP_SIZE, leader from "
            "LWS_LEADER_ADDRESS");
}

TEST(TopologyTest, FlagsBeatTsVariablesWhichBeatLws) {
  const FakeEnv env{{{"LWS_WORKER_INDEX", "2"},
                     {"LWS_GROUP_SIZE", "4"},
                     {"LWS_LEADER_ADDRESS", "lws-leader"},
                     {"TS_WORLD_SIZE", "8"},
                     {"TS_LEADER_ADDRESS", "ts-leader:7000"}}};
  absl::StatusOr<Topology> t = ResolveTopology({.rank = 5}, env);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->rank, 5);
  EXPECT_EQ(t->world_size, 8);
  EXPECT_EQ(t->leader_host, "ts-leader");
  EXPECT_EQ(t->leader_port, 7000);
  t = ResolveTopology({.leader_address = "[fd00::7]:1234"}, env);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->rank, 2);  // LWS_WORKER_INDEX: no flag, no TS_RANK
  EXPECT_EQ(t->leader_host, "fd00::7");
  EXPECT_EQ(t->leader_port, 1234);
  t = ResolveTopology({.leader_address = "fd00::7"}, env);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->leader_host, "fd00::7");  // a bare IPv6 address: the default port
  EXPECT_EQ(t->leader_port, 29500);
}

TEST(TopologyTest, BadValuesNameWhereTheyCameFrom) {
  const auto message = [](const TopologyFlags& f, const FakeEnv& env) {
    absl::StatusOr<Topology> t = ResolveTopology(f, env);
    EXPECT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(t.status().message());
  };
  EXPECT_THAT(message({}, FakeEnv{{{"LWS_GROUP_SIZE", "four"}}}),
              HasSubstr("--world_size (from LWS_GROUP_SIZE=\"four\"): not a number"));
  EXPECT_THAT(message({}, FakeEnv{{{"LWS_GROUP_SIZE", "4"},
                                   {"LWS_WORKER_INDEX", "4"},
                                   {"LWS_LEADER_ADDRESS", "x"}}}),
              HasSubstr("--rank (from LWS_WORKER_INDEX): 4 is outside [0, 4) (world size from "
                        "LWS_GROUP_SIZE)"));
  EXPECT_THAT(message({.world_size = 2}, FakeEnv{}),
              HasSubstr("a world of 2 processes needs the leader's address"));
  EXPECT_THAT(message({.world_size = 0}, FakeEnv{}), HasSubstr("--world_size (from --world_size)"));
  EXPECT_THAT(message({.world_size = 2, .leader_address = "host:99999"}, FakeEnv{}),
              HasSubstr("the port must be a number in [1, 65535]"));
  EXPECT_THAT(message({.world_size = 2, .leader_address = "[::1"}, FakeEnv{}),
              HasSubstr("closing ]"));
  EXPECT_THAT(message({.world_size = 2, .leader_address = ":5"}, FakeEnv{}), HasSubstr("no host"));
}

}  // namespace
}  // namespace ts::pipeline
