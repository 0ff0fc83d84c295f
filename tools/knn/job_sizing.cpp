// Query-block and chunk sizing for the exact-kNN job (see job_sizing.hpp).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include "job_sizing.hpp"

namespace gpupool::exact {

namespace {

constexpr std::size_t kMinTileColumns = 256;  // the kNN kernel's smallest tile width

}  // namespace

JobCosts job_costs(std::size_t dim, std::size_t candidates, StoredElement stored) noexcept {
  // The upload as stored, the widest form the device may compute on (fp32; fast int8 passes
  // through it) and an int8 form with its scale.
  const std::size_t row = dim * (stored_size(stored) + sizeof(float) + 1) + sizeof(float);
  const std::size_t entry = sizeof(float) + sizeof(std::int32_t);
  const std::size_t per_chunk = candidates * entry + kMinTileColumns * sizeof(float);
  return {.bytes_per_base_row = row, .bytes_per_query = row + per_chunk,
          .chunk_bytes_per_query = per_chunk};
}

std::size_t pick_query_block(std::size_t headroom, std::size_t queries, const JobCosts& costs) noexcept {
  std::size_t fit = headroom / 2 / std::max<std::size_t>(costs.bytes_per_query, 1);
  return std::clamp<std::size_t>(fit, 1, std::max<std::size_t>(queries, 1));
}

std::size_t pick_chunk_rows(std::size_t headroom, std::size_t block_queries, const JobCosts& costs,
                            std::size_t max_rows) noexcept {
  std::size_t fixed = block_queries * costs.chunk_bytes_per_query;
  std::size_t usable = headroom > fixed ? headroom - fixed : 0;
  std::size_t rows = usable / 3 / std::max<std::size_t>(costs.bytes_per_base_row, 1);
  return std::clamp<std::size_t>(rows, 1, std::max<std::size_t>(max_rows, 1));
}

std::size_t even_batch_size(std::size_t size, std::size_t total) noexcept {
  if (size == 0 || total == 0) return size;
  const std::size_t batches = (total + size - 1) / size;
  return (total + batches - 1) / batches;
}

std::size_t reading_parts(std::size_t block_bytes, unsigned hardware_threads) noexcept {
  constexpr std::size_t kMinPartBytes = std::size_t{8} << 20, kMaxParts = 16;
  const std::size_t by_size = std::max<std::size_t>(block_bytes / kMinPartBytes, 1);
  return std::min({by_size, kMaxParts, std::max<std::size_t>(hardware_threads, 1)});
}

std::size_t chunk_cap(std::size_t base_rows, std::size_t max_chunk_rows) noexcept {
  std::size_t for_progress = std::max<std::size_t>((base_rows + 19) / 20, std::size_t{1} << 18);
  return std::max<std::size_t>(std::min(max_chunk_rows, for_progress), 1);
}

}  // namespace gpupool::exact
