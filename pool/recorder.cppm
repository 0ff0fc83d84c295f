// PoolRecorder: what tracing keeps for one pool (all its devices) — the live allocations (leak
// tracing) and the ring buffer of events (history). DevicePool calls one on_* hook per event,
// only while tracing is on (PoolPolicies::recorder is not null); everything here is under one
// mutex, which is fine for a diagnostic mode and keeps the events in one order.
//   pool/allocation_tracker.cpp   hooks, live allocations, leak report
//   pool/event_history.cpp        ring buffer, trace export and parsing
module;
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <source_location>
#include <unordered_map>
#include <vector>
module gpupool:recorder;
import :precision;
import :device;
import :tracing;

namespace gpupool {

// A device pool's figures after an event. limit = the hard limit, else the device's capacity.
struct PoolFigures {
  std::size_t in_use = 0;
  std::size_t reserved = 0;
  std::size_t limit = 0;
};

class PoolRecorder {
 public:
  explicit PoolRecorder(TracingConfig config);
  void configure(TracingConfig config);  // starts afresh

  void on_allocate(const Device& device, const void* ptr, std::size_t requested_bytes,
                   std::size_t block_bytes, Precision precision, void* stream,
                   const std::source_location& where, PoolFigures after);
  void on_free(const Device& device, const void* ptr, std::size_t block_bytes, PoolFigures after);
  void on_trim(const Device& device, std::size_t released_bytes, PoolFigures after);
  void on_oom(const Device& device, std::size_t requested_bytes, Precision precision,
              void* stream, PoolFigures after);

  std::vector<LiveAllocation> live() const;
  Trace history() const;
  // The pool's last handle is going: hands the live allocations to on_leaks (or stderr).
  void report_leaks();

 private:
  void record(TraceEvent event);  // mutex_ held
  std::uint64_t now_ns() const;

  mutable std::mutex mutex_;
  TracingConfig config_;
  // Read by the hooks before they take the lock (labels and stack walks are made outside it).
  std::atomic<bool> track_allocations_{false}, capture_stack_traces_{false};
  std::chrono::steady_clock::time_point start_;
  // The call site stays a source_location (static strings) until live() is asked: no string
  // copies on the allocation path.
  struct LiveRecord {
    LiveAllocation allocation;
    std::source_location where;
  };
  std::unordered_map<const void*, LiveRecord> live_;
  std::uint64_t next_id_ = 1;
  // History: a ring of config_.history_capacity events; ring_[next_seq_ % capacity] is next.
  std::vector<TraceEvent> ring_;
  std::uint64_t next_seq_ = 0;
};

}  // namespace gpupool
