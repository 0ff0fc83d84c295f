// Internal: the sum of squares of one 16-byte piece of a row, for row_norms (row_norms.cu) and the
// resident distance matrix, which sums its corpus rows' norms from the tiles it holds in shared
// memory (resident_tiles.cuh). Only device code: include it from .cu files.
#pragma once

#include "kernels.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace gpupool::cuda_kernels {

// The squared sum of a piece of 8 fp16 / bf16 values, 16 int8 ones (exact, with dp4a; the caller
// multiplies by the row's scale²) or 4 fp32 ones, summed in order into fp32.
template <Element kElement>
__device__ __forceinline__ float piece_squares(uint4 piece) {
  const unsigned words[4] = {piece.x, piece.y, piece.z, piece.w};
  float acc = 0.0f;
  if constexpr (kElement == Element::Int8) {
    int sum = 0;
#pragma unroll
    for (unsigned w : words) sum = __dp4a(static_cast<int>(w), static_cast<int>(w), sum);
    return static_cast<float>(sum);
  } else if constexpr (kElement == Element::Fp32) {
#pragma unroll
    for (unsigned w : words) acc = fmaf(__uint_as_float(w), __uint_as_float(w), acc);
  } else {
#pragma unroll
    for (unsigned w : words) {
      float2 v = kElement == Element::Fp16
                     ? __half22float2(*reinterpret_cast<const __half2*>(&w))
                     : __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
      acc = fmaf(v.x, v.x, acc);
      acc = fmaf(v.y, v.y, acc);
    }
  }
  return acc;
}

}  // namespace gpupool::cuda_kernels
