// Minimal inline-SVG charts for report.html: no scripts, no external files, so the report opens
// anywhere a browser does.
#pragma once

#include <span>
#include <string>
#include <utility>
#include <vector>
#include "absl/strings/string_view.h"

namespace ts::load {

using Point = std::pair<double, double>;  // (x, y)

struct Series {
  std::string name;
  std::string color;  // CSS color
  std::vector<Point> points;
};

struct ChartOptions {
  std::string title;
  std::string x_label;
  std::string y_label;
  int width = 560;
  int height = 320;
  bool dots = false;  // scatter (dots only) instead of a polyline
  bool y_from_zero = true;
};

std::string EscapeXml(absl::string_view text);

// About `target` round tick values (1, 2 or 5 x 10^k steps) covering [lo, hi].
std::vector<double> NiceTicks(double lo, double hi, int target);

// Empirical CDF of `values` (NaNs dropped) as (value, fraction <= value), thinned to at most
// max_points by keeping evenly spaced ranks (always the first and last).
std::vector<Point> CdfPoints(std::vector<double> values, size_t max_points);

// Line (or scatter) chart of one or more series on shared linear axes.
std::string LineChartSvg(const ChartOptions& options, std::span<const Series> series);

// Histogram of `values` (NaNs dropped) with `bins` equal-width bars; y = count.
std::string HistogramSvg(const ChartOptions& options, std::span<const double> values, int bins,
                         absl::string_view color);

}  // namespace ts::load
