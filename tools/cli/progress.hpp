// Progress of the exact-kNN job on stderr: a bar redrawn in place when stderr is a terminal, a log
// line every tenth of the way otherwise (so CI logs stay readable).
#pragma once
#include <cstddef>
#include <string>
#include "exact_knn.hpp"

namespace gpupool::cli {

class ProgressReporter {
 public:
  explicit ProgressReporter(bool enabled);
  // One of several jobs at once (a device of a split job): log lines prefixed by `label`, never
  // a bar redrawn in place, which several jobs would overwrite.
  ProgressReporter(bool enabled, std::string label);
  void operator()(const exact::Progress& progress);
  void finish();  // ends the bar's line

 private:
  bool enabled_;
  std::string label_;  // "device 1" and the like; empty for the one job
  bool terminal_;
  int last_tenth_ = -1;
  bool drawn_ = false;
};

}  // namespace gpupool::cli
