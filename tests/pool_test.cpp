#include <catch2/catch.hpp>
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>
import gpupool;

using namespace gpupool;

namespace {
Device sim(std::size_t capacity = 64 * MiB, bool deferred = false) {
  auto device = Device::simulated({.capacity = capacity, .deferred_streams = deferred});
  REQUIRE(device);
  return *device;
}
// Blocks up to 64 KiB are cached per size class; the tests of class caching use sizes in these
// units so that every block stays a class block (larger ones come from segments: see below).
constexpr std::size_t kUnit = 4 * KiB;
std::size_t device_used(const Device& device) {
  auto info = device.memory_info();
  return info->total - info->free;
}
ManagedBuffer take(GpuMemoryPool& pool, const Device& device, std::size_t bytes,
                   Precision precision = Precision::Bytes) {
  auto buffer = pool.get_managed_buffer(device, bytes / element_size(precision), precision);
  REQUIRE(buffer);
  return std::move(*buffer);
}
// `count` floats of random values away from zero.
std::vector<float> random_floats(std::size_t count, float offset) {
  std::vector<float> values(count);
  for (float& v : values) v = offset + static_cast<float>(std::rand() % 997);
  return values;
}
}  // namespace

TEST_CASE("size classes waste at most 1/16 above 4 KiB and align to 256", "[pool]") {
  Device device = sim();
  GpuMemoryPool pool;
  for (std::size_t bytes : {1ul, 255ul, 256ul, 257ul, 4096ul, 4097ul, 10000ul, 1ul << 20,
                            (1ul << 20) + 1, 3 * MiB + 12345}) {
    auto buffer = pool.get_managed_buffer(device, bytes, Precision::Bytes);
    REQUIRE(buffer);
    CHECK(buffer->size_bytes() == bytes);
    CHECK(buffer->capacity_bytes() >= bytes);
    CHECK(buffer->capacity_bytes() % 256 == 0);
    if (bytes > 4096) CHECK(buffer->capacity_bytes() - bytes <= bytes / 16);
    else CHECK(buffer->capacity_bytes() - bytes < 256);
  }
}

TEST_CASE("a freed buffer is reused without asking the device", "[pool]") {
  Device device = sim();
  GpuMemoryPool pool;
  void* first = nullptr;
  {
    auto buffer = pool.get_managed_buffer(device, 1000, Precision::Fp32);
    REQUIRE(buffer);
    first = buffer->raw_data();
  }
  PoolStats after_free = pool.stats(device);
  CHECK(after_free.cached_bytes == 4096);
  CHECK(after_free.in_use_bytes == 0);
  CHECK(after_free.device_allocations == 1);
  auto again = pool.get_managed_buffer(device, 1000, Precision::Fp32);
  REQUIRE(again);
  CHECK(again->raw_data() == first);
  PoolStats s = pool.stats(device);
  CHECK(s.device_allocations == 1);
  CHECK(s.cache_hits == 1);
  CHECK(s.cache_misses == 1);
  CHECK(s.hit_rate() == Approx(0.5));
  CHECK(s.in_use_bytes == 4096);
  CHECK(s.requested_bytes == 4000);
}

TEST_CASE("a miss reuses the same byte class cached under another precision", "[pool]") {
  Device device = sim();
  GpuMemoryPool pool;
  void* ptr = nullptr;
  {
    auto halves = pool.get_managed_buffer(device, 2048, Precision::Fp16);  // 4096 bytes
    REQUIRE(halves);
    ptr = halves->raw_data();
  }
  auto floats = pool.get_managed_buffer(device, 1024, Precision::Fp32);  // also 4096 bytes
  REQUIRE(floats);
  CHECK(floats->raw_data() == ptr);
  CHECK(floats->precision() == Precision::Fp32);
  CHECK(floats->element_count() == 1024);
  CHECK(pool.stats(device).device_allocations == 1);
}

TEST_CASE("typed access is checked against the precision", "[pool][buffer]") {
  Device device = sim();
  GpuMemoryPool pool;
  auto buffer = pool.get_managed_buffer(device, 64, Precision::Fp32);
  REQUIRE(buffer);
  CHECK(buffer->data<float>());
  auto wrong = buffer->data<std::int8_t>();
  REQUIRE_FALSE(wrong);
  CHECK(wrong.error().kind() == ErrorKind::InvalidInput);
  CHECK_THAT(wrong.error().message(), Catch::Contains("holds fp32 elements but was accessed as int8"));
  CHECK(buffer->data<Half>().error().kind() == ErrorKind::InvalidInput);
}

