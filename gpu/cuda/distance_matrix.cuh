// Internal: the fused distance matrix of gpupool:kernels (gpu/cuda/distance_matrix.cu). One kernel
// multiplies query and corpus tiles on the tensor cores (tile_product.cuh) and writes distances
// straight from its registers, so the Q × N matrix is written once and never read back (the
// cuBLAS path writes dot products, then reads and rewrites them in an epilogue pass).
#pragma once

#include "kernels.cuh"

#include <cstddef>

namespace gpupool::cudak {

struct MatrixArgs {
  Matrix q;  // fp16, bf16, int8 (per-row scales) or fp32 rows
  Matrix x;
  std::size_t dim = 0;
  Metric metric = Metric::L2;
  // fp32 rows: true = fp32-accurate (3×TF32 products, and L2 pairs whose GEMM form cancelled
  // recomputed from the fp32 rows), false = TF32 products.
  bool accurate = true;
  const float* q_norms = nullptr;  // squared norms (dequantised for int8); L2 and cosine
  const float* x_norms = nullptr;
  float* out = nullptr;  // q.rows × x.rows, row-major
};

// Rows must be whole 16-byte chunks (tiles_read_rows).
Status distance_matrix(const MatrixArgs& args, void* stream);

}  // namespace gpupool::cudak
