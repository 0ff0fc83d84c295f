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
// Plain thread_locals (no destructor, so usable while the registry itself is being destroyed).
thread_local ThreadCache* last_used = nullptr;
thread_local bool registry_gone = false;

ThreadCacheRegistry::~ThreadCacheRegistry() {
  registry_gone = true;
  last_used = nullptr;
  for (ThreadCache* cache : caches) cache->pool().detach_cache(*cache);
}

}  // namespace

ThreadCache& DevicePool::thread_cache() {
  if (last_used && &last_used->pool() == this) return *last_used;
  if (registry_gone) {
    // Thread teardown (a buffer made in another thread_local's destructor): a detached cache of
    // its own, which ends with its last buffer.
    auto* cache = new ThreadCache(shared_from_this(), /*detached=*/true);
    std::lock_guard lock(caches_mutex_);
    caches_.push_back(cache);
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
      caches_.push_back(cache);
    }
    caches.push_back(cache);
    found = std::prev(caches.end());
  }
  return *(last_used = *found);
}

void DevicePool::release_calling_threads_cache() noexcept {
  if (registry_gone) return;
  auto& caches = registry.caches;
  auto found = std::find_if(caches.begin(), caches.end(),
                            [&](ThreadCache* cache) { return &cache->pool() == this; });
  if (found == caches.end()) return;
  ThreadCache* cache = *found;
  caches.erase(found);
  if (last_used == cache) last_used = nullptr;
  detach_cache(*cache);
}

void DevicePool::mark_active(std::uint32_t size_class) noexcept {
  std::atomic<std::uint64_t>& word = active_classes_[size_class / 64];
  const std::uint64_t bit = std::uint64_t{1} << (size_class % 64);
  // Set once per class: later allocations only read the word.
  if (!(word.load(std::memory_order_relaxed) & bit)) word.fetch_or(bit, std::memory_order_relaxed);
}

// Under cache.lock. Peaks read the pool-wide published figure plus this cache's unpublished
// rest: exact when one thread uses the pool, within kPublishBytes per other thread otherwise.
void DevicePool::count_allocation(ThreadCache& cache, std::uint32_t size_class,
                                  std::size_t block_bytes, std::size_t requested_bytes,
                                  bool hit) noexcept {
  ClassCounters& counted = cache.counters[size_class];
  if (counted.allocations == 0) mark_active(size_class);
  ++counted.allocations;
  counted.hits += hit ? 1 : 0;
  cache.in_use += static_cast<std::int64_t>(block_bytes);
  cache.requested += static_cast<std::int64_t>(requested_bytes);
  ++cache.references;  // the buffer's
  publish(cache);
  raise_peak(peak_in_use_, in_use_.load(std::memory_order_relaxed) +
                               static_cast<std::size_t>(cache.in_use - cache.published_in_use));
  raise_peak(peak_requested_,
             requested_.load(std::memory_order_relaxed) +
                 static_cast<std::size_t>(cache.requested - cache.published_requested));
}

// Under cache.lock.
void DevicePool::count_free(ThreadCache& cache, std::uint32_t size_class, std::size_t block_bytes,
                            std::size_t requested_bytes) noexcept {
  ++cache.counters[size_class].frees;
  cache.in_use -= static_cast<std::int64_t>(block_bytes);
  cache.requested -= static_cast<std::int64_t>(requested_bytes);
  publish(cache);
  const std::size_t in_use = in_use_.load(std::memory_order_relaxed) +
                             static_cast<std::size_t>(cache.in_use - cache.published_in_use);
  const std::size_t reserved = reserved_.load(std::memory_order_relaxed);
  raise_peak(peak_cached_, reserved > in_use ? reserved - in_use : 0);
}

// Moves the cache's unpublished bytes into the pool-wide totals once they pass kPublishBytes.
void DevicePool::publish(ThreadCache& cache) noexcept {
  const std::int64_t in_use = cache.in_use - cache.published_in_use;
  const std::int64_t requested = cache.requested - cache.published_requested;
  if (std::max(std::abs(in_use), std::abs(requested)) < ThreadCache::kPublishBytes) return;
  in_use_.fetch_add(static_cast<std::size_t>(in_use), std::memory_order_relaxed);
  requested_.fetch_add(static_cast<std::size_t>(requested), std::memory_order_relaxed);
  cache.published_in_use = cache.in_use;
  cache.published_requested = cache.requested;
}

DevicePool::LiveBytes DevicePool::live_bytes() const {
  std::lock_guard list_lock(caches_mutex_);
  LiveBytes live{in_use_.load(), requested_.load()};
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
    in_use_.fetch_add(static_cast<std::size_t>(cache.in_use - cache.published_in_use));
    requested_.fetch_add(static_cast<std::size_t>(cache.requested - cache.published_requested));
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
