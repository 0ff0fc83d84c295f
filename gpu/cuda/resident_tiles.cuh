// Internal: the resident-query tile stream that the fused kernels use on Hopper (the distance
// matrix, the kNN filter). A block keeps 128 queries in shared memory for as long as it works on
// them and streams 128-row corpus tiles past them; its two warpgroups multiply (warpgroup_mma.cuh),
// 64 queries each, and the kernel's own epilogue takes each tile's 64 products a thread from the
// registers.
//
// Why: tile_product.cuh's blocks load a query tile and a corpus tile for every 128 × 128 item and
// multiply them in four 64-byte steps at D = 128, so the loads are most of a block's life and
// the L2 carries both tiles for every item. Here the queries are loaded once per run of tiles and
// only corpus tiles stream.
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
// memory once and then from L2. The matrix holds them together as clusters (Lockstep): left
// alone they drift apart within their runs.
// Only device code and launch helpers: include it from .cu files.
#pragma once

#include "kernels.cuh"
#include "per_device.cuh"
#include "piece_squares.cuh"
#include "tensor_copy.cuh"
#include "tile_product.cuh"
#include "warpgroup_mma.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace gpupool::cuda_kernels::resident {

inline constexpr int kThreads = 256;       // two warpgroups
inline constexpr int kGroupThreads = 128;  // one warpgroup
inline constexpr int kQueries = 128;       // resident queries a block, 64 a warpgroup
inline constexpr int kRows = 128;          // corpus rows a tile: the MMA's N
// Rows of at most two 128-byte chunks (fp16 / bf16 D <= 128, int8 D <= 256, fp32 D <= 64) unless a
// Pipeline says otherwise (kWideRowBytes).
inline constexpr int kMaxRowBytes = 2 * wgmma::kChunkBytes;
// Rows of up to four chunks (fp16 / bf16 D <= 256, int8 D <= 512, fp32 D <= 128): the query tile
// and each stage take 64 KB, so an overlapped pipeline has room for two stages only.
inline constexpr int kWideRowBytes = 4 * wgmma::kChunkBytes;
inline constexpr int kChunkTileBytes = kRows * wgmma::kChunkBytes;  // one copy-engine box
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
//  EpilogueBytes: shared memory the kernel's epilogue keeps for itself (epilogue_area).
//  MaxRowBytes: the longest rows it takes (a whole number of 128-byte chunks; takes_rows).
template <int Stages, bool Overlap, int EpilogueBytes = 0, int MaxRowBytes = kMaxRowBytes>
struct Pipeline {
  static constexpr int kStages = Stages;
  static constexpr bool kOverlap = Overlap;
  static constexpr int kBlocksPerMultiprocessor = Overlap ? 1 : 2;
  static constexpr int kEpilogueBytes = EpilogueBytes;
  static constexpr int kMaxRowBytes = MaxRowBytes;
  static constexpr int kStageBytes = kMaxRowBytes / wgmma::kChunkBytes * kChunkTileBytes;
  static constexpr int kQueryTileBytes = kQueries * kMaxRowBytes;
  static_assert(kMaxRowBytes % wgmma::kChunkBytes == 0);
  // + 1 KB so that the tiles can start at a 1024-byte boundary (the swizzle's period).
  static constexpr int kSharedBytes = 1024 + kQueryTileBytes + kStages * kStageBytes +
                                      kFigureBytes + kBarrierBytes + kEpilogueBytes;
  static_assert(kStages * 12 <= kBarrierBytes);
  static_assert(kEpilogueBytes % 16 == 0);
  static_assert(kSharedBytes * kBlocksPerMultiprocessor <= 220 * 1024);
  // The epilogue's bytes (16-byte aligned): the end of the block's shared memory, past the
  // stream's (SharedTiles, which starts up to 1 KB in).
  __device__ static char* epilogue_area(char* dynamic_shared) {
    return dynamic_shared + (kSharedBytes - kEpilogueBytes);
  }
};
// The kernels whose epilogue tests each row against a bound and keeps the few that pass (the kNN
// filter, the sample's minima): two stages, no overlap, two blocks a multiprocessor.
using RowTestPipeline = Pipeline<2, false>;

