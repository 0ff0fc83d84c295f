// memory_report: per-device figures, the busiest size classes, recommendations; text and JSON.
module;
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <fmt/format.h>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>
module gpupool;
import :device_pool;
import :pool_access;
import :thread_cache;
import :size_classes;

namespace gpupool {

namespace sc = size_classes;

std::vector<SizeClassActivity> DevicePool::class_activity() const {
  std::vector<SizeClassActivity> active;
  const std::vector<ClassFigures> classes = class_figures();
  for (std::uint32_t c = 0; c < classes.size(); ++c) {
    const ClassCounters& n = classes[c].counted;
    if (n.allocations || classes[c].cached_blocks)
      active.push_back({sc::class_bytes(c), n.allocations, n.hits, n.allocations - n.hits,
                        n.allocations - n.frees, classes[c].cached_blocks});
  }
  return active;
}

namespace {

constexpr std::size_t kBusiestClasses = 5;

std::vector<SizeClassActivity> busiest_classes(const GpuMemoryPool& pool, const Device& device) {
  DevicePool* sub_pool = PoolAccess::find(pool, device);
  if (!sub_pool) return {};
  std::vector<SizeClassActivity> classes = sub_pool->class_activity();
  std::sort(classes.begin(), classes.end(), [](const auto& a, const auto& b) {
    return a.allocations != b.allocations ? a.allocations > b.allocations : a.block_bytes < b.block_bytes;
  });
  if (classes.size() > kBusiestClasses) classes.resize(kBusiestClasses);
  return classes;
}

Result<DeviceReport> device_report(const GpuMemoryPool& pool, const Device& device) {
  auto memory = device.memory_info();
  if (!memory) return std::unexpected(memory.error().with_context("memory report"));
  DeviceReport r;
  r.device_id = device.id();
  r.name = device.properties().name;
  r.total_bytes = memory->total;
  r.free_bytes = memory->free;
  r.used_bytes = memory->total - std::min(memory->free, memory->total);
  r.utilization = r.total_bytes ? static_cast<double>(r.used_bytes) / static_cast<double>(r.total_bytes) : 0.0;
  r.limit = pool.max_pool_size(device);
  r.pressure = pool.memory_pressure(device);
  r.pool = pool.stats(device);
  r.largest_free_block = memory->free;
  r.busiest_classes = busiest_classes(pool, device);
  r.recommendations = recommend(r);
  return r;
}

std::string percent(double share) { return fmt::format("{:.1f}%", 100.0 * share); }

}  // namespace

std::string_view to_string(Severity severity) noexcept {
  switch (severity) {
    case Severity::Ok: return "ok";
    case Severity::Warning: return "warning";
    case Severity::Critical: return "critical";
  }
  return "?";
}

// ---- recommendations --------------------------------------------------------------------------

std::vector<Recommendation> recommend(const DeviceReport& r) {
  std::vector<Recommendation> out;
  const PoolStats& s = r.pool;
  if (r.utilization >= 0.9)
    out.push_back({Severity::Critical,
                   fmt::format("device memory {} used (under 10% free): split the work with "
                               "auto_chunk or lower the batch size before the next allocation fails",
                               percent(r.utilization))});
  else if (r.utilization >= 0.8)
    out.push_back({Severity::Warning,
                   fmt::format("device memory {} used (under 20% free): check will_oom before large "
                               "allocations", percent(r.utilization))});
  else
    out.push_back({Severity::Ok, fmt::format("memory usage healthy ({} used)", percent(r.utilization))});
  if (r.limit && r.pressure >= 0.8)
    out.push_back({r.pressure >= 0.9 ? Severity::Critical : Severity::Warning,
                   fmt::format("the pool holds {} of its limit of {}: new blocks trim the cache first, "
                               "then fail; raise the limit (set_max_pool_size, GPUPOOL_MEMORY_LIMIT) "
                               "or split the work with auto_chunk",
                               percent(r.pressure), format_bytes(*r.limit))});
  if (s.out_of_memory_errors)
    out.push_back({Severity::Critical,
                   fmt::format("{} out-of-memory error{} so far: plan with auto_chunk and keep a "
                               "margin (fraction 0.7)", s.out_of_memory_errors,
                               s.out_of_memory_errors == 1 ? "" : "s")});
  if (s.cached_bytes && s.fragmentation.external >= 0.5)
    out.push_back({Severity::Warning,
                   fmt::format("{} cached over {} size classes (external fragmentation {}): trim() "
                               "or max_cached_bytes gives the cold classes back",
                               format_bytes(s.cached_bytes), s.fragmentation.cached_classes,
                               percent(s.fragmentation.external))});
  if (s.in_use_bytes && s.fragmentation.internal >= 0.05)
    out.push_back({Severity::Warning,
                   fmt::format("{} of the memory in use is size-class rounding: sizes just above a "
                               "class boundary waste most; round buffer sizes to the class sizes",
                               percent(s.fragmentation.internal))});
  if (s.allocations >= 100 && s.hit_rate() < 0.5)
    out.push_back({Severity::Warning,
                   fmt::format("cache hit rate {} over {} allocations: buffer sizes vary a lot; an "
                               "initial_reservation of the common size warms the cache",
                               percent(s.hit_rate()), s.allocations)});
  if (!r.limit && r.utilization >= 0.8)
    out.push_back({Severity::Warning,
                   "no pool limit on this device: GPUPOOL_MEMORY_LIMIT (e.g. 80%) leaves room for "
                   "other processes"});
  return out;
}

// ---- the report -------------------------------------------------------------------------------

Result<MemoryReport> memory_report(const GpuMemoryPool& pool, std::span<const Device> devices) {
  MemoryReport report;
  for (const Device& device : devices) {
    auto one = device_report(pool, device);
    if (!one) return std::unexpected(one.error());
    report.devices.push_back(std::move(*one));
  }
  return report;
}

Result<MemoryReport> memory_report(const GpuMemoryPool& pool, const Device& device) {
  return memory_report(pool, std::span<const Device>(&device, 1));
}

std::string to_text(const MemoryReport& report) {
  std::string text;
  for (const DeviceReport& r : report.devices) {
    const PoolStats& s = r.pool;
    text += fmt::format("== GPU Memory Report (device {}: {}) ==\n", r.device_id, r.name);
    text += fmt::format("Memory:\n  Total:        {}\n  Used:         {}\n  Free:         {}\n"
                        "  Utilization:  {}\n",
                        format_bytes(r.total_bytes), format_bytes(r.used_bytes),
                        format_bytes(r.free_bytes), percent(r.utilization));
    text += fmt::format("Pool:\n  In use:       {} (requested {}, {} live buffers)\n"
                        "  Cached:       {}\n  Reserved:     {}\n  Peak:         in use {}, reserved {}\n"
                        "  Limit:        {}\n  Pressure:     {}\n"
                        "  Traffic:      {} allocations, {} frees, hit rate {}, {} device "
                        "allocations, {} trims, {} OOM errors\n",
                        format_bytes(s.in_use_bytes), format_bytes(s.requested_bytes), s.live_buffers,
                        format_bytes(s.cached_bytes), format_bytes(s.reserved_bytes),
                        format_bytes(s.peak_in_use_bytes), format_bytes(s.peak_reserved_bytes),
                        r.limit ? format_bytes(*r.limit) : "none (the device's capacity)",
                        percent(r.pressure), s.allocations, s.frees, percent(s.hit_rate()),
                        s.device_allocations, s.trims, s.out_of_memory_errors);
    text += fmt::format("Fragmentation:\n  External:     {} ({} cached classes, largest cached "
                        "block {})\n  Internal:     {}\n  Largest free block: {}\n",
                        percent(s.fragmentation.external), s.fragmentation.cached_classes,
                        format_bytes(s.fragmentation.largest_cached_block),
                        percent(s.fragmentation.internal), format_bytes(r.largest_free_block));
    text += "Busiest size classes:\n";
    if (r.busiest_classes.empty()) text += "  (none)\n";
    for (const SizeClassActivity& c : r.busiest_classes)
      text += fmt::format("  {:>12} B  {} allocations ({} hits, {} misses), {} live, {} cached\n",
                          c.block_bytes, c.allocations, c.hits, c.misses, c.live_blocks, c.cached_blocks);
    text += "Recommendations:\n";
    for (const Recommendation& rec : r.recommendations)
      text += fmt::format("  [{}] {}\n", to_string(rec.severity), rec.text);
  }
  return text;
}

std::string to_json(const MemoryReport& report) {
  nlohmann::json devices = nlohmann::json::array();
  for (const DeviceReport& r : report.devices) {
    const PoolStats& s = r.pool;
    nlohmann::json classes = nlohmann::json::array();
    for (const SizeClassActivity& c : r.busiest_classes)
      classes.push_back({{"block_bytes", c.block_bytes}, {"allocations", c.allocations},
                         {"hits", c.hits}, {"misses", c.misses}, {"live_blocks", c.live_blocks},
                         {"cached_blocks", c.cached_blocks}});
    nlohmann::json recommendations = nlohmann::json::array();
    for (const Recommendation& rec : r.recommendations)
      recommendations.push_back({{"severity", to_string(rec.severity)}, {"text", rec.text}});
    devices.push_back({
        {"device_id", r.device_id}, {"name", r.name}, {"total_bytes", r.total_bytes},
        {"free_bytes", r.free_bytes}, {"used_bytes", r.used_bytes}, {"utilization", r.utilization},
        {"limit", r.limit ? nlohmann::json(*r.limit) : nlohmann::json(nullptr)},
        {"pressure", r.pressure}, {"largest_free_block", r.largest_free_block},
        {"pool",
         {{"in_use_bytes", s.in_use_bytes}, {"requested_bytes", s.requested_bytes},
          {"cached_bytes", s.cached_bytes}, {"reserved_bytes", s.reserved_bytes},
          {"peak_in_use_bytes", s.peak_in_use_bytes}, {"peak_reserved_bytes", s.peak_reserved_bytes},
          {"allocations", s.allocations}, {"frees", s.frees}, {"cache_hits", s.cache_hits},
          {"cache_misses", s.cache_misses}, {"device_allocations", s.device_allocations},
          {"trims", s.trims}, {"out_of_memory_errors", s.out_of_memory_errors},
          {"live_buffers", s.live_buffers}, {"hit_rate", s.hit_rate()}}},
        {"fragmentation",
         {{"internal", s.fragmentation.internal}, {"external", s.fragmentation.external},
          {"largest_cached_block", s.fragmentation.largest_cached_block},
          {"cached_classes", s.fragmentation.cached_classes}}},
        {"busiest_classes", std::move(classes)},
        {"recommendations", std::move(recommendations)}});
  }
  return nlohmann::json{{"devices", std::move(devices)}}.dump(2);
}

}  // namespace gpupool
