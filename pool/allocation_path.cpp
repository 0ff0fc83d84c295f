// The allocation path: a request and a free, each top to bottom in one function.
//
//   GpuMemoryPool::allocate_*(): the device's sub-pool (PoolState::find, pool/pool_state.cppm)
//   allocate():  check the request → its size class → this thread's cache → hit: count, hand out
//                ↳ a large block: this thread's own arena shard, in the same lock hold
//                ↳ miss (allocate_missed, pool/device_pool.cpp's shared path): bins, arenas, device
//   take_back(): count → the allocating thread's cache → done
//                ↳ a large block the cache does not keep: its arena shard, in the same lock hold
//                ↳ other streams, a soft cap, a busy shard (give_back_slow): the shared path
//
// Pointer-only allocations (allocate_pointer, free_own_pointer) take the same steps, parking
// the block's buffer in the thread cache (pool/parked_buffers.cppm) within the same lock hold;
// a free from another thread searches the other caches (pool/parked_pointers.cpp).
//
// The hit and the cached free touch only the calling thread's cache (its lock, its counters) and
// read a few of the pool's atomics; no allocation, no formatting, no device call. Everything else
// sits in functions marked cold or noinline, so the hot functions stay short for the compiler.
module;
#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <expected>
#include <fmt/format.h>
#include <memory>
#include <mutex>
#include "word_lock.hpp"  // the arena shards' lock
#include <optional>
#include <source_location>
#include <utility>
#include "owner_biased_lock.hpp"  // the thread caches' lock
module gpupool;
import :device_pool;
import :pool_state;
import :thread_cache;
import :parked_buffers;
import :size_classes;
import :recorder;

namespace gpupool {

namespace sc = size_classes;

// ---- a request --------------------------------------------------------------------------------

Result<ManagedBuffer> GpuMemoryPool::get_managed_buffer(const Device& device, std::size_t elements,
                                                        Precision precision,
                                                        std::source_location where) {
  return allocate_elements(device, elements, precision, nullptr, where);
}

Result<ManagedBuffer> GpuMemoryPool::get_managed_buffer(const Device& device, std::size_t elements,
                                                        Precision precision, const Stream& stream,
                                                        std::source_location where) {
  return allocate_elements(device, elements, precision, &stream, where);
}

// The public entry points are one call each: these two fold into them.
[[gnu::always_inline]] Result<ManagedBuffer> GpuMemoryPool::allocate_elements(const Device& device, std::size_t elements,
                                                       Precision precision, const Stream* stream,
                                                       const std::source_location& where) {
  const std::size_t element_bytes = element_size(precision);
  if (elements == 0)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("a buffer of 0 {} elements was asked for: expected at least 1",
                                  to_string(precision)), device.id());
  if (elements > SIZE_MAX / element_bytes)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{} {} elements overflow a byte count", elements,
                                  to_string(precision)), device.id());
  return allocate_bytes_as(device, elements * element_bytes, precision, stream, where);
}

Result<ManagedBuffer> GpuMemoryPool::allocate_bytes(const Device& device, std::size_t bytes,
                                                    std::source_location where) {
  return allocate_bytes_as(device, bytes, Precision::Bytes, nullptr, where);
}

Result<ManagedBuffer> GpuMemoryPool::allocate_bytes(const Device& device, std::size_t bytes,
                                                    const Stream& stream,
                                                    std::source_location where) {
  return allocate_bytes_as(device, bytes, Precision::Bytes, &stream, where);
}

[[gnu::always_inline]] Result<ManagedBuffer> GpuMemoryPool::allocate_bytes_as(const Device& device, std::size_t bytes,
                                                       Precision precision, const Stream* stream,
                                                       const std::source_location& where) {
  DevicePool* pool = state_->find(device);
  if (!pool) [[unlikely]] {
    auto made = state_->device_pool(device);
    if (!made) return std::unexpected(made.error());
    pool = *made;
  }
  return pool->allocate(bytes, precision, stream ? *stream : pool->default_stream(), where);
}

Result<void*> GpuMemoryPool::allocate_pointer(const Device& device, std::size_t bytes,
                                              const Stream* stream, std::source_location where) {
  DevicePool* pool = state_->find(device);
  if (!pool) [[unlikely]] {
    auto made = state_->device_pool(device);
    if (!made) return std::unexpected(made.error());
    pool = *made;
  }
  return pool->allocate_pointer(bytes, stream ? *stream : pool->default_stream(), where);
}

