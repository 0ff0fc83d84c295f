// DevicePool: one device's share of a GpuMemoryPool — the shared path below a thread's cache
// (pool/allocation_path.cpp). A miss reads top to bottom: take_shared() → take_cached() (a bin)
// or take_from_arenas() (segments) → allocate_from_device() (the OOM ladder) →
// reserve_from_device() (the hard limit, the device, the pressure: the policies of
// pool/pool_policies.cppm). A free: give_back_shared() → cache_block() or give_back_large().
module;
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <fmt/format.h>
#include <functional>
#include <map>
#include <set>
#include <tuple>
#include <memory>
#include <mutex>
#include "word_lock.hpp"  // the arena shards' lock
#include <optional>
#include <source_location>
#include <utility>
#include <unordered_map>
#include <vector>
module gpupool;
import :device_pool;
import :size_classes;
import :recorder;

namespace gpupool {

namespace sc = size_classes;

DevicePool::DevicePool(Device device, std::shared_ptr<PoolPolicies> policies,
                       const PoolState* owner)
    : device_(std::move(device)),
      policies_(std::move(policies)),
      owner_(owner),
      bins_(std::make_unique<SizeClassBin[]>(sc::kClassCount)),
      default_stream_(device_.default_stream()),
      limit_(policies_->config.max_pool_size.value_or(0)),
      soft_cap_(policies_->config.max_cached_bytes.value_or(SIZE_MAX)),
      virtual_segments_(policies_->config.virtual_segments && policies_->config.caching &&
                        policies_->config.segments && device_.page_bytes() > 0),
      page_bytes_(device_.page_bytes()),
      carves_large_blocks_(policies_->config.caching && policies_->config.segments),
      last_class_of_its_own_(sc::class_of(virtual_segments_ ? sc::kVirtualArenaThreshold
                                                            : sc::kArenaThreshold)),
      caches_blocks_(policies_->config.caching),
      frees_to_thread_caches_(policies_->config.thread_caches) {}

DevicePool::~DevicePool() {
  collect_completed_pending(/*wait=*/true);
  trim(0);
  // A trim stops once the cache is empty; the address ranges of virtual segments go too.
  if (virtual_segments_) for_each_arena([&](ArenaShard& shard) { release_free_pages(shard, SIZE_MAX); });
}

namespace {
constexpr std::size_t kSegmentBytes = std::size_t{32} << 20;
constexpr std::size_t kSegmentGranule = std::size_t{2} << 20;

// Private shards are handed out lowest-free-first and given back when their threads exit, so that
// a pool of worker threads started again (or a benchmark's next run) finds its shards — and the
// memory carved in them — where the threads before it left them. Shard 0 of every stream is the
// one threads share: beyond kArenaShards - 1 threads with shards of their own, the others stay
// there. (Sending them to share private shards instead left shard 0 empty and two threads on one
// lock: 16 threads on an H200's 16 cores ran 3-4x slower than 15.)
class ShardSlots {
 public:
  // A private shard, or nullopt when all are taken.
  std::optional<unsigned> acquire() {
    std::lock_guard lock(mutex_);
    for (unsigned i = 1; i < kArenaShards; ++i)
      if (!(used_ & (1u << i))) {
        used_ |= 1u << i;
        return i;
      }
    return std::nullopt;
  }
  void release(unsigned shard) {
    std::lock_guard lock(mutex_);
    used_ &= ~(1u << shard);
  }

