// The fused distance matrix (see distance_matrix.cuh): one block multiplies 128 corpus rows by
// 128 queries on the tensor cores (tile_product.cuh), turns its 64 products per thread into
// distances (the rules of distance_rules.cuh) and stores them. The kernel is bound by the matrix
// it writes: the products take a fraction of that time.
#include "accumulator_rows.cuh"
#include "distance_matrix.cuh"
#include "distance_rules.cuh"
#include "resident_tiles.cuh"
#include "tile_product.cuh"

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace gpupool::cuda_kernels {

namespace {

using namespace tiles;

// The direct form Σ(q − x)² in fp32, in the same order as finish_distance's re-compute. Out of
// line: it runs for the rare pairs whose GEMM form cancelled, and inlined 64 times it would crowd
// the instruction cache.
__device__ __noinline__ float direct_l2(const float* q, const float* x, std::size_t dim) {
  float acc = 0.0f;
  for (std::size_t c = 0; c < dim; ++c) {
    float d = q[c] - x[c];
    acc += d * d;
  }
  return acc;
}

// The sum of products Σ q·x in fp32, in index order: for fp32-accurate pairs that the halves could
// not give (a row split_to_fp16 could not scale). Out of line, as direct_l2.
__device__ __noinline__ float direct_dot(const float* q, const float* x, std::size_t dim) {
  float acc = 0.0f;
  for (std::size_t c = 0; c < dim; ++c) acc = fmaf(q[c], x[c], acc);
  return acc;
}

// What the epilogue needs of one query or one corpus row: its squared norm, 1 / its length
// (cosine: infinite for a zero row) and its int8 scale.
struct Figures {
  float norm = 0.0f, inverse_length = 0.0f, scale = 1.0f;
};

template <Metric kMetric>
__device__ __forceinline__ Figures figures_from(float norm, float scale) {
  Figures f;
  f.norm = norm;
  if (kMetric == Metric::Cosine) f.inverse_length = 1.0f / sqrtf(norm);
  f.scale = scale;
  return f;
}

template <Metric kMetric>
__device__ __forceinline__ Figures figures_of(const Matrix& m, const float* norms,
                                              std::size_t row) {
  if (row >= m.rows) return Figures{};
  return figures_from<kMetric>(norms ? norms[row] : 0.0f, m.scales ? m.scales[row] : 1.0f);
}

// Cosine from a product and the figures: 1 − q·x·(1/|q|)·(1/|x|), 1 for a zero row (NaN stays NaN).
__device__ __forceinline__ float cosine_distance(float dot, const Figures& q, const Figures& x) {
  if (isinf(q.inverse_length) || isinf(x.inverse_length)) return isnan(dot) ? dot : 1.0f;
  float value = fmaf(-dot * q.inverse_length, x.inverse_length, 1.0f);
  return value > 2.0f ? 2.0f : clamp_low(value, 0.0f);
}

// finish_distance's rules with this kernel's figures. Cosine multiplies by the inverse lengths
// (two multiplies instead of a square root and a division per pair). kRecompute (3×TF32, fp32
// rows): a NaN product is taken again from the fp32 rows — the split makes ±inf into inf and
// inf − inf, so a row holding ±inf gives NaN where the fp32 product is ±inf — and, for L2, a
// distance that cancelled below 2^-10 of the norms.
template <Metric kMetric, bool kRecompute>
__device__ __forceinline__ float distance(float dot, const Figures& q, const Figures& x,
                                          const MatrixArgs& a, std::size_t query,
                                          std::size_t row) {
  if constexpr (kRecompute && kMetric != Metric::L2) {
    if (isnan(dot))
      dot = direct_dot(static_cast<const float*>(a.q.data) + query * a.dim,
                       static_cast<const float*>(a.x.data) + row * a.dim, a.dim);
  }
  if constexpr (kMetric == Metric::InnerProduct) {
    return -dot;
  } else if constexpr (kMetric == Metric::L2) {
    float sum = q.norm + x.norm;
    float value = fmaf(-2.0f, dot, sum);
    if (kRecompute && !(value > sum * 0x1p-10f))
      value = direct_l2(static_cast<const float*>(a.q.data) + query * a.dim,
                        static_cast<const float*>(a.x.data) + row * a.dim, a.dim);
    return clamp_low(value, 0.0f);
  } else {
    return cosine_distance(dot, q, x);
  }
}

// Whether a product of fp16 halves does not give its pair's distance: NaN (a row split_to_fp16
// could not scale, or NaN data) or, for L2, a distance that cancelled below 2^-10 of the norms
// (distance's re-compute rule).
template <Metric kMetric>
__device__ __forceinline__ bool inexact(float dot, const Figures& q, const Figures& x) {
  if constexpr (kMetric == Metric::L2) {
    const float sum = q.norm + x.norm;
    return !(fmaf(-2.0f, dot, sum) > sum * 0x1p-10f);
  } else {
    return isnan(dot);
  }
}

// A pair's distance from its fp32 rows alone (the direct forms), for the pairs inexact marks.
// Out of line, with scalar arguments: one call site for every slice of the epilogue, not one a
// pair (64 a tile inlined tripled the kernel's code and ran it 4× slower, from the instruction
// cache).
template <Metric kMetric>
__device__ __noinline__ float exact_distance(const float* q, const float* x, std::size_t dim,
                                             Figures qf, Figures xf) {
  if constexpr (kMetric == Metric::L2) return clamp_low(direct_l2(q, x, dim), 0.0f);
  const float dot = direct_dot(q, x, dim);
  if constexpr (kMetric == Metric::InnerProduct) return -dot;
  else return cosine_distance(dot, qf, xf);
}

template <class Mma, Metric kMetric, bool kRecompute>
__global__ void __launch_bounds__(kThreads, 2)
    matrix_kernel(MatrixArgs a, unsigned query_tiles) {
  extern __shared__ std::uint32_t stages[];
  const TilePair pair(query_tiles);
  WarpAccumulators<typename Mma::Accumulator> acc = {};
  multiply_tiles<Mma>(acc, pair, a.x.data, a.x.rows, a.q.data, a.q.rows,
                      a.dim * sizeof(typename Mma::Element), stages);
  const WarpPlace place;
  // This thread's 8 queries: their figures and output rows (null past the last query).
  Figures qf[kQueryTiles][2];
  float* out_row[kQueryTiles][2];
#pragma unroll
  for (int j = 0; j < kQueryTiles; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      std::size_t query = pair.q0 + place.query(j, c);
      qf[j][c] = figures_of<kMetric>(a.q, a.q_norms, query);
      out_row[j][c] = query < a.q.rows ? a.out + query * a.x.rows : nullptr;
    }
#pragma unroll
  for (int i = 0; i < kRowTiles; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      std::size_t row = pair.x0 + place.row(i, 2 * h);
      if (row >= a.x.rows) continue;
      Figures xf = figures_of<kMetric>(a.x, a.x_norms, row);
#pragma unroll
      for (int j = 0; j < kQueryTiles; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          if (!out_row[j][c]) continue;
          float dot = product<Mma>(acc[i][j][2 * h + c], qf[j][c].scale, xf.scale);
          std::size_t query = pair.q0 + place.query(j, c);
          out_row[j][c][row] = distance<kMetric, kRecompute>(dot, qf[j][c], xf, a, query, row);
        }
    }
}

// Stores a thread's two distances of one query at adjacent corpus rows `row`, `row` + 1: one
// 8-byte streaming store where both exist and the pair is 8-byte aligned (even row count), else
// one at a time. Streaming (evict-first): the matrix is written once and read by nobody here.
// `rel`: the row's place in its tile, `rows_here`: the tile's rows that exist, `pairs`: whether
// the row count is even.
__device__ __forceinline__ void store_pair(float* out_row, std::size_t row, int rel, int rows_here,
                                           bool pairs, float first, float second) {
  if (pairs && rel + 1 < rows_here) {
    __stcs(reinterpret_cast<float2*>(out_row + row), make_float2(first, second));
    return;
  }
  if (rel < rows_here) __stcs(out_row + row, first);
  if (rel + 1 < rows_here) __stcs(out_row + row + 1, second);
}

// The resident streams of the matrix: tile j + 1's MMAs overlapping tile j's epilogue, a staging
// area for each warp's stores (accumulator_rows.cuh) and corpus tiles in flight. Rows of up to
// 256 bytes: fp16, bf16 and tf32 with 512-byte row stores (wgmma::store_staged_rows) and four
// stages (five leave no room for their staging); int8 and fp32-accurate's halves with the
// 128-byte stores of four rows (wgmma::store_slice) and five stages, where the row stores ran
// 2% and 12% slower (H100, (1024, 2^20, 128) and (1024, 2^20, 64); docs/benchmarks.md, "Why the
// dispatch rules are where they are"). Rows of up to 512 bytes: two stages (their query tile and
// each stage take 64 KB) and the 128-byte stores (wgmma::Tf32 on them ran the tf32 matrix faster
// than tile_product.cuh's mma.sync).
inline constexpr int kMatrixStagingBytes = resident::kThreads / 32 * wgmma::kWarpStagingBytes;
inline constexpr int kMatrixRowStagingBytes =
    resident::kThreads / 32 * wgmma::kWarpRowStagingBytes;
using RowStoreMatrixPipeline = resident::Pipeline<4, true, kMatrixRowStagingBytes>;
using SliceStoreMatrixPipeline = resident::Pipeline<5, true, kMatrixStagingBytes>;
using WideMatrixPipeline =
    resident::Pipeline<2, true, kMatrixStagingBytes, resident::kWideRowBytes>;
template <class Mma>
using MatrixPipeline =
    std::conditional_t<resident::kHalves<Mma> || std::is_same_v<Mma, wgmma::Int8>,
                       SliceStoreMatrixPipeline, RowStoreMatrixPipeline>;

// The rows the resident kernel streams for an MMA type: split_to_fp16's halves for
// wgmma::Fp16Halves (q_halves / x_halves, 2h fp16 values a row), else the rows themselves.
template <class Mma>
__host__ __device__ constexpr std::size_t resident_row_bytes(std::size_t dim) {
  if constexpr (resident::kHalves<Mma>) return 2 * fp16_halves_dim(dim) * Mma::kElementBytes;
  else return dim * Mma::kElementBytes;
}
// `m` (a.q or a.x) as the resident kernel streams it, `halves` its split_to_fp16 rows.
template <class Mma>
__host__ __device__ Matrix resident_rows(const Matrix& m, const void* halves) {
  if constexpr (resident::kHalves<Mma>) return Matrix{halves, Element::Fp16, m.scales, m.rows};
  else return m;
}

// The matrix on the resident stream (resident_tiles.cuh): a thread's products are 2 queries ×
// 32 corpus rows, two adjacent rows of each 8-row group (wgmma::accumulator_row). A whole tile
// of a matrix whose rows are 16-byte aligned (N a multiple of 4) goes out through
// accumulator_rows.cuh, 128 bytes of a row per warp store (2.7× the write rate of the layout's
// own 32 bytes, measured); the last tile and other N through store_pair.
template <class Pipe, class Mma, Metric kMetric>
__global__ void __launch_bounds__(resident::kThreads, Pipe::kBlocksPerMultiprocessor)
    resident_matrix_kernel(MatrixArgs a, const __grid_constant__ CUtensorMap corpus,
                           resident::Lockstep lockstep) {
  extern __shared__ char dynamic_shared[];
  // 512-byte row stores where the pipeline has the room for their staging.
  constexpr bool kRowStaging = Pipe::kEpilogueBytes >= kMatrixRowStagingBytes;
  char* const staging =
      Pipe::epilogue_area(dynamic_shared) +
      threadIdx.x / 32 * (kRowStaging ? wgmma::kWarpRowStagingBytes : wgmma::kWarpStagingBytes);
  constexpr bool kHalves = resident::kHalves<Mma>;
  const Matrix q = resident_rows<Mma>(a.q, a.q_halves);
  const Matrix x = resident_rows<Mma>(a.x, a.x_halves);
  Figures qf[2];
  std::size_t query_of[2];  // this thread's two queries (the halves' re-computes)
  float* warp_out = nullptr;  // this warp's first query row of the segment (null: none exists)
  int warp_queries = 0;       // how many of the warp's 16 queries exist
  float* out_row[2];          // this thread's two queries' rows (null past the last query)
  wgmma::SliceRows slice_rows(nullptr, 0, 0);
  auto begin_segment = [&](std::size_t query_tile) {
    const std::size_t warp_query = query_tile * resident::kQueries + 64 * (threadIdx.x / 128) +
                                   16 * ((threadIdx.x / 32) % 4);
    const std::size_t left = warp_query < a.q.rows ? a.q.rows - warp_query : 0;
    warp_queries = left < 16 ? static_cast<int>(left) : 16;
    warp_out = warp_queries > 0 ? a.out + warp_query * a.x.rows : nullptr;
    if constexpr (!kRowStaging) slice_rows = wgmma::SliceRows(warp_out, a.x.rows, warp_queries);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int query = wgmma::accumulator_query(2 * h);
      query_of[h] = query_tile * resident::kQueries + 64 * (threadIdx.x / 128) + query;
      qf[h] = figures_of<kMetric>(q, a.q_norms, query_of[h]);
      out_row[h] = query % 16 < warp_queries ? warp_out + (query % 16) * a.x.rows : nullptr;
    }
  };
  const bool pairs = a.x.rows % 2 == 0;
  const bool row_slices =
      a.x.rows % 4 == 0 && reinterpret_cast<std::uintptr_t>(a.out) % 16 == 0;
  // Slice s of the tile's distances, this thread's accumulators 16s + 4g + 2h + e (its query h,
  // corpus row 32s + 8g + 2(lane % 4) + e), for both its queries (count 2: into d[4g + 2h + e],
  // accumulator order) or for query `only` (count 1: into d[2g + e]). The slice stores take both,
  // the row stores one at a time (their staging holds 8 of a warp's 16 rows; computing both and
  // keeping one for later made the fp16-halves kernels spill).
  auto index_of = [](auto count, int g, int h, int e) {
    return decltype(count)::value == 2 ? 4 * g + 2 * h + e : 2 * g + e;
  };
  // Halves: the entries of d that inexact marked in `marked` (bits by index_of), from the fp32
  // rows (rare: a loop over the marked ones, each written into d by an unrolled select, so that
  // d stays in registers).
  auto exact_entries = [&](auto count, std::uint32_t marked, const float* figures,
                           std::size_t x0, int s, int only, auto& d) {
    constexpr int kCount = decltype(count)::value;
    const float* q32 = static_cast<const float*>(a.q.data);
    const float* x32 = static_cast<const float*>(a.x.data);
    while (marked != 0) {
      const int k = __ffs(marked) - 1;
      marked &= marked - 1;
      const int g = k / (2 * kCount), h = kCount == 2 ? (k / 2) % 2 : only, e = k % 2;
      const int rel = 8 * (4 * s + g) + 2 * (threadIdx.x % 4) + e;  // wgmma::accumulator_row
      const std::size_t query = query_of[h], row = x0 + rel;
      if (query >= a.q.rows || row >= a.x.rows) continue;  // not stored
      const float v = exact_distance<kMetric>(q32 + query * a.dim, x32 + row * a.dim, a.dim,
                                              qf[h], figures_from<kMetric>(figures[rel], 1.0f));
#pragma unroll
      for (int i = 0; i < 8 * kCount; ++i)
        if (i == k) d[i] = v;
    }
  };
  // The tile's norms and scales are in shared memory (figures: float[2][128], zero past the end).
  auto slice_distances = [&](auto count, const auto& acc, const float* figures, std::size_t x0,
                             int s, int only, auto& d) {
    constexpr int kCount = decltype(count)::value;
    [[maybe_unused]] std::uint32_t marked = 0;  // halves: bits of d needing exact_distance
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const int i = 16 * s + 4 * g;
      const int rel = wgmma::accumulator_row(i);  // even: the pair is one 8-byte load
      float2 norm = *reinterpret_cast<const float2*>(figures + rel);
      float2 scale = x.scales ? *reinterpret_cast<const float2*>(figures + resident::kRows + rel)
                              : make_float2(1.0f, 1.0f);
      Figures xf[2] = {figures_from<kMetric>(norm.x, scale.x),
                       figures_from<kMetric>(norm.y, scale.y)};
#pragma unroll
      for (int n = 0; n < kCount; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int h = kCount == 2 ? n : only, at = index_of(count, g, h, e);
          float dot = product<Mma>(acc[i + 2 * h + e], qf[h].scale, xf[e].scale);
          d[at] = distance<kMetric, false>(dot, qf[h], xf[e], a, 0, 0);
          if constexpr (kHalves)
            marked |= std::uint32_t(inexact<kMetric>(dot, qf[h], xf[e])) << at;
        }
    }
    if constexpr (kHalves)
      if (marked != 0) exact_entries(count, marked, figures, x0, s, only, d);
  };
  using BothQueries = std::integral_constant<int, 2>;
  using OneQuery = std::integral_constant<int, 1>;
  // A whole tile of a matrix whose rows are 16-byte aligned: 512-byte row stores, half by half.
  auto store_rows = [&](const auto& acc, std::size_t x0, const float* figures) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (warp_queries <= 8 * h) break;  // warp-uniform: no query of this half exists
#pragma unroll
      for (int s = 0; s < wgmma::kAccumulators / 16; ++s) {
        float d[8];
        slice_distances(OneQuery{}, acc, figures, x0, s, h, d);
        wgmma::stage_half_slice(d, staging, s);
      }
      wgmma::store_staged_rows(staging, warp_out + 8 * h * a.x.rows, a.x.rows,
                               warp_queries - 8 * h, x0);
    }
  };
  auto finish_tile = [&](const auto& acc, std::size_t x0, const float* figures) {
    const int rows_here = a.x.rows - x0 < resident::kRows ? static_cast<int>(a.x.rows - x0)
                                                          : resident::kRows;
    if (!warp_out) return;  // warp-uniform: no query of this warp exists
    const bool whole = row_slices && rows_here == resident::kRows;
    if constexpr (kRowStaging)
      if (whole) return store_rows(acc, x0, figures);
#pragma unroll
    for (int s = 0; s < wgmma::kAccumulators / 16; ++s) {
      float d[16];
      slice_distances(BothQueries{}, acc, figures, x0, s, 0, d);
      if (!kRowStaging && whole) {
        wgmma::store_slice(d, staging, slice_rows, x0 + 32 * s);
        continue;
      }
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        const int rel = wgmma::accumulator_row(16 * s + 4 * g);
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if (out_row[h])
            store_pair(out_row[h], x0 + rel, rel, rows_here, pairs, d[4 * g + 2 * h],
                       d[4 * g + 2 * h + 1]);
      }
    }
  };
  // Without x_norms (L2, cosine) the kernel sums each row's squares from the tile it holds
  // (never from halves: pairwise() has their norms from the fp32 rows).
  const resident::RowFigures figures{a.x_norms, x.scales, 0.0f,
                                     !kHalves && kMetric != Metric::InnerProduct && !a.x_norms};
  resident::stream_tiles<Pipe, Mma>(corpus, q, x, resident_row_bytes<Mma>(a.dim), figures,
                                    dynamic_shared, begin_segment, finish_tile, lockstep);
}