Result<ManagedBuffer> DevicePool::allocate(std::size_t requested_bytes, Precision precision,
                                           const Stream& stream, const std::source_location& where) {
  auto sizing = size_request(requested_bytes, precision, stream);
  if (!sizing) [[unlikely]] return std::unexpected(std::move(sizing.error()));
  ThreadCache& cache = thread_cache();
  cache.lock.lock();
  if (auto block = cache.take(sizing->size_class, {sizing->block_bytes, sizing->most_bytes},
                              precision, stream.native())) {
    count_allocation(cache, block->size_class, block->bytes, requested_bytes, /*hit=*/true);
    cache.lock.unlock();
    if (policies_->recorder.load(std::memory_order_acquire)) [[unlikely]]
      record_allocation(*block, requested_bytes, precision, stream, where);
    Result<ManagedBuffer> result(std::in_place);  // made in place: no move on the way out
    fill(*result, cache, *block, requested_bytes, precision, stream);
    return result;
  }
  // A large block from this thread's own arena shard, still in this lock hold: most requests of
  // a workload whose sizes vary end here, and a second hold of the cache's lock would cost them
  // another atomic exchange.
  if (sizing->from_segments && stream.is_default()) {
    if (auto block = take_from_own_shard_now(sizing->size_class, sizing->block_bytes)) {
      count_allocation(cache, block->size_class, block->bytes, requested_bytes, /*hit=*/true);
      cache.lock.unlock();
      if (policies_->recorder.load(std::memory_order_acquire)) [[unlikely]]
        record_allocation(*block, requested_bytes, precision, stream, where);
      Result<ManagedBuffer> result(std::in_place);
      fill(*result, cache, *block, requested_bytes, precision, stream);
      return result;
    }
  }
  ++cache.references;  // keeps the cache (and this pool) while the shared path runs
  cache.lock.unlock();
  return allocate_missed(cache, requested_bytes, sizing->size_class, sizing->block_bytes,
                         precision, stream, where);
}

// The same request for a caller that keeps only the pointer: the buffer parks in this thread's
// cache, in the same lock hold that takes its block.
Result<void*> DevicePool::allocate_pointer(std::size_t requested_bytes, const Stream& stream,
                                           const std::source_location& where) {
  constexpr Precision precision = Precision::Bytes;
  auto sizing = size_request(requested_bytes, precision, stream);
  if (!sizing) [[unlikely]] return std::unexpected(std::move(sizing.error()));
  ThreadCache& cache = thread_cache();
  cache.lock.lock();
  if (!cache.parked.make_room()) [[unlikely]] {
    cache.lock.unlock();
    return make_error(ErrorKind::OutOfMemory, "the host ran out of memory for the pool's "
                      "record of a pointer-only allocation", device_.id());
  }
  if (auto block = cache.take(sizing->size_class, {sizing->block_bytes, sizing->most_bytes},
                              precision, stream.native())) {
    count_allocation(cache, block->size_class, block->bytes, requested_bytes, /*hit=*/true);
    ParkedBlock& record = cache.parked.emplace(block->ptr);
    record.arena = block->arena;
    record.requested_bytes = requested_bytes;
    record.block_bytes = block->bytes;
    record.size_class = block->size_class;
    record.span = block->span;
    if (!stream.is_default()) record.stream = stream;  // the default one is the pool's
    cache.lock.unlock();
    if (policies_->recorder.load(std::memory_order_acquire)) [[unlikely]]
      record_allocation(*block, requested_bytes, precision, stream, where);
    return block->ptr;
  }
  ++cache.references;  // keeps the cache (and this pool) while the shared path runs
  cache.lock.unlock();
  auto buffer = allocate_missed(cache, requested_bytes, sizing->size_class, sizing->block_bytes,
                                precision, stream, where);
  if (!buffer) return std::unexpected(std::move(buffer.error()));
  void* const ptr = buffer->ptr_;
  std::lock_guard lock(cache.lock);  // the room made above is still there: only this thread parks
  park(cache.parked.emplace(ptr), std::move(*buffer));
  return ptr;
}

