#include <catch2/catch.hpp>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>
import gpupool;

using namespace gpupool;

namespace {
Device sim() {
  auto device = Device::simulated({.capacity = 256 * MiB});
  REQUIRE(device);
  return *device;
}
std::vector<std::byte> random_bytes(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> bytes(n);
  for (auto& b : bytes) b = std::byte{static_cast<unsigned char>(rng() % 255 + 1)};  // never zero
  return bytes;
}
}  // namespace

TEST_CASE("the staging pool reuses pinned chunks instead of pinning again", "[staging]") {
  Device device = sim();
  auto staging = PinnedStagingPool::create(device, 64 * KiB);
  REQUIRE(staging);
  {
    auto run = staging->acquire(200 * KiB);  // 4 chunks
    REQUIRE(run);
    CHECK(run->bytes().size() == 200 * KiB);
    CHECK(staging->reserved_bytes() >= 256 * KiB);
  }
  std::size_t reserved = staging->reserved_bytes();
  for (int i = 0; i < 10; ++i) {
    auto again = staging->acquire(100 * KiB);
    REQUIRE(again);
  }
  CHECK(staging->reserved_bytes() == reserved);
  CHECK(staging->release_unused());
  CHECK(staging->reserved_bytes() == 0);
}

TEST_CASE("two live staging runs never overlap", "[staging]") {
  Device device = sim();
  auto staging = PinnedStagingPool::create(device, 4 * KiB);
  REQUIRE(staging);
  auto a = staging->acquire(10 * KiB);
  auto b = staging->acquire(10 * KiB);
  REQUIRE(a);
  REQUIRE(b);
  auto* a0 = a->bytes().data();
  auto* b0 = b->bytes().data();
  CHECK((b0 >= a0 + 12 * KiB || a0 >= b0 + 12 * KiB));
  staging->release_unused();
  CHECK(staging->reserved_bytes() >= 24 * KiB);  // live runs keep their blocks
}

TEST_CASE("uploads and downloads through small staging runs round-trip", "[staging]") {
  Device device = sim();
  GpuMemoryPool pool;
  auto staging = PinnedStagingPool::create(device, 64 * KiB);
  REQUIRE(staging);
  auto buffer = pool.get_managed_buffer(device, 3 * MiB + 123, Precision::Bytes);
  REQUIRE(buffer);
  auto data = random_bytes(3 * MiB + 100, 7);
  REQUIRE(upload_staged(*staging, *buffer, data, 23, 256 * KiB));
  std::vector<std::byte> back(data.size(), std::byte{0xAB});  // poisoned
  REQUIRE(download_staged(*staging, *buffer, back, 23, 100 * KiB));
  CHECK(back == data);
  CHECK(staging->reserved_bytes() <= 320 * KiB);
}

TEST_CASE("bad staging requests are errors that say what was expected", "[staging]") {
  Device device = sim();
  CHECK(PinnedStagingPool::create(device, 100).error().kind() == ErrorKind::InvalidInput);
  auto staging = PinnedStagingPool::create(device);
  REQUIRE(staging);
  CHECK(staging->acquire(0).error().kind() == ErrorKind::InvalidInput);
  GpuMemoryPool pool;
  auto buffer = pool.get_managed_buffer(device, 1000, Precision::Bytes);
  REQUIRE(buffer);
  std::vector<std::byte> big(2000, std::byte{1});
  auto too_big = upload_staged(*staging, *buffer, big);
  REQUIRE_FALSE(too_big);
  CHECK(too_big.error().kind() == ErrorKind::InvalidInput);
  CHECK_THAT(too_big.error().message(), Catch::Contains("expected offset + size <= buffer size"));
  CHECK(upload_staged(*staging, *buffer, std::span<const std::byte>(big).first(10), 0, 0).error().kind() ==
        ErrorKind::InvalidInput);
  ManagedBuffer empty;
  CHECK(download_staged(*staging, empty, big).error().kind() == ErrorKind::InvalidInput);
}