constexpr LaunchNames kMatrixNames{
    "distance matrix kernel", "cudaFuncSetAttribute (distance matrix kernel)",
    "distance matrix kernel (more than 2^31 - 1 blocks of 128 x 128)"};

template <class Mma, Metric kMetric, bool kRecompute>
Status launch(const MatrixArgs& a, cudaStream_t stream) {
  return launch_tiles<matrix_kernel<Mma, kMetric, kRecompute>>(a, a.q.rows, a.x.rows, stream,
                                                                kMatrixNames);
}

// Tiles between the lockstep's stops (resident::Lockstep): GPUPOOL_MATRIX_LOCKSTEP if it is 0
// (blocks run free) or a power of two up to 1024, else kLockstepPeriod (a mistyped value keeps
// the measured default rather than turning the lockstep off).
inline constexpr unsigned kLockstepPeriod = 8;
unsigned lockstep_period() {
  static const unsigned period = [] {
    const char* v = std::getenv("GPUPOOL_MATRIX_LOCKSTEP");
    if (!v || !*v) return kLockstepPeriod;
    char* end = nullptr;
    const unsigned long p = std::strtoul(v, &end, 10);
    if (*end != '\0') return kLockstepPeriod;
    if (p == 0) return 0u;
    return (p & (p - 1)) == 0 && p <= 1024 ? static_cast<unsigned>(p) : kLockstepPeriod;
  }();
  return period;
}

