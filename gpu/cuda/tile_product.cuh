// Internal: the tensor-core tile product that the fused kernels share (gpu/cuda/knn_filter.cu,
// gpu/cuda/distance_matrix.cu). One block of 256 threads multiplies 128 corpus rows (the MMA's M)
// by 128 queries (its N) with mma.sync and fp32 (int8: int32) accumulation, fed by a cp.async
// pipeline through shared memory; each kernel then does its own thing with the products, which
// never leave the registers. Only device code: include it from .cu files.
#pragma once

#include "kernels.cuh"
#include "per_device.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace gpupool::cuda_kernels::tiles {

// 8 warps of 64 rows × 32 queries; the rows stream through shared memory 64 bytes at a time
// (32 halves, 16 floats or 64 int8 values: two MMA k-steps).
inline constexpr int kThreads = 256;
inline constexpr int kTileRows = 128;
inline constexpr int kTileQueries = 128;
inline constexpr int kWarpRows = 64;
inline constexpr int kWarpQueries = 32;
inline constexpr int kWarpsAcrossQueries = kTileQueries / kWarpQueries;
inline constexpr int kRowTiles = kWarpRows / 16;      // m16 tiles per warp
inline constexpr int kQueryTiles = kWarpQueries / 8;  // n8 tiles per warp
inline constexpr int kStageBytes = 64;
// 16 words of a row + 4 of padding: the 8 rows × 4 words one fragment load touches fall in 32
// different banks.
inline constexpr int kPitchWords = 20;
// Four stages: a power of two makes a step's stage one AND (not measured against three alone).
inline constexpr int kStages = 4;
inline constexpr int kStageWords = (kTileRows + kTileQueries) * kPitchWords;
inline constexpr int kSharedBytes = kStages * kStageWords * 4;
static_assert(kThreads == (kTileRows / kWarpRows) * kWarpsAcrossQueries * 32);

// Every MMA k-step covers 8 words of each row (16 halves, 8 tf32 values or 32 int8 values) with
// the same fragment layout in words, so the addressing below serves every element type; the
// types differ in their instruction and accumulator.
template <class Acc>
using WarpAccumulators = Acc[kRowTiles][kQueryTiles][4];
using RowFragments = std::uint32_t[kRowTiles][4];
using QueryFragments = std::uint32_t[kQueryTiles][2];

#define GPUPOOL_MMA_F32(shape_types)                                                            \
  asm volatile("mma.sync.aligned." shape_types " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "       \
               "{%0,%1,%2,%3};\n"                                                               \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))

// kScaled: the rows carry a scale each (Matrix::scales) that the accumulated sums are multiplied
// by (product below).
struct Fp16Mma {
  using Element = __half;
  using Accumulator = float;
  static constexpr bool kScaled = false;
  __device__ static void run(float (&c)[4], const std::uint32_t (&a)[4],
                             const std::uint32_t (&b)[2]) {
    GPUPOOL_MMA_F32("m16n8k16.row.col.f32.f16.f16.f32");
  }
};
struct Bf16Mma {
  using Element = __nv_bfloat16;
  using Accumulator = float;
  static constexpr bool kScaled = false;
  __device__ static void run(float (&c)[4], const std::uint32_t (&a)[4],
                             const std::uint32_t (&b)[2]) {
    GPUPOOL_MMA_F32("m16n8k16.row.col.f32.bf16.bf16.f32");
  }
};
// fp32 rows go to the tensor cores as they are: the TF32 MMA reads the top 19 bits of each.
struct Tf32Mma {
  using Element = float;
  using Accumulator = float;
  static constexpr bool kScaled = false;
  __device__ static void run(float (&c)[4], const std::uint32_t (&a)[4],
                             const std::uint32_t (&b)[2]) {
    GPUPOOL_MMA_F32("m16n8k8.row.col.f32.tf32.tf32.f32");
  }
};
#undef GPUPOOL_MMA_F32
// fp32 rows as fp16 rows scaled by a power of two each (scale_to_fp16 in kernels.cuh): the fp32-
// accurate kNN filter's operands, at the fp16 rate and half TF32's bytes.
struct ScaledFp16Mma : Fp16Mma {
  static constexpr bool kScaled = true;
};

