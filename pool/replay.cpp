// Replay: a recorded trace driven against a fresh pool, to compare configurations on real
// allocation patterns (peak reserved, fragmentation, time).
module;
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <expected>
#include <fmt/format.h>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>
module gpupool;
import :device_pool;
import :pool_access;
import :recorder;

namespace gpupool {

namespace {

struct Replayer {
  GpuMemoryPool pool;
  Device device;
  ReplayResult result;
  std::unordered_map<std::uint64_t, ManagedBuffer> live;  // by the trace's allocation id

  void alloc(const TraceEvent& event) {
    auto buffer = pool.allocate_bytes(device, event.bytes, device.default_stream());
    if (!buffer) {
      ++result.replay_ooms;
      return;
    }
    ++result.allocations;
    live[event.id] = std::move(*buffer);
  }
  void free(const TraceEvent& event) {
    auto it = live.find(event.id);
    if (event.id == 0 || it == live.end()) {
      ++result.skipped_frees;
      return;
    }
    live.erase(it);
    ++result.frees;
  }
  void trim(const TraceEvent& event) {
    // Trim to what the recording kept: a no-op where this configuration already trimmed itself.
    std::size_t recorded_cached =
        event.reserved_bytes > event.in_use_bytes ? event.reserved_bytes - event.in_use_bytes : 0;
    pool.trim(device, recorded_cached);
    ++result.trims;
  }
  void oom(const TraceEvent& event) {
    ++result.recorded_ooms;
    auto buffer = pool.allocate_bytes(device, event.bytes, device.default_stream());
    if (!buffer) ++result.replay_ooms;  // the buffer, if any, goes at once: the recording had none
  }
  void run(const TraceEvent& event) {
    switch (event.kind) {
      case TraceEventKind::Alloc: alloc(event); break;
      case TraceEventKind::Free: free(event); break;
      case TraceEventKind::Trim: trim(event); break;
      case TraceEventKind::Oom: oom(event); break;
    }
    // After the event, as the recording measured it (three atomic loads, no locks).
    if (!sub_pool) sub_pool = PoolAccess::find(pool, device);
    if (sub_pool) result.peak_reserved = std::max(result.peak_reserved, sub_pool->figures().reserved);
  }
  DevicePool* sub_pool = nullptr;
};

}  // namespace

Result<ReplayResult> replay_trace(const Trace& trace, const Device& device, PoolConfig config) {
  for (const TraceEvent& event : trace.events)
    if (event.kind == TraceEventKind::Alloc && (event.bytes == 0 || event.id == 0))
      return make_error(ErrorKind::InvalidInput,
                        fmt::format("trace event {} allocates {} bytes with id {}: expected at "
                                    "least 1 byte and an id from 1", event.seq, event.bytes, event.id));
  Replayer replay{GpuMemoryPool(std::move(config)), device, {}, {}, nullptr};
  const auto began = std::chrono::steady_clock::now();
  for (const TraceEvent& event : trace.events) replay.run(event);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();

  PoolStats stats = replay.pool.stats(device);
  ReplayResult& r = replay.result;
  r.events = trace.events.size();
  r.recorded_peak_reserved = trace.peak_reserved_bytes();
  r.peak_reserved_within_events = stats.peak_reserved_bytes;
  r.peak_in_use = stats.peak_in_use_bytes;
  r.peak_requested = stats.peak_requested_bytes;
  r.fragmentation = stats.peak_requested_bytes
                        ? static_cast<double>(stats.peak_reserved_bytes) / static_cast<double>(stats.peak_requested_bytes)
                        : 0.0;
  r.external_fragmentation_at_end = stats.fragmentation.external;
  r.seconds = seconds;
  r.ns_per_event = r.events ? seconds * 1e9 / static_cast<double>(r.events) : 0.0;
  r.device = device.describe();
  ReplayResult result = std::move(r);
  replay.live.clear();  // before the pool goes, so its state sees no leaks
  return result;
}

Result<ReplayResult> replay_trace_file(const std::string& path, std::optional<Device> device,
                                       PoolConfig config, std::FILE* out) {
  auto trace = read_trace(path);
  if (!trace) return std::unexpected(trace.error());
  if (!device) {
    std::size_t capacity = 0;
    for (const TraceEvent& event : trace->events) capacity = std::max(capacity, event.limit_bytes);
    auto simulated = Device::simulated({.capacity = capacity ? capacity : std::size_t{1} << 30});
    if (!simulated) return std::unexpected(simulated.error());
    device = *simulated;
  }
  auto result = replay_trace(*trace, *device, std::move(config));
  if (result && out) std::fprintf(out, "%s", result->to_string().c_str());
  return result;
}

std::string ReplayResult::to_string() const {
  return fmt::format(
      "replay on {}\n"
      "  events           {} ({} allocations, {} frees, {} trims; {} frees skipped)\n"
      "  out of memory    {} recorded, {} in the replay\n"
      "  peak reserved    {} (recorded {}); within events {}\n"
      "  peak in use      {}\n"
      "  peak requested   {}\n"
      "  fragmentation    {:.4f} (peak reserved / peak requested); external at end {:.4f}\n"
      "  time             {:.6f} s ({:.1f} ns per event)\n",
      device, events, allocations, frees, trims, skipped_frees, recorded_ooms, replay_ooms,
      format_bytes(peak_reserved), format_bytes(recorded_peak_reserved),
      format_bytes(peak_reserved_within_events), format_bytes(peak_in_use),
      format_bytes(peak_requested), fragmentation, external_fragmentation_at_end, seconds, ns_per_event);
}

}  // namespace gpupool
