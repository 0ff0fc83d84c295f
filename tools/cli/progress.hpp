// Progress of the exact-kNN job on stderr: a bar redrawn in place when stderr is a terminal, a log
// line every tenth of the way otherwise (so CI logs stay readable).
#pragma once
#include <cstddef>
#include "exact_knn.hpp"

namespace gpupool::cli {

class ProgressReporter {
 public:
  explicit ProgressReporter(bool enabled);
  void operator()(const exact::Progress& progress);
  void finish();  // ends the bar's line

 private:
  bool enabled_;
  bool terminal_;
  int last_tenth_ = -1;
  bool drawn_ = false;
};

}  // namespace gpupool::cli
