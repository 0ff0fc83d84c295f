// ThreadCache: one thread's private slice of a DevicePool — the blocks it freed last, ready for
// its next allocations, and its share of the pool's counters.
//
// Why: a pool hit must not write memory other threads write. Through the shared bins a hit takes
// a mutex and bumps shared atomics; on 16 threads those cache lines bounce between cores and the
// total throughput falls below one thread's (PyTorch's caching allocator and cudaMallocAsync do
// exactly that: docs/benchmarks.md, "Pool"). Here a hit takes this cache's own lock — owner-biased
// (pool/owner_biased_lock.hpp: plain loads and stores, no atomic read-modify-write), on a line no
// other thread writes — and changes only this cache's counters.
//
// Other threads still reach a cache, rarely, and that is what the lock is for: trim, cleanup and
// emergency cleanup take its blocks back, stats() adds up its counters, and a buffer freed on
// another thread returns to the cache it came from (its counters stay exact that way).
//
// Lifetime: the owning thread's registry (pool/thread_caches.cpp) holds one reference and each
// live buffer (parked ones included) one more; the cache holds its DevicePool. A buffer
// therefore keeps its pool alive with a reference count on a line only its own thread usually
// touches. When the thread exits the cache is detached: its blocks go back to the shared bins,
// later frees bypass it, and its parked buffers stay until they are freed.
module;
#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include "owner_biased_lock.hpp"
module gpupool:thread_cache;
import :precision;
import :size_classes;
import :parked_buffers;

namespace gpupool {

class DevicePool;

// A freed block waiting in a thread cache. Trivial (no member initialisers), so that the arrays
// of them on the free path cost nothing to make.
struct ThreadBlock {
  void* ptr;
  void* stream;  // native handle of the stream it was freed on: reused at once only there
  void* arena;   // the ArenaShard a large block was carved from; null for class blocks
  std::size_t bytes;  // its class's bytes, or for a block carved from a segment its own
  std::uint32_t size_class;
  Precision precision;
  std::uint32_t span;  // a large block's span in its arena (SegmentArena::Block)
};

struct ClassCounters {
  std::uint64_t allocations = 0, frees = 0, hits = 0;
};

// Blocks a put() moved out of a full cache, for the caller to return once the lock is dropped.
struct EvictedBlocks {
  static constexpr int kCapacity = 64;
  std::array<ThreadBlock, kCapacity> blocks;
  int count = 0;
  void push_back(const ThreadBlock& block) noexcept { blocks[count++] = block; }
};

class alignas(64) ThreadCache {  // its lock and counters share no cache line with others' data
 public:
  static constexpr int kSlotsPerClass = 4;
  static constexpr int kEntries = 16;  // classes held at once
  static_assert(EvictedBlocks::kCapacity >= kEntries * kSlotsPerClass);
  // Bytes a cache may hold, beyond one block of any size: small against what a workload keeps
  // live, because a block parked here is memory no other thread reuses without a trim and, when
  // carved from a segment, a hole its free neighbours cannot merge across (on a random 1 B–4 MiB
  // trace a 16 MiB cache raised peak reserved / peak requested by several percent). One block
  // is what a steady alloc/free loop needs.
  static constexpr std::size_t kMaxBytes = std::size_t{4} << 20;
  // Unpublished in-use bytes beyond which the cache publishes them while other caches exist
  // (keeps the pool-wide figure other threads' peaks read within this much per thread).
  static constexpr std::int64_t kPublishBytes = std::int64_t{64} << 20;

  ThreadCache(std::shared_ptr<DevicePool> pool, bool detached)
      : detached(detached),
        counters(std::make_unique<ClassCounters[]>(size_classes::kClassCount)),
        pool_(std::move(pool)) {
    if (detached) lock.disown();  // made at its thread's end: no thread owns it
  }
  ThreadCache(const ThreadCache&) = delete;
  ThreadCache& operator=(const ThreadCache&) = delete;

  inline DevicePool& pool() const noexcept { return *pool_; }

