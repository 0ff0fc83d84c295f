// The fused kNN filter (see knn_filter.cuh): one block multiplies a tile of 128 corpus rows by a
// tile of 128 queries on the tensor cores (tile_product.cuh) and tests its 64 products per thread
// against their queries' thresholds in registers. A row that cannot beat its query's threshold
// costs two instructions; the few that may are checked exactly and appended to the query's
// candidate list with an atomic counter.
#include "distance_rules.cuh"
#include "knn_filter.cuh"
#include "quick_values.cuh"
#include "resident_tiles.cuh"
#include "streamed_tiles.cuh"
#include "tile_product.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace gpupool::cuda_kernels {

namespace {

using namespace tiles;

// Candidate rows are int32 indices, so 32-bit arithmetic (a 64-bit remainder is a subroutine).
__device__ __forceinline__ bool in_sample(const FilterSample& s, std::size_t row) {
  if (s.period == 0 || row >= kFilterPieces * s.period) return false;
  return static_cast<std::uint32_t>(row) % static_cast<std::uint32_t>(s.period) < s.length;
}

// The block's queries' thresholds and squared norms, in shared memory.
struct QueryTile {
  float tau_d[kTileQueries];
  int tau_i[kTileQueries];
  float norm[kTileQueries];
  float scale[kTileQueries];  // int8 rows
};

// Query q's threshold in the full order (FilterArgs::thresholds or the running lists').
struct Threshold {
  float d;
  int i;
};
__device__ __forceinline__ Threshold unbounded_threshold_of(const FilterArgs& a, std::size_t q) {
  if (!a.thresholds) return {a.run_d[q * a.k + a.k - 1], a.run_i[q * a.k + a.k - 1]};
  const float d = a.thresholds[q];
  return {d, isnan(d) ? static_cast<int>(a.k) : INT_MAX};
}
__device__ __forceinline__ Threshold threshold_of(const FilterArgs& a, std::size_t q) {
  const Threshold t = unbounded_threshold_of(a, q);
  if (!a.bounds || t.d <= a.bounds[q]) return t;
  return {a.bounds[q], INT_MAX};  // NaN thresholds too: the bound is a number
}

// The thresholds, norms and scales of the block's queries q0.. into shared memory, by the block's
// kBlockThreads threads. A constant stride: with blockDim.x the resident filter kernel ran 1.5×
// slower (H100, fp16 (1024, 2^20, 128) k = 10: 1023 against 677 µs), its hot loop compiled
// differently although this runs once a segment.
template <int kBlockThreads>
__device__ __forceinline__ void load_query_tile(const FilterArgs& a, QueryTile& tile,
                                                std::size_t q0) {
  for (int t = threadIdx.x; t < kTileQueries; t += kBlockThreads) {
    std::size_t q = q0 + t;
    bool real = q < a.q.rows;  // past the last query: a threshold nothing passes
    const Threshold tau = real ? threshold_of(a, q) : Threshold{-INFINITY, 0};
    tile.tau_d[t] = tau.d;
    tile.tau_i[t] = tau.i;
    tile.norm[t] = real && a.q_norms ? a.q_norms[q] : 0.0f;
    tile.scale[t] = real && a.q.scales ? a.q.scales[q] : 1.0f;
  }
}

// Where kept rows go, passed by value to the out-of-line slow path.
struct Sink {
  float* cand_d;
  std::int32_t* cand_i;
  std::uint32_t* counts;
  std::size_t capacity;
  FilterSample sample;
  std::size_t x_rows, q_rows;
  const float* x_norms;
  float lower_bound;
};

// The exact test of a product that passed the quick one: the distance as finish_distance makes
// it (and its lower bound), inside the tiles, not a sample row, and better than the threshold in
// the full order (ties by index, NaN last). `x_norm`: the row's squared norm.
template <Metric kMetric, bool kLowerBound>
__device__ __forceinline__ bool passes_exactly(const Sink& sink, const QueryTile* tile, int t,
                                               std::size_t query, std::size_t row, float dot,
                                               float x_norm, float& distance) {
  if (row >= sink.x_rows || query >= sink.q_rows || in_sample(sink.sample, row)) return false;
  float q_norm = tile->norm[t];
  distance = finish_distance(dot, kMetric, q_norm, x_norm, nullptr, nullptr, 0);
  float bound = distance;
  if constexpr (kLowerBound)
    bound -= sink.lower_bound *
             error_scale<kMetric>(q_norm, x_norm, sqrtf(q_norm), sqrtf(x_norm));
  // With the bound, a NaN distance says nothing about the exact one (a row scale_to_fp16 could
  // not scale, or an overflow): the re-rank decides.
  bool unknown = kLowerBound && isnan(bound);
  return unknown || better(bound, static_cast<int>(row), tile->tau_d[t], tile->tau_i[t]);
}

// A kept row into its query's candidate list (a slot past the capacity is only counted: the
// list overflowed).
__device__ __forceinline__ void append(const Sink& sink, std::size_t query, std::int32_t index,
                                       float distance) {
  unsigned slot = atomicAdd(&sink.counts[query], 1u);
  if (slot < sink.capacity) {
    sink.cand_d[query * sink.capacity + slot] = distance;
    sink.cand_i[query * sink.capacity + slot] = index;
  }
}

// The slow path of tile_product.cuh's filter kernel. Out of line: inlined 64 times per thread it
// overflowed the instruction cache (measured: 60% of all stalls).
template <Metric kMetric, bool kLowerBound>
__device__ __noinline__ void keep_if_better(Sink sink, const QueryTile* tile, int t,
                                            std::size_t query, std::size_t row, float dot) {
  float x_norm = sink.x_norms && row < sink.x_rows ? sink.x_norms[row] : 0.0f;
  float distance;
  if (passes_exactly<kMetric, kLowerBound>(sink, tile, t, query, row, dot, x_norm, distance))
    append(sink, query, static_cast<std::int32_t>(row), distance);
}

// The quick test, two instructions a product (one for inner product without the bound): it
// rejects a row only where its exact distance cannot beat the query's threshold τ, with a margin
// (2^-20 of |τ| + |q|², 2^-19 for cosine) for the fp32 rounding of either side. NaN passes, to the
// exact test. Per query: `limit` (and `weight`); per corpus row: one figure, all in registers.
//   L2:       x² − 2·q·x > τ − q² (+ margin): the q² term moves to the query's side. With the
//             bound (fp32-accurate), a row whose exact distance beats τ has |x| <= |q| + √τ,
//             so the bound's error scale at that |x| (a query figure) covers every row that
//             matters; rows with larger |x| cannot beat τ whatever their approximate product
//             says.
//   inner:    −q·x > τ; with the bound −q·x − lb·|q|·|x| > τ (per row: |x|).
//   cosine:   q·x / |x| < (1 − τ − bound) · |q| (per row: 1 / |x|, infinite for a zero row, whose
//             products are 0 and give NaN: it passes).
struct QueryFigures {
  float limit, weight;
};

template <Metric kMetric, bool kLowerBound>
__device__ __forceinline__ bool may_beat(float dot, const QueryFigures& q, float x) {
  if constexpr (kMetric == Metric::L2) return !(fmaf(-2.0f, dot, x) > q.limit);
  else if constexpr (kMetric == Metric::InnerProduct && kLowerBound)
    return !(fmaf(q.weight, x, -dot) > q.limit);
  else if constexpr (kMetric == Metric::InnerProduct) return !(-dot > q.limit);
  else return !(dot * x < q.limit);
}

template <Metric kMetric, bool kLowerBound>
__device__ __forceinline__ QueryFigures query_figures(float norm, float tau, float lower_bound) {
  float margin = (fabsf(tau) + norm) * 0x1p-20f;
  float length = sqrtf(norm);
  if constexpr (kMetric == Metric::L2) {
    float limit = tau + margin - norm;
    if (kLowerBound) {
      float reach = (length + sqrtf(fmaxf(tau, 0.0f) * (1.0f + lower_bound))) * (1.0f + 0x1p-10f);
      limit += lower_bound * error_scale<kMetric>(norm, reach * reach, length, reach);
    }
    return {limit, 0.0f};
  } else if constexpr (kMetric == Metric::InnerProduct) {
    return {tau + margin, kLowerBound ? -lower_bound * length : 0.0f};
  } else {
    float bound = kLowerBound ? error_scale<kMetric>(0, 0, 0, 0) * lower_bound : 0.0f;
    return {(1.0f - tau - bound - 0x1p-19f) * length, 0.0f};
  }
}

// A corpus row's figure for may_beat from its squared norm (rows past the end: one that fails
// L2's test).
template <Metric kMetric, bool kLowerBound>
__device__ __forceinline__ float figure_of_norm(float norm, bool real) {
  if (kMetric == Metric::InnerProduct && !kLowerBound) return 0.0f;
  if (!real) return kMetric == Metric::L2 ? INFINITY : 0.0f;
  if constexpr (kMetric == Metric::L2) return norm;
  else if constexpr (kMetric == Metric::InnerProduct) return sqrtf(norm);
  else return 1.0f / sqrtf(norm);
}

template <Metric kMetric, bool kLowerBound>
__device__ __forceinline__ float row_figure(const FilterArgs& a, std::size_t row) {
  if (kMetric == Metric::InnerProduct && !kLowerBound) return 0.0f;
  bool real = row < a.x.rows;
  return figure_of_norm<kMetric, kLowerBound>(real ? a.x_norms[row] : 0.0f, real);
}

// This thread's 8 queries' figures go to registers first: the 64 tests reuse them. The 16 tests
// of a row tile come first (independent: they overlap, and fold into one predicate), then one
// rarely taken branch that redoes them one by one.
template <class Mma, Metric kMetric, bool kLowerBound>
__device__ __forceinline__ void filter_epilogue(const FilterArgs& a, const QueryTile& tile,
                                                const WarpAccumulators<typename Mma::Accumulator>& acc,
                                                const TilePair& pair, const WarpPlace& place) {
  constexpr bool kScaled = Mma::kScaled;
  Sink sink{a.cand_d, a.cand_i, a.counts, a.capacity, a.sample,
            a.x.rows, a.q.rows, a.x_norms, a.lower_bound};
  QueryFigures mine[kQueryTiles][2];
  float q_scale[kQueryTiles][2];
#pragma unroll
  for (int j = 0; j < kQueryTiles; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      int t = place.query(j, c);
      mine[j][c] = query_figures<kMetric, kLowerBound>(tile.norm[t], tile.tau_d[t], a.lower_bound);
      q_scale[j][c] = kScaled ? tile.scale[t] : 1.0f;
    }
#pragma unroll
  for (int i = 0; i < kRowTiles; ++i) {
    float x[2], x_scale[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      std::size_t row = pair.x0 + place.row(i, 2 * h);
      x[h] = row_figure<kMetric, kLowerBound>(a, row);
      x_scale[h] = kScaled && row < a.x.rows ? a.x.scales[row] : 1.0f;
    }
    float dot[kQueryTiles][4];
#pragma unroll
    for (int j = 0; j < kQueryTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) dot[j][e] = product<Mma>(acc[i][j][e], q_scale[j][e % 2], x_scale[e / 2]);
    bool any = false;
#pragma unroll
    for (int j = 0; j < kQueryTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        any |= may_beat<kMetric, kLowerBound>(dot[j][e], mine[j][e % 2], x[e / 2]);
    if (!any) continue;
#pragma unroll
    for (int j = 0; j < kQueryTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (may_beat<kMetric, kLowerBound>(dot[j][e], mine[j][e % 2], x[e / 2])) {
          int t = place.query(j, e);
          keep_if_better<kMetric, kLowerBound>(sink, &tile, t, pair.q0 + t,
                                               pair.x0 + place.row(i, e), dot[j][e]);
        }
  }
}

// One block per (query tile, corpus tile) item (TilePair). (Persistent blocks streaming many
// items through one pipeline were measured slower: the per-step bookkeeping cost more
// instructions than the pipeline fills it saved.)
template <class Mma, Metric kMetric, bool kLowerBound>
__global__ void __launch_bounds__(kThreads, 2)
    filter_kernel(FilterArgs a, unsigned query_tiles) {
  extern __shared__ std::uint32_t stages[];
  __shared__ QueryTile tile;
  const TilePair pair(query_tiles);
  load_query_tile<kThreads>(a, tile, pair.q0);
  WarpAccumulators<typename Mma::Accumulator> acc = {};
  multiply_tiles<Mma>(acc, pair, a.x.data, a.x.rows, a.q.data, a.q.rows,
                      a.dim * sizeof(typename Mma::Element), stages);
  filter_epilogue<Mma, kMetric, kLowerBound>(a, tile, acc, pair, WarpPlace());
}

// ---- The resident kernel (resident_tiles.cuh): Hopper's warpgroup MMAs on queries that stay in
// shared memory while corpus tiles stream past.
//
// Its epilogue keeps the accumulators out of every branch. Each product becomes one value v in
// the same instruction as the quick test needs it (quick_value); a thread tests 16 of them at a
// time against its two queries' limits, folded into one predicate, and a product that passes
// leaves only (query, row, v) in its warp's slots in shared memory. The exact test, the sample's
// rows and the appends to the candidate lists happen when a warp's slots are flushed, a lane a
// candidate (flush_staged), so a warp that finds a candidate is held up by a few stores, not by a
// divergent exact test. Run where a product passes, the exact test's branches read the
// accumulators, so ptxas serialises the MMAs (C7520), keeps the 16 tests' predicates in
// registers for the branch (two instructions more a product), and the warps of a warpgroup wait
// at each tile's barrier for the one that branched (38% of the stalls; ncu, H100, 958 instructions
// a warp a tile for about 250 that the test needs, against 415 this way).

static_assert(resident::kQueries == kTileQueries, "QueryTile holds one resident query tile");

// The kernels that share the staged exact test below (its template argument).
enum class FilterEngine { Resident, Streamed };

// Where a wgmma filter kernel appends its candidates.
__device__ __forceinline__ Sink sink_of(const FilterArgs& a) {
  return {a.cand_d, a.cand_i, a.counts, a.capacity, a.sample,
          a.x.rows, a.q.rows, a.x_norms, a.lower_bound};
}

// A query's limit and weight for quick_value (query_figures, the cosine limit negated).
template <Metric kMetric, bool kLowerBound>
__device__ __forceinline__ QueryFigures resident_figures(const FilterArgs& a, std::size_t q) {
  if (q >= a.q.rows) return {-INFINITY, 0.0f};  // past the last query: nothing passes
  const float tau = threshold_of(a, q).d;
  const float norm = a.q_norms ? a.q_norms[q] : 0.0f;
  QueryFigures f = query_figures<kMetric, kLowerBound>(norm, tau, a.lower_bound);
  if (kMetric == Metric::Cosine) f.limit = -f.limit;
  return f;
}

// The exact test of a staged product from its quick value v: the distance (distance_of_value;
// with the bound, its lower bound too) in the full order against the query's threshold, ties by
// index, NaN last; rows past the corpus and the sample's rows (already in the running lists) are
// dropped. With the bound, inner product's v is the lower bound itself (the re-rank makes the
// distance). kEngine: the kernel that calls it (one instantiation each), so that the compiler
// sees the one query tile in shared memory its caller passes and reads it as shared memory — a
// copy shared by two kernels reads it through generic pointers, which made fp32-accurate's
// resident filter 22% slower on an H200.
template <Metric kMetric, bool kLowerBound, FilterEngine kEngine>
__device__ __noinline__ void keep_staged(Sink sink, const QueryTile* tile, int t, std::size_t q0,
                                         std::int32_t row, float v) {
  const std::size_t query = q0 + t;
  const auto r = static_cast<std::size_t>(row);
  if (r >= sink.x_rows || query >= sink.q_rows || in_sample(sink.sample, r)) return;
  const float q_norm = tile->norm[t];
  const bool needs_x = kMetric == Metric::Cosine || (kMetric == Metric::L2 && kLowerBound);
  const float x_norm = needs_x ? sink.x_norms[r] : 0.0f;
  const float distance = distance_of_value<kMetric>(v, q_norm, x_norm);
  float bound = distance;
  if constexpr (kLowerBound && kMetric == Metric::L2)
    bound -= sink.lower_bound * error_scale<kMetric>(q_norm, x_norm, sqrtf(q_norm), sqrtf(x_norm));
  else if constexpr (kLowerBound && kMetric == Metric::Cosine)
    bound -= sink.lower_bound * error_scale<kMetric>(0, 0, 0, 0);
  // With the bound a NaN says nothing about the exact distance (a row scale_to_fp16 could not
  // scale, or an overflow): the re-rank decides.
  const bool unknown = kLowerBound && isnan(bound);
  if (unknown || better(bound, row, tile->tau_d[t], tile->tau_i[t]))
    append(sink, query, row, distance);
}

// A warp's staged products. A warp's products past kStagedPerWarp in one tile take the exact
// test at once (a query whose threshold everything beats: NaN, or a list about to overflow;
// keep_unstaged).
inline constexpr int kStagedPerWarp = 32;
struct StagedCandidate {
  std::int32_t query;  // in the block's query tile
  std::int32_t row;
  float value;  // quick_value
};
struct CandidateStage {
  std::uint32_t count[resident::kThreads / 32];
  StagedCandidate entries[resident::kThreads / 32][kStagedPerWarp];
};

// (t, row, v) into the warp's next slot; false when the slots are full.
__device__ __forceinline__ bool stage_candidate(CandidateStage& staged, int t, std::int32_t row,
                                                float v) {
  const int warp = threadIdx.x / 32;
  const unsigned slot = atomicAdd(&staged.count[warp], 1u);
  if (slot >= kStagedPerWarp) return false;
  staged.entries[warp][slot] = {t, row, v};
  return true;
}

// The warp's staged products through the exact test into the candidate lists, a lane each, once
// there are at least `at_least` of them. Every lane of the warp calls it.
template <Metric kMetric, bool kLowerBound, FilterEngine kEngine>
__device__ __forceinline__ void flush_staged(const Sink& sink, const QueryTile& tile,
                                             CandidateStage& staged, std::size_t q0,
                                             unsigned at_least) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncwarp();
  const unsigned count = staged.count[warp];
  if (count < at_least) return;
  const unsigned held = count < kStagedPerWarp ? count : kStagedPerWarp;
  if (static_cast<unsigned>(lane) < held) {
    const StagedCandidate c = staged.entries[warp][lane];
    keep_staged<kMetric, kLowerBound, kEngine>(sink, &tile, c.query, q0, c.row, c.value);
  }
  __syncwarp();
  if (lane == 0) staged.count[warp] = 0;
  __syncwarp();
}

// The exact test of the values of a 16-value group (resident_epilogue's `group`) that found the
// warp's slots full (bit j: value j), at one call site for the group: a call site a value (128 a
// tile) filled the instruction cache with copies of the call, and the warps waited on
// instruction fetches. Rare: a query whose threshold everything beats.
template <Metric kMetric, bool kLowerBound, FilterEngine kEngine>
__device__ __forceinline__ void keep_unstaged(const Sink& sink, const QueryTile& tile,
                                              const float (&v)[16], std::size_t q0,
                                              std::int32_t x0, int group, unsigned unstaged) {
  do {
    const int j = __ffs(unstaged) - 1;
    unstaged &= unstaged - 1;
    float value = v[0];  // v[j] by selects: an index in a register would put v in local memory
#pragma unroll
    for (int i = 1; i < 16; ++i)
      if (j == i) value = v[i];
    keep_staged<kMetric, kLowerBound, kEngine>(sink, &tile, resident::thread_query((j / 2) % 2),
                                               q0, x0 + wgmma::accumulator_row(16 * group + j),
                                               value);
  } while (unstaged != 0);
}

// Whether all 16 values fail their limits (v > limit; a NaN passes): one predicate, in one asm
// statement so that the compiler cannot keep the 16 comparisons for the branch that redoes them
// (it did, in registers, at two instructions a product).
__device__ __forceinline__ bool all_fail(const float (&v)[16], float limit0, float limit1) {
  unsigned out;
  asm("{\n.reg .pred p;\n"
      "setp.gt.f32 p, %1, %17;\n"
      "setp.gt.and.f32 p, %2, %17, p;\n"
      "setp.gt.and.f32 p, %3, %18, p;\n"
      "setp.gt.and.f32 p, %4, %18, p;\n"
      "setp.gt.and.f32 p, %5, %17, p;\n"
      "setp.gt.and.f32 p, %6, %17, p;\n"
      "setp.gt.and.f32 p, %7, %18, p;\n"
      "setp.gt.and.f32 p, %8, %18, p;\n"
      "setp.gt.and.f32 p, %9, %17, p;\n"
      "setp.gt.and.f32 p, %10, %17, p;\n"
      "setp.gt.and.f32 p, %11, %18, p;\n"
      "setp.gt.and.f32 p, %12, %18, p;\n"
      "setp.gt.and.f32 p, %13, %17, p;\n"
      "setp.gt.and.f32 p, %14, %17, p;\n"
      "setp.gt.and.f32 p, %15, %18, p;\n"
      "setp.gt.and.f32 p, %16, %18, p;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(out)
      : "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]), "f"(v[4]), "f"(v[5]), "f"(v[6]), "f"(v[7]),
        "f"(v[8]), "f"(v[9]), "f"(v[10]), "f"(v[11]), "f"(v[12]), "f"(v[13]), "f"(v[14]),
        "f"(v[15]), "f"(limit0), "f"(limit1));
  return out != 0;
}

// One corpus tile's epilogue: a thread holds 2 queries × 32 rows (two adjacent rows of each 8-row
// group, wgmma::accumulator_row); the rows' squared norms and scales are in shared memory
// (`figures`: float[2][128]). Value j of a 16-value group is accumulator 16 · group + j: row pair
// j / 4, query (j / 2) % 2, row j % 2 of the pair.
template <class Mma, Metric kMetric, bool kLowerBound, FilterEngine kEngine>
__device__ __forceinline__ void resident_epilogue(
    const Sink& sink, const QueryTile& tile, CandidateStage& staged,
    const typename Mma::Accumulator (&acc)[wgmma::kAccumulators], std::int32_t x0,
    const float* figures, std::size_t q0, const QueryFigures (&mine)[2],
    const float (&q_scale)[2]) {
#pragma unroll
  for (int group = 0; group < 4; ++group) {
    float v[16];
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const int i = 16 * group + 4 * g;
      const int rel = wgmma::accumulator_row(i);  // even: the pair is one 8-byte load
      const float2 norm = *reinterpret_cast<const float2*>(figures + rel);
      const float2 scale = Mma::kScaled
                               ? *reinterpret_cast<const float2*>(figures + resident::kRows + rel)
                               : make_float2(1.0f, 1.0f);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = resident_row_figure<kMetric, kLowerBound>(e ? norm.y : norm.x);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float dot = product<Mma>(acc[i + 2 * h + e], q_scale[h], e ? scale.y : scale.x);
          v[4 * g + 2 * h + e] = quick_value<kMetric, kLowerBound>(dot, x, mine[h].weight);
        }
      }
    }
    if (all_fail(v, mine[0].limit, mine[1].limit)) continue;
    unsigned unstaged = 0;  // value j found the warp's slots full: bit j
#pragma unroll
    for (int j = 0; j < 16; ++j)
      if (!(v[j] > mine[(j / 2) % 2].limit) &&
          !stage_candidate(staged, resident::thread_query((j / 2) % 2),
                           x0 + wgmma::accumulator_row(16 * group + j), v[j]))
        unstaged |= 1u << j;
    if (unstaged != 0)
      keep_unstaged<kMetric, kLowerBound, kEngine>(sink, tile, v, q0, x0, group, unstaged);
  }
}

