#include <cstdio>
#include <fmt/format.h>
#include <string>
#include <utility>
#include <unistd.h>
#include "progress.hpp"

namespace gpupool::cli {

ProgressReporter::ProgressReporter(bool enabled)
    : enabled_(enabled), terminal_(::isatty(STDERR_FILENO) == 1) {}

ProgressReporter::ProgressReporter(bool enabled, std::string label)
    : enabled_(enabled), label_(std::move(label)), terminal_(false) {}

namespace {

// "4096/60000 base rows", and which queries when the job works in several query blocks.
std::string position(const exact::Progress& p) {
  std::string rows = fmt::format("{}/{} base rows", p.base_rows_done, p.base_rows);
  if (p.block_queries >= p.queries) return rows;
  return fmt::format("queries {}..{} of {}: {}", p.queries_done,
                     p.queries_done + p.block_queries - 1, p.queries, rows);
}

}  // namespace

void ProgressReporter::operator()(const exact::Progress& p) {
  if (!enabled_ || p.base_rows == 0 || p.queries == 0) return;
  double fraction = p.fraction();
  if (terminal_) {
    constexpr int width = 30;
    int filled = static_cast<int>(fraction * width);
    fmt::print(stderr, "\r[{}{}] {:3.0f}% {}, {} chunks, {} retries, {:.1f} s",
               std::string(static_cast<std::size_t>(filled), '#'),
               std::string(static_cast<std::size_t>(width - filled), '.'), fraction * 100,
               position(p), p.chunks, p.retries, p.seconds);
    std::fflush(stderr);
    drawn_ = true;
    return;
  }
  int tenth = static_cast<int>(fraction * 10);
  if (tenth == last_tenth_) return;
  last_tenth_ = tenth;
  fmt::print(stderr, "knn: {}{}{} ({:.0f}%), {} chunks, {} retries, {:.1f} s\n", label_,
             label_.empty() ? "" : ": ", position(p), fraction * 100, p.chunks, p.retries, p.seconds);
}

void ProgressReporter::finish() {
  if (drawn_) fmt::print(stderr, "\n");
  drawn_ = false;
}

}  // namespace gpupool::cli
