// tailserve-load's text path against an in-process fake server whose "tokenizer" counts words:
// prompts are counted once each before the run, too-long ones are skipped, replies set output
// lengths, request i gets the prompt the workload names, and the binary fails at startup on a
// server without a tokenizer or a bad file.
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/load/client.h"
#include "bench/load/text_source.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/bench/subprocess.h"

namespace ts::load {
namespace {

namespace v1 = ::tailserve::v1;
using ::testing::HasSubstr;

constexpr int32_t kMaxContext = 40;
constexpr int32_t kMaxNewTokens = 32;

// Words, plus one BOS when add_special_tokens (unset means true, as in the proto).
int32_t WordCount(const std::string& text, bool add_special) {
  std::vector<std::string> words = absl::StrSplit(text, ' ', absl::SkipWhitespace());
  return static_cast<int32_t>(words.size()) + (add_special ? 1 : 0);
}

class FakeTextServer final : public v1::Generation::Service {
 public:
  std::atomic<bool> has_tokenizer{true};

  grpc::Status GetModelInfo(grpc::ServerContext*, const v1::GetModelInfoRequest*,
                            v1::ModelInfo* info) override {
    info->set_model("fake-text");
    info->set_backend("fake");
    info->set_vocab_size(100);
    info->set_max_context(kMaxContext);
    info->set_max_new_tokens(kMaxNewTokens);
    info->set_has_tokenizer(has_tokenizer);
    return grpc::Status::OK;
  }

  grpc::Status Tokenize(grpc::ServerContext*, const v1::TokenizeRequest* req,
                        v1::TokenizeResponse* resp) override {
    if (!has_tokenizer) return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "no tokenizer");
    if (req->text().find("INVALID") != std::string::npos) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "text: not valid UTF-8");
    }
    const bool add = !req->params().has_add_special_tokens() || req->params().add_special_tokens();
    resp->set_count(WordCount(req->text(), add));
    std::lock_guard<std::mutex> lock(mu_);
    ++tokenize_calls_[req->text()];
    return grpc::Status::OK;
  }

  grpc::Status Generate(grpc::ServerContext*, const v1::GenerateRequest* req,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    if (req->prompt_case() != v1::GenerateRequest::kPromptText) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "expected prompt_text");
    }
    const bool add = !req->text().has_add_special_tokens() || req->text().add_special_tokens();
    {
      std::lock_guard<std::mutex> lock(mu_);
      prompts_[req->request_id()] = req->prompt_text();
    }
    v1::GenerateResponse msg;
    msg.set_request_id(req->request_id());
    for (int32_t k = 0; k < req->stop().max_new_tokens(); ++k) msg.add_token_ids(k);
    msg.set_finish_reason(v1::FINISH_REASON_LENGTH);
    msg.mutable_usage()->set_prompt_tokens(WordCount(req->prompt_text(), add));
    msg.mutable_usage()->set_completion_tokens(req->stop().max_new_tokens());
    writer->Write(msg);
    return grpc::Status::OK;
  }

  std::map<std::string, std::string> prompts() {
    std::lock_guard<std::mutex> lock(mu_);
    return prompts_;
  }
  std::map<std::string, int> tokenize_calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return tokenize_calls_;
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::string> prompts_;  // request_id -> prompt_text
  std::map<std::string, int> tokenize_calls_;   // text -> calls
};

std::string Words(int n, const std::string& word) {
  std::string s;
  for (int i = 0; i < n; ++i) s += (i ? " " : "") + word;
  return s;
}

class TextClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    dir_ =
        std::filesystem::temp_directory_path() / ("ts_text_client_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    // Entry 0: 3 words + BOS; 1: a repeat of 0; 2: a ShareGPT turn pair whose reply has 5 words;
    // 3: 50 words, over max_context; 4: an empty conversation (skipped by the parser);
    // 5: 7 words with a 40-word reply, capped to max_new_tokens.
    file_ = (dir_ / "prompts.jsonl").string();
    std::ofstream(file_) << "\"one two three\"\n"
                         << "{\"prompt\": \"one two three\"}\n"
                         << "{\"conversations\": [{\"from\": \"human\", \"value\": \"hi there\"}, "
                            "{\"from\": \"gpt\", \"value\": \"a b c d e\"}]}\n"
                         << "{\"text\": \"" << Words(50, "long") << "\"}\n"
                         << "{\"conversations\": []}\n"
                         << "{\"messages\": [{\"role\": \"user\", \"content\": \"" << Words(7, "q")
                         << "\"}, {\"role\": \"assistant\", \"content\": \"" << Words(40, "r")
                         << "\"}]}\n";
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    std::filesystem::remove_all(dir_);
  }

  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }

  LoadOptions Options() const {
    LoadOptions o;
    o.target = target();
    o.seed = 5;
    o.prompts_file = file_;
    o.num_requests = 8;
    o.concurrency = 2;
    return o;
  }

  test::CommandResult RunBinary(std::vector<std::string> flags) {
    const char* bin = std::getenv("TS_LOAD_BIN");
    EXPECT_NE(bin, nullptr) << "TS_LOAD_BIN must name the tailserve-load binary";
    flags.insert(flags.begin(), bin ? bin : "/nonexistent");
    return test::RunCommand(flags, (dir_ / "log.txt").string(), std::chrono::seconds(60));
  }

  FakeTextServer service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::filesystem::path dir_;
  std::string file_;
};

