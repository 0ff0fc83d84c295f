// GpuMemoryPool: the public face. It finds the device's sub-pool and forwards; allocations go
// through pool/allocation_path.cpp, the policies live in pool/device_pool.cpp.
module;
#include <algorithm>
#include <array>
#include <atomic>
#include <unordered_map>
#include <string>
#include <cstddef>
#include <expected>
#include <fmt/format.h>
#include <memory>
#include <mutex>
#include <optional>
#include <source_location>
#include <utility>
#include <vector>
module gpupool;
import :device_pool;
import :pool_policies;
import :pool_state;
import :recorder;

namespace gpupool {

// ---- PoolState --------------------------------------------------------------------------------

PoolState::PoolState(PoolConfig config) : policies(std::make_shared<PoolPolicies>()) {
  policies->config = std::move(config);
}

PoolState::~PoolState() {
  {
    std::lock_guard lock(legacy_mutex);
    legacy_buffers.clear();  // never returned through return_buffer: give them back now
  }
  for (auto& pool : owned_) pool->free_parked_buffers();  // pointers never freed: back now
  if (PoolRecorder* recorder = policies->recorder.load()) recorder->report_leaks();  // tracing
  for (auto& pool : owned_) pool->orphan();
}

Result<DevicePool*> PoolState::device_pool(const Device& device) {
  if (DevicePool* pool = find(device)) return pool;
  std::lock_guard lock(create_mutex_);
  if (DevicePool* pool = find(device)) return pool;
  std::size_t n = count_.load();
  if (n == kMaxDevices)
    return make_error(ErrorKind::Unsupported,
                      fmt::format("one pool serves at most {} devices; device {} would be one more",
                                  kMaxDevices, device.id()), device.id());
  auto pool = std::make_shared<DevicePool>(device, policies, this);
  if (auto ok = pool->reserve(policies->config.initial_reservation,
                              policies->config.reservation_block_bytes); !ok)
    return std::unexpected(ok.error());
  owned_.push_back(pool);
  slots_[n].device_id.store(device.id(), std::memory_order_relaxed);
  slots_[n].pool.store(pool.get(), std::memory_order_release);
  count_.store(n + 1, std::memory_order_release);
  return pool.get();
}

// ---- GpuMemoryPool ----------------------------------------------------------------------------

GpuMemoryPool::GpuMemoryPool(PoolConfig config) : state_(std::make_shared<PoolState>(std::move(config))) {}

const PoolConfig& GpuMemoryPool::config() const noexcept { return state_->policies->config; }

Result<BufferBatch> GpuMemoryPool::create_buffer_batch(const Device& device,
                                                       const std::vector<BufferRequest>& requests) {
  BufferBatch batch(*this, device);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    if (auto ok = batch.add(requests[i].elements, requests[i].precision); !ok)
      // `batch` goes out of scope here and hands back what it already holds.
      return std::unexpected(ok.error().with_context(
          fmt::format("buffer batch request {} of {} ({} {} elements); none of the batch is held",
                      i, requests.size(), requests[i].elements, to_string(requests[i].precision))));
  }
  return batch;
}

BufferBatch GpuMemoryPool::create_buffer_batch(const Device& device) { return BufferBatch(*this, device); }

Result<void> GpuMemoryPool::set_max_pool_size(const Device& device, std::size_t bytes) {
  if (bytes == 0)
    return make_error(ErrorKind::InvalidInput,
                      "max pool size 0: expected a positive byte count (the hard limit)", device.id());
  auto pool = state_->device_pool(device);
  if (!pool) return std::unexpected(pool.error());
  (*pool)->set_limit(bytes);
  return {};
}

Result<void> GpuMemoryPool::enable_peer_access(const Device& owner, const Device& accessor) {
  if (auto ok = accessor.enable_peer_access(owner); !ok) return ok;
  if (owner.id() == accessor.id()) return {};
  auto pool = state_->device_pool(owner);
  if (!pool) return std::unexpected(pool.error());
  return (*pool)->grant_access_to(accessor);
}

