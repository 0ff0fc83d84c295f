// Internal: the resident-query tile stream that the fused kernels use on Hopper (the distance
// matrix, the kNN filter). A block keeps 128 queries in shared memory for as long as it works on
// them and streams 128-row corpus tiles past them through a cp.async pipeline; its two warpgroups
// multiply (warpgroup_mma.cuh), 64 queries each, and the kernel's own epilogue takes each tile's
// 64 products a thread from the registers.
//
// Why: tile_product.cuh's blocks load a query tile and a corpus tile for every 128 × 128 item and
// multiply them in four 64-byte steps at D = 128, so the loads are most of a block's life and
// the L2 carries both tiles for every item (docs/benchmarks.md). Here the queries are loaded once
// per run of tiles, only corpus tiles stream, and the MMAs run asynchronously on the warpgroups.
//
// Work: the (query tile, corpus tile) pairs in query-tile-major order, split evenly over one
// wave of blocks. A block's range is one or two runs ("segments") of corpus tiles for one query
// tile each; blocks of different query tiles at the same place of their runs read the same corpus
// tiles at about the same time, so a corpus tile comes from memory once and then from L2.
// Only device code and launch helpers: include it from .cu files.
#pragma once

#include "kernels.cuh"
#include "tile_product.cuh"
#include "warpgroup_mma.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace gpupool::cudak::resident {

inline constexpr int kThreads = 256;  // two warpgroups
inline constexpr int kQueries = 128;  // resident queries a block, 64 a warpgroup
inline constexpr int kRows = 128;     // corpus rows a tile: the MMA's N
// Rows of at most two 128-byte chunks (fp16 / bf16 D <= 128, int8 D <= 256, fp32 D <= 64): the
// query tile (32 KB) and four stages (16 KB each) fit twice on a multiprocessor, so that one
// block's epilogue overlaps the other's MMAs.
inline constexpr int kMaxRowBytes = 2 * wgmma::kChunkBytes;
inline constexpr int kStages = 4;
inline constexpr int kChunkTileBytes = kRows * wgmma::kChunkBytes;
// Each stage also holds two per-row figures of its tile's rows (RowFigures), so that the
// epilogue reads them from shared memory: read from global memory one 8-row group at a time, they
// left the warps waiting on loads for two thirds of their cycles (ncu, H200).
inline constexpr int kFigureBytes = 2 * kRows * 4;
inline constexpr int kStageBytes = kChunkTileBytes + kFigureBytes;  // a multiple of 1024
inline constexpr int kQueryTileBytes = kQueries * kMaxRowBytes;
// + 1 KB so that the tiles can start at a 1024-byte boundary (the swizzle's period).
inline constexpr int kSharedBytes = 1024 + kQueryTileBytes + kStages * kStageBytes;
static_assert(kQueries == 2 * 64 && kChunkTileBytes / 16 == 4 * kThreads);
static_assert(kStageBytes % 1024 == 0);

// Two optional per-row arrays of the corpus (norms, scales, ...; null: not copied), in shared
// memory beside each tile as float[2][kRows] (rows past the end read as zero).
struct RowFigures {
  const float* first = nullptr;
  const float* second = nullptr;
};

inline bool takes_rows(std::size_t row_bytes) {
  return row_bytes > 0 && row_bytes % 16 == 0 && row_bytes <= std::size_t(kMaxRowBytes);
}

__device__ __forceinline__ std::uint32_t shared_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ char* aligned_tiles(char* dynamic_shared) {
  std::uint32_t address = shared_address(dynamic_shared);
  return dynamic_shared + ((1024u - address % 1024u) % 1024u);
}

// Copies chunk c (bytes [128c, 128c + 128) of each row) of 128 rows into a swizzled 16 KB tile:
// 1024 pieces of 16 bytes, four a thread (rows r, r + 32, r + 64, r + 96 at piece p; the same
// swizzle for all four, since they are 32 rows apart). Rows past `rows` and bytes past a row's end
// are zero-filled: they add nothing to a product.
struct ChunkCopier {
  int row, piece_byte, offset;
  __device__ ChunkCopier()
      : row(threadIdx.x / 8),
        piece_byte(16 * (threadIdx.x % 8)),
        offset(wgmma::swizzled_offset(threadIdx.x / 8, threadIdx.x % 8)) {}

