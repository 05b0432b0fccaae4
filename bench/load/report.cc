#include "bench/load/report.h"

#include <cmath>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/load/svg.h"

namespace ts::load {
namespace {

// JSON has no NaN; undefined values become null.
nlohmann::json Num(double v) {
  return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json();
}

// Milliseconds rounded to microseconds keep results.jsonl readable without losing precision that
// a steady clock and a network stack could honestly claim.
nlohmann::json Ms(double v) {
  return Num(std::isfinite(v) ? std::round(v * 1000.0) / 1000.0 : v);
}

absl::Status WriteFile(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot open ", path.string()));
  out << text;
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat("failed writing ", path.string()));
  return absl::OkStatus();
}

std::string Cell(double v) {
  return std::isfinite(v) ? absl::StrFormat("%.3f", v) : "-";
}

struct MetricView {
  const char* key;    // summary.json key
  const char* label;  // table / chart label
  const Distribution* dist;
};

std::vector<MetricView> Views(const RunMetrics& m) {
  return {{"ttft_ms", "TTFT", &m.ttft_ms},
          {"tpot_ms", "TPOT", &m.tpot_ms},
          {"itl_ms", "ITL", &m.itl_ms},
          {"e2e_ms", "E2E latency", &m.e2e_ms},
          {"send_lag_ms", "send lag", &m.send_lag_ms},
          {"server_queue_ms", "srv queue", &m.server_queue_ms},
          {"server_prefill_wait_ms", "srv wait", &m.server_prefill_wait_ms},
          {"server_prefill_ms", "srv prefill", &m.server_prefill_ms},
          {"server_ttft_ms", "srv TTFT", &m.server_ttft_ms}};
}

constexpr const char* kCss = R"(
body{font-family:sans-serif;margin:24px;color:#222;max-width:1200px}
table{border-collapse:collapse;margin:8px 0 16px}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3} td:first-child,th:first-child{text-align:left}
.charts{display:flex;flex-wrap:wrap;gap:12px} pre{background:#f7f7f7;padding:8px;overflow:auto}
)";

}  // namespace

nlohmann::json RecordToJson(const RequestRecord& r) {
  const RequestMetrics m = ComputeRequestMetrics(r);
  nlohmann::json message_ms = nlohmann::json::array();
  for (double t : r.message_ms) message_ms.push_back(Ms(t));
  nlohmann::json server;  // null without the server's Timing
  if (r.server.has) {
    server = {{"preprocess_ms", Ms(r.server.preprocess_ms)},
              {"queue_ms", Ms(r.server.queue_ms)},
              {"prefill_wait_ms", Ms(r.server.prefill_wait_ms)},
              {"prefill_ms", Ms(r.server.prefill_ms)},
              {"decode_ms", Ms(r.server.decode_ms)}};
  }
  return {{"index", r.index},
          {"request_id", r.request_id},
          {"status", r.status_name},
          {"status_code", r.status_code},
          {"error", r.status_message},
          {"input_tokens", r.input_tokens},
          {"usage_prompt_tokens", r.usage_prompt_tokens},
          {"prompt_entry", r.prompt_entry},
          {"requested_output_tokens", r.requested_output_tokens},
          {"output_tokens", r.OutputTokens()},
          {"usage_completion_tokens", r.usage_completion_tokens},
          {"finish_reason", r.finish_reason},
          {"intended_ms", Ms(r.intended_ms)},
          {"send_ms", Ms(r.send_ms)},
          {"first_token_ms", r.message_ms.empty() ? nlohmann::json() : Ms(r.message_ms.front())},
          {"end_ms", Ms(r.end_ms)},
          {"ttft_ms", Ms(m.ttft_ms)},
          {"tpot_ms", Ms(m.tpot_ms)},
          {"e2e_ms", Ms(m.e2e_ms)},
          {"send_lag_ms", Ms(m.send_lag_ms)},
          {"server_timing", server},
          {"message_ms", message_ms},
          {"message_tokens", r.message_tokens}};
}

nlohmann::json DistributionToJson(const Distribution& d) {
  return {{"count", d.count},        {"mean", Num(d.mean)}, {"min", Num(d.min)},
          {"median", Num(d.median)}, {"p90", Num(d.p90)},   {"p99", Num(d.p99)},
          {"max", Num(d.max)}};
}

nlohmann::json MetricsToJson(const RunMetrics& m) {
  nlohmann::json j = {{"requests_total", m.requests_total},
                      {"requests_ok", m.requests_ok},
                      {"requests_failed", m.requests_failed},
                      {"output_len_mismatches", m.output_len_mismatches},
                      {"input_len_mismatches", m.input_len_mismatches},
                      {"errors_by_code", m.errors_by_code},
                      {"duration_s", Num(m.duration_s)},
                      {"request_throughput_per_s", Num(m.request_throughput)},
                      {"output_token_throughput_per_s", Num(m.output_token_throughput)},
                      {"input_token_throughput_per_s", Num(m.input_token_throughput)},
                      {"output_tokens", m.output_tokens},
                      {"input_tokens", m.input_tokens},
                      {"timeline_bin_ms", Num(m.bin_ms)}};
  for (const MetricView& v : Views(m)) j[v.key] = DistributionToJson(*v.dist);
  nlohmann::json timeline = nlohmann::json::array();
  for (const RateBin& b : m.timeline) {
    timeline.push_back({{"start_ms", Ms(b.start_ms)},
                        {"tokens_per_s", Num(b.tokens_per_s)},
                        {"requests_completed", b.requests_completed}});
  }
  j["timeline"] = std::move(timeline);
  return j;
}

