// gpupool:batch_planner — how large a batch may be: the headroom the pool could still hand out,
// the batch-size policy (first size, bisection on out-of-memory, growth) and the estimate of
// bytes per item for items of uneven length (pool/batch_planner.cpp, pool/batching.cpp).
module;
#include <algorithm>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <expected>
#include <functional>
#include <iterator>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>
export module gpupool:batch_planner;
import :error;
import :units;
import :device;
import :pool;

export namespace gpupool {

// ---- Planning policy (pool/batch_planner.cpp): a plain class, no device needed ----------------

struct PlannerConfig {
  double growth_factor = 1.5;        // in [1.2, 2]
  std::size_t grow_after = 2;        // successes in a row before growing (>= 1)
  std::size_t max_retries = 32;      // out-of-memory failures in a row before giving up (>= 1)
  std::size_t max_batch_size = SIZE_MAX;
  // A failure recorded at headroom H still caps growth while the headroom is below
  // H × comparable_headroom; more memory than that and the size may be tried again.
  double comparable_headroom = 1.1;
};

// What to do after an out-of-memory failure.
enum class OomDecision : std::uint8_t {
  Retry,            // try again from the same item with size()
  FailedAtOne,      // a batch of one item does not fit: give up
  RetriesExhausted  // max_retries failures in a row: give up
};

// The batch-size policy: first size from the headroom, bisection on out-of-memory, bounded
// growth, adaptation to the headroom. It sees sizes and byte counts only, so it is unit-tested
// with no device; process_in_batches and DeviceBatches drive it.
class BatchPlanner {
 public:
  // InvalidInput names the field and its value (growth factor outside [1.2, 2], zero bounds).
  static Result<BatchPlanner> create(PlannerConfig config);

  // floor(headroom × safety ÷ bytes_per_item), at least 1 and at most the configured maximum.
  std::size_t size_for_headroom(std::size_t headroom_bytes, double safety_fraction,
                                std::size_t bytes_per_item) const noexcept;

  // Sets the size of the next batch (the first one, or after a probe).
  void start(std::size_t size) noexcept;
  // The headroom before a batch: shrinks the size in proportion when it fell by more than the
  // comparable margin, and decides which recorded failures still cap growth.
  void observe_headroom(std::size_t headroom_bytes) noexcept;
  void on_success(std::size_t size) noexcept;
  OomDecision on_out_of_memory(std::size_t size) noexcept;
  // The size the headroom is estimated to hold, from what the last batch measurably used
  // (headroom ÷ its bytes per item): growth stops there instead of finding it by failing.
  // With a fixed cost per call the estimate is low at small sizes and rises as the size does,
  // so growth still reaches the largest size that fits. nullopt: no estimate.
  void set_fit_estimate(std::optional<std::size_t> items) noexcept { fit_estimate_ = items; }

  std::size_t size() const noexcept { return size_; }
  // The smallest size that failed at comparable headroom (nullopt: none caps growth now).
  std::optional<std::size_t> ceiling() const noexcept;
  std::size_t retries() const noexcept { return retries_; }  // out-of-memory failures in all
  std::size_t consecutive_failures() const noexcept { return consecutive_failures_; }
  const PlannerConfig& config() const noexcept { return config_; }

 private:
  explicit BatchPlanner(PlannerConfig config) : config_(config) {}
  std::size_t clamp(std::size_t size) const noexcept;
  static std::size_t tolerance(std::size_t size) noexcept;
  void remember_failure(std::size_t size);
  struct Failure { std::size_t size; std::size_t headroom; };

  PlannerConfig config_;
  std::size_t size_ = 1;
  std::optional<std::size_t> last_success_;
  std::size_t successes_in_a_row_ = 0;
  std::size_t consecutive_failures_ = 0;
  std::size_t retries_ = 0;
  std::size_t headroom_ = 0;            // last observed; 0 = none yet
  std::size_t reference_headroom_ = 0;  // the headroom the current size was judged against
  std::optional<std::size_t> fit_estimate_;
  std::vector<Failure> failures_;
};

// What the pool could still hand out on `device`: the device's free memory plus the pool's
// cached bytes (which a trim gives back), within the pool's hard limit minus its bytes in use.
// An estimate: fragmentation and other processes may make less than this allocatable.
struct MemoryHeadroom {
  std::size_t bytes = 0;  // min(device_free + cached, device total − in use, limit_room)
  std::size_t device_free = 0;
  std::size_t cached = 0;
  std::optional<std::size_t> limit_room;  // the pool's hard limit minus its bytes in use
  std::size_t pool_in_use = 0;            // the pool's bytes in use on the device
};
Result<MemoryHeadroom> memory_headroom(const GpuMemoryPool& pool, const Device& device);

// Item lengths, for estimate_bytes_per_item on items of uneven length.
struct LengthStats {
  std::size_t count = 0;
  double sum = 0, sum_of_squares = 0;
  std::size_t max = 0;
  void add(std::size_t length) noexcept;
  double mean() const noexcept;
  double coefficient_of_variation() const noexcept;  // standard deviation ÷ mean
};

// Bytes per item from a probe that used `probe_bytes` for items of lengths `probe`, sized for a
// population of lengths `population`: the probe's bytes per unit of length × the mean length when
// lengths vary little (cv < 0.1), else × (0.7 mean + 0.3 max) — weighted towards the longest
// items, so that a batch of the long ones still fits.
std::size_t estimate_bytes_per_item(std::size_t probe_bytes, const LengthStats& probe,
                                    const LengthStats& population) noexcept;

}  // namespace gpupool