 private:
  std::mutex mutex_;
  std::uint32_t used_ = 0;
};
static_assert(kArenaShards <= 32);

ShardSlots& shard_slots() {
  static auto* slots = new ShardSlots;  // never destroyed: threads may exit after static destruction
  return *slots;
}

// A thread's place among the shards: the shared shard 0 until it has met other threads there
// kContentionsBeforeOwnShard times, then one of its own. Plain thread_locals, read on every
// large request without an initialisation check; the slot of a private shard goes back when the
// thread exits (ShardRelease, made when the thread takes one).
constexpr unsigned kContentionsBeforeOwnShard = 8;
constinit thread_local unsigned this_thread_shard = 0;  // 0: the shared shard; else this thread's alone
constinit thread_local unsigned this_thread_contentions = 0;
struct ShardRelease {
  ~ShardRelease() {
    if (this_thread_shard != 0) shard_slots().release(this_thread_shard);
    this_thread_shard = 0;
  }
};
thread_local ShardRelease shard_release;
}  // namespace

// Threads share a stream's first shard while they take turns — PyTorch's main and autograd
// threads — so that memory one frees serves the other's next block (a shard per thread raised
// ResNet-50's peak reserved under PyTorch by 16% on an H200). A thread that keeps finding the
// shard locked by others moves to a shard of its own, where it never waits for them.
std::unique_lock<WordLock> lock_own_shard(ArenaShard& shard) {
  std::unique_lock lock(shard.mutex, std::try_to_lock);
  if (lock.owns_lock()) return lock;
  if (this_thread_shard == 0 && ++this_thread_contentions >= kContentionsBeforeOwnShard) {
    (void)&shard_release;  // made now, so that the thread's exit gives the slot back
    this_thread_shard = shard_slots().acquire().value_or(0);
    this_thread_contentions = 0;  // none free: ask again after as many more
  }
  lock.lock();
  return lock;
}

// ---- the shared path ------------------------------------------------------------------------

// The shared path: the class's bin (blocks that are not carved) or the stream's arenas, else the device
// through the OOM ladder.
Result<DevicePool::Taken> DevicePool::take_shared(std::size_t requested_bytes,
                                                  std::uint32_t size_class, std::size_t block_bytes,
                                                  Precision precision, void* stream) {
  if (class_carves_from_segments(size_class)) {
    StreamArenas& arenas = arenas_of(stream);
    ArenaShard& own = arenas[this_thread_shard];
    if (virtual_segments_)
      return take_from_virtual_arena(own, size_class, block_bytes, requested_bytes);
    return take_from_arenas(arenas, own, size_class, block_bytes, requested_bytes);
  }
  SizeClassBin& bin = bins_[size_class];
  {
    std::lock_guard lock(bin.mutex);
    if (auto cached = take_cached(bin, precision, stream)) {
      bin.last_use = tick();
      return Taken{{cached->ptr, stream, nullptr, block_bytes, size_class, precision, 0}, true};
    }
  }
  if (has_pending_.load(std::memory_order_acquire)) collect_completed_pending(false);
  auto fresh = allocate_from_device(block_bytes, requested_bytes);
  if (!fresh) return std::unexpected(fresh.error());
  return Taken{{*fresh, stream, nullptr, block_bytes, size_class, precision, 0}, false};
}

// ---- large blocks: carved from segments -------------------------------------------------------

// Own shard first (one lock), then the sibling shards, then a new segment.
Result<DevicePool::Taken> DevicePool::take_from_arenas(StreamArenas& arenas, ArenaShard& own,
                                                       std::uint32_t size_class,
                                                       std::size_t block_bytes,
                                                       std::size_t requested_bytes) {
  auto try_shard = [&](ArenaShard& shard) -> std::optional<Taken> {
    std::unique_lock lock = &shard == &own ? lock_own_shard(shard) : std::unique_lock(shard.mutex);
    auto block = shard.arena.take(block_bytes);
    if (!block) return std::nullopt;
    return Taken{{block->ptr, nullptr, &shard, block_bytes, size_class, Precision::Bytes, block->span},
                 true};
  };
  if (auto taken = try_shard(own)) return *taken;
  if (has_pending_.load(std::memory_order_acquire)) collect_completed_pending(false);
  // Sibling shards are other threads' working memory: raiding them makes every later free of
  // the block take that thread's lock (on a 2-thread trace that halved the total throughput).
  // So while memory is plentiful (a full segment fits) this shard grows instead; near the limit
  // of the device or the pool, siblings' free space comes first.
  std::size_t segment = segment_bytes_for(block_bytes);
  if (segment < kSegmentBytes || segment == block_bytes)
    for (ArenaShard& shard : arenas)
      if (&shard != &own)
        if (auto taken = try_shard(shard)) return *taken;
  // A whole free segment of a sibling moves here without a device call: no block of it is
  // live, so no later free of the sibling's takes this shard's lock, or this one's the sibling's.
  // The block from a segment that joins this shard (adopted: a hit; from the device: not).
  auto carve_from = [&](void* base, std::size_t bytes, bool hit) {
    std::lock_guard lock(own.mutex);
    own.arena.add_segment(base, bytes);
    const SegmentArena::Block block = *own.arena.take(block_bytes);  // the segment holds it
    return Taken{{block.ptr, nullptr, &own, block_bytes, size_class, Precision::Bytes, block.span},
                 hit};
  };
  if (auto moved = adopt_free_segment(arenas, own, block_bytes))
    return carve_from(moved->base, moved->bytes, true);
  // A miss. Fully free segments of this shard are too small for the block: give them back
  // before asking for more, so reserved memory does not pile up.
  release_free_segments(own, SIZE_MAX);
  Result<void*> base = std::unexpected(GpuError(ErrorKind::OutOfMemory, "", device_.id()));
  if (segment > block_bytes) base = reserve_from_device(segment, requested_bytes, false);
  if (!base) {  // no room for a whole segment: exactly the block, through the OOM ladder
    segment = block_bytes;
    base = allocate_from_device(block_bytes, requested_bytes);
  }
  if (!base) return std::unexpected(base.error());
  return carve_from(*base, segment, false);
}

// A fully free segment of at least `block_bytes` taken out of a sibling shard, for `own` to add.
// Waiting for a sibling's lock (held for one arena step) costs less than a device call.
std::optional<SegmentArena::Segment> DevicePool::adopt_free_segment(StreamArenas& arenas,
                                                                   ArenaShard& own,
                                                                   std::size_t block_bytes) {
  for (ArenaShard& shard : arenas) {
    if (&shard == &own) continue;
    std::lock_guard lock(shard.mutex);
    if (auto segment = shard.arena.remove_free_segment(block_bytes)) return segment;
  }
  return std::nullopt;
}

std::optional<ThreadBlock> DevicePool::take_from_own_shard_now(std::uint32_t size_class,
                                                               std::size_t block_bytes) noexcept {
  ArenaShard& own = default_stream_arenas_[this_thread_shard];
  std::unique_lock lock(own.mutex, std::try_to_lock);
  if (!lock.owns_lock()) return std::nullopt;  // the shared path counts the contention
  if (virtual_segments_ && !own.pages) return std::nullopt;
  const std::optional<SegmentArena::Block> block = own.arena.take(block_bytes);
  if (!block) return std::nullopt;
  // A virtual segment's block whose pages are not all mapped needs device calls: the shared path
  // maps them (this one never waits on the device).
  if (virtual_segments_ &&
      !own.pages->all_mapped(reinterpret_cast<std::uintptr_t>(block->ptr), block_bytes)) {
    own.arena.give_back(block->span);
    return std::nullopt;
  }
  return ThreadBlock{block->ptr, nullptr, &own, block_bytes, size_class, Precision::Bytes,
                     block->span};
}

// Segments of 32 MiB while memory is plentiful; smaller (down to the block itself) as the
// device or the hard limit gets full, so one segment never takes the last free memory.
std::size_t DevicePool::segment_bytes_for(std::size_t block_bytes) const {
  if (block_bytes >= kSegmentBytes) return block_bytes;
  std::size_t headroom = device_free_estimate();
  if (std::size_t limit = limit_.bytes()) {
    std::size_t reserved = reservations_.reserved();
    headroom = std::min(headroom, limit > reserved ? limit - reserved : 0);
  }
  std::size_t segment = std::min(kSegmentBytes, headroom / 8) / kSegmentGranule * kSegmentGranule;
  return std::max(segment, block_bytes);
}

// The device's free memory, at most 1 ms old. Segment sizing reads it on every shard miss, and
// cudaMemGetInfo takes the driver's lock (~11 µs): 16 threads missing at once queued on it. A
// stale figure only picks a segment size; the allocation itself still checks the device.
std::size_t DevicePool::device_free_estimate() const {
  constexpr std::int64_t kMaxAgeNs = 1'000'000;
  const std::int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                               std::chrono::steady_clock::now().time_since_epoch()).count();
  if (now - free_checked_at_ns_.load(std::memory_order_acquire) < kMaxAgeNs) {
    // Less what this pool has taken since (what others took shows at the next check).
    const std::size_t free = free_estimate_.load(std::memory_order_relaxed);
    const std::size_t reserved = reservations_.reserved(), then = reserved_at_check_.load();
    const std::size_t taken = reserved > then ? reserved - then : 0;
    return free > taken ? free - taken : 0;
  }
  auto memory = device_.memory_info();
  const std::size_t free = memory ? memory->free : 0;
  free_estimate_.store(free, std::memory_order_relaxed);
  reserved_at_check_.store(reservations_.reserved());
  free_checked_at_ns_.store(now, std::memory_order_release);
  return free;
}