// The block's 128 queries from q0 into the tile, and this thread's two queries' figures and
// scales (resident::thread_query: the resident and the streamed tiles place them alike).
template <class Mma, Metric kMetric, bool kLowerBound>
__device__ __forceinline__ void begin_queries(const FilterArgs& a, QueryTile& tile,
                                              std::size_t q0, QueryFigures (&mine)[2],
                                              float (&q_scale)[2]) {
  load_query_tile<resident::kThreads>(a, tile, q0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const std::size_t q = q0 + resident::thread_query(h);
    mine[h] = resident_figures<kMetric, kLowerBound>(a, q);
    q_scale[h] = Mma::kScaled && q < a.q.rows ? a.q.scales[q] : 1.0f;
  }
}

template <class Mma, Metric kMetric, bool kLowerBound>
__global__ void __launch_bounds__(resident::kThreads,
                                  resident::RowTestPipeline::kBlocksPerMultiprocessor)
    resident_filter_kernel(FilterArgs a, const __grid_constant__ CUtensorMap corpus) {
  extern __shared__ char dynamic_shared[];
  __shared__ QueryTile tile;
  __shared__ CandidateStage staged;
  const Sink sink = sink_of(a);
  if (threadIdx.x % 32 == 0) staged.count[threadIdx.x / 32] = 0;
  QueryFigures mine[2];
  float q_scale[2];
  std::size_t q0 = 0;
  auto begin_segment = [&](std::size_t query_tile) {
    // The last segment's staged products are tested against its queries' figures, before any
    // warp replaces them.
    flush_staged<kMetric, kLowerBound, FilterEngine::Resident>(sink, tile, staged, q0, 1);
    __syncthreads();
    q0 = query_tile * resident::kQueries;
    begin_queries<Mma, kMetric, kLowerBound>(a, tile, q0, mine, q_scale);
  };
  auto finish_tile = [&](const auto& acc, std::size_t x0, const float* figures) {
    constexpr FilterEngine kEngine = FilterEngine::Resident;
    resident_epilogue<Mma, kMetric, kLowerBound, kEngine>(
        sink, tile, staged, acc, static_cast<std::int32_t>(x0), figures, q0, mine, q_scale);
    flush_staged<kMetric, kLowerBound, kEngine>(sink, tile, staged, q0, kStagedPerWarp);
  };
  // L2 reads +inf as the norm of rows past the corpus: their products fail the quick test.
  const resident::RowFigures figures{a.x_norms, Mma::kScaled ? a.x.scales : nullptr,
                                     kMetric == Metric::L2 ? INFINITY : 0.0f};
  resident::stream_tiles<resident::RowTestPipeline, Mma>(
      corpus, a.q, a.x, a.dim * Mma::kElementBytes, figures, dynamic_shared, begin_segment,
      finish_tile);
  flush_staged<kMetric, kLowerBound, FilterEngine::Resident>(sink, tile, staged, q0, 1);
}

