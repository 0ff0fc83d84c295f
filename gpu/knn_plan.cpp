// The kNN plan (knn_plan.hpp): which path a CUDA kNN call takes and how big its pieces are.
#include "knn_plan.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>

namespace gpupool::knn_plan {

// Many queries share the budget by taking turns, not by narrowing the tile: every tile pays a
// top-k pass over its queries' lists, and the filter's lists must fit half a tile. On an H200, a
// million queries against 2,000,003 rows (k = 10) searched for 42.1 s in 268-column tiles (the
// filter off, a thousand top-k passes per chunk of the base) and 3.78 s taking turns in 8192-column
// tiles, where 100,000 queries (in 2,684 columns, then 8192) took 0.37 and 0.38 s.
TileShape choose_tile(std::size_t headroom, std::size_t q_rows, std::size_t n_rows, bool cuda) {
  std::size_t cap = cuda ? (std::size_t{1} << 30) : (std::size_t{64} << 20);
  std::size_t budget = std::min(headroom / 2, cap) / sizeof(float);
  std::size_t min_cols = std::min<std::size_t>(n_rows, 256);
  std::size_t cols = std::clamp<std::size_t>(budget / q_rows, min_cols, n_rows);
  const std::size_t wide = std::min(n_rows, kWideTileCols);
  if (cols < wide && budget / wide >= kWideTileMinRows) cols = wide;
  std::size_t rows = std::clamp<std::size_t>(budget / cols, 1, q_rows);
  return {rows, cols};
}

// A cap below what the headroom allows, down to 256 columns: a tile that stays in the L2 cache is
// written by the GEMM and read by the top-k pass without a trip to device memory (kernel_bench
// compares the two).
std::size_t capped_tile_cols(std::size_t tile_cols, std::size_t q_rows, std::size_t n_rows,
                             std::size_t cap_bytes) {
  if (cap_bytes == 0) return tile_cols;
  std::size_t cols = cap_bytes / (q_rows * sizeof(float));
  std::size_t fewest = std::min<std::size_t>({n_rows, 256, tile_cols});
  return std::max(std::min(cols, tile_cols), fewest);
}

// Fp32-accurate kNN runs 3×TF32 (see cuda_kernels::split_tf32) on tiles whose split copy (3·dim floats a
// row) takes at most as much as the distance tile, or 256 MiB, whichever is more.
std::size_t split_tile_cols(std::size_t tile_cols, std::size_t q_rows, std::size_t dim) {
  std::size_t budget = std::max<std::size_t>(q_rows * tile_cols * sizeof(float), 256u << 20);
  std::size_t cols = budget / (3 * dim * sizeof(float));
  return std::max<std::size_t>(std::min(cols, tile_cols), std::min<std::size_t>(tile_cols, 256));
}

// The filter pays for itself on large corpora, small k and enough queries to fill its 128-query
// tiles (Q = 1 ran 3× slower filtered on an H100). Where its distances are the result (fp16,
// bf16, TF32 mode) its mma.sync GEMM must not be the bottleneck: rows of 256 bytes ran 2.1-2.6×
// faster filtered, rows of 1920 and 3840 bytes (D = 960) 1.1-1.4× slower than cuBLAS's GEMM in
// the tiled path; the cut at 1024 bytes lies between (not measured there). The streamed wgmma
// kernel (Hopper: fp16 / bf16 / int8 rows over 256 bytes) has no such cut: at D = 960 fp16
// ran 1.37× faster filtered on it than tiled (H200, k = 10: 5.01 against 6.84 ms).
// Fp32-accurate filters at any D: its bounds on scaled fp16 copies (cuda_kernels::scale_to_fp16, rows
// padded to whole 16-byte chunks) replace an fp32 or 3×TF32 GEMM.
// The sample gives each query its threshold. Where the resident filter runs (fp16 / bf16 / int8
// rows, fp32-accurate's scaled copies, on Hopper) through its group minima (sample_minima.cuh:
// whole 128-row tiles, so pieces of a multiple of 8 rows, and at least k groups; with the bound,
// of upper bounds, and the exact sample again where they overflow the lists: see
// run_filtered in gpu/cuda_backend.cpp); elsewhere the sample's rows go through the
// tiled path, its k-th best is the threshold and the filter skips them. It is sized so that about
// k·N/S rows per query beat its thresholds (for rows in no particular order), balancing the
// sample's cost against the candidates': S ≈ √(64·k·N), at most a quarter of the corpus. The
// factor was measured for the tiled sample on an H100 (docs/benchmarks.md, "Why the dispatch
// rules are where they are"): against 16, 64 took the filtered calls of kernel_bench 4-17% faster
// (fp16 (1024, 2^20, 128) k = 10: 2.22 -> 1.85 ms), 36 half as much; the minima were not tuned
// apart (they cost a ninth of the tiled sample).
// Lists hold 4× the expected count (a list that overflows sends the whole call to the tiled
// path), and take at most the tile's memory (2 × 4 bytes a slot).
FilterPlan filter_plan(const KnnProblem& problem, const KernelCapabilities& capabilities,
                       bool accurate, std::size_t tile_cols) {
  FilterPlan plan;
  const std::size_t n = problem.rows, k = problem.k;
  if (k > kFilterMaxK || n < kFilterMinRows || problem.queries < kFilterMinQueries) return plan;
  if (problem.fp32 && accurate)
    plan.lower_bound = true;
  else if (!capabilities.filter_reads_rows ||
           (problem.dim * problem.value_bytes > kFilterMaxExactRowBytes &&
            !capabilities.streamed_filter_on_corpus))
    return plan;
  // Each piece at most a quarter of its period (the test below).
  std::size_t largest = cuda_kernels::kFilterPieces * (n / cuda_kernels::kFilterPieces / 4);
  auto root = static_cast<std::size_t>(std::sqrt(kFilterSampleFactor * static_cast<double>(k) * n));
  std::size_t sample = std::min(std::max<std::size_t>(root, 64 * k), largest);
  std::size_t capacity = std::bit_ceil(std::max<std::size_t>(4 * k * n / sample, 2 * k));
  std::size_t most = std::bit_floor(std::max<std::size_t>(tile_cols / 2, 1));
  if (capacity > most) {  // less memory: a larger sample, fewer candidates
    capacity = most;
    sample = 4 * k * n / capacity;
  }
  std::size_t period = n / cuda_kernels::kFilterPieces;
  std::size_t length = (sample + cuda_kernels::kFilterPieces - 1) / cuda_kernels::kFilterPieces;
  // The bound's minima read the scaled copies (pool buffers, so aligned wherever they lie).
  bool minima = plan.lower_bound ? capabilities.resident_filter_on_scaled_copies
                                 : capabilities.resident_filter_on_corpus;
  if (minima) {  // pieces of whole 8-row groups: up if that still fits the period, else down
    const std::size_t up = (length + 7) / 8 * 8;
    length = 4 * up <= period ? up : length / 8 * 8;
  }
  if (length == 0 || capacity < 2 * k || 4 * length > period) return plan;
  plan.on = true;
  plan.minima = minima && cuda_kernels::kFilterPieces * length / cuda_kernels::kMinimaGroupRows >= k;
  plan.sample = {period, length};
  plan.capacity = capacity;
  return plan;
}

// Where 3×TF32 beats plain fp32 FMA (cuBLAS SGEMM) on the tiles: enough queries that the GEMM is
// bound by its arithmetic, and rows short enough that the split tiles (3·dim floats a row) stay
// wide. With fewer queries the split's own pass over each tile (4 bytes read, 12 written per
// value) is the cost: on an H200, fp32-accurate k = 10 over 65,000 rows of 128 ran SGEMM faster
// up to 96 queries, even at 128, 3×TF32 5–10% faster from 192; Q = 1 over 2^20 rows took 0.45 ms
// against 1.58; at D = 960, Q = 1024, 3×TF32 was slower than fp32 FMA on an H100
// (docs/benchmarks.md, "Why the dispatch rules are where they are").
static bool wants_split(const KnnProblem& problem, bool accurate) {
  return problem.fp32 && accurate && problem.queries > kPlainFmaMaxQueries &&
         problem.dim <= kSplitMaxDim;
}

KnnPlan plan_knn(const KnnProblem& problem, const KernelCapabilities& capabilities,
                 bool scaled_copies_fit) {
  KnnPlan plan;
  plan.accurate = problem.accurate;
  const std::size_t cols = capped_tile_cols(problem.tile_cols, problem.queries, problem.rows,
                                            problem.tile_bytes_cap);
  plan.filter = filter_plan(problem, capabilities, problem.accurate, cols);
  // TF32 mode is a permission, not a request for TF32's error (docs/kernels.md). Where kNN would
  // run the TF32 filter (tile_product.cuh's mma.sync: TF32 rows of D > 64 do not fit the resident
  // kernel's stages), fp32-accurate's filter on the resident kernel (scaled fp16 copies,
  // D <= 128) is about twice as fast (H100) and exact, so the call runs fp32-accurate, if the
  // pool has room for its copies (else it stays TF32).
  // Past the TF32 filter's reach (rows over 1024 bytes) the call stays TF32 and tiled: at
  // D = 960 fp32-accurate's filter on the streamed kernel (an H200: 9.93 / 13.86 ms, k = 10 /
  // 100) was slower than cuBLAS's TF32 GEMM in the tiled path (9.52 / 9.98 ms).
  if (plan.filter.on && problem.fp32 && !problem.accurate && scaled_copies_fit) {
    const FilterPlan exact = filter_plan(problem, capabilities, true, cols);
    if (exact.on && capabilities.resident_filter_on_scaled_copies) {
      plan.filter = exact;
      plan.accurate = true;
    }
  }
  if (plan.filter.on && plan.filter.lower_bound) {
    if (scaled_copies_fit) plan.scaled_copies = true;
    else plan.filter = {};  // no room for the bound's operands: tiled
  }
  plan.refine = problem.l2 && problem.fp32 && plan.accurate;
  // Inner product needs no norms, except for fp32-accurate's filter: its error bound scales with
  // |q|·|x|.
  plan.norms = !problem.inner_product || plan.scaled_copies;
  std::size_t tile_cols = problem.tile_cols;
  if (plan.filter.on) {  // tiles for the gathered sample only (and the rare fallback)
    std::size_t sample = cuda_kernels::kFilterPieces * plan.filter.sample.length;
    tile_cols = std::min(tile_cols, std::max<std::size_t>(sample, 4096));
  }
  tile_cols = capped_tile_cols(tile_cols, problem.queries, problem.rows, problem.tile_bytes_cap);
  plan.split = wants_split(problem, plan.accurate);
  if (plan.split) tile_cols = split_tile_cols(tile_cols, problem.queries, problem.dim);
  plan.tile_cols = tile_cols;
  return plan;
}

}  // namespace gpupool::knn_plan