StreamArenas& DevicePool::arenas_of(void* stream) {
  if (!stream) return default_stream_arenas_;
  std::lock_guard lock(stream_arenas_mutex_);
  auto& arenas = stream_arenas_[stream];
  if (!arenas) arenas = std::make_unique<StreamArenas>();
  return *arenas;
}

template <class F>
void DevicePool::for_each_arena(F&& f) const {
  for (ArenaShard& shard : default_stream_arenas_) f(shard);
  std::vector<StreamArenas*> others;
  {
    std::lock_guard lock(stream_arenas_mutex_);
    for (auto& [stream, arenas] : stream_arenas_) others.push_back(arenas.get());
  }
  for (StreamArenas* arenas : others)
    for (ArenaShard& shard : *arenas) f(shard);
}

// ---- peers ------------------------------------------------------------------------------------

std::vector<Device> DevicePool::granted_peers() const {
  std::lock_guard lock(peers_mutex_);
  return peers_;
}

// The peer joins the list before the shards are visited: a page mapped meanwhile is mapped under
// its shard's lock, so either that mapping saw the peer or this visit sees the page.
Result<void> DevicePool::grant_access_to(const Device& accessor) {
  {
    std::lock_guard lock(peers_mutex_);
    if (std::none_of(peers_.begin(), peers_.end(),
                     [&](const Device& d) { return d.id() == accessor.id(); }))
      peers_.push_back(accessor);
  }
  if (!virtual_segments_) return {};  // ordinary allocations: the device's peer access suffices
  Result<void> result;
  for_each_arena([&](ArenaShard& shard) {
    std::lock_guard lock(shard.mutex);
    if (!shard.pages || !result) return;
    shard.pages->for_each_mapped_run([&](std::uintptr_t address, std::size_t bytes) {
      if (result) result = device_.grant_access(reinterpret_cast<void*>(address), bytes, accessor);
    });
  });
  return result;
}

