#include "bench/load/svg.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ts::load {
namespace {

// Plot area margins in px: room for tick labels (left, bottom) and the title (top).
constexpr double kLeft = 64, kRight = 16, kTop = 28, kBottom = 44;

std::string Num(double v) {
  if (v == 0) return "0";
  const double a = std::fabs(v);
  if (a >= 1e5 || a < 1e-3) return absl::StrFormat("%.2g", v);
  return absl::StrFormat("%.4g", v);
}

struct Frame {
  double x0, x1, y0, y1;  // data range
  double w, h;            // whole svg
  double PxX(double x) const {
    return kLeft + (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5) * (w - kLeft - kRight);
  }
  double PxY(double y) const {
    return h - kBottom - (y1 > y0 ? (y - y0) / (y1 - y0) : 0.5) * (h - kTop - kBottom);
  }
};

// Widens a degenerate range so a single value still gets a visible axis.
void Widen(double& lo, double& hi) {
  if (!(hi > lo)) {
    const double pad = lo == 0 ? 1.0 : std::fabs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
}

std::string OpenSvg(const ChartOptions& o) {
  return absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
      "font-family=\"sans-serif\" font-size=\"11\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%d\" y=\"18\" text-anchor=\"middle\" font-size=\"13\" font-weight=\"bold\">%s"
      "</text>\n",
      o.width, o.height, o.width, o.height, o.width / 2, EscapeXml(o.title));
}

// Grid, ticks and axis labels; returns the frame after snapping the range to the ticks.
std::string Axes(const ChartOptions& o, Frame& f) {
  const std::vector<double> xt = NiceTicks(f.x0, f.x1, 6);
  const std::vector<double> yt = NiceTicks(f.y0, f.y1, 5);
  if (!xt.empty()) f.x0 = std::min(f.x0, xt.front()), f.x1 = std::max(f.x1, xt.back());
  if (!yt.empty()) f.y0 = std::min(f.y0, yt.front()), f.y1 = std::max(f.y1, yt.back());
  std::string s;
  for (double x : xt) {
    const double px = f.PxX(x);
    absl::StrAppendFormat(
        &s,
        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e4e4e4\"/>"
        "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n",
        px, kTop, px, f.h - kBottom, px, f.h - kBottom + 14, Num(x));
  }
  for (double y : yt) {
    const double py = f.PxY(y);
    absl::StrAppendFormat(
        &s,
        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e4e4e4\"/>"
        "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n",
        kLeft, py, f.w - kRight, py, kLeft - 4, py + 4, Num(y));
  }
  absl::StrAppendFormat(&s,
                        "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
                        "stroke=\"#888\"/>\n",
                        kLeft, kTop, f.w - kLeft - kRight, f.h - kTop - kBottom);
  absl::StrAppendFormat(&s, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n",
                        (kLeft + f.w - kRight) / 2, f.h - 8, EscapeXml(o.x_label));
  absl::StrAppendFormat(&s,
                        "<text x=\"14\" y=\"%.1f\" text-anchor=\"middle\" "
                        "transform=\"rotate(-90 14 %.1f)\">%s</text>\n",
                        (kTop + f.h - kBottom) / 2, (kTop + f.h - kBottom) / 2,
                        EscapeXml(o.y_label));
  return s;
}

std::string NoData(const ChartOptions& o) {
  return OpenSvg(o) + absl::StrFormat(
                          "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" fill=\"#888\">no data"
                          "</text>\n</svg>\n",
                          o.width / 2, o.height / 2);
}

}  // namespace

