// Internal: the fused distance matrix of gpupool:kernels (gpu/cuda/distance_matrix.cu). One kernel
// multiplies query and corpus tiles on the tensor cores (tile_product.cuh) and writes distances
// straight from its registers, so the Q × N matrix is written once and never read back (the
// cuBLAS path writes dot products, then reads and rewrites them in an epilogue pass). Two kernel
// forms: tile_product.cuh's (mma.sync) and, on compute capability 9.0, resident_tiles.cuh's (wgmma)
// where distance_matrix.cu's resident_matrix says.
#pragma once

#include "kernels.cuh"

#include <cstddef>

namespace gpupool::cuda_kernels {

struct MatrixArgs {
  Matrix q;  // fp16, bf16, int8 (per-row scales) or fp32 rows
  Matrix x;
  std::size_t dim = 0;
  Metric metric = Metric::L2;
  // fp32 rows: true = fp32-accurate (3×TF32 products, and L2 pairs whose GEMM form cancelled
  // recomputed from the fp32 rows), false = TF32 products.
  bool accurate = true;
  // Squared norms (dequantised for int8); L2 and cosine. x_norms may be null where
  // matrix_sums_corpus_norms says: the kernel then sums them from its tiles.
  const float* q_norms = nullptr;
  const float* x_norms = nullptr;
  float* out = nullptr;  // q.rows × x.rows, row-major
  // fp32-accurate on the resident kernel (matrix_takes_halves): split_to_fp16's rows of q and x,
  // which the kernel multiplies, their scales then in q.scales and x.scales (fp32 rows have none
  // of their own); q and x stay the fp32 rows, from which it computes the pairs the halves cannot
  // give (cancelled L2, rows split_to_fp16 could not scale). Null: not split. (Two pointers, not
  // two Matrix: at 168 bytes the kernels' argument no longer went into registers whole, and the
  // PTX of every matrix kernel changed.)
  const void* q_halves = nullptr;
  const void* x_halves = nullptr;
};

// Rows must be whole 16-byte chunks (tiles_read_rows).
Status distance_matrix(const MatrixArgs& args, void* stream);

// Whether distance_matrix runs the resident (wgmma) kernel for these rows, which sums the corpus
// norms from the tiles it holds in shared memory (saving pairwise() a pass over the corpus:
// 0.1 ms of 2.3 at fp16 (1024, 2^20, 128) on an H100). GPUPOOL_MATRIX_TILE_NORMS=0 says no, for
// comparing the two in one build. `accurate` as MatrixArgs's.
bool matrix_sums_corpus_norms(const Matrix& x, std::size_t q_rows, std::size_t dim, bool accurate);

// Whether distance_matrix can run the fp32-accurate matrix on split_to_fp16's halves of the rows
// (the resident kernel on wgmma::Fp16Halves: rows of up to 128 values, compute capability 9.0;
// split_to_fp16 reads 16-byte aligned rows of whole 16-byte pieces), which pairwise() then makes
// (with the rows' norms, in the same pass). `accurate` as MatrixArgs's.
bool matrix_takes_halves(const Matrix& q, const Matrix& x, std::size_t dim, bool accurate);

// Whether pairwise() takes the fused kernel, where it measured faster than cuBLAS + the epilogue
// pass (H100; docs/benchmarks.md, "Why the dispatch rules are where they are"): int8 always
// (int32 MMAs against a GEMM on fp16 widenings); otherwise 64+ queries (Q = 1 ran 1.1-1.9×
// slower: 127 of a tile's 128 query columns idle) and, for TF32 / fp16 / bf16, rows of at most
// 1 KiB (at D = 960 cuBLAS's wgmma GEMM ran 1.2-1.6× faster); fp32-accurate at any length (3×TF32
// in registers: 1.3× faster at D = 960).
inline constexpr std::size_t kFusedMatrixMinQueries = 64;
inline constexpr std::size_t kFusedMatrixMaxRowBytes = 1024;
inline bool fused_matrix(Element element, std::size_t q_rows, std::size_t dim, bool tf32) {
  if (!tiles_read_rows(element, dim)) return false;
  if (element == Element::Int8) return true;
  if (q_rows < kFusedMatrixMinQueries) return false;
  if (element == Element::Fp32 && !tf32) return true;
  std::size_t bytes = element == Element::Fp32 ? 4 : 2;
  return dim * bytes <= kFusedMatrixMaxRowBytes;
}

}  // namespace gpupool::cuda_kernels
