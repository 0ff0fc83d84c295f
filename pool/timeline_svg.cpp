// The memory timeline: a trace drawn as SVG text. In use (dark) and cached (light) are stacked
// step areas, so their top edge is the reserved bytes; the limit is a dashed line; trims and
// out-of-memory errors are vertical marks.
module;
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <fmt/format.h>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>
module gpupool;

namespace gpupool {

namespace {

constexpr double kLeft = 90, kRight = 20, kTop = 40, kBottom = 60;

std::string escape_xml(std::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// A round step for about four byte ticks up to `top`: 1, 2, 2.5 or 5 × 10^k of a binary unit.
double tick_step(double top) {
  double unit = 1;
  while (top / unit >= 1024.0) unit *= 1024.0;
  const double raw = top / unit / 4.0;
  double decade = 1;
  while (decade * 10 <= raw) decade *= 10;
  while (decade > raw) decade /= 10;
  for (double nice : {1.0, 2.0, 2.5, 5.0, 10.0})
    if (nice * decade >= raw) return nice * decade * unit;
  return 10 * decade * unit;
}

std::string short_bytes(double bytes) {
  constexpr const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024.0 && unit < 4) {
    bytes /= 1024.0;
    ++unit;
  }
  return fmt::format("{:.4g} {}", bytes, units[unit]);
}

// Maps trace coordinates (x = time or event number, y = bytes) to pixels in the plot area.
struct Plot {
  double width, height, x_min, x_max, y_max, y_step;
  double x(double value) const {
    return kLeft + (value - x_min) / (x_max - x_min) * (width - kLeft - kRight);
  }
  double y(double bytes) const { return height - kBottom - bytes / y_max * (height - kTop - kBottom); }
};

// A step area from the baseline: value(i) holds from x(i) until x(i + 1).
template <class Value>
std::string step_area(const Plot& p, const std::vector<double>& xs, Value value) {
  std::string points = fmt::format("{:.2f},{:.2f}", p.x(xs.front()), p.y(0));
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const double next = i + 1 < xs.size() ? xs[i + 1] : p.x_max;
    points += fmt::format(" {:.2f},{:.2f} {:.2f},{:.2f}", p.x(xs[i]), p.y(value(i)), p.x(next), p.y(value(i)));
  }
  points += fmt::format(" {:.2f},{:.2f}", p.x(p.x_max), p.y(0));
  return points;
}

std::string axes(const Plot& p, bool by_event) {
  std::string svg = fmt::format(
      "<line x1=\"{0:.2f}\" y1=\"{1:.2f}\" x2=\"{2:.2f}\" y2=\"{1:.2f}\" stroke=\"#333\"/>\n"
      "<line x1=\"{0:.2f}\" y1=\"{1:.2f}\" x2=\"{0:.2f}\" y2=\"{3:.2f}\" stroke=\"#333\"/>\n",
      kLeft, p.y(0), p.width - kRight, kTop);
  for (double bytes = 0; bytes <= p.y_max * (1 + 1e-9); bytes += p.y_step)
    svg += fmt::format("<line x1=\"{0:.2f}\" y1=\"{1:.2f}\" x2=\"{2:.2f}\" y2=\"{1:.2f}\" stroke=\"#ddd\"/>"
                       "<text x=\"{3:.2f}\" y=\"{4:.2f}\" font-size=\"11\" text-anchor=\"end\">{5}</text>\n",
                       kLeft, p.y(bytes), p.width - kRight, kLeft - 6, p.y(bytes) + 4, short_bytes(bytes));
  for (int tick = 0; tick <= 4; ++tick) {
    const double at = p.x_min + (p.x_max - p.x_min) * tick / 4.0;
    svg += fmt::format("<text x=\"{:.2f}\" y=\"{:.2f}\" font-size=\"11\" text-anchor=\"middle\">{}</text>\n",
                       p.x(at), p.y(0) + 16, by_event ? fmt::format("{:.0f}", at) : fmt::format("{:.3g}", at / 1e6));
  }
  svg += fmt::format("<text x=\"{:.2f}\" y=\"{:.2f}\" font-size=\"12\" text-anchor=\"middle\">{}</text>\n",
                     (kLeft + p.width - kRight) / 2, p.height - 28, by_event ? "event" : "time (ms)");
  return svg;
}

std::string legend(const Plot& p) {
  struct Item { const char* colour; const char* text; bool line; };
  constexpr Item items[] = {{"#1f5fa8", "in use", false}, {"#9cc3ea", "cached", false},
                            {"#555", "limit", true}, {"#f08c00", "trim", true}, {"#d62728", "OOM", true}};
  std::string svg;
  double x = kLeft;
  const double y = p.height - 12;
  for (const Item& item : items) {
    svg += item.line
               ? fmt::format("<line x1=\"{0:.2f}\" y1=\"{1:.2f}\" x2=\"{2:.2f}\" y2=\"{1:.2f}\" stroke=\"{3}\" stroke-width=\"2\"/>",
                             x, y - 4, x + 14, item.colour)
               : fmt::format("<rect x=\"{:.2f}\" y=\"{:.2f}\" width=\"14\" height=\"10\" fill=\"{}\"/>", x, y - 9, item.colour);
    svg += fmt::format("<text x=\"{:.2f}\" y=\"{:.2f}\" font-size=\"11\">{}</text>\n", x + 18, y, item.text);
    x += 80;
  }
  return svg;
}

}  // namespace

