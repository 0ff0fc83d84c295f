// Internal: the one value per product that the resident kNN kernels compute in their epilogues
// (gpu/cuda/knn_filter.cu's filter, gpu/cuda/sample_minima.cu's group minima), and the distance
// it stands for. Both kernels make it from the same accumulators in the same instructions, so a
// row's value, and the distance made from it, are the same bits in either kernel: the minima's
// thresholds are reached exactly by the rows they came from.
#pragma once

#include "distance_rules.cuh"
#include "kernels.cuh"

namespace gpupool::cuda_kernels {

// How far an approximate (scaled fp16) distance may lie from the exact fp32 one, in units of
// FilterArgs::lower_bound: the product error (twice it for L2's −2·q·x) plus, for L2, the norms'
// and the re-rank's own rounding.
template <Metric kMetric>
__device__ __forceinline__ float error_scale(float q_norm, float x_norm, float q_len, float x_len) {
  if constexpr (kMetric == Metric::Cosine) return 1.0625f;
  else if constexpr (kMetric == Metric::InnerProduct) return q_len * x_len;
  else return 2.0f * q_len * x_len + 0.0625f * (q_norm + x_norm);
}

// The value a product is tested by, `!(v > limit)`, from the product `dot`, the row's figure x
// (resident_row_figure) and, for inner product with the error bound, the query's weight:
// L2 ‖x‖² − 2·q·x (x: the row's squared norm, +inf past the corpus); inner product −q·x, with the
// bound −q·x − lb·|q|·|x| (weight = −lb·|q|, x = |x|); cosine −(q·x)/|x| (x = 1/|x|; NaN for a zero
// row).
template <Metric kMetric, bool kLowerBound>
__device__ __forceinline__ float quick_value(float dot, float x, float weight) {
  if constexpr (kMetric == Metric::L2) return fmaf(-2.0f, dot, x);
  else if constexpr (kMetric == Metric::InnerProduct) return kLowerBound ? fmaf(weight, x, -dot) : -dot;
  else return -(dot * x);
}

// The row's figure for quick_value from its squared norm.
template <Metric kMetric, bool kLowerBound>
__device__ __forceinline__ float resident_row_figure(float norm) {
  if constexpr (kMetric == Metric::L2) return norm;
  else if constexpr (kMetric == Metric::InnerProduct) return kLowerBound ? sqrtf(norm) : 0.0f;
  else return rsqrtf(norm);
}

// The distance that a quick value v (without the bound) stands for, given the squared norms of
// its query and row:
//   L2:     ‖q‖² + v, clamped at 0 (the GEMM form, summed in the other order);
//   inner:  v (= −q·x);
//   cosine: 1 + v/|q|, in [0, 2]; 1 for a zero row or query (NaN where a norm is not finite, or
//           where the product was NaN).
// It never decreases as v grows, so the least v of a set of rows gives their least distance.
template <Metric kMetric>
__device__ __forceinline__ float distance_of_value(float v, float q_norm, float x_norm) {
  if constexpr (kMetric == Metric::L2) {
    return clamp_low(q_norm + v, 0.0f);
  } else if constexpr (kMetric == Metric::InnerProduct) {
    return v;
  } else {
    const float length = sqrtf(q_norm);
    if (length == 0.0f || x_norm == 0.0f)
      return isfinite(q_norm + x_norm) ? 1.0f : __int_as_float(0x7fc00000);
    const float value = 1.0f + v / length;
    return value > 2.0f ? 2.0f : clamp_low(value, 0.0f);
  }
}

}  // namespace gpupool::cuda_kernels
