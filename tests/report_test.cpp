// memory_report: figures checked field by field in the text and in the JSON, recommendations
// rule by rule.
#include <catch2/catch.hpp>
#include <cstddef>
#include <expected>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>
import gpupool;

using namespace gpupool;
// These figures are exact per block: every block is its own device allocation (segments off).
const PoolConfig kOwnBlocks{.segments = false};


namespace {
Device sim(std::size_t capacity, std::string name = "report sim") {
  auto device = Device::simulated({.capacity = capacity, .name = std::move(name)});
  REQUIRE(device);
  return *device;
}
bool contains(const std::string& text, const std::string& part) {
  INFO("looking for: " << part);
  return text.find(part) != std::string::npos;
}

// Traffic with known figures: class 4096 (3 allocations, 1 hit, 2 live), class 1 MiB (1 cached),
// class 256 (1 live).
struct KnownTraffic {
  std::vector<ManagedBuffer> live;
  explicit KnownTraffic(GpuMemoryPool& pool, const Device& device) {
    auto a = pool.get_managed_buffer(device, 1000, Precision::Fp32);
    auto b = pool.get_managed_buffer(device, 1000, Precision::Fp32);
    REQUIRE(a);
    REQUIRE(b);
    live.push_back(std::move(*b));
    a->release().value();
    auto c = pool.get_managed_buffer(device, 1000, Precision::Fp32);
    REQUIRE(c);
    live.push_back(std::move(*c));
    { auto big = pool.get_managed_buffer(device, MiB, Precision::Bytes); REQUIRE(big); }
    auto small = pool.get_managed_buffer(device, 100, Precision::Int8);
    REQUIRE(small);
    live.push_back(std::move(*small));
  }
};
}  // namespace

