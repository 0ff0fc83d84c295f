// Progress of process_in_batches for people: a bar redrawn in place on a terminal, log lines
// elsewhere (CI logs, files), where a bar's carriage returns would be noise.
module;
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <fmt/format.h>
#include <memory>
#include <optional>
#include <string>
#include <unistd.h>
module gpupool;

namespace gpupool {

namespace {

std::string format_rate(double items_per_second) {
  if (items_per_second >= 1e9) return fmt::format("{:.1f}G", items_per_second / 1e9);
  if (items_per_second >= 1e6) return fmt::format("{:.1f}M", items_per_second / 1e6);
  if (items_per_second >= 1e3) return fmt::format("{:.1f}k", items_per_second / 1e3);
  return fmt::format("{:.1f}", items_per_second);
}

bool finished(const BatchProgress& p) { return p.items_total && p.items_done >= *p.items_total; }

}  // namespace

std::string format_progress_bar(const BatchProgress& p, std::size_t width) {
  std::string bar;
  if (p.items_total && *p.items_total > 0) {
    double share = std::min(1.0, static_cast<double>(p.items_done) / static_cast<double>(*p.items_total));
    auto filled = static_cast<std::size_t>(share * static_cast<double>(width));
    bar = fmt::format("[{}{}] {:5.1f}%  {}/{} items", std::string(filled, '#'),
                      std::string(width - filled, '-'), share * 100.0, p.items_done, *p.items_total);
  } else {
    bar = fmt::format("[stream] {} items", p.items_done);  // no total: nothing to fill
  }
  return fmt::format("{}  batch {}  retries {}  {} items/s", bar, p.batch_size, p.retries,
                     format_rate(p.items_per_second));
}

std::string format_progress_line(const BatchProgress& p) {
  std::string done = p.items_total && *p.items_total > 0
                         ? fmt::format("{}/{} items ({:.1f}%)", p.items_done, *p.items_total,
                                       100.0 * static_cast<double>(p.items_done) /
                                           static_cast<double>(*p.items_total))
                         : fmt::format("{} items", p.items_done);
  return fmt::format("batching: {}, {} batches, batch size {}, {} retries, {:.1f} items/s", done,
                     p.batches_done, p.batch_size, p.retries, p.items_per_second);
}

ProgressCallback terminal_progress(std::FILE* out, ProgressStyle style,
                                   std::chrono::milliseconds interval) {
  if (style == ProgressStyle::Auto)
    style = out && ::isatty(::fileno(out)) ? ProgressStyle::Bar : ProgressStyle::Lines;
  // The callback is copied into options; the time of the last line is shared by the copies.
  auto last = std::make_shared<std::optional<std::chrono::steady_clock::time_point>>();
  return [out, style, interval, last](const BatchProgress& p) {
    if (!out) return;
    if (style == ProgressStyle::Bar) {
      std::fprintf(out, "\r%s%s", format_progress_bar(p).c_str(), finished(p) ? "\n" : "");
      std::fflush(out);
      return;
    }
    auto now = std::chrono::steady_clock::now();
    if (*last && now - **last < interval && !finished(p)) return;
    *last = now;
    std::fprintf(out, "%s\n", format_progress_line(p).c_str());
    std::fflush(out);
  };
}

}  // namespace gpupool
