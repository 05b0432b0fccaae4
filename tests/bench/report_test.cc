// Report outputs: JSON shapes, NaN handling, and an HTML file with real SVG charts.
#include "bench/load/report.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "bench/load/svg.h"
#include "gtest/gtest.h"

namespace ts::load {
namespace {

std::vector<RequestRecord> SampleRecords() {
  std::vector<RequestRecord> records;
  for (int i = 0; i < 30; ++i) {
    RequestRecord r;
    r.index = i;
    r.request_id = "r-" + std::to_string(i);
    r.input_tokens = 8 + i % 3;
    r.requested_output_tokens = 4;
    r.intended_ms = 10.0 * i;
    r.send_ms = r.intended_ms + 0.25;
    r.message_ms = {r.intended_ms + 20 + i, r.intended_ms + 30 + i, r.intended_ms + 45 + 2 * i};
    r.message_tokens = {1, 2, 1};
    r.end_ms = r.message_ms.back() + 1;
    r.finish_reason = "LENGTH";
    r.usage_completion_tokens = 4;
    records.push_back(r);
  }
  records[7].status_code = 14;
  records[7].status_name = "UNAVAILABLE";
  records[7].status_message = "connection reset <&>";
  records[7].message_ms.clear();
  records[7].message_tokens.clear();
  return records;
}

std::string Slurp(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

size_t Count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + 1)) {
    ++n;
  }
  return n;
}

