// tailserve-load: drives a tailserve server with synthetic streaming requests and reports TTFT,
// TPOT, ITL and end-to-end latency. See docs/load-client.md.
//
// Exit codes: 0 run completed with no failed request (or --allow_errors); 1 some requests failed;
// 2 bad flags; 3 cannot reach the server or fetch ModelInfo; 4 cannot write --out_dir;
// 5 the run itself broke; 130 interrupted (SIGINT/SIGTERM; partial results are still written).
#include <csignal>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "bench/load/client.h"
#include "bench/load/options.h"
#include "bench/load/report.h"
#include "bench/load/stats.h"
#include "bench/load/text_source.h"
#include "bench/load/workload.h"
#include "common/flags.h"

ABSL_FLAG(std::string, target, "localhost:50051", "host:port of the tailserve server");
ABSL_FLAG(std::string, rate, "",
          "open loop: Poisson arrivals at this many requests/s ('inf' = all at once). Latency is "
          "measured from each request's intended send time. Mutually exclusive with --concurrency");
ABSL_FLAG(int32_t, concurrency, 0,
          "closed loop: keep this many requests in flight (default 1 when --rate is not set)");
ABSL_FLAG(int64_t, num_requests, 0, "measured requests to send (0 = bounded by --duration_s only)");
ABSL_FLAG(double, duration_s, 0, "stop sending after this many seconds (0 = no time bound)");
ABSL_FLAG(int64_t, warmup_requests, 0, "requests sent before the measured run, not recorded");
ABSL_FLAG(uint64_t, seed, 0,
          "seeds arrivals, lengths, prompt ids, the order of file prompts and per-request "
          "sampling seeds");
ABSL_FLAG(std::optional<int32_t>, input_len, std::nullopt,
          "random prompts' length in tokens (default 32; shorthand for --input_dist=fixed:N)");
ABSL_FLAG(std::optional<int32_t>, output_len, std::nullopt,
          "output length (default 32; shorthand for --output_dist=fixed:N). Given (or "
          "--output_dist), it overrides the replies of a --prompts_file");
ABSL_FLAG(std::string, input_dist, "",
          "random prompts' length distribution: fixed:N | uniform:MIN:MAX | normal:MEAN:STD "
          "(overrides --input_len)");
ABSL_FLAG(std::string, output_dist, "", "output length distribution, as --input_dist");
ABSL_FLAG(std::string, prompts_file, "",
          "send text prompts from this file instead of random ids (the server needs a tokenizer). "
          "JSON (an array) or JSONL (one entry a line); an entry is a string, "
          "{\"prompt\": ...}, {\"text\": ...}, ShareGPT's {\"conversations\": [{\"from\": "
          "\"human\", \"value\": ...}, {\"from\": \"gpt\", ...}]} or OpenAI's "
          "{\"messages\": [{\"role\": \"user\", \"content\": ...}, ...]}. The first human/user "
          "turn is the prompt, as raw text (no chat template); the reply after it sets the output "
          "length (its token count) unless --output_len/--output_dist is given. Entries without a "
          "prompt and prompts that do not fit max_context with their output are skipped (counted)");
ABSL_FLAG(std::string, prompt_text, "", "send this one text prompt in every request");
ABSL_FLAG(bool, shuffle_prompts, true,
          "take the --prompts_file prompts in an order shuffled by --seed (false: file order); "
          "request i uses prompt i mod N of that order");
ABSL_FLAG(bool, add_special_tokens, true,
          "text prompts: let the tokenizer add its special tokens (BOS); also how they are "
          "counted");
ABSL_FLAG(double, temperature, 0.0, "sampling temperature (0 = greedy)");
ABSL_FLAG(std::optional<int32_t>, top_k, std::nullopt, "top_k passed to the server");
ABSL_FLAG(std::optional<double>, top_p, std::nullopt, "top_p passed to the server");
ABSL_FLAG(std::optional<double>, min_p, std::nullopt, "min_p passed to the server");
ABSL_FLAG(std::optional<double>, repetition_penalty, std::nullopt, "passed to the server");
ABSL_FLAG(std::optional<double>, presence_penalty, std::nullopt, "passed to the server");
ABSL_FLAG(std::optional<double>, frequency_penalty, std::nullopt, "passed to the server");
ABSL_FLAG(bool, send_seed, true,
          "send a per-request sampling seed derived from --seed (false: the server draws one)");
ABSL_FLAG(double, connect_timeout_s, 10,
          "time allowed to connect and fetch ModelInfo, and for each Tokenize call that counts "
          "a text prompt");
ABSL_FLAG(double, request_timeout_s, 0, "per-request gRPC deadline (0 = none)");
ABSL_FLAG(double, drain_timeout_s, 60,
          "after sending stops, wait this long for in-flight requests, then cancel them");
ABSL_FLAG(int32_t, channels, 1, "gRPC connections to open; requests round-robin over them");
ABSL_FLAG(std::string, out_dir, "",
          "write results.jsonl, summary.json and report.html here (empty = stdout only)");
ABSL_FLAG(bool, allow_errors, false, "exit 0 even when some requests failed");

