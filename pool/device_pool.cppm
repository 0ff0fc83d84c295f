// The data structures of the pool, in one place. Read this first.
//
//   GpuMemoryPool ──shared_ptr──> PoolState (pool/pool_state.cppm)
//                                   ├─ PoolPolicies: config, pressure observers, OOM handlers
//                                   │  (pool/pool_policies.cppm, with the policy layers)
//                                   └─ one DevicePool per device, made on first use
//   ManagedBuffer ──counted──> ThreadCache ──shared_ptr──> DevicePool
//                  (the allocating thread's cache, pool/thread_cache.cppm: so a buffer outliving
//                   the pool returns safely, without a reference count all threads write)
//
//   DevicePool
//     thread caches     one per thread that used the pool: the blocks it freed last and its
//                       counters; a hit or a free touches only the thread's own cache
//     bins_[class]      one SizeClassBin per size class, each with its own mutex:
//                       free lists by precision of CachedBlock {ptr, stream freed on}
//                       (blocks not carved: one device allocation each)
//     arenas            larger blocks: one ArenaShard per (stream, thread shard), each a
//                       SegmentArena (pool/segment_arena.cppm) behind its own mutex; with
//                       virtual segments, its VirtualPages (pool/virtual_pages.cppm) beside it
//     pending_          blocks freed while other streams (record_stream) may still use them,
//                       each with the events to wait for; they join the bins once complete
//     counters          reserved (held from the device): an atomic, changed only on device calls;
//                       in use and requested: each thread cache's own, plus `published` totals
//                       (retired caches, and what live caches published) that peaks read
//
// Locking: a thread cache's lock guards that cache; a bin's mutex only that bin; an arena
// shard's mutex only that shard; pending_mutex_ guards pending_; caches_mutex_ the list of thread
// caches. Order: caches_mutex_ → a cache's lock or a bin's or a shard's mutex; a cache's lock is
// never held while another lock is taken. Observers and handlers are copied out under
// PoolPolicies::mutex and called with no lock held. No lock is held across a device call except a
// bin's or a shard's while that bin or shard gives memory back.
module;
#include "word_lock.hpp"  // the arena shards' lock
#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <map>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <source_location>
#include <vector>
module gpupool:device_pool;
import :error;
import :units;
import :precision;
import :device;
import :buffer;
import :pool;
import :size_classes;
import :segment_arena;
import :virtual_pages;
import :thread_cache;
import :parked_buffers;
import :report;
import :recorder;
import :pool_policies;

