// Internal: writes results held in wgmma's accumulator layout (warpgroup_mma.cuh) into a
// row-major fp32 matrix with every warp store covering 128 contiguous bytes of four rows
// (store_slice) or, where a kernel has the shared memory, 512 bytes of one row
// (store_staged_rows).
//
// Why: in the accumulator layout a thread holds two adjacent columns of each 8-column group, so
// storing them as they lie writes 32 bytes of each of 8 rows per warp store, which an H200 wrote
// at a third of the rate of 128-byte row pieces (docs/benchmarks.md, "Why the dispatch rules are
// where they are": 1.40 against 3.72 TB/s for a 1024 × 2^20 fp32 matrix in 128 × 128 tiles).
// How: each warp passes its values through a small staging area of its own in shared memory
// (written in the accumulator layout, read back a row piece a lane): 32 + 16 accesses a thread
// per 64 × 128 tile, where swapping them between lanes takes 64 shuffles and 192 selects, enough
// instructions to set the matrix kernel's pace (ncu, H100).
// Only device code: include it from .cu files.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace gpupool::cuda_kernels::wgmma {

// A warp's staging area: 16 rows of one 32-column slice, each row padded by 16 bytes so that
// neither the accumulator layout's writes (8 rows × 32 bytes a warp access) nor the row reads
// (4 rows × 128 bytes) meet the same bank more often than their size needs.
inline constexpr int kStagingPitch = 32 * 4 + 16;
inline constexpr int kWarpStagingBytes = 16 * kStagingPitch;

// Where this thread's stores go: the four rows it writes (4i + lane / 8 of the warp's 16), each
// at its 16-byte column of a slice (lane % 8), in a matrix of `pitch` floats a row (a multiple
// of 4) whose warp's first row is `warp_rows` (16-byte aligned); null for rows from `rows` on
// (0 to 16). Worked out once per run of tiles, so that a store's address is one add.
struct SliceRows {
  float* row[4];
  __device__ SliceRows(float* warp_rows, std::size_t pitch, int rows) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 4 * i + lane / 8;
      row[i] = r < rows ? warp_rows + r * pitch + 4 * (lane % 8) : nullptr;
    }
  }
};

// A streaming (evict-first) 16-byte store where `on`, predicated rather than branched around
// (__stcs is an asm block, which the compiler only branches around).
__device__ __forceinline__ void store_streaming_if(float* at, float4 v, bool on) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
      " @p st.global.cs.v4.f32 [%0], {%1, %2, %3, %4};\n}\n" ::"l"(at),
      "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(static_cast<int>(on))
      : "memory");
}

// Stores one 32-column slice of a warp's 16 rows × 128 columns: the 16 accumulators 16·s ..
// 16·s + 15 of this thread (s: the slice), value j at row lane / 4 + 8·((j / 2) % 2) and column
// 8·(j / 4) + 2·(lane % 4) + j % 2 of the slice, to columns [first, first + 32) of `rows`,
// through the warp's staging area (kWarpStagingBytes, 16-byte aligned). Every lane of the warp
// must call it.
__device__ __forceinline__ void store_slice(const float (&d)[16], char* staging,
                                            const SliceRows& rows, std::size_t first) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int g = 0; g < 4; ++g)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = lane / 4 + 8 * h, column = 8 * g + 2 * (lane % 4);
      *reinterpret_cast<float2*>(staging + row * kStagingPitch + 4 * column) =
          make_float2(d[4 * g + 2 * h], d[4 * g + 2 * h + 1]);
    }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 v = *reinterpret_cast<const float4*>(staging + (4 * i + lane / 8) * kStagingPitch +
                                                      16 * (lane % 8));
    // (as integers: no pointer arithmetic on a null row)
    const auto at = reinterpret_cast<std::uintptr_t>(rows.row[i]) + first * sizeof(float);
    store_streaming_if(reinterpret_cast<float*>(at), v, rows.row[i] != nullptr);
  }
  __syncwarp();  // every lane has read the area before the next slice writes it
}

// The wider form, for kernels with room for it: a warp stages the values of 8 of its 16 rows
// (one half: rows 8h .. 8h + 7) over all 128 columns of the tile, then each warp store writes 512
// contiguous bytes of one row: the matrix's traffic alone, with the corpus reads, ran a few per
// cent faster this way than with 128 bytes of four rows a store, on the H100 and on the H200
// (matrix_traffic_bench; docs/benchmarks.md, "... the matrix's memory traffic alone").
// A warp's area: 8 rows of 128 columns, each padded by 16 bytes (as kStagingPitch: the
// accumulator layout's writes take two wavefronts, a row's read four, the least their sizes need).
inline constexpr int kRowStagingPitch = 128 * 4 + 16;
inline constexpr int kWarpRowStagingBytes = 8 * kRowStagingPitch;

// Stages one half of slice s (its 32 columns) of a warp's rows: d[2g + e], this thread's value of
// accumulator 16s + 4g + 2h + e (h: the half), at row lane / 4 and column 32s + 8g + 2(lane % 4)
// + e of the area.
__device__ __forceinline__ void stage_half_slice(const float (&d)[8], char* staging, int s) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    const int column = 32 * s + 8 * g + 2 * (lane % 4);
    *reinterpret_cast<float2*>(staging + lane / 4 * kRowStagingPitch + 4 * column) =
        make_float2(d[2 * g], d[2 * g + 1]);
  }
}

// Writes the 8 staged rows, row i to columns [first, first + 128) of `first_row` + i · pitch
// (floats; 16-byte aligned), for the rows i < rows (0 to 8). Every lane of the warp must call it,
// after all four slices of the half are staged.
__device__ __forceinline__ void store_staged_rows(char* staging, float* first_row,
                                                  std::size_t pitch, int rows,
                                                  std::size_t first) {
  const int lane = threadIdx.x % 32;
  __syncwarp();
  // (as integers: no pointer arithmetic past the matrix for rows that do not exist)
  const auto base = reinterpret_cast<std::uintptr_t>(first_row) + (first + 4 * lane) * sizeof(float);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float4 v = *reinterpret_cast<const float4*>(staging + i * kRowStagingPitch + 16 * lane);
    store_streaming_if(reinterpret_cast<float*>(base + i * pitch * sizeof(float)), v, i < rows);
  }
  __syncwarp();  // every lane has read the area before the next half writes it
}

}  // namespace gpupool::cuda_kernels::wgmma