TEST_CASE("upload and download round-trip and are bounds-checked", "[pool][buffer]") {
  Device device = sim();
  GpuMemoryPool pool;
  ManagedBuffer buffer = take(pool, device, 400, Precision::Fp32);
  const std::vector<float> host = random_floats(100, 0.5f);
  REQUIRE(buffer.upload(std::span<const float>(host)));
  auto back = buffer.to_host<float>();
  REQUIRE(back);
  CHECK(*back == host);
  std::vector<float> too_big(101, 1.0f);
  auto overflow = buffer.upload(std::span<const float>(too_big));
  REQUIRE_FALSE(overflow);
  CHECK_THAT(overflow.error().message(), Catch::Contains("runs past the buffer's 400 bytes"));
  std::vector<std::int8_t> bytes(4);
  CHECK(buffer.download(std::span<std::int8_t>(bytes)).error().kind() == ErrorKind::InvalidInput);
}

TEST_CASE("upload and download take vectors, arrays and element offsets", "[pool][buffer]") {
  Device device = sim();
  GpuMemoryPool pool;
  ManagedBuffer buffer = take(pool, device, 256, Precision::Fp32);
  const std::vector<float> head = random_floats(40, 1.5f);
  std::array<float, 24> tail{};
  std::ranges::copy(random_floats(tail.size(), -1000.0f), tail.begin());
  REQUIRE(buffer.upload(head));
  REQUIRE(buffer.upload(tail, /*first=*/40));  // elements, not bytes
  std::vector<float> back(24);
  REQUIRE(buffer.download(back, 40));
  CHECK(std::equal(back.begin(), back.end(), tail.begin()));
  float first_two[2];
  REQUIRE(buffer.download(first_two));
  CHECK(first_two[0] == head[0]);
  CHECK(first_two[1] == head[1]);
  // Offsets and lengths are checked in elements, also where the bytes would overflow.
  CHECK_THAT(buffer.upload(tail, 41).error().message(), Catch::Contains("runs past"));
  CHECK(buffer.download(back, SIZE_MAX / 2).error().kind() == ErrorKind::InvalidInput);
  static_assert(!HostRange<std::vector<std::int32_t>>);  // no precision holds int32
  std::vector<std::int8_t> other_precision(4);
  CHECK(buffer.download(other_precision).error().kind() == ErrorKind::InvalidInput);
  // A byte buffer from allocate_bytes on the default stream: vectors of std::byte.
  auto bytes = pool.allocate_bytes(device, 16);
  REQUIRE(bytes);
  std::vector<std::byte> raw(16, std::byte{0x5a});
  REQUIRE(bytes->upload(raw));
  std::vector<std::byte> raw_back(8);
  REQUIRE(bytes->download(raw_back, 8));
  CHECK(raw_back == std::vector<std::byte>(8, std::byte{0x5a}));
}

TEST_CASE("reused memory keeps old contents unless zeroed on request", "[pool][buffer][annie]") {
  // Annie handed reused buffers out with old contents and no way to ask for zeros.
  Device device = sim();
  GpuMemoryPool pool;
  std::vector<float> ones(256, 1.0f);
  {
    auto buffer = pool.get_managed_buffer(device, 256, Precision::Fp32);
    REQUIRE(buffer);
    REQUIRE(buffer->upload(std::span<const float>(ones)));
  }
  auto reused = pool.get_managed_buffer(device, 256, Precision::Fp32);
  REQUIRE(reused);
  REQUIRE(reused->fill_zero());
  auto back = reused->to_host<float>();
  REQUIRE(back);
  CHECK(*back == std::vector<float>(256, 0.0f));
}

TEST_CASE("release() gives the memory back early, once", "[pool][buffer]") {
  Device device = sim();
  GpuMemoryPool pool;
  auto buffer = pool.get_managed_buffer(device, 10, Precision::Fp32);
  REQUIRE(buffer);
  REQUIRE(buffer->release());
  CHECK_FALSE(buffer->valid());
  CHECK(pool.stats(device).in_use_bytes == 0);
  auto twice = buffer->release();
  REQUIRE_FALSE(twice);
  CHECK(twice.error().kind() == ErrorKind::InvalidState);
  CHECK(buffer->data<float>().error().kind() == ErrorKind::InvalidState);
}