std::size_t DevicePool::release_free_segments(ArenaShard& shard, std::size_t enough) {
  if (virtual_segments_) return release_free_pages(shard, enough);
  std::vector<SegmentArena::Segment> segments;
  {
    std::lock_guard lock(shard.mutex);
    segments = shard.arena.remove_free_segments(enough);
  }
  std::size_t released = 0;
  for (const auto& segment : segments) {
    free_to_device(segment.base, segment.bytes);
    released += segment.bytes;
    counters_.count_trim();
  }
  return released;
}

void DevicePool::give_back_large(ArenaShard& shard, std::uint32_t span, bool keep) noexcept {
  {
    std::lock_guard lock(shard.mutex);
    shard.arena.give_back(span);
  }
  if (!keep) release_free_segments(shard, SIZE_MAX);
}

// Same precision first, then the same byte class cached under another precision; in both cases
// only blocks last freed on this stream, which are safe to reuse at once in stream order.
std::optional<CachedBlock> DevicePool::take_cached(SizeClassBin& bin, Precision precision,
                                                   void* stream) {
  if (bin.cached_blocks == 0) return std::nullopt;
  auto take_from = [&](std::vector<CachedBlock>& list) -> std::optional<CachedBlock> {
    for (auto it = list.rbegin(); it != list.rend(); ++it) {
      if (it->stream != stream) continue;
      CachedBlock block = *it;
      list.erase(std::next(it).base());
      --bin.cached_blocks;
      return block;
    }
    return std::nullopt;
  };
  if (auto block = take_from(bin.free[static_cast<int>(precision)])) return block;
  for (int p = 0; p < kPrecisionCount; ++p)
    if (p != static_cast<int>(precision))
      if (auto block = take_from(bin.free[p])) return block;
  return std::nullopt;
}

// The OOM ladder (OomLadder, pool/pool_policies.cppm) around the one way to the device.
Result<void*> DevicePool::allocate_from_device(std::size_t block_bytes,
                                               std::size_t requested_bytes) {
  return through_oom_ladder(requested_bytes, [&] {
    return reserve_from_device(block_bytes, requested_bytes);
  });
}

