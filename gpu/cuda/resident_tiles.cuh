// Internal: the resident-query tile stream that the fused kernels use on Hopper (the distance
// matrix, the kNN filter). A block keeps 128 queries in shared memory for as long as it works on
// them and streams 128-row corpus tiles past them; its two warpgroups multiply (warpgroup_mma.cuh),
// 64 queries each, and the kernel's own epilogue takes each tile's 64 products a thread from the
// registers.
//
// Why: tile_product.cuh's blocks load a query tile and a corpus tile for every 128 × 128 item and
// multiply them in four 64-byte steps at D = 128, so the loads are most of a block's life and
// the L2 carries both tiles for every item (docs/benchmarks.md). Here the queries are loaded once
// per run of tiles and only corpus tiles stream.
//
// How the work overlaps (docs/kernels.md): the copy engine brings each corpus tile into one of
// a few stages (tensor_copy.cuh) and the warpgroups wait on that stage's barrier, not on each
// other; the warpgroup that is second to finish with a stage refills it, so a block's warpgroups
// may be a few tiles apart and meet only where the block moves on to other queries. Then either
// each warpgroup issues the next tile's MMAs before it runs the epilogue of the current one
// (two sets of accumulators, one block a multiprocessor), or two blocks share a multiprocessor
// and their four warpgroups overlap one another (Pipeline).
//
// Work: the (query tile, corpus tile) pairs in query-tile-major order, split evenly over one
// wave of blocks (blocks_in_step says how many). A block's range is one or two runs ("segments")
// of corpus tiles for one query tile each; blocks of different query tiles at the same place of
// their runs read the same corpus tiles at about the same time, so a corpus tile comes from
// memory once and then from L2.
// Only device code and launch helpers: include it from .cu files.
#pragma once

#include "kernels.cuh"
#include "tensor_copy.cuh"
#include "tile_product.cuh"
#include "warpgroup_mma.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace gpupool::cudak::resident {

inline constexpr int kThreads = 256;       // two warpgroups
inline constexpr int kGroupThreads = 128;  // one warpgroup
inline constexpr int kQueries = 128;       // resident queries a block, 64 a warpgroup
inline constexpr int kRows = 128;          // corpus rows a tile: the MMA's N
// Rows of at most two 128-byte chunks (fp16 / bf16 D <= 128, int8 D <= 256, fp32 D <= 64).
inline constexpr int kMaxRowBytes = 2 * wgmma::kChunkBytes;
inline constexpr int kChunkTileBytes = kRows * wgmma::kChunkBytes;  // one copy-engine box
inline constexpr int kStageBytes = kMaxRowBytes / wgmma::kChunkBytes * kChunkTileBytes;
inline constexpr int kQueryTileBytes = kQueries * kMaxRowBytes;
// Each warpgroup copies two per-row figures of its tiles' rows (RowFigures) into shared memory,
// two tiles' worth (the one it tests and the next): read from global memory one 8-row group at a
// time in the epilogue, they left the warps waiting on loads for two thirds of their cycles (ncu,
// H200).
inline constexpr int kFigureFloats = 2 * kRows;
inline constexpr int kFigureBytes = 2 * 2 * kFigureFloats * 4;
inline constexpr int kBarrierBytes = 64;  // a barrier (8 bytes) and a release count a stage
static_assert(kQueries == 2 * 64 && kChunkTileBytes / 16 == 4 * kThreads);
static_assert(tensor_copy::kBoxBytes == wgmma::kChunkBytes && tensor_copy::kBoxRows == kRows);

// How a kernel runs the stream: with `Stages` corpus tiles in flight, and either
//  - Overlap: each warpgroup issues tile j + 1's MMAs into a second set of accumulators before
//    tile j's epilogue (128 accumulator registers a thread: one block a multiprocessor). For
//    epilogues that mostly store (the distance matrix);
//  - or not: one set of accumulators, two blocks a multiprocessor, whose four warpgroups overlap
//    one another's MMAs and epilogues. For epilogues that wait on memory in divergent branches
//    (the kNN filter's kept rows): with eight warps a multiprocessor the overlapping form ran
//    the filter 1.5-3× slower, its warps waiting on instruction fetches and latencies (ncu, H200).
template <int Stages, bool Overlap>
struct Pipeline {
  static constexpr int kStages = Stages;
  static constexpr bool kOverlap = Overlap;
  static constexpr int kBlocksPerMultiprocessor = Overlap ? 1 : 2;
  // + 1 KB so that the tiles can start at a 1024-byte boundary (the swizzle's period).
  static constexpr int kSharedBytes =
      1024 + kQueryTileBytes + kStages * kStageBytes + kFigureBytes + kBarrierBytes;
  static_assert(kStages * 12 <= kBarrierBytes);
  static_assert(kSharedBytes * kBlocksPerMultiprocessor <= 220 * 1024);
};
using StoringPipeline = Pipeline<5, true>;
using TestingPipeline = Pipeline<2, false>;

