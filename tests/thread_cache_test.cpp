// Thread caches (pool/thread_cache.cppm): a thread's freed blocks serve its next allocations; they
// stay exact in the stats, go back on trim and cleanup, and outlive neither their thread nor the
// pool in a way that loses a byte. The multi-threaded cases are data-race checks under tsan.
#include <catch2/catch.hpp>
#include <atomic>
#include <barrier>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <thread>
#include <vector>
import gpupool;

using namespace gpupool;

namespace {

Device sim(std::size_t capacity) {
  auto device = Device::simulated({.capacity = capacity});
  REQUIRE(device);
  return *device;
}

std::size_t device_used(const Device& device) {
  auto memory = device.memory_info();
  REQUIRE(memory);
  return memory->total - memory->free;
}

ManagedBuffer take(GpuMemoryPool& pool, const Device& device, std::size_t bytes) {
  auto buffer = pool.get_managed_buffer(device, bytes, Precision::Bytes);
  REQUIRE(buffer);
  return std::move(*buffer);
}

// For worker threads, where Catch2's assertions are not safe: counts failures for the main
// thread to check.
std::atomic<int> worker_failures{0};
ManagedBuffer take_in_worker(GpuMemoryPool& pool, const Device& device, std::size_t bytes) {
  auto buffer = pool.get_managed_buffer(device, bytes, Precision::Bytes);
  if (!buffer) {
    ++worker_failures;
    return ManagedBuffer();
  }
  return std::move(*buffer);
}

}  // namespace

TEST_CASE("a thread's freed block serves its next allocation of the class", "[pool][thread-cache]") {
  Device device = sim(1 * GiB);
  GpuMemoryPool pool;
  for (std::size_t bytes : {std::size_t{256}, 48 * KiB, 3 * MiB, 40 * MiB}) {
    void* first = take(pool, device, bytes).raw_data();
    const PoolStats before = pool.stats(device);
    for (int i = 0; i < 100; ++i) CHECK(take(pool, device, bytes).raw_data() == first);
    const PoolStats after = pool.stats(device);
    CHECK(after.device_allocations == before.device_allocations);
    CHECK(after.cache_hits == before.cache_hits + 100);
    CHECK(after.allocations == before.allocations + 100);
    CHECK(after.live_buffers == 0);
    CHECK(after.in_use_bytes == 0);
  }
}

TEST_CASE("a full thread cache sends a large block back to its segment, unless its size loops",
          "[pool][thread-cache]") {
  Device device = sim(1 * GiB);
  GpuMemoryPool pool;
  { ManagedBuffer a = take(pool, device, 3 * MiB); }  // this thread's cache holds 3 MiB now
  ManagedBuffer y = take(pool, device, 2 * MiB);
  ManagedBuffer z = take(pool, device, 3 * MiB / 2);  // the class asked for last
  void* const y_address = y.raw_data();
  y = ManagedBuffer{};  // 2 more MiB would pass the cache's 4: back to the segment instead
  void* other_threads = nullptr;
  std::thread([&] { other_threads = take_in_worker(pool, device, 2 * MiB).raw_data(); }).join();
  CHECK(worker_failures == 0);
  CHECK(other_threads == y_address);  // reached through the shared segment

  // A loop of one size: the block is the class this thread just missed, so it stays here (the
  // older 3 MiB block is evicted to make room) and serves the next request as a hit.
  ManagedBuffer w = take(pool, device, 5 * MiB / 2);
  void* const w_address = w.raw_data();
  w = ManagedBuffer{};
  const PoolStats before = pool.stats(device);
  CHECK(take(pool, device, 5 * MiB / 2).raw_data() == w_address);
  CHECK(pool.stats(device).cache_hits == before.cache_hits + 1);
}