std::optional<std::size_t> GpuMemoryPool::max_pool_size(const Device& device) const {
  DevicePool* pool = state_->find(device);
  return pool ? pool->limit() : config().max_pool_size;
}

Result<void> GpuMemoryPool::set_max_cached_bytes(const Device& device, std::optional<std::size_t> bytes) {
  auto pool = state_->device_pool(device);
  if (!pool) return std::unexpected(pool.error());
  (*pool)->set_max_cached(bytes);
  return {};
}

PoolStats GpuMemoryPool::stats(const Device& device) const {
  DevicePool* pool = state_->find(device);
  return pool ? pool->stats() : PoolStats{};
}

PoolStats GpuMemoryPool::total_stats() const {
  PoolStats total;
  state_->for_each([&](const DevicePool& pool) {
    PoolStats s = pool.stats();
    total.in_use_bytes += s.in_use_bytes;
    total.requested_bytes += s.requested_bytes;
    total.cached_bytes += s.cached_bytes;
    total.reserved_bytes += s.reserved_bytes;
    total.peak_in_use_bytes += s.peak_in_use_bytes;  // sum of per-device peaks: an upper bound
    total.peak_requested_bytes += s.peak_requested_bytes;
    total.peak_cached_bytes += s.peak_cached_bytes;
    total.peak_reserved_bytes += s.peak_reserved_bytes;
    total.allocations += s.allocations;
    total.frees += s.frees;
    total.cache_hits += s.cache_hits;
    total.cache_misses += s.cache_misses;
    total.device_allocations += s.device_allocations;
    total.device_frees += s.device_frees;
    total.out_of_memory_errors += s.out_of_memory_errors;
    total.trims += s.trims;
    total.live_buffers += s.live_buffers;
    total.fragmentation.cached_classes += s.fragmentation.cached_classes;
    total.fragmentation.largest_cached_block =
        std::max(total.fragmentation.largest_cached_block, s.fragmentation.largest_cached_block);
  });
  derive_fragmentation_ratios(total);
  return total;
}

void GpuMemoryPool::reset_peaks(const Device& device) {
  if (DevicePool* pool = state_->find(device)) pool->reset_peaks();
}

std::optional<MemoryUsage> GpuMemoryPool::memory_usage(const Device& device) const {
  DevicePool* pool = state_->find(device);
  if (!pool) return std::nullopt;
  PoolStats s = pool->stats();
  return MemoryUsage{s.reserved_bytes, s.peak_reserved_bytes};
}

MemoryUsage GpuMemoryPool::total_memory_usage() const {
  PoolStats s = total_stats();
  return {s.reserved_bytes, s.peak_reserved_bytes};
}

double GpuMemoryPool::memory_pressure(const Device& device) const {
  DevicePool* pool = state_->find(device);
  return pool ? pool->pressure() : 0.0;
}

std::uint64_t GpuMemoryPool::add_pressure_observer(double threshold, PressureObserver observer) {
  std::lock_guard lock(state_->policies->mutex);
  std::uint64_t id = state_->policies->next_id++;
  state_->policies->observers.push_back({id, threshold, std::move(observer)});
  return id;
}

void GpuMemoryPool::remove_pressure_observer(std::uint64_t id) {
  std::lock_guard lock(state_->policies->mutex);
  std::erase_if(state_->policies->observers, [&](auto& o) { return o.id == id; });
}

std::uint64_t GpuMemoryPool::add_oom_handler(OomHandler handler) {
  std::lock_guard lock(state_->policies->mutex);
  std::uint64_t id = state_->policies->next_id++;
  state_->policies->oom_handlers.push_back({id, std::move(handler)});
  return id;
}

void GpuMemoryPool::remove_oom_handler(std::uint64_t id) {
  std::lock_guard lock(state_->policies->mutex);
  std::erase_if(state_->policies->oom_handlers, [&](auto& h) { return h.id == id; });
}

std::size_t GpuMemoryPool::trim(const Device& device, std::size_t keep_bytes) {
  DevicePool* pool = state_->find(device);
  return pool ? pool->trim(keep_bytes) : 0;
}

