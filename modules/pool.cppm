// gpupool:pool — GpuMemoryPool, a caching pool of device memory.
//
// How one allocation goes (pool/device_pool.cpp reads top to bottom in this order):
//   1. the request is rounded up to a size class (pool/size_classes.cppm: 256-byte steps up to
//      4 KiB, then 16 classes per power of two, so at most 1/16 of the request is wasted);
//   2. hit: a cached block of that class, this precision and this stream (free lists keyed by
//      device, class, precision; one small lock per class, no global lock, no device call);
//   3. near hit: a cached block of the same class cached under another precision;
//   4. miss: the device is asked — within the per-device hard limit (the coldest cached classes
//      are trimmed first to make room) and through the OOM ladder (trim this device's cache →
//      retry → OOM handlers → a typed OutOfMemory error carrying the figures).
// Blocks up to 64 KiB (4 KiB with virtual segments) are one device allocation each of exactly
// their class size. Larger blocks are carved (good fit, O(1)) from device segments (pool/segment_arena.cppm) and merge with their free
// neighbours when freed, so freed memory serves the next size instead of waiting for its own
// class; fully free segments go back to the device on trim (docs/pool.md has the measurements).
module;
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <source_location>
#include <string>
#include <type_traits>
#include <vector>
export module gpupool:pool;
import :error;
import :units;
import :precision;
import :device;
import :buffer;

namespace gpupool {
class PoolState;  // pool/pool_state.cppm
struct PoolAccess;  // pool/pool_access.cppm: the diagnostics' view of a pool's state
}

export namespace gpupool {

struct PoolConfig {
  // Hard limit on reserved bytes (in use + cached) per device; nullopt = the device's capacity.
  std::optional<std::size_t> max_pool_size;
  // Cached bytes above this are trimmed, coldest size classes first. nullopt = no soft cap.
  std::optional<std::size_t> max_cached_bytes;
  // Bytes to reserve on each device when its sub-pool is made, as cached blocks of
  // reservation_block_bytes each (a workload that knows its buffer size warms the cache this way).
  std::size_t initial_reservation = 0;
  std::size_t reservation_block_bytes = std::size_t{64} << 20;
  // false: pass-through mode (GPUPOOL_POOL=none): every free goes straight back to the device.
  bool caching = true;
  // true: blocks above 64 KiB are carved from shared device segments (docs/pool.md: it cuts
  // peak reserved / peak requested from 1.9 to 1.09 on a random trace). false: every block is a
  // device allocation of its own (exact figures per block; what the pool did before segments).
  bool segments = true;
  // true (GPUPOOL_SEGMENTS=virtual): the segments are virtual — one address range per stream and
  // thread shard, reserved without memory, whose pages get memory as blocks first touch them and
  // give it back from anywhere in free space, so freed space is never stranded in a segment that
  // still holds a live block (docs/pool.md); blocks above 4 KiB are carved from them, not only
  // those above 64 KiB. Where the device has no virtual memory, plain segments.
  bool virtual_segments = false;
  // With virtual segments, a page budget: a block that would map new pages and take the reserved
  // bytes above (1 + virtual_page_slack) x the most bytes the pool has had in use, and above the
  // most it has reserved, takes pages lying wholly in free space instead (unmapped once the
  // device has finished the work queued before: one synchronization per move), and the rest of
  // the excess goes back to the device, so a workload whose sizes vary does not reserve its peak
  // plus the holes its earlier sizes left (docs/pool.md, "Virtual segments"). The moves recur in
  // a workload that repeats: 0.01 kept PyTorch's ResNet-50 training within 1.01x its peak in use
  // but made its steps 1.9x slower on an H200. nullopt (the default): pages move only under the
  // hard limit or out of memory. Negative values count as 0.
  std::optional<double> virtual_page_slack = std::nullopt;
  // true: each thread keeps the last few blocks it freed (up to 4 MiB beyond one block) for its
  // next allocations, so that a hit writes nothing other threads write (pool/thread_cache.cppm;
  // docs/pool.md). false: every free goes to the shared bins and segments at once, where freed
  // neighbours merge immediately.
  bool thread_caches = true;
  // Pressure at or above this trims the cache after an allocation (0.9 by default).
  double critical_pressure = 0.9;

