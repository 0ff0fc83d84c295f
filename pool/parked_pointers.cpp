// Pointer-only allocations beyond the allocating thread: a free or a visit from another thread
// searches every thread cache of the pool, and the pool's last handle frees what is left. Also
// the two conversions between a parked record and the buffer it stands for. The fast path (the
// thread that allocated frees) is in pool/allocation_path.cpp.
module;
#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>
#include "owner_biased_lock.hpp"  // the thread caches' lock
module gpupool;
import :device_pool;
import :pool_state;
import :thread_cache;
import :parked_buffers;

namespace gpupool {

ManagedBuffer DevicePool::buffer_of(ThreadCache& cache, ParkedBlock& record) noexcept {
  ManagedBuffer buffer;
  buffer.cache_ = &cache;
  buffer.ptr_ = record.ptr;
  buffer.requested_bytes_ = record.requested_bytes;
  buffer.block_bytes_ = record.block_bytes;
  buffer.size_class_ = record.size_class;
  buffer.arena_ = record.arena;
  buffer.span_ = record.span;
  buffer.precision_ = Precision::Bytes;
  buffer.stream_ = std::move(record.stream);
  buffer.used_on_ = std::move(record.used_on);
  record.stream = Stream();
  return buffer;
}

void DevicePool::park(ParkedBlock& record, ManagedBuffer&& buffer) noexcept {
  record.arena = buffer.arena_;
  record.requested_bytes = buffer.requested_bytes_;
  record.block_bytes = buffer.block_bytes_;
  record.size_class = buffer.size_class_;
  record.span = buffer.span_;
  record.stream = std::move(buffer.stream_);
  record.used_on = std::move(buffer.used_on_);
  // The buffer's reference to its cache is the record's now: the buffer ends holding nothing.
  buffer.cache_ = nullptr;
  buffer.ptr_ = nullptr;
}

bool GpuMemoryPool::visit_pointer(const void* ptr, void* context,
                                  void (*visit)(void*, ManagedBuffer&)) {
  if (!ptr) return false;
  return state_->find_if([&](DevicePool& pool) { return pool.visit_parked(ptr, context, visit); }) !=
         nullptr;
}

PointerFree DevicePool::free_pointer_anywhere(void* ptr, void* stream_handle) noexcept {
  ManagedBuffer taken;
  {
    std::lock_guard list_lock(caches_mutex_);
    for (ThreadCache* cache : caches_) {
      std::lock_guard lock(cache->lock);
      ParkedBlock* record = cache->parked.find(ptr);
      if (!record) continue;
      if (!frees_on(*record, stream_handle)) return PointerFree::other_stream;
      taken = buffer_of(*cache, *record);
      cache->parked.erase(*record);
      break;
    }
  }
  // `taken` gives its block back as it goes (take_back), with no lock of this pool held.
  return taken ? PointerFree::freed : PointerFree::not_found;
}

bool DevicePool::visit_parked(const void* ptr, void* context,
                              void (*visit)(void*, ManagedBuffer&)) {
  std::lock_guard list_lock(caches_mutex_);
  for (ThreadCache* cache : caches_) {
    std::lock_guard lock(cache->lock);
    ParkedBlock* record = cache->parked.find(ptr);
    if (!record) continue;
    // The visitor sees the buffer the record stands for; whatever it changed (the streams
    // recorded) goes back into the record, also when it throws.
    struct Repark {
      ParkedBlock& record;
      ManagedBuffer buffer;
      ~Repark() { park(record, std::move(buffer)); }
    } held{*record, buffer_of(*cache, *record)};
    visit(context, held.buffer);
    return true;
  }
  return false;
}

void DevicePool::free_parked_buffers() noexcept {
  std::vector<ManagedBuffer> taken;  // destroyed after the lock below is released
  std::lock_guard list_lock(caches_mutex_);
  std::size_t parked = 0;
  for (ThreadCache* cache : caches_) {
    std::lock_guard lock(cache->lock);
    parked += cache->parked.size();
  }
  if (parked == 0) return;
  try {
    taken.reserve(parked);  // no other handle of the pool exists: nobody parks meanwhile
  } catch (...) {
    return;  // the host is out of memory: leave them parked rather than fail here
  }
  for (ThreadCache* cache : caches_) {
    std::lock_guard lock(cache->lock);
    cache->parked.drain(
        [&](ParkedBlock&& record) { taken.push_back(buffer_of(*cache, record)); });
  }
}  // the lock goes first, then `taken` (declared before it) gives the blocks back

}  // namespace gpupool