// The checks every request passes before it looks for a block.
[[gnu::always_inline]] inline Result<DevicePool::Sizing> DevicePool::size_request(
    std::size_t requested_bytes, Precision precision, const Stream& stream) {
  if (requested_bytes - 1 >= sc::kMaxRequest || !is_known(precision) ||
      stream.device_id() != device_.id()) [[unlikely]]
    return std::unexpected(refusal(requested_bytes, precision, stream));
  const std::uint32_t size_class = sc::class_of(requested_bytes);
  const std::size_t block_bytes = block_bytes_for(requested_bytes, size_class);
  // Under a lowered limit the pool may still hold more than the limit (free space in segments
  // that live blocks use): then even a hit must stay within the room the limit leaves.
  std::size_t most_bytes = SIZE_MAX;
  if (limit_.exceeded(reservations_)) [[unlikely]] {
    auto room = room_under_lowered_limit(requested_bytes, block_bytes, precision, stream,
                                         limit_.bytes());
    if (!room) return std::unexpected(std::move(room.error()));
    most_bytes = *room;
  }
  return Sizing{size_class, block_bytes, most_bytes,
                class_carves_from_segments(size_class)};
}

// This thread's cache: the one it used last, else found in its registry (or made).
[[gnu::always_inline]] inline ThreadCache& DevicePool::thread_cache() {
  ThreadCache* last = last_used_cache;
  if (last && &last->pool() == this) [[likely]] return *last;
  return find_thread_cache();
}

// Under cache.lock. Peaks read the pool-wide published figure plus this cache's unpublished
// rest: exact when one thread uses the pool, within kPublishBytes per other thread otherwise.
[[gnu::always_inline]] inline void DevicePool::count_allocation(ThreadCache& cache, std::uint32_t size_class,
                                         std::size_t block_bytes, std::size_t requested_bytes,
                                         bool hit) noexcept {
  ClassCounters& counted = cache.counters[size_class];
  if (counted.allocations == 0) [[unlikely]] mark_active(size_class);
  ++counted.allocations;
  counted.hits += hit ? 1 : 0;
  cache.in_use += static_cast<std::int64_t>(block_bytes);
  cache.requested += static_cast<std::int64_t>(requested_bytes);
  ++cache.references;  // the buffer's
  publish(cache);
  const UsageCounters::Bytes published = counters_.published();
  counters_.raise_peaks(
      {published.in_use + static_cast<std::size_t>(cache.in_use - cache.published_in_use),
       published.requested + static_cast<std::size_t>(cache.requested - cache.published_requested)});
}

// Makes `buffer` (empty) the owner of `block`.
[[gnu::always_inline]] inline void DevicePool::fill(ManagedBuffer& buffer, ThreadCache& cache,
                                                   const ThreadBlock& block,
                                                   std::size_t requested_bytes,
                                                   Precision precision,
                                                   const Stream& stream) noexcept {
  buffer.cache_ = &cache;
  buffer.ptr_ = block.ptr;
  buffer.requested_bytes_ = requested_bytes;
  buffer.block_bytes_ = block.bytes;
  buffer.size_class_ = block.size_class;
  buffer.arena_ = block.arena;
  buffer.span_ = block.span;
  buffer.precision_ = precision;
  if (!stream.is_default()) buffer.stream_ = stream;  // the default one is the pool's
}

// Tracing: after the block is counted, before anyone else can see it.
void DevicePool::record_allocation(const ThreadBlock& block, std::size_t requested_bytes,
                                   Precision precision, const Stream& stream,
                                   const std::source_location& where) noexcept {
  if (PoolRecorder* r = policies_->recorder.load(std::memory_order_acquire))
    r->on_allocate(device_, block.ptr, requested_bytes, block.bytes, precision, stream.native(),
                   where, figures());
}

// A miss in the thread's cache: the shared bins and arenas, else the device (the OOM ladder).
// The caller took a reference to `cache` for the time this runs.
Result<ManagedBuffer> DevicePool::allocate_missed(ThreadCache& cache, std::size_t requested_bytes,
                                                  std::uint32_t size_class, std::size_t block_bytes,
                                                  Precision precision, const Stream& stream,
                                                  const std::source_location& where) {
  auto taken = take_shared(requested_bytes, size_class, block_bytes, precision, stream.native());
  if (!taken) {
    PoolRecorder* r = policies_->recorder.load(std::memory_order_acquire);  // tracing
    if (r && taken.error().is_out_of_memory())
      r->on_oom(device_, requested_bytes, precision, stream.native(), figures());
    release_reference(cache);
    return std::unexpected(taken.error());
  }
  cache.lock.lock();
  count_allocation(cache, taken->block.size_class, taken->block.bytes, requested_bytes, taken->hit);
  --cache.references;  // count_allocation took the buffer's own
  cache.lock.unlock();
  if (policies_->recorder.load(std::memory_order_acquire)) [[unlikely]]
    record_allocation(taken->block, requested_bytes, precision, stream, where);
  Result<ManagedBuffer> result(std::in_place);
  fill(*result, cache, taken->block, requested_bytes, precision, stream);
  return result;
}