TEST(ReportTest, RecordJsonCarriesTimesAndNullsForUndefined) {
  const std::vector<RequestRecord> records = SampleRecords();
  const nlohmann::json ok = RecordToJson(records[2]);
  EXPECT_EQ(ok["status"], "OK");
  EXPECT_EQ(ok["output_tokens"], 4);
  EXPECT_DOUBLE_EQ(ok["ttft_ms"].get<double>(), 22.0);
  EXPECT_NEAR(ok["tpot_ms"].get<double>(), (50.0 - 22.0) / 3.0, 1e-3);  // rounded to us
  EXPECT_EQ(ok["message_tokens"], nlohmann::json({1, 2, 1}));
  const nlohmann::json failed = RecordToJson(records[7]);
  EXPECT_EQ(failed["status"], "UNAVAILABLE");
  EXPECT_TRUE(failed["ttft_ms"].is_null());
  EXPECT_TRUE(failed["first_token_ms"].is_null());
  EXPECT_TRUE(ok["server_timing"].is_null());  // SampleRecords' server sent no Timing

  RequestRecord timed = records[2];
  timed.server = {.has = true,
                  .preprocess_ms = 0.25,
                  .queue_ms = 3.5,
                  .prefill_wait_ms = 1.5,
                  .prefill_ms = 12.125,
                  .decode_ms = 40};
  const nlohmann::json t = RecordToJson(timed)["server_timing"];
  EXPECT_DOUBLE_EQ(t["preprocess_ms"].get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(t["queue_ms"].get<double>(), 3.5);
  EXPECT_DOUBLE_EQ(t["prefill_wait_ms"].get<double>(), 1.5);
  EXPECT_DOUBLE_EQ(t["prefill_ms"].get<double>(), 12.125);
  EXPECT_DOUBLE_EQ(t["decode_ms"].get<double>(), 40);
}

TEST(ReportTest, SummaryJsonHasMetricsConfigAndModelInfo) {
  const std::vector<RequestRecord> records = SampleRecords();
  const RunMetrics m = ComputeRunMetrics(records);
  const ReportInputs in{.config = {{"mode", "open"}, {"target", "x:1"}},
                        .model_info = {{"model", "tiny"}, {"vocab_size", 320}},
                        .run = {{"wall_s", 1.0}},
                        .records = records,
                        .metrics = &m};
  const nlohmann::json s = BuildSummaryJson(in);
  EXPECT_EQ(s["config"]["mode"], "open");
  EXPECT_EQ(s["model_info"]["vocab_size"], 320);
  EXPECT_EQ(s["metrics"]["requests_total"], 30);
  EXPECT_EQ(s["metrics"]["requests_failed"], 1);
  EXPECT_EQ(s["metrics"]["errors_by_code"]["UNAVAILABLE"], 1);
  EXPECT_EQ(s["metrics"]["ttft_ms"]["count"], 29);
  EXPECT_DOUBLE_EQ(s["metrics"]["ttft_ms"]["max"].get<double>(), m.ttft_ms.max);
  for (const char* key : {"mean", "median", "p90", "p99", "max"}) {
    EXPECT_TRUE(s["metrics"]["itl_ms"][key].is_number()) << key;
  }
  // A distribution with no samples serialises as nulls, not NaN (invalid JSON).
  const RunMetrics empty = ComputeRunMetrics({});
  EXPECT_TRUE(MetricsToJson(empty)["ttft_ms"]["mean"].is_null());
  for (const char* key :
       {"server_queue_ms", "server_prefill_wait_ms", "server_prefill_ms", "server_ttft_ms"}) {
    EXPECT_EQ(s["metrics"][key]["count"], 0) << key;
    EXPECT_TRUE(s["definitions"].contains(key)) << key;
  }
}

TEST(ReportTest, WritesAllThreeFiles) {
  const std::vector<RequestRecord> records = SampleRecords();
  const RunMetrics m = ComputeRunMetrics(records);
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("ts_report_test_" + std::to_string(::getpid())) / "nested";
  const ReportInputs in{.config = {{"mode", "closed"}, {"target", "localhost:5"}},
                        .model_info = {{"model", "tiny<model>"}},
                        .run = {{"wall_s", 0.5}},
                        .records = records,
                        .metrics = &m};
  ASSERT_TRUE(WriteReport(dir.string(), in).ok());

  std::ifstream jsonl(dir / "results.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(jsonl, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    EXPECT_EQ(j["index"], lines);
    ++lines;
  }
  EXPECT_EQ(lines, 30);
  const nlohmann::json summary = nlohmann::json::parse(Slurp(dir / "summary.json"));
  EXPECT_EQ(summary["metrics"]["requests_ok"], 29);

  const std::string html = Slurp(dir / "report.html");
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  // 4 metrics x (CDF + histogram) + tokens/s + completions/s + TTFT scatter.
  EXPECT_EQ(Count(html, "<svg "), 11u);
  EXPECT_EQ(Count(html, "</svg>"), 11u);
  EXPECT_GT(Count(html, "<polyline"), 5u);
  EXPECT_EQ(Count(html, "no data"), 0u);
  EXPECT_NE(html.find("tiny&lt;model&gt;"), std::string::npos);  // escaped, not raw markup
  EXPECT_EQ(html.find("tiny<model>"), std::string::npos);
  EXPECT_EQ(html.find("<script"), std::string::npos);  // self-contained and static
  std::filesystem::remove_all(dir.parent_path());
}

TEST(SvgTest, CdfPointsAreMonotoneAndThinned) {
  std::vector<double> v;
  for (int i = 1000; i > 0; --i) v.push_back(i * 0.5);
  const std::vector<Point> pts = CdfPoints(v, 50);
  ASSERT_EQ(pts.size(), 50u);
  EXPECT_DOUBLE_EQ(pts.front().first, 0.5);
  EXPECT_DOUBLE_EQ(pts.front().second, 0.001);
  EXPECT_DOUBLE_EQ(pts.back().first, 500);
  EXPECT_DOUBLE_EQ(pts.back().second, 1.0);
  for (size_t i = 1; i < pts.size(); ++i) {
    EXPECT_GE(pts[i].first, pts[i - 1].first);
    EXPECT_GT(pts[i].second, pts[i - 1].second);
  }
}

TEST(SvgTest, NiceTicksCoverTheRange) {
  const std::vector<double> t = NiceTicks(3, 97, 5);
  ASSERT_GE(t.size(), 2u);
  EXPECT_LE(t.front(), 3);
  EXPECT_GE(t.back(), 97);
  EXPECT_DOUBLE_EQ(t[1] - t[0], 20);
  EXPECT_FALSE(NiceTicks(5, 5, 5).empty());  // degenerate range still gets an axis
}

TEST(SvgTest, HistogramCountsEveryValue) {
  const std::vector<double> v = {1, 1, 2, 3, 3, 3, 10};
  ChartOptions options;
  options.title = "h";
  const std::string svg = HistogramSvg(options, v, 3, "red");
  // Bins [1,4), [4,7), [7,10]: 6, 0, 1.
  EXPECT_NE(svg.find(": 6</title>"), std::string::npos);
  EXPECT_NE(svg.find(": 0</title>"), std::string::npos);
  EXPECT_NE(svg.find(": 1</title>"), std::string::npos);
}

}  // namespace
}  // namespace ts::load
