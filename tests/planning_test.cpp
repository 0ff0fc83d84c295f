// Planning: OOM forecasts checked against what the pool really does, chunking and batch sizes
// with exact numbers, and every bad input.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstddef>
#include <expected>
#include <limits>
#include <optional>
#include <rapidcheck/catch.h>
#include <string>
#include <vector>
import gpupool;

using namespace gpupool;
// These figures are exact per block: every block is its own device allocation (segments off).
const PoolConfig kOwnBlocks{.segments = false};


namespace {
Device sim(std::size_t capacity) {
  auto device = Device::simulated({.capacity = capacity});
  REQUIRE(device);
  return *device;
}
// Whether `bytes`, rounded to its size class, can pass `budget`: classes waste less than 256
// bytes up to 4 KiB and at most 1/16 above.
bool may_pass(std::size_t bytes, std::size_t budget) {
  return bytes > 4096 ? bytes + bytes / 16 > budget : bytes + 255 > budget;
}
bool mentions(const GpuError& error, const std::string& part) {
  INFO(error.to_string());
  return error.message().find(part) != std::string::npos;
}
}  // namespace

TEST_CASE("will_oom counts the device's free memory and the pool's cache", "[planning]") {
  Device device = sim(16 * MiB);
  GpuMemoryPool pool(kOwnBlocks);
  CHECK(will_oom(16 * MiB, device, pool) == false);
  CHECK(will_oom(16 * MiB + 1, device, pool) == true);  // its class is 17 MiB
  auto forecast = predict_oom(16 * MiB + 1, device, pool);
  REQUIRE(forecast);
  CHECK(forecast->block_bytes == 17 * MiB);
  CHECK(forecast->device_free_bytes == 16 * MiB);
  CHECK(forecast->reason == "a block of 17.00 MiB (17825792 bytes) is more than the device's free "
                            "16.00 MiB (16777216 bytes) plus the pool's cached 0 B");

  { auto cached = pool.get_managed_buffer(device, 8 * MiB, Precision::Bytes); REQUIRE(cached); }
  forecast = predict_oom(16 * MiB, device, pool);
  REQUIRE(forecast);
  CHECK(forecast->device_free_bytes == 8 * MiB);
  CHECK(forecast->reclaimable_bytes == 8 * MiB);
  CHECK(!forecast->will_oom);
  auto whole = pool.get_managed_buffer(device, 16 * MiB, Precision::Bytes);  // the ladder trims
  CHECK(whole);

  CHECK(will_oom(MiB, device) == true);  // without the pool: the device is full
  CHECK(will_oom(MiB, device, pool) == true);
}

TEST_CASE("will_oom respects the pool's hard limit", "[planning]") {
  Device device = sim(64 * MiB);
  GpuMemoryPool pool(PoolConfig{.max_pool_size = 4 * MiB, .segments = false});
  CHECK(will_oom(4 * MiB, device, pool) == false);
  auto forecast = predict_oom(4 * MiB + 1, device, pool);
  REQUIRE(forecast);
  CHECK(forecast->will_oom);
  CHECK(forecast->limit == std::optional<std::size_t>(4 * MiB));
  CHECK(forecast->reason.find("passes the pool limit of 4.00 MiB") != std::string::npos);
  auto refused = pool.get_managed_buffer(device, 4 * MiB + 1, Precision::Bytes);
  REQUIRE(!refused);
  CHECK(refused.error().kind() == ErrorKind::PoolLimitExceeded);
}

TEST_CASE("will_oom refuses sizes the pool never hands out", "[planning]") {
  Device device = sim(MiB);
  GpuMemoryPool pool(kOwnBlocks);
  auto zero = will_oom(0, device, pool);
  REQUIRE(!zero);
  CHECK(zero.error().kind() == ErrorKind::InvalidInput);
  CHECK(mentions(zero.error(), "will_oom of 0 bytes"));
  auto absurd = will_oom(std::size_t{1} << 50, device, pool);
  REQUIRE(!absurd);
  CHECK(mentions(absurd.error(), "1125899906842624 bytes"));
  CHECK(!will_oom(0, device));
}