// Whether the runs interleave (Lockstep::interleaved): GPUPOOL_MATRIX_INTERLEAVE=0 or 1 if set,
// else kInterleavedRuns.
inline constexpr bool kInterleavedRuns = true;
bool interleaved_runs() {
  static const bool interleaved = [] {
    const char* v = std::getenv("GPUPOOL_MATRIX_INTERLEAVE");
    if (!v || !*v) return kInterleavedRuns;
    return std::strcmp(v, "0") != 0;
  }();
  return interleaved;
}

template <class Pipe, class Warpgroup, Metric kMetric>
Status launch_on(const MatrixArgs& a, cudaStream_t stream) {
  const Matrix x = resident_rows<Warpgroup>(a.x, a.x_halves);
  return resident::launch_in_lockstep<Pipe, resident_matrix_kernel<Pipe, Warpgroup, kMetric>>(
      a, a.q.rows, x.data, x.rows, resident_row_bytes<Warpgroup>(a.dim), lockstep_period(),
      interleaved_runs(), stream, kMatrixNames);
}

// On the pipeline whose stages take the rows (resident_matrix).
template <class Warpgroup, Metric kMetric>
Status launch_resident(const MatrixArgs& a, cudaStream_t stream) {
  using Pipe = MatrixPipeline<Warpgroup>;
  if (resident_row_bytes<Warpgroup>(a.dim) <= std::size_t(Pipe::kMaxRowBytes))
    return launch_on<Pipe, Warpgroup, kMetric>(a, stream);
  return launch_on<WideMatrixPipeline, Warpgroup, kMetric>(a, stream);
}

