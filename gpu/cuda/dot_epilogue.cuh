// Internal: a GEMM dot product turned into its pair's distance (kernels.cuh's Epilogue), the
// step both the cuBLAS path's epilogue pass (gemm_distances.cu) and the running top-k pass
// (running_topk.cu, which reads the dot products once) take. The row figures it needs (norms,
// int8 scales) are loaded ahead of the work, so that their loads overlap.
#pragma once

#include "distance_rules.cuh"
#include "kernels.cuh"

#include <cstddef>

namespace gpupool::cuda_kernels {

// The figures of query row i and corpus row j that finish() reads, loaded ahead.
struct PairFigures {
  float q_norm = 0.0f, x_norm = 0.0f, q_scale = 1.0f, x_scale = 1.0f;
};
__device__ __forceinline__ float query_norm(const Epilogue& e, std::size_t i) {
  return e.q_norms ? e.q_norms[i] : 0.0f;
}
__device__ __forceinline__ float query_scale(const Epilogue& e, std::size_t i) {
  return e.q_scales ? e.q_scales[i] : 1.0f;
}
__device__ __forceinline__ void load_row_figures(const Epilogue& e, std::size_t j, PairFigures& f) {
  if (e.x_norms) f.x_norm = e.x_norms[j];
  if (e.x_scales) f.x_scale = e.x_scales[j];
}

// A GEMM dot product → the pair's distance. Int8 inputs reach the GEMM widened to fp16 (exact:
// |q| <= 127), so their dot products still carry the per-row scales.
__device__ __forceinline__ float finish(float dot, const Epilogue& e, const PairFigures& f,
                                        std::size_t i, std::size_t j) {
  if (e.q_scales) dot *= f.q_scale * f.x_scale;
  return finish_distance(dot, e.metric, f.q_norm, f.x_norm, e.q32 ? e.q32 + i * e.dim : nullptr,
                         e.x32 ? e.x32 + j * e.dim : nullptr, e.dim);
}

__device__ __forceinline__ float finish(float dot, const Epilogue& e, std::size_t i, std::size_t j) {
  PairFigures f{query_norm(e, i), 0.0f, query_scale(e, i), 1.0f};
  load_row_figures(e, j, f);
  return finish(dot, e, f, i, j);
}

}  // namespace gpupool::cuda_kernels
