// TextStream on the fixture tokenizer (tests/fixtures/tiny-gqa-untied: 256 byte tokens plus
// merges): deltas that never split a character and add up to the decoded text, and stop strings
// that end the text where a client reading the stream would see them first, even across tokens.
#include "models/tokenizer/text_stream.h"

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/tokenizer/utf8.h"
#include "tests/common/fixture_tokenizer.h"

namespace ts {
namespace {

class TextStreamTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { tok_ = testing::FixtureTokenizer(); }
  void SetUp() override { ASSERT_NE(tok_, nullptr); }
  static std::vector<int32_t> Ids(const std::string& text) {
    absl::StatusOr<std::vector<int32_t>> ids = tok_->Encode(text, false);
    EXPECT_TRUE(ids.ok()) << ids.status();
    return ids.ok() ? *ids : std::vector<int32_t>{};
  }
  struct Run {
    std::string text;     // every delta, plus Finish when no stop matched
    int stop_token = -1;  // index of the token whose delta carried the match
    int stop_index = -1;
    int deltas_after_stop = 0;
  };
  static Run Stream(const std::vector<int32_t>& ids, std::vector<std::string> stops,
                    int min_tokens = 0) {
    TextStream s(*tok_, std::move(stops));
    Run run;
    for (size_t i = 0; i < ids.size(); ++i) {
      TextStream::Delta d = s.Next(ids[i], static_cast<int>(i) + 1 >= min_tokens);
      EXPECT_TRUE(utf8::IsValid(d.text)) << "delta " << i;
      if (run.stop_token >= 0) {
        run.deltas_after_stop += !d.text.empty() || d.stop_index.has_value();
        continue;
      }
      run.text += d.text;
      if (d.stop_index) {
        run.stop_token = static_cast<int>(i);
        run.stop_index = static_cast<int>(*d.stop_index);
      }
    }
    if (run.stop_token < 0) run.text += s.Finish();
    return run;
  }
  static const Tokenizer* tok_;
};
const Tokenizer* TextStreamTest::tok_ = nullptr;

TEST_F(TextStreamTest, WithoutStopsTheDeltasAddUpToTheDecodedText) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    // Random ids are mostly lone bytes of multi-byte characters: the hard case for deltas.
    std::vector<int32_t> ids(1 + rng() % 40);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % tok_->vocab_size());
    const Run run = Stream(ids, {});
    EXPECT_EQ(run.text, tok_->Decode(ids, {.skip_special_tokens = false})) << "trial " << trial;
  }
}

TEST_F(TextStreamTest, AStopStringSpanningTokensEndsTheTextBeforeIt) {
  const std::string text = "the cat is on the mat. and then it ran";
  const std::vector<int32_t> ids = Ids(text);
  const Run run = Stream(ids, {"t. an"});
  EXPECT_EQ(run.text, "the cat is on the ma");
  EXPECT_EQ(run.stop_index, 0);
  // The match completes with the token holding "n" of "and": nothing is sent after it.
  EXPECT_EQ(run.stop_token, static_cast<int>(Ids("the cat is on the mat. an").size()) - 1);
  EXPECT_EQ(run.deltas_after_stop, 0);
  // More than one token makes up the stop string, so the test means what it says.
  EXPECT_GT(Ids("t. an").size(), 1u);
}

TEST_F(TextStreamTest, AStopStringInTheFirstTokenSendsNothing) {
  const std::vector<int32_t> ids = Ids("the cat");
  const Run run = Stream(ids, {"t"});  // "the" is "t" + "he"
  EXPECT_EQ(run.text, "");
  EXPECT_EQ(run.stop_token, 0);
}

TEST_F(TextStreamTest, OfSeveralStopsTheFirstToAppearWins) {
  const std::vector<int32_t> ids = Ids("the cat sat");
  EXPECT_EQ(Stream(ids, {"sat", "cat"}).text, "the ");
  EXPECT_EQ(Stream(ids, {"sat", "cat"}).stop_index, 1);
  // Both complete with the same token and start at the same place: the one listed first.
  EXPECT_EQ(Stream(ids, {"ca", "c"}).stop_index, 1);  // "c" completes a token earlier
  const Run tie = Stream(Ids("xy"), {"xy", "x"});
  EXPECT_EQ(tie.stop_index, 1);  // "x" is complete after the first byte token
  const Run same = Stream(Ids("qz"), {"qz", "qz"});
  EXPECT_EQ(same.stop_index, 0);
  EXPECT_EQ(Stream(ids, {"dog", "bird"}).text, "the cat sat");
}