// Why a request is refused before it reaches the pool: 0 bytes, an absurd size, a precision
// outside the enumeration, a stream of another device.
GpuError DevicePool::refusal(std::size_t requested_bytes, Precision precision,
                             const Stream& stream) const {
  if (requested_bytes == 0)
    return GpuError(ErrorKind::InvalidInput,
                    "cannot allocate a buffer of 0 bytes: expected at least 1 element", device_.id());
  if (requested_bytes > sc::kMaxRequest)
    return GpuError(ErrorKind::InvalidInput,
                    fmt::format("a buffer of {} is absurd: expected at most {}",
                                format_bytes(requested_bytes), format_bytes(sc::kMaxRequest)),
                    device_.id());
  if (!is_known(precision))
    return GpuError(ErrorKind::InvalidInput,
                    fmt::format("precision {} is not one of fp32, fp16, bf16, int8 and bytes",
                                static_cast<int>(precision)),
                    device_.id());
  return GpuError(ErrorKind::InvalidInput,
                  fmt::format("a buffer on device {} was asked for on a stream of device {}: "
                              "expected a stream of the same device",
                              device_.id(), stream.device_id()),
                  device_.id());
}

// The pool holds more than a lowered hard limit: the most bytes a block may have, or
// PoolLimitExceeded when not even `block_bytes` fits beside what is in use.
Result<std::size_t> DevicePool::room_under_lowered_limit(std::size_t requested_bytes,
                                                         std::size_t block_bytes,
                                                         Precision precision, const Stream& stream,
                                                         std::size_t limit) {
  const std::size_t in_use = live_bytes().in_use;
  if (in_use + block_bytes <= limit) return limit - in_use;
  if (PoolRecorder* r = policies_->recorder.load(std::memory_order_acquire))  // tracing
    r->on_oom(device_, requested_bytes, precision, stream.native(), figures());
  counters_.count_out_of_memory();
  return std::unexpected(limit_exceeded(requested_bytes, block_bytes));
}

// ---- a free -----------------------------------------------------------------------------------

PointerFree GpuMemoryPool::free_pointer(void* ptr, void* stream_handle) noexcept {
  if (!ptr) return PointerFree::not_found;
  // The cache this thread used last, if it is one of this pool's (the common case: no search),
  // then every cache of every device.
  if (ThreadCache* own = last_used_cache; own && own->pool().serves(*state_)) {
    const PointerFree outcome = own->pool().free_own_pointer(*own, ptr, stream_handle);
    if (outcome != PointerFree::not_found) [[likely]] return outcome;
  }
  PointerFree outcome = PointerFree::not_found;
  state_->find_if([&](DevicePool& pool) {
    outcome = pool.free_pointer_anywhere(ptr, stream_handle);
    return outcome != PointerFree::not_found;
  });
  return outcome;
}


// A buffer's way back: ManagedBuffer's destructor, move-assignment and release() end here, with
// take_back folded in (one call a free).
void ManagedBuffer::return_to_pool() noexcept {
  if (!ptr_) return;
  // take_back drops this buffer's reference to its thread cache, which may end the cache and
  // an orphaned sub-pool with it: neither is touched afterwards.
  cache_->pool().take_back(*this);
  cache_ = nullptr;
  ptr_ = nullptr;
  requested_bytes_ = block_bytes_ = 0;
  used_on_.reset();
}

[[gnu::always_inline]] inline void DevicePool::take_back(ManagedBuffer& buffer) noexcept {
  ThreadCache& cache = *buffer.cache_;
  const ThreadBlock block = block_of(buffer);
  const bool keep = keeps_freed_blocks();
  if (policies_->recorder.load(std::memory_order_acquire)) [[unlikely]]
    record_free(buffer, keep);
  const bool other_streams = buffer.used_on_ != nullptr;
  cache.lock.lock();
  if (cache_freed_block(cache, block, buffer.requested_bytes_, other_streams, keep)) [[likely]]
    return;
  const bool reference_dropped = drop_reference_if_owner(cache);
  cache.lock.unlock();
  give_back_slow(cache, block, other_streams ? &buffer : nullptr, keep, reference_dropped);
}