template <class Warpgroup>
Status launch_resident_for_metric(const MatrixArgs& a, cudaStream_t s) {
  switch (a.metric) {
    case Metric::InnerProduct: return launch_resident<Warpgroup, Metric::InnerProduct>(a, s);
    case Metric::Cosine: return launch_resident<Warpgroup, Metric::Cosine>(a, s);
    default: return launch_resident<Warpgroup, Metric::L2>(a, s);
  }
}

// Where the resident kernel (warpgroup MMAs, resident_tiles.cuh) writes the matrix instead of
// tile_product.cuh's: wherever it takes the rows (rows of at most 512 bytes, compute capability
// 9.0): on an H200, fp16 / bf16 / int8 ran 1.4-1.8× faster there at (1024, 2^20, 128) and
// (10000, 10^5, 128), given stores that cover 128 bytes of a row (accumulator_rows.cuh).
bool resident_matrix(const void* x, std::size_t row_bytes) {
  return resident::takes_rows(x, row_bytes, WideMatrixPipeline::kMaxRowBytes) &&
         resident::available();
}

// Mma: tile_product.cuh's type; Warpgroup: warpgroup_mma.cuh's, taken where resident_matrix says
// (not for fp32-accurate: its 3×TF32 split stays in tile_product.cuh).
template <class Mma, class Warpgroup = void>
Status launch_for_metric(const MatrixArgs& a, cudaStream_t s) {
  if constexpr (!std::is_void_v<Warpgroup>) {
    if (resident_matrix(a.x.data, a.dim * Warpgroup::kElementBytes))
      return launch_resident_for_metric<Warpgroup>(a, s);
  }
  switch (a.metric) {
    case Metric::InnerProduct: return launch<Mma, Metric::InnerProduct, false>(a, s);
    case Metric::Cosine: return launch<Mma, Metric::Cosine, false>(a, s);
    default: return launch<Mma, Metric::L2, false>(a, s);
  }
}

}  // namespace

