// The fused distance matrix (see distance_matrix.cuh): one block multiplies 128 corpus rows by
// 128 queries on the tensor cores (tile_product.cuh), turns its 64 products per thread into
// distances (the rules of distance_rules.cuh) and stores them. The kernel is bound by the matrix
// it writes: the products take a fraction of that time.
#include "distance_matrix.cuh"
#include "distance_rules.cuh"
#include "tile_product.cuh"

#include <cuda_runtime.h>

#include <cstdint>

namespace gpupool::cudak {

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

// What the epilogue needs of one query or one corpus row: its squared norm, 1 / its length
// (cosine: infinite for a zero row) and its int8 scale.
struct Figures {
  float norm = 0.0f, inverse_length = 0.0f, scale = 1.0f;
};

template <Metric kMetric>
__device__ __forceinline__ Figures figures_of(const Matrix& m, const float* norms,
                                              std::size_t row) {
  Figures f;
  if (row >= m.rows) return f;
  if (norms) f.norm = norms[row];
  if (kMetric == Metric::Cosine) f.inverse_length = 1.0f / sqrtf(f.norm);
  if (m.scales) f.scale = m.scales[row];
  return f;
}

// finish_distance's rules with this kernel's figures. Cosine multiplies by the inverse lengths
// (two multiplies instead of a square root and a division per pair).
template <Metric kMetric, bool kRecompute>
__device__ __forceinline__ float distance(float dot, const Figures& q, const Figures& x,
                                          const MatrixArgs& a, std::size_t query,
                                          std::size_t row) {
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
    if (isinf(q.inverse_length) || isinf(x.inverse_length)) return isnan(dot) ? dot : 1.0f;
    float value = fmaf(-dot * q.inverse_length, x.inverse_length, 1.0f);
    return value > 2.0f ? 2.0f : clamp_low(value, 0.0f);
  }
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

constexpr LaunchNames kMatrixNames{
    "distance matrix kernel", "cudaFuncSetAttribute (distance matrix kernel)",
    "distance matrix kernel (more than 2^31 - 1 blocks of 128 x 128)"};

template <class Mma, Metric kMetric, bool kRecompute>
Status launch(const MatrixArgs& a, cudaStream_t stream) {
  return launch_tiles<matrix_kernel<Mma, kMetric, kRecompute>>(a, a.q.rows, a.x.rows, stream,
                                                                kMatrixNames);
}

template <class Mma>
Status launch_for_metric(const MatrixArgs& a, cudaStream_t s) {
  switch (a.metric) {
    case Metric::InnerProduct: return launch<Mma, Metric::InnerProduct, false>(a, s);
    case Metric::Cosine: return launch<Mma, Metric::Cosine, false>(a, s);
    default: return launch<Mma, Metric::L2, false>(a, s);
  }
}

}  // namespace

Status distance_matrix(const MatrixArgs& a, void* stream) {
  if (a.q.rows == 0 || a.x.rows == 0) return {};
  auto s = static_cast<cudaStream_t>(stream);
  switch (a.x.element) {
    case Element::Fp16: return launch_for_metric<Fp16Mma>(a, s);
    case Element::Bf16: return launch_for_metric<Bf16Mma>(a, s);
    case Element::Int8: return launch_for_metric<Int8Mma>(a, s);
    case Element::Fp32:
      if (!a.accurate) return launch_for_metric<Tf32Mma>(a, s);
      if (a.metric == Metric::L2) return launch<Tf32x3Mma, Metric::L2, true>(a, s);
      return launch_for_metric<Tf32x3Mma>(a, s);
  }
  return {};
}

}  // namespace gpupool::cudak
