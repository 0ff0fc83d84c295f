// MemoryProfiler, snapshots, phases, and the monitoring helpers (memory_status and others).
module;
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <expected>
#include <fmt/format.h>
#include <span>
#include <string>
#include <utility>
#include <vector>
module gpupool;

namespace gpupool {

namespace {

double percent(std::size_t part, std::size_t whole) {
  return whole ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0;
}

MemoryPeak peaks_of(const PoolStats& s) {
  return {s.peak_in_use_bytes, s.peak_requested_bytes, s.peak_reserved_bytes};
}

void raise(MemoryPeak& peak, const MemoryPeak& other) {
  peak.in_use_bytes = std::max(peak.in_use_bytes, other.in_use_bytes);
  peak.requested_bytes = std::max(peak.requested_bytes, other.requested_bytes);
  peak.reserved_bytes = std::max(peak.reserved_bytes, other.reserved_bytes);
}

void print_to(std::FILE* out, const std::string& text) {
  if (out) std::fputs(text.c_str(), out);
}

double seconds_since(std::chrono::steady_clock::time_point began) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
}

}  // namespace

// ---- snapshots --------------------------------------------------------------------------------

Result<MemorySnapshot> capture_snapshot(const GpuMemoryPool& pool, const Device& device,
                                        std::string label) {
  auto memory = device.memory_info();
  if (!memory) return std::unexpected(memory.error().with_context("memory snapshot \"" + label + "\""));
  PoolStats s = pool.stats(device);
  MemorySnapshot snapshot;
  snapshot.label = std::move(label);
  snapshot.device_id = device.id();
  snapshot.device_free_bytes = memory->free;
  snapshot.device_total_bytes = memory->total;
  snapshot.in_use_bytes = s.in_use_bytes;
  snapshot.requested_bytes = s.requested_bytes;
  snapshot.cached_bytes = s.cached_bytes;
  snapshot.reserved_bytes = s.reserved_bytes;
  snapshot.live_buffers = s.live_buffers;
  snapshot.fragmentation = s.fragmentation;
  snapshot.largest_free_block = memory->free;
  return snapshot;
}

std::string MemorySnapshot::to_string() const {
  const std::size_t used = device_total_bytes - std::min(device_free_bytes, device_total_bytes);
  return fmt::format(
      "{} (device {}, {:.3f} s):\n"
      "  Device:        {} free of {} ({:.1f}% used)\n"
      "  Pool:          in use {}, cached {}, reserved {}, {} live buffers\n"
      "  Fragmentation: external {:.1f}%, internal {:.1f}%, largest free block {}\n",
      label, device_id, seconds, format_bytes(device_free_bytes), format_bytes(device_total_bytes),
      percent(used, device_total_bytes), format_bytes(in_use_bytes), format_bytes(cached_bytes),
      format_bytes(reserved_bytes), live_buffers, 100.0 * fragmentation.external,
      100.0 * fragmentation.internal, format_bytes(largest_free_block));
}

// ---- MemoryProfiler ---------------------------------------------------------------------------

MemoryProfiler::MemoryProfiler(GpuMemoryPool pool, Device device)
    : pool_(std::move(pool)), device_(std::move(device)), began_(std::chrono::steady_clock::now()) {
  reset_peak();
}

Result<MemorySnapshot> MemoryProfiler::capture(std::string label) {
  auto snapshot = capture_snapshot(pool_, device_, std::move(label));
  if (!snapshot) return snapshot;
  snapshot->seconds = seconds_since(began_);
  snapshots_.push_back(*snapshot);
  return snapshot;
}

std::string MemoryProfiler::summary(std::span<const MemorySnapshot> snapshots) {
  std::string text;
  const MemorySnapshot* highest = nullptr;
  for (const MemorySnapshot& s : snapshots) {
    text += s.to_string() + "\n";
    if (!highest || s.reserved_bytes > highest->reserved_bytes) highest = &s;
  }
  if (highest)
    text += fmt::format("Peak reserved: {} ({})\n", format_bytes(highest->reserved_bytes), highest->label);
  else
    text += "No snapshots.\n";
  return text;
}

std::string MemoryProfiler::print_summary(std::span<const MemorySnapshot> snapshots, std::FILE* out) {
  std::string text = summary(snapshots);
  print_to(out, text);
  return text;
}

void MemoryProfiler::fold_pool_peaks() {
  const MemoryPeak pool_peak = peaks_of(pool_.stats(device_));
  raise(session_, pool_peak);
  for (OpenPhase& open : open_) raise(open.running, pool_peak);
}