TEST_CASE("the stats count blocks in thread caches exactly", "[pool][thread-cache][stats]") {
  Device device = sim(1 * GiB);
  GpuMemoryPool pool;
  ManagedBuffer live = take(pool, device, 100 * KiB + 3);
  { ManagedBuffer parked = take(pool, device, 1000); }
  const PoolStats s = pool.stats(device);
  CHECK(s.live_buffers == 1);
  CHECK(s.in_use_bytes == live.capacity_bytes());
  CHECK(s.requested_bytes == 100 * KiB + 3);
  CHECK(s.cached_bytes == s.reserved_bytes - s.in_use_bytes);
  CHECK(s.peak_in_use_bytes == live.capacity_bytes() + 1024);
  CHECK(s.peak_requested_bytes == 100 * KiB + 3 + 1000);
  CHECK(s.fragmentation.cached_classes >= 1);  // the parked 1 KiB block's class
}

TEST_CASE("a second thread's peaks see what the first thread's cache kept to itself",
          "[pool][thread-cache][stats]") {
  // The only cache of a pool publishes nothing, even above 64 MiB; the second cache to come makes
  // it publish, so the peaks the second thread raises include the first thread's blocks.
  Device device = sim(1 * GiB);
  GpuMemoryPool pool;
  ManagedBuffer mine = take(pool, device, 100 * MiB);
  pool.reset_peaks(device);
  const std::size_t mine_bytes = mine.capacity_bytes();
  std::size_t theirs_bytes = 0;
  std::thread([&] {
    ManagedBuffer theirs = take_in_worker(pool, device, 70 * MiB);
    theirs_bytes = theirs.capacity_bytes();
  }).join();
  REQUIRE(worker_failures == 0);
  const PoolStats s = pool.stats(device);
  CHECK(s.in_use_bytes == mine_bytes);
  CHECK(s.peak_in_use_bytes == mine_bytes + theirs_bytes);
  CHECK(s.peak_requested_bytes == 170 * MiB);
  // Alone again, the first thread's peaks stay exact.
  mine = ManagedBuffer();
  pool.reset_peaks(device);
  { ManagedBuffer again = take(pool, device, 200 * MiB); }
  CHECK(pool.stats(device).peak_requested_bytes == 200 * MiB);
  CHECK(pool.stats(device).in_use_bytes == 0);
}

TEST_CASE("a thread cache holds a few blocks per class, the rest are shared at once", "[pool][thread-cache]") {
  Device device = sim(1 * GiB);
  GpuMemoryPool pool;
  constexpr int kBlocks = 40;
  {
    std::vector<ManagedBuffer> blocks;
    for (int i = 0; i < kBlocks; ++i) blocks.push_back(take(pool, device, 64 * KiB));
  }  // freed here: at most a few stay in this thread's cache
  const std::uint64_t made = pool.stats(device).device_allocations;
  std::thread other([&] {
    std::vector<ManagedBuffer> blocks;
    for (int i = 0; i < kBlocks; ++i) blocks.push_back(take_in_worker(pool, device, 64 * KiB));
  });
  other.join();
  REQUIRE(worker_failures.exchange(0) == 0);
  const std::uint64_t new_ones = pool.stats(device).device_allocations - made;
  CHECK(new_ones >= 1);  // some blocks were parked in the first thread's cache
  CHECK(new_ones <= 4);  // and only a few
}

