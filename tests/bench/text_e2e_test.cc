// Text in and out through the real binaries: `tailserve` on the CPU backend, serving a fixture
// checkpoint beside a small tokenizer.json (tokenizer_model.h), driven by tailserve-client and
// tailserve-load. The client's printed text must equal the text of the ids it printed, by the
// server's Tokenize and by a tokenizer loaded here; a stop string must end the text before its
// first occurrence; the load report's input lengths must equal Tokenize's counts of the prompts
// each request names. Without a tokenizer, the text options fail at startup.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "models/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tailserve/v1/generation.grpc.pb.h"
#include "tests/bench/subprocess.h"
#include "tests/bench/tokenizer_model.h"

namespace ts::load {
namespace {

namespace fs = std::filesystem;
namespace v1 = ::tailserve::v1;
using ::testing::HasSubstr;

constexpr const char* kPrompt = "In the beginning";

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// What tailserve-client --show_ids prints: the text, a newline, "token_ids: ...", then the
// summary line (stderr, which the log interleaves after stdout's last flush).
struct ClientOutput {
  std::string text;
  std::vector<int32_t> ids;
  std::string summary;
};

ClientOutput ParseClientOutput(const std::string& out) {
  ClientOutput c;
  const std::string marker = "\ntoken_ids:";
  const size_t at = out.rfind(marker);
  if (at == std::string::npos) return c;
  c.text = out.substr(0, at);
  const size_t eol = out.find('\n', at + 1);
  for (absl::string_view part : absl::StrSplit(
           out.substr(at + marker.size(), eol - at - marker.size()), ' ', absl::SkipEmpty())) {
    int32_t id = 0;
    if (absl::SimpleAtoi(part, &id)) c.ids.push_back(id);
  }
  if (eol != std::string::npos) c.summary = out.substr(eol + 1);
  return c;
}

class TextE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_bin_ = Env("TS_SERVER_BIN");
    load_bin_ = Env("TS_LOAD_BIN");
    client_bin_ = Env("TS_CLIENT_BIN");
    ASSERT_FALSE(server_bin_.empty() || load_bin_.empty() || client_bin_.empty())
        << "TS_SERVER_BIN, TS_LOAD_BIN and TS_CLIENT_BIN must name the binaries";
    dir_ = fs::temp_directory_path() / ("ts_text_e2e_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }

  void TearDown() override {
    if (server_pid_ > 0) {
      kill(server_pid_, SIGTERM);
      test::WaitExit(server_pid_, std::chrono::seconds(15));  // SIGKILL if it does not drain
    }
    if (!HasFailure()) fs::remove_all(dir_);
  }

  // Starts tailserve on model_dir; sets target_ and stub_.
  void StartServer(const fs::path& model_dir) {
    server_log_ = (dir_ / "server.log").string();
    server_pid_ = test::SpawnLogged({server_bin_, "--port", "0", "--backend", "cpu", "--model_dir",
                                     model_dir.string(), "--threads", "1"},
                                    server_log_);
    ASSERT_GT(server_pid_, 0) << "could not start " << server_bin_;
    const std::string address = test::WaitForLine(
        server_pid_, server_log_, "tailserve listening on ", std::chrono::seconds(30));
    ASSERT_FALSE(address.empty()) << "server did not report its address:\n"
                                  << test::ReadFileOrEmpty(server_log_);
    const size_t colon = address.rfind(':');
    ASSERT_NE(colon, std::string::npos) << address;
    target_ = "127.0.0.1:" + address.substr(colon + 1, address.find(' ', colon) - colon - 1);
    stub_ =
        v1::Generation::NewStub(grpc::CreateChannel(target_, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    const grpc::Status s = stub_->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info_);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }

  // The fixture with a tokenizer beside it, served; tokenizer_ loads the same file here.
  void StartTextServer() {
    const fs::path model = dir_ / "model";
    const std::string made = test::MakeTokenizerModelDir(Fixture(), model);
    ASSERT_EQ(made, "");
    auto tok = ts::Tokenizer::Load(model.string());
    ASSERT_TRUE(tok.ok()) << tok.status();
    tokenizer_ = std::make_unique<ts::Tokenizer>(std::move(*tok));
    StartServer(model);
    ASSERT_TRUE(info_.has_tokenizer()) << "the server did not load " << model / "tokenizer.json"
                                       << "\n"
                                       << test::ReadFileOrEmpty(server_log_);
  }

  static fs::path Fixture() {
    return fs::path(Env("TS_SOURCE_DIR")) / "tests/fixtures/tiny-gqa-untied";
  }

  test::CommandResult Run(const std::string& bin, const std::string& name,
                          std::vector<std::string> flags) {
    flags.insert(flags.begin(), {bin, "--target=" + target_});
    return test::RunCommand(flags, (dir_ / (name + ".log")).string(), std::chrono::seconds(90));
  }

  // The server's Tokenize: text -> ids, or ids -> text.
  v1::TokenizeResponse Tokenize(const std::string& text, bool add_special) {
    v1::TokenizeRequest req;
    req.set_text(text);
    req.mutable_params()->set_add_special_tokens(add_special);
    return Call(req);
  }
  std::string Detokenize(const std::vector<int32_t>& ids) {
    v1::TokenizeRequest req;
    req.mutable_token_ids()->mutable_ids()->Assign(ids.begin(), ids.end());
    req.mutable_params()->set_skip_special_tokens(true);
    return Call(req).text();
  }
  v1::TokenizeResponse Call(const v1::TokenizeRequest& req) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::TokenizeResponse resp;
    const grpc::Status s = stub_->Tokenize(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
    return resp;
  }

  std::vector<int32_t> Encode(const std::string& text, bool add_special = true) {
    auto ids = tokenizer_->Encode(text, add_special);
    EXPECT_TRUE(ids.ok()) << ids.status();
    return ids.ok() ? *ids : std::vector<int32_t>{};
  }

  std::string server_bin_, load_bin_, client_bin_, server_log_, target_;
  fs::path dir_;
  pid_t server_pid_ = -1;
  std::unique_ptr<v1::Generation::Stub> stub_;
  v1::ModelInfo info_;
  std::unique_ptr<ts::Tokenizer> tokenizer_;
};

TEST_F(TextE2eTest, ClientPrintsTheTextOfTheIdsItStreams) {
  ASSERT_NO_FATAL_FAILURE(StartTextServer());
  const test::CommandResult run = Run(
      client_bin_, "client",
      {"--prompt_text", kPrompt, "--max_new_tokens=24", "--ignore_eos", "--show_ids", "--seed=7"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const ClientOutput out = ParseClientOutput(run.output);
  ASSERT_EQ(out.ids.size(), 24u) << run.output;
  EXPECT_EQ(out.text, Detokenize(out.ids));
  EXPECT_EQ(out.text, tokenizer_->Decode(out.ids, {.skip_special_tokens = true}));
  const std::vector<int32_t> prompt = Encode(kPrompt);
  EXPECT_EQ(Tokenize(kPrompt, true).count(), static_cast<int32_t>(prompt.size()));
  EXPECT_THAT(out.summary, HasSubstr("finish_reason: FINISH_REASON_LENGTH"));
  EXPECT_THAT(out.summary, HasSubstr("prompt_tokens: " + std::to_string(prompt.size()) + ","));
  EXPECT_THAT(out.summary, HasSubstr("completion_tokens: 24,"));
  EXPECT_THAT(out.summary, HasSubstr("seed: 7,"));
  EXPECT_THAT(out.summary, HasSubstr("ttft: "));
  EXPECT_THAT(out.summary, HasSubstr("(server: queue "));

  // --tokenize prints what the tokenizer makes of the text, ready for --prompt.
  const test::CommandResult tok = Run(client_bin_, "tokenize", {"--tokenize", kPrompt});
  ASSERT_EQ(tok.exit_code, 0) << tok.output;
  EXPECT_THAT(tok.output, HasSubstr(absl::StrJoin(prompt, ",") + "\n"));
  EXPECT_THAT(tok.output, HasSubstr(std::to_string(prompt.size()) + " tokens"));
  const test::CommandResult detok =
      Run(client_bin_, "detokenize", {"--detokenize", absl::StrJoin(out.ids, ",")});
  ASSERT_EQ(detok.exit_code, 0) << detok.output;
  EXPECT_EQ(detok.output, out.text + "\n");

  // The same prompt as ids gives the same continuation.
  const test::CommandResult ids =
      Run(client_bin_, "ids",
          {"--prompt", absl::StrJoin(prompt, ","), "--max_new_tokens=24", "--ignore_eos",
           "--show_ids", "--seed=7"});
  ASSERT_EQ(ids.exit_code, 0) << ids.output;
  EXPECT_EQ(ParseClientOutput(ids.output).text, out.text);
}

TEST_F(TextE2eTest, ClientStopStringEndsTheTextBeforeItsFirstMatch) {
  ASSERT_NO_FATAL_FAILURE(StartTextServer());
  const std::vector<std::string> base = {"--prompt_text", kPrompt, "--max_new_tokens=32",
                                         "--ignore_eos", "--show_ids"};
  const test::CommandResult full = Run(client_bin_, "full", base);
  ASSERT_EQ(full.exit_code, 0) << full.output;
  const std::string text = ParseClientOutput(full.output).text;
  ASSERT_GE(text.size(), 8u) << full.output;
  // Three characters from the middle; CEscape spells them for the client's --stop decoding.
  const std::string stop = text.substr(text.size() / 2, 3);
  std::vector<std::string> flags = base;
  flags.insert(flags.end(), {"--stop", absl::CEscape(stop), "--stop=zzzzzzzz"});
  const test::CommandResult stopped = Run(client_bin_, "stopped", flags);
  ASSERT_EQ(stopped.exit_code, 0) << stopped.output;
  const ClientOutput out = ParseClientOutput(stopped.output);
  EXPECT_EQ(out.text, text.substr(0, text.find(stop))) << "stop " << absl::CEscape(stop);
  EXPECT_THAT(out.summary, HasSubstr("finish_reason: FINISH_REASON_STOP_STRING"));
  EXPECT_THAT(out.summary, HasSubstr("matched_stop: \"" + absl::CHexEscape(stop) + "\""));

  // A server error comes back with its code and message, and a non-zero exit.
  std::vector<std::string> too_many = base;
  for (int i = 0; i <= info_.max_stop_strings(); ++i) {
    too_many.push_back("--stop=s" + std::to_string(i));
  }
  const test::CommandResult refused = Run(client_bin_, "refused", too_many);
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_THAT(refused.output, HasSubstr("Generate failed: INVALID_ARGUMENT (3): "));
  EXPECT_THAT(refused.output, HasSubstr("stop_strings"));
}

TEST_F(TextE2eTest, LoadReportsTheTokenizeCountOfEachRequestsPrompt) {
  ASSERT_NO_FATAL_FAILURE(StartTextServer());
  std::string too_long;
  for (int i = 0; i < info_.max_context(); ++i) too_long += " zq";
  // Entries: 0 string, 1 prompt object, 2 ShareGPT with a reply, 3 an empty conversation
  // (skipped), 4 too long for max_context (skipped), 5 messages, 6 a repeat of 0.
  const std::vector<std::string> texts = {
      "In the beginning", "it was the best of times", "and he said to them", "",
      too_long,           "from this day on",         "In the beginning"};
  const std::string reply = "that is a thing of the beginning";
  const nlohmann::json file = nlohmann::json::array(
      {texts[0],
       {{"prompt", texts[1]}, {"id", 1}},
       {{"conversations",
         {{{"from", "human"}, {"value", texts[2]}}, {{"from", "gpt"}, {"value", reply}}}}},
       {{"conversations", nlohmann::json::array()}},
       {{"text", texts[4]}},
       {{"messages", {{{"role", "user"}, {"content", texts[5]}}}}},
       texts[6]});
  const fs::path prompts = dir_ / "prompts.json";
  std::ofstream(prompts) << file.dump(2);
  const fs::path out = dir_ / "load";
  const test::CommandResult run =
      Run(load_bin_, "load",
          {"--prompts_file=" + prompts.string(), "--num_requests=15", "--concurrency=3", "--seed=4",
           "--request_timeout_s=60", "--out_dir=" + out.string()});
  ASSERT_EQ(run.exit_code, 0) << run.output << "\nserver log:\n"
                              << test::ReadFileOrEmpty(server_log_);
  EXPECT_THAT(run.output, HasSubstr("prompts: 5 of 7 entries"));
  EXPECT_THAT(run.output, HasSubstr("skipped 1 that do not fit max_context"));
  EXPECT_THAT(run.output, HasSubstr("errors: none"));

  std::map<int, int32_t> count;  // entry -> the server's Tokenize count
  for (int e : {0, 1, 2, 5, 6}) count[e] = Tokenize(texts[e], true).count();
  const int32_t reply_tokens = Tokenize(reply, false).count();
  std::ifstream jsonl(out / "results.jsonl");
  std::map<int, int> uses;
  int lines = 0;
  for (std::string line; std::getline(jsonl, line); ++lines) {
    SCOPED_TRACE(line);
    const nlohmann::json r = nlohmann::json::parse(line);
    EXPECT_EQ(r["status"], "OK");
    const int entry = r["prompt_entry"].get<int>();
    ASSERT_TRUE(count.count(entry)) << "entry " << entry << " should have been skipped";
    EXPECT_EQ(r["input_tokens"].get<int32_t>(), count[entry]);
    EXPECT_EQ(r["input_tokens"].get<int32_t>(), static_cast<int32_t>(Encode(texts[entry]).size()));
    EXPECT_EQ(r["usage_prompt_tokens"], r["input_tokens"]);  // the server's own count agrees
    EXPECT_EQ(r["output_tokens"], r["requested_output_tokens"]);
    EXPECT_EQ(r["requested_output_tokens"].get<int32_t>(), entry == 2 ? reply_tokens : 32);
    ++uses[entry];
  }
  EXPECT_EQ(lines, 15);
  for (const auto& [entry, n] : uses) EXPECT_EQ(n, 3) << "entry " << entry;  // 15 over 5 prompts

  std::ifstream summary_file(out / "summary.json");
  const nlohmann::json summary = nlohmann::json::parse(summary_file);
  EXPECT_EQ(summary["metrics"]["input_len_mismatches"], 0);
  EXPECT_EQ(summary["run"]["prompts"]["fit"]["skipped_too_long"], 1);
  EXPECT_EQ(summary["run"]["prompts"]["distinct_prompts"], 5);  // entry 6 repeats entry 0
  EXPECT_EQ(summary["config"]["prompt_source"], "file");

  // One fixed prompt, an explicit output length.
  const test::CommandResult one = Run(load_bin_, "one",
                                      {"--prompt_text=" + texts[1], "--num_requests=4",
                                       "--output_len=5", "--out_dir=" + (dir_ / "one").string()});
  ASSERT_EQ(one.exit_code, 0) << one.output;
  std::ifstream one_jsonl(dir_ / "one" / "results.jsonl");
  lines = 0;
  for (std::string line; std::getline(one_jsonl, line); ++lines) {
    const nlohmann::json r = nlohmann::json::parse(line);
    EXPECT_EQ(r["input_tokens"].get<int32_t>(), count[1]) << line;
    EXPECT_EQ(r["usage_prompt_tokens"].get<int32_t>(), count[1]) << line;
    EXPECT_EQ(r["output_tokens"], 5) << line;
  }
  EXPECT_EQ(lines, 4);
}

// The fixture's own tokenizer has all 256 bytes, so random ids decode to invalid UTF-8 too: the
// client must print the server's deltas (U+FFFD replacements included) as they are.
TEST_F(TextE2eTest, ClientPrintsTheFixturesByteLevelTextAsIs) {
  ASSERT_NO_FATAL_FAILURE(StartServer(Fixture()));
  ASSERT_TRUE(info_.has_tokenizer()) << test::ReadFileOrEmpty(server_log_);
  const test::CommandResult run =
      Run(client_bin_, "client",
          {"--prompt_text", kPrompt, "--max_new_tokens=40", "--ignore_eos", "--show_ids"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const ClientOutput out = ParseClientOutput(run.output);
  ASSERT_EQ(out.ids.size(), 40u) << run.output;
  EXPECT_EQ(out.text, Detokenize(out.ids));
}

TEST_F(TextE2eTest, WithoutATokenizerTextOptionsFailAtStartup) {
  const fs::path model = dir_ / "no-tokenizer";
  ASSERT_EQ(test::LinkCheckpoint(Fixture(), model), "");
  ASSERT_NO_FATAL_FAILURE(StartServer(model));
  ASSERT_FALSE(info_.has_tokenizer());
  const test::CommandResult client = Run(client_bin_, "client", {"--prompt_text", kPrompt});
  EXPECT_EQ(client.exit_code, 1) << client.output;
  EXPECT_THAT(client.output, HasSubstr("--prompt_text needs a tokenizer"));
  const test::CommandResult load =
      Run(load_bin_, "load", {"--prompt_text=hello", "--num_requests=1"});
  EXPECT_EQ(load.exit_code, 2) << load.output;
  EXPECT_THAT(load.output, HasSubstr("has no tokenizer"));
  // Ids still work, and print as ids.
  const test::CommandResult ids =
      Run(client_bin_, "ids", {"--prompt=1,15,27", "--max_new_tokens=3", "--ignore_eos"});
  EXPECT_EQ(ids.exit_code, 0) << ids.output;
  EXPECT_THAT(ids.output, HasSubstr("continuation: "));
  EXPECT_THAT(ids.output, HasSubstr("completion_tokens: 3,"));
}

}  // namespace
}  // namespace ts::load
