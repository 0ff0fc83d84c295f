// MemoryProfiler, snapshots, phases and the monitoring helpers, with exact figures: the
// simulated device counts every byte, and the pool rounds to known size classes.
#include <catch2/catch.hpp>
#include <cstddef>
#include <cstdio>
#include <expected>
#include <optional>
#include <string>
#include <vector>
import gpupool;

using namespace gpupool;
// These figures are exact per block: every block is its own device allocation (segments off).
const PoolConfig kOwnBlocks{.segments = false};


namespace {
Device sim(std::size_t capacity = 64 * MiB) {
  auto device = Device::simulated({.capacity = capacity});
  REQUIRE(device);
  return *device;
}
ManagedBuffer bytes(GpuMemoryPool& pool, const Device& device, std::size_t count) {
  auto buffer = pool.get_managed_buffer(device, count, Precision::Bytes);
  REQUIRE(buffer);
  return std::move(*buffer);
}
// What a helper printed to a FILE*, to compare with what it returned.
struct Captured {
  std::FILE* file = std::tmpfile();
  ~Captured() { std::fclose(file); }
  std::string text() {
    std::fflush(file);
    std::rewind(file);
    std::string all;
    for (int c; (c = std::fgetc(file)) != EOF;) all += static_cast<char>(c);
    return all;
  }
};
}  // namespace

TEST_CASE("a snapshot holds the device's and the pool's figures", "[profiler]") {
  Device device = sim();
  GpuMemoryPool pool(kOwnBlocks);
  MemoryProfiler profiler(pool, device);
  auto kept = pool.get_managed_buffer(device, 262144, Precision::Fp32);  // 1 MiB, its own class
  REQUIRE(kept);
  { auto freed = pool.get_managed_buffer(device, 1000, Precision::Fp32); REQUIRE(freed); }  // 4096 cached

  auto snapshot = profiler.capture("one cached class");
  REQUIRE(snapshot);
  CHECK(snapshot->label == "one cached class");
  CHECK(snapshot->device_id == device.id());
  CHECK(snapshot->device_total_bytes == 64 * MiB);
  CHECK(snapshot->device_free_bytes == 64 * MiB - MiB - 4096);
  CHECK(snapshot->largest_free_block == 64 * MiB - MiB - 4096);
  CHECK(snapshot->in_use_bytes == MiB);
  CHECK(snapshot->requested_bytes == MiB);
  CHECK(snapshot->cached_bytes == 4096);
  CHECK(snapshot->reserved_bytes == MiB + 4096);
  CHECK(snapshot->live_buffers == 1);
  CHECK(snapshot->fragmentation.external == 0.0);
  CHECK(snapshot->fragmentation.largest_cached_block == 4096);

  { ManagedBuffer small = bytes(pool, device, 2048); }  // a second cached class: 2048 bytes
  auto spread = profiler.capture("two cached classes");
  REQUIRE(spread);
  CHECK(spread->cached_bytes == 6144);
  CHECK(spread->fragmentation.cached_classes == 2);
  CHECK(spread->fragmentation.external == Approx(1.0 - 4096.0 / 6144.0));
  CHECK(spread->seconds >= snapshot->seconds);
  REQUIRE(profiler.snapshots().size() == 2);
  CHECK(profiler.snapshots()[1].label == "two cached classes");
}

TEST_CASE("print_summary prints every snapshot and names the peak", "[profiler]") {
  Device device = sim();
  GpuMemoryPool pool(kOwnBlocks);
  MemoryProfiler profiler(pool, device);
  REQUIRE(profiler.capture("baseline"));
  ManagedBuffer big = bytes(pool, device, MiB);
  REQUIRE(profiler.capture("after upload"));
  Captured out;
  std::string text = MemoryProfiler::print_summary(profiler.snapshots(), out.file);
  CHECK(out.text() == text);
  CHECK(text.find("baseline (device " + std::to_string(device.id())) != std::string::npos);
  CHECK(text.find("  Device:        64.00 MiB (67108864 bytes) free of 64.00 MiB (67108864 bytes) (0.0% used)") != std::string::npos);
  CHECK(text.find("  Pool:          in use 1.00 MiB (1048576 bytes), cached 0 B, reserved 1.00 MiB (1048576 bytes), 1 live buffers") != std::string::npos);
  CHECK(text.find("Peak reserved: 1.00 MiB (1048576 bytes) (after upload)") != std::string::npos);
  CHECK(MemoryProfiler::summary({}) == "No snapshots.\n");
}

TEST_CASE("peak() keeps the session's highest figures across reset_peak", "[profiler]") {
  Device device = sim();
  GpuMemoryPool pool(kOwnBlocks);
  MemoryProfiler profiler(pool, device);
  { ManagedBuffer two = bytes(pool, device, 2 * MiB); }
  CHECK(profiler.peak().in_use_bytes == 2 * MiB);
  CHECK(profiler.peak().reserved_bytes == 2 * MiB);
  profiler.reset_peak();
  CHECK(profiler.peak().in_use_bytes == 0);
  CHECK(profiler.peak().reserved_bytes == 2 * MiB);  // still cached
  ManagedBuffer one = bytes(pool, device, MiB);
  MemoryPeak peak = profiler.peak();
  CHECK(peak.in_use_bytes == MiB);
  CHECK(peak.requested_bytes == MiB);
  CHECK(peak.reserved_bytes == 3 * MiB);
}