TEST_CASE("moving a buffer moves ownership, the moved-from one is empty", "[pool][buffer]") {
  Device device = sim();
  GpuMemoryPool pool;
  auto a = pool.get_managed_buffer(device, 10, Precision::Fp32);
  REQUIRE(a);
  ManagedBuffer b = std::move(*a);
  CHECK_FALSE(a->valid());
  CHECK(b.valid());
  ManagedBuffer c;
  c = std::move(b);
  CHECK(c.valid());
  CHECK(pool.stats(device).live_buffers == 1);
  c = ManagedBuffer{};
  CHECK(pool.stats(device).live_buffers == 0);
}

TEST_CASE("a buffer that outlives its pool object is returned to the device", "[pool][buffer]") {
  Device device = sim();
  std::optional<ManagedBuffer> survivor;
  {
    GpuMemoryPool pool;
    auto cached = pool.get_managed_buffer(device, 1 * MiB, Precision::Bytes);
    REQUIRE(cached);
    REQUIRE(cached->release());  // cached in the pool
    auto live = pool.get_managed_buffer(device, 100, Precision::Fp32);
    REQUIRE(live);
    survivor.emplace(std::move(*live));
  }
  // The pool object is gone: its cache went back to the device; the survivor still holds 512 B.
  CHECK(device_used(device) == 512);
  std::vector<float> data(100, 2.0f);
  REQUIRE(survivor->upload(std::span<const float>(data)));
  survivor.reset();
  CHECK(device_used(device) == 0);
}

TEST_CASE("bad requests are errors that say what was expected", "[pool]") {
  Device device = sim(1 * MiB);
  GpuMemoryPool pool;
  auto zero = pool.get_managed_buffer(device, 0, Precision::Fp32);
  REQUIRE_FALSE(zero);
  CHECK(zero.error().kind() == ErrorKind::InvalidInput);
  CHECK_THAT(zero.error().message(), Catch::Contains("expected at least 1"));
  auto overflow = pool.get_managed_buffer(device, SIZE_MAX / 2, Precision::Fp32);
  REQUIRE_FALSE(overflow);
  CHECK(overflow.error().kind() == ErrorKind::InvalidInput);
  auto absurd = pool.get_managed_buffer(device, std::size_t{1} << 50, Precision::Bytes);
  REQUIRE_FALSE(absurd);
  CHECK_THAT(absurd.error().message(), Catch::Contains("absurd"));
  Device other = sim();
  auto wrong_stream = pool.get_managed_buffer(device, 10, Precision::Fp32, other.default_stream());
  REQUIRE_FALSE(wrong_stream);
  CHECK(wrong_stream.error().kind() == ErrorKind::InvalidInput);
  // A precision cast from an integer outside the enumeration is not some 1-byte type.
  for (int value : {5, 9, 255}) {
    auto unknown = pool.get_managed_buffer(device, 10, static_cast<Precision>(value));
    REQUIRE_FALSE(unknown);
    CHECK(unknown.error().kind() == ErrorKind::InvalidInput);
    CHECK_THAT(unknown.error().message(), Catch::Contains("precision " + std::to_string(value)));
    BufferBatch batch(pool, device);
    CHECK_FALSE(batch.add(10, static_cast<Precision>(value)));
  }
  CHECK(pool.stats(device).live_buffers == 0);
}

TEST_CASE("critical pressure trims back under the critical level, not to it", "[pool][pressure]") {
  Device device = sim(64 * MiB);
  GpuMemoryPool pool(PoolConfig{.max_pool_size = 32 * MiB, .critical_pressure = 0.5});
  // 8 MiB of 64 KiB blocks cached (each its own device allocation: a trim can stop anywhere).
  { std::vector<ManagedBuffer> blocks;
    for (int i = 0; i < 128; ++i) blocks.push_back(take(pool, device, 64 * KiB)); }
  // 32 KiB blocks in use until reserved reaches 16 MiB, half the limit: exactly the critical
  // level, which the trim must leave behind.
  std::vector<ManagedBuffer> live;
  for (int i = 0; i < 256; ++i) {
    live.push_back(take(pool, device, 32 * KiB));
    const PoolStats s = pool.stats(device);
    INFO("after " << i + 1 << " blocks: reserved " << s.reserved_bytes << ", cached " << s.cached_bytes);
    CHECK((pool.memory_pressure(device) < 0.5 || s.cached_bytes == 0));
  }
}