  __device__ void copy(char* tile, const void* data, std::size_t row0, std::size_t rows,
                       std::size_t row_bytes, int chunk) const {
    std::size_t byte = std::size_t(chunk) * wgmma::kChunkBytes + piece_byte;
    bool in_row = byte < row_bytes;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      std::size_t r = row0 + row + 32 * u;
      bool valid = in_row && r < rows;
      const char* src = static_cast<const char*>(data) + (valid ? r * row_bytes + byte : 0);
      tiles::copy_async16(reinterpret_cast<std::uint32_t*>(tile + offset + 32 * 128 * u), src,
                          valid);
    }
  }
};

// The tile's rows [row0, row0 + 128) of each RowFigures array, one float a thread (threads
// 0-127 the first array, 128-255 the second). Four bytes at a time: the arrays need not be
// 16-byte aligned (the knn driver's corpus norms follow the queries' in one buffer).
__device__ __forceinline__ void copy_figures(float* dst, const RowFigures& figures,
                                             std::size_t row0, std::size_t rows) {
  static_assert(kThreads == 2 * kRows);
  const int which = threadIdx.x / kRows, row = threadIdx.x % kRows;
  const float* src = which == 0 ? figures.first : figures.second;
  if (!src) return;
  bool real = row0 + row < rows;
  auto address = shared_address(dst + which * kRows + row);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(address),
               "l"(real ? src + row0 + row : src), "r"(real ? 4 : 0));
}

// The pairs [begin, end) of this block (query-tile-major order, one even share per block).
struct BlockShare {
  std::size_t begin, end, corpus_tiles;
  __device__ BlockShare(std::size_t q_rows, std::size_t x_rows) {
    std::size_t query_tiles = (q_rows + kQueries - 1) / kQueries;
    corpus_tiles = (x_rows + kRows - 1) / kRows;
    std::size_t pairs = query_tiles * corpus_tiles;
    begin = pairs * blockIdx.x / gridDim.x;
    end = pairs * (blockIdx.x + 1) / gridDim.x;
  }
};

