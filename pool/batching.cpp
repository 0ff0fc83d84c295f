// The non-template parts of process_in_batches: the headroom it plans with, option checks, the
// first planned size and the errors it gives up with.
module;
#include <algorithm>
#include <cstddef>
#include <expected>
#include <fmt/format.h>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>
module gpupool;
import :device_pool;
import :pool_access;

namespace gpupool {

namespace {
DevicePool::Usage usage_of(const GpuMemoryPool& pool, const Device& device) {
  DevicePool* sub_pool = PoolAccess::find(pool, device);
  return sub_pool ? sub_pool->usage() : DevicePool::Usage{0, 0, 0};
}
}  // namespace

// Read before every batch: the device's free memory and the pool's lean figures (not stats(),
// whose pass over every size class would sit between the batches' device work).
Result<MemoryHeadroom> memory_headroom(const GpuMemoryPool& pool, const Device& device) {
  auto info = device.memory_info();
  if (!info) return std::unexpected(info.error().with_context("measuring the headroom for batching"));
  const DevicePool::Usage usage = usage_of(pool, device);
  MemoryHeadroom headroom;
  headroom.device_free = info->free;
  headroom.cached = usage.reserved > usage.in_use ? usage.reserved - usage.in_use : 0;
  headroom.pool_in_use = usage.in_use;
  // Cached blocks count as available: a trim gives them back to the device. But never more
  // than the device's total beyond what the pool has in use (a simulated device may shrink
  // below what is cached, and then its free memory reads 0 while the cache stays large).
  const std::size_t beyond_in_use = info->total > usage.in_use ? info->total - usage.in_use : 0;
  headroom.bytes = std::min(headroom.device_free + headroom.cached, beyond_in_use);
  if (auto limit = pool.max_pool_size(device)) {
    headroom.limit_room = *limit > usage.in_use ? *limit - usage.in_use : 0;
    headroom.bytes = std::min(headroom.bytes, *headroom.limit_room);
  }
  return headroom;
}

}  // namespace gpupool

namespace gpupool::batching_detail {

std::size_t peak_in_use_bytes(const GpuMemoryPool& pool, const Device& device) {
  return usage_of(pool, device).peak_in_use;
}

Result<void> validate_options(const BatchingOptions& options) {
  if (options.probe_items == 0)
    return make_error(ErrorKind::InvalidInput, "probe_items is 0: expected at least 1 item");
  if (!(options.safety_fraction > 0 && options.safety_fraction <= 1))
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("safety_fraction is {}: expected a value in (0, 1]", options.safety_fraction));
  if (options.batch_size && *options.batch_size == 0)
    return make_error(ErrorKind::InvalidInput, "batch_size is 0: expected at least 1 item (or nullopt to plan)");
  if (options.bytes_per_item && *options.bytes_per_item == 0)
    return make_error(ErrorKind::InvalidInput,
                      "bytes_per_item is 0: expected at least 1 byte (or nullopt to measure)");
  if (options.max_item_length == 0)
    return make_error(ErrorKind::InvalidInput, "max_item_length is 0: expected at least 1 element");
  return {};
}

std::string describe_items(std::size_t first, std::size_t count, std::string_view item,
                           std::string_view items) {
  return count == 1 ? fmt::format("{} {}", item, first)
                    : fmt::format("{} {}..{}", items, first, first + count - 1);
}

std::size_t first_planned_size(const MemoryHeadroom& headroom, const BatchPlanner& planner,
                               const BatchingOptions& options, std::size_t bytes_per_item) {
  // The probe used no pool memory: memory does not bound the size, so start from the probe's
  // size and let the planner's growth find the rest (a stream is never read whole at once).
  if (bytes_per_item == 0) return std::min(options.probe_items, planner.config().max_batch_size);
  return planner.size_for_headroom(headroom.bytes, options.safety_fraction, bytes_per_item);
}

GpuError give_up_error(OomDecision decision, const GpuError& cause, std::size_t first,
                       std::size_t size, std::size_t retries, std::string_view item,
                       std::string_view items) {
  if (decision == OomDecision::FailedAtOne)
    return cause.with_context(fmt::format(
        "{} {} does not fit: a batch of this one {} ran out of memory ({} out-of-memory "
        "retries in all); free memory or raise the pool limit",
        item, first, item, retries));
  return cause.with_context(fmt::format(
      "gave up on {} after too many out-of-memory failures in a row (max_retries reached, last "
      "batch size {}); raise planner.max_retries or free memory",
      describe_items(first, size, item, items), size));
}

}  // namespace gpupool::batching_detail