namespace gpupool {

class PoolState;  // pool/pool_state.cppm

struct CachedBlock {
  void* ptr;
  void* stream;  // native handle of the stream it was freed on: reused at once only there
};

struct SizeClassBin {
  std::mutex mutex;
  std::array<std::vector<CachedBlock>, kPrecisionCount> free;
  std::size_t cached_blocks = 0;
  std::uint64_t last_use = 0;  // the pool's use counter when blocks last came or went: coldest first
  ClassCounters retired;       // the counters of thread caches that are gone
};

// One stream's large blocks, for the threads that map to this shard (threads spread over shards
// so that they do not all queue on one lock; a shard that runs dry borrows from its siblings).
struct alignas(64) ArenaShard {  // a cache line of its own: neighbouring shards' owners never share one
  WordLock mutex;
  SegmentArena arena;
  // Virtual segments only (pool/virtual_segments.cpp): which of the arena's pages have memory.
  std::unique_ptr<VirtualPages> pages;
};
// Shard 0 is shared; a thread that keeps meeting others there moves to one of the other 15 (the
// GPU machine has 16 cores), so busy threads never share a lock while threads that take turns
// share free space (pool/device_pool.cpp, lock_own_shard).
inline constexpr int kArenaShards = 16;
using StreamArenas = std::array<ArenaShard, kArenaShards>;
// Locks the calling thread's own shard (arenas[its index]), counting the times it was contended.
std::unique_lock<WordLock> lock_own_shard(ArenaShard& shard);

struct PendingBlock {
  CachedBlock block;
  std::size_t bytes;
  std::uint32_t size_class;
  Precision precision;
  ArenaShard* arena;  // large blocks go back to their arena; null for class blocks
  std::uint32_t span;  // and to this span of it
  std::vector<Event> events;  // recorded on each stream the buffer was used on, at free time
};

// The ratios of PoolStats::fragmentation from its byte figures (one device's, or all summed).
inline void derive_fragmentation_ratios(PoolStats& s) noexcept {
  s.fragmentation.internal =
      s.in_use_bytes ? static_cast<double>(s.in_use_bytes - s.requested_bytes) /
                           static_cast<double>(s.in_use_bytes)
                     : 0.0;
  s.fragmentation.external =
      s.cached_bytes ? 1.0 - static_cast<double>(s.fragmentation.largest_cached_block) /
                                 static_cast<double>(s.cached_bytes)
                     : 0.0;
}

// The mechanism; the policies (pool/pool_policies.cppm) reach it as CacheControl.
class DevicePool final : public std::enable_shared_from_this<DevicePool>, private CacheControl {
 public:
  DevicePool(Device device, std::shared_ptr<PoolPolicies> policies, const PoolState* owner);
  ~DevicePool();
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  inline const Device& device() const noexcept { return device_; }
  // The device's default stream, made once (a buffer on it stores no stream of its own).
  inline const Stream& default_stream() const noexcept { return default_stream_; }
  Result<ManagedBuffer> allocate(std::size_t requested_bytes, Precision precision,
                                 const Stream& stream, const std::source_location& where);
  // Takes a buffer's block back (ManagedBuffer's destructor and release()); drops the buffer's
  // reference to its thread cache, which may end the cache and then this pool: the caller must
  // not touch either afterwards.
  void take_back(ManagedBuffer& buffer) noexcept;
  // Pointer-only allocations (GpuMemoryPool::allocate_pointer): the buffer parks in the calling
  // thread's cache (pool/allocation_path.cpp) until a free finds it there, or in another thread's
  // cache (pool/parked_pointers.cpp).
  Result<void*> allocate_pointer(std::size_t requested_bytes, const Stream& stream,
                                 const std::source_location& where);
  PointerFree free_own_pointer(ThreadCache& cache, void* ptr, void* stream_handle) noexcept;
  // This sub-pool belongs to the pool whose handles share `state`.
  inline bool serves(const PoolState& state) const noexcept { return owner_ == &state; }
  PointerFree free_pointer_anywhere(void* ptr, void* stream_handle) noexcept;
  bool visit_parked(const void* ptr, void* context, void (*visit)(void*, ManagedBuffer&));
  // The pool's last handle is going: every buffer still parked is freed.
  void free_parked_buffers() noexcept;
  // The calling thread has exited: `cache` gives its blocks back and drops the thread's reference.
  void detach_cache(ThreadCache& cache) noexcept;
  inline bool orphaned() const noexcept { return orphaned_.load(std::memory_order_acquire); }

  std::size_t trim(std::size_t keep_cached_bytes) override;
  std::size_t cleanup() override;
  std::size_t in_use_bytes() const override { return live_bytes().in_use; }
  // The pool's handles are all gone: give the cache back; later returns go to the device.
  void orphan() noexcept;
  // The calling thread lets go of its cache of this pool now (the thread that orphans the pool:
  // host memory comes back with the pool, not at the thread's next use of some other pool).
  // Other threads' caches go at their next use of a pool or at their exit.
  void release_calling_threads_cache() noexcept;

