// gpupool::exact — how many base rows one chunk of the exact-kNN job sends to the device.
//
// The one place that sizes chunks, so that it can later hand over to the adaptive batching
// library (issue 5): pick_chunk_rows() turns the pool's headroom into a row count, and
// ChunkPlan::shrink_after() reacts to an out-of-memory GpuError (by kind, never by message) by
// trimming the pool's cache and halving the chunk for the rest of the job.
#pragma once
#include <cstddef>
#include <expected>
import gpupool;

namespace gpupool::exact {

// Device bytes a chunk needs: per base row, and fixed (the per-chunk top-k and merge buffers).
struct ChunkCost {
  std::size_t bytes_per_row = 0;
  std::size_t fixed_bytes = 0;
};

// Bytes the pool may still take on `device`: the device's free memory plus the pool's cache,
// within the pool's hard limit.
std::size_t pool_headroom(const GpuMemoryPool& pool, const Device& device);

// Rows for one chunk: a third of the headroom left after the fixed cost (the kNN kernel's tiles
// and the pool's size-class rounding need the rest), clamped to [1, max_rows].
std::size_t pick_chunk_rows(std::size_t headroom, const ChunkCost& cost, std::size_t max_rows);

class ChunkPlan {
 public:
  ChunkPlan(GpuMemoryPool pool, Device device, ChunkCost cost, std::size_t max_rows)
      : pool_(std::move(pool)), device_(std::move(device)), cost_(cost), cap_(max_rows) {}

  // Rows for the next chunk, at most `remaining` (> 0).
  std::size_t next_rows(std::size_t remaining) const;
  // After `error` from a chunk of `rows` rows: for OutOfMemory / PoolLimitExceeded, trims the
  // pool's cache, caps every later chunk at rows / 2 and returns that; anything else, or a chunk
  // of one row, gives the error back.
  Result<std::size_t> shrink_after(const GpuError& error, std::size_t rows);
  std::size_t retries() const noexcept { return retries_; }
  std::size_t cap() const noexcept { return cap_; }  // the most rows a chunk may have now

 private:
  GpuMemoryPool pool_;
  Device device_;
  ChunkCost cost_;
  std::size_t cap_;
  std::size_t retries_ = 0;
};

}  // namespace gpupool::exact