bool matrix_sums_corpus_norms(const Matrix& x, std::size_t q_rows, std::size_t dim,
                              bool accurate) {
  static const bool switched_off = [] {
    const char* v = std::getenv("GPUPOOL_MATRIX_TILE_NORMS");
    return v && std::strcmp(v, "0") == 0;
  }();
  if (switched_off || !fused_matrix(x.element, q_rows, dim, !accurate)) return false;
  if (x.element == Element::Fp32 && accurate) return false;  // 3×TF32: tile_product.cuh's form
  return resident_matrix(x.data, dim * element_bytes(x.element));
}

// split_to_fp16 reads fp32 rows the copy engine could read (whole, aligned 16-byte pieces), and
// their halves have a row of at most 512 bytes exactly where the fp32 rows do (D <= 128): so both
// are resident_matrix's rule for the fp32 rows.
bool matrix_takes_halves(const Matrix& q, const Matrix& x, std::size_t dim, bool accurate) {
  static_assert(resident_row_bytes<wgmma::Fp16Halves>(128) == WideMatrixPipeline::kMaxRowBytes);
  const std::size_t row_bytes = dim * sizeof(float);
  return x.element == Element::Fp32 && accurate && fused_matrix(x.element, q.rows, dim, false) &&
         resident::takes_rows(q.data, row_bytes, WideMatrixPipeline::kMaxRowBytes) &&
         resident_matrix(x.data, row_bytes);
}

Status distance_matrix(const MatrixArgs& a, void* stream) {
  if (a.q.rows == 0 || a.x.rows == 0) return {};
  auto s = static_cast<cudaStream_t>(stream);
  switch (a.x.element) {
    case Element::Fp16: return launch_for_metric<Fp16Mma, wgmma::Fp16>(a, s);
    case Element::Bf16: return launch_for_metric<Bf16Mma, wgmma::Bf16>(a, s);
    case Element::Int8: return launch_for_metric<Int8Mma, wgmma::Int8>(a, s);
    case Element::Fp32:
      if (!a.accurate) return launch_for_metric<Tf32Mma, wgmma::Tf32>(a, s);
      if (a.x_halves) return launch_resident_for_metric<wgmma::Fp16Halves>(a, s);
      switch (a.metric) {  // 3×TF32, its NaN and cancelled pairs re-computed (distance)
        case Metric::InnerProduct: return launch<Tf32x3Mma, Metric::InnerProduct, true>(a, s);
        case Metric::Cosine: return launch<Tf32x3Mma, Metric::Cosine, true>(a, s);
        default: return launch<Tf32x3Mma, Metric::L2, true>(a, s);
      }
  }
  return {};
}

}  // namespace gpupool::cuda_kernels
