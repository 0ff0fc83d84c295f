// Internal: the rules every CUDA kernel of gpupool shares (the GEMM epilogue, the running top-k,
// the re-rank, the fused kernels): the order of (distance, index) pairs and how a dot product
// becomes a distance. The CPU kernels (gpu/cpu_kernels.cpp) follow the same rules.
#pragma once

#include "kernels.cuh"

#include <cstddef>

namespace gpupool::cuda_kernels {

// max(v, low) with NaN passed on (one instruction, sm_80's max.NaN, where `v < low ? low : v`
// took a compare and a select: a fused kernel's epilogue clamps every distance it writes).
__device__ __forceinline__ float clamp_low(float v, float low) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(v), "f"(low));
  return r;
}

// Same order as the CPU kernels: smaller first, NaN after numbers, ties by index, -1 last.
__device__ __forceinline__ bool better(float da, int ia, float db, int ib) {
  if ((ia < 0) != (ib < 0)) return ib < 0;
  bool na = isnan(da), nb = isnan(db);
  if (na != nb) return nb;
  if (!na && da != db) return da < db;
  return ia < ib;
}

// dot (from the GEMM) → distance of a query and a corpus row with squared norms qn and xn (read
// only for L2 and cosine). For fp32-accurate L2 (q32 and x32: the two fp32 rows), pairs whose
// GEMM form cancelled badly (result below 2^-10 of |q|^2 + |x|^2) are recomputed in the direct
// form. The norms come as values: a caller that reads them from memory loads them ahead of its
// own work (the top-k pass waited on each pair's two loads in turn: 7 round trips a step).
__device__ __forceinline__ float finish_distance(float dot, Metric metric, float qn, float xn,
                                                 const float* q32, const float* x32,
                                                 std::size_t dim) {
  if (metric == Metric::InnerProduct) return -dot;
  if (metric == Metric::L2) {
    float sum = qn + xn;
    float value = sum - 2.0f * dot;
    if (q32 && !(value > sum * 0x1p-10f)) {
      float acc = 0.0f;
      for (std::size_t c = 0; c < dim; ++c) {
        float d = q32[c] - x32[c];
        acc += d * d;
      }
      value = acc;
    }
    return clamp_low(value, 0.0f);
  }
  float a = sqrtf(qn), b = sqrtf(xn);
  if (a == 0.0f || b == 0.0f) return isnan(dot) ? dot : 1.0f;
  float value = 1.0f - dot / (a * b);
  return value > 2.0f ? 2.0f : clamp_low(value, 0.0f);
}

}  // namespace gpupool::cuda_kernels
