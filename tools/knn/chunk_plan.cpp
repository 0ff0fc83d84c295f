// Chunk sizing for the exact-kNN job (see chunk_plan.hpp).
#include <algorithm>
#include <cstddef>
#include <expected>
#include <fmt/format.h>
#include <string>
#include "chunk_plan.hpp"

namespace gpupool::exact {

std::size_t pool_headroom(const GpuMemoryPool& pool, const Device& device) {
  PoolStats stats = pool.stats(device);
  auto info = device.memory_info();
  std::size_t room = (info ? info->free : 0) + stats.cached_bytes;
  if (auto limit = pool.max_pool_size(device))
    room = std::min(room, *limit > stats.in_use_bytes ? *limit - stats.in_use_bytes : 0);
  return room;
}

std::size_t pick_chunk_rows(std::size_t headroom, const ChunkCost& cost, std::size_t max_rows) {
  std::size_t usable = headroom > cost.fixed_bytes ? headroom - cost.fixed_bytes : 0;
  std::size_t rows = usable / 3 / std::max<std::size_t>(cost.bytes_per_row, 1);
  return std::clamp<std::size_t>(rows, 1, std::max<std::size_t>(max_rows, 1));
}

std::size_t ChunkPlan::next_rows(std::size_t remaining) const {
  return std::min(remaining, pick_chunk_rows(pool_headroom(pool_, device_), cost_, cap_));
}

Result<std::size_t> ChunkPlan::shrink_after(const GpuError& error, std::size_t rows) {
  if (!error.is_out_of_memory()) return std::unexpected(error);
  if (rows <= 1)
    return std::unexpected(error.with_context(
        "a chunk of one base row does not fit on the device (lower --k, use a smaller "
        "--precision, or raise --memory-limit)"));
  pool_.trim(device_);
  cap_ = rows / 2;
  ++retries_;
  return cap_;
}

}  // namespace gpupool::exact
