// The pool's policies, as small layers over the mechanism (DevicePool: thread caches, bins,
// arenas, pending blocks). Each decides one thing and reaches the mechanism only through
// CacheControl, so each is tested alone (tests/pool_policies_test.cpp):
//
//   Reservations   the bytes a sub-pool holds from its device, their peak, the device calls
//   UsageCounters  the rest of the pool-wide figures stats() reports: the bytes thread caches
//                  published, the peaks of in use, requested and cached, OOM errors and trims
//   HardLimit      whether a reservation may grow (trimming cached memory to make room)
//   SoftCap        how many bytes may stay cached (trims the excess after a free)
//   PressureWatch  pressure observers, and the critical level that trims back under itself
//   OomLadder      what follows a device out-of-memory: cleanup, retry, the OOM handlers, retry
//
// DevicePool composes them on its one way to the device (pool/device_pool.cpp,
// reserve_from_device): ladder → limit → device → reservations → pressure.
module;
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>
module gpupool:pool_policies;
import :error;
import :pool;
import :recorder;

namespace gpupool {

// What every device of one pool shares: its configuration and the callbacks its users added.
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

// The mechanism as the policies see it. DevicePool implements it; tests fake it.
class CacheControl {
 public:
  // Gives cached memory back to the device until at most `keep_cached_bytes` stay cached;
  // returns the bytes released.
  virtual std::size_t trim(std::size_t keep_cached_bytes) = 0;
  // Waits for blocks other streams still use, then gives every cached block back.
  virtual std::size_t cleanup() = 0;
  // Bytes of live buffers (their blocks'): what no trim can give back.
  virtual std::size_t in_use_bytes() const = 0;

 protected:
  ~CacheControl() = default;
};

// The bytes a sub-pool holds from its device (in use and cached), their peak, and the device
// calls that moved them. Lock-free; every figure a policy or stats() reads about the device's
// memory comes from here.
class Reservations {
 public:
  inline std::size_t reserved() const noexcept { return reserved_.load(std::memory_order_relaxed); }
  // Reserved minus in use, never negative (the two are read apart).
  inline std::size_t cached(std::size_t in_use) const noexcept {
    const std::size_t now = reserved();
    return now > in_use ? now - in_use : 0;
  }
  std::size_t peak() const noexcept { return std::max(peak_.load(), reserved()); }
  // The peak, which reset_peak() lowers here only when nothing is reserved (virtual segments
  // move pages only to keep it within their budget: pool/virtual_segments.cpp).
  std::size_t most() const noexcept { return std::max(most_.load(), reserved()); }
  void reset_peak() noexcept {
    const std::size_t now = reserved();
    peak_.store(now);
    if (now == 0) most_.store(0);
  }
  std::uint64_t device_allocations() const noexcept { return device_allocations_.load(); }
  std::uint64_t device_frees() const noexcept { return device_frees_.load(); }

  // Counts `bytes` in if the total stays within `limit` (0: no limit); false otherwise.
  bool try_add(std::size_t bytes, std::size_t limit) noexcept;
  // A reservation counted in whose device call failed: counted out again.
  void cancel(std::size_t bytes) noexcept { reserved_.fetch_sub(bytes); }
  // The device call of a counted reservation succeeded.
  void allocated() noexcept;
  // Memory given back to the device.
  void freed(std::size_t bytes) noexcept;

 private:
  std::atomic<std::size_t> reserved_{0}, peak_{0}, most_{0};
  std::atomic<std::uint64_t> device_allocations_{0}, device_frees_{0};
};

// The pool-wide figures besides the reservations, in one place. Thread caches count their own
// allocations and bytes without touching shared lines and, while several caches exist, publish
// bytes here in batches (ThreadCache::kPublishBytes); the peaks are raised from the published figure plus the calling
// cache's unpublished rest, so they are exact with one thread and within kPublishBytes per other
// thread otherwise. DevicePool::stats adds the thread caches' counters and the arenas' figures.
class UsageCounters {
 public:
  struct Bytes {
    std::size_t in_use, requested;
  };
  inline Bytes published() const noexcept {
    return {in_use_.load(std::memory_order_relaxed), requested_.load(std::memory_order_relaxed)};
  }
  inline void publish(std::int64_t in_use_delta, std::int64_t requested_delta) noexcept {
    in_use_.fetch_add(static_cast<std::size_t>(in_use_delta), std::memory_order_relaxed);
    requested_.fetch_add(static_cast<std::size_t>(requested_delta), std::memory_order_relaxed);
  }
  inline void raise_peaks(Bytes now) noexcept {
    raise(peak_in_use_, now.in_use);
    raise(peak_requested_, now.requested);
  }
  inline void raise_peak_cached(std::size_t cached) noexcept { raise(peak_cached_, cached); }
  // Peaks read at least `now` (the snapshot's own figures, read apart from the peaks).
  std::size_t peak_in_use(std::size_t now) const noexcept { return std::max(peak_in_use_.load(), now); }
  std::size_t peak_requested(std::size_t now) const noexcept {
    return std::max(peak_requested_.load(), now);
  }
  std::size_t peak_cached(std::size_t now) const noexcept { return std::max(peak_cached_.load(), now); }
  // The most bytes in use, at least `now`, that virtual segments hold their reserved bytes near
  // (pool/virtual_segments.cpp): the peak in use, which reset_peaks() lowers only when the pool
  // holds no memory at all — a workload that resets its peaks every step keeps its budget, and a
  // pool emptied by a cleanup starts afresh.
  std::size_t most_in_use(std::size_t now) const noexcept {
    return std::max({most_in_use_before_reset_.load(), peak_in_use_.load(), now});
  }
  void reset_peaks(Bytes live, std::size_t cached) noexcept {
    if (live.in_use == 0 && cached == 0) most_in_use_before_reset_.store(0);
    else raise(most_in_use_before_reset_, peak_in_use_.load());
    peak_in_use_.store(live.in_use);
    peak_requested_.store(live.requested);
    peak_cached_.store(cached);
  }