  // GPUPOOL_MEMORY_LIMIT (bytes like 8GiB, or a percentage of device memory like 80%; not 0),
  // GPUPOOL_CACHE_LIMIT (same forms; 0 caches nothing), GPUPOOL_POOL (caching | none),
  // GPUPOOL_SEGMENTS (virtual | device | none: virtual_segments, plain segments, no segments).
  // Percentages are of `device`'s memory: the device the pool will serve. InvalidInput names the
  // variable and its value when one is malformed.
  static Result<PoolConfig> from_environment(const Device& device);
  // The same, percentages of GPUPOOL_DEVICE's device (Device::from_environment()).
  static Result<PoolConfig> from_environment();
};

struct FragmentationStats {
  double internal = 0;       // (rounded − requested) / rounded over live buffers
  double external = 0;       // 1 − largest cached block / total cached bytes (0 when none cached)
  std::size_t largest_cached_block = 0;  // the largest block the cache can hand out now
  // Free bytes inside segments that still hold live blocks (blocks above 64 KiB, or 4 KiB with
  // virtual segments, are carved from segments): counted as cached, but no trim can give them back until those blocks are freed.
  std::size_t stranded_bytes = 0;
  std::size_t cached_classes = 0;  // class spread: size classes holding cached blocks
};

// Figures for one device (or, summed, for all). "Reserved" = in use + cached: what the pool
// holds from the device. None of them says how large an allocation can succeed: the device may
// be fragmented, and other processes share it.
// A snapshot: with other threads allocating meanwhile, each figure is one it had during the call,
// and reserved = in use + cached holds in every snapshot.
struct PoolStats {
  std::size_t in_use_bytes = 0;        // rounded bytes held by live buffers
  std::size_t requested_bytes = 0;     // bytes live buffers asked for
  std::size_t cached_bytes = 0;        // freed blocks kept for reuse (pending ones included)
  std::size_t reserved_bytes = 0;      // in use + cached
  std::size_t peak_in_use_bytes = 0;
  std::size_t peak_requested_bytes = 0;
  std::size_t peak_cached_bytes = 0;
  std::size_t peak_reserved_bytes = 0;
  std::uint64_t allocations = 0;
  std::uint64_t frees = 0;
  std::uint64_t cache_hits = 0;        // served from the cache (same or other precision)
  std::uint64_t cache_misses = 0;
  std::uint64_t device_allocations = 0;
  std::uint64_t device_frees = 0;
  std::uint64_t out_of_memory_errors = 0;
  std::uint64_t trims = 0;             // blocks given back by trimming or cleanup
  std::size_t live_buffers = 0;
  FragmentationStats fragmentation;
  double hit_rate() const noexcept {
    auto total = cache_hits + cache_misses;
    return total ? static_cast<double>(cache_hits) / static_cast<double>(total) : 0.0;
  }
};

// Called (outside the pool's locks) when a device's pressure rises to or past `threshold`.
struct PressureEvent {
  int device_id;
  double pressure;
  double threshold;
};
using PressureObserver = std::function<void(const PressureEvent&)>;
// Called on out-of-memory after the cache was trimmed; return true to ask for one more try.
using OomHandler = std::function<bool(int device_id, std::size_t requested_bytes)>;

// A raw block handed out by the deprecated get_buffer API.
struct RawBuffer {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  Precision precision = Precision::Bytes;
  int device_id = -1;
};

// One buffer of a batch request.
struct BufferRequest {
  std::size_t elements;
  Precision precision;
};

class BufferBatch;

// Bytes held from the device (live and cached) and the most ever held since the last reset.
struct MemoryUsage {
  std::size_t allocated = 0;
  std::size_t peak = 0;
  friend bool operator==(const MemoryUsage&, const MemoryUsage&) = default;
};

// What GpuMemoryPool::free_pointer did.
enum class PointerFree {
  freed,         // the block is back in the pool (or waits for the streams that used it)
  not_found,     // not a live allocate_pointer of this pool: foreign, or already freed
  other_stream,  // freed on a stream it was neither allocated on nor recorded for: still live
};

class GpuMemoryPool {
 public:
  // Copies share one pool. Devices get their sub-pool on first use.
  explicit GpuMemoryPool(PoolConfig config = {});