TEST_CASE("will_oom's forecast is what the pool then does", "[planning][property]") {
  rc::prop("forecast == outcome on a random pool state", [] {
    const std::size_t capacity = *rc::gen::inRange<std::size_t>(MiB, 32 * MiB);
    const bool limited = *rc::gen::arbitrary<bool>();
    const std::size_t limit = *rc::gen::inRange<std::size_t>(MiB / 2, 48 * MiB);
    auto device = Device::simulated({.capacity = capacity});
    RC_ASSERT(device.has_value());
    PoolConfig config;
    if (limited) config.max_pool_size = limit;
    config.segments = false;
    GpuMemoryPool pool(config);
    std::vector<ManagedBuffer> kept;
    const auto sizes = *rc::gen::container<std::vector<std::size_t>>(rc::gen::inRange<std::size_t>(1, 4 * MiB));
    for (std::size_t size : sizes) {
      auto buffer = pool.get_managed_buffer(*device, size, Precision::Bytes);
      if (buffer && *rc::gen::arbitrary<bool>()) kept.push_back(std::move(*buffer));
    }
    const std::size_t request = *rc::gen::inRange<std::size_t>(1, 2 * capacity);
    auto forecast = will_oom(request, *device, pool);
    RC_ASSERT(forecast.has_value());
    auto outcome = pool.get_managed_buffer(*device, request, Precision::Bytes);
    RC_ASSERT(*forecast == !outcome.has_value());
  });
}

TEST_CASE("auto_chunk splits items so a chunk's size class fits the budget", "[planning]") {
  auto even = auto_chunk(100, MiB, 64 * MiB, 0.5);
  REQUIRE(even);
  CHECK(even->chunk_size == 32);
  CHECK(even->num_chunks == 4);
  CHECK(even->last_chunk_size == 4);
  CHECK(even->bytes_per_chunk == 32 * MiB);
  CHECK(even->to_string() == "Chunking: 4 chunks of 32 items (last 4)\nMemory per chunk: 32.00 MiB (33554432 bytes)\n");

  // 10 items of 1000 bytes round up to a 10240-byte block, past the budget of 10000: 9 fit.
  auto rounded = auto_chunk(20, 1000, 10000, 1.0);
  REQUIRE(rounded);
  CHECK(rounded->chunk_size == 9);
  CHECK(rounded->num_chunks == 3);
  CHECK(rounded->last_chunk_size == 2);
  CHECK(rounded->bytes_per_chunk == 9000);

  auto single = auto_chunk(3, 100, GiB, 0.7);
  REQUIRE(single);
  CHECK(single->num_chunks == 1);
  CHECK(single->chunk_size == 3);
  CHECK(single->last_chunk_size == 3);
  CHECK(single->to_string() == "Chunking: 1 chunk of 3 items (last 3)\nMemory per chunk: 300 B\n");
}

TEST_CASE("auto_chunk on a device uses its free memory, the cache and the limit", "[planning]") {
  Device device = sim(64 * MiB);
  GpuMemoryPool pool(kOwnBlocks);
  { auto cached = pool.get_managed_buffer(device, 8 * MiB, Precision::Bytes); REQUIRE(cached); }
  CHECK(available_bytes(device, pool) == std::size_t{64 * MiB});
  auto config = auto_chunk(1000, MiB, device, pool, 0.25);
  REQUIRE(config);
  CHECK(config->chunk_size == 16);
  CHECK(config->num_chunks == 63);
  CHECK(config->last_chunk_size == 8);
  REQUIRE(pool.set_max_pool_size(device, 10 * MiB));
  auto in_use = pool.get_managed_buffer(device, 2 * MiB, Precision::Bytes);
  REQUIRE(in_use);
  CHECK(available_bytes(device, pool) == std::size_t{8 * MiB});
}