nlohmann::json BuildSummaryJson(const ReportInputs& in) {
  return {{"tool", "tailserve-load"},
          {"definitions",
           {{"ttft_ms", "first token arrival - intended send time"},
            {"tpot_ms", "(e2e - ttft) / (output_tokens - 1)"},
            {"itl_ms",
             "gap between token-carrying messages, split evenly over the later message's "
             "tokens; first-message tokens add no sample"},
            {"e2e_ms", "stream end - intended send time"},
            {"send_lag_ms", "actual send - intended send time"},
            {"server_queue_ms", "the server's Timing.queue_us: waiting for a slot and KV blocks"},
            {"server_prefill_wait_ms", "Timing.prefill_wait_us: behind the prompts ahead of it"},
            {"server_prefill_ms", "Timing.prefill_us: its first prompt rows -> its first token"},
            {"server_ttft_ms", "the server's Timing: every part but decode_us"}}},
          {"config", in.config},
          {"model_info", in.model_info},
          {"run", in.run},
          {"metrics", MetricsToJson(*in.metrics)}};
}

std::string FormatSummaryTable(const RunMetrics& m, const std::string& headline) {
  std::string s = headline + "\n";
  absl::StrAppendFormat(&s, "  requests: %d ok, %d failed, %d total in %.3f s\n", m.requests_ok,
                        m.requests_failed, m.requests_total, m.duration_s);
  absl::StrAppendFormat(&s, "  request throughput:      %10.3f req/s\n", m.request_throughput);
  absl::StrAppendFormat(&s, "  output token throughput: %10.3f tok/s (%d tokens)\n",
                        m.output_token_throughput, m.output_tokens);
  absl::StrAppendFormat(&s, "  input token throughput:  %10.3f tok/s (%d tokens)\n",
                        m.input_token_throughput, m.input_tokens);
  absl::StrAppendFormat(&s, "  %-12s %8s %10s %10s %10s %10s %10s\n", "metric (ms)", "count",
                        "mean", "median", "p90", "p99", "max");
  for (const MetricView& v : Views(m)) {
    const Distribution& d = *v.dist;
    absl::StrAppendFormat(&s, "  %-12s %8d %10s %10s %10s %10s %10s\n", v.label, d.count,
                          Cell(d.mean), Cell(d.median), Cell(d.p90), Cell(d.p99), Cell(d.max));
  }
  if (m.errors_by_code.empty()) {
    s += "  errors: none\n";
  } else {
    s += "  errors by status:";
    for (const auto& [code, n] : m.errors_by_code) absl::StrAppendFormat(&s, " %s=%d", code, n);
    s += "\n";
  }
  if (m.output_len_mismatches > 0) {
    absl::StrAppendFormat(&s,
                          "  WARNING: %d successful requests got a token count other than the "
                          "requested (pinned) output length\n",
                          m.output_len_mismatches);
  }
  if (m.input_len_mismatches > 0) {
    absl::StrAppendFormat(&s,
                          "  WARNING: %d successful requests had a Usage.prompt_tokens other than "
                          "their input length\n",
                          m.input_len_mismatches);
  }
  return s;
}