// The filter on long rows (streamed_tiles.cuh): the resident kernel's epilogue on each half of a
// 128-query × 256-row tile whose operands both stream through the stages in chunks.
static_assert(streamed::kThreads == resident::kThreads && streamed::kHalfRows == resident::kRows,
              "the streamed halves are what resident_epilogue and CandidateStage take");

template <class Mma, Metric kMetric, bool kLowerBound>
__global__ void __launch_bounds__(streamed::kThreads, 1)
    streamed_filter_kernel(FilterArgs a, const __grid_constant__ CUtensorMap queries,
                           const __grid_constant__ CUtensorMap corpus) {
  extern __shared__ char dynamic_shared[];
  __shared__ QueryTile tile;
  __shared__ CandidateStage staged;
  const Sink sink = sink_of(a);
  if (threadIdx.x % 32 == 0) staged.count[threadIdx.x / 32] = 0;
  QueryFigures mine[2];
  float q_scale[2];
  std::size_t q0 = 0;
  auto begin_pair = [&](std::size_t first_query) {
    q0 = first_query;
    begin_queries<Mma, kMetric, kLowerBound>(a, tile, q0, mine, q_scale);
  };
  // The staged products are all tested at the end of a pair: the next one replaces the queries.
  auto finish_half = [&](const auto& acc, std::size_t x0, const float* figures, bool last) {
    constexpr FilterEngine kEngine = FilterEngine::Streamed;
    resident_epilogue<Mma, kMetric, kLowerBound, kEngine>(
        sink, tile, staged, acc, static_cast<std::int32_t>(x0), figures, q0, mine, q_scale);
    flush_staged<kMetric, kLowerBound, kEngine>(sink, tile, staged, q0,
                                                last ? 1u : kStagedPerWarp);
  };
  const streamed::RowFigures figures{a.x_norms, Mma::kScaled ? a.x.scales : nullptr,
                                     kMetric == Metric::L2 ? INFINITY : 0.0f};
  streamed::stream_pairs<Mma>(queries, corpus, a.q, a.x, a.dim * Mma::kElementBytes, figures,
                              dynamic_shared, begin_pair, finish_half);
}