// This thread's query h (0, 1) of the block's 128: its warpgroup's 64, then where the
// accumulators put it (wgmma::accumulator_query of accumulators 4m + 2h + e).
__device__ __forceinline__ int thread_query(int h) {
  return 64 * (threadIdx.x / kGroupThreads) + wgmma::accumulator_query(2 * h);
}

// Two optional per-row arrays of the corpus (norms, scales, ...; null: not copied), in shared
// memory beside each tile as float[2][kRows] (rows past the end read as first_past_end and zero).
// first_is_tile_norm (overlapped runs only, with first null): the first figure is the row's
// squared norm, summed from the tile in shared memory (times the square of the second figure,
// the int8 scale, where there is one), so that no pass over the corpus makes the norms before
// the kernel runs.
struct RowFigures {
  const float* first = nullptr;
  const float* second = nullptr;
  float first_past_end = 0.0f;
  bool first_is_tile_norm = false;
};

// The element type of an MMA's rows (warpgroup_mma.cuh), for summing them outside the MMA.
template <class Mma>
inline constexpr Element kRowElement =
    std::is_same_v<Mma, wgmma::Bf16>   ? Element::Bf16
    : std::is_same_v<Mma, wgmma::Int8> ? Element::Int8
    : std::is_same_v<Mma, wgmma::Tf32> ? Element::Fp32
                                       : Element::Fp16;

// Whether an MMA's rows are wgmma::Fp16Halves (chunks paired as multiply_halves says).
template <class Mma>
inline constexpr bool kHalves = std::is_same_v<Mma, wgmma::Fp16Halves>;

// Blocks that read the same corpus tiles (one for each query tile, at the same place of their
// runs) kept within a few tiles of one another, so that each tile is read from memory once and
// from the L2 by the rest: `cluster` blocks of consecutive index (a thread block cluster, which
// the hardware runs together) take the same run for `cluster` query tiles, and every `period`
// tiles (a power of two) each waits at the cluster's barrier until all have passed its previous
// stop. cluster 1 (period 0): blocks run free, as BlockShare's order sets them off. (Sharing each
// tile by the copy engine's multicast instead held the blocks closer and ran slower: see
// docs/benchmarks.md, "Why the dispatch rules are where they are".)
// `interleaved` (clusters only): run r of R takes corpus tiles r, r + R, r + 2R, ... instead of a
// contiguous range, so that the runs, in step, write neighbouring 512-byte pieces of each output
// row and read neighbouring corpus tiles.
struct Lockstep {
  unsigned cluster = 1;
  unsigned period = 0;
  bool interleaved = false;
};

__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}