// Runs the block's share. For each segment: begin_segment(query tile) once its queries are on
// their way (after a barrier: the last segment's readers are done), then, for each corpus tile,
// finish_tile(acc, x0, figures) with this thread's 64 products of the warpgroup's 64 queries
// × corpus rows [x0, x0 + 128) (their places: wgmma::accumulator_query / accumulator_row, the
// queries offset by 64 for the second warpgroup) and the tile's RowFigures in shared memory
// (float[2][128], row-relative). `tiles` is the 1024-aligned shared memory
// (kSharedBytes - 1024 bytes); rows are `row_bytes` long, a multiple of 16, at most kMaxRowBytes.
template <class Mma, class BeginSegment, class FinishTile>
__device__ __forceinline__ void stream_tiles(const Matrix& q, const Matrix& x,
                                             std::size_t row_bytes, const RowFigures& figures,
                                             char* tiles,
                                             BeginSegment&& begin_segment,
                                             FinishTile&& finish_tile) {
  const BlockShare share(q.rows, x.rows);
  const int chunks = static_cast<int>((row_bytes + wgmma::kChunkBytes - 1) / wgmma::kChunkBytes);
  char* query_tile = tiles;
  char* stages = tiles + kQueryTileBytes;
  const ChunkCopier copier;
  // This warpgroup's 64 queries within each chunk of the query tile.
  const std::uint32_t my_queries = shared_address(query_tile) + (threadIdx.x / 128) * 64 * 128;
  typename Mma::Accumulator acc[wgmma::kAccumulators] = {};

  for (std::size_t p = share.begin; p < share.end;) {
    const std::size_t query_tile_index = p / share.corpus_tiles;
    const std::size_t first = p % share.corpus_tiles;
    const std::size_t left_in_run = share.corpus_tiles - first, left = share.end - p;
    const std::size_t count = left < left_in_run ? left : left_in_run;
    p += count;
    __syncthreads();  // every warp is done with the last segment's tiles
    for (int c = 0; c < chunks; ++c)
      copier.copy(query_tile + c * kChunkTileBytes, q.data, query_tile_index * kQueries, q.rows,
                  row_bytes, c);
    tiles::copy_async_commit();
    begin_segment(query_tile_index);

    // Loads run ahead of the MMAs by kStages - 1 (tile, chunk) steps, in order.
    const std::size_t steps = count * chunks;
    std::size_t load_tile = first;
    int load_chunk = 0;
    // A tile's figures come with its last chunk: that stage stays until its epilogue is done.
    auto load = [&](std::size_t step) {
      char* stage = stages + (step % kStages) * kStageBytes;
      copier.copy(stage, x.data, load_tile * kRows, x.rows, row_bytes, load_chunk);
      if (load_chunk == chunks - 1)
        copy_figures(reinterpret_cast<float*>(stage + kChunkTileBytes), figures,
                     load_tile * kRows, x.rows);
      if (++load_chunk == chunks) load_chunk = 0, ++load_tile;
    };
    for (int s = 0; s < kStages - 1; ++s) {
      if (std::size_t(s) < steps) load(s);
      tiles::copy_async_commit();
    }
    std::size_t tile = first;
    int chunk = 0;
    for (std::size_t step = 0; step < steps; ++step) {
      tiles::copy_async_wait<kStages - 2>();
      wgmma::fence_shared_for_async();
      __syncthreads();  // this step's chunk is in; every warp's MMAs of the refilled stage are done
      if (step + kStages - 1 < steps) load(step + kStages - 1);
      tiles::copy_async_commit();
      char* stage = stages + (step % kStages) * kStageBytes;
      const std::uint32_t rows = shared_address(stage);
      const std::uint32_t queries = my_queries + chunk * kChunkTileBytes;
      wgmma::fence();
#pragma unroll
      for (int k = 0; k < wgmma::kStepsPerChunk; ++k)
        Mma::run(acc, wgmma::descriptor(queries + k * wgmma::kStepBytes),
                 wgmma::descriptor(rows + k * wgmma::kStepBytes), chunk > 0 || k > 0);
      wgmma::commit();
      wgmma::wait_all();
      wgmma::settle(acc);
      if (++chunk == chunks) {
        finish_tile(acc, tile * kRows, reinterpret_cast<const float*>(stage + kChunkTileBytes));
        chunk = 0;
        ++tile;
      }
    }
    tiles::copy_async_wait<0>();
  }
}

// Whether the resident kernels run on the current device: compute capability 9.0 (the sm_90a
// code; elsewhere only the PTX fallback, which has no wgmma, would run) and not switched off with
// GPUPOOL_WGMMA=0 (kept for comparing the two kernel families in one build).
inline bool available() {
  static const bool switched_off = [] {
    const char* v = std::getenv("GPUPOOL_WGMMA");
    return v && std::strcmp(v, "0") == 0;
  }();
  if (switched_off) return false;
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
    return false;
  return major == 9 && minor == 0;
}

// Kernel<<<one wave of blocks (at most one per pair), kThreads, kSharedBytes>>>(args).
template <auto Kernel, class Args>
Status launch(const Args& args, std::size_t q_rows, std::size_t x_rows, cudaStream_t stream,
              const tiles::LaunchNames& names) {
  auto failure = [](cudaError_t e, const char* what) {
    Status st;
    st.cuda = static_cast<int>(e);
    st.what = what;
    return st;
  };
  static const cudaError_t shared_ok =
      cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes);
  if (shared_ok != cudaSuccess) return failure(shared_ok, names.attribute);
  static int per_multiprocessor = 0;
  static const cudaError_t occupancy_ok = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_multiprocessor, Kernel, kThreads, kSharedBytes);
  if (occupancy_ok != cudaSuccess) return failure(occupancy_ok, names.attribute);
  int device = 0, multiprocessors = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return failure(e, names.kernel);
  std::size_t pairs = ((q_rows + kQueries - 1) / kQueries) * ((x_rows + kRows - 1) / kRows);
  std::size_t wave = std::size_t(std::max(per_multiprocessor, 1)) * multiprocessors;
  auto blocks = static_cast<unsigned>(std::min(pairs, wave));
  if (blocks == 0) return {};
  Kernel<<<blocks, kThreads, kSharedBytes, stream>>>(args);
  e = cudaGetLastError();
  return e == cudaSuccess ? Status{} : failure(e, names.kernel);
}

}  // namespace gpupool::cudak::resident