Result<void*> DevicePool::climb_oom_ladder(std::size_t requested_bytes, GpuError first_error,
                                           const std::function<Result<void*>()>& attempt) {
  Result<void*> result = oom_ladder_.climb(requested_bytes, std::move(first_error), attempt,
                                           *policies_, device_.id(), *this);
  if (!result) {
    counters_.count_out_of_memory();
    if (result.error().kind() == ErrorKind::OutOfMemory)
      return std::unexpected(out_of_memory_error(result.error(), requested_bytes));
  }
  return result;
}

Result<void*> DevicePool::reserve_from_device(std::size_t block_bytes,
                                              std::size_t requested_bytes, bool may_trim) {
  const double pressure_before = pressure();
  if (auto admitted = limit_.admit(block_bytes, requested_bytes, may_trim, reservations_, *this,
                                   device_.id());
      !admitted)
    return std::unexpected(admitted.error());
  auto ptr = device_.allocate(block_bytes);
  if (!ptr) {
    reservations_.cancel(block_bytes);
    return ptr;
  }
  reservations_.allocated();
  after_reservation_growth(pressure_before);
  return ptr;
}

GpuError DevicePool::limit_exceeded(std::size_t requested_bytes, std::size_t block_bytes) const {
  const std::size_t in_use = live_bytes().in_use;
  return limit_.exceeded_error(requested_bytes, block_bytes, in_use, reservations_.cached(in_use),
                               device_.id());
}

GpuError DevicePool::out_of_memory_error(const GpuError& cause, std::size_t requested_bytes) const {
  auto memory = device_.memory_info();
  const std::size_t largest = stats().fragmentation.largest_cached_block;
  const std::size_t limit = limit_.bytes();
  return GpuError(
      ErrorKind::OutOfMemory,
      fmt::format("requested {}; pool in use {}, cached {}, limit {}; device free {} of {}; "
                  "largest cached block {} (device said: {})",
                  format_bytes(requested_bytes), format_bytes(live_bytes().in_use),
                  format_bytes(cached_bytes()), limit ? format_bytes(limit) : "none",
                  memory ? format_bytes(memory->free) : "unknown",
                  memory ? format_bytes(memory->total) : "unknown", format_bytes(largest),
                  cause.message()),
      device_.id(), cause.native_status());
}

// ---- freeing ----------------------------------------------------------------------------------

// A block to its arena (large) or its bin (class blocks), or to the device when not kept.
void DevicePool::give_back_shared(const ThreadBlock& block, bool keep) noexcept {
  if (block.arena) {
    give_back_large(*static_cast<ArenaShard*>(block.arena), block.span, keep);
  } else if (keep) {
    cache_block(block.size_class, block.precision, {block.ptr, block.stream});
  } else {
    free_to_device(block.ptr, block.bytes);
  }
}

// Records an event on every stream the buffer was declared on and parks the block until they
// complete. False if an event could not be made: then it has waited for those streams instead.
bool DevicePool::park_until_streams_done(ManagedBuffer& buffer) noexcept {
  PendingBlock pending{{buffer.ptr_, buffer.stream_.native()}, buffer.block_bytes_,
                       buffer.size_class_, buffer.precision_, static_cast<ArenaShard*>(buffer.arena_),
                       buffer.span_, {}};
  for (const Stream& other : *buffer.used_on_) {
    auto event = device_.create_event();
    if (!event || !event->record(other)) {
      for (const Stream& s : *buffer.used_on_) (void)s.synchronize();
      return false;
    }
    pending.events.push_back(std::move(*event));
  }
  std::lock_guard lock(pending_mutex_);
  pending_.push_back(std::move(pending));
  has_pending_.store(true, std::memory_order_release);
  return true;
}

void DevicePool::cache_block(std::uint32_t size_class, Precision precision,
                             CachedBlock block) noexcept {
  mark_active(size_class);  // blocks come from allocations, but the figures must not miss one
  SizeClassBin& bin = bins_[size_class];
  std::lock_guard lock(bin.mutex);
  bin.free[static_cast<int>(precision)].push_back(block);
  ++bin.cached_blocks;
  bin.last_use = tick();
}

void DevicePool::free_to_device(void* ptr, std::size_t bytes) noexcept {
  // A failing free means the block was not the device's: a bug in gpupool, never the user's.
  // The bytes are still taken off the books, since the pool no longer holds them.
  (void)device_.deallocate(ptr);
  reservations_.freed(bytes);
}

