#include "bench/load/stats.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace ts::load {
namespace {
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
}  // namespace

int32_t RequestRecord::OutputTokens() const {
  return std::accumulate(message_tokens.begin(), message_tokens.end(), int32_t{0});
}

RequestMetrics ComputeRequestMetrics(const RequestRecord& r) {
  RequestMetrics m;
  m.e2e_ms = r.end_ms - r.intended_ms;
  m.send_lag_ms = r.send_ms - r.intended_ms;
  m.ttft_ms = r.message_ms.empty() ? kNaN : r.message_ms.front() - r.intended_ms;
  const int32_t tokens = r.OutputTokens();
  m.tpot_ms = tokens >= 2 ? (m.e2e_ms - m.ttft_ms) / (tokens - 1) : kNaN;
  const ServerTiming& s = r.server;
  m.server_queue_ms = s.has ? s.queue_ms : kNaN;
  m.server_prefill_wait_ms = s.has ? s.prefill_wait_ms : kNaN;
  m.server_prefill_ms = s.has ? s.prefill_ms : kNaN;
  m.server_ttft_ms = s.has ? s.preprocess_ms + s.queue_ms + s.prefill_wait_ms + s.prefill_ms : kNaN;
  return m;
}

std::vector<double> InterTokenLatencies(const RequestRecord& r) {
  std::vector<double> itl;
  for (size_t k = 1; k < r.message_ms.size() && k < r.message_tokens.size(); ++k) {
    const int32_t n = r.message_tokens[k];
    if (n <= 0) continue;
    const double share = (r.message_ms[k] - r.message_ms[k - 1]) / n;
    itl.insert(itl.end(), static_cast<size_t>(n), share);
  }
  return itl;
}

double Percentile(std::span<const double> sorted, double q) {
  if (sorted.empty()) return kNaN;
  const double pos = std::clamp(q, 0.0, 1.0) * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (pos - static_cast<double>(lo)) * (sorted[hi] - sorted[lo]);
}

Distribution Summarize(std::vector<double> values) {
  std::erase_if(values, [](double v) { return std::isnan(v); });
  Distribution d;
  d.count = static_cast<int64_t>(values.size());
  if (values.empty()) {
    d.mean = d.min = d.median = d.p90 = d.p99 = d.max = kNaN;
    return d;
  }
  std::sort(values.begin(), values.end());
  d.mean = std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
  d.min = values.front();
  d.max = values.back();
  d.median = Percentile(values, 0.5);
  d.p90 = Percentile(values, 0.9);
  d.p99 = Percentile(values, 0.99);
  return d;
}

double ChooseBinMs(double duration_ms, int target_bins) {
  if (!(duration_ms > 0) || target_bins <= 0) return 1.0;
  const double raw = duration_ms / target_bins;
  const double decade = std::pow(10.0, std::floor(std::log10(raw)));
  double width = 10 * decade;
  for (double step : {1.0, 2.0, 5.0}) {
    if (step * decade >= raw) {
      width = step * decade;
      break;
    }
  }
  return std::max(width, 1.0);
}

RunMetrics ComputeRunMetrics(std::span<const RequestRecord> records, int target_bins) {
  RunMetrics m;
  m.requests_total = static_cast<int64_t>(records.size());
  std::vector<double> ttft, tpot, itl, e2e, lag, queue, prefill_wait, prefill, server_ttft;
  double window_start = std::numeric_limits<double>::infinity();
  double window_end = -std::numeric_limits<double>::infinity();
  for (const RequestRecord& r : records) {
    window_start = std::min(window_start, r.intended_ms);
    window_end = std::max(window_end, r.end_ms);
    if (!r.ok()) {
      ++m.requests_failed;
      ++m.errors_by_code[r.status_name];
      continue;
    }
    ++m.requests_ok;
    const int32_t tokens = r.OutputTokens();
    m.output_tokens += tokens;
    m.input_tokens += r.input_tokens;
    if (tokens != r.requested_output_tokens) ++m.output_len_mismatches;
    if (r.usage_prompt_tokens >= 0 && r.usage_prompt_tokens != r.input_tokens) {
      ++m.input_len_mismatches;
    }
    const RequestMetrics rm = ComputeRequestMetrics(r);
    ttft.push_back(rm.ttft_ms);
    tpot.push_back(rm.tpot_ms);
    e2e.push_back(rm.e2e_ms);
    lag.push_back(rm.send_lag_ms);
    queue.push_back(rm.server_queue_ms);
    prefill_wait.push_back(rm.server_prefill_wait_ms);
    prefill.push_back(rm.server_prefill_ms);
    server_ttft.push_back(rm.server_ttft_ms);
    const std::vector<double> r_itl = InterTokenLatencies(r);
    itl.insert(itl.end(), r_itl.begin(), r_itl.end());
  }
  m.ttft_ms = Summarize(std::move(ttft));
  m.tpot_ms = Summarize(std::move(tpot));
  m.itl_ms = Summarize(std::move(itl));
  m.e2e_ms = Summarize(std::move(e2e));
  m.send_lag_ms = Summarize(std::move(lag));
  m.server_queue_ms = Summarize(std::move(queue));
  m.server_prefill_wait_ms = Summarize(std::move(prefill_wait));
  m.server_prefill_ms = Summarize(std::move(prefill));
  m.server_ttft_ms = Summarize(std::move(server_ttft));
  if (records.empty()) return m;

  const double duration_ms = std::max(window_end - window_start, 0.0);
  m.duration_s = duration_ms / 1000.0;
  if (m.duration_s > 0) {
    m.request_throughput = static_cast<double>(m.requests_ok) / m.duration_s;
    m.output_token_throughput = static_cast<double>(m.output_tokens) / m.duration_s;
    m.input_token_throughput = static_cast<double>(m.input_tokens) / m.duration_s;
  }

  m.bin_ms = ChooseBinMs(duration_ms, target_bins);
  const size_t num_bins = static_cast<size_t>(std::floor(duration_ms / m.bin_ms)) + 1;
  m.timeline.resize(num_bins);
  for (size_t b = 0; b < num_bins; ++b) m.timeline[b].start_ms = window_start + b * m.bin_ms;
  auto bin_of = [&](double t_ms) {
    const double b = std::floor((t_ms - window_start) / m.bin_ms);
    return static_cast<size_t>(std::clamp(b, 0.0, static_cast<double>(num_bins - 1)));
  };
  const double bin_s = m.bin_ms / 1000.0;
  for (const RequestRecord& r : records) {
    for (size_t k = 0; k < r.message_ms.size() && k < r.message_tokens.size(); ++k) {
      m.timeline[bin_of(r.message_ms[k])].tokens_per_s += r.message_tokens[k] / bin_s;
    }
    if (r.ok()) m.timeline[bin_of(r.end_ms)].requests_completed += 1;
  }
  return m;
}

}  // namespace ts::load
