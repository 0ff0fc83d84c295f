// Planning: OOM forecasts, chunking and batch-size recommendations.
module;
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <expected>
#include <fmt/format.h>
#include <optional>
#include <string>
module gpupool;
import :size_classes;

namespace gpupool {

namespace sc = size_classes;

namespace {

Result<void> check_fraction(double fraction) {
  if (!(fraction > 0.0 && fraction <= 1.0))
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("memory fraction {}: expected a share in (0, 1]", fraction));
  return {};
}

Result<void> check_items(std::size_t items, std::size_t bytes_per_item, const char* what) {
  if (items == 0)
    return make_error(ErrorKind::InvalidInput, fmt::format("{}: 0 items: expected at least 1", what));
  if (bytes_per_item == 0)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: 0 bytes per item: expected at least 1", what));
  return {};
}

// The bytes the pool takes for a request: its size class.
std::size_t pooled_bytes(std::size_t bytes) { return sc::class_bytes(sc::class_of(bytes)); }

}  // namespace

// ---- will it fit? -----------------------------------------------------------------------------

Result<OomForecast> predict_oom(std::size_t bytes, const Device& device, const GpuMemoryPool& pool) {
  if (bytes == 0 || bytes > sc::kMaxRequest)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("will_oom of {} bytes: expected 1 .. {} bytes", bytes, sc::kMaxRequest),
                      device.id());
  auto headroom = memory_headroom(pool, device);
  if (!headroom) return std::unexpected(headroom.error().with_context("will_oom"));
  OomForecast f;
  f.requested_bytes = bytes;
  f.block_bytes = pooled_bytes(bytes);
  f.device_free_bytes = headroom->device_free;
  f.reclaimable_bytes = headroom->cached;
  f.limit = pool.max_pool_size(device);
  f.in_use_bytes = headroom->pool_in_use;
  if (headroom->limit_room && f.block_bytes > *headroom->limit_room) {
    f.will_oom = true;
    f.reason = fmt::format("a block of {} on top of {} in use passes the pool limit of {}",
                           format_bytes(f.block_bytes), format_bytes(f.in_use_bytes), format_bytes(*f.limit));
  } else if (f.block_bytes > headroom->bytes) {
    f.will_oom = true;
    f.reason = fmt::format("a block of {} is more than the device's free {} plus the pool's cached {}",
                           format_bytes(f.block_bytes), format_bytes(f.device_free_bytes),
                           format_bytes(f.reclaimable_bytes));
  } else {
    f.reason = fmt::format("a block of {} fits in the device's free {} plus the pool's cached {}",
                           format_bytes(f.block_bytes), format_bytes(f.device_free_bytes),
                           format_bytes(f.reclaimable_bytes));
  }
  return f;
}

Result<bool> will_oom(std::size_t bytes, const Device& device, const GpuMemoryPool& pool) {
  auto forecast = predict_oom(bytes, device, pool);
  if (!forecast) return std::unexpected(forecast.error());
  return forecast->will_oom;
}

Result<bool> will_oom(std::size_t bytes, const Device& device) {
  if (bytes == 0)
    return make_error(ErrorKind::InvalidInput, "will_oom of 0 bytes: expected at least 1", device.id());
  auto memory = device.memory_info();
  if (!memory) return std::unexpected(memory.error().with_context("will_oom"));
  return bytes > memory->free;
}

Result<std::size_t> available_bytes(const Device& device, const GpuMemoryPool& pool) {
  auto headroom = memory_headroom(pool, device);
  if (!headroom) return std::unexpected(headroom.error().with_context("available memory"));
  return headroom->bytes;
}

// ---- chunking ---------------------------------------------------------------------------------

