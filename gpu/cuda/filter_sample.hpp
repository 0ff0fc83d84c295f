// The kNN filter's sample layout, in plain C++: the kernels (knn_filter.cuh, sample_minima.cuh)
// read samples of this shape and the host plan (gpu/knn_plan.hpp) sizes them, in every build.
#pragma once

#include <cstddef>

namespace gpupool::cuda_kernels {

// The sample: rows [p · period, p · period + length) for p < kFilterPieces, spread over the
// corpus so that its order (sorted, clustered) does not make the thresholds loose.
inline constexpr std::size_t kFilterPieces = 16;
struct FilterSample {
  std::size_t period = 0;
  std::size_t length = 0;
};

// The rows of one group of the sample's minima (sample_minima.cuh): those a thread of the
// resident kernel holds of a 128-row tile.
inline constexpr std::size_t kMinimaGroupRows = 32;

}  // namespace gpupool::cuda_kernels