  void count_out_of_memory() noexcept { oom_errors_.fetch_add(1, std::memory_order_relaxed); }
  void count_trim() noexcept { trims_.fetch_add(1, std::memory_order_relaxed); }
  std::uint64_t out_of_memory_errors() const noexcept { return oom_errors_.load(); }
  std::uint64_t trims() const noexcept { return trims_.load(); }

 private:
  static inline void raise(std::atomic<std::size_t>& peak, std::size_t value) noexcept {
    std::size_t seen = peak.load(std::memory_order_relaxed);
    while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
    }
  }
  std::atomic<std::size_t> in_use_{0}, requested_{0};
  std::atomic<std::size_t> peak_in_use_{0}, peak_requested_{0}, peak_cached_{0};
  std::atomic<std::size_t> most_in_use_before_reset_{0};
  std::atomic<std::uint64_t> oom_errors_{0}, trims_{0};
};

// At most this many bytes reserved from the device (PoolConfig::max_pool_size,
// set_max_pool_size). A limit may be lowered below what is reserved: cached memory goes back at
// once, and freed blocks go to the device until the pool is under it.
class HardLimit {
 public:
  explicit HardLimit(std::size_t bytes) : bytes_(bytes) {}
  // 0: none (the device's capacity applies).
  inline std::size_t bytes() const noexcept { return bytes_.load(std::memory_order_relaxed); }
  // The pool holds more than the limit (it was lowered below what was reserved).
  inline bool exceeded(const Reservations& reservations) const noexcept {
    const std::size_t limit = bytes();
    return limit != 0 && reservations.reserved() > limit;
  }
  void set(std::optional<std::size_t> bytes, const Reservations& reservations,
           CacheControl& cache) noexcept;
  // Gives cached memory back until `bytes` more fit under the limit, as far as cached memory
  // allows.
  void make_room(std::size_t bytes, const Reservations& reservations, CacheControl& cache) const;
  // Counts `bytes` into `reservations` if the limit allows, first trimming cached memory to make
  // room when `may_trim`; PoolLimitExceeded (naming `requested_bytes` and the pool's figures)
  // otherwise.
  Result<void> admit(std::size_t bytes, std::size_t requested_bytes, bool may_trim,
                     Reservations& reservations, CacheControl& cache, int device_id);
  GpuError exceeded_error(std::size_t requested_bytes, std::size_t block_bytes,
                          std::size_t in_use, std::size_t cached, int device_id) const;

 private:
  std::atomic<std::size_t> bytes_;
};

// One automatic trim at a time (soft cap, critical pressure): a trim that finds another under
// way leaves the work to it.
class AutomaticTrims {
 public:
  template <class Trim>
  void run(Trim&& trim) {
    if (running_.exchange(true)) return;
    trim();
    running_.store(false);
  }

 private:
  std::atomic<bool> running_{false};
};

// At most this many bytes cached (PoolConfig::max_cached_bytes, set_max_cached_bytes): the
// excess goes back after the free that passed it.
class SoftCap {
 public:
  explicit SoftCap(std::size_t bytes) : bytes_(bytes) {}
  // SIZE_MAX: none.
  inline std::size_t bytes() const noexcept { return bytes_.load(std::memory_order_relaxed); }
  inline bool active() const noexcept { return bytes() != SIZE_MAX; }
  void set(std::optional<std::size_t> bytes, CacheControl& cache) noexcept;
  // After a free: trims back to the cap if the cache holds more.
  void enforce(const Reservations& reservations, CacheControl& cache, AutomaticTrims& trims) noexcept;

 private:
  std::atomic<std::size_t> bytes_;
};

// Pressure = reserved / effective limit (the hard limit, else the device's memory). Observers
// hear when it crosses their threshold upwards; at the critical level (PoolConfig::
// critical_pressure) the coldest cached memory goes back until the pool is under it again.
class PressureWatch {
 public:
  static double pressure(std::size_t reserved, std::size_t effective_limit) noexcept;
  // A reservation grew: pressure went from `before` to what `reserved` now gives.
  void after_growth(double before, std::size_t reserved, std::size_t effective_limit,
                    PoolPolicies& policies, int device_id, CacheControl& cache,
                    AutomaticTrims& trims);
};

// What follows a device out-of-memory: give this device's cache back and retry; then the OOM
// handlers (which may free memory and ask for one more try: what they freed is given back before
// it); the last error otherwise. The caller adds its figures to that error.
class OomLadder {
 public:
  Result<void*> climb(std::size_t requested_bytes, GpuError first_error,
                      const std::function<Result<void*>()>& attempt, PoolPolicies& policies,
                      int device_id, CacheControl& cache);
};

}  // namespace gpupool
