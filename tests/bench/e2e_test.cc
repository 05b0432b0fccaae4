// tailserve-load against the real `tailserve` binary (CPU backend, tiny fixture): an open-loop run
// with warmup, then a closed-loop run; both must finish with exit 0, no failed request, one
// results.jsonl line per request at the pinned output length, a parseable summary.json and an
// HTML report with SVG charts.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/bench/subprocess.h"

namespace ts::load {
namespace {

namespace fs = std::filesystem;

constexpr int kRequests = 20;
constexpr int kOutputLen = 8;

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

class LoadE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_bin_ = Env("TS_SERVER_BIN");
    load_bin_ = Env("TS_LOAD_BIN");
    ASSERT_FALSE(server_bin_.empty()) << "TS_SERVER_BIN must name the tailserve binary";
    ASSERT_FALSE(load_bin_.empty()) << "TS_LOAD_BIN must name the tailserve-load binary";
    const fs::path model = fs::path(Env("TS_SOURCE_DIR")) / "tests/fixtures/tiny-gqa-untied";
    ASSERT_TRUE(fs::exists(model / "config.json")) << model;
    dir_ = fs::temp_directory_path() / ("ts_load_e2e_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    server_log_ = (dir_ / "server.log").string();
    server_pid_ = test::SpawnLogged({server_bin_, "--port", "0", "--backend", "cpu", "--model_dir",
                                     model.string(), "--threads", "1"},
                                    server_log_);
    ASSERT_GT(server_pid_, 0) << "could not start " << server_bin_;
    const std::string address = test::WaitForLine(
        server_pid_, server_log_, "tailserve listening on ", std::chrono::seconds(20));
    ASSERT_FALSE(address.empty()) << "server did not report its address:\n"
                                  << test::ReadFileOrEmpty(server_log_);
    const size_t colon = address.rfind(':');
    ASSERT_NE(colon, std::string::npos) << address;
    std::string host = address.substr(0, colon);
    if (host == "0.0.0.0" || host == "[::]" || host == "::") host = "127.0.0.1";
    target_ = host + ":" + address.substr(colon + 1);
  }

  void TearDown() override {
    if (server_pid_ > 0) {
      kill(server_pid_, SIGTERM);
      test::WaitExit(server_pid_, std::chrono::seconds(15));  // SIGKILL if it does not drain
    }
    if (!HasFailure()) fs::remove_all(dir_);
  }

  // Runs tailserve-load into out_dir and checks every artifact.
  void RunAndCheck(const std::string& name, std::vector<std::string> mode_flags) {
    SCOPED_TRACE(name);
    const fs::path out = dir_ / name;
    std::vector<std::string> argv = {load_bin_,
                                     "--target=" + target_,
                                     "--num_requests=" + std::to_string(kRequests),
                                     "--input_dist=uniform:4:24",
                                     "--output_len=" + std::to_string(kOutputLen),
                                     "--seed=3",
                                     "--request_timeout_s=60",
                                     "--out_dir=" + out.string()};
    argv.insert(argv.end(), mode_flags.begin(), mode_flags.end());
    const test::CommandResult run =
        test::RunCommand(argv, (dir_ / (name + ".log")).string(), std::chrono::seconds(90));
    ASSERT_EQ(run.exit_code, 0) << run.output << "\nserver log:\n"
                                << test::ReadFileOrEmpty(server_log_);
    EXPECT_NE(run.output.find("errors: none"), std::string::npos) << run.output;

    std::ifstream jsonl(out / "results.jsonl");
    int lines = 0;
    for (std::string line; std::getline(jsonl, line); ++lines) {
      const nlohmann::json r = nlohmann::json::parse(line);
      EXPECT_EQ(r["index"], lines);
      EXPECT_EQ(r["status"], "OK") << line;
      EXPECT_EQ(r["output_tokens"], kOutputLen) << line;
      EXPECT_EQ(r["requested_output_tokens"], kOutputLen);
      EXPECT_GE(r["input_tokens"].get<int>(), 4);
      EXPECT_LE(r["input_tokens"].get<int>(), 24);
      EXPECT_GE(r["ttft_ms"].get<double>(), 0.0);
      EXPECT_GE(r["e2e_ms"].get<double>(), r["ttft_ms"].get<double>());
      // The server's own account: inside the client's TTFT, which also holds the network.
      const nlohmann::json& t = r["server_timing"];
      ASSERT_TRUE(t.is_object()) << line;
      EXPECT_GE(t["queue_ms"].get<double>(), 0.0);
      EXPECT_EQ(t["prefill_wait_ms"].get<double>(), 0.0) << "the CPU backend starts at once";
      EXPECT_GT(t["decode_ms"].get<double>(), 0.0) << line;
      EXPECT_LE(t["preprocess_ms"].get<double>() + t["queue_ms"].get<double>() +
                    t["prefill_wait_ms"].get<double>() + t["prefill_ms"].get<double>(),
                r["ttft_ms"].get<double>())
          << line;
    }
    EXPECT_EQ(lines, kRequests);

    std::ifstream summary_file(out / "summary.json");
    const nlohmann::json summary = nlohmann::json::parse(summary_file, nullptr, false);
    ASSERT_FALSE(summary.is_discarded()) << "summary.json does not parse";
    const nlohmann::json& m = summary["metrics"];
    EXPECT_EQ(m["requests_total"], kRequests);
    EXPECT_EQ(m["requests_failed"], 0);
    EXPECT_EQ(m["output_len_mismatches"], 0);
    EXPECT_EQ(m["output_tokens"], kRequests * kOutputLen);
    EXPECT_TRUE(m["ttft_ms"]["p99"].is_number());
    EXPECT_EQ(m["server_ttft_ms"]["count"], kRequests);
    EXPECT_TRUE(m["tpot_ms"]["median"].is_number());
    EXPECT_GT(m["output_token_throughput_per_s"].get<double>(), 0.0);
    EXPECT_EQ(summary["model_info"]["backend"], "cpu");
    EXPECT_EQ(summary["model_info"]["vocab_size"], 311);  // the fixture's config.json
    EXPECT_EQ(summary["config"]["num_requests"], kRequests);
    // The server's counters over the measured phase alone: a step's tokens may fall on either side
    // of an edge, but not the warmup's or the run before this one (the closed run comes second).
    const nlohmann::json& c = summary["run"]["server_counters"];
    ASSERT_TRUE(c.is_object()) << summary["run"].dump();
    EXPECT_GT(c["steps"].get<uint64_t>(), 0u);
    EXPECT_GE(c["tokens_generated"].get<int>(), kRequests * kOutputLen - kRequests);
    EXPECT_LE(c["tokens_generated"].get<int>(), kRequests * kOutputLen + kRequests);
    EXPECT_EQ(c["mixed_steps"], 0) << "the CPU server decodes host-driven";
    EXPECT_EQ(c["loop_launches"], 0);
    EXPECT_NE(run.output.find("server during the run:"), std::string::npos) << run.output;

    std::ifstream html_file(out / "report.html");
    const std::string html((std::istreambuf_iterator<char>(html_file)),
                           std::istreambuf_iterator<char>());
    EXPECT_NE(html.find("<svg"), std::string::npos);
  }

  std::string server_bin_, load_bin_, server_log_, target_;
  fs::path dir_;
  pid_t server_pid_ = -1;
};

TEST_F(LoadE2eTest, OpenThenClosedLoopAgainstTheCpuServer) {
  RunAndCheck("open", {"--rate=20", "--warmup_requests=2"});
  RunAndCheck("closed", {"--concurrency=4"});
}

}  // namespace
}  // namespace ts::load