std::string RenderReportHtml(const ReportInputs& in) {
  const RunMetrics& m = *in.metrics;
  std::string h = absl::StrCat(
      "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>tailserve-load report</title>"
      "<style>",
      kCss, "</style></head><body>\n<h1>tailserve-load report</h1>\n");
  absl::StrAppendFormat(
      &h,
      "<p>%s loop against <code>%s</code> (model <code>%s</code>, backend "
      "<code>%s</code>): %d requests, %d failed, %.3f s.</p>\n",
      EscapeXml(in.config.value("mode", "?")), EscapeXml(in.config.value("target", "?")),
      EscapeXml(in.model_info.value("model", "?")), EscapeXml(in.model_info.value("backend", "?")),
      m.requests_total, m.requests_failed, m.duration_s);
  h += "<h2>Summary</h2>\n<table><tr><th>metric (ms)</th><th>count</th><th>mean</th>"
       "<th>median</th><th>p90</th><th>p99</th><th>max</th></tr>\n";
  for (const MetricView& v : Views(m)) {
    const Distribution& d = *v.dist;
    absl::StrAppendFormat(&h,
                          "<tr><td>%s</td><td>%d</td><td>%s</td><td>%s</td><td>%s</td>"
                          "<td>%s</td><td>%s</td></tr>\n",
                          v.label, d.count, Cell(d.mean), Cell(d.median), Cell(d.p90), Cell(d.p99),
                          Cell(d.max));
  }
  absl::StrAppendFormat(&h,
                        "</table>\n<table><tr><td>request throughput</td><td>%.3f req/s</td>"
                        "</tr><tr><td>output token throughput</td><td>%.3f tok/s</td></tr>"
                        "<tr><td>input token throughput</td><td>%.3f tok/s</td></tr>",
                        m.request_throughput, m.output_token_throughput, m.input_token_throughput);
  for (const auto& [code, n] : m.errors_by_code) {
    absl::StrAppendFormat(&h, "<tr><td>errors: %s</td><td>%d</td></tr>", EscapeXml(code), n);
  }
  h += "</table>\n<h2>Latency distributions</h2>\n";

  std::vector<std::vector<double>> samples(4);
  for (const RequestRecord& r : in.records) {
    if (!r.ok()) continue;
    const RequestMetrics rm = ComputeRequestMetrics(r);
    samples[0].push_back(rm.ttft_ms);
    samples[1].push_back(rm.tpot_ms);
    const std::vector<double> itl = InterTokenLatencies(r);
    samples[2].insert(samples[2].end(), itl.begin(), itl.end());
    samples[3].push_back(rm.e2e_ms);
  }
  const char* names[] = {"TTFT", "TPOT", "ITL", "E2E latency"};
  const char* colors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"};
  for (size_t k = 0; k < samples.size(); ++k) {
    h += "<div class=\"charts\">\n";
    const Series cdf{names[k], colors[k], CdfPoints(samples[k], 400)};
    h += LineChartSvg({.title = absl::StrCat(names[k], " CDF"),
                       .x_label = "ms",
                       .y_label = "fraction of samples"},
                      std::span<const Series>(&cdf, 1));
    h += HistogramSvg(
        {.title = absl::StrCat(names[k], " histogram"), .x_label = "ms", .y_label = "samples"},
        samples[k], 40, colors[k]);
    h += "</div>\n";
  }

  h += "<h2>Over time</h2>\n<div class=\"charts\">\n";
  Series tokens{"output tokens/s", "#9467bd", {}};
  Series done{"completed req/s", "#8c564b", {}};
  const double t0 = m.timeline.empty() ? 0 : m.timeline.front().start_ms;
  for (const RateBin& b : m.timeline) {
    const double mid_s = (b.start_ms - t0 + m.bin_ms / 2) / 1000.0;
    tokens.points.emplace_back(mid_s, b.tokens_per_s);
    done.points.emplace_back(mid_s, b.requests_completed / (m.bin_ms / 1000.0));
  }
  h += LineChartSvg({.title = absl::StrFormat("Output tokens/s (%g ms bins)", m.bin_ms),
                     .x_label = "time since first intended send (s)",
                     .y_label = "tokens/s"},
                    std::span<const Series>(&tokens, 1));
  h += LineChartSvg({.title = absl::StrFormat("Completed requests/s (%g ms bins)", m.bin_ms),
                     .x_label = "time since first intended send (s)",
                     .y_label = "requests/s"},
                    std::span<const Series>(&done, 1));
  Series ttft_by_time{"TTFT", "#1f77b4", {}};
  for (const RequestRecord& r : in.records) {
    if (r.ok()) {
      ttft_by_time.points.emplace_back((r.intended_ms - t0) / 1000.0,
                                       ComputeRequestMetrics(r).ttft_ms);
    }
  }
  h += LineChartSvg({.title = "TTFT by intended send time",
                     .x_label = "intended send (s)",
                     .y_label = "TTFT (ms)",
                     .dots = true},
                    std::span<const Series>(&ttft_by_time, 1));
  h += "</div>\n<h2>Configuration</h2>\n<pre>" + EscapeXml(in.config.dump(2)) +
       "</pre>\n<h2>Server ModelInfo</h2>\n<pre>" + EscapeXml(in.model_info.dump(2)) +
       "</pre>\n<h2>Run</h2>\n<pre>" + EscapeXml(in.run.dump(2)) + "</pre>\n</body></html>\n";
  return h;
}

absl::Status WriteReport(const std::string& out_dir, const ReportInputs& in) {
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("--out_dir: cannot create ", out_dir, ": ", ec.message()));
  }
  const std::filesystem::path dir(out_dir);
  std::string jsonl;
  for (const RequestRecord& r : in.records)
    jsonl += RecordToJson(r).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  if (auto s = WriteFile(dir / "results.jsonl", jsonl); !s.ok()) return s;
  if (auto s = WriteFile(
          dir / "summary.json",
          BuildSummaryJson(in).dump(2, ' ', false, nlohmann::json::error_handler_t::replace) +
              "\n");
      !s.ok()) {
    return s;
  }
  return WriteFile(dir / "report.html", RenderReportHtml(in));
}

}  // namespace ts::load