  // The main entry: `elements` of `precision` on `device`, ordered on `stream` (default stream
  // when omitted). InvalidInput for 0 elements or absurd sizes; PoolLimitExceeded past the hard
  // limit; OutOfMemory when the device cannot provide the memory even after the OOM ladder.
  // `where` is the call site that leak tracing reports (gpupool:tracing); leave it defaulted.
  Result<ManagedBuffer> get_managed_buffer(
      const Device& device, std::size_t elements, Precision precision,
      std::source_location where = std::source_location::current());
  Result<ManagedBuffer> get_managed_buffer(
      const Device& device, std::size_t elements, Precision precision, const Stream& stream,
      std::source_location where = std::source_location::current());
  // `bytes` bytes (Precision::Bytes), on `stream` or the device's default stream.
  Result<ManagedBuffer> allocate_bytes(const Device& device, std::size_t bytes,
                                       std::source_location where = std::source_location::current());
  Result<ManagedBuffer> allocate_bytes(const Device& device, std::size_t bytes,
                                       const Stream& stream,
                                       std::source_location where = std::source_location::current());

  // Pointer-only allocations, for callers that keep nothing but the address (the C ABI, and
  // through it PyTorch, CuPy, cuda::mr resources and Rust): the pool keeps the block's buffer,
  // parked in the allocating thread's cache, until free_pointer. `bytes` bytes on `stream`, the
  // device's default stream when null; errors as allocate_bytes'. A pair costs about what a
  // ManagedBuffer pair costs when the thread that allocates also frees.
  Result<void*> allocate_pointer(const Device& device, std::size_t bytes,
                                 const Stream* stream = nullptr,
                                 std::source_location where = std::source_location::current());
  // Frees `ptr` when `stream_handle` (Stream::native(): null for the default stream) is the
  // stream it was allocated on or one recorded for it; otherwise nothing changes (see
  // PointerFree). Any thread may free. Like free(), a free must not race another call about the
  // same pointer. Allocations never freed go back when the pool's last handle goes.
  PointerFree free_pointer(void* ptr, void* stream_handle = nullptr) noexcept;
  // Runs `visit(ManagedBuffer&)` on the buffer behind `ptr` (to read it, or record_stream)
  // while no other call can free it; false when `ptr` is not a live allocate_pointer of this
  // pool. `visit` must not call into this pool.
  template <class Visit>
  bool with_pointer(const void* ptr, Visit&& visit) {
    return visit_pointer(ptr, &visit, [](void* context, ManagedBuffer& buffer) {
      (*static_cast<std::remove_reference_t<Visit>*>(context))(buffer);
    });
  }

  // All-or-nothing: if one request fails, none stays held and the error names its index.
  Result<BufferBatch> create_buffer_batch(const Device& device,
                                          const std::vector<BufferRequest>& requests);
  BufferBatch create_buffer_batch(const Device& device);

  // Deprecated API (a buffer handed out, then returned by hand): returns are validated (this
  // pool, device, size, precision); foreign, double and mismatched returns are errors and never
  // adopted into the cache.
  [[deprecated("use get_managed_buffer: it returns itself")]]
  Result<RawBuffer> get_buffer(const Device& device, std::size_t elements, Precision precision);
  [[deprecated("use get_managed_buffer: it returns itself")]]
  Result<void> return_buffer(const Device& device, const RawBuffer& buffer);