TEST_CASE("phases record their own peaks, nested, without hiding the session's", "[profiler]") {
  Device device = sim();
  GpuMemoryPool pool(kOwnBlocks);
  MemoryProfiler profiler(pool, device);
  { ManagedBuffer early = bytes(pool, device, 8 * MiB); }  // the session peak, before any phase
  {
    auto outer = profiler.phase("outer");
    ManagedBuffer a = bytes(pool, device, MiB);
    {
      auto inner = profiler.phase("inner");
      ManagedBuffer b = bytes(pool, device, 2 * MiB);
    }
    ManagedBuffer c = bytes(pool, device, 4 * MiB);
  }
  REQUIRE(profiler.phases().size() == 2);
  const PhaseRecord& inner = profiler.phases()[0];
  const PhaseRecord& outer = profiler.phases()[1];
  CHECK(inner.name == "inner");
  CHECK(inner.depth == 1);
  CHECK(inner.peak.in_use_bytes == 3 * MiB);
  CHECK(inner.peak.reserved_bytes == 8 * MiB + 3 * MiB);  // the 8 MiB block stays cached
  CHECK(inner.in_use_before == MiB);
  CHECK(inner.in_use_after == MiB);
  CHECK(outer.name == "outer");
  CHECK(outer.depth == 0);
  CHECK(outer.peak.in_use_bytes == 5 * MiB);
  CHECK(outer.peak.reserved_bytes == 8 * MiB + 7 * MiB);
  CHECK(outer.in_use_before == 0);
  CHECK(outer.in_use_after == 0);
  CHECK(outer.seconds >= inner.seconds);
  CHECK(profiler.peak().in_use_bytes == 8 * MiB);
  CHECK(profiler.peak().reserved_bytes == 15 * MiB);
}

TEST_CASE("memory_status returns and prints the device's memory info", "[profiler]") {
  Device device = sim();
  auto raw = device.allocate(16 * MiB);
  REQUIRE(raw);
  Captured out;
  auto status = memory_status(device, "after load", out.file);
  REQUIRE(status);
  CHECK(status->label == "after load");
  CHECK(status->total_bytes == 67108864);
  CHECK(status->free_bytes == 50331648);
  CHECK(status->used_bytes == 16777216);
  CHECK(status->used_fraction == 0.25);
  CHECK(out.text() == "GPU Memory Info (after load):\n  Total: 67.1 MB\n  Used:  16.8 MB (25.0%)\n"
                      "  Free:  50.3 MB (75.0%)\n");
  CHECK(status->to_string() == out.text());
  REQUIRE(device.deallocate(*raw));
}

TEST_CASE("with_memory_monitoring reports before, after, the peak between and the time", "[profiler]") {
  Device device = sim();
  GpuMemoryPool pool(kOwnBlocks);
  auto run = with_memory_monitoring(pool, device, [&] {
    ManagedBuffer temporary = bytes(pool, device, 3 * MiB);
    return 42;
  }, "temporary", nullptr);
  REQUIRE(run);
  CHECK(run->value == 42);
  CHECK(run->report.label == "temporary");
  CHECK(run->report.before.in_use_bytes == 0);
  CHECK(run->report.after.in_use_bytes == 0);
  CHECK(run->report.after.cached_bytes == 3 * MiB);
  CHECK(run->report.peak.in_use_bytes == 3 * MiB);
  CHECK(run->report.peak.reserved_bytes == 3 * MiB);
  CHECK(run->report.seconds >= 0.0);

  std::optional<ManagedBuffer> kept;
  Captured out;
  auto report = with_memory_monitoring(pool, device, [&] { kept = bytes(pool, device, MiB); },
                                       "keeps one", out.file);
  REQUIRE(report);
  CHECK(report->before.cached_bytes == 3 * MiB);
  CHECK(report->after.in_use_bytes == MiB);
  CHECK(report->peak.in_use_bytes == MiB);
  CHECK(report->peak.reserved_bytes == 4 * MiB);
  CHECK(out.text() == report->to_string());
  CHECK(out.text().find("Monitoring keeps one:") == 0);
  CHECK(out.text().find("Pool in use change: +1.00 MiB (1048576 bytes)") != std::string::npos);
}

TEST_CASE("cleanup_memory gives the cache back and reports both sides", "[profiler]") {
  Device device = sim();
  GpuMemoryPool pool(kOwnBlocks);
  { ManagedBuffer a = bytes(pool, device, 3 * MiB); ManagedBuffer b = bytes(pool, device, 4096); }
  Captured out;
  auto cleanup = cleanup_memory(pool, device, "between queries", out.file);
  REQUIRE(cleanup);
  CHECK(cleanup->released_bytes == 3 * MiB + 4096);
  CHECK(cleanup->before.cached_bytes == 3 * MiB + 4096);
  CHECK(cleanup->after.cached_bytes == 0);
  CHECK(cleanup->after.device_free_bytes == 64 * MiB);
  CHECK(out.text() == cleanup->to_string());
  CHECK(out.text().find("Cleanup between queries: released 3.00 MiB (3149824 bytes)") == 0);
}
