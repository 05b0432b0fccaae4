// Outputs of a load run: the stdout table, results.jsonl (one record per request), summary.json
// (metrics + configuration + server ModelInfo) and a self-contained report.html with SVG charts.
#pragma once

#include <span>
#include <string>

#include "absl/status/status.h"
#include "bench/load/stats.h"
#include "nlohmann/json.hpp"

namespace ts::load {

struct ReportInputs {
  nlohmann::json config;      // OptionsToJson
  nlohmann::json model_info;  // the server's ModelInfo
  nlohmann::json run;         // run facts: wall_s, cancelled_at_drain, interrupted, ...
  std::span<const RequestRecord> records;
  const RunMetrics* metrics = nullptr;  // ComputeRunMetrics(records)
};

nlohmann::json RecordToJson(const RequestRecord& record);
nlohmann::json DistributionToJson(const Distribution& d);
nlohmann::json MetricsToJson(const RunMetrics& m);
nlohmann::json BuildSummaryJson(const ReportInputs& in);

// The human-readable summary printed to stdout.
std::string FormatSummaryTable(const RunMetrics& m, const std::string& headline);

std::string RenderReportHtml(const ReportInputs& in);

// Creates out_dir if needed and writes results.jsonl, summary.json and report.html into it.
absl::Status WriteReport(const std::string& out_dir, const ReportInputs& in);

}  // namespace ts::load