  PoolStats stats() const;
  // In use, reserved and peak in use: what batching reads per batch, without stats()'s pass over
  // every size class and arena.
  struct Usage { std::size_t in_use, reserved, peak_in_use; };
  Usage usage() const;
  void reset_peaks() noexcept;
  double pressure() const;
  void set_limit(std::optional<std::size_t> bytes) noexcept;
  std::optional<std::size_t> limit() const noexcept;
  void set_max_cached(std::optional<std::size_t> bytes) noexcept;
  Result<void> reserve(std::size_t bytes, std::size_t block_bytes);
  // Lets `accessor` reach this pool's memory: the pages of virtual segments mapped now and every
  // page mapped later (pool/virtual_segments.cpp).
  Result<void> grant_access_to(const Device& accessor);
  std::vector<Device> granted_peers() const;
  // Per size class activity, for memory reports (defined in pool/report.cpp).
  std::vector<SizeClassActivity> class_activity() const;
  // In use, reserved and limit now: three atomic loads (what tracing records after each event).
  PoolFigures figures() const noexcept;

 private:
  // The allocation path (pool/allocation_path.cpp).
  ThreadCache& thread_cache();
  ThreadCache& find_thread_cache();  // pool/thread_caches.cpp
  // A request's size class, its block's bytes, the most bytes a cached block may have and
  // whether the block is carved from a segment; or why it is refused.
  struct Sizing {
    std::uint32_t size_class;
    std::size_t block_bytes, most_bytes;
    bool from_segments;
  };
  Result<Sizing> size_request(std::size_t requested_bytes, Precision precision,
                              const Stream& stream);
  // Under the cache's lock, after a miss there: a block carved from this thread's shard of the
  // default stream's arenas if that shard's lock is free and one of its spans holds the block
  // (with virtual segments: with every page mapped). Never waits, never calls the device (the
  // shared path does, once the cache's lock is gone).
  std::optional<ThreadBlock> take_from_own_shard_now(std::uint32_t size_class,
                                                     std::size_t block_bytes) noexcept;
  Result<ManagedBuffer> allocate_missed(ThreadCache& cache, std::size_t requested_bytes,
                                        std::uint32_t size_class, std::size_t block_bytes,
                                        Precision precision, const Stream& stream,
                                        const std::source_location& where);
  [[gnu::cold]] GpuError refusal(std::size_t requested_bytes, Precision precision,
                                 const Stream& stream) const;
  [[gnu::cold]] Result<std::size_t> room_under_lowered_limit(std::size_t requested_bytes,
                                                             std::size_t block_bytes,
                                                             Precision precision,
                                                             const Stream& stream,
                                                             std::size_t limit);
  void fill(ManagedBuffer& buffer, ThreadCache& cache, const ThreadBlock& block,
            std::size_t requested_bytes, Precision precision, const Stream& stream) noexcept;
  [[gnu::cold]] void record_allocation(const ThreadBlock& block, std::size_t requested_bytes,
                                       Precision precision, const Stream& stream,
                                       const std::source_location& where) noexcept;
  static ThreadBlock block_of(const ManagedBuffer& buffer) noexcept;
  bool keeps_freed_blocks() const noexcept;
  bool cache_freed_block(ThreadCache& cache, const ThreadBlock& block,
                         std::size_t requested_bytes, bool used_on_other_streams,
                         bool keep) noexcept;
  bool drop_reference_if_owner(ThreadCache& cache) noexcept;
  bool give_back_to_shard_now(const ThreadBlock& block) noexcept;
  [[gnu::noinline]] void give_back_slow(ThreadCache& cache, const ThreadBlock& block,
                                        ManagedBuffer* used_on_other_streams, bool keep,
                                        bool reference_dropped) noexcept;
  [[gnu::cold]] void record_free(const ManagedBuffer& buffer, bool keep) noexcept;
  PointerFree free_parked(ThreadCache& cache, ParkedBlock& record, void* stream_handle) noexcept;
  static bool frees_on(const ParkedBlock& record, void* stream_handle) noexcept;
  // A parked record as the buffer it stands for (holding the record's reference to `cache`;
  // the record keeps only its key), and a buffer parked as a record (pool/parked_pointers.cpp).
  static ManagedBuffer buffer_of(ThreadCache& cache, ParkedBlock& record) noexcept;
  static void park(ParkedBlock& record, ManagedBuffer&& buffer) noexcept;
  // Thread caches (pool/thread_caches.cpp).
  void count_allocation(ThreadCache& cache, std::uint32_t size_class, std::size_t block_bytes,
                        std::size_t requested_bytes, bool hit) noexcept;
  void count_free(ThreadCache& cache, std::uint32_t size_class, std::size_t block_bytes,
                  std::size_t requested_bytes) noexcept;
  void publish(ThreadCache& cache) noexcept;
  void publish_rest(ThreadCache& cache) noexcept;  // all of it, under cache.lock
  void add_cache(ThreadCache* cache);              // to caches_, under caches_mutex_
  void release_reference(ThreadCache& cache) noexcept;
  void retire(ThreadCache& cache) noexcept;
  void drain_thread_caches() noexcept;
  struct LiveBytes { std::size_t in_use, requested; };
  LiveBytes live_bytes() const;  // exact: the published totals and every cache's rest
  // Every size class's counters and cached blocks, thread caches and retired caches included
  // (stats, memory reports).
  struct ClassFigures { ClassCounters counted; std::size_t cached_blocks = 0; };
  std::vector<ClassFigures> class_figures() const;
  // The same summed over the classes (stats): counters, classes holding cached blocks and the
  // largest of those.
  struct ClassTotals {
    ClassCounters counted;
    std::size_t cached_classes = 0;
    std::size_t largest_cached_block = 0;
  };
  ClassTotals class_totals() const;
  // Classes that have served an allocation: the only ones with counters or cached blocks, so the
  // only ones class_figures visits (a pool sees tens of its 560 classes).
  void mark_active(std::uint32_t size_class) noexcept;
  // f(size class) for each active class, smallest first.
  template <class F>
  void for_each_active_class(F&& f) const {
    for (std::size_t w = 0; w < active_classes_.size(); ++w)
      for (std::uint64_t bits = active_classes_[w].load(std::memory_order_relaxed); bits;
           bits &= bits - 1)
        f(static_cast<std::uint32_t>(w * 64 + static_cast<std::size_t>(std::countr_zero(bits))));
  }

