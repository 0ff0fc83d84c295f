// Internal: the kNN filter's thresholds from a sample of the corpus in one resident kernel
// (gpu/cuda/sample_minima.cu). The filter needs, for each query, a distance that at least k rows
// reach. The k-th best distance of a sample is one (the tiled path's GEMM and top-k pass made it,
// at a fifth of a filtered call: the sample's Q × S matrix written, then read and sorted). The
// k-th best of the sample's group minima is another: k groups each hold a row at least that
// good. With groups of 32 rows and k well below the number of groups it lets through as few
// rows as the sample's own k-th (a group rarely holds two of the sample's best k), and it costs
// one pass of the filter's own kernel over the sample that writes Q × S / 32 floats, and a radix
// select of the k-th of those per query. gpu/cuda_backend.cpp drives it: gather the sample,
// these thresholds, then knn_filter with them.
#pragma once

#include "kernels.cuh"
#include "filter_sample.hpp"  // kMinimaGroupRows
#include "knn_filter.cuh"

#include <cstddef>
#include <cstdint>

namespace gpupool::cuda_kernels {

struct MinimaArgs {
  // fp16 / bf16 / int8 rows (or fp32-accurate's scaled fp16 copies) that knn_filter's resident
  // kernel reads (resident_filter_runs)
  Matrix q;
  Matrix x;  // the sample's rows side by side (gather_pieces), a multiple of 128 of them
  std::size_t dim = 0;
  Metric metric = Metric::L2;
  const float* q_norms = nullptr;  // squared norms (L2, cosine)
  const float* x_norms = nullptr;  // the sample rows', gathered like them
  std::size_t k = 0;               // at most x.rows / kMinimaGroupRows
  // FilterArgs::lower_bound of the filter these thresholds are for (fp32-accurate: q and x are
  // scale_to_fp16 copies with their scales, the norms the fp32 rows'), or 0. With it each group's
  // minimum is of the rows' upper bounds (distance + the error bound), so that k rows' exact
  // distances reach the threshold.
  float lower_bound = 0.0f;
  // Scratch, q.rows × x.rows / kMinimaGroupRows: each group's least distance (NaN only where all
  // its rows' are).
  float* minima = nullptr;
  // Out, one a query: the k-th least of its group minima (NaN last), FilterArgs::thresholds.
  float* thresholds = nullptr;
};

Status sample_minima(const MinimaArgs& args, void* stream);

}  // namespace gpupool::cuda_kernels