void DevicePool::collect_completed_pending(bool wait) {
  std::vector<PendingBlock> ready;
  {
    std::lock_guard lock(pending_mutex_);
    auto done = [&](PendingBlock& pending) {
      for (Event& event : pending.events) {
        if (wait) (void)event.synchronize();
        auto completed = event.completed();
        if (!completed || !*completed) return false;
      }
      return true;
    };
    auto keep_end = std::partition(pending_.begin(), pending_.end(),
                                   [&](PendingBlock& p) { return !done(p); });
    std::move(keep_end, pending_.end(), std::back_inserter(ready));
    pending_.erase(keep_end, pending_.end());
    has_pending_.store(!pending_.empty(), std::memory_order_release);
  }
  for (PendingBlock& pending : ready) {
    if (pending.arena)
      give_back_large(*pending.arena, pending.span, !orphaned_.load(std::memory_order_acquire));
    else
      cache_block(pending.size_class, pending.precision, pending.block);
  }
}

// ---- giving memory back -----------------------------------------------------------------------

// Whole free segments first (large, and each one a single device free), then the coldest size
// classes; the blocks parked in thread caches only when that was not enough.
std::size_t DevicePool::trim(std::size_t keep_cached_bytes) {
  std::size_t released = trim_shared(keep_cached_bytes);
  if (cached_bytes() > keep_cached_bytes) {
    drain_thread_caches();
    released += trim_shared(keep_cached_bytes);
  }
  if (PoolRecorder* r = policies_->recorder.load(std::memory_order_acquire); r && released)
    r->on_trim(device_, released, figures());  // tracing
  return released;
}

std::size_t DevicePool::trim_shared(std::size_t keep_cached_bytes) {
  const std::size_t cached = cached_bytes();
  if (cached <= keep_cached_bytes) return 0;
  const std::size_t excess = cached - keep_cached_bytes;
  std::size_t released = 0;
  for_each_arena([&](ArenaShard& shard) {
    if (released < excess) released += release_free_segments(shard, excess - released);
  });
  if (released >= excess) return released;
  std::vector<std::pair<std::uint64_t, std::uint32_t>> coldest_first;
  for_each_active_class([&](std::uint32_t c) {  // the others never cached a block
    std::lock_guard lock(bins_[c].mutex);
    if (bins_[c].cached_blocks) coldest_first.emplace_back(bins_[c].last_use, c);
  });
  std::sort(coldest_first.begin(), coldest_first.end());
  for (auto [last_use, c] : coldest_first) {
    SizeClassBin& bin = bins_[c];
    const std::size_t bytes = sc::class_bytes(c);
    std::lock_guard lock(bin.mutex);
    for (auto& list : bin.free) {
      while (!list.empty() && released < excess) {
        free_to_device(list.back().ptr, bytes);
        list.pop_back();
        --bin.cached_blocks;
        released += bytes;
        counters_.count_trim();
      }
    }
    if (released >= excess) break;
  }
  return released;
}

std::size_t DevicePool::cleanup() {
  collect_completed_pending(/*wait=*/true);
  return trim(0);
}

void DevicePool::orphan() noexcept {
  orphaned_.store(true, std::memory_order_release);
  release_calling_threads_cache();
  cleanup();
}

Result<void> DevicePool::reserve(std::size_t bytes, std::size_t block_bytes) {
  if (bytes == 0) return {};
  if (block_bytes == 0 || block_bytes > sc::kMaxRequest)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("reservation_block_bytes is {}: expected 1 .. {}", block_bytes,
                                  format_bytes(sc::kMaxRequest)), device_.id());
  const std::uint32_t size_class = sc::class_of(block_bytes);
  const std::size_t class_size = sc::class_bytes(size_class);
  const bool as_segments = class_carves_from_segments(size_class);
  for (std::size_t done = 0; done < bytes; done += class_size) {
    if (as_segments && virtual_segments_) {  // pages mapped in the default stream's shards
      ArenaShard& shard = default_stream_arenas_[(done / class_size) % kArenaShards];
      auto taken = take_from_virtual_arena(shard, size_class, class_size, class_size);
      if (!taken) return std::unexpected(taken.error().with_context("initial reservation"));
      give_back_large(shard, taken->block.span, true);
      continue;
    }
    auto ptr = allocate_from_device(class_size, class_size);
    if (!ptr) return std::unexpected(ptr.error().with_context("initial reservation"));
    if (as_segments) {  // spread over the default stream's shards, which all threads reach
      ArenaShard& shard = default_stream_arenas_[(done / class_size) % kArenaShards];
      std::lock_guard lock(shard.mutex);
      shard.arena.add_segment(*ptr, class_size);
    } else {
      cache_block(size_class, Precision::Bytes, CachedBlock{*ptr, nullptr});
    }
  }
  return {};
}

