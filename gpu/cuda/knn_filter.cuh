// Internal: the fused kNN filter of gpupool:kernels (gpu/cuda/knn_filter.cu). Tensor-core products
// of query and corpus tiles become distances in registers and are compared at once with each
// query's threshold, which a sample of the corpus gives (its k-th best distance, or the k-th best
// of its group minima: sample_minima.cuh); only the rows that beat it leave the kernel, into
// per-query candidate lists. The Q × N matrix is never written anywhere.
// gpu/cuda_backend.cpp drives it: sample, filter, merge, and the tiled path when a list overflows.
// Three kernel forms: tile_product.cuh's (mma.sync) and, on compute capability 9.0, resident_tiles.cuh's
// (wgmma) where knn_filter.cu's kResidentFilterTakes says (resident_filter_runs) and, for the same
// element types' longer rows, streamed_tiles.cuh's (wgmma, streamed_filter_runs).
#pragma once

#include "filter_sample.hpp"  // kFilterPieces, FilterSample
#include "kernels.cuh"

#include <cstddef>
#include <cstdint>

namespace gpupool::cuda_kernels {

struct FilterArgs {
  // fp16, bf16, int8 (exact int32 sums, scaled), fp32 rows (TF32 products), or, with lower_bound,
  // fp16 rows scaled by a power of two each (scale_to_fp16; scales in Matrix::scales).
  Matrix q;
  Matrix x;             // the whole corpus; candidate indices are its row numbers
  std::size_t dim = 0;  // elements per row; a multiple of 16 bytes (tiles_read_rows)
  Metric metric = Metric::L2;
  const float* q_norms = nullptr;  // squared norms (L2, cosine)
  const float* x_norms = nullptr;
  // Each query's running top-k (k per row, sorted): entry k - 1 is its threshold, ties by index.
  const float* run_d = nullptr;
  const std::int32_t* run_i = nullptr;
  std::size_t k = 0;
  FilterSample sample;  // rows already folded into the running lists, skipped here
  // Or, instead of the lists' entries, one threshold a query that at least k rows reach
  // (sample_minima.cuh; sample then empty): rows at or under it are kept, whatever their index,
  // and where it is NaN (fewer than k rows of the sample have a distance), every row with a
  // distance and the NaN ones among the first k rows.
  const float* thresholds = nullptr;
  // Optional, per query (knn's upper bounds): rows farther than it are not wanted, so a query's
  // threshold is the tighter of the above and (bound, any index).
  const float* bounds = nullptr;
  // lower_bound > 0 (fp32-accurate mode): q and x are scale_to_fp16 copies of fp32 rows, so the
  // products approximate the fp32 ones, and a row is kept when its distance minus lower_bound ×
  // (the metric's error scale) beats the threshold, so that no row whose exact distance would
  // beat it is dropped. The kept rows' distances are then recomputed exactly by rerank_distances.
  float lower_bound = 0.0f;
  // Per query: capacity slots of candidates and a count of rows kept (it can exceed capacity:
  // that query's list overflowed and is incomplete).
  float* cand_d = nullptr;
  std::int32_t* cand_i = nullptr;
  std::uint32_t* counts = nullptr;
  std::size_t capacity = 0;
};

// Relative error bound of a scaled-fp16 product sum against the fp32 one, per unit of
// Σ|q_c|·|x_c|: each operand rounded to nearest with 10 mantissa bits (2^-11 each, and fp16
// subnormals at most 2^-39 of the row's largest value), with a factor 2 to spare. The fp32
// accumulation's own rounding is the caller's dim · 2^-23 term.
inline constexpr float kScaledFp16ProductError = 0x1p-9f;

// Whether knn_filter runs its resident (wgmma) kernel on rows of this element type and length at
// `data`, on the current device: fp16, bf16 or int8 rows (fp16: fp32-accurate's scaled copies
// too) that the copy engine reads.
bool resident_filter_runs(Element element, std::size_t dim, const void* data);
// The same for rows 16-byte aligned wherever they lie (a pool's buffers).
bool resident_filter_takes(Element element, std::size_t dim);

// Whether knn_filter runs its streamed (wgmma) kernel (streamed_tiles.cuh) on rows too long for
// the resident one: the same element types, rows of whole 16-byte pieces over 256 bytes, queries
// and corpus 16-byte aligned, on the current device.
bool streamed_filter_runs(Element element, std::size_t dim, const void* queries,
                          const void* corpus);

// counts must be zero before the call (the filter only adds to them).
Status knn_filter(const FilterArgs& args, void* stream);

// Waits for `stream`, then says whether any of the `rows` counts exceeds `capacity` (a list that
// overflowed: its query needs the tiled path).
Status filter_overflowed(const std::uint32_t* counts, std::size_t rows, std::size_t capacity,
                         void* stream, bool& overflowed);

}  // namespace gpupool::cuda_kernels
