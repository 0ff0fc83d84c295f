// Internal: the streamed tile engine of the fused kNN filter for long rows (gpu/cuda/knn_filter.cu).
// A block multiplies 128 queries by 256 corpus rows at a time, both operands streamed through
// shared memory in 128-byte chunks of their rows (the K dimension) by the copy engine
// (tensor_copy.cuh), and its two warpgroups multiply (warpgroup_mma.cuh, m64n256: 64 queries
// each), then hand each tile's 128 products a thread to the kernel's epilogue.
//
// Why: resident_tiles.cuh keeps a block's 128 queries whole in shared memory, which holds rows of
// at most 256 bytes beside its stages; tile_product.cuh's mma.sync tiles take any row but reach
// about half of the wgmma rate, so at D = 960 fp16 they ran slower than cuBLAS's GEMM with the
// distance matrix written and sorted. Streaming both operands needs only a few chunk stages,
// whatever the row length.
//
// How the work overlaps: the chunks of the block's tiles form one sequence of steps (tile after
// tile), each step one stage of the ring (a query chunk of 16 KB and a corpus chunk of 32 KB);
// each warpgroup issues a step's MMAs as soon as its stage is in, and once the MMAs of the step
// before are done it releases that step's stage; the second warpgroup to release a stage refills
// it with the step kStages further on, which may be the next tile's (so the next tile's first
// chunks arrive while the epilogue runs). No warp only copies: one thread issues a step's three
// copies, and the 128 accumulator registers a thread leave room for only two warpgroups.
//
// Work: the (query tile, corpus tile) pairs in query-tile-major order, block b taking pairs b,
// b + grid, ...: the blocks at work at one time share a few corpus tiles (read from memory once,
// then from the L2), and the queries stay in the L2.
// Only device code and launch helpers: include it from .cu files.
#pragma once

#include "kernels.cuh"
#include "per_device.cuh"
#include "resident_tiles.cuh"
#include "tensor_copy.cuh"
#include "tile_product.cuh"
#include "warpgroup_mma.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace gpupool::cuda_kernels::streamed {

inline constexpr int kThreads = 256;       // two warpgroups
inline constexpr int kGroupThreads = 128;  // one warpgroup
inline constexpr int kQueries = 128;       // 64 a warpgroup
inline constexpr int kRows = 256;          // corpus rows a tile: the MMA's N
inline constexpr int kHalfRows = kRows / 2;
inline constexpr int kStages = 4;
inline constexpr int kChunkBytes = wgmma::kChunkBytes;
inline constexpr int kBoxBytes = tensor_copy::kBoxRows * kChunkBytes;  // 16 KB
inline constexpr int kQueryChunkBytes = kQueries * kChunkBytes;
inline constexpr int kRowChunkBytes = kRows * kChunkBytes;
inline constexpr int kStageBytes = kQueryChunkBytes + kRowChunkBytes;
// Each warpgroup's figures of the tile's rows (two per row, as float[2][128] for each half).
inline constexpr int kFigureFloats = 2 * kRows;
inline constexpr int kBarrierBytes = 64;  // a barrier (8 bytes) and a release count a stage
// + 1 KB so that the stages can start at a 1024-byte boundary (the swizzle's period).
inline constexpr int kSharedBytes =
    1024 + kStages * kStageBytes + 2 * kFigureFloats * 4 + kBarrierBytes;
static_assert(kQueries == tensor_copy::kBoxRows && kRows == 2 * tensor_copy::kBoxRows);
static_assert(kStageBytes % 1024 == 0 && kStages * 12 <= kBarrierBytes);
static_assert(kSharedBytes <= 200 * 1024, "room for the kernel's static shared memory");

// This thread's query h (0, 1) of the block's 128 and the rows' figures: as the resident tiles
// have them (both engines split their queries between two warpgroups alike).
using resident::RowFigures;
using resident::thread_query;