TEST_CASE("trim and cleanup take back what thread caches hold", "[pool][thread-cache]") {
  Device device = sim(1 * GiB);
  GpuMemoryPool pool;
  constexpr int kThreads = 4;
  std::barrier parked(kThreads + 1), cleaned(kThreads + 1);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      { ManagedBuffer a = take_in_worker(pool, device, 2 * KiB * (t + 1)); }
      { ManagedBuffer b = take_in_worker(pool, device, 1 * MiB * (t + 1)); }
      parked.arrive_and_wait();   // the blocks sit in this thread's cache, the thread lives on
      cleaned.arrive_and_wait();
      { ManagedBuffer again = take_in_worker(pool, device, 1 * MiB * (t + 1)); }  // the pool still works
    });
  parked.arrive_and_wait();
  CHECK(worker_failures.load() == 0);  // no REQUIRE: the workers wait at the barrier
  CHECK(pool.stats(device).cached_bytes > 0);
  CHECK(pool.trim(device, 0) > 0);
  CHECK(pool.stats(device).reserved_bytes == 0);
  CHECK(device_used(device) == 0);
  cleaned.arrive_and_wait();
  for (auto& thread : threads) thread.join();
  REQUIRE(worker_failures.exchange(0) == 0);
  pool.emergency_cleanup_all();
  CHECK(device_used(device) == 0);
  CHECK(pool.stats(device).live_buffers == 0);
}

TEST_CASE("a buffer outlives the thread that made it and the pool", "[pool][thread-cache]") {
  Device device = sim(1 * GiB);
  std::optional<ManagedBuffer> survivor;
  {
    GpuMemoryPool pool;
    std::thread maker([&] {
      survivor = take_in_worker(pool, device, 3 * MiB);
      { ManagedBuffer parked = take_in_worker(pool, device, 5 * KiB); }  // left in the exiting thread's cache
    });
    maker.join();
    REQUIRE(worker_failures.exchange(0) == 0);
    // The thread is gone: its cache gave its block back to the pool.
    CHECK(pool.stats(device).live_buffers == 1);
    CHECK(pool.stats(device).in_use_bytes == survivor->capacity_bytes());
  }
  CHECK(device_used(device) >= 3 * MiB);
  std::vector<std::byte> data(survivor->size_bytes(), std::byte{7});
  REQUIRE(survivor->upload(std::span<const std::byte>(data)));
  survivor.reset();  // the last user of the pool's state: everything goes back to the device
  CHECK(device_used(device) == 0);
}

TEST_CASE("buffers freed on other threads return to the cache they came from", "[pool][thread-cache][threads]") {
  Device device = sim(2 * GiB);
  GpuMemoryPool pool;
  constexpr int kThreads = 8;
  constexpr int kRounds = 300;
  std::vector<std::vector<ManagedBuffer>> handed(kThreads);
  std::barrier round_done(kThreads);
  std::atomic<std::size_t> live_requested{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      std::mt19937_64 random(static_cast<std::uint64_t>(t) * 7919 + 1);
      std::vector<ManagedBuffer> mine;
      for (int round = 0; round < kRounds; ++round) {
        // Allocate and free on this thread (mostly cache hits), keep a few live.
        for (int i = 0; i < 8; ++i) {
          std::size_t bytes = 1 + random() % (i % 2 ? 64 * KiB : 2 * MiB);
          ManagedBuffer buffer = take_in_worker(pool, device, bytes);
          if (buffer && random() % 4 == 0) {
            live_requested += bytes;
            mine.push_back(std::move(buffer));
          }
        }
        // Hand the live ones to the next thread, free what the previous one handed here.
        handed[(t + 1) % kThreads] = std::move(mine);
        mine.clear();
        round_done.arrive_and_wait();
        for (ManagedBuffer& buffer : handed[t]) {
          live_requested -= buffer.size_bytes();
          buffer = ManagedBuffer();
        }
        handed[t].clear();
        round_done.arrive_and_wait();
      }
    });
  for (auto& thread : threads) thread.join();
  REQUIRE(worker_failures.exchange(0) == 0);
  const PoolStats s = pool.stats(device);
  CHECK(live_requested == 0);
  CHECK(s.live_buffers == 0);
  CHECK(s.in_use_bytes == 0);
  CHECK(s.requested_bytes == 0);
  CHECK(s.allocations == s.frees);
  CHECK(s.allocations == std::uint64_t{kThreads} * kRounds * 8);
  CHECK(s.cache_hits + s.cache_misses == s.allocations);
  pool.emergency_cleanup_all();
  CHECK(device_used(device) == 0);
}
