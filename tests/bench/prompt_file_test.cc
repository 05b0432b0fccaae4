// The --prompts_file parser: every accepted shape, the line numbers errors name, and entries that
// are skipped rather than fatal.
#include "bench/load/prompt_file.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ts::load {
namespace {

using ::testing::HasSubstr;

PromptFile Parse(absl::string_view content, absl::string_view path = "p.jsonl") {
  auto f = ParsePromptFile(content, path);
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? *f : PromptFile{};
}

// The error message of a file that must not parse.
std::string Error(absl::string_view content, absl::string_view path = "p.jsonl") {
  auto f = ParsePromptFile(content, path);
  EXPECT_FALSE(f.ok()) << "parsed: " << content;
  if (f.ok()) return "";
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(f.status().message());
}

std::vector<std::string> Texts(const PromptFile& f) {
  std::vector<std::string> out;
  for (const FilePrompt& p : f.prompts) out.push_back(p.text);
  return out;
}

TEST(PromptFileTest, JsonArrayOfStringsKeepsOrderEntriesAndLines) {
  const PromptFile f =
      Parse("[\n  \"first, \\\"quoted, [x]\\\" end\",\n\n  \"second\",\"third\"\n]", "p.json");
  EXPECT_THAT(Texts(f), ::testing::ElementsAre("first, \"quoted, [x]\" end", "second", "third"));
  ASSERT_EQ(f.prompts.size(), 3u);
  EXPECT_EQ(f.prompts[0].line, 2);
  EXPECT_EQ(f.prompts[1].line, 4);
  EXPECT_EQ(f.prompts[2].line, 4);
  EXPECT_EQ(f.prompts[2].entry, 2);
  EXPECT_EQ(f.entries, 3);
  EXPECT_TRUE(f.skipped.empty());
  EXPECT_FALSE(f.prompts[0].reply.has_value());
}

TEST(PromptFileTest, JsonlTakesEveryShapeAndSkipsBlankLines) {
  const std::string jsonl =
      "\"plain\"\r\n"
      "\n"
      "{\"prompt\": \"from prompt\", \"id\": 7}\n"
      "   \n"
      "{\"text\": \"from text\"}\n"
      "{\"id\": \"x\", \"conversations\": [{\"from\": \"system\", \"value\": \"be brief\"}, "
      "{\"from\": \"human\", \"value\": \"hi there\"}, {\"from\": \"gpt\", \"value\": \"hello!\"}, "
      "{\"from\": \"human\", \"value\": \"later\"}, {\"from\": \"gpt\", \"value\": \"no\"}]}\n"
      "{\"messages\": [{\"role\": \"system\", \"content\": \"sys\"}, {\"role\": \"user\", "
      "\"content\": [{\"type\": \"text\", \"text\": \"part one\"}, {\"type\": \"image_url\", "
      "\"image_url\": {}}, {\"type\": \"text\", \"text\": \"part two\"}]}, {\"role\": "
      "\"assistant\", \"content\": \"answer\"}]}\n"
      "{\"conversations\": [{\"from\": \"user\", \"value\": \"only a question\"}]}";
  const PromptFile f = Parse(jsonl);
  EXPECT_THAT(Texts(f), ::testing::ElementsAre("plain", "from prompt", "from text", "hi there",
                                               "part one\npart two", "only a question"));
  ASSERT_EQ(f.prompts.size(), 6u);
  EXPECT_EQ(f.prompts[1].line, 3);
  EXPECT_EQ(f.prompts[2].line, 5);
  EXPECT_EQ(f.prompts[5].line, 8);
  EXPECT_EQ(f.prompts[5].entry, 5);
  EXPECT_FALSE(f.prompts[1].reply.has_value());
  EXPECT_EQ(f.prompts[3].reply, "hello!");  // the first gpt turn after the human one
  EXPECT_EQ(f.prompts[4].reply, "answer");
  EXPECT_FALSE(f.prompts[5].reply.has_value());
}

TEST(PromptFileTest, TheReplyIsTheFirstAnswerAfterThePrompt) {
  // A gpt turn before the first human turn is not the reply; a system turn after it is skipped.
  const PromptFile f = Parse(
      "{\"conversations\": [{\"from\": \"gpt\", \"value\": \"greeting\"}, {\"from\": \"human\", "
      "\"value\": \"q\"}, {\"from\": \"system\", \"value\": \"s\"}, {\"from\": \"chatgpt\", "
      "\"value\": \"a\"}]}");
  ASSERT_EQ(f.prompts.size(), 1u);
  EXPECT_EQ(f.prompts[0].text, "q");
  EXPECT_EQ(f.prompts[0].reply, "a");
}

TEST(PromptFileTest, EntriesWithoutAPromptAreCountedNotFatal) {
  const PromptFile f = Parse(
      "{\"conversations\": []}\n"
      "\"ok\"\n"
      "\"\"\n"
      "{\"conversations\": [{\"from\": \"gpt\", \"value\": \"x\"}]}\n"
      "{\"messages\": [{\"role\": \"assistant\", \"content\": \"y\"}]}\n"
      "{\"prompt\": \"\"}\n",
      "data.jsonl");
  EXPECT_THAT(Texts(f), ::testing::ElementsAre("ok"));
  EXPECT_EQ(f.prompts[0].entry, 1);
  EXPECT_EQ(f.entries, 6);
  ASSERT_EQ(f.skipped.size(), 3u);
  EXPECT_EQ(f.skipped[0].reason, "conversation with no human turn");
  EXPECT_EQ(f.skipped[0].count, 2);
  EXPECT_EQ(f.skipped[0].first, "data.jsonl:1");
  EXPECT_EQ(f.skipped[1].reason, "empty prompt");
  EXPECT_EQ(f.skipped[1].count, 2);
  EXPECT_EQ(f.skipped[1].first, "data.jsonl:3");
  EXPECT_EQ(f.skipped[2].reason, "messages with no user message");
  EXPECT_EQ(f.skipped[2].count, 1);
}

TEST(PromptFileTest, AByteOrderMarkIsIgnored) {
  EXPECT_THAT(Texts(Parse("\xEF\xBB\xBF[\"a\"]", "p.json")), ::testing::ElementsAre("a"));
  EXPECT_THAT(Texts(Parse("\xEF\xBB\xBF\"b\"\n")), ::testing::ElementsAre("b"));
}

TEST(PromptFileTest, ErrorsNameTheFileTheLineAndTheProblem) {
  struct Case {
    const char* content;
    const char* path;
    std::vector<std::string> want;
  };
  const std::vector<Case> cases = {
      {"[\"a\",\n\"b\",\n  nope]", "p.json", {"p.json:3: invalid JSON", "syntax error"}},
      {"\"a\"\n{\"prompt\": \"b\"\n\"c\"", "p.jsonl", {"p.jsonl:2: invalid JSON", "one complete"}},
      {"\"a\"\n\"b\xff\"\n", "p.jsonl", {"p.jsonl:2: invalid JSON", "UTF-8"}},
      {"[\"a\",\n\n  3]", "p.json", {"p.json:3: entry is number; want a string or an object"}},
      {"[\"a\",\n {\"prompt\": \"p\", \"x\": [1, \"]\"],\n  \"y\": 2},\n {\"id\": 3}]",
       "p.json",
       {"p.json:4: object has no \"prompt\", \"text\"", "its keys: \"id\""}},
      {"{}", "p.jsonl", {"p.jsonl:1: object has no \"prompt\"", "its keys: none"}},
      {"{\"prompt\": \"a\", \"text\": \"b\"}",
       "p.jsonl",
       {"p.jsonl:1: object has \"prompt\" and \"text\"; give one"}},
      {"\"ok\"\n{\"prompt\": 5}", "p.jsonl", {"p.jsonl:2: \"prompt\" is number, want a string"}},
      {"{\"text\": null}", "p.jsonl", {"p.jsonl:1: \"text\" is null"}},
      {"{\"conversations\": {\"from\": \"human\"}}",
       "p.jsonl",
       {"p.jsonl:1: \"conversations\" is object, want an array"}},
      {"{\"conversations\": [{\"from\": \"human\", \"value\": \"q\"}, {\"value\": \"a\"}]}",
       "p.jsonl",
       {"p.jsonl:1: conversations[1] needs a string \"from\""}},
      {"{\"conversations\": [{\"from\": \"human\", \"value\": 1}]}",
       "p.jsonl",
       {"conversations[0].value is number, want a string"}},
      {"{\"conversations\": [\"hi\"]}", "p.jsonl", {"conversations[0] is string, want an object"}},
      {"{\"messages\": [{\"role\": \"user\"}]}", "p.jsonl", {"messages[0] has no \"content\""}},
      {"{\"messages\": [{\"role\": \"user\", \"content\": [\"x\"]}]}",
       "p.jsonl",
       {"messages[0].content[0] is string, want an object"}},
      {"{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\"}]}]}",
       "p.jsonl",
       {"messages[0].content[0] is a text part without a string \"text\""}},
      {"{\"prompt\": \"pretty-printed\",\n \"id\": 1}",
       "p.json",
       {"p.json:1: invalid JSON", "a JSON file must be one array"}},
      {"", "p.jsonl", {"p.jsonl: no prompts (the file is empty)"}},
      {" \n\t\n", "p.jsonl", {"p.jsonl: no prompts (the file is empty)"}},
      {"[]", "p.json", {"p.json: no prompts (the file holds no entries)"}},
      {"\"\"\n{\"conversations\": []}",
       "p.jsonl",
       {"p.jsonl: no usable prompt among 2 entries", "1 empty prompt (first at p.jsonl:1)",
        "1 conversation with no human turn (first at p.jsonl:2)"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.content);
    const std::string error = Error(c.content, c.path);
    for (const std::string& want : c.want) EXPECT_THAT(error, HasSubstr(want));
  }
}

TEST(PromptFileTest, ReadsAFileAndNamesOneThatIsMissing) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("ts_prompt_file_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "p.jsonl").string();
  std::ofstream(path) << "{\"prompt\": \"from disk\"}\n";
  auto f = ReadPromptFile(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_THAT(Texts(*f), ::testing::ElementsAre("from disk"));

  const auto missing = ReadPromptFile((dir / "missing.json").string());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.status().message(), HasSubstr("missing.json: No such file"));
  const auto directory = ReadPromptFile(dir.string());
  EXPECT_FALSE(directory.ok());
  EXPECT_THAT(directory.status().message(), HasSubstr(dir.string()));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace ts::load
