// The pool's policies (pool/pool_policies.cppm): each over the mechanism's CacheControl.
module;
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <fmt/format.h>
#include <functional>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>
module gpupool;
import :pool_policies;

namespace gpupool {

// ---- Reservations -----------------------------------------------------------------------------

bool Reservations::try_add(std::size_t bytes, std::size_t limit) noexcept {
  if (limit == 0) {
    reserved_.fetch_add(bytes);
    return true;
  }
  std::size_t reserved = reserved_.load();
  do {
    if (reserved + bytes > limit) return false;
  } while (!reserved_.compare_exchange_weak(reserved, reserved + bytes));
  return true;
}

void Reservations::allocated() noexcept {
  device_allocations_.fetch_add(1, std::memory_order_relaxed);
  const std::size_t now = reserved();
  std::size_t peak = peak_.load(std::memory_order_relaxed);
  while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  std::size_t most = most_.load(std::memory_order_relaxed);
  while (now > most && !most_.compare_exchange_weak(most, now, std::memory_order_relaxed)) {
  }
}

void Reservations::freed(std::size_t bytes) noexcept {
  reserved_.fetch_sub(bytes);
  device_frees_.fetch_add(1, std::memory_order_relaxed);
}

// ---- HardLimit --------------------------------------------------------------------------------

void HardLimit::set(std::optional<std::size_t> bytes, const Reservations& reservations,
                    CacheControl& cache) noexcept {
  bytes_.store(bytes.value_or(0));
  // A lower limit applies to the cache at once: otherwise a cache hit could hand out bytes the
  // limit no longer allows.
  if (bytes && reservations.reserved() > *bytes) {
    const std::size_t in_use = cache.in_use_bytes();
    cache.trim(*bytes > in_use ? *bytes - in_use : 0);
  }
}

void HardLimit::make_room(std::size_t bytes, const Reservations& reservations,
                          CacheControl& cache) const {
  const std::size_t limit = this->bytes(), reserved = reservations.reserved();
  if (limit == 0 || reserved + bytes <= limit) return;
  const std::size_t cached = reservations.cached(cache.in_use_bytes());
  const std::size_t excess = reserved + bytes - limit;
  cache.trim(cached > excess ? cached - excess : 0);
}

Result<void> HardLimit::admit(std::size_t bytes, std::size_t requested_bytes, bool may_trim,
                              Reservations& reservations, CacheControl& cache, int device_id) {
  if (may_trim) make_room(bytes, reservations, cache);
  if (reservations.try_add(bytes, this->bytes())) return {};
  const std::size_t in_use = cache.in_use_bytes();
  return std::unexpected(
      exceeded_error(requested_bytes, bytes, in_use, reservations.cached(in_use), device_id));
}

GpuError HardLimit::exceeded_error(std::size_t requested_bytes, std::size_t block_bytes,
                                   std::size_t in_use, std::size_t cached, int device_id) const {
  return GpuError(ErrorKind::PoolLimitExceeded,
                  fmt::format("requested {} (a block of {}) would pass the pool limit of {}: in use "
                              "{}, cached {}; free buffers or raise the limit with "
                              "set_max_pool_size or GPUPOOL_MEMORY_LIMIT",
                              format_bytes(requested_bytes), format_bytes(block_bytes),
                              format_bytes(bytes()), format_bytes(in_use), format_bytes(cached)),
                  device_id);
}

// ---- SoftCap ----------------------------------------------------------------------------------

void SoftCap::set(std::optional<std::size_t> bytes, CacheControl& cache) noexcept {
  bytes_.store(bytes.value_or(SIZE_MAX));
  if (bytes) cache.trim(*bytes);
}

void SoftCap::enforce(const Reservations& reservations, CacheControl& cache,
                      AutomaticTrims& trims) noexcept {
  const std::size_t cap = bytes();
  if (reservations.cached(cache.in_use_bytes()) > cap) trims.run([&] { cache.trim(cap); });
}

// ---- PressureWatch ----------------------------------------------------------------------------

double PressureWatch::pressure(std::size_t reserved, std::size_t effective_limit) noexcept {
  if (effective_limit == 0) return 0.0;
  return std::min(1.0, static_cast<double>(reserved) / static_cast<double>(effective_limit));
}

void PressureWatch::after_growth(double before, std::size_t reserved, std::size_t effective_limit,
                                 PoolPolicies& policies, int device_id, CacheControl& cache,
                                 AutomaticTrims& trims) {
  const double now = pressure(reserved, effective_limit);
  std::vector<std::pair<double, PressureObserver>> crossed;
  {
    std::lock_guard lock(policies.mutex);
    for (auto& observer : policies.observers)
      if (before < observer.threshold && now >= observer.threshold)
        crossed.emplace_back(observer.threshold, observer.callback);
  }
  for (auto& [threshold, callback] : crossed) callback(PressureEvent{device_id, now, threshold});
  const double critical = policies.config.critical_pressure;
  if (now < critical) return;
  // Critical: give back the coldest cached blocks until under the critical level again
  // (strictly: reserved at most one byte below it).
  trims.run([&] {
    const auto target = static_cast<std::size_t>(critical * static_cast<double>(effective_limit));
    const std::size_t in_use = cache.in_use_bytes();
    cache.trim(target > in_use ? target - in_use - 1 : 0);
  });
}

// ---- OomLadder --------------------------------------------------------------------------------

Result<void*> OomLadder::climb(std::size_t requested_bytes, GpuError first_error,
                               const std::function<Result<void*>()>& attempt,
                               PoolPolicies& policies, int device_id, CacheControl& cache) {
  Result<void*> result = std::unexpected(std::move(first_error));
  if (cache.cleanup() > 0) result = attempt();
  if (result || result.error().kind() != ErrorKind::OutOfMemory) return result;
  std::vector<OomHandler> handlers;
  {
    std::lock_guard lock(policies.mutex);
    for (auto& handler : policies.oom_handlers) handlers.push_back(handler.callback);
  }
  bool retry = false;
  for (auto& handler : handlers) retry = handler(device_id, requested_bytes) || retry;
  // What the handlers freed went to the cache (a thread cache or a segment's free range): it
  // goes back to the device before the retry asks it again.
  if (retry) {
    cache.cleanup();
    result = attempt();
  }
  return result;
}

}  // namespace gpupool