  // The shared path (pool/device_pool.cpp): the bins and arenas every thread reaches.
  struct Taken { ThreadBlock block; bool hit; };
  Result<Taken> take_shared(std::size_t requested_bytes, std::uint32_t size_class,
                            std::size_t block_bytes, Precision precision, void* stream);
  void give_back_shared(const ThreadBlock& block, bool keep) noexcept;
  std::optional<CachedBlock> take_cached(SizeClassBin& bin, Precision precision, void* stream);
  Result<void*> allocate_from_device(std::size_t block_bytes, std::size_t requested_bytes);
  // The OOM ladder around `attempt` (an allocation from the device that does not trim):
  // cleanup and handlers between retries, the error with the pool's figures at the end.
  template <class Attempt>
  Result<void*> through_oom_ladder(std::size_t requested_bytes, Attempt&& attempt) {
    auto result = attempt();
    if (result || result.error().kind() != ErrorKind::OutOfMemory) {
      if (!result && result.error().is_out_of_memory()) counters_.count_out_of_memory();
      return result;
    }
    return climb_oom_ladder(requested_bytes, std::move(result.error()),
                            std::function<Result<void*>()>(attempt));
  }
  Result<void*> climb_oom_ladder(std::size_t requested_bytes, GpuError first_error,
                                 const std::function<Result<void*>()>& attempt);
  // The one way to the device's memory: the hard limit admits the bytes (trimming cached memory
  // to make room when `may_trim`), the device allocates, the reservation is counted and the
  // pressure watched.
  Result<void*> reserve_from_device(std::size_t block_bytes, std::size_t requested_bytes,
                                    bool may_trim = true);
  // Large blocks (pool/segment_arena.cppm).
  std::optional<SegmentArena::Segment> adopt_free_segment(StreamArenas& arenas, ArenaShard& own,
                                                          std::size_t block_bytes);
  Result<Taken> take_from_arenas(StreamArenas& arenas, ArenaShard& own, std::uint32_t size_class,
                                 std::size_t block_bytes, std::size_t requested_bytes);
  std::size_t segment_bytes_for(std::size_t block_bytes) const;
  std::size_t device_free_estimate() const;
  StreamArenas& arenas_of(void* stream);
  std::size_t release_free_segments(ArenaShard& shard, std::size_t enough);
  // Virtual segments (pool/virtual_segments.cpp).
  Result<Taken> take_from_virtual_arena(ArenaShard& shard, std::uint32_t size_class,
                                        std::size_t block_bytes, std::size_t requested_bytes);
  // The reserved bytes past which a block moves free pages rather than map new ones
  // (PoolConfig::virtual_page_slack): `limit` = (1 + slack) x the most bytes in use, or the most
  // the pool has reserved where that is more. Read from the peak alone (`exact` false: atomics
  // only, under a shard's lock) it misses the block's own bytes; exact, it counts them and what
  // is in use now, and `floor` (the most in use) says where a move brings reserved bytes back to.
  struct PageBudget {
    std::size_t limit = SIZE_MAX;
    std::size_t floor = SIZE_MAX;
    bool exact = false;
  };
  PageBudget page_budget(std::size_t block_bytes, bool exact) const;
  Result<void*> try_take_virtual(ArenaShard& shard, std::size_t block_bytes,
                                 std::size_t requested_bytes, std::uint32_t& span, bool& hit,
                                 std::optional<double>& pressure_before, const PageBudget& budget);
  Result<void> reserve_virtual_range(ArenaShard& shard, std::size_t block_bytes);
  std::vector<PhysicalPage> move_free_pages(ArenaShard& shard, std::size_t wanted,
                                            std::size_t excess_bytes);
  Result<void> back_with_pages(ArenaShard& shard, std::uintptr_t address, std::size_t bytes,
                               std::size_t requested_bytes, bool& hit,
                               std::optional<double>& pressure_before,
                               std::vector<PhysicalPage> moved);
  Result<PhysicalPage> create_page_within_limit(std::size_t requested_bytes);
  void release_page(PhysicalPage page) noexcept;
  std::size_t release_free_pages(ArenaShard& shard, std::size_t enough);
  void give_back_large(ArenaShard& shard, std::uint32_t span, bool keep) noexcept;
  // The bytes a request of `requested_bytes` in `size_class` takes: its class's, or where it is
  // carved from a segment, itself rounded to the alignment.
  // Blocks of a class are interchangeable in bins and caches, so they hold the class's bytes; a
  // block carved from a segment holds only what was asked for (rounded to the alignment) — on
  // PyTorch's training loops class rounding alone added 1.4–2% to the peak in use.
  inline std::size_t block_bytes_for(std::size_t requested_bytes,
                                     std::uint32_t size_class) const noexcept {
    if (!class_carves_from_segments(size_class)) return size_classes::class_bytes(size_class);
    return (requested_bytes + size_classes::kAlignment - 1) / size_classes::kAlignment *
           size_classes::kAlignment;
  }
  // Whether blocks of the class are carved from segments (above kArenaThreshold, or
  // kVirtualArenaThreshold with virtual segments).
  inline bool class_carves_from_segments(std::uint32_t size_class) const noexcept {
    return carves_large_blocks_ && size_class > last_class_of_its_own_;
  }
  static_assert(size_classes::class_bytes(size_classes::class_of(size_classes::kArenaThreshold)) ==
                size_classes::kArenaThreshold);
  static_assert(size_classes::class_bytes(size_classes::class_of(
                    size_classes::kVirtualArenaThreshold)) == size_classes::kVirtualArenaThreshold);
  template <class F>
  void for_each_arena(F&& f) const;
  GpuError limit_exceeded(std::size_t requested_bytes, std::size_t block_bytes) const;
  GpuError out_of_memory_error(const GpuError& cause, std::size_t requested_bytes) const;
  void cache_block(std::uint32_t size_class, Precision precision, CachedBlock block) noexcept;
  std::size_t trim_shared(std::size_t keep_cached_bytes);
  void free_to_device(void* ptr, std::size_t bytes) noexcept;
  void collect_completed_pending(bool wait);
  bool park_until_streams_done(ManagedBuffer& buffer) noexcept;
  void after_reservation_growth(double pressure_before);
  std::size_t effective_limit() const;
  std::size_t cached_bytes() const noexcept;
  std::uint64_t tick() noexcept { return use_counter_.fetch_add(1, std::memory_order_relaxed); }