// This thread's query h (0, 1) of the block's 128: its warpgroup's 64, then where the
// accumulators put it (wgmma::accumulator_query of accumulators 4m + 2h + e).
__device__ __forceinline__ int thread_query(int h) {
  return 64 * (threadIdx.x / kGroupThreads) + wgmma::accumulator_query(2 * h);
}

// Two optional per-row arrays of the corpus (norms, scales, ...; null: not copied), in shared
// memory beside each tile as float[2][kRows] (rows past the end read as first_past_end and zero).
struct RowFigures {
  const float* first = nullptr;
  const float* second = nullptr;
  float first_past_end = 0.0f;
};

// Rows the copy engine can read: whole 16-byte pieces, at most kMaxRowBytes, from a 16-byte
// aligned start.
inline bool takes_rows(const void* data, std::size_t row_bytes) {
  return row_bytes > 0 && row_bytes % 16 == 0 && row_bytes <= std::size_t(kMaxRowBytes) &&
         reinterpret_cast<std::uintptr_t>(data) % 16 == 0;
}

using tensor_copy::shared_address;

// Copies chunk c (bytes [128c, 128c + 128) of each row) of 128 rows into a swizzled 16 KB tile:
// 1024 pieces of 16 bytes, four a thread (rows r, r + 32, r + 64, r + 96 at piece p; the same
// swizzle for all four, since they are 32 rows apart). Rows past `rows` and bytes past a row's end
// are zero-filled: they add nothing to a product. (The query tile, once per segment.)
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

// The block's shared memory: the query tile, the stages, each warpgroup's two figure buffers,
// and a barrier and a release count per stage. Steps count the block's corpus tiles from 0 on,
// across its segments; step s uses stage s % kStages, the (s / kStages)-th fill of that stage.
template <int kStages>
struct SharedTiles {
  char* queries;
  char* stages;
  float* figures;
  std::uint64_t* filled;    // completes when the stage's copies have landed
  std::uint32_t* released;  // +1 by each warpgroup done with the stage's MMAs
  __device__ explicit SharedTiles(char* dynamic_shared) {
    queries = dynamic_shared + (1024u - shared_address(dynamic_shared) % 1024u) % 1024u;
    stages = queries + kQueryTileBytes;
    figures = reinterpret_cast<float*>(stages + kStages * kStageBytes);
    filled = reinterpret_cast<std::uint64_t*>(figures + kFigureBytes / 4);
    released = reinterpret_cast<std::uint32_t*>(filled + kStages);
  }
  __device__ char* stage(std::uint32_t step) const { return stages + step % kStages * kStageBytes; }
  __device__ std::uint64_t* barrier(std::uint32_t step) const { return filled + step % kStages; }
  __device__ static std::uint32_t parity(std::uint32_t step) { return step / kStages % 2; }
};

// One warpgroup's view of the stream: the copies it may have to issue, its MMAs, its figure
// buffers. `member` is the thread's place in its warpgroup; member 0 leads.
template <class Mma, int kStages>
struct GroupStream {
  using Accumulators = typename Mma::Accumulator[wgmma::kAccumulators];
  const CUtensorMap& map;
  const Matrix& x;
  RowFigures figures;
  SharedTiles<kStages> shared;
  int chunks, group, member;
  std::uint32_t queries;  // shared address of this warpgroup's 64 queries in chunk 0

