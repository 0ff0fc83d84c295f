// gpupool:tracing — who holds the memory, and what happened to it.
//
// Both features are opt-in per pool (enable_tracing) and cost the allocation path one branch
// while off:
//   leak tracing  every live buffer with its label, size, stream, time and call site (and, when
//                 asked, a stack trace); dumped on demand, and reported when the last handle of a
//                 pool goes while buffers are still live
//   history       a ring buffer of alloc / free / trim / OOM events with the pool's figures after
//                 each, exported as a trace file (CSV or JSON) and replayed against any pool
//                 configuration (replay_trace) to compare configurations on real traces
// Call sites come from GpuMemoryPool::get_managed_buffer's defaulted std::source_location;
// labels from an AllocationLabel scope on the allocating thread.
module;
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>
export module gpupool:tracing;
import :error;
import :precision;
import :device;
import :pool;

export namespace gpupool {

struct LiveAllocation {
  std::uint64_t id = 0;            // the allocation's number in the pool's trace (from 1)
  int device_id = -1;
  const void* ptr = nullptr;
  std::size_t requested_bytes = 0;
  std::size_t block_bytes = 0;     // its size class
  Precision precision = Precision::Bytes;
  std::uintptr_t stream = 0;       // the native stream handle (0 = default stream)
  double seconds = 0;              // when, in seconds since tracing was enabled
  std::string label;               // the innermost AllocationLabel, empty when none
  std::string file;                // call site of get_managed_buffer / allocate_bytes
  std::uint32_t line = 0;
  std::string function;
  std::string stack_trace;         // only with TracingConfig::capture_stack_traces
};

struct TracingConfig {
  bool track_allocations = true;      // keep the live allocations (leak tracing)
  bool capture_stack_traces = false;  // Boost.Stacktrace at every allocation: slow, for hunts
  std::size_t history_capacity = 0;   // events kept in the ring buffer; 0 = no history
  // Called when the pool's last handle goes with buffers still live; nullptr = print to stderr.
  std::function<void(const std::vector<LiveAllocation>&)> on_leaks;
};

// Turns tracing on (or changes its settings: live allocations and history start afresh).
// InvalidInput for capture_stack_traces without track_allocations.
Result<void> enable_tracing(GpuMemoryPool& pool, TracingConfig config);
// Turns the hooks off; what was recorded stays readable.
void disable_tracing(GpuMemoryPool& pool);
// Live allocations made while tracing was on, oldest first.
std::vector<LiveAllocation> live_allocations(const GpuMemoryPool& pool);
// "2 live allocations, 1.25 MiB: ..." one line each, with call site and label.
std::string format_live_allocations(const std::vector<LiveAllocation>& live);

// Names the allocations this thread makes while it lives (nested scopes: the innermost wins).
class AllocationLabel {
 public:
  explicit AllocationLabel(std::string label);
  ~AllocationLabel();
  AllocationLabel(const AllocationLabel&) = delete;
  AllocationLabel& operator=(const AllocationLabel&) = delete;

 private:
  std::string previous_;
};
std::string current_allocation_label();

// ---- history -----------------------------------------------------------------------------------

enum class TraceEventKind : std::uint8_t { Alloc, Free, Trim, Oom };
std::string_view to_string(TraceEventKind kind) noexcept;

struct TraceEvent {
  std::uint64_t seq = 0;            // event number in the pool, from 0
  std::uint64_t time_ns = 0;        // since tracing was enabled
  TraceEventKind kind = TraceEventKind::Alloc;
  int device_id = -1;
  std::uint64_t id = 0;             // allocation id (Alloc, Free; 0 = made before tracing)
  std::size_t bytes = 0;            // requested (Alloc, Oom), block (Free), released (Trim)
  std::size_t block_bytes = 0;      // size class (Alloc, Free)
  Precision precision = Precision::Bytes;
  std::uintptr_t stream = 0;
  // The device's pool after the event. limit = the hard limit, else the device's capacity.
  std::size_t in_use_bytes = 0;
  std::size_t reserved_bytes = 0;
  std::size_t limit_bytes = 0;
  friend bool operator==(const TraceEvent&, const TraceEvent&) = default;
};

struct Trace {
  std::vector<TraceEvent> events;  // oldest first
  std::uint64_t dropped = 0;       // events the ring buffer overwrote before this was taken
  // The largest reserved bytes after any event: the peak a replay must reproduce.
  std::size_t peak_reserved_bytes() const noexcept;
};

enum class TraceFormat : std::uint8_t { Csv, Json };

// The pool's history so far (empty without history_capacity).
Trace history(const GpuMemoryPool& pool);
std::string to_csv(const Trace& trace);
std::string to_json(const Trace& trace);
// Parses what to_csv / to_json wrote (the format is told by the first character). InvalidInput
// names the line or field that is wrong.
Result<Trace> parse_trace(std::string_view text);
Result<void> write_trace(const Trace& trace, const std::string& path, TraceFormat format);
Result<Trace> read_trace(const std::string& path);

// ---- replay ------------------------------------------------------------------------------------

struct ReplayResult {
  std::size_t events = 0;
  std::size_t allocations = 0;       // Alloc events that succeeded in the replay
  std::size_t frees = 0;
  std::size_t trims = 0;
  std::size_t recorded_ooms = 0;     // Oom events in the trace
  std::size_t replay_ooms = 0;       // allocations that failed in the replay
  std::size_t skipped_frees = 0;     // frees of allocations unknown to the replay
  // Reserved bytes after each event, as the trace records them: the replay's peak of these is
  // the figure to compare with the recorded one (equal for the same configuration and device).
  std::size_t recorded_peak_reserved = 0;
  std::size_t peak_reserved = 0;
  // The pool's own peak, which also sees the moment inside an allocation between taking a new
  // block and the critical-pressure trim that may follow it.
  std::size_t peak_reserved_within_events = 0;
  std::size_t peak_in_use = 0;
  std::size_t peak_requested = 0;
  // peak reserved / peak requested (1 = no overhead; the figure peers quote), and the external
  // fragmentation of the cache at the end.
  double fragmentation = 0;
  double external_fragmentation_at_end = 0;
  double seconds = 0;
  double ns_per_event = 0;
  std::string device;                // Device::describe()
  std::string to_string() const;
};

// Replays Alloc / Free / Trim / Oom events (all devices' onto `device`, in the default stream)
// against a fresh pool with `config`. Trim events trim down to the recorded cached bytes; an
// Oom event tries its allocation again (freed at once if it succeeds now).
Result<ReplayResult> replay_trace(const Trace& trace, const Device& device, PoolConfig config = {});
// The whole replay from a file: on `device`, or on a simulated device as large as the largest
// limit in the trace when none is given. Prints the result to `out` when it is not null.
Result<ReplayResult> replay_trace_file(const std::string& path, std::optional<Device> device = {},
                                       PoolConfig config = {}, std::FILE* out = nullptr);

}  // namespace gpupool