TEST_F(TextStreamTest, APossibleStartIsHeldUntilItCannotMatch) {
  const std::vector<int32_t> ids = Ids("hello world? world!");
  TextStream s(*tok_, {"world!"});
  std::string sent;
  std::vector<std::string> seen;
  for (int32_t id : ids) {
    TextStream::Delta d = s.Next(id, true);
    sent += d.text;
    seen.push_back(sent);
    if (d.stop_index) break;
  }
  // "world" is never sent ahead of the "?" that rules the first one out.
  for (const std::string& prefix : seen) {
    if (prefix.find("world") != std::string::npos) {
      EXPECT_NE(prefix.find("world?"), std::string::npos) << prefix;
    }
  }
  EXPECT_EQ(sent, "hello world? ");
  EXPECT_TRUE(s.stopped());
  EXPECT_EQ(s.Finish(), "");
}

TEST_F(TextStreamTest, HeldTextComesOutAtTheEnd) {
  const Run run = Stream(Ids("it is over and"), {"and then"});
  EXPECT_EQ(run.stop_token, -1);
  EXPECT_EQ(run.text, "it is over and");
}

TEST_F(TextStreamTest, NoMatchBeforeMinTokens) {
  const std::vector<int32_t> ids = Ids("the cat. the dog.");
  ASSERT_GT(ids.size(), 4u);
  // With matching held off past the first period's token, that period goes out and the second
  // one stops the stream.
  const int first_dot = static_cast<int>(Ids("the cat.").size());
  const Run run = Stream(ids, {"."}, first_dot + 1);
  EXPECT_EQ(run.text, "the cat. the dog");
  EXPECT_EQ(Stream(ids, {"."}, 0).text, "the cat");
}

TEST_F(TextStreamTest, AMultiByteStopMatchesAcrossByteTokens) {
  const std::string text = "caf\xC3\xA9 au lait";  // é is two byte tokens here
  const std::vector<int32_t> ids = Ids(text);
  const Run run = Stream(ids, {"\xC3\xA9"});
  EXPECT_EQ(run.text, "caf");
  EXPECT_EQ(run.stop_token, 4);  // c a f, then the two bytes of é
}

// Against a reference that sees the whole text so far after every token: the first token after
// which some stop string occurs ends the stream at that occurrence's start.
TEST_F(TextStreamTest, MatchesTheWholeTextReferenceOnRandomText) {
  std::mt19937 rng(11);
  const std::vector<std::string> pieces = {"a",  "b",  "ab", "the", " ", "\xC3\xA9", "\xE2\x82\xAC",
                                           "\n", "ba", "cat"};
  int stopped = 0;
  for (int trial = 0; trial < 400; ++trial) {
    std::string text;
    for (int n = 1 + rng() % 30; n > 0; --n) text += pieces[rng() % pieces.size()];
    std::vector<std::string> stops;
    for (int n = 1 + rng() % 3; n > 0; --n) {
      std::string stop;
      for (int m = 1 + rng() % 3; m > 0; --m) stop += pieces[rng() % pieces.size()];
      stops.push_back(stop);
    }
    const std::vector<int32_t> ids = Ids(text);
    StreamDecoder decoder(*tok_);
    std::string so_far, want = text;
    int want_token = -1;
    for (size_t i = 0; i < ids.size() && want_token < 0; ++i) {
      so_far += decoder.Next(ids[i]);
      size_t best = std::string::npos;
      for (const std::string& s : stops) best = std::min(best, so_far.find(s));
      if (best != std::string::npos) {
        want = so_far.substr(0, best);
        want_token = static_cast<int>(i);
      }
    }
    const Run run = Stream(ids, stops);
    EXPECT_EQ(run.text, want) << "trial " << trial;
    EXPECT_EQ(run.stop_token, want_token) << "trial " << trial;
    stopped += want_token >= 0;
  }
  // Both outcomes are common, so neither branch of the reference goes untested.
  EXPECT_GT(stopped, 100);
  EXPECT_LT(stopped, 350);
}

}  // namespace
}  // namespace ts