  // A block of `size_class` within `sizes` (blocks carved from segments have their own sizes
  // within the class) freed on `stream`, of the same precision if there is one (a miss reuses the
  // byte class under another precision before it asks the device). Under `lock`.
  struct Sizes { std::size_t least, most; };
  [[gnu::always_inline]] inline std::optional<ThreadBlock> take(std::uint32_t size_class, Sizes sizes,
                                         Precision precision, void* stream) noexcept {
    if (const int e = held_blocks ? find(size_class) : -1; e >= 0) {
      Entry& entry = entries_[e];
      int any = -1;
      for (int i = entry.count - 1; i >= 0; --i) {
        const ThreadBlock& block = entry.blocks[i];
        if (block.stream != stream || block.bytes < sizes.least || block.bytes > sizes.most)
          continue;
        if (block.precision == precision) return remove(e, i);
        if (any < 0) any = i;
      }
      if (any >= 0) return remove(e, any);
    }
    last_missed_class_ = size_class;
    return std::nullopt;
  }

  // Keeps a freed block, first moving the least recently used classes' blocks to `evicted` when
  // the cache is full. False (nothing changed but `evicted`) when the block's class already
  // holds kSlotsPerClass blocks. Under `lock`.
  [[gnu::always_inline]] inline bool put(const ThreadBlock& block, EvictedBlocks& evicted) noexcept {
    const bool full = held_bytes + block.bytes > kMaxBytes && held_blocks;
    // A block carved from a segment does better back there, merged with its free neighbours,
    // than parked here at the cost of other blocks — on a trace of varying large sizes nearly
    // every such free would evict one, and the next request would miss here anyway — unless
    // this thread just asked for its class in vain (a loop of that size: the next request will
    // be the same).
    if (full && block.arena && block.size_class != last_missed_class_) return false;
    int e = find(block.size_class);
    if (e >= 0 && entries_[e].count == kSlotsPerClass) return false;
    if (full) [[unlikely]] make_room(block.bytes, e, evicted);
    if (e < 0) [[unlikely]] e = open_entry(block.size_class, evicted);
    Entry& entry = entries_[e];
    entry.blocks[entry.count++] = block;
    entry.last_use = ++clock_;
    nonempty_ |= 1u << e;
    held_bytes += block.bytes;
    ++held_blocks;
    return true;
  }

  // Empties the cache through `give(block)`; under `lock`.
  template <class F>
  void drain(F&& give) {
    for (int e = 0; e < kEntries; ++e)
      while (entries_[e].count) give(remove(e, entries_[e].count - 1));
  }

  // f(size class, blocks held, the largest one's bytes) for each class with blocks here (stats,
  // reports); under `lock`.
  template <class F>
  void for_each_class(F&& f) const {
    for (int e = 0; e < kEntries; ++e) {
      const Entry& entry = entries_[e];
      std::size_t largest = 0;
      for (int i = 0; i < entry.count; ++i) largest = std::max(largest, entry.blocks[i].bytes);
      if (entry.count) f(classes_[e], entry.count, largest);
    }
  }

  // Taken by the owning thread (the one that made the cache) without an atomic read-modify-write.
  OwnerBiasedLock lock;
  // Everything below is guarded by `lock`.
  bool detached;  // the owning thread is gone: frees bypass the cache
  int references = 0;  // the registry's and one per live buffer; the last one out deletes
  std::unique_ptr<ClassCounters[]> counters;  // per size class
  std::int64_t in_use = 0, requested = 0;     // bytes of live buffers allocated through here
  std::int64_t published_in_use = 0, published_requested = 0;  // the part the pool's totals hold
  std::size_t held_bytes = 0, held_blocks = 0;
  ParkedBuffers parked;  // the live pointer-only allocations made through this cache