// Under cache.lock, on the way to the shared path: the buffer's reference to its cache goes now,
// in this hold, when the calling thread owns the cache — its registry keeps the cache (and the
// pool) while the thread lives, and only the thread itself detaches it. Another thread keeps the
// reference until the shared path is done, and drops it in a second hold.
[[gnu::always_inline]] inline bool DevicePool::drop_reference_if_owner(ThreadCache& cache) noexcept {
  if (&cache != last_used_cache || cache.detached) return false;
  --cache.references;
  return true;
}

// A pointer-only free by the thread whose cache (this pool's) the buffer parked in: the
// allocating thread.
[[gnu::always_inline]] inline PointerFree DevicePool::free_own_pointer(ThreadCache& cache,
                                                                       void* ptr,
                                                                       void* stream_handle) noexcept {
  cache.lock.lock();
  ParkedBlock* record = cache.parked.find(ptr);
  if (!record) [[unlikely]] {
    cache.lock.unlock();
    return PointerFree::not_found;
  }
  return free_parked(cache, *record, stream_handle);
}

// Frees the block of `record`, parked in `cache`, whose lock the caller holds; releases it.
[[gnu::always_inline]] inline PointerFree DevicePool::free_parked(ThreadCache& cache,
                                                                  ParkedBlock& record,
                                                                  void* stream_handle) noexcept {
  if (!frees_on(record, stream_handle)) [[unlikely]] {
    cache.lock.unlock();
    return PointerFree::other_stream;
  }
  if (record.used_on || policies_->recorder.load(std::memory_order_acquire)) [[unlikely]] {
    ManagedBuffer taken = buffer_of(cache, record);
    cache.parked.erase(record);
    cache.lock.unlock();
    return PointerFree::freed;  // `taken` goes the way of any buffer (take_back)
  }
  const ThreadBlock block{record.ptr,        record.stream.native(), record.arena,
                         record.block_bytes, record.size_class,      Precision::Bytes,
                         record.span};
  const std::size_t requested_bytes = record.requested_bytes;
  cache.parked.erase(record);
  const bool keep = keeps_freed_blocks();
  if (!cache_freed_block(cache, block, requested_bytes, /*used_on_other_streams=*/false, keep)) {
    const bool reference_dropped = drop_reference_if_owner(cache);
    cache.lock.unlock();
    give_back_slow(cache, block, nullptr, keep, reference_dropped);
  }
  return PointerFree::freed;
}

// A free on `stream_handle` may go ahead if the block was allocated on that stream or recorded
// for it (the streams it was recorded for are waited for either way).
bool DevicePool::frees_on(const ParkedBlock& record, void* stream_handle) noexcept {
  if (record.stream.native() == stream_handle) [[likely]] return true;
  if (record.used_on)
    for (const Stream& used : *record.used_on)
      if (used.native() == stream_handle) return true;
  return false;
}

[[gnu::always_inline]] inline ThreadBlock DevicePool::block_of(const ManagedBuffer& buffer) noexcept {
  return {buffer.ptr_,        buffer.stream_.native(), buffer.arena_, buffer.block_bytes_,
          buffer.size_class_, buffer.precision_,       buffer.span_};
}

// Freed blocks stay in the pool unless caching is off, the pool is orphaned, or the pool holds
// more than a lowered hard limit (then they go back to the device until it is under).
[[gnu::always_inline]] inline bool DevicePool::keeps_freed_blocks() const noexcept {
  return caches_blocks_ && !orphaned() && !limit_.exceeded(reservations_);
}

// Under cache.lock: counts the free and keeps the block in this thread's cache when it may (not
// when other streams still use it, or a soft cap on cached bytes must be checked). True when
// done: the lock released, the buffer's reference to the cache dropped. False when the block
// must take the slow way: the lock still held.
[[gnu::always_inline]] inline bool DevicePool::cache_freed_block(ThreadCache& cache,
                                                                const ThreadBlock& block,
                                                                std::size_t requested_bytes,
                                                                bool used_on_other_streams,
                                                                bool keep) noexcept {
  count_free(cache, block.size_class, block.bytes, requested_bytes);
  const bool to_thread_cache = keep && frees_to_thread_caches_ && !used_on_other_streams &&
                               !soft_cap_.active();
  EvictedBlocks evicted;
  if (!to_thread_cache || cache.detached) [[unlikely]] return false;
  if (!cache.put(block, evicted)) {
    // A block carved from a segment goes back to its shard in this hold when that shard's lock
    // is free: on a trace of varying sizes most frees end here, with one lock fewer.
    if (!block.arena || !give_back_to_shard_now(block)) return false;
    --cache.references;  // the registry still holds the cache: it cannot end here
    cache.lock.unlock();
    return true;
  }
  const bool done = evicted.count == 0;
  if (done) --cache.references;  // the registry still holds the cache: it cannot end here
  const bool reference_dropped = done || drop_reference_if_owner(cache);
  cache.lock.unlock();
  if (done) [[likely]] return true;
  for (int i = 0; i < evicted.count; ++i) give_back_shared(evicted.blocks[i], true);
  if (!reference_dropped) release_reference(cache);
  return true;
}

