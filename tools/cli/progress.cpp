#include <cstdio>
#include <fmt/format.h>
#include <string>
#include <unistd.h>
#include "progress.hpp"

namespace gpupool::cli {

ProgressReporter::ProgressReporter(bool enabled)
    : enabled_(enabled), terminal_(::isatty(STDERR_FILENO) == 1) {}

void ProgressReporter::operator()(const exact::Progress& p) {
  if (!enabled_ || p.base_rows == 0) return;
  double fraction = static_cast<double>(p.base_rows_done) / static_cast<double>(p.base_rows);
  if (terminal_) {
    constexpr int width = 30;
    int filled = static_cast<int>(fraction * width);
    fmt::print(stderr, "\r[{}{}] {:3.0f}% {}/{} base rows, {} chunks, {} retries, {:.1f} s",
               std::string(static_cast<std::size_t>(filled), '#'),
               std::string(static_cast<std::size_t>(width - filled), '.'), fraction * 100,
               p.base_rows_done, p.base_rows, p.chunks, p.retries, p.seconds);
    std::fflush(stderr);
    drawn_ = true;
    return;
  }
  int tenth = static_cast<int>(fraction * 10);
  if (tenth == last_tenth_) return;
  last_tenth_ = tenth;
  fmt::print(stderr, "knn: {}/{} base rows ({:.0f}%), {} chunks, {} retries, {:.1f} s\n",
             p.base_rows_done, p.base_rows, fraction * 100, p.chunks, p.retries, p.seconds);
}

void ProgressReporter::finish() {
  if (drawn_) fmt::print(stderr, "\n");
  drawn_ = false;
}

}  // namespace gpupool::cli
