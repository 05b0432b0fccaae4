// tailserve-client's argument helpers: a repeatable --stop taken out of argv before absl sees it,
// C escapes in stop strings, and comma-separated ids.
#include "bench/client/args.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ts::client {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// argv from literals; the strings must outlive the char* view.
struct Argv {
  explicit Argv(std::vector<std::string> a) : strings(std::move(a)) {
    for (std::string& s : strings) ptrs.push_back(s.data());
  }
  std::vector<std::string> Remaining() const { return {ptrs.begin(), ptrs.end()}; }
  std::vector<std::string> strings;
  std::vector<char*> ptrs;
};

TEST(TakeRepeatedFlagTest, TakesEveryFormInOrderAndLeavesTheRest) {
  Argv a({"client", "--stop=a", "--max_new_tokens", "5", "--stop", "b c", "-stop=", "-stop",
          "--stop_token_ids=3", "--stopx=1", "--", "--stop=after"});
  auto v = TakeRepeatedFlag(&a.ptrs, "stop");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_THAT(*v, ElementsAre("a", "b c", "", "--stop_token_ids=3"));
  EXPECT_THAT(a.Remaining(),
              ElementsAre("client", "--max_new_tokens", "5", "--stopx=1", "--", "--stop=after"));
}

TEST(TakeRepeatedFlagTest, TheProgramNameIsNeverAFlag) {
  Argv a({"--stop", "x"});
  auto v = TakeRepeatedFlag(&a.ptrs, "stop");
  ASSERT_TRUE(v.ok());
  EXPECT_TRUE(v->empty());
  EXPECT_THAT(a.Remaining(), ElementsAre("--stop", "x"));
}

TEST(TakeRepeatedFlagTest, AMissingValueNamesTheFlag) {
  Argv a({"client", "--stop=x", "--stop"});
  auto v = TakeRepeatedFlag(&a.ptrs, "stop");
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(v.status().message(), HasSubstr("--stop: missing a value"));
}

TEST(StopStringTest, DecodesEscapesAndRejectsEmptyOrBad) {
  EXPECT_EQ(*StopString("\\n\\n", "--stop"), "\n\n");
  EXPECT_EQ(*StopString("User:", "--stop"), "User:");
  EXPECT_EQ(*StopString("a\\\\b\\x41", "--stop"), "a\\bA");
  const auto empty = StopString("", "--stop");
  EXPECT_THAT(empty.status().message(), HasSubstr("--stop: must not be empty"));
  const auto bad = StopString("\\q", "--stop");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("--stop: '\\q'"));
}

TEST(ParseIdListTest, ParsesIdsAndNamesTheFlagOnErrors) {
  EXPECT_THAT(*ParseIdList("1,15, 27,,100", "--prompt"), ElementsAre(1, 15, 27, 100));
  EXPECT_TRUE(ParseIdList("", "--stop_token_ids")->empty());
  const auto bad = ParseIdList("1,x", "--stop_token_ids");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("--stop_token_ids: 'x' is not a token id"));
  EXPECT_FALSE(ParseIdList("99999999999", "--prompt").ok());
}

}  // namespace
}  // namespace ts::client
