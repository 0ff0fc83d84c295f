// DevicePool's thread caches (pool/thread_cache.cppm): finding this thread's, counting through
// it, and the ways a cache ends — its thread exits (detach) or its last buffer goes (retire).
module;
#include <algorithm>
#include <array>
#include <bit>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>
#include "owner_biased_lock.hpp"  // the thread caches' lock
module gpupool;
import :device_pool;
import :thread_cache;
import :size_classes;

namespace gpupool {

namespace sc = size_classes;

namespace {

// The caches this thread made, one per DevicePool it used; each holds one of its references.
// At thread exit every cache is detached: its blocks go back to the shared bins.
struct ThreadCacheRegistry {
  std::vector<ThreadCache*> caches;
  ~ThreadCacheRegistry();
};
thread_local ThreadCacheRegistry registry;
// A plain thread_local (no destructor, so usable while the registry itself is being destroyed).
thread_local bool registry_gone = false;

ThreadCacheRegistry::~ThreadCacheRegistry() {
  registry_gone = true;
  last_used_cache = nullptr;
  for (ThreadCache* cache : caches) cache->pool().detach_cache(*cache);
}

}  // namespace

constinit thread_local ThreadCache* last_used_cache = nullptr;

// The calling thread's cache of this pool when it is not the one it used last: found in the
// registry, or made.
ThreadCache& DevicePool::find_thread_cache() {
  if (registry_gone) {
    // Thread teardown (a buffer made in another thread_local's destructor): a detached cache of
    // its own, which ends with its last buffer.
    auto* cache = new ThreadCache(shared_from_this(), /*detached=*/true);
    std::lock_guard lock(caches_mutex_);
    add_cache(cache);
    return *cache;
  }
  auto& caches = registry.caches;
  auto found = std::find_if(caches.begin(), caches.end(),
                            [&](ThreadCache* cache) { return &cache->pool() == this; });
  if (found == caches.end()) {
    // The caches of pools whose handles are all gone are only waiting for this thread: let go.
    std::erase_if(caches, [](ThreadCache* cache) {
      if (!cache->pool().orphaned()) return false;
      cache->pool().detach_cache(*cache);
      return true;
    });
    auto* cache = new ThreadCache(shared_from_this(), /*detached=*/false);
    cache->references = 1;  // the registry's
    {
      std::lock_guard lock(caches_mutex_);
      add_cache(cache);
    }
    caches.push_back(cache);
    found = std::prev(caches.end());
  }
  return *(last_used_cache = *found);
}

// Under caches_mutex_. The first cache keeps its bytes to itself (publish); from the second on,
// every cache publishes what passes kPublishBytes, and what the others kept goes out now, before
// the new cache's first peak reads the totals.
void DevicePool::add_cache(ThreadCache* cache) {
  caches_.push_back(cache);
  if (caches_.size() < 2 || several_caches_.load(std::memory_order_relaxed)) return;
  several_caches_.store(true, std::memory_order_relaxed);
  for (ThreadCache* other : caches_) {
    std::lock_guard lock(other->lock);  // its owner sees the flag from its next hold on
    publish_rest(*other);
  }
}

void DevicePool::release_calling_threads_cache() noexcept {
  if (registry_gone) return;
  auto& caches = registry.caches;
  auto found = std::find_if(caches.begin(), caches.end(),
                            [&](ThreadCache* cache) { return &cache->pool() == this; });
  if (found == caches.end()) return;
  ThreadCache* cache = *found;
  caches.erase(found);
  if (last_used_cache == cache) last_used_cache = nullptr;
  detach_cache(*cache);
}

DevicePool::LiveBytes DevicePool::live_bytes() const {
  std::lock_guard list_lock(caches_mutex_);
  const UsageCounters::Bytes published = counters_.published();
  LiveBytes live{published.in_use, published.requested};
  for (ThreadCache* cache : caches_) {
    std::lock_guard lock(cache->lock);
    live.in_use += static_cast<std::size_t>(cache->in_use - cache->published_in_use);
    live.requested += static_cast<std::size_t>(cache->requested - cache->published_requested);
  }
  return live;
}

std::vector<DevicePool::ClassFigures> DevicePool::class_figures() const {
  std::vector<ClassFigures> classes(sc::kClassCount);
  // Under caches_mutex_ no cache retires (folds its counters into the bins) meanwhile: each
  // counter is added exactly once.
  std::lock_guard list_lock(caches_mutex_);
  for (ThreadCache* cache : caches_) {
    std::lock_guard lock(cache->lock);
    for_each_active_class([&](std::uint32_t c) {
      classes[c].counted.allocations += cache->counters[c].allocations;
      classes[c].counted.frees += cache->counters[c].frees;
      classes[c].counted.hits += cache->counters[c].hits;
    });
    cache->for_each_class(
        [&](std::uint32_t c, int blocks, std::size_t) { classes[c].cached_blocks += blocks; });
  }
  for_each_active_class([&](std::uint32_t c) {
    std::lock_guard lock(bins_[c].mutex);
    classes[c].counted.allocations += bins_[c].retired.allocations;
    classes[c].counted.frees += bins_[c].retired.frees;
    classes[c].counted.hits += bins_[c].retired.hits;
    classes[c].cached_blocks += bins_[c].cached_blocks;
  });
  return classes;
}

DevicePool::ClassTotals DevicePool::class_totals() const {
  ClassTotals totals;
  std::array<std::uint64_t, (sc::kClassCount + 63) / 64> cached_in_caches{};
  std::lock_guard list_lock(caches_mutex_);
  for (ThreadCache* cache : caches_) {
    std::lock_guard lock(cache->lock);
    for_each_active_class([&](std::uint32_t c) {
      totals.counted.allocations += cache->counters[c].allocations;
      totals.counted.frees += cache->counters[c].frees;
      totals.counted.hits += cache->counters[c].hits;
    });
    cache->for_each_class([&](std::uint32_t c, int, std::size_t largest) {
      cached_in_caches[c / 64] |= std::uint64_t{1} << (c % 64);
      totals.largest_cached_block = std::max(totals.largest_cached_block, largest);
    });
  }
  for_each_active_class([&](std::uint32_t c) {
    std::lock_guard lock(bins_[c].mutex);
    totals.counted.allocations += bins_[c].retired.allocations;
    totals.counted.frees += bins_[c].retired.frees;
    totals.counted.hits += bins_[c].retired.hits;
    if (bins_[c].cached_blocks || (cached_in_caches[c / 64] >> (c % 64) & 1)) ++totals.cached_classes;
    if (bins_[c].cached_blocks)
      totals.largest_cached_block = std::max(totals.largest_cached_block, sc::class_bytes(c));
  });
  return totals;
}

void DevicePool::release_reference(ThreadCache& cache) noexcept {
  cache.lock.lock();
  const bool last = --cache.references == 0;
  cache.lock.unlock();
  if (last) retire(cache);
}

void DevicePool::detach_cache(ThreadCache& cache) noexcept {
  std::vector<ThreadBlock> blocks;
  cache.lock.disown();  // its thread is leaving it, and another may later have its identity
  cache.lock.lock();
  cache.detached = true;
  cache.drain([&](const ThreadBlock& block) { blocks.push_back(block); });
  cache.lock.unlock();
  for (const ThreadBlock& block : blocks) give_back_shared(block, !orphaned());
  release_reference(cache);
}

// The cache's last reference is gone (no buffer, no thread): its counters join the bins' and
// the totals, and it ends — perhaps taking this pool with it, so nothing may follow.
void DevicePool::retire(ThreadCache& cache) noexcept {
  {
    std::lock_guard list_lock(caches_mutex_);
    std::erase(caches_, &cache);
    if (caches_.size() < 2) several_caches_.store(false, std::memory_order_relaxed);
    counters_.publish(cache.in_use - cache.published_in_use,
                      cache.requested - cache.published_requested);
    for_each_active_class([&](std::uint32_t c) {
      const ClassCounters& counted = cache.counters[c];
      if (!counted.allocations && !counted.frees) return;
      std::lock_guard lock(bins_[c].mutex);
      bins_[c].retired.allocations += counted.allocations;
      bins_[c].retired.frees += counted.frees;
      bins_[c].retired.hits += counted.hits;
    });
  }
  delete &cache;
}

// Every thread cache's blocks back to the bins and arenas (trim, cleanup).
void DevicePool::drain_thread_caches() noexcept {
  std::vector<ThreadBlock> blocks;
  {
    std::lock_guard list_lock(caches_mutex_);
    for (ThreadCache* cache : caches_) {
      std::lock_guard lock(cache->lock);
      cache->drain([&](const ThreadBlock& block) { blocks.push_back(block); });
    }
  }
  for (const ThreadBlock& block : blocks) give_back_shared(block, !orphaned());
}

}  // namespace gpupool