Result<std::string> timeline_svg(const Trace& trace, const TimelineOptions& options) {
  if (options.width < 200 || options.height < 120)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("timeline of {}x{} pixels: expected at least 200x120",
                                  options.width, options.height));
  if (trace.events.empty())
    return make_error(ErrorKind::InvalidInput, "timeline of an empty trace: expected at least one event");
  const int device = options.device_id.value_or(trace.events.front().device_id);
  std::vector<TraceEvent> events;
  for (const TraceEvent& e : trace.events)
    if (e.device_id == device) events.push_back(e);
  if (events.empty())
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("the trace has no events of device {}: expected one of its devices", device));

  std::vector<double> xs;
  double y_max = 1;
  for (std::size_t i = 0; i < events.size(); ++i) {
    xs.push_back(options.by_event ? static_cast<double>(i) : static_cast<double>(events[i].time_ns));
    y_max = std::max({y_max, static_cast<double>(events[i].limit_bytes), static_cast<double>(events[i].reserved_bytes)});
  }
  const double x_max = xs.back() > xs.front() ? xs.back() : xs.front() + 1;
  const double step = tick_step(y_max * 1.05);
  const Plot p{static_cast<double>(options.width), static_cast<double>(options.height), xs.front(),
               x_max, std::ceil(y_max * 1.05 / step) * step, step};

  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{2:.2f}\" y=\"24\" font-size=\"15\" text-anchor=\"middle\">{3}</text>\n",
      options.width, options.height, options.width / 2.0,
      escape_xml(fmt::format("{} (device {}, {} events)", options.title, device, events.size())));
  svg += axes(p, options.by_event);
  svg += fmt::format("<polygon fill=\"#9cc3ea\" points=\"{}\"/>\n",
                     step_area(p, xs, [&](std::size_t i) { return static_cast<double>(events[i].reserved_bytes); }));
  svg += fmt::format("<polygon fill=\"#1f5fa8\" points=\"{}\"/>\n",
                     step_area(p, xs, [&](std::size_t i) { return static_cast<double>(events[i].in_use_bytes); }));
  std::string limit;
  for (std::size_t i = 0; i < events.size(); ++i) {
    const double next = i + 1 < xs.size() ? xs[i + 1] : p.x_max;
    const double y = p.y(static_cast<double>(events[i].limit_bytes));
    limit += fmt::format("{:.2f},{:.2f} {:.2f},{:.2f} ", p.x(xs[i]), y, p.x(next), y);
  }
  svg += fmt::format("<polyline fill=\"none\" stroke=\"#555\" stroke-width=\"1.5\" stroke-dasharray=\"6 4\" points=\"{}\"/>\n", limit);
  for (std::size_t i = 0; i < events.size(); ++i) {
    if (events[i].kind != TraceEventKind::Trim && events[i].kind != TraceEventKind::Oom) continue;
    const bool oom = events[i].kind == TraceEventKind::Oom;
    // An OOM crosses the whole plot; a trim is a tick along the top, so many of them stay readable.
    svg += fmt::format("<line class=\"{0}\" x1=\"{2:.2f}\" y1=\"{3:.2f}\" x2=\"{2:.2f}\" y2=\"{4:.2f}\" "
                       "stroke=\"{1}\" stroke-width=\"{5}\"><title>{6} {7}</title></line>\n",
                       oom ? "oom" : "trim", oom ? "#d62728" : "#f08c00", p.x(xs[i]), oom ? p.y(0) : kTop + 10,
                       kTop, oom ? 1.5 : 1.0, to_string(events[i].kind),
                       short_bytes(static_cast<double>(events[i].bytes)));
  }
  svg += legend(p);
  svg += "</svg>\n";
  return svg;
}

Result<void> write_timeline_svg(const Trace& trace, const std::string& path, const TimelineOptions& options) {
  auto svg = timeline_svg(trace, options);
  if (!svg) return std::unexpected(svg.error());
  std::ofstream file(path, std::ios::binary);
  if (file) file << *svg;
  if (!file.good()) return make_error(ErrorKind::Io, fmt::format("cannot write the timeline \"{}\"", path));
  return {};
}

}  // namespace gpupool