TEST_CASE("a batch takes buffers of other pools, each goes back to its own", "[pool][batch]") {
  Device device = sim(64 * MiB);
  GpuMemoryPool mine, other;
  {
    BufferBatch batch(mine, device);
    REQUIRE(batch.add(take(other, device, 1000)));
    REQUIRE(batch.add(100, Precision::Fp32));
    CHECK(other.stats(device).live_buffers == 1);
    CHECK(mine.stats(device).live_buffers == 1);
  }
  CHECK(other.stats(device).live_buffers == 0);
  CHECK(other.stats(device).cached_bytes > 0);  // back in the pool it came from
  CHECK(mine.stats(device).live_buffers == 0);
}

TEST_CASE("the hard limit is enforced and trims the cache first", "[pool][limits][annie]") {
  // Annie let a 100 MB request through a 1 KiB limit; pressure then read 97656.
  Device device = sim(64 * MiB);
  GpuMemoryPool pool;
  REQUIRE(pool.set_max_pool_size(device, 1024));
  auto huge = pool.get_managed_buffer(device, 100'000'000, Precision::Bytes);
  REQUIRE_FALSE(huge);
  CHECK(huge.error().kind() == ErrorKind::PoolLimitExceeded);
  CHECK_THAT(huge.error().message(), Catch::Contains("limit of 1.00 KiB"));
  CHECK(pool.memory_pressure(device) <= 1.0);

  // Class blocks (up to 64 KiB) are one device allocation each: room is made by trimming them.
  REQUIRE(pool.set_max_pool_size(device, 64 * KiB));
  { auto a = pool.get_managed_buffer(device, 40 * KiB, Precision::Bytes); REQUIRE(a); }
  CHECK(pool.stats(device).cached_bytes == 40 * KiB);
  // 40 KiB cached + 30 KiB new > 64 KiB: the cache is trimmed, then the request fits.
  auto b = pool.get_managed_buffer(device, 30 * KiB, Precision::Bytes);
  REQUIRE(b);
  PoolStats s = pool.stats(device);
  CHECK(s.cached_bytes == 0);
  CHECK(s.reserved_bytes == 30 * KiB);
  CHECK(s.trims == 1);
  auto c = pool.get_managed_buffer(device, 40 * KiB, Precision::Bytes);
  REQUIRE_FALSE(c);
  CHECK(c.error().kind() == ErrorKind::PoolLimitExceeded);
  CHECK_THAT(c.error().message(), Catch::Contains("in use 30.00 KiB"));
  CHECK(pool.set_max_pool_size(device, 0).error().kind() == ErrorKind::InvalidInput);
}

TEST_CASE("pressure counts cached bytes and is between 0 and 1", "[pool][pressure][annie]") {
  // Annie reported pressure 0.0 with 10 MiB cached.
  Device device = sim(64 * kUnit);
  GpuMemoryPool pool;
  REQUIRE(pool.set_max_pool_size(device, 40 * kUnit));
  { auto a = pool.get_managed_buffer(device, 10 * kUnit, Precision::Bytes); REQUIRE(a); }
  CHECK(pool.stats(device).cached_bytes == 10 * kUnit);
  CHECK(pool.memory_pressure(device) == Approx(0.25));
  // Without a limit, pressure is against the device's memory.
  Device other = sim(64 * kUnit);
  GpuMemoryPool unlimited;
  auto b = unlimited.get_managed_buffer(other, 16 * kUnit, Precision::Bytes);
  REQUIRE(b);
  CHECK(unlimited.memory_pressure(other) == Approx(0.25));
  CHECK(unlimited.memory_pressure(sim()) == 0.0);  // never used
}

TEST_CASE("pressure observers fire when a threshold is crossed, critical trims", "[pool][pressure]") {
  Device device = sim(64 * kUnit);
  GpuMemoryPool pool(PoolConfig{.max_pool_size = 10 * kUnit});
  std::vector<PressureEvent> events;
  auto id = pool.add_pressure_observer(0.7, [&](const PressureEvent& e) { events.push_back(e); });
  pool.add_pressure_observer(0.9, [&](const PressureEvent& e) { events.push_back(e); });
  auto a = pool.get_managed_buffer(device, 6 * kUnit, Precision::Bytes);
  REQUIRE(a);
  CHECK(events.empty());
  {
    auto b = pool.get_managed_buffer(device, kUnit + kUnit / 2, Precision::Bytes);
    REQUIRE(b);
    REQUIRE(events.size() == 1);
    CHECK(events[0].threshold == 0.7);
    CHECK(events[0].device_id == device.id());
    CHECK(events[0].pressure == Approx(0.75));
  }
  // 7.5 MiB reserved (1.5 cached). Another 2 MiB → 0.95 ≥ critical 0.9: the cache is trimmed.
  auto c = pool.get_managed_buffer(device, 2 * kUnit, Precision::Bytes);
  REQUIRE(c);
  REQUIRE(events.size() == 2);
  CHECK(events[1].threshold == 0.9);
  CHECK(pool.stats(device).cached_bytes == 0);
  CHECK(pool.memory_pressure(device) == Approx(0.8));
  pool.remove_pressure_observer(id);
}

