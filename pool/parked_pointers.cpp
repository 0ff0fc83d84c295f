// Pointer-only allocations beyond the allocating thread: a free or a visit from another thread
// searches every thread cache of the pool, and the pool's last handle frees what is left.
// The fast path (the thread that allocated frees) is in pool/allocation_path.cpp.
module;
#include <atomic>
#include <cstddef>
#include <mutex>
#include <utility>
#include <vector>
module gpupool;
import :device_pool;
import :pool_state;
import :thread_cache;
import :parked_buffers;

namespace gpupool {

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
      ManagedBuffer* buffer = cache->parked.find(ptr);
      if (!buffer) continue;
      if (!frees_on(*buffer, stream_handle)) return PointerFree::other_stream;
      taken = cache->parked.take(*buffer);
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
    if (ManagedBuffer* buffer = cache->parked.find(ptr)) {
      visit(context, *buffer);
      return true;
    }
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
    cache->parked.drain([&](ManagedBuffer&& buffer) { taken.push_back(std::move(buffer)); });
  }
}  // the lock goes first, then `taken` (declared before it) gives the blocks back

}  // namespace gpupool