namespace ts::load {
namespace {

enum ExitCode {
  kOk = 0,
  kRequestErrors = 1,
  kBadFlags = 2,
  kNoServer = 3,
  kNoOutput = 4,
  kRunFailed = 5,
  kInterrupted = 130
};

constexpr int32_t kDefaultLength = 32;  // --input_len and --output_len

int Fail(int code, const absl::Status& status) {
  std::fprintf(stderr, "tailserve-load: %s\n", std::string(status.message()).c_str());
  return code;
}

absl::StatusOr<LengthDist> LengthFlag(const std::string& dist_flag, std::optional<int32_t> len,
                                      const char* dist_name, const char* len_name) {
  if (!dist_flag.empty()) return ParseLengthDist(dist_flag, dist_name);
  const int32_t n = len.value_or(kDefaultLength);
  if (n < 1) return absl::InvalidArgumentError(absl::StrCat(len_name, ": must be >= 1"));
  return LengthDist{LengthDist::Kind::kFixed, static_cast<double>(n), 0};
}

template <typename To, typename From>
std::optional<To> Narrow(const std::optional<From>& v) {
  return v ? std::optional<To>(static_cast<To>(*v)) : std::nullopt;
}

absl::StatusOr<LoadOptions> OptionsFromFlags() {
  LoadOptions o;
  o.target = absl::GetFlag(FLAGS_target);
  const std::string rate = absl::GetFlag(FLAGS_rate);
  const int32_t concurrency = absl::GetFlag(FLAGS_concurrency);
  if (!rate.empty()) {
    if (concurrency != 0) {
      return absl::InvalidArgumentError(
          "--rate and --concurrency: choose one (open loop or closed loop)");
    }
    o.mode = LoopMode::kOpen;
    if (rate == "inf") {
      o.rate_per_s = std::numeric_limits<double>::infinity();
    } else if (!absl::SimpleAtod(rate, &o.rate_per_s)) {
      return absl::InvalidArgumentError(absl::StrCat("--rate: '", rate, "' is not a number"));
    }
  } else {
    o.mode = LoopMode::kClosed;
    o.concurrency = concurrency == 0 ? 1 : concurrency;
  }
  o.num_requests = absl::GetFlag(FLAGS_num_requests);
  o.duration_s = absl::GetFlag(FLAGS_duration_s);
  o.warmup_requests = absl::GetFlag(FLAGS_warmup_requests);
  o.seed = absl::GetFlag(FLAGS_seed);
  auto input = LengthFlag(absl::GetFlag(FLAGS_input_dist), absl::GetFlag(FLAGS_input_len),
                          "--input_dist", "--input_len");
  if (!input.ok()) return input.status();
  auto output = LengthFlag(absl::GetFlag(FLAGS_output_dist), absl::GetFlag(FLAGS_output_len),
                           "--output_dist", "--output_len");
  if (!output.ok()) return output.status();
  o.input = *input;
  o.output = *output;
  o.input_len_set = absl::GetFlag(FLAGS_input_len) || !absl::GetFlag(FLAGS_input_dist).empty();
  o.output_len_set = absl::GetFlag(FLAGS_output_len) || !absl::GetFlag(FLAGS_output_dist).empty();
  o.prompts_file = absl::GetFlag(FLAGS_prompts_file);
  o.prompt_text = absl::GetFlag(FLAGS_prompt_text);
  o.shuffle_prompts = absl::GetFlag(FLAGS_shuffle_prompts);
  o.add_special_tokens = absl::GetFlag(FLAGS_add_special_tokens);
  o.sampling.temperature = static_cast<float>(absl::GetFlag(FLAGS_temperature));
  o.sampling.top_k = absl::GetFlag(FLAGS_top_k);
  o.sampling.top_p = Narrow<float>(absl::GetFlag(FLAGS_top_p));
  o.sampling.min_p = Narrow<float>(absl::GetFlag(FLAGS_min_p));
  o.sampling.repetition_penalty = Narrow<float>(absl::GetFlag(FLAGS_repetition_penalty));
  o.sampling.presence_penalty = Narrow<float>(absl::GetFlag(FLAGS_presence_penalty));
  o.sampling.frequency_penalty = Narrow<float>(absl::GetFlag(FLAGS_frequency_penalty));
  o.sampling.send_seed = absl::GetFlag(FLAGS_send_seed);
  o.connect_timeout_s = absl::GetFlag(FLAGS_connect_timeout_s);
  o.request_timeout_s = absl::GetFlag(FLAGS_request_timeout_s);
  o.drain_timeout_s = absl::GetFlag(FLAGS_drain_timeout_s);
  o.channels = absl::GetFlag(FLAGS_channels);
  o.out_dir = absl::GetFlag(FLAGS_out_dir);
  o.allow_errors = absl::GetFlag(FLAGS_allow_errors);
  if (auto s = ValidateOptions(o); !s.ok()) return s;
  return o;
}

void OnSignal(int) {
  RequestStop();
}

int Main(int argc, char** argv) {
  const std::vector<char*> rest = ParseFlags(
      argc, argv,
      "load-tests a tailserve server.\n  open loop:   tailserve-load --target=HOST:PORT --rate=20 "
      "--num_requests=200\n  closed loop: tailserve-load --target=HOST:PORT --concurrency=8 "
      "--duration_s=60\n  text prompts: tailserve-load --target=HOST:PORT "
      "--prompts_file=sharegpt.json "
      "--rate=10 --num_requests=500\nSee docs/load-client.md.",
      "bench/load/");
  if (rest.size() > 1) {
    return Fail(kBadFlags, absl::InvalidArgumentError(
                               absl::StrCat("unexpected argument '", rest[1], "' (flags only)")));
  }
  auto options = OptionsFromFlags();
  if (!options.ok()) return Fail(kBadFlags, options.status());

  auto client = LoadClient::Connect(*options);
  if (!client.ok()) return Fail(kNoServer, client.status());
  auto info = (*client)->GetModelInfo();
  if (!info.ok()) return Fail(kNoServer, info.status());

  WorkloadOptions workload{.seed = options->seed,
                           .input = options->input,
                           .output = options->output,
                           .vocab_size = info->vocab_size(),
                           .max_context = info->max_context(),
                           .max_new_tokens = info->max_new_tokens()};
  nlohmann::json prompt_facts = {{"source", PromptSource(*options)}};
  if (PromptSource(*options) != "random") {
    auto text = LoadTextSource(**client, *options, *info);
    if (!text.ok()) {
      return Fail(text.status().code() == absl::StatusCode::kUnavailable ? kNoServer : kBadFlags,
                  text.status());
    }
    for (const std::string& note : text->notes) std::printf("tailserve-load: %s\n", note.c_str());
    workload.text = text->prompts;
    prompt_facts = text->facts;
  }
  if (auto s = CheckWorkloadFits(workload); !s.ok()) return Fail(kBadFlags, s);

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  std::printf("tailserve-load: %s loop against %s (model %s, backend %s, vocab %d)\n",
              ModeName(options->mode).c_str(), options->target.c_str(), info->model().c_str(),
              info->backend().c_str(), info->vocab_size());
  std::fflush(stdout);
  auto result = (*client)->Run(workload);
  if (!result.ok()) return Fail(kRunFailed, result.status());

  const RunMetrics metrics = ComputeRunMetrics(result->records);
  const std::string headline =
      options->mode == LoopMode::kOpen
          ? absl::StrCat("open loop, rate ", options->rate_per_s, " req/s, seed ", options->seed)
          : absl::StrCat("closed loop, concurrency ", options->concurrency, ", seed ",
                         options->seed);
  std::fputs(FormatSummaryTable(metrics, headline).c_str(), stdout);
  nlohmann::json server_counters = nullptr;
  if (result->server_before && result->server_after) {
    server_counters = ServerCountersToJson(*result->server_before, *result->server_after);
    const nlohmann::json& c = server_counters;
    auto num = [&](const char* key) {
      return c[key].is_number() ? std::to_string(c[key].get<uint64_t>()) : std::string("?");
    };
    std::printf(
        "  server during the run: %s steps (%s mixed), %s tokens; its decode loop: %s launches, "
        "%s regime changes on the device, %s by an exit\n",
        num("steps").c_str(), num("mixed_steps").c_str(), num("tokens_generated").c_str(),
        num("loop_launches").c_str(), num("regime_changes_on_device").c_str(),
        num("regime_changes_by_exit").c_str());
  }
  if (result->cancelled_at_drain > 0) {
    std::printf(
        "  %lld requests were still in flight after --drain_timeout_s=%g and were "
        "cancelled\n",
        static_cast<long long>(result->cancelled_at_drain), options->drain_timeout_s);
  }
  std::fflush(stdout);

  if (!options->out_dir.empty()) {
    const ReportInputs in{.config = OptionsToJson(*options),
                          .model_info = ModelInfoToJson(*info),
                          .run = {{"wall_s", result->wall_s},
                                  {"cancelled_at_drain", result->cancelled_at_drain},
                                  {"interrupted", result->interrupted},
                                  {"prompts", prompt_facts},
                                  {"server_counters", server_counters}},
                          .records = result->records,
                          .metrics = &metrics};
    if (auto s = WriteReport(options->out_dir, in); !s.ok()) return Fail(kNoOutput, s);
    std::printf("  wrote %s/{results.jsonl,summary.json,report.html}\n", options->out_dir.c_str());
  }
  if (result->interrupted) {
    return Fail(kInterrupted, absl::CancelledError("interrupted; results are partial"));
  }
  if (metrics.requests_ok == 0) {
    return Fail(kRequestErrors, absl::InternalError("no request succeeded"));
  }
  if (metrics.requests_failed > 0 && !options->allow_errors) {
    return Fail(kRequestErrors, absl::InternalError(absl::StrCat(
                                    metrics.requests_failed, " of ", metrics.requests_total,
                                    " requests failed (see errors above; "
                                    "--allow_errors to exit 0 anyway)")));
  }
  return kOk;
}

}  // namespace
}  // namespace ts::load

int main(int argc, char** argv) {
  return ts::load::Main(argc, argv);
}