  // Limits. A hard limit below what is in use is allowed: allocations fail until enough is freed.
  Result<void> set_max_pool_size(const Device& device, std::size_t bytes);
  std::optional<std::size_t> max_pool_size(const Device& device) const;
  Result<void> set_max_cached_bytes(const Device& device, std::optional<std::size_t> bytes);

  // Several devices: lets `accessor`'s work read and write the memory this pool holds on
  // `owner` — Device::enable_peer_access, and for virtual segments the access of every page
  // mapped now and later (CUDA's virtual memory is reached only by the devices each mapping
  // names). InvalidInput where accessor.can_access_peer(owner) is false.
  Result<void> enable_peer_access(const Device& owner, const Device& accessor);

  // Statistics.
  PoolStats stats(const Device& device) const;
  PoolStats total_stats() const;
  void reset_peaks(const Device& device);
  // Reserved (allocated, cached included) and its peak; nullopt for a device never used.
  // Unpacks as a pair: `auto [allocated, peak] = *pool.memory_usage(device);`.
  std::optional<MemoryUsage> memory_usage(const Device& device) const;
  MemoryUsage total_memory_usage() const;

  // Reserved bytes / effective limit (the hard limit, else the device's total memory), in [0, 1].
  // Counts cached bytes: they are held from the device even if the pool could give them back.
  double memory_pressure(const Device& device) const;
  std::uint64_t add_pressure_observer(double threshold, PressureObserver observer);
  void remove_pressure_observer(std::uint64_t id);
  std::uint64_t add_oom_handler(OomHandler handler);
  void remove_oom_handler(std::uint64_t id);

  // Gives cached blocks back, coldest size classes first, until at most `keep_bytes` stay
  // cached. Returns the bytes released. Never touches live buffers.
  std::size_t trim(const Device& device, std::size_t keep_bytes = 0);
  // Ends a scoped peak: the peaks since begin_phase().
  void begin_phase(const Device& device) { reset_peaks(device); }
  // Waits for pending stream frees, then gives every cached block back. Returns bytes released.
  std::size_t emergency_cleanup(const Device& device);
  std::size_t emergency_cleanup_all();

  const PoolConfig& config() const noexcept;

 private:
  friend struct PoolAccess;
  // `stream` null: the device's default stream (the sub-pool's, made once).
  Result<ManagedBuffer> allocate_bytes_as(const Device& device, std::size_t bytes,
                                          Precision precision, const Stream* stream,
                                          const std::source_location& where);
  Result<ManagedBuffer> allocate_elements(const Device& device, std::size_t elements,
                                          Precision precision, const Stream* stream,
                                          const std::source_location& where);
  bool visit_pointer(const void* ptr, void* context, void (*visit)(void*, ManagedBuffer&));
  std::shared_ptr<PoolState> state_;
};

class BufferBatch {
 public:
  using Request = BufferRequest;
  BufferBatch(GpuMemoryPool pool, Device device) : pool_(std::move(pool)), device_(std::move(device)) {}

  std::size_t size() const noexcept { return buffers_.size(); }
  bool empty() const noexcept { return buffers_.empty(); }
  // InvalidInput naming the index and the batch size when out of range.
  Result<ManagedBuffer*> at(std::size_t index);
  // Unchecked, like std::vector's: index < size().
  ManagedBuffer& operator[](std::size_t index) noexcept { return buffers_[index]; }
  // Takes a buffer in (refused: empty buffers and buffers of another device).
  Result<void> add(ManagedBuffer buffer);
  // Allocates one more buffer from the batch's pool and device and appends it.
  Result<void> add(std::size_t elements, Precision precision);
  // Takes buffer `index` out of the batch: the caller owns it now.
  Result<ManagedBuffer> remove(std::size_t index);
  void clear() noexcept { buffers_.clear(); }
  const Device& device() const noexcept { return device_; }
  std::size_t total_bytes() const noexcept;

 private:
  GpuMemoryPool pool_;
  Device device_;
  std::vector<ManagedBuffer> buffers_;
};

}  // namespace gpupool