// Int8 rows: exact int32 sums (|q · x| <= 127² · dim < 2^31 for dim < 133,000).
struct Int8Mma {
  using Element = std::int8_t;
  using Accumulator = int;
  static constexpr bool kScaled = true;
  __device__ static void run(int (&c)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

// An accumulated product as a float. Scaled rows: the sum is in the rows' units (int8: an exact
// integer; scaled fp16: powers of two, so the scaling is exact), times the two rows' scales.
template <class Mma>
__device__ __forceinline__ float product(typename Mma::Accumulator sum, float q_scale,
                                         float x_scale) {
  if constexpr (Mma::kScaled) return static_cast<float>(sum) * (q_scale * x_scale);
  else return sum;
}

// One k-step of a warp's 64 × 32 products: every row tile times every query tile.
template <class Mma>
__device__ __forceinline__ void warp_step(WarpAccumulators<typename Mma::Accumulator>& acc,
                                          const RowFragments& rows, const QueryFragments& queries) {
#pragma unroll
  for (int i = 0; i < kRowTiles; ++i)
#pragma unroll
    for (int j = 0; j < kQueryTiles; ++j) Mma::run(acc[i][j], rows[i], queries[j]);
}

// fp32 rows, fp32-accurate (3×TF32): each value a = hi + lo with hi rounded to TF32 (exact in
// what the tensor cores read) and lo = a − hi exact in fp32; q·x ≈ hi·hi + hi·lo + lo·hi, close
// to an fp32 product (the lo·lo term is below fp32's rounding). The split is done in registers on
// the fragments, so the rows are read once, as they are (gpu/cuda/operand_copies.cu's split_tf32 makes
// the same parts in memory for cuBLAS).
struct Tf32x3Mma {
  using Element = float;
  using Accumulator = float;
  static constexpr bool kScaled = false;
  __device__ static void split(std::uint32_t word, std::uint32_t& hi, std::uint32_t& lo) {
    float a = __uint_as_float(word);
    float h = __uint_as_float((word + 0x1000u) & 0xffffe000u);
    if (!isfinite(a)) h = a;
    hi = __float_as_uint(h);
    lo = __float_as_uint(a - h);
  }
};

template <>
__device__ __forceinline__ void warp_step<Tf32x3Mma>(WarpAccumulators<float>& acc,
                                                     const RowFragments& rows,
                                                     const QueryFragments& queries) {
  QueryFragments queries_hi, queries_lo;
#pragma unroll
  for (int j = 0; j < kQueryTiles; ++j)
#pragma unroll
    for (int w = 0; w < 2; ++w) Tf32x3Mma::split(queries[j][w], queries_hi[j][w], queries_lo[j][w]);
  // One row tile's parts at a time (fewer registers live); the small terms first: they are added
  // before the big one that would round them away.
#pragma unroll
  for (int i = 0; i < kRowTiles; ++i) {
    std::uint32_t hi[4], lo[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) Tf32x3Mma::split(rows[i][w], hi[w], lo[w]);
#pragma unroll
    for (int j = 0; j < kQueryTiles; ++j) {
      Tf32Mma::run(acc[i][j], lo, queries_hi[j]);
      Tf32Mma::run(acc[i][j], hi, queries_lo[j]);
      Tf32Mma::run(acc[i][j], hi, queries_hi[j]);
    }
  }
}

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

// This thread's share of a tile's copies: rows r and r + 64 (r = thread / 4), 16 bytes at
// 16 · (thread % 4) of each 64-byte step, the steps in order. Rows past the end and bytes past a
// row's end read as zeros (they add nothing to a product). The source pointers advance with the
// steps (loop-carried: worked out once, not again at every step) and stop at a row's last chunk,
// so that a zero-fill copy still names an address inside the rows.
struct TileCopier {
  static_assert(kTileRows * 4 == 2 * kThreads && kTileQueries == kTileRows);
  const char* src[2];
  int dst_word[2];
  int left[2];  // bytes of the row from this thread's 16 onwards at the next step (0: no row)

  __device__ TileCopier(const void* data, std::size_t row0, std::size_t rows,
                        std::size_t row_bytes) {
    int part = threadIdx.x % 4;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      int r = threadIdx.x / 4 + u * (kTileRows / 2);
      bool real = row0 + r < rows;
      src[u] = static_cast<const char*>(data) + (real ? (row0 + r) * row_bytes : 0) + part * 16;
      dst_word[u] = r * kPitchWords + part * 4;
      left[u] = real ? static_cast<int>(row_bytes) - part * 16 : 0;
    }
  }
  __device__ void copy_next(std::uint32_t* tile) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      copy_async16(tile + dst_word[u], src[u], left[u] > 0);
      if (left[u] > kStageBytes) src[u] += kStageBytes;
      left[u] -= kStageBytes;
    }
  }
};

// Where this thread's products lie: acc[i][j][e] is corpus row
// x0 + warp_row + 16·i + group + 8·(e / 2) times query q0 + warp_query + 8·j + 2·quad + e % 2.
struct WarpPlace {
  int warp_row, warp_query, group, quad;
  __device__ WarpPlace() {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    group = lane / 4;
    quad = lane % 4;
    warp_row = (warp / kWarpsAcrossQueries) * kWarpRows;
    warp_query = (warp % kWarpsAcrossQueries) * kWarpQueries;
  }
  __device__ int row(int i, int e) const { return warp_row + 16 * i + group + 8 * (e / 2); }
  __device__ int query(int j, int e) const { return warp_query + 8 * j + 2 * quad + e % 2; }
};

