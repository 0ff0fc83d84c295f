// The pool's policy layers (pool/pool_policies.cppm), each exercised alone on the simulated
// device: the reservations' counts, the hard limit, the soft cap, the pressure watch and the OOM
// ladder — what each decides, and that none acts where another's turn is.
#include <catch2/catch.hpp>
#include <cstddef>
#include <optional>
#include <vector>
import gpupool;
#include "support/sim_device.hpp"

using namespace gpupool;
using gpupool::testing::device_used;
using gpupool::testing::sim;
using gpupool::testing::take;

namespace {
// Class blocks (one device allocation each, below the segments' threshold).
constexpr std::size_t kUnit = 4 * KiB;
}  // namespace

TEST_CASE("reservations: one count per device call, the peak of what was reserved",
          "[pool][policies]") {
  Device device = sim(64 * kUnit);
  GpuMemoryPool pool;
  { ManagedBuffer a = take(pool, device, 2 * kUnit), b = take(pool, device, 3 * kUnit); }
  PoolStats s = pool.stats(device);
  CHECK(s.device_allocations == 2);
  CHECK(s.device_frees == 0);
  CHECK(s.reserved_bytes == 5 * kUnit);
  CHECK(s.peak_reserved_bytes == 5 * kUnit);
  CHECK(pool.trim(device) == 5 * kUnit);
  s = pool.stats(device);
  CHECK(s.device_frees == 2);
  CHECK(s.reserved_bytes == 0);
  CHECK(s.peak_reserved_bytes == 5 * kUnit);  // a peak outlives the trim...
  pool.reset_peaks(device);
  CHECK(pool.stats(device).peak_reserved_bytes == 0);  // ...until the peaks are reset
  ManagedBuffer c = take(pool, device, kUnit);
  CHECK(pool.stats(device).peak_reserved_bytes == kUnit);
  CHECK(device_used(device) == kUnit);
}

TEST_CASE("hard limit alone: lowered below what is reserved, frees go to the device until under",
          "[pool][policies]") {
  Device device = sim(64 * kUnit);
  GpuMemoryPool pool;
  ManagedBuffer a = take(pool, device, 4 * kUnit), b = take(pool, device, 4 * kUnit);
  { ManagedBuffer cached = take(pool, device, 2 * kUnit); }
  REQUIRE(pool.stats(device).reserved_bytes == 10 * kUnit);
  REQUIRE(pool.set_max_pool_size(device, 6 * kUnit));
  CHECK(pool.stats(device).cached_bytes == 0);  // the cache went at once
  CHECK(pool.stats(device).reserved_bytes == 8 * kUnit);
  auto refused = pool.get_managed_buffer(device, kUnit, Precision::Bytes);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().kind() == ErrorKind::PoolLimitExceeded);
  a = ManagedBuffer{};  // over the limit: to the device, not the cache
  PoolStats s = pool.stats(device);
  CHECK(s.reserved_bytes == 4 * kUnit);
  CHECK(s.cached_bytes == 0);
  b = ManagedBuffer{};  // under it again: kept
  CHECK(pool.stats(device).cached_bytes == 4 * kUnit);
  ManagedBuffer within = take(pool, device, 2 * kUnit);  // a new class: the limit trims to admit it
  CHECK(pool.stats(device).reserved_bytes <= 6 * kUnit);
}

TEST_CASE("soft cap alone: set trims at once, a free past it trims, allocations never do",
          "[pool][policies]") {
  Device device = sim(64 * kUnit);
  GpuMemoryPool pool;
  { ManagedBuffer a = take(pool, device, 2 * kUnit), b = take(pool, device, 3 * kUnit); }
  REQUIRE(pool.stats(device).cached_bytes == 5 * kUnit);
  REQUIRE(pool.set_max_cached_bytes(device, 3 * kUnit));
  CHECK(pool.stats(device).cached_bytes <= 3 * kUnit);
  const std::size_t trims_after_set = pool.stats(device).trims;
  ManagedBuffer c = take(pool, device, 4 * kUnit), d = take(pool, device, kUnit);
  CHECK(pool.stats(device).trims == trims_after_set);  // allocating cached nothing new
  c = ManagedBuffer{};
  d = ManagedBuffer{};
  CHECK(pool.stats(device).cached_bytes <= 3 * kUnit);
  CHECK(pool.stats(device).trims > trims_after_set);
  REQUIRE(pool.set_max_cached_bytes(device, std::nullopt));
  { ManagedBuffer e = take(pool, device, 8 * kUnit); }
  CHECK(pool.stats(device).cached_bytes >= 8 * kUnit);  // no cap: kept
}

TEST_CASE("pressure watch alone: an observer hears each upward crossing once", "[pool][policies]") {
  Device device = sim(64 * kUnit);
  GpuMemoryPool pool(PoolConfig{.max_pool_size = 10 * kUnit, .critical_pressure = 1.0});
  std::vector<double> heard;
  pool.add_pressure_observer(0.5, [&](const PressureEvent& e) { heard.push_back(e.pressure); });
  std::optional<ManagedBuffer> a = take(pool, device, 6 * kUnit);
  REQUIRE(heard.size() == 1);
  CHECK(heard[0] == Approx(0.6));
  { ManagedBuffer b = take(pool, device, kUnit); }
  CHECK(heard.size() == 1);  // still above: not again
  a.reset();
  pool.trim(device);  // pressure falls to 0
  CHECK(pool.memory_pressure(device) == 0.0);
  ManagedBuffer c = take(pool, device, 5 * kUnit);
  REQUIRE(heard.size() == 2);  // crossed upwards again
  CHECK(heard[1] == Approx(0.5));
}

TEST_CASE("OOM ladder alone: handlers only after the cleanup retry, never for the hard limit",
          "[pool][policies]") {
  Device device = sim(8 * kUnit);
  GpuMemoryPool pool(PoolConfig{.max_pool_size = 6 * kUnit});
  int handler_calls = 0;
  pool.add_oom_handler([&](int, std::size_t) {
    ++handler_calls;
    return false;
  });
  auto over_limit = pool.get_managed_buffer(device, 7 * kUnit, Precision::Bytes);
  REQUIRE_FALSE(over_limit);
  CHECK(over_limit.error().kind() == ErrorKind::PoolLimitExceeded);
  CHECK(handler_calls == 0);  // a limit is a decision, not a shortage: no ladder
  { ManagedBuffer a = take(pool, device, 5 * kUnit); }
  ManagedBuffer b = take(pool, device, 6 * kUnit);  // the limit trims the cached 5 to admit it
  CHECK(handler_calls == 0);
  CHECK(pool.set_max_pool_size(device, 16 * kUnit));
  auto short_of_memory = pool.get_managed_buffer(device, 3 * kUnit, Precision::Bytes);
  REQUIRE_FALSE(short_of_memory);  // 6 of 8 in use: the device has 2
  CHECK(short_of_memory.error().kind() == ErrorKind::OutOfMemory);
  CHECK(handler_calls == 1);
  CHECK(pool.stats(device).out_of_memory_errors == 2);  // both failures count, limit and device
}