constexpr LaunchNames kFilterNames{
    "kNN filter kernel", "cudaFuncSetAttribute (kNN filter kernel)",
    "kNN filter kernel (more than 2^31 - 1 blocks: too many queries at once)"};

template <class Mma, Metric kMetric, bool kLowerBound>
Status launch(const FilterArgs& a, cudaStream_t stream) {
  return launch_tiles<filter_kernel<Mma, kMetric, kLowerBound>>(a, a.q.rows, a.x.rows, stream,
                                                                 kFilterNames);
}

template <class Mma, Metric kMetric, bool kLowerBound>
Status launch_resident(const FilterArgs& a, cudaStream_t stream) {
  return resident::launch<resident::RowTestPipeline,
                          resident_filter_kernel<Mma, kMetric, kLowerBound>>(
      a, a.q.rows, a.x.data, a.x.rows, a.dim * Mma::kElementBytes, stream, kFilterNames);
}

template <class Mma, Metric kMetric, bool kLowerBound>
Status launch_streamed(const FilterArgs& a, cudaStream_t stream) {
  return streamed::launch<streamed_filter_kernel<Mma, kMetric, kLowerBound>>(
      a, a.q, a.x, a.dim * Mma::kElementBytes, stream, kFilterNames);
}

// Where the resident kernel (warpgroup MMAs, resident_tiles.cuh) runs instead of tile_product.cuh's:
// fp16 / bf16 rows (scaled fp16 copies included) and int8 rows, any k the filter takes, where it
// ran faster than the mma.sync filter (docs/benchmarks.md, "Why the dispatch rules are where they
// are"). TF32 rows fit its stages only up to D = 64.
template <class Warpgroup>
inline constexpr bool kResidentFilterTakes = std::is_base_of_v<wgmma::Fp16, Warpgroup> ||
                                             std::is_same_v<Warpgroup, wgmma::Bf16> ||
                                             std::is_same_v<Warpgroup, wgmma::Int8>;