// The block's shared memory: the stages, the warpgroups' figure buffers, a barrier and a release
// count per stage. Step s (the block's chunks, tile after tile) uses stage s % kStages.
struct SharedStages {
  char* stages;
  float* figures;
  std::uint64_t* filled;    // completes when the stage's copies have landed
  std::uint32_t* released;  // +1 by each warpgroup done with the stage's MMAs
  __device__ explicit SharedStages(char* dynamic_shared) {
    stages = dynamic_shared +
             (1024u - tensor_copy::shared_address(dynamic_shared) % 1024u) % 1024u;
    figures = reinterpret_cast<float*>(stages + kStages * kStageBytes);
    filled = reinterpret_cast<std::uint64_t*>(figures + 2 * kFigureFloats);
    released = reinterpret_cast<std::uint32_t*>(filled + kStages);
  }
  __device__ char* queries(std::uint32_t step) const {
    return stages + step % kStages * kStageBytes;
  }
  __device__ char* rows(std::uint32_t step) const { return queries(step) + kQueryChunkBytes; }
  __device__ std::uint64_t* barrier(std::uint32_t step) const { return filled + step % kStages; }
  __device__ static std::uint32_t parity(std::uint32_t step) { return step / kStages % 2; }
};

// The block's pairs: pair p is query tile p % query_tiles, corpus tile p / query_tiles.
struct Pairs {
  std::size_t query_tiles, count;
  int chunks;  // a row's 128-byte chunks: steps a pair
  __device__ Pairs(std::size_t q_rows, std::size_t x_rows, std::size_t row_bytes)
      : query_tiles((q_rows + kQueries - 1) / kQueries),
        count(query_tiles * ((x_rows + kRows - 1) / kRows)),
        chunks(static_cast<int>((row_bytes + kChunkBytes - 1) / kChunkBytes)) {}
  // The block's i-th pair (count or more: none).
  __device__ std::size_t pair(std::size_t i) const { return blockIdx.x + i * gridDim.x; }
};

// Step `step`'s chunks into its stage, by one thread: chunk step % chunks of the block's pair
// step / chunks, if there is one.
__device__ __forceinline__ void fill(const SharedStages& shared, const Pairs& pairs,
                                     const CUtensorMap& q_map, const CUtensorMap& x_map,
                                     std::uint32_t step) {
  const std::size_t p = pairs.pair(step / static_cast<std::uint32_t>(pairs.chunks));
  if (p >= pairs.count) return;
  const int column = static_cast<int>(step % static_cast<std::uint32_t>(pairs.chunks)) * kChunkBytes;
  const int q0 = static_cast<int>(p % pairs.query_tiles) * kQueries;
  const int x0 = static_cast<int>(p / pairs.query_tiles) * kRows;
  std::uint64_t* barrier = shared.barrier(step);
  tensor_copy::arrive_expecting(barrier, kStageBytes);
  tensor_copy::load_box(shared.queries(step), q_map, column, q0, barrier);
  tensor_copy::load_box(shared.rows(step), x_map, column, x0, barrier);
  tensor_copy::load_box(shared.rows(step) + kBoxBytes, x_map, column, x0 + tensor_copy::kBoxRows,
                        barrier);
}