TEST_CASE("memory_report has exact figures for known traffic", "[report]") {
  Device device = sim(64 * MiB);
  GpuMemoryPool pool(PoolConfig{.max_pool_size = 32 * MiB, .segments = false});
  KnownTraffic traffic(pool, device);
  auto report = memory_report(pool, device);
  REQUIRE(report);
  REQUIRE(report->devices.size() == 1);
  const DeviceReport& r = report->devices[0];
  CHECK(r.device_id == device.id());
  CHECK(r.name == "report sim");
  CHECK(r.total_bytes == 67108864);
  CHECK(r.used_bytes == 1057024);
  CHECK(r.free_bytes == 67108864 - 1057024);
  CHECK(r.largest_free_block == 67108864 - 1057024);
  CHECK(r.utilization == Approx(1057024.0 / 67108864.0));
  CHECK(r.limit == std::optional<std::size_t>(33554432));
  CHECK(r.pressure == Approx(1057024.0 / 33554432.0));
  CHECK(r.pool.in_use_bytes == 8448);
  CHECK(r.pool.requested_bytes == 8100);
  CHECK(r.pool.cached_bytes == 1048576);
  CHECK(r.pool.reserved_bytes == 1057024);
  CHECK(r.pool.peak_in_use_bytes == 1056768);
  CHECK(r.pool.peak_reserved_bytes == 1057024);
  CHECK(r.pool.allocations == 5);
  CHECK(r.pool.frees == 2);
  CHECK(r.pool.cache_hits == 1);
  CHECK(r.pool.cache_misses == 4);
  CHECK(r.pool.device_allocations == 4);
  CHECK(r.pool.live_buffers == 3);
  CHECK(r.pool.fragmentation.external == 0.0);
  CHECK(r.pool.fragmentation.internal == Approx(348.0 / 8448.0));
  REQUIRE(r.busiest_classes.size() == 3);
  CHECK(r.busiest_classes[0].block_bytes == 4096);
  CHECK(r.busiest_classes[0].allocations == 3);
  CHECK(r.busiest_classes[0].hits == 1);
  CHECK(r.busiest_classes[0].misses == 2);
  CHECK(r.busiest_classes[0].live_blocks == 2);
  CHECK(r.busiest_classes[0].cached_blocks == 0);
  CHECK(r.busiest_classes[1].block_bytes == 256);   // ties: the smaller class first
  CHECK(r.busiest_classes[1].live_blocks == 1);
  CHECK(r.busiest_classes[2].block_bytes == 1048576);
  CHECK(r.busiest_classes[2].cached_blocks == 1);
  REQUIRE(r.recommendations.size() == 1);
  CHECK(r.recommendations[0].severity == Severity::Ok);
  CHECK(r.recommendations[0].text == "memory usage healthy (1.6% used)");

  SECTION("as text") {
    std::string text = to_text(*report);
    CHECK(contains(text, "== GPU Memory Report (device " + std::to_string(device.id()) + ": report sim) ==\n"));
    CHECK(contains(text, "  Total:        64.00 MiB (67108864 bytes)\n"));
    CHECK(contains(text, "  Used:         1.01 MiB (1057024 bytes)\n"));
    CHECK(contains(text, "  Utilization:  1.6%\n"));
    CHECK(contains(text, "  In use:       8.25 KiB (8448 bytes) (requested 7.91 KiB (8100 bytes), 3 live buffers)\n"));
    CHECK(contains(text, "  Cached:       1.00 MiB (1048576 bytes)\n"));
    CHECK(contains(text, "  Limit:        32.00 MiB (33554432 bytes)\n"));
    CHECK(contains(text, "  Traffic:      5 allocations, 2 frees, hit rate 20.0%, 4 device allocations, 0 trims, 0 OOM errors\n"));
    CHECK(contains(text, "  External:     0.0% (1 cached classes, largest cached block 1.00 MiB (1048576 bytes))\n"));
    CHECK(contains(text, "  Internal:     4.1%\n"));
    CHECK(contains(text, "        4096 B  3 allocations (1 hits, 2 misses), 2 live, 0 cached\n"));
    CHECK(contains(text, "     1048576 B  1 allocations (0 hits, 1 misses), 0 live, 1 cached\n"));
    CHECK(contains(text, "  [ok] memory usage healthy (1.6% used)\n"));
  }
  SECTION("as JSON") {
    nlohmann::json json = nlohmann::json::parse(to_json(*report));
    REQUIRE(json["devices"].size() == 1);
    const nlohmann::json& d = json["devices"][0];
    CHECK(d["device_id"] == device.id());
    CHECK(d["name"] == "report sim");
    CHECK(d["total_bytes"] == 67108864);
    CHECK(d["free_bytes"] == 67108864 - 1057024);
    CHECK(d["used_bytes"] == 1057024);
    CHECK(d["utilization"].get<double>() == Approx(1057024.0 / 67108864.0));
    CHECK(d["limit"] == 33554432);
    CHECK(d["largest_free_block"] == 67108864 - 1057024);
    CHECK(d["pool"]["in_use_bytes"] == 8448);
    CHECK(d["pool"]["requested_bytes"] == 8100);
    CHECK(d["pool"]["cached_bytes"] == 1048576);
    CHECK(d["pool"]["reserved_bytes"] == 1057024);
    CHECK(d["pool"]["peak_in_use_bytes"] == 1056768);
    CHECK(d["pool"]["peak_reserved_bytes"] == 1057024);
    CHECK(d["pool"]["allocations"] == 5);
    CHECK(d["pool"]["frees"] == 2);
    CHECK(d["pool"]["cache_hits"] == 1);
    CHECK(d["pool"]["cache_misses"] == 4);
    CHECK(d["pool"]["device_allocations"] == 4);
    CHECK(d["pool"]["trims"] == 0);
    CHECK(d["pool"]["out_of_memory_errors"] == 0);
    CHECK(d["pool"]["live_buffers"] == 3);
    CHECK(d["pool"]["hit_rate"].get<double>() == Approx(0.2));
    CHECK(d["fragmentation"]["external"].get<double>() == 0.0);
    CHECK(d["fragmentation"]["internal"].get<double>() == Approx(348.0 / 8448.0));
    CHECK(d["fragmentation"]["largest_cached_block"] == 1048576);
    CHECK(d["fragmentation"]["cached_classes"] == 1);
    REQUIRE(d["busiest_classes"].size() == 3);
    CHECK(d["busiest_classes"][0] == nlohmann::json{{"block_bytes", 4096}, {"allocations", 3}, {"hits", 1},
                                                    {"misses", 2}, {"live_blocks", 2}, {"cached_blocks", 0}});
    REQUIRE(d["recommendations"].size() == 1);
    CHECK(d["recommendations"][0]["severity"] == "ok");
    CHECK(d["recommendations"][0]["text"] == "memory usage healthy (1.6% used)");
  }
}

