// Leak tracing: PoolRecorder's hooks, the live allocations, the leak report, allocation labels,
// and the public switches of gpupool:tracing.
module;
#include <algorithm>
#include <atomic>
#include <boost/stacktrace.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <expected>
#include <fmt/format.h>
#include <functional>
#include <memory>
#include <mutex>
#include <source_location>
#include <sstream>
#include <string>
#include <utility>
#include <unordered_map>
#include <vector>
module gpupool;
import :device_pool;
import :pool_policies;
import :pool_state;
import :pool_access;
import :recorder;

namespace gpupool {

namespace {
thread_local std::string current_label;  // the innermost AllocationLabel of this thread

std::uintptr_t stream_number(void* stream) noexcept { return reinterpret_cast<std::uintptr_t>(stream); }
}  // namespace

AllocationLabel::AllocationLabel(std::string label) : previous_(std::exchange(current_label, std::move(label))) {}
AllocationLabel::~AllocationLabel() { current_label = std::move(previous_); }
std::string current_allocation_label() { return current_label; }

// ---- PoolRecorder: hooks ------------------------------------------------------------------------

PoolRecorder::PoolRecorder(TracingConfig config) { configure(std::move(config)); }

void PoolRecorder::configure(TracingConfig config) {
  std::lock_guard lock(mutex_);
  config_ = std::move(config);
  track_allocations_.store(config_.track_allocations);
  capture_stack_traces_.store(config_.capture_stack_traces);
  start_ = std::chrono::steady_clock::now();
  live_.clear();
  next_id_ = 1;
  ring_.assign(config_.history_capacity, TraceEvent{});
  next_seq_ = 0;
}

std::uint64_t PoolRecorder::now_ns() const {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count());
}

void PoolRecorder::on_allocate(const Device& device, const void* ptr, std::size_t requested_bytes,
                               std::size_t block_bytes, Precision precision, void* stream,
                               const std::source_location& where, PoolFigures after) {
  // The costly parts (strings, a stack walk) are made before taking the lock.
  std::string label, stack;
  const bool track = track_allocations_.load();
  if (track) label = current_label;
  if (track && capture_stack_traces_.load()) {
    std::ostringstream text;
    text << boost::stacktrace::stacktrace();
    stack = text.str();
  }
  std::lock_guard lock(mutex_);
  const std::uint64_t id = next_id_++;
  const std::uint64_t time = now_ns();
  live_[ptr] = LiveRecord{LiveAllocation{id, device.id(), ptr, requested_bytes, block_bytes, precision,
                                         stream_number(stream), static_cast<double>(time) * 1e-9,
                                         std::move(label), {}, 0, {}, std::move(stack)},
                          where};
  record({0, time, TraceEventKind::Alloc, device.id(), id, requested_bytes, block_bytes, precision,
          stream_number(stream), after.in_use, after.reserved, after.limit});
}

void PoolRecorder::on_free(const Device& device, const void* ptr, std::size_t block_bytes,
                           PoolFigures after) {
  std::lock_guard lock(mutex_);
  TraceEvent event{0, now_ns(), TraceEventKind::Free, device.id(), 0, block_bytes, block_bytes,
                   Precision::Bytes, 0, after.in_use, after.reserved, after.limit};
  if (auto it = live_.find(ptr); it != live_.end()) {  // else: allocated before tracing began
    event.id = it->second.allocation.id;
    event.precision = it->second.allocation.precision;
    event.stream = it->second.allocation.stream;
    live_.erase(it);
  }
  record(event);
}

void PoolRecorder::on_trim(const Device& device, std::size_t released_bytes, PoolFigures after) {
  std::lock_guard lock(mutex_);
  record({0, now_ns(), TraceEventKind::Trim, device.id(), 0, released_bytes, 0, Precision::Bytes, 0,
          after.in_use, after.reserved, after.limit});
}

void PoolRecorder::on_oom(const Device& device, std::size_t requested_bytes, Precision precision,
                          void* stream, PoolFigures after) {
  std::lock_guard lock(mutex_);
  record({0, now_ns(), TraceEventKind::Oom, device.id(), 0, requested_bytes, 0, precision,
          stream_number(stream), after.in_use, after.reserved, after.limit});
}

// ---- live allocations and leaks -----------------------------------------------------------------

std::vector<LiveAllocation> PoolRecorder::live() const {
  std::vector<LiveAllocation> all;
  {
    std::lock_guard lock(mutex_);
    if (!config_.track_allocations) return all;
    all.reserve(live_.size());
    for (const auto& [ptr, record] : live_) {
      all.push_back(record.allocation);
      all.back().file = record.where.file_name();
      all.back().line = record.where.line();
      all.back().function = record.where.function_name();
    }
  }
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  return all;
}

void PoolRecorder::report_leaks() {
  std::vector<LiveAllocation> leaks = live();
  if (leaks.empty()) return;
  std::function<void(const std::vector<LiveAllocation>&)> sink;
  {
    std::lock_guard lock(mutex_);
    sink = config_.on_leaks;
  }
  if (sink) {
    sink(leaks);
    return;
  }
  std::fprintf(stderr, "gpupool: a pool was destroyed with buffers still live (they return to the "
                       "device when they go):\n%s", format_live_allocations(leaks).c_str());
}

std::string format_live_allocations(const std::vector<LiveAllocation>& live) {
  std::size_t bytes = 0;
  for (const LiveAllocation& a : live) bytes += a.requested_bytes;
  std::string text = fmt::format("{} live allocation{}, {} requested\n", live.size(),
                                 live.size() == 1 ? "" : "s", format_bytes(bytes));
  for (const LiveAllocation& a : live) {
    text += fmt::format("  #{} device {} {} {} (block {}) stream {:#x} at {:.6f} s, label \"{}\", "
                        "allocated at {}:{} in {}\n",
                        a.id, a.device_id, format_bytes(a.requested_bytes), to_string(a.precision),
                        format_bytes(a.block_bytes), a.stream, a.seconds, a.label, a.file, a.line,
                        a.function);
    if (!a.stack_trace.empty()) text += a.stack_trace;
  }
  return text;
}

// ---- the public switches ------------------------------------------------------------------------

Result<void> enable_tracing(GpuMemoryPool& pool, TracingConfig config) {
  if (config.capture_stack_traces && !config.track_allocations)
    return make_error(ErrorKind::InvalidInput,
                      "capture_stack_traces is true but track_allocations is false: expected "
                      "track_allocations for stack traces (they belong to live allocations)");
  PoolPolicies& policies = PoolAccess::policies(pool);
  std::lock_guard lock(policies.mutex);
  if (!policies.recorder_owner)
    policies.recorder_owner = std::make_shared<PoolRecorder>(std::move(config));
  else
    policies.recorder_owner->configure(std::move(config));
  policies.recorder.store(policies.recorder_owner.get(), std::memory_order_release);
  return {};
}

void disable_tracing(GpuMemoryPool& pool) {
  PoolAccess::policies(pool).recorder.store(nullptr, std::memory_order_release);
}

std::vector<LiveAllocation> live_allocations(const GpuMemoryPool& pool) {
  PoolPolicies& policies = PoolAccess::policies(pool);
  std::lock_guard lock(policies.mutex);
  return policies.recorder_owner ? policies.recorder_owner->live() : std::vector<LiveAllocation>{};
}

}  // namespace gpupool