// The element types kResidentFilterTakes names.
bool resident_filter_element(Element element) {
  static_assert(kResidentFilterTakes<wgmma::Fp16> && kResidentFilterTakes<wgmma::Bf16> &&
                kResidentFilterTakes<wgmma::Int8>);
  return element == Element::Fp16 || element == Element::Bf16 || element == Element::Int8;
}

// Mma: tile_product.cuh's type; Warpgroup: warpgroup_mma.cuh's (of x's element type), taken where
// resident_filter_runs says.
template <class Mma, class Warpgroup, bool kLowerBound>
Status launch_for_metric(const FilterArgs& a, cudaStream_t s) {
  if constexpr (kResidentFilterTakes<Warpgroup>) {
    if (resident_filter_runs(a.x.element, a.dim, a.x.data)) {
      switch (a.metric) {
        case Metric::InnerProduct: return launch_resident<Warpgroup, Metric::InnerProduct, kLowerBound>(a, s);
        case Metric::Cosine: return launch_resident<Warpgroup, Metric::Cosine, kLowerBound>(a, s);
        default: return launch_resident<Warpgroup, Metric::L2, kLowerBound>(a, s);
      }
    }
    if (streamed_filter_runs(a.x.element, a.dim, a.q.data, a.x.data)) {
      switch (a.metric) {
        case Metric::InnerProduct: return launch_streamed<Warpgroup, Metric::InnerProduct, kLowerBound>(a, s);
        case Metric::Cosine: return launch_streamed<Warpgroup, Metric::Cosine, kLowerBound>(a, s);
        default: return launch_streamed<Warpgroup, Metric::L2, kLowerBound>(a, s);
      }
    }
  }
  switch (a.metric) {
    case Metric::InnerProduct: return launch<Mma, Metric::InnerProduct, kLowerBound>(a, s);
    case Metric::Cosine: return launch<Mma, Metric::Cosine, kLowerBound>(a, s);
    default: return launch<Mma, Metric::L2, kLowerBound>(a, s);
  }
}

}  // namespace