// Runs the block's pairs. For each: begin_pair(q0) (the block's threads together, after a
// barrier: the last pair's epilogue is done), then, once the products are in,
// finish_half(acc, x0, figures, last) twice, for the tile's rows [x0, x0 + 128) and then (last)
// the next 128, with
// this thread's 64 products of each (wgmma's 64 × 128 layout; queries: thread_query) and the
// rows' RowFigures in shared memory (float[2][128], row-relative). Rows are `row_bytes` long
// (a multiple of 16), q_map and x_map their tensor maps (tensor_copy::encode_rows).
template <class Mma, class BeginPair, class FinishHalf>
__device__ __forceinline__ void stream_pairs(const CUtensorMap& q_map, const CUtensorMap& x_map,
                                             const Matrix& q, const Matrix& x,
                                             std::size_t row_bytes, const RowFigures& figures,
                                             char* dynamic_shared, BeginPair&& begin_pair,
                                             FinishHalf&& finish_half) {
  using Acc = typename Mma::Accumulator;
  const SharedStages shared(dynamic_shared);
  const Pairs pairs(q.rows, x.rows, row_bytes);
  const int group = threadIdx.x / kGroupThreads, member = threadIdx.x % kGroupThreads;
  float* my_figures = shared.figures + group * kFigureFloats;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      tensor_copy::init_barrier(shared.filled + s, 1);
      shared.released[s] = 0;
    }
    tensor_copy::fence_barrier_init();
    for (std::uint32_t s = 0; s < kStages; ++s) fill(shared, pairs, q_map, x_map, s);
  }
  const auto chunks = static_cast<std::uint32_t>(pairs.chunks);
  std::uint32_t step0 = 0;
  // The stage of `step` is done with by this warpgroup: the second warpgroup's leader to say so
  // refills it.
  auto release = [&](std::uint32_t step) {
    if (member == 0 && tensor_copy::count_up(shared.released + step % kStages) % 2 == 1)
      fill(shared, pairs, q_map, x_map, step + kStages);
  };
  for (std::size_t i = 0;; ++i) {
    const std::size_t p = pairs.pair(i);
    if (p >= pairs.count) break;
    const std::size_t q0 = p % pairs.query_tiles * kQueries;
    const std::size_t x0 = p / pairs.query_tiles * kRows;
    __syncthreads();  // the last pair's epilogue is done (the first time: the barriers are set)
    begin_pair(q0);
    // This thread's rows of the tile (member, member + 128): figures read now, stored after the
    // MMAs, so that the loads' latency hides behind them.
    float f[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::size_t row = x0 + h * kHalfRows + member;
      const bool real = row < x.rows;
      f[h][0] = !real ? figures.first_past_end : figures.first ? figures.first[row] : 0.0f;
      f[h][1] = real && figures.second ? figures.second[row] : 0.0f;
    }
    Acc lo[wgmma::kAccumulators], hi[wgmma::kAccumulators];  // the first k-step overwrites
    const std::uint32_t a_offset = group * 64 * kChunkBytes;
    for (std::uint32_t c = 0; c < chunks; ++c) {
      const std::uint32_t step = step0 + c;
      tensor_copy::wait_barrier(shared.barrier(step), SharedStages::parity(step));
      const wgmma::Descriptor a(tensor_copy::shared_address(shared.queries(step)) + a_offset),
          b(tensor_copy::shared_address(shared.rows(step)));
      wgmma::fence();
#pragma unroll
      for (int k = 0; k < wgmma::kStepsPerChunk; ++k) {
        const std::uint32_t offset = k * wgmma::kStepBytes;
        Mma::run_wide(lo, hi, a.advance(offset).value(), b.advance(offset).value(),
                      c > 0 || k > 0);
      }
      wgmma::commit();
      if (c > 0) {
        wgmma::wait<1>();
        release(step - 1);
      }
    }
    wgmma::wait<0>();
    wgmma::settle(lo);
    wgmma::settle(hi);
    release(step0 + chunks - 1);
    step0 += chunks;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      my_figures[h * 2 * kHalfRows + member] = f[h][0];
      my_figures[h * 2 * kHalfRows + kHalfRows + member] = f[h][1];
    }
    __syncthreads();  // the figures and begin_pair's shared values are in
    finish_half(lo, x0, static_cast<const float*>(my_figures), false);
    finish_half(hi, x0 + kHalfRows, static_cast<const float*>(my_figures + 2 * kHalfRows), true);
  }
}

// Kernel<<<blocks, kThreads, kSharedBytes>>>(args, q's map, x's map): one block a
// multiprocessor (its shared memory allows no more), at most one a pair.
template <auto Kernel, class Args>
Status launch(const Args& args, const Matrix& q, const Matrix& x, std::size_t row_bytes,
              cudaStream_t stream, const tiles::LaunchNames& names) {
  static PerDevice<cudaError_t> attribute_set;
  const cudaError_t shared_ok = attribute_set.get([] {
    return cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                kSharedBytes);
  });
  if (shared_ok != cudaSuccess) return cuda_failure(shared_ok, names.attribute);
  int device = 0, multiprocessors = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return cuda_failure(e, names.kernel);
  const std::size_t pairs =
      (q.rows + kQueries - 1) / kQueries * ((x.rows + kRows - 1) / kRows);
  const auto blocks = static_cast<unsigned>(std::min<std::size_t>(pairs, multiprocessors));
  if (blocks == 0) return {};
  CUtensorMap q_map, x_map;
  if (Status st = tensor_copy::encode_rows(q.data, q.rows, row_bytes, q_map); !st.ok()) return st;
  if (Status st = tensor_copy::encode_rows(x.data, x.rows, row_bytes, x_map); !st.ok()) return st;
  Kernel<<<blocks, kThreads, kSharedBytes, stream>>>(args, q_map, x_map);
  e = cudaGetLastError();
  return e == cudaSuccess ? Status{} : cuda_failure(e, names.kernel);
}

}  // namespace gpupool::cuda_kernels::streamed