Result<ChunkConfig> auto_chunk(std::size_t total_items, std::size_t bytes_per_item,
                               std::size_t available, double fraction) {
  if (auto ok = check_items(total_items, bytes_per_item, "auto_chunk"); !ok) return std::unexpected(ok.error());
  if (auto ok = check_fraction(fraction); !ok) return std::unexpected(ok.error());
  if (total_items > sc::kMaxRequest / bytes_per_item)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("auto_chunk: {} items of {} bytes overflow what a pool can hold",
                                  total_items, bytes_per_item));
  const auto budget = static_cast<std::size_t>(std::floor(fraction * static_cast<double>(available)));
  auto fits = [&](std::size_t items) { return pooled_bytes(items * bytes_per_item) <= budget; };
  if (!fits(1))
    return make_error(ErrorKind::OutOfMemory,
                      fmt::format("auto_chunk: one item of {} (a block of {}) does not fit in {} "
                                  "({:.0f}% of {} available): expected items of at most {}",
                                  format_bytes(bytes_per_item), format_bytes(pooled_bytes(bytes_per_item)),
                                  format_bytes(budget), 100 * fraction, format_bytes(available),
                                  format_bytes(budget)));
  // The largest chunk whose size class fits: bisect, since rounding up is monotonic.
  std::size_t low = 1, high = std::min(total_items, budget / bytes_per_item);
  while (low < high) {
    std::size_t middle = low + (high - low + 1) / 2;
    if (fits(middle)) low = middle;
    else high = middle - 1;
  }
  ChunkConfig config;
  config.chunk_size = low;
  config.num_chunks = (total_items + low - 1) / low;
  config.last_chunk_size = total_items - (config.num_chunks - 1) * low;
  config.bytes_per_chunk = low * bytes_per_item;
  return config;
}

Result<ChunkConfig> auto_chunk(std::size_t total_items, std::size_t bytes_per_item,
                               const Device& device, const GpuMemoryPool& pool, double fraction) {
  auto available = available_bytes(device, pool);
  if (!available) return std::unexpected(available.error());
  return auto_chunk(total_items, bytes_per_item, *available, fraction);
}

std::string ChunkConfig::to_string() const {
  return fmt::format("Chunking: {} chunk{} of {} items (last {})\nMemory per chunk: {}\n", num_chunks,
                     num_chunks == 1 ? "" : "s", chunk_size, last_chunk_size, format_bytes(bytes_per_chunk));
}

// ---- batch size -----------------------------------------------------------------------------

Result<BatchRecommendation> recommend_batch_size(std::size_t item_count,
                                                 std::size_t worst_case_bytes_per_item,
                                                 std::size_t available, double fraction,
                                                 std::optional<std::size_t> cap) {
  if (auto ok = check_items(item_count, worst_case_bytes_per_item, "recommend_batch_size"); !ok)
    return std::unexpected(ok.error());
  if (auto ok = check_fraction(fraction); !ok) return std::unexpected(ok.error());
  if (cap && *cap == 0)
    return make_error(ErrorKind::InvalidInput, "recommend_batch_size: a cap of 0: expected at least 1");
  BatchRecommendation r;
  r.available_bytes = available;
  r.usable_bytes = static_cast<std::size_t>(std::floor(fraction * static_cast<double>(available)));
  r.bytes_per_item = worst_case_bytes_per_item;
  r.max_items = std::max<std::size_t>(1, r.usable_bytes / worst_case_bytes_per_item);
  r.batch_size = std::min({r.max_items, item_count, cap.value_or(item_count)});
  return r;
}

Result<BatchRecommendation> recommend_batch_size(std::size_t item_count,
                                                 std::size_t worst_case_bytes_per_item,
                                                 const Device& device, const GpuMemoryPool& pool,
                                                 double fraction, std::optional<std::size_t> cap) {
  auto available = available_bytes(device, pool);
  if (!available) return std::unexpected(available.error());
  return recommend_batch_size(item_count, worst_case_bytes_per_item, *available, fraction, cap);
}

std::string BatchRecommendation::to_string() const {
  return fmt::format("Batch size recommendation:\n  Available memory: {}\n  Usable memory: {}\n"
                     "  Memory per item (worst case): {}\n  Max items per batch: {}\n"
                     "  Recommended batch size: {}\n",
                     format_bytes(available_bytes), format_bytes(usable_bytes),
                     format_bytes(bytes_per_item), max_items, batch_size);
}

}  // namespace gpupool