void MemoryProfiler::reset_peak() {
  fold_pool_peaks();  // open phases keep what they saw
  pool_.reset_peaks(device_);
  session_ = peaks_of(pool_.stats(device_));
}

MemoryPeak MemoryProfiler::peak() const {
  MemoryPeak peak = session_;
  raise(peak, peaks_of(pool_.stats(device_)));
  return peak;
}

MemoryProfiler::Phase MemoryProfiler::phase(std::string name) {
  fold_pool_peaks();
  pool_.begin_phase(device_);
  const PoolStats now = pool_.stats(device_);
  open_.push_back({std::move(name), peaks_of(now), now.in_use_bytes, std::chrono::steady_clock::now()});
  return Phase(this, open_.size() - 1);
}

void MemoryProfiler::end_phase(std::size_t index) {
  fold_pool_peaks();
  const std::size_t in_use = pool_.stats(device_).in_use_bytes;
  while (open_.size() > index) {  // phases left open inside this one end with it
    OpenPhase& open = open_.back();
    phases_.push_back({std::move(open.name), static_cast<int>(open_.size() - 1), open.running,
                       open.in_use_before, in_use, seconds_since(open.began)});
    open_.pop_back();
  }
}

// ---- monitoring helpers -----------------------------------------------------------------------

std::string DeviceMemoryStatus::to_string() const {
  const double mb = 1e6;  // decimal megabytes, as tools that print MB usually mean
  return fmt::format("GPU Memory Info{}:\n  Total: {:.1f} MB\n  Used:  {:.1f} MB ({:.1f}%)\n"
                     "  Free:  {:.1f} MB ({:.1f}%)\n",
                     label.empty() ? "" : " (" + label + ")", static_cast<double>(total_bytes) / mb,
                     static_cast<double>(used_bytes) / mb, 100.0 * used_fraction,
                     static_cast<double>(free_bytes) / mb, percent(free_bytes, total_bytes));
}

Result<DeviceMemoryStatus> memory_status(const Device& device, std::string label, std::FILE* out) {
  auto memory = device.memory_info();
  if (!memory) return std::unexpected(memory.error());
  DeviceMemoryStatus status{std::move(label), memory->total, memory->free,
                            memory->total - std::min(memory->free, memory->total), 0.0};
  status.used_fraction = percent(status.used_bytes, status.total_bytes) / 100.0;
  print_to(out, status.to_string());
  return status;
}

Result<MemorySnapshot> begin_monitoring(GpuMemoryPool& pool, const Device& device) {
  pool.begin_phase(device);
  return capture_snapshot(pool, device, "before");
}

Result<MonitoringReport> end_monitoring(GpuMemoryPool& pool, const Device& device,
                                        MemorySnapshot before, std::string label,
                                        std::chrono::steady_clock::time_point began, std::FILE* out) {
  const double seconds = seconds_since(began);
  auto after = capture_snapshot(pool, device, "after");
  if (!after) return std::unexpected(after.error());
  after->seconds = seconds;
  MonitoringReport report{std::move(label), std::move(before), std::move(*after),
                          peaks_of(pool.stats(device)), seconds};
  print_to(out, report.to_string());
  return report;
}

std::string MonitoringReport::to_string() const {
  const auto change = static_cast<long long>(after.in_use_bytes) - static_cast<long long>(before.in_use_bytes);
  return fmt::format("Monitoring {}:\n{}{}Pool in use change: {}{}\nPeak in use: {}, peak reserved: {}\n"
                     "Execution time: {:.6f} s\n",
                     label.empty() ? "(unlabelled)" : label, before.to_string(), after.to_string(),
                     change < 0 ? "-" : "+",
                     format_bytes(static_cast<std::uint64_t>(change < 0 ? -change : change)),
                     format_bytes(peak.in_use_bytes), format_bytes(peak.reserved_bytes), seconds);
}

std::string CleanupReport::to_string() const {
  return fmt::format("Cleanup {}: released {}\n{}{}", label.empty() ? "(unlabelled)" : label,
                     format_bytes(released_bytes), before.to_string(), after.to_string());
}

Result<CleanupReport> cleanup_memory(GpuMemoryPool& pool, const Device& device, std::string label,
                                     std::FILE* out) {
  auto before = capture_snapshot(pool, device, "before cleanup");
  if (!before) return std::unexpected(before.error());
  const std::size_t released = pool.emergency_cleanup(device);
  auto after = capture_snapshot(pool, device, "after cleanup");
  if (!after) return std::unexpected(after.error());
  CleanupReport report{std::move(label), std::move(*before), std::move(*after), released};
  print_to(out, report.to_string());
  return report;
}

}  // namespace gpupool