TEST_F(TextClientTest, CountsOncePerPromptFitsAndSendsTheNamedPrompt) {
  const LoadOptions o = Options();
  auto client = LoadClient::Connect(o);
  ASSERT_TRUE(client.ok()) << client.status();
  auto info = (*client)->GetModelInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  auto source = LoadTextSource(**client, o, *info);
  ASSERT_TRUE(source.ok()) << source.status();

  // Each distinct text was counted exactly once (the repeated prompt too).
  const auto calls = service_.tokenize_calls();
  EXPECT_EQ(calls.at("one two three"), 1);
  EXPECT_EQ(calls.at("a b c d e"), 1);  // the reply
  EXPECT_EQ(calls.size(), 6u);          // 4 distinct prompts (one too long) and 2 replies

  const TextPromptSet& set = *source->prompts;
  ASSERT_EQ(set.prompts.size(), 4u);  // the long one is skipped, the empty one never parsed
  std::map<int64_t, TextPrompt> by_entry;
  for (const TextPrompt& p : set.prompts) by_entry[p.entry] = p;
  ASSERT_EQ(by_entry.size(), 4u);
  EXPECT_EQ(by_entry.at(0).input_tokens, 4);
  EXPECT_EQ(by_entry.at(0).reply_tokens, -1);
  EXPECT_EQ(by_entry.at(2).input_tokens, 3);
  EXPECT_EQ(by_entry.at(2).reply_tokens, 5);  // counted without BOS
  EXPECT_EQ(by_entry.at(5).reply_tokens, kMaxNewTokens);
  EXPECT_FALSE(by_entry.count(3));
  EXPECT_EQ(source->facts["fit"]["skipped_too_long"], 1);
  EXPECT_EQ(source->facts["fit"]["replies_capped"], 1);
  EXPECT_EQ(source->facts["skipped_entries"]["conversation with no human turn"], 1);
  EXPECT_EQ(source->facts["entries"], 6);
  const std::string notes = absl::StrJoin(source->notes, "\n");
  EXPECT_THAT(notes, HasSubstr("skipped 1 that do not fit max_context 40"));
  EXPECT_THAT(notes, HasSubstr("(first at " + file_ + ":4, 51 prompt tokens)"));

  WorkloadOptions workload{.seed = o.seed,
                           .output = o.output,
                           .max_context = info->max_context(),
                           .max_new_tokens = info->max_new_tokens(),
                           .text = source->prompts};
  auto result = (*client)->Run(workload);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->records.size(), 8u);
  const auto sent = service_.prompts();
  std::map<int64_t, int> uses;
  for (const RequestRecord& r : result->records) {
    SCOPED_TRACE(r.request_id);
    ASSERT_TRUE(r.ok()) << r.status_message;
    const RequestSpec spec = MakeRequestSpec(workload, static_cast<uint64_t>(r.index));
    EXPECT_EQ(sent.at(r.request_id), by_entry.at(r.prompt_entry).text);
    EXPECT_EQ(spec.prompt_entry, r.prompt_entry);
    EXPECT_EQ(r.input_tokens, by_entry.at(r.prompt_entry).input_tokens);
    EXPECT_EQ(r.usage_prompt_tokens, r.input_tokens);
    EXPECT_EQ(r.OutputTokens(), r.requested_output_tokens);
    if (r.prompt_entry == 2) {
      EXPECT_EQ(r.requested_output_tokens, 5);
    }
    if (r.prompt_entry == 0) {
      EXPECT_EQ(r.requested_output_tokens, 32);  // --output_len default
    }
    ++uses[r.prompt_entry];
  }
  // 8 requests over 4 prompts in a permutation: each prompt twice.
  for (const auto& [entry, n] : uses) EXPECT_EQ(n, 2) << "entry " << entry;
  EXPECT_EQ(ComputeRunMetrics(result->records).input_len_mismatches, 0);
}