TEST_CASE("emergency cleanup gives every cached byte back, live buffers untouched", "[pool][annie]") {
  // Annie's emergency cleanup zeroed its counter while buffers were live.
  Device device = sim(64 * kUnit);
  GpuMemoryPool pool;
  auto live = pool.get_managed_buffer(device, 1 * kUnit, Precision::Bytes);
  REQUIRE(live);
  { auto a = pool.get_managed_buffer(device, 2 * kUnit, Precision::Bytes); REQUIRE(a); }
  { auto b = pool.get_managed_buffer(device, 3 * kUnit, Precision::Bytes); REQUIRE(b); }
  CHECK(pool.stats(device).cached_bytes == 5 * kUnit);
  CHECK(pool.emergency_cleanup(device) == 5 * kUnit);
  PoolStats s = pool.stats(device);
  CHECK(s.cached_bytes == 0);
  CHECK(s.in_use_bytes == 1 * kUnit);
  CHECK(s.live_buffers == 1);
  CHECK(device_used(device) == 1 * kUnit);
  CHECK(pool.memory_usage(device)->allocated == 1 * kUnit);
  live = ManagedBuffer{};
  CHECK(pool.emergency_cleanup_all() == 1 * kUnit);
  CHECK(device_used(device) == 0);
}

TEST_CASE("trimming takes the coldest size classes first and keeps the hot ones", "[pool][fragmentation][annie]") {
  // Annie's fragmentation cleanup could drop every cached buffer.
  Device device = sim(64 * kUnit);
  GpuMemoryPool pool;
  { auto cold = pool.get_managed_buffer(device, 1 * kUnit, Precision::Bytes); REQUIRE(cold); }
  { auto warm = pool.get_managed_buffer(device, 2 * kUnit, Precision::Bytes); REQUIRE(warm); }
  { auto hot = pool.get_managed_buffer(device, 4 * kUnit, Precision::Bytes); REQUIRE(hot); }
  CHECK(pool.trim(device, 6 * kUnit) == 1 * kUnit);
  CHECK(pool.stats(device).cached_bytes == 6 * kUnit);
  CHECK(pool.trim(device, 4 * kUnit) == 2 * kUnit);
  PoolStats s = pool.stats(device);
  CHECK(s.cached_bytes == 4 * kUnit);
  CHECK(s.fragmentation.largest_cached_block == 4 * kUnit);
  CHECK(s.fragmentation.cached_classes == 1);
}

TEST_CASE("the soft cap on cached bytes trims automatically", "[pool][fragmentation]") {
  Device device = sim(64 * kUnit);
  GpuMemoryPool pool(PoolConfig{.max_cached_bytes = 3 * kUnit});
  { auto a = pool.get_managed_buffer(device, 2 * kUnit, Precision::Bytes); REQUIRE(a); }
  { auto b = pool.get_managed_buffer(device, 2 * kUnit + 1, Precision::Bytes); REQUIRE(b); }  // other class
  PoolStats s = pool.stats(device);
  CHECK(s.cached_bytes <= 3 * kUnit);
  CHECK(s.trims == 1);
}

TEST_CASE("fragmentation figures: internal, external and class spread", "[pool][fragmentation]") {
  Device device = sim(64 * kUnit);
  GpuMemoryPool pool;
  auto live = pool.get_managed_buffer(device, 4097, Precision::Bytes);  // class 4352
  REQUIRE(live);
  { auto a = pool.get_managed_buffer(device, 1 * kUnit, Precision::Bytes); REQUIRE(a); }
  { auto b = pool.get_managed_buffer(device, 3 * kUnit, Precision::Bytes); REQUIRE(b); }
  PoolStats s = pool.stats(device);
  CHECK(s.fragmentation.internal == Approx((4352.0 - 4097.0) / 4352.0));
  CHECK(s.fragmentation.external == Approx(1.0 - 3.0 / 4.0));
  CHECK(s.fragmentation.largest_cached_block == 3 * kUnit);
  CHECK(s.fragmentation.cached_classes == 2);
}

