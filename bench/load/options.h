// Configuration of one tailserve-load run. main.cc fills it from flags; everything else reads it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "bench/load/workload.h"
#include "nlohmann/json.hpp"

namespace ts::load {

enum class LoopMode { kOpen, kClosed };

// Passed through to SamplingParams; unset fields are left unset (the server's defaults apply),
// except temperature, which defaults to 0 (greedy) so runs are reproducible.
struct SamplingOptions {
  float temperature = 0.0f;
  std::optional<int32_t> top_k;
  std::optional<float> top_p;
  std::optional<float> min_p;
  std::optional<float> repetition_penalty;
  std::optional<float> presence_penalty;
  std::optional<float> frequency_penalty;
  // true: each request carries a seed derived from (--seed, request index), so sampled runs
  // repeat; false: the server draws seeds.
  bool send_seed = true;
};

struct LoadOptions {
  std::string target = "localhost:50051";  // host:port of the tailserve server
  LoopMode mode = LoopMode::kClosed;
  double rate_per_s = 0;        // open loop: Poisson arrival rate, > 0 or inf
  int32_t concurrency = 1;      // closed loop: requests in flight at all times
  int64_t num_requests = 0;     // 0 = no count limit
  double duration_s = 0;        // 0 = no time limit; stops *sending* after this long
  int64_t warmup_requests = 0;  // sent (closed loop) before the measured run, not recorded
  uint64_t seed = 0;
  LengthDist input = {LengthDist::Kind::kFixed, 32, 0};
  LengthDist output = {LengthDist::Kind::kFixed, 32, 0};
  bool input_len_set = false;   // --input_len or --input_dist was given
  bool output_len_set = false;  // --output_len or --output_dist was given (replies do not count)
  // The text path; both empty sends random prompt ids. At most one is set.
  std::string prompts_file;
  std::string prompt_text;
  bool shuffle_prompts = true;     // false: requests take the file's prompts in file order
  bool add_special_tokens = true;  // TextParams.add_special_tokens, for requests and counts
  SamplingOptions sampling;
  double connect_timeout_s = 10;  // channel connect + GetModelInfo, and each counting Tokenize
  double request_timeout_s = 0;   // per-request gRPC deadline, 0 = none
  double drain_timeout_s = 60;    // after sending stops, in-flight requests get this long, then
                                  // are cancelled (so a run always ends)
  int32_t channels = 1;           // separate HTTP/2 connections, requests round-robin over them
  std::string out_dir;            // empty = write no files
  bool allow_errors = false;      // exit 0 even when some requests failed
};

// Checks ranges and combinations; errors name the flag.
absl::Status ValidateOptions(const LoadOptions& options);

// "file", "text" or "random": where prompts come from.
std::string PromptSource(const LoadOptions& options);

// The full configuration, as recorded in summary.json.
nlohmann::json OptionsToJson(const LoadOptions& options);

std::string ModeName(LoopMode mode);

}  // namespace ts::load