TEST_F(TextClientTest, AnExplicitOutputLengthOverridesReplies) {
  LoadOptions o = Options();
  o.output = {LengthDist::Kind::kFixed, 3, 0};
  o.output_len_set = true;
  auto client = LoadClient::Connect(o);
  ASSERT_TRUE(client.ok());
  auto info = (*client)->GetModelInfo();
  ASSERT_TRUE(info.ok());
  auto source = LoadTextSource(**client, o, *info);
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_EQ(service_.tokenize_calls().count("a b c d e"), 0u);  // replies are not even counted
  EXPECT_FALSE(source->prompts->output_from_reply);
  const WorkloadOptions workload{.seed = o.seed,
                                 .output = o.output,
                                 .max_context = kMaxContext,
                                 .max_new_tokens = kMaxNewTokens,
                                 .text = source->prompts};
  for (uint64_t i = 0; i < 8; ++i) EXPECT_EQ(MakeRequestSpec(workload, i).output_len, 3);
}

TEST_F(TextClientTest, TokenizeErrorsNameThePrompt) {
  std::ofstream(file_, std::ios::app) << "\"an INVALID one\"\n";
  const LoadOptions o = Options();
  auto client = LoadClient::Connect(o);
  ASSERT_TRUE(client.ok());
  auto info = (*client)->GetModelInfo();
  ASSERT_TRUE(info.ok());
  auto source = LoadTextSource(**client, o, *info);
  ASSERT_FALSE(source.ok());
  EXPECT_EQ(source.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(source.status().message(), HasSubstr(file_ + ":7 (entry 6)"));
  EXPECT_THAT(source.status().message(), HasSubstr("INVALID_ARGUMENT: text: not valid UTF-8"));
}

TEST_F(TextClientTest, TheBinaryWritesCountsAndFailsAtStartupOnBadInput) {
  const std::string out = (dir_ / "run").string();
  const std::vector<std::string> base = {"--target=" + target(), "--num_requests=6",
                                         "--concurrency=2"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> f = base;
    f.insert(f.end(), extra.begin(), extra.end());
    return f;
  };
  const test::CommandResult ok = RunBinary(with({"--prompts_file=" + file_, "--out_dir=" + out}));
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_THAT(ok.output, HasSubstr("prompts: 4 of 6 entries of " + file_));
  std::ifstream jsonl(out + "/results.jsonl");
  int lines = 0;
  for (std::string line; std::getline(jsonl, line); ++lines) {
    const nlohmann::json r = nlohmann::json::parse(line);
    EXPECT_GE(r["prompt_entry"].get<int>(), 0) << line;
    EXPECT_EQ(r["input_tokens"], r["usage_prompt_tokens"]) << line;
  }
  EXPECT_EQ(lines, 6);
  std::ifstream summary_file(out + "/summary.json");
  const nlohmann::json summary = nlohmann::json::parse(summary_file);
  EXPECT_EQ(summary["config"]["prompt_source"], "file");
  EXPECT_EQ(summary["run"]["prompts"]["used"], 4);
  EXPECT_EQ(summary["metrics"]["input_len_mismatches"], 0);

  const test::CommandResult one = RunBinary(with({"--prompt_text=hello world"}));
  EXPECT_EQ(one.exit_code, 0) << one.output;
  int hello = 0;
  for (const auto& [id, text] : service_.prompts()) hello += text == "hello world";
  EXPECT_EQ(hello, 6);

  const test::CommandResult both = RunBinary(with({"--prompts_file=" + file_, "--prompt_text=x"}));
  EXPECT_EQ(both.exit_code, 2) << both.output;
  EXPECT_THAT(both.output, HasSubstr("--prompts_file and --prompt_text: choose one"));
  const test::CommandResult input_len = RunBinary(with({"--prompt_text=x", "--input_len=4"}));
  EXPECT_EQ(input_len.exit_code, 2) << input_len.output;
  EXPECT_THAT(input_len.output, HasSubstr("--input_len / --input_dist"));

  const std::string bad = (dir_ / "bad.jsonl").string();
  std::ofstream(bad) << "\"fine\"\n{\"prompt\": 3}\n";
  const test::CommandResult bad_file = RunBinary(with({"--prompts_file=" + bad}));
  EXPECT_EQ(bad_file.exit_code, 2) << bad_file.output;
  EXPECT_THAT(bad_file.output, HasSubstr("--prompts_file: " + bad + ":2: \"prompt\" is number"));

  service_.has_tokenizer = false;
  const test::CommandResult no_tok = RunBinary(with({"--prompt_text=hello"}));
  EXPECT_EQ(no_tok.exit_code, 2) << no_tok.output;
  EXPECT_THAT(no_tok.output, HasSubstr("--prompt_text: the server's model (fake-text) has no "
                                       "tokenizer"));
}

}  // namespace
}  // namespace ts::load
