// The data structures of the pool, in one place. Read this first.
//
//   GpuMemoryPool ──shared_ptr──> PoolState (pool/pool_state.cppm)
//                                   ├─ PoolPolicies: config, pressure observers, OOM handlers
//                                   └─ one DevicePool per device, made on first use
//   ManagedBuffer ──shared_ptr──> DevicePool   (so a buffer outliving the pool returns safely)
//
//   DevicePool
//     bins_[class]      one SizeClassBin per size class, each with its own mutex:
//                       free lists by precision of CachedBlock {ptr, stream freed on}
//                       (blocks up to 64 KiB: one device allocation each)
//     arenas            blocks above 64 KiB: one ArenaShard per (stream, thread shard), each a
//                       SegmentArena (pool/segment_arena.cppm) behind its own mutex
//     pending_          blocks freed while other streams (record_stream) may still use them,
//                       each with the events to wait for; they join the bins once complete
//     counters          reserved (held from the device), in use, requested: atomics, because
//                       the limit check and the peaks need them across classes
//
// Locking: a bin's mutex guards only that bin; an arena shard's mutex only that shard; pending_mutex_ guards pending_; observers and
// handlers are copied out under PoolPolicies::mutex and called with no lock held. No lock is
// held across a device call except a bin's during trimming of that bin.
module;
#include <array>
#include <atomic>
#include <map>
#include <cstddef>
#include <cstdint>
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
import :report;
import :recorder;

namespace gpupool {

// What every device of one pool shares.
struct PoolPolicies {
  PoolConfig config;
  std::mutex mutex;  // guards the lists below
  struct Observer { std::uint64_t id; double threshold; PressureObserver callback; };
  struct Handler { std::uint64_t id; OomHandler callback; };
  std::vector<Observer> observers;
  std::vector<Handler> oom_handlers;
  std::uint64_t next_id = 1;
  // Tracing (gpupool:tracing): the hooks' gate, null while off, so the allocation path pays one
  // branch. The recorder is made once and lives as long as any sub-pool: buffers that outlive
  // the pool still report their frees to it.
  std::atomic<PoolRecorder*> recorder{nullptr};
  std::shared_ptr<PoolRecorder> recorder_owner;  // set once under `mutex`
};

struct CachedBlock {
  void* ptr;
  void* stream;  // native handle of the stream it was freed on: reused at once only there
};

struct SizeClassBin {
  std::mutex mutex;
  std::array<std::vector<CachedBlock>, kPrecisionCount> free;
  std::size_t cached_blocks = 0;
  std::size_t live_blocks = 0;
  std::uint64_t last_use = 0;  // the pool's use counter at the last alloc/free: coldest first
  std::uint64_t allocations = 0, frees = 0, hits = 0, misses = 0;
};

// One stream's large blocks, for the threads that map to this shard (threads spread over shards
// so that they do not all queue on one lock; a shard that runs dry borrows from its siblings).
struct ArenaShard {
  std::mutex mutex;
  SegmentArena arena;
};
inline constexpr int kArenaShards = 8;
using StreamArenas = std::array<ArenaShard, kArenaShards>;

struct PendingBlock {
  CachedBlock block;
  std::uint32_t size_class;
  Precision precision;
  ArenaShard* arena;  // large blocks go back to their arena; null for class blocks
  std::vector<Event> events;  // recorded on each stream the buffer was used on, at free time
};

class DevicePool : public std::enable_shared_from_this<DevicePool> {
 public:
  DevicePool(Device device, std::shared_ptr<PoolPolicies> policies);
  ~DevicePool();
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  const Device& device() const noexcept { return device_; }
  Result<ManagedBuffer> allocate(std::size_t requested_bytes, Precision precision,
                                 const Stream& stream, const std::source_location& where);
  // Takes a buffer's block back (ManagedBuffer's destructor and release()).
  void take_back(ManagedBuffer& buffer) noexcept;

  std::size_t trim(std::size_t keep_cached_bytes);
  std::size_t cleanup();
  // The pool's handles are all gone: give the cache back; later returns go to the device.
  void orphan() noexcept;