bool resident_filter_takes(Element element, std::size_t dim) {
  return resident_filter_element(element) &&
         resident::takes_row_bytes(dim * element_bytes(element)) && resident::available();
}

bool streamed_filter_runs(Element element, std::size_t dim, const void* queries,
                          const void* corpus) {
  const std::size_t row_bytes = dim * element_bytes(element);
  return resident_filter_element(element) && row_bytes % 16 == 0 &&
         row_bytes > std::size_t(resident::kMaxRowBytes) &&
         reinterpret_cast<std::uintptr_t>(queries) % 16 == 0 &&
         reinterpret_cast<std::uintptr_t>(corpus) % 16 == 0 && resident::available();
}

bool resident_filter_runs(Element element, std::size_t dim, const void* data) {
  return resident_filter_element(element) &&
         resident::takes_rows(data, dim * element_bytes(element)) && resident::available();
}

Status knn_filter(const FilterArgs& a, void* stream) {
  if (a.q.rows == 0 || a.x.rows == 0) return {};
  auto s = static_cast<cudaStream_t>(stream);
  if (a.lower_bound > 0.0f) return launch_for_metric<ScaledFp16Mma, wgmma::ScaledFp16, true>(a, s);
  switch (a.q.element) {
    case Element::Fp16: return launch_for_metric<Fp16Mma, wgmma::Fp16, false>(a, s);
    case Element::Bf16: return launch_for_metric<Bf16Mma, wgmma::Bf16, false>(a, s);
    case Element::Int8: return launch_for_metric<Int8Mma, wgmma::Int8, false>(a, s);
    default: return launch_for_metric<Tf32Mma, wgmma::Tf32, false>(a, s);
  }
}

Status filter_overflowed(const std::uint32_t* counts, std::size_t rows, std::size_t capacity,
                         void* stream, bool& overflowed) {
  overflowed = false;
  if (rows == 0) return {};
  std::vector<std::uint32_t> host(rows);
  auto s = static_cast<cudaStream_t>(stream);
  Status st;
  cudaError_t e = cudaMemcpyAsync(host.data(), counts, rows * sizeof(std::uint32_t),
                                  cudaMemcpyDeviceToHost, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) {
    st.cuda = static_cast<int>(e);
    st.what = "reading the kNN filter's candidate counts";
    return st;
  }
  overflowed = *std::max_element(host.begin(), host.end()) > capacity;
  return st;
}

}  // namespace gpupool::cuda_kernels
