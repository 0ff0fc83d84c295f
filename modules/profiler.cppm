// gpupool:profiler — snapshots, peaks and phases of one device's memory, and monitoring helpers
// that print a device's memory (memory_status, with_memory_monitoring, cleanup_memory).
//
//   MemoryProfiler p(pool, device);
//   p.capture("baseline");  { auto phase = p.phase("build index"); ... }  p.capture("after");
//   MemoryProfiler::print_summary(p.snapshots());   p.phases()[0].peak.reserved_bytes
//
// Peaks come from the pool's own peak counters, which a phase resets when it begins
// (GpuMemoryPool::begin_phase); the profiler folds them into every open phase and into its own
// session peak first, so nested phases and peak() stay right. Anyone else reading the pool's
// peaks on that device sees them reset. A profiler is for one thread.
//
// Every helper returns its figures and also prints them to `out` unless it is null.
module;
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <expected>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>
export module gpupool:profiler;
import :error;
import :device;
import :pool;

export namespace gpupool {

struct MemorySnapshot {
  std::string label;
  int device_id = -1;
  double seconds = 0;                 // since the profiler (or the monitoring) began
  std::size_t device_free_bytes = 0;
  std::size_t device_total_bytes = 0;
  std::size_t in_use_bytes = 0;       // the pool's, on this device
  std::size_t requested_bytes = 0;
  std::size_t cached_bytes = 0;
  std::size_t reserved_bytes = 0;
  std::size_t live_buffers = 0;
  FragmentationStats fragmentation;
  // The device's free memory: exact on the simulated device; on CUDA the free bytes, which
  // need not be one contiguous range (gpupool:report says more).
  std::size_t largest_free_block = 0;
  std::string to_string() const;      // the snapshot's block of print_summary
};

// The pool's figures on `device` now.
Result<MemorySnapshot> capture_snapshot(const GpuMemoryPool& pool, const Device& device,
                                        std::string label);

struct MemoryPeak {
  std::size_t in_use_bytes = 0;
  std::size_t requested_bytes = 0;
  std::size_t reserved_bytes = 0;
};

struct PhaseRecord {
  std::string name;
  int depth = 0;                      // 0 = outermost
  MemoryPeak peak;                    // highest figures while the phase was open
  std::size_t in_use_before = 0;
  std::size_t in_use_after = 0;
  double seconds = 0;
};

class MemoryProfiler {
 public:
  MemoryProfiler(GpuMemoryPool pool, Device device);

  // Takes a snapshot and keeps it. DeviceUnavailable when the device cannot report its memory.
  Result<MemorySnapshot> capture(std::string label);
  const std::vector<MemorySnapshot>& snapshots() const noexcept { return snapshots_; }
  static std::string summary(std::span<const MemorySnapshot> snapshots);
  static std::string print_summary(std::span<const MemorySnapshot> snapshots, std::FILE* out = stdout);

  // The session's peak: the highest figures since construction or reset_peak().
  void reset_peak();
  MemoryPeak peak() const;

  // An open phase; its destructor records a PhaseRecord. Phases nest; end them in reverse order.
  class Phase {
   public:
    Phase(Phase&& other) noexcept : profiler_(std::exchange(other.profiler_, nullptr)), index_(other.index_) {}
    Phase& operator=(Phase&&) = delete;
    Phase(const Phase&) = delete;
    ~Phase() { if (profiler_) profiler_->end_phase(index_); }

   private:
    friend class MemoryProfiler;
    Phase(MemoryProfiler* profiler, std::size_t index) : profiler_(profiler), index_(index) {}
    MemoryProfiler* profiler_;
    std::size_t index_;
  };
  [[nodiscard]] Phase phase(std::string name);
  const std::vector<PhaseRecord>& phases() const noexcept { return phases_; }  // in end order

 private:
  struct OpenPhase {
    std::string name;
    MemoryPeak running;  // folded peaks of the pool since the phase began
    std::size_t in_use_before;
    std::chrono::steady_clock::time_point began;
  };
  void fold_pool_peaks();  // raises the session's and every open phase's peak to the pool's
  void end_phase(std::size_t index);

  GpuMemoryPool pool_;
  Device device_;
  std::chrono::steady_clock::time_point began_;
  std::vector<MemorySnapshot> snapshots_;
  MemoryPeak session_;
  std::vector<OpenPhase> open_;
  std::vector<PhaseRecord> phases_;
};

// ---- monitoring helpers ----------------------------------------------------------------------

struct DeviceMemoryStatus {
  std::string label;
  std::size_t total_bytes = 0;
  std::size_t free_bytes = 0;
  std::size_t used_bytes = 0;
  double used_fraction = 0;
  std::string to_string() const;  // "GPU Memory Info (label):\n  Total: …\n  Used: …\n  Free: …"
};
Result<DeviceMemoryStatus> memory_status(const Device& device, std::string label = {},
                                         std::FILE* out = stdout);

struct MonitoringReport {
  std::string label;
  MemorySnapshot before;
  MemorySnapshot after;
  MemoryPeak peak;                 // the pool's peaks while the function ran
  double seconds = 0;
  std::string to_string() const;
};

// Monitoring starts by resetting the pool's peaks on the device (like begin_phase).
Result<MemorySnapshot> begin_monitoring(GpuMemoryPool& pool, const Device& device);
Result<MonitoringReport> end_monitoring(GpuMemoryPool& pool, const Device& device,
                                        MemorySnapshot before, std::string label,
                                        std::chrono::steady_clock::time_point began, std::FILE* out);

template <class R>
struct Monitored {
  R value;
  MonitoringReport report;
};

// Runs f() and reports the memory before, after, the peak between and the time it took.
// Result<MonitoringReport> for a void f, else Result<Monitored<R>>.
template <class F>
auto with_memory_monitoring(GpuMemoryPool& pool, const Device& device, F&& f,
                            std::string label = {}, std::FILE* out = stdout) {
  using R = std::invoke_result_t<F&>;
  using Out = std::conditional_t<std::is_void_v<R>, MonitoringReport, Monitored<R>>;
  auto before = begin_monitoring(pool, device);
  if (!before) return Result<Out>(std::unexpected(before.error()));
  const auto began = std::chrono::steady_clock::now();
  if constexpr (std::is_void_v<R>) {
    f();
    return end_monitoring(pool, device, std::move(*before), std::move(label), began, out);
  } else {
    R value = f();
    auto report = end_monitoring(pool, device, std::move(*before), std::move(label), began, out);
    if (!report) return Result<Out>(std::unexpected(report.error()));
    return Result<Out>(Out{std::move(value), std::move(*report)});
  }
}

struct CleanupReport {
  std::string label;
  MemorySnapshot before;
  MemorySnapshot after;
  std::size_t released_bytes = 0;
  std::string to_string() const;
};
// Waits for pending frees and gives the pool's whole cache on `device` back.
Result<CleanupReport> cleanup_memory(GpuMemoryPool& pool, const Device& device,
                                     std::string label = {}, std::FILE* out = stdout);

}  // namespace gpupool