TEST_CASE("memory_report covers several devices, used or not", "[report]") {
  Device used = sim(16 * MiB, "used");
  Device idle = sim(8 * MiB, "idle");
  GpuMemoryPool pool(kOwnBlocks);
  auto buffer = pool.get_managed_buffer(used, MiB, Precision::Bytes);
  REQUIRE(buffer);
  std::vector<Device> devices{used, idle};
  auto report = memory_report(pool, devices);
  REQUIRE(report);
  REQUIRE(report->devices.size() == 2);
  CHECK(report->devices[0].pool.in_use_bytes == MiB);
  CHECK(report->devices[1].name == "idle");
  CHECK(report->devices[1].pool.allocations == 0);
  CHECK(report->devices[1].busiest_classes.empty());
  CHECK(!report->devices[1].limit);
  std::string text = to_text(*report);
  CHECK(contains(text, ": idle) ==\nMemory:\n  Total:        8.00 MiB (8388608 bytes)\n"));
  CHECK(contains(text, "Busiest size classes:\n  (none)\n"));
  CHECK(contains(text, "  Limit:        none (the device's capacity)\n"));
  CHECK(nlohmann::json::parse(to_json(*report))["devices"][1]["limit"].is_null());
}

TEST_CASE("an out-of-memory error and a nearly full device show up as critical", "[report]") {
  Device device = sim(4 * MiB);
  GpuMemoryPool pool(kOwnBlocks);
  auto filler = pool.get_managed_buffer(device, 3 * MiB + MiB / 2, Precision::Bytes);  // 87.5% used
  REQUIRE(filler);
  auto too_big = pool.get_managed_buffer(device, 2 * MiB, Precision::Bytes);
  REQUIRE(!too_big);
  CHECK(too_big.error().kind() == ErrorKind::OutOfMemory);
  auto report = memory_report(pool, device);
  REQUIRE(report);
  const auto& recs = report->devices[0].recommendations;
  REQUIRE(recs.size() == 3);
  CHECK(recs[0].severity == Severity::Warning);
  CHECK(recs[0].text == "device memory 87.5% used (under 20% free): check will_oom before large allocations");
  CHECK(recs[1].severity == Severity::Critical);
  CHECK(recs[1].text == "1 out-of-memory error so far: plan with auto_chunk and keep a margin (fraction 0.7)");
  CHECK(recs[2].severity == Severity::Warning);
  CHECK(contains(recs[2].text, "no pool limit on this device"));
  CHECK(report->devices[0].pool.out_of_memory_errors == 1);
}

TEST_CASE("recommend applies each rule to the figures", "[report]") {
  DeviceReport figures;
  figures.utilization = 0.95;
  figures.limit = 10 * GiB;
  figures.pool.out_of_memory_errors = 2;
  figures.pool.cached_bytes = 10 * MiB;
  figures.pool.fragmentation.external = 0.6;
  figures.pool.fragmentation.cached_classes = 3;
  figures.pool.in_use_bytes = 100 * MiB;
  figures.pool.fragmentation.internal = 0.1;
  figures.pool.allocations = 200;
  figures.pool.cache_hits = 50;
  figures.pool.cache_misses = 150;
  auto recs = recommend(figures);
  REQUIRE(recs.size() == 5);
  CHECK(recs[0].severity == Severity::Critical);
  CHECK(recs[0].text == "device memory 95.0% used (under 10% free): split the work with auto_chunk or "
                        "lower the batch size before the next allocation fails");
  CHECK(recs[1].text == "2 out-of-memory errors so far: plan with auto_chunk and keep a margin (fraction 0.7)");
  CHECK(recs[2].text == "10.00 MiB (10485760 bytes) cached over 3 size classes (external fragmentation "
                        "60.0%): trim() or max_cached_bytes gives the cold classes back");
  CHECK(recs[3].text == "10.0% of the memory in use is size-class rounding: sizes just above a class "
                        "boundary waste most; round buffer sizes to the class sizes");
  CHECK(recs[4].text == "cache hit rate 25.0% over 200 allocations: buffer sizes vary a lot; an "
                        "initial_reservation of the common size warms the cache");
  for (std::size_t i = 2; i < recs.size(); ++i) CHECK(recs[i].severity == Severity::Warning);

  figures.limit.reset();
  CHECK(recommend(figures).size() == 6);
  figures.limit = 64 * MiB;
  figures.pressure = 0.88;
  recs = recommend(figures);
  REQUIRE(recs.size() == 6);
  CHECK(recs[1].severity == Severity::Warning);
  CHECK(recs[1].text == "the pool holds 88.0% of its limit of 64.00 MiB (67108864 bytes): new blocks "
                        "trim the cache first, then fail; raise the limit (set_max_pool_size, "
                        "GPUPOOL_MEMORY_LIMIT) or split the work with auto_chunk");
  figures.pressure = 0.95;
  CHECK(recommend(figures)[1].severity == Severity::Critical);
  CHECK(to_string(Severity::Critical) == "critical");
}