TEST_CASE("OOM ladder: trim, retry, handlers, then a typed error with the figures", "[pool][oom]") {
  Device device = sim(8 * kUnit);
  GpuMemoryPool pool;
  { auto a = pool.get_managed_buffer(device, 6 * kUnit, Precision::Bytes); REQUIRE(a); }
  // 6 MiB cached; 4 MiB more does not fit the device: the ladder trims the cache and retries.
  auto b = pool.get_managed_buffer(device, 4 * kUnit, Precision::Bytes);
  REQUIRE(b);
  CHECK(pool.stats(device).cached_bytes == 0);

  std::vector<std::size_t> handler_requests;
  std::optional<ManagedBuffer> ballast = pool.get_managed_buffer(device, 3 * kUnit, Precision::Bytes).value();
  pool.add_oom_handler([&](int id, std::size_t requested) {
    handler_requests.push_back(requested);
    CHECK(id == device.id());
    if (!ballast) return false;               // nothing left to give: let the error through
    ballast.reset();                          // the application frees something...
    pool.emergency_cleanup(device);
    return true;                              // ...and asks for one more try
  });
  auto c = pool.get_managed_buffer(device, 3 * kUnit, Precision::Bytes);
  REQUIRE(c);
  CHECK(handler_requests == std::vector<std::size_t>{3 * kUnit});

  auto d = pool.get_managed_buffer(device, 7 * kUnit, Precision::Bytes);
  REQUIRE_FALSE(d);
  CHECK(d.error().kind() == ErrorKind::OutOfMemory);
  CHECK(d.error().device() == device.id());
  CHECK(handler_requests == std::vector<std::size_t>{3 * kUnit, 7 * kUnit});
  for (const char* figure : {"requested 28.00 KiB", "in use 28.00 KiB", "device free 4.00 KiB",
                             "of 32.00 KiB", "largest cached block"})
    CHECK_THAT(d.error().message(), Catch::Contains(figure));
  CHECK(pool.stats(device).out_of_memory_errors == 1);
}

TEST_CASE("an OOM handler that frees the caller's own buffers gets its retry served", "[pool][oom]") {
  Device device = sim(8 * MiB);
  GpuMemoryPool pool;
  std::optional<ManagedBuffer> ballast = take(pool, device, 5 * MiB);
  int calls = 0;
  pool.add_oom_handler([&](int, std::size_t) {
    ++calls;
    ballast.reset();  // back to the pool's cache, not to the device: the retry must see it
    return true;
  });
  auto big = pool.get_managed_buffer(device, 6 * MiB, Precision::Bytes);
  REQUIRE(big);
  CHECK(calls == 1);
  CHECK(pool.stats(device).out_of_memory_errors == 0);
}

TEST_CASE("injected device faults surface as OutOfMemory and lose nothing", "[pool][oom]") {
  Device device = sim(8 * MiB);
  GpuMemoryPool pool;
  REQUIRE(device.inject_faults({.fail_above_bytes = 1 * MiB}));
  auto big = pool.get_managed_buffer(device, 2 * MiB, Precision::Bytes);
  REQUIRE_FALSE(big);
  CHECK(big.error().kind() == ErrorKind::OutOfMemory);
  PoolStats s = pool.stats(device);
  CHECK(s.reserved_bytes == 0);
  CHECK(s.in_use_bytes == 0);
  CHECK(s.live_buffers == 0);
}

TEST_CASE("buffer batches are all-or-nothing and say which request failed", "[pool][batch]") {
  Device device = sim(4 * MiB);
  GpuMemoryPool pool;
  auto batch = pool.create_buffer_batch(device, {{1024, Precision::Fp32},
                                                 {2048, Precision::Fp16},
                                                 {100, Precision::Int8}});
  REQUIRE(batch);
  CHECK(batch->size() == 3);
  CHECK((*batch->at(1))->precision() == Precision::Fp16);
  CHECK(batch->total_bytes() == 4096 + 4096 + 100);
  CHECK(batch->at(3).error().kind() == ErrorKind::InvalidInput);

  auto failed = pool.create_buffer_batch(device, {{1024, Precision::Fp32}, {8 * MiB, Precision::Bytes}});
  REQUIRE_FALSE(failed);
  CHECK(failed.error().kind() == ErrorKind::OutOfMemory);
  CHECK_THAT(failed.error().message(), Catch::Contains("request 1 of 2"));
  CHECK(pool.stats(device).live_buffers == 3);  // only the first batch's

  auto removed = batch->remove(0);
  REQUIRE(removed);
  CHECK(batch->size() == 2);
  REQUIRE(batch->add(std::move(*removed)));
  REQUIRE(batch->add(16, Precision::Bf16));
  CHECK(batch->size() == 4);
  CHECK(batch->add(ManagedBuffer{}).error().kind() == ErrorKind::InvalidInput);
  Device other = sim();
  auto foreign = pool.get_managed_buffer(other, 4, Precision::Fp32);
  REQUIRE(foreign);
  CHECK(batch->add(std::move(*foreign)).error().kind() == ErrorKind::InvalidInput);
  batch = pool.create_buffer_batch(device);  // the old batch goes: all released together
  CHECK(pool.stats(device).live_buffers == 0);
}