  // Corpus tile `tile` into the stage of `step`, by one thread.
  __device__ void fill(std::uint32_t step, std::size_t tile) const {
    char* stage = shared.stage(step);
    std::uint64_t* barrier = shared.barrier(step);
    tensor_copy::arrive_expecting(barrier, chunks * kChunkTileBytes);
    for (int c = 0; c < chunks; ++c)
      tensor_copy::load_box(stage + c * kChunkTileBytes, map, c * wgmma::kChunkBytes,
                            static_cast<int>(tile * kRows), barrier);
  }

  // This warpgroup's products of its queries and the tile of `step`, into acc: issued as one
  // group once the tile is in (`arriving`: first waits for its copies), not waited for.
  __device__ void multiply(Accumulators& acc, std::uint32_t step, bool arriving) const {
    if (arriving) tensor_copy::wait_barrier(shared.barrier(step), SharedTiles<kStages>::parity(step));
    const wgmma::Descriptor a(queries), b(shared_address(shared.stage(step)));
    wgmma::fence();
    for (int c = 0; c < chunks; ++c)
#pragma unroll
      for (int k = 0; k < wgmma::kStepsPerChunk; ++k) {
        const std::uint32_t offset = c * kChunkTileBytes + k * wgmma::kStepBytes;
        Mma::run(acc, a.advance(offset).value(), b.advance(offset).value(), c > 0 || k > 0);
      }
    wgmma::commit();
  }

  // Once this warpgroup's MMAs of `step` are done: the leader counts the stage released, and the
  // second warpgroup to do so refills it with corpus tile `next_tile` (if `refill`).
  __device__ void release(std::uint32_t step, bool refill, std::size_t next_tile) const {
    if (member != 0) return;
    if (tensor_copy::count_up(shared.released + step % kStages) % 2 == 1 && refill)
      fill(step + kStages, next_tile);
  }

  struct RowFigurePair {
    float first, second;
  };
  // This thread's row of corpus tile `tile`: its two figures (zero if absent; past the end,
  // RowFigures says).
  __device__ RowFigurePair load_figures(std::size_t tile) const {
    const std::size_t row = tile * kRows + member;
    const bool real = row < x.rows;
    return {!real ? figures.first_past_end : figures.first ? figures.first[row] : 0.0f,
            real && figures.second ? figures.second[row] : 0.0f};
  }
  // The figure buffer (float[2][kRows]) of `step` for this warpgroup.
  __device__ float* figures_of(std::uint32_t step) const {
    return shared.figures + (2 * group + step % 2) * kFigureFloats;
  }
  __device__ void store_figures(std::uint32_t step, RowFigurePair f) const {
    float* buffer = figures_of(step);
    buffer[member] = f.first;
    buffer[kRows + member] = f.second;
  }
  // The warpgroup's own barrier (named barriers 1 and 2; 0 is __syncthreads). Constant ids: with
  // an id in a register ptxas reserves all 16 barriers for the block.
  __device__ void sync() const {
    if (group == 0) asm volatile("bar.sync 1, %0;\n" ::"n"(kGroupThreads) : "memory");
    else asm volatile("bar.sync 2, %0;\n" ::"n"(kGroupThreads) : "memory");
  }
};

// One warpgroup's run over corpus tiles [first, first + count), the block's steps step0 on:
// tile j + 1's MMAs go out before tile j's epilogue, into the other set of accumulators.
// finish_tile(acc, x0, figures) as for stream_tiles. After the last tile a spare group of MMAs
// (the last tile's again, its results unused) takes the place of the next tile's, so that every
// pass runs the same code: ptxas serialises the MMAs (warning C7514/C7515) where it cannot tell
// which group a wait leaves outstanding, and each copy of the epilogue costs instruction cache
// (five copies, for a peeled last pass, left the warps waiting on instruction fetches for a
// third of their cycles; ncu, H200).
template <int kStages, class Mma, class FinishTile>
__device__ __forceinline__ void overlapped_run(const GroupStream<Mma, kStages>& s,
                                               std::uint32_t step0, std::size_t first,
                                               std::size_t count, FinishTile& finish_tile) {
  using Stream = GroupStream<Mma, kStages>;
  using RowFigurePair = typename Stream::RowFigurePair;
  typename Stream::Accumulators ping, pong;  // the first k-step of a tile overwrites
  // Tile j + 1's MMAs into `next` (or the spare group) and its figures, then tile j's epilogue
  // on `done`.
  auto overlap = [&](auto& done, auto& next, std::size_t j) {
    const std::uint32_t step = step0 + static_cast<std::uint32_t>(j);
    const bool more = j + 1 < count;
    s.multiply(next, more ? step + 1 : step, more);
    RowFigurePair next_figures{};
    if (more) next_figures = s.load_figures(first + j + 1);
    wgmma::wait<1>();
    wgmma::settle(done);
    s.release(step, j + kStages < count, first + j + kStages);
    finish_tile(done, (first + j) * kRows, static_cast<const float*>(s.figures_of(step)));
    if (more) s.store_figures(step + 1, next_figures);
    s.sync();  // the next tile's figures are in; this one's buffer is free
  };
  s.store_figures(step0, s.load_figures(first));
  s.multiply(ping, step0, true);
  s.sync();
  for (std::size_t j = 0;; j += 2) {
    overlap(ping, pong, j);
    if (j + 1 == count) break;
    overlap(pong, ping, j + 1);
    if (j + 2 == count) break;
  }
  wgmma::wait<0>();  // the spare group
}

