// The sample's thresholds (see sample_minima.cuh): knn_filter's resident kernel stream
// (resident_tiles.cuh) over the gathered sample, whose epilogue keeps the least quick value of
// each query's 32 products a thread holds, as a distance, instead of testing them; then a radix
// select of each query's k-th least minimum.
#include "distance_rules.cuh"
#include "quick_values.cuh"
#include "resident_tiles.cuh"
#include "sample_minima.cuh"
#include "tile_product.cuh"

#include <cuda_runtime.h>

#include <cstdint>

namespace gpupool::cuda_kernels {

namespace {

// One tile's minima: for each of the thread's two queries, the least value of the 32 rows it
// holds as a distance (NaN only where all 32 are: fminf passes over NaN; so the least value
// comes from a row of nonzero norm, whose cosine distance does not need that norm). Products of
// int8 rows are scaled as the filter's epilogue scales them (the same instructions: the same bits).
// kBound (fp32-accurate's scaled fp16 copies): each row's distance plus the error bound the
// filter subtracts for its lower bound, so an upper bound of the row's exact distance; `figures`
// then holds the rows' squared norms as they are.
template <class Mma, Metric kMetric, bool kBound>
__device__ __forceinline__ float row_value(typename Mma::Accumulator sum, float q_scale,
                                           float x_scale, float q_norm, float figure,
                                           float lower_bound) {
  const float dot = tiles::product<Mma>(sum, q_scale, x_scale);
  if constexpr (kBound)
    return finish_distance(dot, kMetric, q_norm, figure, nullptr, nullptr, 0) +
           lower_bound * error_scale<kMetric>(q_norm, figure, sqrtf(q_norm), sqrtf(figure));
  else return quick_value<kMetric, false>(dot, resident_row_figure<kMetric, false>(figure), 0.0f);
}

template <class Mma, Metric kMetric, bool kBound>
__device__ __forceinline__ void store_minima(const MinimaArgs& a, std::size_t groups,
                                             const typename Mma::Accumulator (&acc)[wgmma::kAccumulators],
                                             std::size_t x0, const float* figures, std::size_t q0,
                                             const float (&q_norm)[2], const float (&q_scale)[2]) {
  float least[2] = {__int_as_float(0x7fc00000), __int_as_float(0x7fc00000)};
#pragma unroll
  for (int m = 0; m < wgmma::kAccumulators / 4; ++m)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int rel = wgmma::accumulator_row(4 * m + e);
      const float x_scale = Mma::kScaled ? figures[resident::kRows + rel] : 1.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        least[h] = fminf(least[h],
                         row_value<Mma, kMetric, kBound>(acc[4 * m + 2 * h + e], q_scale[h], x_scale,
                                                         q_norm[h], figures[rel], a.lower_bound));
    }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const std::size_t q = q0 + resident::thread_query(h);
    if (q < a.q.rows)
      a.minima[q * groups + x0 / kMinimaGroupRows + threadIdx.x % 4] =
          kBound ? least[h] : distance_of_value<kMetric>(least[h], q_norm[h], 1.0f);
  }
}

template <class Mma, Metric kMetric, bool kBound>
__global__ void __launch_bounds__(resident::kThreads,
                                  resident::RowTestPipeline::kBlocksPerMultiprocessor)
    sample_minima_kernel(MinimaArgs a, const __grid_constant__ CUtensorMap sample) {
  extern __shared__ char dynamic_shared[];
  const std::size_t groups = a.x.rows / kMinimaGroupRows;
  float q_norm[2] = {0.0f, 0.0f}, q_scale[2] = {1.0f, 1.0f};
  std::size_t q0 = 0;
  auto begin_segment = [&](std::size_t query_tile) {
    q0 = query_tile * resident::kQueries;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::size_t q = q0 + resident::thread_query(h);
      q_norm[h] = q < a.q.rows && a.q_norms ? a.q_norms[q] : 0.0f;
      q_scale[h] = Mma::kScaled && q < a.q.rows ? a.q.scales[q] : 1.0f;
    }
  };
  auto finish_tile = [&](const auto& acc, std::size_t x0, const float* figures) {
    store_minima<Mma, kMetric, kBound>(a, groups, acc, x0, figures, q0, q_norm, q_scale);
  };
  // No row lies past the end (the sample is whole tiles).
  const resident::RowFigures figures{a.x_norms, Mma::kScaled ? a.x.scales : nullptr, 0.0f};
  resident::stream_tiles<resident::RowTestPipeline, Mma>(
      sample, a.q, a.x, a.dim * Mma::kElementBytes, figures, dynamic_shared, begin_segment,
      finish_tile);
}

// A float's place in the order of distances as an unsigned key (NaN last, as one key).
__device__ __forceinline__ std::uint32_t order_key(float d) {
  const std::uint32_t bits = __float_as_uint(d);
  if (isnan(d)) return 0xffffffffu;
  return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}