 private:
  // A few classes are hot in any one thread: a short list (kEntries) beats a table over all
  // ~560 classes, in memory and in lookup time. Entry e serves class classes_[e] (the classes
  // sit together on one cache line, so a search reads one line) and keeps it while empty, so an
  // allocate/free loop finds the same entry on both paths, the one used last checked first;
  // nonempty_ says which entries hold blocks, so finding an empty one or the coldest reads no
  // entry that has none.
  static constexpr std::uint32_t kNoClass = UINT32_MAX;
  struct Entry {
    int count = 0;
    std::uint64_t last_use = 0;
    std::array<ThreadBlock, kSlotsPerClass> blocks;
  };
  static_assert(kEntries <= 32);

  // The entry of `size_class`, or -1.
  [[gnu::always_inline]] inline int find(std::uint32_t size_class) noexcept {
    if (classes_[recent_] == size_class) [[likely]] return recent_;
    // All entries compared at once, without a branch per entry (the compiler makes it a few
    // vector compares): a workload of varying sizes misses here on nearly every request.
    std::uint32_t matches = 0;
    for (int e = 0; e < kEntries; ++e)
      matches |= static_cast<std::uint32_t>(classes_[e] == size_class) << e;
    if (!matches) return -1;
    return recent_ = std::countr_zero(matches);
  }
  // Moves blocks out (the coldest classes' first) until `bytes` more fit under kMaxBytes.
  [[gnu::noinline]] void make_room(std::size_t bytes, int keep, EvictedBlocks& evicted) noexcept {
    while (held_blocks && held_bytes + bytes > kMaxBytes) evict_coldest(keep, evicted);
  }
  // An entry for a class that has none: an empty one, else the coldest class's, its blocks
  // moved to `evicted`.
  [[gnu::noinline]] int open_entry(std::uint32_t size_class, EvictedBlocks& evicted) noexcept {
    const std::uint32_t empty = ~nonempty_ & ((1u << kEntries) - 1);
    const int chosen = empty ? std::countr_zero(empty) : evict_coldest(-1, evicted);
    classes_[chosen] = size_class;
    return recent_ = chosen;
  }
  // Moves the blocks of the least recently used class other than `keep` to `evicted`; returns
  // the entry emptied.
  int evict_coldest(int keep, EvictedBlocks& evicted) noexcept {
    int coldest = -1;
    for (std::uint32_t bits = nonempty_; bits; bits &= bits - 1) {
      const int e = std::countr_zero(bits);
      if (e != keep && (coldest < 0 || entries_[e].last_use < entries_[coldest].last_use))
        coldest = e;
    }
    if (coldest < 0) {  // only `keep` holds blocks: give one of its own back
      evicted.push_back(remove(keep, 0));
      return keep;
    }
    while (entries_[coldest].count) evicted.push_back(remove(coldest, entries_[coldest].count - 1));
    return coldest;
  }
  inline ThreadBlock remove(int e, int i) noexcept {
    Entry& entry = entries_[e];
    ThreadBlock block = entry.blocks[i];
    entry.blocks[i] = entry.blocks[--entry.count];
    if (entry.count == 0) nonempty_ &= ~(1u << e);
    held_bytes -= block.bytes;
    --held_blocks;
    return block;
  }

  std::shared_ptr<DevicePool> pool_;
  alignas(64) std::array<std::uint32_t, kEntries> classes_ = make_no_classes();
  int recent_ = 0;
  std::uint32_t nonempty_ = 0;
  std::array<Entry, kEntries> entries_{};
  std::uint64_t clock_ = 0;
  std::uint32_t last_missed_class_ = kNoClass;  // the class take() last found nothing for

  static constexpr std::array<std::uint32_t, kEntries> make_no_classes() noexcept {
    std::array<std::uint32_t, kEntries> classes{};
    classes.fill(kNoClass);
    return classes;
  }
};

// The cache the calling thread used last: a hit on the same pool finds it with one comparison
// (DevicePool::thread_cache, pool/allocation_path.cpp). Cleared when the thread lets go of it.
// The default TLS model, not initial-exec: libgpupool_c must load with dlopen into processes
// that have used up glibc's spare static TLS (PyTorch does: "cannot allocate memory in static TLS
// block").
extern constinit thread_local ThreadCache* last_used_cache;

}  // namespace gpupool