// The same run with one set of accumulators: each tile's MMAs, then its epilogue.
template <int kStages, class Mma, class FinishTile>
__device__ __forceinline__ void plain_run(const GroupStream<Mma, kStages>& s, std::uint32_t step0,
                                          std::size_t first, std::size_t count,
                                          FinishTile& finish_tile) {
  typename GroupStream<Mma, kStages>::Accumulators acc;  // the first k-step of a tile overwrites
  s.store_figures(step0, s.load_figures(first));
  s.sync();
  for (std::size_t j = 0; j < count; ++j) {
    const std::uint32_t step = step0 + static_cast<std::uint32_t>(j);
    const bool more = j + 1 < count;
    s.multiply(acc, step, true);
    typename GroupStream<Mma, kStages>::RowFigurePair next_figures{};
    if (more) next_figures = s.load_figures(first + j + 1);
    wgmma::wait<0>();
    wgmma::settle(acc);
    s.release(step, j + kStages < count, first + j + kStages);
    finish_tile(acc, (first + j) * kRows, static_cast<const float*>(s.figures_of(step)));
    if (more) s.store_figures(step + 1, next_figures);
    s.sync();
  }
}

// Runs the block's share. For each segment: begin_segment(query tile) once its queries are on
// their way (after a barrier: the last segment's readers are done), then, for each corpus tile,
// finish_tile(acc, x0, figures) with this thread's 64 products of the warpgroup's 64 queries
// × corpus rows [x0, x0 + 128) (their places: wgmma::accumulator_query / accumulator_row, the
// queries offset by 64 for the second warpgroup) and the tile's RowFigures in shared memory
// (float[2][128], row-relative). `map`: x's rows for the copy engine (encode_rows). Rows are
// `row_bytes` long, a multiple of 16, at most kMaxRowBytes.
template <class Pipe, class Mma, class BeginSegment, class FinishTile>
__device__ __forceinline__ void stream_tiles(const CUtensorMap& map, const Matrix& q,
                                             const Matrix& x, std::size_t row_bytes,
                                             const RowFigures& figures, char* dynamic_shared,
                                             BeginSegment&& begin_segment,
                                             FinishTile&& finish_tile) {
  constexpr int kStages = Pipe::kStages;
  const SharedTiles<kStages> shared(dynamic_shared);
  const BlockShare share(q.rows, x.rows);
  const int chunks = static_cast<int>((row_bytes + wgmma::kChunkBytes - 1) / wgmma::kChunkBytes);
  const int group = threadIdx.x / kGroupThreads;
  const GroupStream<Mma, kStages> stream{map,    x,     figures, shared, chunks, group,
                                static_cast<int>(threadIdx.x % kGroupThreads),
                                shared_address(shared.queries) + group * 64 * wgmma::kChunkBytes};
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      tensor_copy::init_barrier(shared.filled + s, 1);
      shared.released[s] = 0;
    }
    tensor_copy::fence_barrier_init();
  }
  const ChunkCopier copier;
  std::uint32_t step = 0;
  for (std::size_t p = share.begin; p < share.end;) {
    const std::size_t query_tile = p / share.corpus_tiles;
    const std::size_t first = p % share.corpus_tiles;
    const std::size_t left_in_run = share.corpus_tiles - first, left = share.end - p;
    const std::size_t count = left < left_in_run ? left : left_in_run;
    p += count;
    __syncthreads();  // the last segment's MMAs and epilogues are done (the first time: barriers)
    for (int c = 0; c < chunks; ++c)
      copier.copy(shared.queries + c * kChunkTileBytes, q.data, query_tile * kQueries, q.rows,
                  row_bytes, c);
    tiles::copy_async_commit();
    if (threadIdx.x == 0)
      for (std::size_t j = 0; j < count && j < std::size_t(kStages); ++j)
        stream.fill(step + static_cast<std::uint32_t>(j), first + j);
    begin_segment(query_tile);
    tiles::copy_async_wait<0>();
    wgmma::fence_shared_for_async();
    __syncthreads();  // the queries are in
    if constexpr (Pipe::kOverlap) overlapped_run(stream, step, first, count, finish_tile);
    else plain_run(stream, step, first, count, finish_tile);
    step += static_cast<std::uint32_t>(count);
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

// How many blocks share the pairs (BlockShare): one wave, or, where the corpus would not stay in
// the L2 (over half of it), a whole number of blocks for each query tile if that keeps at least
// 7/8 of the wave. Then BlockShare hands block g of each query tile the same run of corpus tiles,
// so blocks of different query tiles read each tile at about the same time: once from memory,
// then from the L2. With a wave that is not such a multiple (132 blocks for 8 query tiles),
// every other query tile's blocks ran half a run apart from the rest and read the corpus from
// memory again (H100, fp16 (1024, 2^20, 128) matrix under ncu: 1.13 GB read from memory for a
// 0.27 GB corpus, 2.14 ms; in step, 0.62 GB and 1.96 ms; docs/benchmarks.md).
inline std::size_t blocks_in_step(std::size_t query_tiles, std::size_t wave,
                                  std::size_t corpus_bytes, int l2_bytes) {
  if (query_tiles == 0 || query_tiles > wave || corpus_bytes <= std::size_t(l2_bytes) / 2)
    return wave;
  const std::size_t in_step = wave / query_tiles * query_tiles;
  return in_step * 8 >= wave * 7 ? in_step : wave;
}

// Kernel<<<blocks_in_step's blocks (at most one per pair), kThreads, Pipe::kSharedBytes>>>(args,
// map): map is the tensor map of the corpus rows `x` (x_rows rows of row_bytes, takes_rows).
template <class Pipe, auto Kernel, class Args>
Status launch(const Args& args, std::size_t q_rows, const void* x, std::size_t x_rows,
              std::size_t row_bytes, cudaStream_t stream, const tiles::LaunchNames& names) {
  constexpr int kSharedBytes = Pipe::kSharedBytes;
  static const cudaError_t shared_ok =
      cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes);
  if (shared_ok != cudaSuccess) return cuda_failure(shared_ok, names.attribute);
  static int per_multiprocessor = 0;
  static const cudaError_t occupancy_ok = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_multiprocessor, Kernel, kThreads, kSharedBytes);
  if (occupancy_ok != cudaSuccess) return cuda_failure(occupancy_ok, names.attribute);
  int device = 0, multiprocessors = 0, l2_bytes = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device);
  if (e != cudaSuccess) return cuda_failure(e, names.kernel);
  const std::size_t query_tiles = (q_rows + kQueries - 1) / kQueries;
  const std::size_t pairs = query_tiles * ((x_rows + kRows - 1) / kRows);
  const std::size_t wave = std::size_t(std::max(per_multiprocessor, 1)) * multiprocessors;
  const auto blocks = static_cast<unsigned>(
      std::min(pairs, blocks_in_step(query_tiles, wave, x_rows * row_bytes, l2_bytes)));
  if (blocks == 0) return {};
  CUtensorMap map;
  if (Status st = tensor_copy::encode_rows(x, x_rows, row_bytes, map); !st.ok()) return st;
  Kernel<<<blocks, kThreads, kSharedBytes, stream>>>(args, map);
  e = cudaGetLastError();
  return e == cudaSuccess ? Status{} : cuda_failure(e, names.kernel);
}

}  // namespace gpupool::cudak::resident