TEST_CASE("a batch buffer keeps the size and precision it was made with", "[pool][batch][annie]") {
  // Annie accepted 10 bytes as (64, Fp32) and later handed them out as 64 floats.
  Device device = sim();
  GpuMemoryPool pool;
  BufferBatch batch = pool.create_buffer_batch(device);
  REQUIRE(batch.add(64, Precision::Fp32));
  CHECK(batch[0].size_bytes() == 256);
  CHECK(batch[0].element_count() == 64);
  auto small = pool.get_managed_buffer(device, 10, Precision::Bytes);
  REQUIRE(small);
  REQUIRE(batch.add(std::move(*small)));
  CHECK(batch[1].element_count() == 10);
  CHECK(batch[1].data<float>().error().kind() == ErrorKind::InvalidInput);
}

#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
TEST_CASE("the deprecated get_buffer/return_buffer API validates every return", "[pool][legacy]") {
  Device device = sim();
  GpuMemoryPool pool, other_pool;
  auto raw = pool.get_buffer(device, 64, Precision::Fp32);
  REQUIRE(raw);
  CHECK(raw->bytes == 256);

  RawBuffer wrong_size = *raw;
  wrong_size.bytes = 10;
  CHECK(pool.return_buffer(device, wrong_size).error().kind() == ErrorKind::InvalidInput);
  RawBuffer wrong_precision = *raw;
  wrong_precision.precision = Precision::Int8;
  CHECK(pool.return_buffer(device, wrong_precision).error().kind() == ErrorKind::InvalidInput);
  CHECK(pool.return_buffer(sim(), *raw).error().kind() == ErrorKind::InvalidInput);
  CHECK(other_pool.return_buffer(device, *raw).error().kind() == ErrorKind::InvalidState);
  int foreign = 0;
  CHECK(pool.return_buffer(device, RawBuffer{&foreign, 4, Precision::Fp32, device.id()}).error().kind() ==
        ErrorKind::InvalidState);
  CHECK(pool.stats(device).cached_bytes == 0);  // nothing adopted

  REQUIRE(pool.return_buffer(device, *raw));
  CHECK(pool.stats(device).cached_bytes == 256);
  auto twice = pool.return_buffer(device, *raw);
  REQUIRE_FALSE(twice);
  CHECK_THAT(twice.error().message(), Catch::Contains("already returned"));
  CHECK(pool.stats(device).cached_bytes == 256);
}
#pragma clang diagnostic pop

TEST_CASE("stats, peaks and the usage figures", "[pool][stats]") {
  Device a = sim(), b = sim();
  GpuMemoryPool pool;
  {
    auto x = pool.get_managed_buffer(a, 1 * kUnit, Precision::Bytes);
    auto y = pool.get_managed_buffer(b, 2 * kUnit, Precision::Bytes);
    REQUIRE(x);
    REQUIRE(y);
  }
  CHECK(pool.memory_usage(a) == MemoryUsage{.allocated = 1 * kUnit, .peak = 1 * kUnit});
  auto [allocated, peak] = pool.total_memory_usage();  // unpacks as a pair
  CHECK(allocated == 3 * kUnit);
  CHECK(peak == 3 * kUnit);
  CHECK_FALSE(pool.memory_usage(sim()));
  PoolStats total = pool.total_stats();
  CHECK(total.allocations == 2);
  CHECK(total.frees == 2);
  CHECK(total.peak_in_use_bytes == 3 * kUnit);
  pool.emergency_cleanup_all();
  pool.reset_peaks(a);
  CHECK(pool.stats(a).peak_reserved_bytes == 0);
  CHECK(pool.stats(b).peak_reserved_bytes == 2 * kUnit);
  pool.begin_phase(b);
  { auto z = pool.get_managed_buffer(b, kUnit / 2, Precision::Bytes); REQUIRE(z); }
  CHECK(pool.stats(b).peak_in_use_bytes == kUnit / 2);
}