TEST_CASE("auto_chunk names each bad input", "[planning]") {
  auto no_items = auto_chunk(0, 4, MiB);
  REQUIRE(!no_items);
  CHECK(no_items.error().kind() == ErrorKind::InvalidInput);
  CHECK(mentions(no_items.error(), "0 items"));
  CHECK(mentions(auto_chunk(4, 0, MiB).error(), "0 bytes per item"));
  CHECK(mentions(auto_chunk(4, 4, MiB, 0.0).error(), "memory fraction 0: expected a share in (0, 1]"));
  CHECK(mentions(auto_chunk(4, 4, MiB, 1.5).error(), "memory fraction 1.5"));
  CHECK(mentions(auto_chunk(4, 4, MiB, std::nan("")).error(), "memory fraction nan"));
  CHECK(mentions(auto_chunk(std::size_t{1} << 40, std::size_t{1} << 20, MiB).error(), "overflow"));
  auto too_big = auto_chunk(10, MiB, MiB, 0.7);
  REQUIRE(!too_big);
  CHECK(too_big.error().kind() == ErrorKind::OutOfMemory);
  CHECK(mentions(too_big.error(), "one item of 1.00 MiB (1048576 bytes)"));
}

TEST_CASE("auto_chunk's chunks cover the items and are as large as fit", "[planning][property]") {
  rc::prop("chunking invariants", [] {
    const std::size_t items = *rc::gen::inRange<std::size_t>(1, 100000);
    const std::size_t per_item = *rc::gen::inRange<std::size_t>(1, 100000);
    const std::size_t available = *rc::gen::inRange<std::size_t>(1, std::size_t{1} << 32);
    const double fraction = *rc::gen::inRange(1, 101) / 100.0;
    auto config = auto_chunk(items, per_item, available, fraction);
    const auto budget = static_cast<std::size_t>(std::floor(fraction * static_cast<double>(available)));
    if (!config) {
      RC_ASSERT(config.error().kind() == ErrorKind::OutOfMemory);
      RC_ASSERT(may_pass(per_item, budget));  // one item's size class passes the budget
      return;
    }
    RC_ASSERT((config->num_chunks - 1) * config->chunk_size + config->last_chunk_size == items);
    RC_ASSERT(config->last_chunk_size >= 1);
    RC_ASSERT(config->last_chunk_size <= config->chunk_size);
    RC_ASSERT(config->bytes_per_chunk == config->chunk_size * per_item);
    RC_ASSERT(config->bytes_per_chunk <= budget);
    if (config->chunk_size < items) RC_ASSERT(may_pass((config->chunk_size + 1) * per_item, budget));
  });
}

TEST_CASE("recommend_batch_size: a fraction of what is available, at least one item", "[planning]") {
  auto r = recommend_batch_size(10000, 4096, 64 * MiB, 0.5);
  REQUIRE(r);
  CHECK(r->available_bytes == 64 * MiB);
  CHECK(r->usable_bytes == 32 * MiB);
  CHECK(r->bytes_per_item == 4096);
  CHECK(r->max_items == 8192);
  CHECK(r->batch_size == 8192);
  CHECK(r->to_string() == "Batch size recommendation:\n  Available memory: 64.00 MiB (67108864 bytes)\n"
                          "  Usable memory: 32.00 MiB (33554432 bytes)\n  Memory per item (worst case): "
                          "4.00 KiB (4096 bytes)\n  Max items per batch: 8192\n  Recommended batch size: 8192\n");
  CHECK(recommend_batch_size(10000, 4096, 64 * MiB, 0.5, 1000)->batch_size == 1000);
  CHECK(recommend_batch_size(100, 4096, 64 * MiB, 0.5)->batch_size == 100);
  auto starved = recommend_batch_size(100, 4096, 1000, 0.7);
  REQUIRE(starved);
  CHECK(starved->max_items == 1);  // at least one
  CHECK(starved->batch_size == 1);

  Device device = sim(64 * MiB);
  GpuMemoryPool pool(PoolConfig{.max_pool_size = 8 * MiB, .segments = false});
  auto limited = recommend_batch_size(100, MiB, device, pool, 0.5);
  REQUIRE(limited);
  CHECK(limited->available_bytes == 8 * MiB);
  CHECK(limited->batch_size == 4);

  CHECK(mentions(recommend_batch_size(0, 1, MiB).error(), "0 items"));
  CHECK(mentions(recommend_batch_size(1, 0, MiB).error(), "0 bytes per item"));
  CHECK(mentions(recommend_batch_size(1, 1, MiB, -0.1).error(), "memory fraction -0.1"));
  CHECK(mentions(recommend_batch_size(1, 1, MiB, 0.5, 0).error(), "a cap of 0"));
}
