// gpupool::exact — how large the exact-kNN job's query blocks and first base chunks are.
//
// The device holds one block of queries and one chunk of base rows at a time. A block takes at
// most half of the pool's headroom (all queries when they fit in that half), so the other half is
// left for the chunks streamed against it; the first chunk of each pass takes a third of what is
// left after the block's per-chunk buffers. Both sizes are then evened out over the queries and
// the base rows (even_batch_size), so that the pool's blocks serve one chunk and block after
// another instead of being trimmed to make room for a remainder's sizes. From there the batching library (gpupool:batching)
// owns the chunk size: it bisects after an out-of-memory error and grows after successes. These
// are pure functions of byte counts, unit-tested with no device.
#pragma once
#include <cstddef>
import gpupool;

namespace gpupool::exact {

// Device bytes the job needs per base row of a chunk and per query of a block.
struct JobCosts {
  // The row as stored, the widest form the device computes on (fp32) and an int8 form with its
  // scale.
  std::size_t bytes_per_base_row = 0;
  // The query's own row (as above) and its share of what every chunk needs: knn's candidates
  // (8 bytes each, distance + id) and a minimal kNN tile row of 256 fp32 columns.
  std::size_t bytes_per_query = 0;
  // The per-chunk part of bytes_per_query (what a chunk costs per query of the block, besides
  // its rows).
  std::size_t chunk_bytes_per_query = 0;
};

JobCosts job_costs(std::size_t dim, std::size_t candidates, StoredElement stored) noexcept;

// Queries per block: all of them when they fit in half the headroom, else as many as do (at
// least 1; the batching library halves a block that still runs out of memory).
std::size_t pick_query_block(std::size_t headroom, std::size_t queries, const JobCosts& costs) noexcept;

// Rows for the first chunk of a pass: a third of the headroom left after the block's per-chunk
// buffers (the kNN kernel's tiles and the pool's size-class rounding need the rest), clamped to
// [1, max_rows].
std::size_t pick_chunk_rows(std::size_t headroom, std::size_t block_queries, const JobCosts& costs,
                            std::size_t max_rows) noexcept;

// `size` evened out over `total` items: the size of ceil(total / size) batches as equal as can
// be (5000 rows in chunks of at most 2729: two of 2500, not 2729 and 2271), so that every batch
// asks the pool for the same block sizes and the blocks the last one freed serve the next.
std::size_t even_batch_size(std::size_t size, std::size_t total) noexcept;

// In how many pieces, read in parallel, a block of the base of `block_bytes` is read: one per
// 8 MiB, at most 16 and at most the machine's hardware threads (0: unknown, taken as 1). Each
// piece's thread also scans what it read; on a 16-core H200 host 8 of them kept the GPU waiting
// on fp32 files, 16 read a page-cached block about 1.3 times as fast.
std::size_t reading_parts(std::size_t block_bytes, unsigned hardware_threads) noexcept;

// The most rows one chunk may have: max_chunk_rows, and at most a twentieth of the base so that
// progress shows — but not under 2^18 rows: a chunk is one knn call, whose fixed costs (launches,
// the candidates' read-back, the host's fold) and sampled filter want many rows (the fused
// filter takes 2^16 and more).
std::size_t chunk_cap(std::size_t base_rows, std::size_t max_chunk_rows) noexcept;

}  // namespace gpupool::exact
