// The fused kNN filter (see knn_filter.cuh): one block multiplies a tile of 128 corpus rows by a
// tile of 128 queries on the tensor cores (mma.sync, fp32 accumulation), fed by a three-stage
// cp.async pipeline, and turns its 64 products per thread into distances in registers. A distance
// that does not beat its query's threshold costs one compare; the few that do are appended to the
// query's candidate list with an atomic counter.
#include "distance_rules.cuh"
#include "knn_filter.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

namespace gpupool::cudak {

namespace {

// Block tile: 128 corpus rows (the MMA's M) × 128 queries (its N), 8 warps of 64 × 32 each; the
// rows stream through shared memory 64 bytes at a time (32 halves or 16 floats: two MMA k-steps).
constexpr int kThreads = 256;
constexpr int kTileRows = 128;
constexpr int kTileQueries = 128;
constexpr int kWarpRows = 64;
constexpr int kWarpQueries = 32;
constexpr int kWarpsAcrossQueries = kTileQueries / kWarpQueries;
constexpr int kRowTiles = kWarpRows / 16;     // m16 tiles per warp
constexpr int kQueryTiles = kWarpQueries / 8; // n8 tiles per warp
constexpr int kStageBytes = 64;
// 16 words of a row + 4 of padding: the 8 rows × 4 words one fragment load touches fall in 32
// different banks.
constexpr int kPitchWords = 20;
constexpr int kStages = 3;
constexpr int kStageWords = (kTileRows + kTileQueries) * kPitchWords;
constexpr int kSharedBytes = kStages * kStageWords * 4;
static_assert(kThreads == (kTileRows / kWarpRows) * kWarpsAcrossQueries * 32);

// One MMA k-step covers 8 words of each row (16 halves or 8 tf32 values), so the fragment
// addressing below is the same for every element type; only the instruction differs.
struct Fp16Mma {
  using Element = __half;
  __device__ static void run(float (&c)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};
struct Bf16Mma {
  using Element = __nv_bfloat16;
  __device__ static void run(float (&c)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};
// fp32 rows go to the tensor cores as they are: the TF32 MMA reads the top 19 bits of each.
struct Tf32Mma {
  using Element = float;
  __device__ static void run(float (&c)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

__device__ __forceinline__ void copy_async16(std::uint32_t* shared_dst, const void* src, bool valid) {
  auto dst = static_cast<unsigned>(__cvta_generic_to_shared(shared_dst));
  int bytes = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled (rows past the end, dim's tail)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int Pending>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

// Four 8 × 8 matrices of 16-bit values (or 8 × 4 of 32-bit ones) from shared memory: lane l gives
// the address of row l % 8 of matrix l / 8 and receives, of each matrix, the 32 bits at row
// l / 4, word l % 4: exactly the MMA fragment layout.
__device__ __forceinline__ void load_matrices(std::uint32_t (&out)[4], const std::uint32_t* row) {
  auto address = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(out[0]), "=r"(out[1]), "=r"(out[2]), "=r"(out[3])
               : "r"(address));
}

// This thread's share of a tile's copies, addresses worked out once: rows r and r + 64
// (r = thread / 4), 16 bytes at 16 · (thread % 4) of each 64-byte step. Rows past the end and
// bytes past a row's end read as zeros (they add nothing to a product).
struct TileCopier {
  static_assert(kTileRows * 4 == 2 * kThreads && kTileQueries == kTileRows);
  const char* src[2];
  bool real[2];
  int dst_word[2];

  __device__ TileCopier(const char* data, std::size_t row0, std::size_t rows,
                        std::size_t row_bytes) {
    int part = threadIdx.x % 4;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      int r = threadIdx.x / 4 + u * (kTileRows / 2);
      real[u] = row0 + r < rows;
      src[u] = data + (real[u] ? (row0 + r) * row_bytes : 0) + part * 16;
      dst_word[u] = r * kPitchWords + part * 4;
    }
  }
  __device__ void copy(std::uint32_t* tile, int step, std::size_t row_bytes) const {
    std::size_t offset = std::size_t(step) * kStageBytes;
    bool in_row = offset + (threadIdx.x % 4) * 16 < row_bytes;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      bool valid = real[u] && in_row;
      copy_async16(tile + dst_word[u], valid ? src[u] + offset : src[u], valid);
    }
  }
};

__device__ __forceinline__ bool in_sample(const FilterSample& s, std::size_t row) {
  return s.period != 0 && row < kFilterPieces * s.period && row % s.period < s.length;
}

// How far a TF32 distance may lie from the exact fp32 one, in units of FilterArgs::lower_bound:
// the product error (twice it for L2's −2·q·x) plus, for L2, the norms' and the re-rank's own
// rounding.
template <Metric kMetric>
__device__ __forceinline__ float error_scale(float q_norm, float x_norm, float q_len, float x_len) {
  if constexpr (kMetric == Metric::Cosine) return 1.0625f;
  else if constexpr (kMetric == Metric::InnerProduct) return q_len * x_len;
  else return 2.0f * q_len * x_len + 0.0625f * (q_norm + x_norm);
}

// The block's queries' thresholds and squared norms, in shared memory.
struct QueryTile {
  float tau_d[kTileQueries];
  int tau_i[kTileQueries];
  float norm[kTileQueries];
};
// What the quick test needs of one query (in registers: 8 per thread) and of one corpus row.
struct QueryFigures {
  float norm, limit, bound_weight;
};
struct RowFigures {
  float norm, len, reduced_norm;
};

// Where kept rows go, passed by value to the out-of-line slow path.
struct Sink {
  float* cand_d;
  std::int32_t* cand_i;
  std::uint32_t* counts;
  std::size_t capacity;
  FilterSample sample;
  std::size_t x_rows, q_rows;
  float lower_bound;
};

// The exact test of a product that passed the quick one: the distance as finish_distance makes
// it (and its lower bound), inside the tiles, not a sample row, and better than the threshold in
// the full order (ties by index, NaN last). Out of line: inlined 64 times per thread it overflowed
// the instruction cache (measured: 60% of all stalls).
template <Metric kMetric, bool kLowerBound>
__device__ __noinline__ void keep_if_better(Sink sink, const QueryTile* tile, int t,
                                            std::size_t query, std::size_t row, float dot,
                                            float x_norm) {
  if (row >= sink.x_rows || query >= sink.q_rows || in_sample(sink.sample, row)) return;
  float q_norm = tile->norm[t];
  float distance = finish_distance(dot, kMetric, &q_norm, &x_norm, nullptr, nullptr, 0, 0, 0);
  float bound = distance;
  if constexpr (kLowerBound)
    bound -= sink.lower_bound *
             error_scale<kMetric>(q_norm, x_norm, sqrtf(q_norm), sqrtf(x_norm));
  int index = static_cast<int>(row);
  if (!better(bound, index, tile->tau_d[t], tile->tau_i[t])) return;
  unsigned slot = atomicAdd(&sink.counts[query], 1u);
  if (slot < sink.capacity) {
    sink.cand_d[query * sink.capacity + slot] = distance;
    sink.cand_i[query * sink.capacity + slot] = index;
  }
}

// The quick test, two to four instructions a product: a value no larger than the (lower bound of
// the) distance, up to a relative 2^-20 that QueryFigures::limit adds to the threshold, so that
// it never rejects what keep_if_better would keep. It leaves out the clamp at zero (the clamped
// distance is never smaller). NaN passes (to the exact test).
template <Metric kMetric, bool kLowerBound>
__device__ __forceinline__ bool may_beat(float dot, const QueryFigures& q, const RowFigures& x) {
  if constexpr (kMetric == Metric::L2) {
    if constexpr (kLowerBound)  // d − lb·(2|q||x| + (|q|² + |x|²)/16), regrouped
      return !(fmaf(q.bound_weight, x.len, fmaf(-2.0f, dot, q.norm + x.reduced_norm)) > q.limit);
    else
      return !(fmaf(-2.0f, dot, q.norm + x.norm) > q.limit);
  } else if constexpr (kMetric == Metric::InnerProduct) {
    if constexpr (kLowerBound) return !(fmaf(q.bound_weight, x.len, -dot) > q.limit);
    else return !(-dot > q.limit);
  } else {
    float d = finish_distance(dot, kMetric, &q.norm, &x.norm, nullptr, nullptr, 0, 0, 0);
    return !((kLowerBound ? d - q.bound_weight : d) > q.limit);
  }
}

template <Metric kMetric, bool kLowerBound>
__device__ __forceinline__ QueryFigures query_figures(float norm, float tau_d,
                                                      float lower_bound) {
  QueryFigures q{norm, tau_d, 0.0f};
  float slack = (fabsf(tau_d) + norm) * 0x1p-20f;
  if (kLowerBound && kMetric == Metric::L2) {
    q.bound_weight = -2.0f * lower_bound * sqrtf(norm);
    q.limit = tau_d + 0.0625f * lower_bound * norm + slack;
  } else if (kLowerBound && kMetric == Metric::InnerProduct) {
    q.bound_weight = -lower_bound * sqrtf(norm);
    q.limit = tau_d + slack;
  } else {
    q.bound_weight = 1.0625f * lower_bound;  // cosine (0 without the bound)
    q.limit = tau_d + slack;
  }
  return q;
}

// Accumulator c of tile (i, j): corpus row group (+8 for c >= 2), query 2·quad (+1 for odd c).
// This thread's 8 queries' figures go to registers first: the 64 tests reuse them.
template <Metric kMetric, bool kLowerBound>
__device__ __forceinline__ void filter_epilogue(const FilterArgs& a, const QueryTile& tile,
                                                const float (&acc)[kRowTiles][kQueryTiles][4],
                                                std::size_t q0, std::size_t x0, int warp_row,
                                                int warp_query, int group, int quad) {
  Sink sink{a.cand_d, a.cand_i, a.counts, a.capacity, a.sample, a.x.rows, a.q.rows, a.lower_bound};
  QueryFigures mine[kQueryTiles][2];
#pragma unroll
  for (int j = 0; j < kQueryTiles; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      int t = warp_query + j * 8 + quad * 2 + c;
      mine[j][c] = query_figures<kMetric, kLowerBound>(tile.norm[t], tile.tau_d[t], a.lower_bound);
    }
  // The 16 tests of a row tile first (independent: they overlap), then one rarely taken branch;
  // a branch after each test serialised them.
#pragma unroll
  for (int i = 0; i < kRowTiles; ++i) {
    RowFigures x[2];
    std::size_t row[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row[h] = x0 + warp_row + i * 16 + group + 8 * h;
      x[h].norm = row[h] < a.x.rows && a.x_norms ? a.x_norms[row[h]] : 0.0f;
      x[h].len = sqrtf(x[h].norm);
      x[h].reduced_norm = x[h].norm - 0.0625f * a.lower_bound * x[h].norm;
    }
    unsigned passed = 0;
#pragma unroll
    for (int j = 0; j < kQueryTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        passed |= unsigned(may_beat<kMetric, kLowerBound>(acc[i][j][e], mine[j][e % 2], x[e / 2]))
                  << (j * 4 + e);
    if (passed == 0) continue;
#pragma unroll
    for (int j = 0; j < kQueryTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (passed & (1u << (j * 4 + e))) {
          int t = warp_query + j * 8 + quad * 2 + e % 2;
          keep_if_better<kMetric, kLowerBound>(sink, &tile, t, q0 + t, row[e / 2], acc[i][j][e],
                                               x[e / 2].norm);
        }
  }
}

// One block per (query tile, corpus tile) item. Items go queries-first: the blocks at work at any
// time share a few corpus tiles (read from memory once, then from L2); the queries stay in L2.
// (Persistent blocks streaming many items through one pipeline were measured slower: the
// per-step bookkeeping cost more instructions than the pipeline fills it saved.)
template <class Mma, Metric kMetric, bool kLowerBound>
__global__ void __launch_bounds__(kThreads, 2)
    filter_kernel(FilterArgs a, std::size_t query_tiles) {
  extern __shared__ std::uint32_t stages[];
  __shared__ QueryTile tile;
  std::size_t q0 = (blockIdx.x % query_tiles) * kTileQueries;
  std::size_t x0 = (blockIdx.x / query_tiles) * kTileRows;
  std::size_t row_bytes = a.dim * sizeof(typename Mma::Element);
  int steps = static_cast<int>((row_bytes + kStageBytes - 1) / kStageBytes);
  auto rows_of = [&](int step) { return stages + (step % kStages) * kStageWords; };
  auto queries_of = [&](int step) { return rows_of(step) + kTileRows * kPitchWords; };
  const TileCopier row_copier(static_cast<const char*>(a.x.data), x0, a.x.rows, row_bytes);
  const TileCopier query_copier(static_cast<const char*>(a.q.data), q0, a.q.rows, row_bytes);
  auto load = [&](int step) {
    row_copier.copy(rows_of(step), step, row_bytes);
    query_copier.copy(queries_of(step), step, row_bytes);
  };
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) load(s);
    copy_async_commit();
  }
  for (int t = threadIdx.x; t < kTileQueries; t += kThreads) {
    std::size_t q = q0 + t;
    bool real = q < a.q.rows;  // past the last query: a threshold nothing passes
    tile.tau_d[t] = real ? a.run_d[q * a.k + a.k - 1] : -INFINITY;
    tile.tau_i[t] = real ? a.run_i[q * a.k + a.k - 1] : 0;
    tile.norm[t] = real && a.q_norms ? a.q_norms[q] : 0.0f;
  }

  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int group = lane / 4, quad = lane % 4;  // the MMA fragment coordinates of this lane
  int warp_row = (warp / kWarpsAcrossQueries) * kWarpRows;
  int warp_query = (warp % kWarpsAcrossQueries) * kWarpQueries;
  float acc[kRowTiles][kQueryTiles][4] = {};
  for (int step = 0; step < steps; ++step) {
    copy_async_wait<kStages - 2>();
    __syncthreads();  // this step's stage is in; every warp is done with the one refilled next
    if (step + kStages - 1 < steps) load(step + kStages - 1);
    copy_async_commit();
    const std::uint32_t* rows = rows_of(step) + warp_row * kPitchWords;
    const std::uint32_t* queries = queries_of(step) + warp_query * kPitchWords;
#pragma unroll
    for (int k_step = 0; k_step < 2; ++k_step) {
      // A fragment (16 rows × 8 words): matrices rows 0-7 / 8-15 × words 0-3 / 4-7, in the order
      // a0..a3. B fragments of two query tiles: queries 0-7 × words 0-3 / 4-7, then the next 8.
      std::uint32_t af[kRowTiles][4], bf[kQueryTiles][2];
      int matrix = lane / 8, matrix_row = lane % 8;
#pragma unroll
      for (int i = 0; i < kRowTiles; ++i)
        load_matrices(af[i], rows + (i * 16 + (matrix % 2) * 8 + matrix_row) * kPitchWords +
                                 k_step * 8 + (matrix / 2) * 4);
#pragma unroll
      for (int j = 0; j < kQueryTiles; j += 2) {
        std::uint32_t pair[4];
        load_matrices(pair, queries + ((j + matrix / 2) * 8 + matrix_row) * kPitchWords +
                                k_step * 8 + (matrix % 2) * 4);
        bf[j][0] = pair[0], bf[j][1] = pair[1], bf[j + 1][0] = pair[2], bf[j + 1][1] = pair[3];
      }
#pragma unroll
      for (int i = 0; i < kRowTiles; ++i)
#pragma unroll
        for (int j = 0; j < kQueryTiles; ++j) Mma::run(acc[i][j], af[i], bf[j]);
    }
  }
  filter_epilogue<kMetric, kLowerBound>(a, tile, acc, q0, x0, warp_row, warp_query, group, quad);
}

template <class Mma, Metric kMetric, bool kLowerBound>
Status launch(const FilterArgs& a, cudaStream_t stream) {
  std::size_t query_tiles = (a.q.rows + kTileQueries - 1) / kTileQueries;
  std::size_t row_tiles = (a.x.rows + kTileRows - 1) / kTileRows;
  Status st;
  auto kernel = filter_kernel<Mma, kMetric, kLowerBound>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       kSharedBytes);
  if (e != cudaSuccess) {
    st.cuda = static_cast<int>(e);
    st.what = "cudaFuncSetAttribute (kNN filter kernel)";
    return st;
  }
  std::size_t blocks = query_tiles * row_tiles;
  if (blocks > static_cast<std::size_t>(INT_MAX)) {
    st.cuda = static_cast<int>(cudaErrorInvalidConfiguration);
    st.what = "kNN filter kernel (more than 2^31 - 1 blocks: too many queries at once)";
    return st;
  }
  kernel<<<static_cast<unsigned>(blocks), kThreads, kSharedBytes, stream>>>(a, query_tiles);
  e = cudaGetLastError();
  if (e != cudaSuccess) {
    st.cuda = static_cast<int>(e);
    st.what = "kNN filter kernel";
  }
  return st;
}

}  // namespace

bool filter_supported(Element element, std::size_t dim) {
  switch (element) {
    case Element::Fp16:
    case Element::Bf16: return dim % 8 == 0;
    case Element::Fp32: return dim % 4 == 0;
    default: return false;
  }
}

namespace {

template <class Mma, bool kLowerBound>
Status launch_for_metric(const FilterArgs& a, cudaStream_t s) {
  switch (a.metric) {
    case Metric::InnerProduct: return launch<Mma, Metric::InnerProduct, kLowerBound>(a, s);
    case Metric::Cosine: return launch<Mma, Metric::Cosine, kLowerBound>(a, s);
    default: return launch<Mma, Metric::L2, kLowerBound>(a, s);
  }
}

}  // namespace

Status knn_filter(const FilterArgs& a, void* stream) {
  if (a.q.rows == 0 || a.x.rows == 0) return {};
  auto s = static_cast<cudaStream_t>(stream);
  switch (a.q.element) {
    case Element::Fp16: return launch_for_metric<Fp16Mma, false>(a, s);
    case Element::Bf16: return launch_for_metric<Bf16Mma, false>(a, s);
    default:
      return a.lower_bound > 0.0f ? launch_for_metric<Tf32Mma, true>(a, s)
                                  : launch_for_metric<Tf32Mma, false>(a, s);
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

}  // namespace gpupool::cudak