__device__ __forceinline__ float key_value(std::uint32_t key) {
  if (key == 0xffffffffu) return __int_as_float(0x7fc00000);
  return __uint_as_float(key & 0x80000000u ? key & 0x7fffffffu : ~key);
}

// One block a query: the k-th least of its group minima (NaN last), by a radix select over their
// keys, 8 bits a pass: each pass counts the keys that share the digits found so far by their
// next digit, and keeps the digit where the k-th falls.
constexpr int kSelectThreads = 256;
__global__ void __launch_bounds__(kSelectThreads)
    kth_minimum_kernel(const float* minima, std::size_t groups, int k, float* thresholds) {
  __shared__ unsigned counts[256];
  __shared__ std::uint32_t found;
  __shared__ int rank_left;
  const float* row = minima + blockIdx.x * groups;
  std::uint32_t prefix = 0, mask = 0;
  int rank = k;  // the rank-th least (from 1) of the keys with those digits
  for (int shift = 24; shift >= 0; shift -= 8) {
    counts[threadIdx.x] = 0;
    __syncthreads();
    for (std::size_t j = threadIdx.x; j < groups; j += kSelectThreads) {
      const std::uint32_t key = order_key(row[j]);
      if ((key & mask) == prefix) atomicAdd(&counts[(key >> shift) & 0xffu], 1u);
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // the digit where the rank-th falls: a warp scans 8 counts a lane
      const int lane = threadIdx.x;
      unsigned mine[8], sum = 0;
#pragma unroll
      for (int b = 0; b < 8; ++b) sum += mine[b] = counts[8 * lane + b];
      unsigned through = sum;  // the counts of lanes 0..lane
#pragma unroll
      for (int offset = 1; offset < 32; offset *= 2) {
        const unsigned before = __shfl_up_sync(0xffffffffu, through, offset);
        if (lane >= offset) through += before;
      }
      unsigned left = static_cast<unsigned>(rank) - (through - sum);
      if (through - sum < static_cast<unsigned>(rank) && static_cast<unsigned>(rank) <= through) {
        int b = 0;
        while (left > mine[b]) left -= mine[b++];
        found = prefix | static_cast<std::uint32_t>(8 * lane + b) << shift;
        rank_left = static_cast<int>(left);
      }
    }
    __syncthreads();
    prefix = found, rank = rank_left, mask |= 0xffu << shift;
    __syncthreads();  // every thread has read `found` before thread 0 writes it again
  }
  if (threadIdx.x == 0) thresholds[blockIdx.x] = key_value(prefix);
}

constexpr tiles::LaunchNames kMinimaNames{
    "kNN sample minima kernel", "cudaFuncSetAttribute (kNN sample minima kernel)",
    "kNN sample minima kernel (too many blocks)"};

template <class Mma, Metric kMetric, bool kBound>
Status launch(const MinimaArgs& a, cudaStream_t s) {
  return resident::launch<resident::RowTestPipeline, sample_minima_kernel<Mma, kMetric, kBound>>(
      a, a.q.rows, a.x.data, a.x.rows, a.dim * Mma::kElementBytes, s, kMinimaNames);
}

template <class Mma, bool kBound = false>
Status launch_for_metric(const MinimaArgs& a, cudaStream_t s) {
  switch (a.metric) {
    case Metric::InnerProduct: return launch<Mma, Metric::InnerProduct, kBound>(a, s);
    case Metric::Cosine: return launch<Mma, Metric::Cosine, kBound>(a, s);
    default: return launch<Mma, Metric::L2, kBound>(a, s);
  }
}

}  // namespace

Status sample_minima(const MinimaArgs& a, void* stream) {
  if (a.q.rows == 0 || a.x.rows == 0) return {};
  const std::size_t groups = a.x.rows / kMinimaGroupRows;
  if (a.x.rows % resident::kRows != 0 || a.k == 0 || a.k > groups ||
      !resident_filter_runs(a.x.element, a.dim, a.x.data))
    return cuda_failure(cudaErrorInvalidValue,
                        "kNN sample minima (rows the resident kernel cannot take, or k > groups)");
  auto s = static_cast<cudaStream_t>(stream);
  Status st = a.lower_bound > 0.0f ? launch_for_metric<wgmma::ScaledFp16, true>(a, s)
              : a.x.element == Element::Bf16 ? launch_for_metric<wgmma::Bf16>(a, s)
              : a.x.element == Element::Int8 ? launch_for_metric<wgmma::Int8>(a, s)
                                             : launch_for_metric<wgmma::Fp16>(a, s);
  if (!st.ok()) return st;
  if (a.q.rows > 0x7fffffffu)
    return cuda_failure(cudaErrorInvalidConfiguration, "kNN thresholds kernel (too many queries)");
  kth_minimum_kernel<<<static_cast<unsigned>(a.q.rows), kSelectThreads, 0, s>>>(
      a.minima, groups, static_cast<int>(a.k), a.thresholds);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status{} : cuda_failure(e, "kNN thresholds kernel");
}

}  // namespace gpupool::cuda_kernels