  PoolStats stats() const;
  void reset_peaks() noexcept;
  double pressure() const;
  void set_limit(std::optional<std::size_t> bytes) noexcept;
  std::optional<std::size_t> limit() const noexcept;
  void set_max_cached(std::optional<std::size_t> bytes) noexcept;
  Result<void> reserve(std::size_t bytes, std::size_t block_bytes);
  // Per size class activity, for memory reports (defined in pool/report.cpp).
  std::vector<SizeClassActivity> class_activity() const;
  // In use, reserved and limit now: three atomic loads (what tracing records after each event).
  PoolFigures figures() const noexcept;

 private:
  std::optional<CachedBlock> take_cached(SizeClassBin& bin, Precision precision, void* stream);
  Result<void*> allocate_from_device(std::size_t block_bytes, std::size_t requested_bytes);
  Result<void*> device_allocate_within_limit(std::size_t block_bytes, std::size_t requested_bytes,
                                             bool may_trim = true);
  ManagedBuffer make_buffer(void* ptr, std::size_t requested_bytes, std::uint32_t size_class,
                            Precision precision, const Stream& stream, ArenaShard* arena,
                            const std::source_location& where);
  // Large blocks (pool/segment_arena.cppm).
  Result<ManagedBuffer> allocate_large(std::size_t requested_bytes, std::uint32_t size_class,
                                       Precision precision, const Stream& stream,
                                       const std::source_location& where);
  Result<std::pair<void*, ArenaShard*>> take_from_arenas(StreamArenas& arenas, ArenaShard& own,
                                                         std::size_t block_bytes,
                                                         std::size_t requested_bytes);
  std::size_t segment_bytes_for(std::size_t block_bytes) const;
  StreamArenas& arenas_of(void* stream);
  std::size_t release_free_segments(ArenaShard& shard, std::size_t enough);
  void give_back_large(ArenaShard& shard, void* ptr, std::size_t bytes, bool keep) noexcept;
  template <class F>
  void for_each_arena(F&& f);
  GpuError limit_exceeded(std::size_t requested_bytes, std::size_t block_bytes,
                          std::size_t limit) const;
  GpuError out_of_memory_error(const GpuError& cause, std::size_t requested_bytes) const;
  void cache_block(std::uint32_t size_class, Precision precision, CachedBlock block) noexcept;
  void free_to_device(void* ptr, std::size_t bytes) noexcept;
  void collect_completed_pending(bool wait);
  void trim_to_soft_cap() noexcept;
  bool park_until_streams_done(ManagedBuffer& buffer) noexcept;
  void after_reservation_change(double pressure_before);
  std::size_t effective_limit() const;
  std::size_t cached_bytes() const noexcept;
  std::uint64_t tick() noexcept { return use_counter_.fetch_add(1, std::memory_order_relaxed); }
  static void raise_peak(std::atomic<std::size_t>& peak, std::size_t value) noexcept;

  Device device_;
  std::shared_ptr<PoolPolicies> policies_;
  std::unique_ptr<SizeClassBin[]> bins_;
  std::mutex pending_mutex_;
  std::vector<PendingBlock> pending_;
  std::atomic<bool> has_pending_{false};
  std::atomic<bool> orphaned_{false};
  std::atomic<std::size_t> reserved_{0}, in_use_{0}, requested_{0};
  std::atomic<std::size_t> peak_reserved_{0}, peak_in_use_{0}, peak_requested_{0}, peak_cached_{0};
  std::atomic<std::uint64_t> device_allocations_{0}, device_frees_{0}, oom_errors_{0}, trims_{0};
  std::atomic<std::uint64_t> use_counter_{0};
  std::atomic<std::size_t> limit_;         // 0 = none (the device's capacity applies)
  std::atomic<std::size_t> max_cached_;    // SIZE_MAX = no soft cap
  std::atomic<bool> trimming_{false};      // one automatic trim at a time
  StreamArenas default_stream_arenas_;
  std::mutex stream_arenas_mutex_;         // guards the map, not the arenas
  std::map<void*, std::unique_ptr<StreamArenas>> stream_arenas_;
};

}  // namespace gpupool