  Device device_;
  std::shared_ptr<PoolPolicies> policies_;
  const PoolState* owner_ = nullptr;  // the state of the GpuMemoryPool handles it serves
  std::unique_ptr<SizeClassBin[]> bins_;
  std::mutex pending_mutex_;
  std::vector<PendingBlock> pending_;
  std::atomic<bool> has_pending_{false};
  std::atomic<bool> orphaned_{false};
  Stream default_stream_;
  // The policies over this mechanism, and what they count (pool/pool_policies.cppm).
  Reservations reservations_;
  HardLimit limit_;
  SoftCap soft_cap_;
  AutomaticTrims automatic_trims_;
  PressureWatch pressure_watch_;
  OomLadder oom_ladder_;
  UsageCounters counters_;
  // The other devices granted the pages this pool maps (grant_access_to).
  mutable std::mutex peers_mutex_;
  std::vector<Device> peers_;
  std::atomic<std::uint64_t> use_counter_{0};
  // Whether more than one thread cache exists: only then do the caches publish their bytes (one
  // cache's peaks read its own rest; a second cache publishes every other's rest when it comes).
  std::atomic<bool> several_caches_{false};
  std::array<std::atomic<std::uint64_t>, (size_classes::kClassCount + 63) / 64> active_classes_{};
  // Blocks above 4 KiB from virtual segments (PoolConfig::virtual_segments, where the device has
  // virtual memory); the page they map and unmap.
  bool virtual_segments_ = false;
  std::size_t page_bytes_ = 0;
  // 1 + PoolConfig::virtual_page_slack, or 0 where pages move only under a limit.
  double page_budget_factor_ =
      policies_->config.virtual_page_slack
          ? 1.0 + std::max(0.0, *policies_->config.virtual_page_slack)
          : 0.0;
  bool carves_large_blocks_ = false;  // caching with segments: larger classes are carved
  // The last class whose blocks are not carved: kArenaThreshold's, or kVirtualArenaThreshold's
  // with virtual segments (pool/size_classes.cppm).
  std::uint32_t last_class_of_its_own_ = 0;
  bool caches_blocks_ = false;           // PoolConfig::caching
  bool frees_to_thread_caches_ = false;  // PoolConfig::thread_caches
  // Mutable: reading figures (stats) takes the shards' locks.
  mutable StreamArenas default_stream_arenas_;
  mutable std::mutex stream_arenas_mutex_;  // guards the map, not the arenas
  std::map<void*, std::unique_ptr<StreamArenas>> stream_arenas_;
  mutable std::mutex caches_mutex_;        // guards the list, not the caches
  mutable std::atomic<std::size_t> free_estimate_{0}, reserved_at_check_{0};  // device_free_estimate()'s
  mutable std::atomic<std::int64_t> free_checked_at_ns_{INT64_MIN / 2};
  std::vector<ThreadCache*> caches_;
};

}  // namespace gpupool
