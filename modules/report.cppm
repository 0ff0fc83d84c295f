// gpupool:report — one call that says where a pool's memory is, for a person and for a program.
//
//   memory_report(pool, devices)   figures per device: device memory, the pool's in use / cached /
//                                  reserved and peaks, fragmentation, the busiest size classes and
//                                  recommendations (what to change when memory runs short)
//   to_text(report) / to_json(report)   the same figures as a box of text or as JSON
//
// "Largest free block" is the device's free memory: exact on the simulated device; on CUDA,
// cudaMemGetInfo reports free bytes, not the largest contiguous range, so an allocation that
// size can still fail when the device is fragmented.
module;
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>
export module gpupool:report;
import :error;
import :device;
import :pool;

export namespace gpupool {

// One size class's traffic in a device's pool.
struct SizeClassActivity {
  std::size_t block_bytes = 0;
  std::uint64_t allocations = 0;
  std::uint64_t hits = 0;
  std::uint64_t misses = 0;
  std::size_t live_blocks = 0;
  std::size_t cached_blocks = 0;
};

enum class Severity : std::uint8_t { Ok, Warning, Critical };

struct Recommendation {
  Severity severity = Severity::Ok;
  std::string text;
};

struct DeviceReport {
  int device_id = -1;
  std::string name;
  std::size_t total_bytes = 0;
  std::size_t free_bytes = 0;
  std::size_t used_bytes = 0;          // by anyone: this pool, other pools, other processes
  double utilization = 0;              // used / total
  std::optional<std::size_t> limit;    // the pool's hard limit on this device
  double pressure = 0;                 // reserved / (limit, else total)
  PoolStats pool;
  std::size_t largest_free_block = 0;  // see the note above
  std::vector<SizeClassActivity> busiest_classes;  // by allocations, at most 5
  std::vector<Recommendation> recommendations;
};

struct MemoryReport {
  std::vector<DeviceReport> devices;
};

// Figures for each device (DeviceUnavailable if one cannot report its memory).
Result<MemoryReport> memory_report(const GpuMemoryPool& pool, std::span<const Device> devices);
Result<MemoryReport> memory_report(const GpuMemoryPool& pool, const Device& device);
std::string to_text(const MemoryReport& report);
std::string to_json(const MemoryReport& report);  // {"devices":[{...}]}, field names as above
std::string_view to_string(Severity severity) noexcept;

// The rules behind DeviceReport::recommendations, for one device's figures (20–80 % used is
// healthy; act before the last 10 %).
std::vector<Recommendation> recommend(const DeviceReport& figures);

}  // namespace gpupool
