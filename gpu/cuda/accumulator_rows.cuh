// Internal: writes results held in wgmma's accumulator layout (warpgroup_mma.cuh) into a
// row-major fp32 matrix with every warp store covering 128 contiguous bytes of four rows.
//
// Why: in the accumulator layout a thread holds two adjacent columns of each 8-column group, so
// storing them as they lie writes 32 bytes of each of 8 rows per warp store. Measured on an H200
// (docs/benchmarks.md), writing a 1024 × 2^20 fp32 matrix in 128 × 128 tiles that way ran at
// 1.39 TB/s whatever the tiles' order; swapped between lanes so that a store covers 64 bytes of a
// row, 2.97 TB/s; 128 bytes (this file), 3.72 TB/s; cudaMemset, 4.60 TB/s. The swaps cost 64
// shuffles a thread per 64 × 128 tile (and save 16 of its 32 stores).
// Only device code: include it from .cu files.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace gpupool::cudak::wgmma {

// Where this thread's stores go: the four rows it writes (0, 1: the quad pair's even and odd
// row; 2, 3: the same 8 rows further), each at its 16-byte column of a slice, in a matrix of
// `pitch` floats a row (a multiple of 4) whose warp's first row is `warp_rows` (16-byte aligned);
// null for rows from `rows` on (0 to 16). Worked out once per run of tiles, so that a store's
// address is one add.
struct SliceRows {
  float* row[4];
  __device__ SliceRows(float* warp_rows, std::size_t pitch, int rows) {
    const int lane = threadIdx.x % 32, quad = lane / 4, t = lane % 4;
    const int column = 16 * (quad & 1) + 8 * (t & 1) + 4 * (t >> 1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = (quad & ~1) + 8 * (i / 2) + i % 2;
      row[i] = r < rows ? warp_rows + r * pitch + column : nullptr;
    }
  }
};

// Stores one 32-column slice of a warp's 16 rows × 128 columns: the 16 accumulators 16·s ..
// 16·s + 15 of this thread (s: the slice), value j at row lane / 4 + 8·((j / 2) % 2) and column
// 8·(j / 4) + 2·(lane % 4) + j % 2 of the slice, to columns [first, first + 32) of `rows`. Every
// lane of the warp must call it (shuffles).
__device__ __forceinline__ void store_slice(const float (&d)[16], const SliceRows& rows,
                                            std::size_t first) {
  const int lane = threadIdx.x % 32, quad = lane / 4, t = lane % 4;
  const bool odd_lane = t & 1, odd_quad = quad & 1;
  // Lanes t and t ^ 1 swap column pairs, so that each holds four adjacent columns of one 8-column
  // group: f[s][h] = row quad + 8h, columns 16s + 8·(t & 1) + 4·(t >> 1) .. + 3.
  float4 f[2][2];
#pragma unroll
  for (int s = 0; s < 2; ++s)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int even = 8 * s + 2 * h, odd = even + 4;  // groups 2s and 2s + 1
      float send0 = odd_lane ? d[even] : d[odd], send1 = odd_lane ? d[even + 1] : d[odd + 1];
      float got0 = __shfl_xor_sync(0xffffffffu, send0, 1);
      float got1 = __shfl_xor_sync(0xffffffffu, send1, 1);
      f[s][h] = odd_lane ? make_float4(got0, got1, d[odd], d[odd + 1])
                         : make_float4(d[even], d[even + 1], got0, got1);
    }
  // Quads q and q ^ 1 swap 16-column halves, so that the 8 lanes of the two quads hold 32
  // adjacent columns of one row: the even quad keeps columns 0-15 and takes the odd row's, the
  // odd quad keeps columns 16-31 and takes the even row's.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float4 send = odd_quad ? f[0][h] : f[1][h], got;
    got.x = __shfl_xor_sync(0xffffffffu, send.x, 4);
    got.y = __shfl_xor_sync(0xffffffffu, send.y, 4);
    got.z = __shfl_xor_sync(0xffffffffu, send.z, 4);
    got.w = __shfl_xor_sync(0xffffffffu, send.w, 4);
    if (float* even_row = rows.row[2 * h])
      __stcs(reinterpret_cast<float4*>(even_row + first), odd_quad ? got : f[0][h]);
    if (float* odd_row = rows.row[2 * h + 1])
      __stcs(reinterpret_cast<float4*>(odd_row + first), odd_quad ? f[1][h] : got);
  }
}

}  // namespace gpupool::cudak::wgmma
