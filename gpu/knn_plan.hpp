// Internal: how one kNN call runs, decided on the host from the shapes, the options and the memory
// the pool can spare (gpu/knn_plan.cpp). Plain C++ with no CUDA dependency, so that every build
// compiles it and the host tests (tests/knn_plan_test.cpp) check its rules; what only the device
// side can answer (which filter kernel takes the rows) arrives as KernelCapabilities.
// The kernel backends size the tiles (choose_tile); gpu/cuda_backend.cpp plans each CUDA call
// (plan_knn) and allocates and runs what the plan says.
#pragma once

#include "cuda/filter_sample.hpp"

#include <cstddef>

namespace gpupool::knn_plan {

// The fused filter's reach (knn_plan.cpp says why the lines lie where they do).
inline constexpr std::size_t kFilterMaxK = 256;
inline constexpr std::size_t kFilterMinRows = 65536;
inline constexpr std::size_t kFilterMinQueries = 64;
inline constexpr std::size_t kFilterMaxExactRowBytes = 1024;
inline constexpr double kFilterSampleFactor = 64.0;

// Where fp32-accurate tiles run 3×TF32 instead of plain fp32 FMA (knn_plan.cpp).
inline constexpr std::size_t kPlainFmaMaxQueries = 128;
inline constexpr std::size_t kSplitMaxDim = 256;

// The narrowest tile the queries are split for (lists of up to 4096 slots fit beside it), where
// the budget holds at least kWideTileMinRows queries of it (a GEMM of fewer rows runs slowly).
inline constexpr std::size_t kWideTileCols = 8192;
inline constexpr std::size_t kWideTileMinRows = 1024;

// The tiled path's tiles: `rows` queries at a time against `cols` corpus rows.
struct TileShape {
  std::size_t rows, cols;
};

// The tile for `headroom` bytes the pool may still take: half of it (the rest stays for everyone
// else), at most 64 MiB on a simulated device (cache-sized tiles are faster there) or 1 GiB on a
// GPU; min(N, kWideTileCols) columns at least, fewer queries at a time instead, where the budget
// holds kWideTileMinRows queries of them; at least one row of min(N, 256) columns.
TileShape choose_tile(std::size_t headroom, std::size_t q_rows, std::size_t n_rows, bool cuda);

// One CUDA kNN call (one chunk of queries) as the plan sees it.
struct KnnProblem {
  std::size_t queries = 0, rows = 0, dim = 0, k = 0;
  std::size_t value_bytes = 4;  // one corpus value: 4 fp32, 2 fp16 / bf16, 1 int8
  bool fp32 = false;            // fp32 rows (ComputeMode applies)
  bool int8 = false;            // int8 rows (the tiled GEMM reads them widened to fp16)
  bool accurate = true;         // ComputeMode::Fp32Accurate (else Tf32)
  bool inner_product = false;   // no row norms needed
  bool l2 = false;
  std::size_t tile_cols = 0;       // choose_tile's columns for this call
  std::size_t tile_bytes_cap = 0;  // GPUPOOL_KNN_TILE_BYTES (0: none), see capped_tile_cols
};

// Answers only the device side can give, for the problem's rows.
struct KernelCapabilities {
  // The fused filter reads the corpus rows (whole 16-byte chunks: cuda_kernels::tiles_read_rows).
  bool filter_reads_rows = false;
  // The resident filter kernel runs on the corpus rows as they lie (cuda_kernels::resident_filter_runs).
  bool resident_filter_on_corpus = false;
  // It runs on fp32-accurate's scaled fp16 copies (pool buffers, cuda_kernels::resident_filter_takes).
  bool resident_filter_on_scaled_copies = false;
  // The streamed filter kernel (rows too long for the resident one) runs on the queries and corpus
  // rows as they lie (cuda_kernels::streamed_filter_runs). Fp32-accurate's copies need no such
  // answer: its filter takes any D, on whichever kernel runs them.
  bool streamed_filter_on_corpus = false;
};

// When the fused filter runs, and with what sample and list capacity.
struct FilterPlan {
  bool on = false;
  cuda_kernels::FilterSample sample;
  std::size_t capacity = 0;  // candidate slots per query
  bool lower_bound = false;  // fp32-accurate: bounds on scaled fp16 copies, then the exact re-rank
  bool minima = false;       // thresholds from the sample's group minima (cuda_kernels::sample_minima)
};

struct KnnPlan {
  FilterPlan filter;
  // The call runs fp32-accurate: asked for, or TF32 mode taking the exact filter (accurate_filter).
  bool accurate = true;
  // The filter reads scale_to_fp16 copies of queries and corpus (filter.lower_bound): the caller
  // allocates them, and plans again with scaled_copies_fit = false where they do not fit.
  bool scaled_copies = false;
  bool norms = false;   // Q + N squared row norms
  bool split = false;   // fp32-accurate tiles through 3×TF32 (if its splits fit, else fp32 FMA)
  bool refine = false;  // L2 fp32-accurate: the cancellation re-compute reads the fp32 rows
  // The tiled path's columns: the whole corpus when unfiltered, else the sample (and the rare
  // fallback). The allocation may halve them where the pool has less room than it said.
  std::size_t tile_cols = 0;
};

// The plan of one call. scaled_copies_fit = false: the pool had no room for the scaled copies
// an earlier plan asked for; TF32 mode then keeps its own filter, fp32-accurate goes tiled.
KnnPlan plan_knn(const KnnProblem& problem, const KernelCapabilities& capabilities,
                 bool scaled_copies_fit = true);

// The parts of plan_knn, for the tests.

// The filter for the problem in the given arithmetic (accurate: fp32-accurate's bounds), its
// candidate lists within the memory of a tile of tile_cols columns.
FilterPlan filter_plan(const KnnProblem& problem, const KernelCapabilities& capabilities,
                       bool accurate, std::size_t tile_cols);

// tile_cols capped to cap_bytes of Q × tile distances (0: no cap), down to 256 columns.
std::size_t capped_tile_cols(std::size_t tile_cols, std::size_t q_rows, std::size_t n_rows,
                             std::size_t cap_bytes);

// The columns whose 3×TF32 split copy fits beside a tile of tile_cols.
std::size_t split_tile_cols(std::size_t tile_cols, std::size_t q_rows, std::size_t dim);

}  // namespace gpupool::knn_plan