std::string EscapeXml(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::vector<double> NiceTicks(double lo, double hi, int target) {
  if (!std::isfinite(lo) || !std::isfinite(hi) || target < 1) return {};
  Widen(lo, hi);
  const double raw = (hi - lo) / target;
  const double decade = std::pow(10.0, std::floor(std::log10(raw)));
  double step = 10 * decade;
  for (double m : {1.0, 2.0, 5.0}) {
    if (m * decade >= raw) {
      step = m * decade;
      break;
    }
  }
  std::vector<double> ticks;
  for (double t = std::floor(lo / step) * step; t <= hi + step * 0.5; t += step) {
    ticks.push_back(std::fabs(t) < step * 1e-9 ? 0.0 : t);
    if (ticks.size() > 100) break;  // guards against float pathologies
  }
  return ticks;
}

std::vector<Point> CdfPoints(std::vector<double> values, size_t max_points) {
  std::erase_if(values, [](double v) { return std::isnan(v); });
  std::sort(values.begin(), values.end());
  std::vector<Point> pts;
  const size_t n = values.size();
  if (n == 0 || max_points == 0) return pts;
  const size_t keep = std::min(n, std::max<size_t>(max_points, 2));
  for (size_t k = 0; k < keep; ++k) {
    const size_t i = keep == 1 ? 0 : k * (n - 1) / (keep - 1);
    pts.emplace_back(values[i], static_cast<double>(i + 1) / static_cast<double>(n));
  }
  return pts;
}

std::string LineChartSvg(const ChartOptions& o, std::span<const Series> series) {
  Frame f{std::numeric_limits<double>::infinity(),
          -std::numeric_limits<double>::infinity(),
          std::numeric_limits<double>::infinity(),
          -std::numeric_limits<double>::infinity(),
          static_cast<double>(o.width),
          static_cast<double>(o.height)};
  for (const Series& s : series) {
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(x) || !std::isfinite(y)) continue;
      f.x0 = std::min(f.x0, x), f.x1 = std::max(f.x1, x);
      f.y0 = std::min(f.y0, y), f.y1 = std::max(f.y1, y);
    }
  }
  if (!std::isfinite(f.x0)) return NoData(o);
  if (o.y_from_zero) f.y0 = std::min(f.y0, 0.0);
  Widen(f.x0, f.x1);
  Widen(f.y0, f.y1);
  std::string svg = OpenSvg(o) + Axes(o, f);
  double legend_x = kLeft + 8;
  for (const Series& s : series) {
    std::string pts;
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(x) || !std::isfinite(y)) continue;
      if (o.dots) {
        absl::StrAppendFormat(&svg, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"2\" fill=\"%s\"/>",
                              f.PxX(x), f.PxY(y), s.color);
      } else {
        absl::StrAppendFormat(&pts, "%.1f,%.1f ", f.PxX(x), f.PxY(y));
      }
    }
    if (!o.dots) {
      absl::StrAppendFormat(&svg,
                            "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.6\" "
                            "points=\"%s\"/>\n",
                            s.color, pts);
    }
    if (series.size() > 1 && !s.name.empty()) {
      absl::StrAppendFormat(&svg,
                            "<rect x=\"%.1f\" y=\"%.1f\" width=\"10\" height=\"10\" fill=\"%s\"/>"
                            "<text x=\"%.1f\" y=\"%.1f\">%s</text>\n",
                            legend_x, kTop + 6, s.color, legend_x + 14, kTop + 15,
                            EscapeXml(s.name));
      legend_x += 24 + 7.0 * static_cast<double>(s.name.size());
    }
  }
  return svg + "</svg>\n";
}

std::string HistogramSvg(const ChartOptions& o, std::span<const double> values, int bins,
                         absl::string_view color) {
  std::vector<double> v;
  for (double x : values) {
    if (std::isfinite(x)) v.push_back(x);
  }
  if (v.empty() || bins < 1) return NoData(o);
  const auto [mn, mx] = std::minmax_element(v.begin(), v.end());
  double lo = *mn, hi = *mx;
  Widen(lo, hi);
  const double width = (hi - lo) / bins;
  std::vector<int64_t> counts(static_cast<size_t>(bins), 0);
  for (double x : v) {
    const int b = std::clamp(static_cast<int>((x - lo) / width), 0, bins - 1);
    ++counts[static_cast<size_t>(b)];
  }
  Frame f{lo,
          hi,
          0.0,
          static_cast<double>(*std::max_element(counts.begin(), counts.end())),
          static_cast<double>(o.width),
          static_cast<double>(o.height)};
  Widen(f.y0, f.y1);
  std::string svg = OpenSvg(o) + Axes(o, f);
  for (int b = 0; b < bins; ++b) {
    const double x0 = f.PxX(lo + b * width), x1 = f.PxX(lo + (b + 1) * width);
    const double y = f.PxY(static_cast<double>(counts[static_cast<size_t>(b)]));
    absl::StrAppendFormat(&svg,
                          "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\" "
                          "fill-opacity=\"0.8\"><title>%s..%s: %d</title></rect>\n",
                          x0, y, std::max(x1 - x0 - 1, 0.5), f.PxY(0) - y, color,
                          Num(lo + b * width), Num(lo + (b + 1) * width),
                          counts[static_cast<size_t>(b)]);
  }
  return svg + "</svg>\n";
}

}  // namespace ts::load