// Under cache.lock: a block carved from a segment back to its shard, if the shard's lock is free
// (never waits: the shared path does, once the cache's lock is gone).
bool DevicePool::give_back_to_shard_now(const ThreadBlock& block) noexcept {
  ArenaShard& shard = *static_cast<ArenaShard*>(block.arena);
  std::unique_lock lock(shard.mutex, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  shard.arena.give_back(block.span);
  return true;
}

// Under cache.lock.
[[gnu::always_inline]] inline void DevicePool::count_free(ThreadCache& cache, std::uint32_t size_class,
                                   std::size_t block_bytes, std::size_t requested_bytes) noexcept {
  ++cache.counters[size_class].frees;
  cache.in_use -= static_cast<std::int64_t>(block_bytes);
  cache.requested -= static_cast<std::int64_t>(requested_bytes);
  publish(cache);
  const std::size_t in_use = counters_.published().in_use +
                             static_cast<std::size_t>(cache.in_use - cache.published_in_use);
  const std::size_t reserved = reservations_.reserved();
  counters_.raise_peak_cached(reserved > in_use ? reserved - in_use : 0);
}

// A free the thread's cache does not take: the block waits for other streams, or goes to the
// shared bins and arenas (or the device), and a soft cap is enforced. Drops the buffer's
// reference to its cache unless the caller did (drop_reference_if_owner).
void DevicePool::give_back_slow(ThreadCache& cache, const ThreadBlock& block,
                                ManagedBuffer* used_on_other_streams, bool keep,
                                bool reference_dropped) noexcept {
  if (!used_on_other_streams || !park_until_streams_done(*used_on_other_streams))
    give_back_shared(block, keep);
  if (keep && soft_cap_.active()) soft_cap_.enforce(reservations_, *this, automatic_trims_);
  if (!reference_dropped) release_reference(cache);
}

// Tracing: recorded before the block can be reused, with the figures the free will leave (a
// block that stays cached, in a segment or waiting for other streams stays reserved).
void DevicePool::record_free(const ManagedBuffer& buffer, bool keep) noexcept {
  PoolRecorder* r = policies_->recorder.load(std::memory_order_acquire);
  if (!r) return;
  const bool stays = keep || buffer.arena_ || buffer.used_on_;
  const std::size_t block_bytes = buffer.block_bytes_;
  PoolFigures now = figures();
  r->on_free(device_, buffer.ptr_, block_bytes,
             {now.in_use - block_bytes, now.reserved - (stays ? 0 : block_bytes), now.limit});
}

// ---- the counters -----------------------------------------------------------------------------

// Moves the cache's unpublished bytes into the pool-wide totals once they pass kPublishBytes,
// where other caches exist: the only cache's peaks read its own rest, and a second cache
// publishes every rest when it comes (add_cache), so a pool used by one thread touches no
// shared line even for blocks above kPublishBytes. Under cache.lock.
[[gnu::always_inline]] inline void DevicePool::publish(ThreadCache& cache) noexcept {
  const std::int64_t in_use = cache.in_use - cache.published_in_use;
  const std::int64_t requested = cache.requested - cache.published_requested;
  if (std::max(std::abs(in_use), std::abs(requested)) < ThreadCache::kPublishBytes) [[likely]]
    return;
  if (!several_caches_.load(std::memory_order_relaxed)) return;
  publish_rest(cache);
}

void DevicePool::publish_rest(ThreadCache& cache) noexcept {
  counters_.publish(cache.in_use - cache.published_in_use,
                    cache.requested - cache.published_requested);
  cache.published_in_use = cache.in_use;
  cache.published_requested = cache.requested;
}

void DevicePool::mark_active(std::uint32_t size_class) noexcept {
  std::atomic<std::uint64_t>& word = active_classes_[size_class / 64];
  const std::uint64_t bit = std::uint64_t{1} << (size_class % 64);
  // Set once per class: later allocations only read the word.
  if (!(word.load(std::memory_order_relaxed) & bit)) word.fetch_or(bit, std::memory_order_relaxed);
}

}  // namespace gpupool