std::size_t GpuMemoryPool::emergency_cleanup(const Device& device) {
  DevicePool* pool = state_->find(device);
  return pool ? pool->cleanup() : 0;
}

std::size_t GpuMemoryPool::emergency_cleanup_all() {
  std::size_t released = 0;
  state_->for_each([&](DevicePool& pool) { released += pool.cleanup(); });
  return released;
}

// ---- the deprecated raw API -------------------------------------------------------------------

Result<RawBuffer> GpuMemoryPool::get_buffer(const Device& device, std::size_t elements,
                                            Precision precision) {
  auto buffer = get_managed_buffer(device, elements, precision);
  if (!buffer) return std::unexpected(buffer.error());
  RawBuffer raw{buffer->raw_data(), buffer->size_bytes(), precision, device.id()};
  std::lock_guard lock(state_->legacy_mutex);
  state_->legacy_buffers.emplace(raw.ptr, std::move(*buffer));
  return raw;
}

Result<void> GpuMemoryPool::return_buffer(const Device& device, const RawBuffer& raw) {
  std::lock_guard lock(state_->legacy_mutex);
  auto it = state_->legacy_buffers.find(raw.ptr);
  if (it == state_->legacy_buffers.end())
    return make_error(ErrorKind::InvalidState,
                      fmt::format("return_buffer: {} was not handed out by this pool's get_buffer "
                                  "or was already returned; it is not taken into the cache",
                                  raw.ptr), device.id());
  const ManagedBuffer& held = it->second;
  std::string mismatch;
  if (device.id() != held.device_id() || raw.device_id != held.device_id())
    mismatch = fmt::format("device {} (buffer says {}), expected {}", device.id(), raw.device_id,
                           held.device_id());
  else if (raw.bytes != held.size_bytes())
    mismatch = fmt::format("size {} bytes, expected {}", raw.bytes, held.size_bytes());
  else if (raw.precision != held.precision())
    mismatch = fmt::format("precision {}, expected {}", to_string(raw.precision),
                           to_string(held.precision()));
  if (!mismatch.empty())
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("return_buffer of {}: {}; the buffer stays held", raw.ptr, mismatch),
                      device.id());
  state_->legacy_buffers.erase(it);  // the ManagedBuffer's destructor gives it back
  return {};
}

// ---- BufferBatch ------------------------------------------------------------------------------

Result<ManagedBuffer*> BufferBatch::at(std::size_t index) {
  if (index >= buffers_.size())
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("buffer batch index {} is out of range: the batch holds {}", index,
                                  buffers_.size()), device_.id());
  return &buffers_[index];
}

Result<void> BufferBatch::add(ManagedBuffer buffer) {
  if (!buffer.valid())
    return make_error(ErrorKind::InvalidInput, "cannot add an empty buffer to a batch", device_.id());
  if (buffer.device_id() != device_.id())
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("cannot add a buffer of device {} to a batch of device {}",
                                  buffer.device_id(), device_.id()), device_.id());
  buffers_.push_back(std::move(buffer));
  return {};
}

Result<void> BufferBatch::add(std::size_t elements, Precision precision) {
  auto buffer = pool_.get_managed_buffer(device_, elements, precision);
  if (!buffer) return std::unexpected(buffer.error());
  buffers_.push_back(std::move(*buffer));
  return {};
}

Result<ManagedBuffer> BufferBatch::remove(std::size_t index) {
  if (index >= buffers_.size())
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("buffer batch index {} is out of range: the batch holds {}", index,
                                  buffers_.size()), device_.id());
  ManagedBuffer taken = std::move(buffers_[index]);
  buffers_.erase(buffers_.begin() + static_cast<std::ptrdiff_t>(index));
  return taken;
}

std::size_t BufferBatch::total_bytes() const noexcept {
  std::size_t total = 0;
  for (const ManagedBuffer& b : buffers_) total += b.size_bytes();
  return total;
}

}  // namespace gpupool