TEST_CASE("pass-through mode caches nothing", "[pool][config]") {
  Device device = sim();
  GpuMemoryPool pool(PoolConfig{.caching = false});
  { auto a = pool.get_managed_buffer(device, 1 * MiB, Precision::Bytes); REQUIRE(a); }
  CHECK(pool.stats(device).cached_bytes == 0);
  CHECK(device_used(device) == 0);
}

TEST_CASE("an initial reservation warms the cache", "[pool][config]") {
  Device device = sim(64 * MiB);
  GpuMemoryPool pool(PoolConfig{.initial_reservation = 8 * MiB, .reservation_block_bytes = 4 * MiB});
  auto buffer = pool.get_managed_buffer(device, 4 * MiB, Precision::Bytes);
  REQUIRE(buffer);
  PoolStats s = pool.stats(device);
  CHECK(s.device_allocations == 2);
  CHECK(s.cache_hits == 1);
  CHECK(s.cached_bytes == 4 * MiB);
}

TEST_CASE("configuration from the environment", "[pool][config]") {
  ::setenv("GPUPOOL_MEMORY_LIMIT", "2GiB", 1);
  ::setenv("GPUPOOL_POOL", "none", 1);
  auto config = PoolConfig::from_environment();
  REQUIRE(config);
  CHECK(config->max_pool_size == 2 * GiB);
  CHECK_FALSE(config->caching);
  ::setenv("GPUPOOL_DEVICE", "sim:10GiB", 1);
  ::setenv("GPUPOOL_MEMORY_LIMIT", "50%", 1);
  config = PoolConfig::from_environment();
  REQUIRE(config);
  CHECK(config->max_pool_size == 5 * GiB);
  ::setenv("GPUPOOL_MEMORY_LIMIT", "lots", 1);
  auto bad = PoolConfig::from_environment();
  REQUIRE_FALSE(bad);
  CHECK_THAT(bad.error().message(), Catch::Contains("GPUPOOL_MEMORY_LIMIT='lots'"));
  ::setenv("GPUPOOL_MEMORY_LIMIT", "1GiB", 1);
  ::setenv("GPUPOOL_POOL", "sometimes", 1);
  CHECK(PoolConfig::from_environment().error().kind() == ErrorKind::InvalidInput);
  ::unsetenv("GPUPOOL_MEMORY_LIMIT");
  ::unsetenv("GPUPOOL_POOL");
  ::unsetenv("GPUPOOL_DEVICE");
}

TEST_CASE("stream-ordered reuse: same stream at once, other streams after their work", "[pool][streams]") {
  Device device = sim(64 * MiB, /*deferred=*/true);
  GpuMemoryPool pool;
  auto s1 = device.create_stream();
  auto s2 = device.create_stream();
  REQUIRE(s1);
  REQUIRE(s2);
  void* ptr = nullptr;
  {
    auto buffer = pool.get_managed_buffer(device, 1024, Precision::Fp32, *s1);
    REQUIRE(buffer);
    ptr = buffer->raw_data();
  }
  // Freed on s1: s1 reuses it at once; s2 must not (s1's queued work may still touch it).
  auto on_s2 = pool.get_managed_buffer(device, 1024, Precision::Fp32, *s2);
  REQUIRE(on_s2);
  CHECK(on_s2->raw_data() != ptr);
  auto on_s1 = pool.get_managed_buffer(device, 1024, Precision::Fp32, *s1);
  REQUIRE(on_s1);
  CHECK(on_s1->raw_data() == ptr);

  // Declared use on s2: after release the block waits for s2's pending work.
  bool s2_work_ran = false;
  REQUIRE(on_s1->record_stream(*s2));
  REQUIRE(device.enqueue_host_work(*s2, [&] { s2_work_ran = true; }));
  REQUIRE(on_s1->release());
  auto while_pending = pool.get_managed_buffer(device, 1024, Precision::Fp32, *s1);
  REQUIRE(while_pending);
  CHECK(while_pending->raw_data() != ptr);
  CHECK_FALSE(s2_work_ran);
  REQUIRE(s2->synchronize());
  CHECK(s2_work_ran);
  REQUIRE(while_pending->release());
  auto after = pool.get_managed_buffer(device, 1024, Precision::Fp32, *s1);
  REQUIRE(after);
  // The pending block joined the cache once s2 finished (either cached block may come back).
  CHECK(pool.stats(device).device_allocations == 3);
  CHECK(on_s2->record_stream(sim().default_stream()).error().kind() == ErrorKind::InvalidInput);
}
