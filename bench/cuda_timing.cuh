// What the standalone CUDA benchmarks (matrix_traffic_bench, read_floor_bench) share: a failed
// CUDA call as an exception their main reports, and the median of launches timed between events.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

namespace gpupool::bench {

struct Failure {
  std::string what;
};

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Failure{std::string(what) + ": " + cudaGetErrorString(e)};
}

// The median, in ms, of `reps` calls of `launch` (which enqueues on `stream`), each between two
// events recorded on `stream`. The caller warms up first.
template <class Launch>
double event_median_ms(cudaStream_t stream, int reps, Launch&& launch) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) {
    check(cudaEventRecord(start, stream), "cudaEventRecord");
    launch();
    check(cudaEventRecord(stop, stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "the timed launch");
    float m = 0;
    check(cudaEventElapsedTime(&m, start, stop), "cudaEventElapsedTime");
    ms.push_back(m);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace gpupool::bench
