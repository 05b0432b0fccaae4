// Metric math against hand-computed values.
#include "bench/load/stats.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace ts::load {
namespace {

RequestRecord Record(int64_t index, double intended, double send, std::vector<double> msg_ms,
                     std::vector<int32_t> msg_tokens, double end, int32_t requested) {
  RequestRecord r;
  r.index = index;
  r.intended_ms = intended;
  r.send_ms = send;
  r.message_ms = std::move(msg_ms);
  r.message_tokens = std::move(msg_tokens);
  r.end_ms = end;
  r.requested_output_tokens = requested;
  r.input_tokens = 10;
  return r;
}

RequestRecord Failed(int64_t index, double intended, double end, int code, const char* name) {
  RequestRecord r = Record(index, intended, intended, {}, {}, end, 4);
  r.status_code = code;
  r.status_name = name;
  return r;
}

TEST(PercentileTest, LinearInterpolationBetweenClosestRanks) {
  const std::vector<double> sorted = {15, 20, 35, 40, 50};
  EXPECT_DOUBLE_EQ(Percentile(sorted, 0.0), 15);
  EXPECT_DOUBLE_EQ(Percentile(sorted, 0.5), 35);
  EXPECT_DOUBLE_EQ(Percentile(sorted, 0.9), 46);     // rank 3.6: 40 + 0.6 * 10
  EXPECT_DOUBLE_EQ(Percentile(sorted, 0.99), 49.6);  // rank 3.96
  EXPECT_DOUBLE_EQ(Percentile(sorted, 1.0), 50);
  EXPECT_DOUBLE_EQ(Percentile(std::vector<double>{7}, 0.9), 7);
  EXPECT_TRUE(std::isnan(Percentile(std::vector<double>{}, 0.5)));
}

TEST(SummarizeTest, UnsortedInputWithNaNs) {
  const std::vector<double> values = {7, 3, NAN, 10, 1, 9, 2, 8, 4, 6, 5, NAN};
  const Distribution d = Summarize(values);
  EXPECT_EQ(d.count, 10);
  EXPECT_DOUBLE_EQ(d.mean, 5.5);
  EXPECT_DOUBLE_EQ(d.min, 1);
  EXPECT_DOUBLE_EQ(d.median, 5.5);
  EXPECT_DOUBLE_EQ(d.p90, 9.1);
  EXPECT_DOUBLE_EQ(d.p99, 9.91);
  EXPECT_DOUBLE_EQ(d.max, 10);
}

TEST(SummarizeTest, EmptyIsNaN) {
  const Distribution d = Summarize({NAN});
  EXPECT_EQ(d.count, 0);
  EXPECT_TRUE(std::isnan(d.mean));
  EXPECT_TRUE(std::isnan(d.p99));
}

TEST(RequestMetricsTest, MeasuredFromIntendedSendTime) {
  // Sent 1.5 ms late; messages carry 1, 2 and 1 tokens.
  const RequestRecord r = Record(0, 100, 101.5, {150, 170, 200}, {1, 2, 1}, 205, 4);
  EXPECT_EQ(r.OutputTokens(), 4);
  const RequestMetrics m = ComputeRequestMetrics(r);
  EXPECT_DOUBLE_EQ(m.ttft_ms, 50);
  EXPECT_DOUBLE_EQ(m.e2e_ms, 105);
  EXPECT_DOUBLE_EQ(m.tpot_ms, 55.0 / 3.0);
  EXPECT_DOUBLE_EQ(m.send_lag_ms, 1.5);
}

TEST(RequestMetricsTest, TpotUndefinedForOneToken) {
  const RequestMetrics m = ComputeRequestMetrics(Record(0, 0, 0, {30}, {1}, 31, 1));
  EXPECT_DOUBLE_EQ(m.ttft_ms, 30);
  EXPECT_TRUE(std::isnan(m.tpot_ms));
  const RequestMetrics none = ComputeRequestMetrics(Record(0, 0, 0, {}, {}, 31, 1));
  EXPECT_TRUE(std::isnan(none.ttft_ms));
  EXPECT_DOUBLE_EQ(none.e2e_ms, 31);
}

TEST(RequestMetricsTest, ServerTimingSplitsTheServersShareOfTtft) {
  RequestRecord r = Record(0, 100, 101, {150, 170}, {1, 1}, 171, 2);
  const RequestMetrics without = ComputeRequestMetrics(r);
  EXPECT_TRUE(std::isnan(without.server_queue_ms));
  EXPECT_TRUE(std::isnan(without.server_prefill_ms));
  EXPECT_TRUE(std::isnan(without.server_ttft_ms));
  r.server = {.has = true,
              .preprocess_ms = 0.5,
              .queue_ms = 12,
              .prefill_wait_ms = 7,
              .prefill_ms = 23,
              .decode_ms = 20};
  const RequestMetrics m = ComputeRequestMetrics(r);
  EXPECT_DOUBLE_EQ(m.server_queue_ms, 12);
  EXPECT_DOUBLE_EQ(m.server_prefill_wait_ms, 7);
  EXPECT_DOUBLE_EQ(m.server_prefill_ms, 23);
  EXPECT_DOUBLE_EQ(m.server_ttft_ms, 42.5);  // decode is not part of it
  EXPECT_DOUBLE_EQ(m.ttft_ms, 50);           // the client's own, unchanged
}

TEST(InterTokenLatencyTest, CoalescedGapIsSplitOverItsTokens) {
  const RequestRecord r = Record(0, 100, 100, {150, 170, 200}, {1, 2, 1}, 205, 4);
  EXPECT_EQ(InterTokenLatencies(r), (std::vector<double>{10, 10, 30}));
}

TEST(InterTokenLatencyTest, FirstMessageTokensAddNoSample) {
  const RequestRecord r = Record(0, 0, 0, {150, 180, 186}, {3, 1, 3}, 190, 7);
  EXPECT_EQ(InterTokenLatencies(r), (std::vector<double>{30, 2, 2, 2}));
  // TPOT still counts every token after the first: (190 - 150) / 6.
  EXPECT_DOUBLE_EQ(ComputeRequestMetrics(r).tpot_ms, 40.0 / 6.0);
}

TEST(ChooseBinMsTest, RoundWidths) {
  EXPECT_DOUBLE_EQ(ChooseBinMs(2000, 60), 50);  // 33.3 -> 50
  EXPECT_DOUBLE_EQ(ChooseBinMs(1000, 10), 100);
  EXPECT_DOUBLE_EQ(ChooseBinMs(12000, 60), 200);
  EXPECT_DOUBLE_EQ(ChooseBinMs(30, 60), 1);  // never below 1 ms
  EXPECT_DOUBLE_EQ(ChooseBinMs(0, 60), 1);
}

TEST(RunMetricsTest, ThroughputErrorsAndDistributions) {
  const std::vector<RequestRecord> records = {
      Record(0, 0, 0.5, {100, 150}, {1, 1}, 150, 2),
      Failed(1, 200, 250, 14, "UNAVAILABLE"),
      Failed(2, 300, 2000, 8, "RESOURCE_EXHAUSTED"),
      Record(3, 500, 502, {650, 700}, {2, 2}, 1000, 4),
      Failed(4, 600, 700, 14, "UNAVAILABLE"),
      Record(5, 900, 900, {1000, 1100}, {1, 2}, 1100, 5),  // got 3 of 5: a mismatch
  };
  const RunMetrics m = ComputeRunMetrics(records);
  EXPECT_EQ(m.requests_total, 6);
  EXPECT_EQ(m.requests_ok, 3);
  EXPECT_EQ(m.requests_failed, 3);
  EXPECT_EQ(m.output_len_mismatches, 1);
  EXPECT_EQ(m.errors_by_code.size(), 2u);
  EXPECT_EQ(m.errors_by_code.at("UNAVAILABLE"), 2);
  EXPECT_EQ(m.errors_by_code.at("RESOURCE_EXHAUSTED"), 1);
  // Window: first intended (0) to last end (2000 ms).
  EXPECT_DOUBLE_EQ(m.duration_s, 2.0);
  EXPECT_EQ(m.output_tokens, 2 + 4 + 3);
  EXPECT_EQ(m.input_tokens, 30);
  EXPECT_DOUBLE_EQ(m.request_throughput, 1.5);
  EXPECT_DOUBLE_EQ(m.output_token_throughput, 4.5);
  EXPECT_DOUBLE_EQ(m.input_token_throughput, 15);
  // TTFT: 100, 150, 100. TPOT: 50, (500 - 150) / 3, (200 - 100) / 2. E2E: 150, 500, 200.
  EXPECT_EQ(m.ttft_ms.count, 3);
  EXPECT_DOUBLE_EQ(m.ttft_ms.mean, 350.0 / 3.0);
  EXPECT_DOUBLE_EQ(m.ttft_ms.median, 100);
  EXPECT_DOUBLE_EQ(m.ttft_ms.max, 150);
  EXPECT_DOUBLE_EQ(m.tpot_ms.median, 50);
  EXPECT_DOUBLE_EQ(m.tpot_ms.max, 350.0 / 3.0);
  EXPECT_DOUBLE_EQ(m.e2e_ms.mean, 850.0 / 3.0);
  EXPECT_DOUBLE_EQ(m.e2e_ms.p90, 440);  // rank 1.8 of {150, 200, 500}
  // ITL: {50}, {25, 25}, {50, 50}.
  EXPECT_EQ(m.itl_ms.count, 5);
  EXPECT_DOUBLE_EQ(m.itl_ms.mean, 40);
  EXPECT_DOUBLE_EQ(m.itl_ms.median, 50);
  EXPECT_DOUBLE_EQ(m.send_lag_ms.max, 2);
  // No server sent its Timing: those distributions are empty, not zeros.
  EXPECT_EQ(m.server_queue_ms.count, 0);
  EXPECT_EQ(m.server_ttft_ms.count, 0);
}

TEST(RunMetricsTest, ServerTimingCountsOnlySuccessfulRequestsThatCarryIt) {
  std::vector<RequestRecord> records = {
      Record(0, 0, 0, {100, 150}, {1, 1}, 150, 2),
      Record(1, 10, 10, {100, 150}, {1, 1}, 150, 2),
      Record(2, 20, 20, {100, 150}, {1, 1}, 150, 2),  // no Timing (an older server)
      Failed(3, 30, 40, 14, "UNAVAILABLE"),
  };
  records[0].server = {
      .has = true, .preprocess_ms = 1, .queue_ms = 4, .prefill_wait_ms = 20, .prefill_ms = 40};
  records[1].server = {.has = true, .preprocess_ms = 1, .queue_ms = 10, .prefill_ms = 40};
  records[3].server = {.has = true, .preprocess_ms = 1, .queue_ms = 1000, .prefill_ms = 1000};
  const RunMetrics m = ComputeRunMetrics(records);
  EXPECT_EQ(m.server_queue_ms.count, 2);
  EXPECT_DOUBLE_EQ(m.server_queue_ms.max, 10);
  EXPECT_DOUBLE_EQ(m.server_prefill_wait_ms.max, 20);
  EXPECT_DOUBLE_EQ(m.server_prefill_ms.mean, 40);
  EXPECT_DOUBLE_EQ(m.server_ttft_ms.min, 51);
  EXPECT_DOUBLE_EQ(m.server_ttft_ms.max, 65);
}

TEST(RunMetricsTest, TimelineConservesTokensAndCompletions) {
  const std::vector<RequestRecord> records = {
      Record(0, 0, 0, {100, 150}, {1, 1}, 150, 2),
      Record(1, 500, 500, {650, 700, 1999}, {2, 2, 3}, 2000, 7),
      Failed(2, 300, 400, 14, "UNAVAILABLE"),
  };
  const RunMetrics m = ComputeRunMetrics(records, 60);
  ASSERT_DOUBLE_EQ(m.bin_ms, 50);
  ASSERT_EQ(m.timeline.size(), 41u);  // [0, 2000] in 50 ms bins, last one holds t = 2000
  double tokens = 0, completed = 0;
  for (const RateBin& b : m.timeline) {
    tokens += b.tokens_per_s * m.bin_ms / 1000.0;
    completed += b.requests_completed;
  }
  EXPECT_NEAR(tokens, 9, 1e-9);
  EXPECT_DOUBLE_EQ(completed, 2);
  EXPECT_NEAR(m.timeline[13].tokens_per_s, 2 / 0.05, 1e-9);  // 650 ms: the 2-token message
  EXPECT_DOUBLE_EQ(m.timeline[3].requests_completed, 1);     // 150 ms
}

TEST(RunMetricsTest, EmptyRun) {
  const RunMetrics m = ComputeRunMetrics({});
  EXPECT_EQ(m.requests_total, 0);
  EXPECT_EQ(m.request_throughput, 0);
  EXPECT_TRUE(m.timeline.empty());
}

}  // namespace
}  // namespace ts::load