// ---- figures ----------------------------------------------------------------------------------

std::size_t DevicePool::cached_bytes() const noexcept {
  return reservations_.cached(live_bytes().in_use);
}

std::size_t DevicePool::effective_limit() const {
  if (std::size_t limit = limit_.bytes()) return limit;
  auto memory = device_.memory_info();
  return memory ? memory->total : 0;
}

double DevicePool::pressure() const {
  return PressureWatch::pressure(reservations_.reserved(), effective_limit());
}

void DevicePool::after_reservation_growth(double pressure_before) {
  pressure_watch_.after_growth(pressure_before, reservations_.reserved(), effective_limit(),
                               *policies_, device_.id(), *this, automatic_trims_);
}

PoolStats DevicePool::stats() const {
  PoolStats s;
  const ClassTotals classes = class_totals();
  s.allocations = classes.counted.allocations;
  s.frees = classes.counted.frees;
  s.cache_hits = classes.counted.hits;
  s.fragmentation.cached_classes = classes.cached_classes;
  s.fragmentation.largest_cached_block = classes.largest_cached_block;
  s.cache_misses = s.allocations - s.cache_hits;
  s.live_buffers = s.allocations - s.frees;
  const LiveBytes live = live_bytes();
  s.in_use_bytes = live.in_use;
  s.requested_bytes = live.requested;
  for_each_arena([&](ArenaShard& shard) {
    std::lock_guard lock(shard.mutex);
    const bool paged = shard.pages != nullptr;
    s.fragmentation.largest_cached_block =
        std::max(s.fragmentation.largest_cached_block,
                 paged ? shard.pages->largest_free(shard.arena) : shard.arena.largest_free());
    s.fragmentation.stranded_bytes +=
        paged ? shard.pages->stranded_bytes(shard.arena) : shard.arena.stranded_bytes();
  });
  // Read apart from in use, the reserved figure may lag it while other threads allocate and trim:
  // a snapshot never shows more in use than reserved.
  s.reserved_bytes = std::max(reservations_.reserved(), s.in_use_bytes);
  s.cached_bytes = s.reserved_bytes - s.in_use_bytes;
  s.peak_in_use_bytes = counters_.peak_in_use(s.in_use_bytes);
  s.peak_requested_bytes = counters_.peak_requested(s.requested_bytes);
  s.peak_cached_bytes = counters_.peak_cached(s.cached_bytes);
  s.peak_reserved_bytes = std::max(reservations_.peak(), s.reserved_bytes);
  s.device_allocations = reservations_.device_allocations();
  s.device_frees = reservations_.device_frees();
  s.out_of_memory_errors = counters_.out_of_memory_errors();
  s.trims = counters_.trims();
  derive_fragmentation_ratios(s);
  return s;
}

DevicePool::Usage DevicePool::usage() const {
  const std::size_t in_use = live_bytes().in_use;
  return {in_use, reservations_.reserved(), counters_.peak_in_use(in_use)};
}

void DevicePool::reset_peaks() noexcept {
  LiveBytes live = live_bytes();
  counters_.reset_peaks({live.in_use, live.requested}, cached_bytes());
  reservations_.reset_peak();
}

PoolFigures DevicePool::figures() const noexcept {
  const std::size_t limit = limit_.bytes();
  return {live_bytes().in_use, reservations_.reserved(),
          limit ? limit : device_.properties().total_memory};
}

void DevicePool::set_limit(std::optional<std::size_t> bytes) noexcept {
  limit_.set(bytes, reservations_, *this);
}
std::optional<std::size_t> DevicePool::limit() const noexcept {
  const std::size_t limit = limit_.bytes();
  return limit ? std::optional(limit) : std::nullopt;
}
void DevicePool::set_max_cached(std::optional<std::size_t> bytes) noexcept {
  soft_cap_.set(bytes, *this);
}

}  // namespace gpupool