// Rows of a length the copy engine can read into a pipeline's stages: whole 16-byte pieces, at
// most `max_row_bytes` (its Pipeline's kMaxRowBytes).
inline bool takes_row_bytes(std::size_t row_bytes, int max_row_bytes = kMaxRowBytes) {
  return row_bytes > 0 && row_bytes % 16 == 0 && row_bytes <= std::size_t(max_row_bytes);
}
// The same rows at `data`: from a 16-byte aligned start too.
inline bool takes_rows(const void* data, std::size_t row_bytes,
                       int max_row_bytes = kMaxRowBytes) {
  return takes_row_bytes(row_bytes, max_row_bytes) &&
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

// The (query tile, corpus tile) pairs of this block, as segments: runs of one query tile's
// corpus tiles first, first + stride, ... (count of them), which for_each_segment hands out.
//  - Plain: the pairs [begin, end) in query-tile-major order, one even share per block; its
//    segments are its contiguous pieces (stride 1), a new one where the query tile changes.
//  - In clusters (Lockstep): the shares go to the blocks in another order, so that the blocks of
//    a cluster take the same run of corpus tiles for consecutive query tiles (the grid is then a
//    whole number of runs a query tile, and the cluster size divides the query tiles).
//  - Interleaved (Lockstep::interleaved, clusters): the block's share is one segment, run r of R
//    of its query tile taking corpus tiles r, r + R, r + 2R, ...
struct BlockShare {
  std::size_t begin = 0, end = 0, corpus_tiles = 0;
  bool interleaved = false;
  std::size_t query_tile = 0, first = 0, count = 0, stride = 1;  // the interleaved segment

  __device__ BlockShare(std::size_t q_rows, std::size_t x_rows) {
    std::size_t query_tiles = (q_rows + kQueries - 1) / kQueries;
    corpus_tiles = (x_rows + kRows - 1) / kRows;
    std::size_t pairs = query_tiles * corpus_tiles;
    begin = pairs * blockIdx.x / gridDim.x;
    end = pairs * (blockIdx.x + 1) / gridDim.x;
  }
  // With Lockstep's clusters (cluster 1: none, as above).
  __device__ BlockShare(std::size_t q_rows, std::size_t x_rows, const Lockstep& lockstep) {
    std::size_t query_tiles = (q_rows + kQueries - 1) / kQueries;
    corpus_tiles = (x_rows + kRows - 1) / kRows;
    std::size_t pairs = query_tiles * corpus_tiles;
    const std::size_t share = share_of_block(query_tiles, lockstep.cluster);
    begin = pairs * share / gridDim.x;
    end = pairs * (share + 1) / gridDim.x;
    if (!lockstep.interleaved) return;
    interleaved = true;
    stride = gridDim.x / query_tiles;  // runs a query tile
    query_tile = share / stride;
    first = share % stride;
    count = first < corpus_tiles ? (corpus_tiles - first + stride - 1) / stride : 0;
  }
  __device__ static std::size_t share_of_block(std::size_t query_tiles, unsigned cluster) {
    if (cluster <= 1) return blockIdx.x;
    const std::size_t runs = gridDim.x / query_tiles, groups = query_tiles / cluster;
    const std::size_t id = blockIdx.x / cluster, rank = blockIdx.x % cluster;
    return (id % groups * cluster + rank) * runs + id / groups;
  }
  // The share of a kernel of pipeline Pipe: only the overlapped pipeline (the matrix) runs in
  // clusters; the other (the kNN filter) keeps the plain form, whose code was measured (the
  // one form for both changes the filter's PTX; a build that shared it ran the kNN 4-7% slower).
  template <class Pipe>
  __device__ static BlockShare of(std::size_t q_rows, std::size_t x_rows, const Lockstep& lockstep) {
    if constexpr (Pipe::kOverlap) return BlockShare(q_rows, x_rows, lockstep);
    else return BlockShare(q_rows, x_rows);
  }
  // run_segment(query tile, first, count, stride) for each segment, in order.
  template <class RunSegment>
  __device__ void for_each_segment(RunSegment&& run_segment) const {
    if (interleaved) {
      if (count > 0) run_segment(query_tile, first, count, stride);
      return;
    }
    for (std::size_t p = begin; p < end;) {
      const std::size_t segment_tile = p / corpus_tiles;
      const std::size_t segment_first = p % corpus_tiles;
      const std::size_t left_in_run = corpus_tiles - segment_first, left = end - p;
      const std::size_t segment_count = left < left_in_run ? left : left_in_run;
      p += segment_count;
      run_segment(segment_tile, segment_first, segment_count, std::size_t{1});
    }
  }
};

// The block's shared memory: the query tile, the stages, each warpgroup's two figure buffers,
// and a barrier and a release count per stage. Steps count the block's corpus tiles from 0 on,
// across its segments; step s uses stage s % kStages, the (s / kStages)-th fill of that stage.
template <class Pipe>
struct SharedTiles {
  static constexpr int kStages = Pipe::kStages;
  static constexpr int kStageBytes = Pipe::kStageBytes;
  char* queries;
  char* stages;
  float* figures;
  std::uint64_t* filled;    // completes when the stage's copies have landed
  std::uint32_t* released;  // +1 by each warpgroup done with the stage's MMAs
  __device__ explicit SharedTiles(char* dynamic_shared) {
    queries = dynamic_shared + (1024u - shared_address(dynamic_shared) % 1024u) % 1024u;
    stages = queries + Pipe::kQueryTileBytes;
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
template <class Mma, class Pipe>
struct GroupStream {
  static constexpr int kStages = Pipe::kStages;
  using Accumulators = typename Mma::Accumulator[wgmma::kAccumulators];
  const CUtensorMap& map;
  const Matrix& x;
  RowFigures figures;
  SharedTiles<Pipe> shared;
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
    if (arriving) tensor_copy::wait_barrier(shared.barrier(step), SharedTiles<Pipe>::parity(step));
    const wgmma::Descriptor a(queries), b(shared_address(shared.stage(step)));
    wgmma::fence();
    if constexpr (kHalves<Mma>) {
      multiply_halves(acc, a, b);
    } else {
      for (int c = 0; c < chunks; ++c)
#pragma unroll
        for (int k = 0; k < wgmma::kStepsPerChunk; ++k) {
          const std::uint32_t offset = c * kChunkTileBytes + k * wgmma::kStepBytes;
          Mma::run(acc, a.advance(offset).value(), b.advance(offset).value(), c > 0 || k > 0);
        }
    }
    wgmma::commit();
  }

  // Rows of hi and lo halves (wgmma::Fp16Halves): lo·hi and hi·lo first, while the sums are
  // small, then hi·hi.
  __device__ void multiply_halves(Accumulators& acc, wgmma::Descriptor a,
                                  wgmma::Descriptor b) const {
    const int half = chunks / 2;
    const std::uint32_t lo = half * kChunkTileBytes;
    for (int c = 0; c < half; ++c)
#pragma unroll
      for (int k = 0; k < wgmma::kStepsPerChunk; ++k) {
        const std::uint32_t hi = c * kChunkTileBytes + k * wgmma::kStepBytes;
        Mma::run(acc, a.advance(hi).value(), b.advance(hi + lo).value(), c > 0 || k > 0);
        Mma::run(acc, a.advance(hi + lo).value(), b.advance(hi).value(), true);
      }
    for (int c = 0; c < half; ++c)
#pragma unroll
      for (int k = 0; k < wgmma::kStepsPerChunk; ++k) {
        const std::uint32_t hi = c * kChunkTileBytes + k * wgmma::kStepBytes;
        Mma::run(acc, a.advance(hi).value(), b.advance(hi).value(), true);
      }
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
  // The same once the tile of `step` is in its stage: there the first figure may be the row's
  // norm summed from the stage (RowFigures::first_is_tile_norm).
  __device__ RowFigurePair load_figures(std::uint32_t step, std::size_t tile) const {
    RowFigurePair f = load_figures(tile);
    if (figures.first_is_tile_norm) {
      f.first = squares_in_stage(step);
      if (figures.second) f.first *= f.second * f.second;
    }
    return f;
  }
  // The sum of squares of this thread's row (`member`) of the tile in `step`'s stage: its 16-byte
  // pieces along the swizzled chunks (a warp's 32 rows at one piece fill the 32 banks 4 times:
  // no conflicts). Rows past the corpus are zeros there.
  __device__ float squares_in_stage(std::uint32_t step) const {
    const char* row = shared.stage(step) + member * wgmma::kChunkBytes;
    float sums[2] = {0.0f, 0.0f};
    for (int c = 0; c < chunks; ++c)
#pragma unroll
      for (int p = 0; p < wgmma::kChunkBytes / 16; ++p) {
        const uint4 piece = *reinterpret_cast<const uint4*>(
            row + c * kChunkTileBytes + ((p ^ (member % 8)) << 4));
        sums[p % 2] += piece_squares<kRowElement<Mma>>(piece);
      }
    return sums[0] + sums[1];
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

// One warpgroup's run over corpus tiles first, first + stride, ... (count of them), the block's
// steps step0 on:
// tile j + 1's MMAs go out before tile j's epilogue, into the other set of accumulators.
// finish_tile(acc, x0, figures) as for stream_tiles. After the last tile a spare group of MMAs
// (the last tile's again, its results unused) takes the place of the next tile's, so that every
// pass runs the same code: ptxas serialises the MMAs (warning C7514/C7515) where it cannot tell
// which group a wait leaves outstanding, and each copy of the epilogue costs instruction cache
// (five copies, for a peeled last pass, left the warps waiting on instruction fetches for a
// third of their cycles; ncu, H200).
// With lockstep.period, the run stops at the cluster's barrier every period tiles (Lockstep).
template <class Pipe, class Mma, class FinishTile>
__device__ __forceinline__ void overlapped_run(const GroupStream<Mma, Pipe>& s,
                                               std::uint32_t step0, std::size_t first,
                                               std::size_t count, std::size_t stride,
                                               FinishTile& finish_tile,
                                               const Lockstep& lockstep) {
  using Stream = GroupStream<Mma, Pipe>;
  constexpr int kStages = Pipe::kStages;
  using RowFigurePair = typename Stream::RowFigurePair;
  typename Stream::Accumulators ping, pong;  // the first k-step of a tile overwrites
  auto tile = [&](std::size_t j) { return first + j * stride; };
  // Tile j + 1's MMAs into `next` (or the spare group) and its figures, then tile j's epilogue
  // on `done`.
  auto overlap = [&](auto& done, auto& next, std::size_t j) {
    const std::uint32_t step = step0 + static_cast<std::uint32_t>(j);
    const bool more = j + 1 < count;
    if (lockstep.period != 0 && (j & (lockstep.period - 1)) == 0) {
      if (j != 0) cluster_wait();  // every block of the cluster has passed tile j - period
      cluster_arrive();
    }
    s.multiply(next, more ? step + 1 : step, more);
    RowFigurePair next_figures{};
    if (more) next_figures = s.load_figures(step + 1, tile(j + 1));
    wgmma::wait<1>();
    wgmma::settle(done);
    s.release(step, j + kStages < count, tile(j + kStages));
    finish_tile(done, tile(j) * kRows, static_cast<const float*>(s.figures_of(step)));
    if (more) s.store_figures(step + 1, next_figures);
    s.sync();  // the next tile's figures are in; this one's buffer is free
  };
  s.multiply(ping, step0, true);
  s.store_figures(step0, s.load_figures(step0, first));
  s.sync();
  for (std::size_t j = 0;; j += 2) {
    overlap(ping, pong, j);
    if (j + 1 == count) break;
    overlap(pong, ping, j + 1);
    if (j + 2 == count) break;
  }
  wgmma::wait<0>();  // the spare group
  if (lockstep.period != 0) cluster_wait();  // the last stop's arrival
}

// The same run with one set of accumulators: each tile's MMAs, then its epilogue.
template <class Pipe, class Mma, class FinishTile>
__device__ __forceinline__ void plain_run(const GroupStream<Mma, Pipe>& s, std::uint32_t step0,
                                          std::size_t first, std::size_t count,
                                          FinishTile& finish_tile) {
  constexpr int kStages = Pipe::kStages;
  typename GroupStream<Mma, Pipe>::Accumulators acc;  // the first k-step of a tile overwrites
  s.store_figures(step0, s.load_figures(first));
  s.sync();
  for (std::size_t j = 0; j < count; ++j) {
    const std::uint32_t step = step0 + static_cast<std::uint32_t>(j);
    const bool more = j + 1 < count;
    s.multiply(acc, step, true);
    typename GroupStream<Mma, Pipe>::RowFigurePair next_figures{};
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
// `row_bytes` long, a multiple of 16, at most Pipe::kMaxRowBytes. `lockstep` as launch_in_lockstep
// launched the kernel (overlapped pipelines only).
template <class Pipe, class Mma, class BeginSegment, class FinishTile>
__device__ __forceinline__ void stream_tiles(const CUtensorMap& map, const Matrix& q,
                                             const Matrix& x, std::size_t row_bytes,
                                             const RowFigures& figures, char* dynamic_shared,
                                             BeginSegment&& begin_segment,
                                             FinishTile&& finish_tile,
                                             const Lockstep& lockstep = {}) {
  constexpr int kStages = Pipe::kStages;
  const SharedTiles<Pipe> shared(dynamic_shared);
  const BlockShare share = BlockShare::of<Pipe>(q.rows, x.rows, lockstep);
  const int chunks = static_cast<int>((row_bytes + wgmma::kChunkBytes - 1) / wgmma::kChunkBytes);
  const int group = threadIdx.x / kGroupThreads;
  const GroupStream<Mma, Pipe> stream{map,    x,     figures, shared, chunks, group,
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
  // One segment: the tiles first, first + stride, ... (count of them) for query_tile's queries.
  auto run_segment = [&](std::size_t query_tile, std::size_t first, std::size_t count,
                         std::size_t stride) {
    __syncthreads();  // the last segment's MMAs and epilogues are done (the first time: barriers)
    for (int c = 0; c < chunks; ++c)
      copier.copy(shared.queries + c * kChunkTileBytes, q.data, query_tile * kQueries, q.rows,
                  row_bytes, c);
    tiles::copy_async_commit();
    if (threadIdx.x == 0)
      for (std::size_t j = 0; j < count && j < std::size_t(kStages); ++j)
        stream.fill(step + static_cast<std::uint32_t>(j), first + j * stride);
    begin_segment(query_tile);
    tiles::copy_async_wait<0>();
    wgmma::fence_shared_for_async();
    __syncthreads();  // the queries are in
    if constexpr (Pipe::kOverlap)
      overlapped_run(stream, step, first, count, stride, finish_tile, lockstep);
    else plain_run(stream, step, first, count, finish_tile);
    step += static_cast<std::uint32_t>(count);
  };
  share.for_each_segment(run_segment);
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
// 0.27 GB corpus, 2.14 ms; in step, 0.62 GB and 1.96 ms; docs/benchmarks.md, "Why the dispatch
// rules are where they are").
inline std::size_t blocks_in_step(std::size_t query_tiles, std::size_t wave,
                                  std::size_t corpus_bytes, int l2_bytes) {
  if (query_tiles == 0 || query_tiles > wave || corpus_bytes <= std::size_t(l2_bytes) / 2)
    return wave;
  const std::size_t in_step = wave / query_tiles * query_tiles;
  return in_step * 8 >= wave * 7 ? in_step : wave;
}

// The grid of a resident kernel: blocks_in_step's blocks (at most one a pair) of kThreads with
// Pipe::kSharedBytes each, and the tensor map of the corpus rows `x` (x_rows rows of row_bytes,
// takes_rows). blocks 0: nothing to do.
struct Grid {
  unsigned blocks = 0;
  std::size_t query_tiles = 0;
  CUtensorMap map;
};
template <class Pipe, auto Kernel>
Status plan_grid(std::size_t q_rows, const void* x, std::size_t x_rows, std::size_t row_bytes,
                 const tiles::LaunchNames& names, Grid& grid) {
  constexpr int kSharedBytes = Pipe::kSharedBytes;
  // The kernel's shared-memory attribute and its blocks a multiprocessor, once per device.
  struct Setup {
    cudaError_t status = cudaSuccess;
    int per_multiprocessor = 0;
  };
  static PerDevice<Setup> setups;
  const Setup setup = setups.get([] {
    Setup s;
    s.status =
        cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes);
    if (s.status == cudaSuccess)
      s.status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&s.per_multiprocessor, Kernel,
                                                               kThreads, kSharedBytes);
    return s;
  });
  if (setup.status != cudaSuccess) return cuda_failure(setup.status, names.attribute);
  const int per_multiprocessor = setup.per_multiprocessor;
  int device = 0, multiprocessors = 0, l2_bytes = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device);
  if (e != cudaSuccess) return cuda_failure(e, names.kernel);
  grid.query_tiles = (q_rows + kQueries - 1) / kQueries;
  const std::size_t pairs = grid.query_tiles * ((x_rows + kRows - 1) / kRows);
  const std::size_t wave = std::size_t(std::max(per_multiprocessor, 1)) * multiprocessors;
  grid.blocks = static_cast<unsigned>(
      std::min(pairs, blocks_in_step(grid.query_tiles, wave, x_rows * row_bytes, l2_bytes)));
  if (grid.blocks == 0) return {};
  return tensor_copy::encode_rows(x, x_rows, row_bytes, grid.map);
}

// Kernel<<<plan_grid's blocks, kThreads, Pipe::kSharedBytes>>>(args, map).
template <class Pipe, auto Kernel, class Args>
Status launch(const Args& args, std::size_t q_rows, const void* x, std::size_t x_rows,
              std::size_t row_bytes, cudaStream_t stream, const tiles::LaunchNames& names) {
  Grid grid;
  if (Status st = plan_grid<Pipe, Kernel>(q_rows, x, x_rows, row_bytes, names, grid); !st.ok())
    return st;
  if (grid.blocks == 0) return {};
  Kernel<<<grid.blocks, kThreads, Pipe::kSharedBytes, stream>>>(args, grid.map);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status{} : cuda_failure(e, names.kernel);
}

// A launch of the grid's blocks in clusters of `cluster` blocks (1: no clusters); the config
// points at `attribute`.
template <class Pipe>
cudaLaunchConfig_t cluster_launch(const Grid& grid, unsigned cluster, cudaStream_t stream,
                                  cudaLaunchAttribute& attribute) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid.blocks);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = Pipe::kSharedBytes;
  config.stream = stream;
  attribute = cudaLaunchAttribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster;
  attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = cluster > 1 ? 1 : 0;
  return config;
}

// The largest cluster (8, 4 or 2 blocks) that divides the query tiles and the grid, where the
// grid runs a whole number of blocks a query tile and every cluster of the grid can be resident
// at once (cudaOccupancyMaxActiveClusters: a cluster's blocks share a GPC); 1 where none does.
template <class Pipe, auto Kernel>
unsigned lockstep_cluster(const Grid& grid, cudaStream_t stream) {
  if (grid.query_tiles < 2 || grid.blocks % grid.query_tiles != 0) return 1;
  // Each device's capacity for clusters of 8, 4 and 2 blocks, asked once, kept + 1 (0: not yet).
  static std::atomic<int> capacity[kMaxDevices][3];
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return 1;
  for (unsigned cluster : {8u, 4u, 2u}) {
    if (grid.query_tiles % cluster != 0) continue;
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config = cluster_launch<Pipe>(grid, cluster, stream, attribute);
    std::atomic<int>& known = capacity[device][cluster == 8 ? 0 : cluster == 4 ? 1 : 2];
    int resident_clusters = known.load(std::memory_order_relaxed) - 1;
    if (resident_clusters < 0) {
      if (cudaOccupancyMaxActiveClusters(&resident_clusters, Kernel, &config) != cudaSuccess) {
        (void)cudaGetLastError();  // not an error of the launch: no clusters of this size
        resident_clusters = 0;
      }
      known.store(resident_clusters + 1, std::memory_order_relaxed);
    }
    if (std::size_t(resident_clusters) * cluster >= grid.blocks) return cluster;
  }
  return 1;
}

// Kernel(args, map, lockstep) on plan_grid's blocks in clusters (lockstep_cluster), stopping at
// the cluster's barrier every `period` tiles (a power of two; 0: never, and no clusters), the runs
// `interleaved` where there are clusters (Lockstep).
template <class Pipe, auto Kernel, class Args>
Status launch_in_lockstep(const Args& args, std::size_t q_rows, const void* x, std::size_t x_rows,
                          std::size_t row_bytes, unsigned period, bool interleaved,
                          cudaStream_t stream, const tiles::LaunchNames& names) {
  Grid grid;
  if (Status st = plan_grid<Pipe, Kernel>(q_rows, x, x_rows, row_bytes, names, grid); !st.ok())
    return st;
  if (grid.blocks == 0) return {};
  Lockstep lockstep;
  if (period != 0) lockstep.cluster = lockstep_cluster<Pipe, Kernel>(grid, stream);
  if (lockstep.cluster > 1) {
    lockstep.period = period;
    lockstep.interleaved = interleaved;
  }
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config =
      cluster_launch<Pipe>(grid, lockstep.cluster, stream, attribute);
  const cudaError_t e = cudaLaunchKernelEx(&config, Kernel, args, grid.map, lockstep);
  return e == cudaSuccess ? Status{} : cuda_failure(e, names.kernel);
}

}  // namespace gpupool::cuda_kernels::resident
