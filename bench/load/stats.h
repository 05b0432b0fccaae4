// Metric math of the load client: pure functions over per-request records, no gRPC, no clocks.
//
// Definitions (all latencies in milliseconds, all times relative to the run's start):
//   TTFT  = first token arrival - INTENDED send time (open loop: the Poisson schedule; closed loop:
//           the moment the previous request on that slot finished). Measuring from the intended
//           time keeps client or server backlog visible (no coordinated omission).
//   E2E   = end of stream (status received) - intended send time.
//   TPOT  = (E2E - TTFT) / (output_tokens - 1); undefined for requests with fewer than 2 tokens.
//   ITL   = inter-token latency. The server coalesces tokens, so one message can carry several.
//           For each message k >= 1 carrying n_k tokens, the gap to message k-1 is split evenly:
//           n_k samples of (t_k - t_{k-1}) / n_k. Tokens that arrive in the first message are
//           covered by TTFT and add no ITL sample. The raw per-message times stay in results.jsonl.
//   send lag = actual send - intended send: how far the client itself fell behind its schedule.
//   server queue / prefill wait / prefill / TTFT = the server's own account of a request (its
//           Timing message): waiting for a slot and KV blocks; then behind the prompts ahead of it;
//           its own prefill to the first token; and all three plus the call's validation and
//           tokenization. TTFT - server TTFT is what the client, the network and gRPC added, and
//           the open loop's send lag.
// Latency distributions use successful requests only; failures are counted by status code.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace ts::load {

// The server's Timing (proto) from a call's last message, in milliseconds.
struct ServerTiming {
  bool has = false;  // false: the server sent none (a failed call, or an older server)
  double preprocess_ms = 0;
  double queue_ms = 0;
  double prefill_wait_ms = 0;
  double prefill_ms = 0;
  double decode_ms = 0;
};

struct RequestRecord {
  int64_t index = 0;  // 0-based position in the schedule
  std::string request_id;
  int32_t input_tokens = 0;   // prompt ids sent, or the text prompt's Tokenize count
  int64_t prompt_entry = -1;  // text path: the prompt's entry in --prompts_file; -1 = random ids
  int32_t requested_output_tokens = 0;
  double intended_ms = 0;                // when the schedule says it should have been sent
  double send_ms = 0;                    // when the call was actually started
  double end_ms = 0;                     // when the final status arrived
  std::vector<double> message_ms;        // [num_token_messages] arrival of each message with tokens
  std::vector<int32_t> message_tokens;   // [num_token_messages] tokens in that message, each >= 1
  int32_t usage_completion_tokens = -1;  // the server's final Usage; -1 when it sent none
  int32_t usage_prompt_tokens = -1;      // likewise
  ServerTiming server;
  std::string finish_reason;  // e.g. "LENGTH"; empty when none arrived
  int status_code = 0;        // grpc::StatusCode value; 0 = OK
  std::string status_name = "OK";
  std::string status_message;

  bool ok() const { return status_code == 0; }
  int32_t OutputTokens() const;
};

// Per-request derived values; NaN where undefined (no tokens, or fewer than 2 for TPOT).
struct RequestMetrics {
  double ttft_ms = 0;
  double tpot_ms = 0;
  double e2e_ms = 0;
  double send_lag_ms = 0;
  // NaN without the server's Timing.
  double server_queue_ms = 0;
  double server_prefill_wait_ms = 0;
  double server_prefill_ms = 0;
  double server_ttft_ms = 0;  // preprocess + queue + prefill wait + prefill
};
RequestMetrics ComputeRequestMetrics(const RequestRecord& r);

// ITL samples of one request, per the definition above. Sum = last message - first message.
std::vector<double> InterTokenLatencies(const RequestRecord& r);

struct Distribution {
  int64_t count = 0;
  // NaN when count == 0.
  double mean = 0;
  double min = 0;
  double median = 0;
  double p90 = 0;
  double p99 = 0;
  double max = 0;
};

// q in [0, 1] over ascending `sorted`, linear interpolation between closest ranks (numpy's
// default): position q * (n - 1). NaN for an empty input.
double Percentile(std::span<const double> sorted, double q);
// NaN values are ignored.
Distribution Summarize(std::vector<double> values);

struct RateBin {
  double start_ms = 0;
  double tokens_per_s = 0;
  double requests_completed = 0;
};

struct RunMetrics {
  int64_t requests_total = 0;
  int64_t requests_ok = 0;
  int64_t requests_failed = 0;
  // Successful requests whose token count differs from the requested (pinned) output length.
  int64_t output_len_mismatches = 0;
  // Successful requests whose Usage.prompt_tokens differs from input_tokens (the client's count).
  int64_t input_len_mismatches = 0;
  std::map<std::string, int64_t> errors_by_code;  // status name -> count, failures only
  // Window: first intended send to last stream end, over all requests.
  double duration_s = 0;
  double request_throughput = 0;       // successful requests / duration
  double output_token_throughput = 0;  // output tokens of successful requests / duration
  double input_token_throughput = 0;   // prompt tokens of successful requests / duration
  int64_t output_tokens = 0;           // of successful requests
  int64_t input_tokens = 0;            // of successful requests
  Distribution ttft_ms;
  Distribution tpot_ms;
  Distribution itl_ms;
  Distribution e2e_ms;
  Distribution send_lag_ms;
  Distribution server_queue_ms;  // over successful requests whose server sent its Timing
  Distribution server_prefill_wait_ms;
  Distribution server_prefill_ms;
  Distribution server_ttft_ms;
  double bin_ms = 0;
  // Token arrivals (all requests) and completions per bin of bin_ms over the window.
  std::vector<RateBin> timeline;
};

// A round bin width (1, 2 or 5 x 10^k ms, at least 1 ms) giving about `target_bins` bins.
double ChooseBinMs(double duration_ms, int target_bins);

RunMetrics ComputeRunMetrics(std::span<const RequestRecord> records, int target_bins = 60);

}  // namespace ts::load