// The block's tile pair: corpus rows [x0, x0 + 128) of x and queries [q0, q0 + 128) of q, both
// row-major with `row_bytes` bytes a row (a multiple of 16). Items are ordered queries-first
// (blockIdx.x % query_tiles): the blocks at work at any time share a few corpus tiles, read from
// memory once and then from L2, while the queries stay in L2.
struct TilePair {
  std::size_t q0, x0;
  __device__ explicit TilePair(unsigned query_tiles)
      : q0(std::size_t(blockIdx.x % query_tiles) * kTileQueries),
        x0(std::size_t(blockIdx.x / query_tiles) * kTileRows) {}
};

// acc += the products of the block's tile pair, this thread's share (WarpPlace). `stages` is the
// dynamic shared memory (kSharedBytes). Ends with a barrier.
template <class Mma>
__device__ __forceinline__ void multiply_tiles(WarpAccumulators<typename Mma::Accumulator>& acc,
                                               const TilePair& tile, const void* x,
                                               std::size_t x_rows, const void* q,
                                               std::size_t q_rows, std::size_t row_bytes,
                                               std::uint32_t* stages) {
  int steps = static_cast<int>((row_bytes + kStageBytes - 1) / kStageBytes);
  auto rows_of = [&](int step) { return stages + (step % kStages) * kStageWords; };
  auto queries_of = [&](int step) { return rows_of(step) + kTileRows * kPitchWords; };
  TileCopier row_copier(x, tile.x0, x_rows, row_bytes);
  TileCopier query_copier(q, tile.q0, q_rows, row_bytes);
  auto load = [&](int step) {  // steps in order: 0, 1, 2, ...
    row_copier.copy_next(rows_of(step));
    query_copier.copy_next(queries_of(step));
  };
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) load(s);
    copy_async_commit();
  }
  const WarpPlace place;
  int lane = threadIdx.x % 32;
  int matrix = lane / 8, matrix_row = lane % 8;
  for (int step = 0; step < steps; ++step) {
    copy_async_wait<kStages - 2>();
    __syncthreads();  // this step's stage is in; every warp is done with the one refilled next
    if (step + kStages - 1 < steps) load(step + kStages - 1);
    copy_async_commit();
    const std::uint32_t* rows = rows_of(step) + place.warp_row * kPitchWords;
    const std::uint32_t* queries = queries_of(step) + place.warp_query * kPitchWords;
#pragma unroll
    for (int k_step = 0; k_step < 2; ++k_step) {
      // A fragment (16 rows × 8 words): matrices rows 0-7 / 8-15 × words 0-3 / 4-7, in the order
      // a0..a3. B fragments of two query tiles: queries 0-7 × words 0-3 / 4-7, then the next 8.
      RowFragments af;
      QueryFragments bf;
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
      warp_step<Mma>(acc, af, bf);
    }
  }
  copy_async_wait<0>();
  // Not needed for correctness (no caller reuses the stages), but measured: without it the fp16
  // distance matrix at (1024, 2^20, 128) took 3.71 ms instead of 2.95 on an H100 (not profiled
  // further).
  __syncthreads();
}

// Blocks for a grid of query_tiles × row tiles items, or 0 if there are too many for one launch.
inline unsigned tile_blocks(std::size_t q_rows, std::size_t x_rows, unsigned& query_tiles) {
  std::size_t qt = (q_rows + kTileQueries - 1) / kTileQueries;
  std::size_t xt = (x_rows + kTileRows - 1) / kTileRows;
  if (qt == 0 || xt == 0 || qt * xt > 0x7fffffffu) return 0;
  query_tiles = static_cast<unsigned>(qt);
  return static_cast<unsigned>(qt * xt);
}

// What a failed launch reports (static strings: Status keeps the pointers).
struct LaunchNames {
  const char* kernel;      // the launch itself
  const char* attribute;   // cudaFuncSetAttribute for the kernel
  const char* too_large;   // more blocks than one launch takes
};

// Kernel<<<one block per tile pair, kThreads, kSharedBytes>>>(args, query_tiles). The shared
// memory attribute is set once per kernel and device (it is the kernel's, not the launch's).
template <auto Kernel, class Args>
Status launch_tiles(const Args& args, std::size_t q_rows, std::size_t x_rows, cudaStream_t stream,
                    const LaunchNames& names) {
  unsigned query_tiles = 0;
  unsigned blocks = tile_blocks(q_rows, x_rows, query_tiles);
  if (blocks == 0) return cuda_failure(cudaErrorInvalidConfiguration, names.too_large);
  static PerDevice<cudaError_t> attribute_set;
  const cudaError_t shared_ok = attribute_set.get([] {
    return cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes);
  });
  if (shared_ok != cudaSuccess) return cuda_failure(shared_ok, names.attribute);
  Kernel<<<blocks, kThreads, kSharedBytes, stream>>>(args, query_tiles);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status{} : cuda_failure(e, names.kernel);
}

}  // namespace gpupool::cuda_kernels::tiles
