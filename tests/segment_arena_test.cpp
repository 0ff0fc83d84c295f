// Blocks above 64 KiB: carved from device segments, best fit, merged with free neighbours.
#include <catch2/catch.hpp>
#include <atomic>
#include <barrier>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <thread>
#include <vector>
import gpupool;
#include "support/sim_device.hpp"

using namespace gpupool;
using gpupool::testing::device_used;
using gpupool::testing::sim;
using gpupool::testing::take;


TEST_CASE("large blocks come from one segment and serve other sizes after a free", "[pool][arena]") {
  Device device = sim(4 * GiB);
  GpuMemoryPool pool;
  { ManagedBuffer a = take(pool, device, 3 * MiB); }
  ManagedBuffer b = take(pool, device, 2 * MiB);  // a different class: carved from the same memory
  ManagedBuffer c = take(pool, device, 5 * MiB);
  PoolStats s = pool.stats(device);
  CHECK(s.device_allocations == 1);
  CHECK(s.reserved_bytes == 32 * MiB);
  CHECK(s.in_use_bytes == 7 * MiB);
  CHECK(s.cache_hits == 2);
  CHECK(device_used(device) == 32 * MiB);
  CHECK(b.capacity_bytes() == 2 * MiB);
  auto* b_begin = static_cast<std::byte*>(b.raw_data());
  auto* c_begin = static_cast<std::byte*>(c.raw_data());
  CHECK((c_begin >= b_begin + b.capacity_bytes() || b_begin >= c_begin + c.capacity_bytes()));
}

TEST_CASE("freed neighbours merge, a segment goes back only when no block uses it", "[pool][arena]") {
  Device device = sim(4 * GiB);
  PoolConfig config;
  config.thread_caches = false;  // every free reaches the arena at once
  GpuMemoryPool pool(config);
  std::optional<ManagedBuffer> a = take(pool, device, 2 * MiB);
  std::optional<ManagedBuffer> b = take(pool, device, 2 * MiB);
  std::optional<ManagedBuffer> c = take(pool, device, 2 * MiB);
  a.reset();
  b.reset();
  PoolStats s = pool.stats(device);
  CHECK(s.fragmentation.stranded_bytes == 30 * MiB);  // the free 4 MiB + the 26 MiB tail
  CHECK(s.fragmentation.largest_cached_block == 26 * MiB);
  CHECK(pool.trim(device, 0) == 0);                   // c still lives in the segment
  { ManagedBuffer merged = take(pool, device, 4 * MiB); CHECK(pool.stats(device).device_allocations == 1); }
  c.reset();
  s = pool.stats(device);
  CHECK(s.fragmentation.stranded_bytes == 0);
  CHECK(s.fragmentation.largest_cached_block == 32 * MiB);
  CHECK(s.fragmentation.external == 0.0);
  CHECK(pool.trim(device, 0) == 32 * MiB);
  CHECK(device_used(device) == 0);
}

TEST_CASE("a segment never takes the last free memory of the device", "[pool][arena]") {
  Device device = sim(8 * MiB);
  GpuMemoryPool pool;
  ManagedBuffer a = take(pool, device, 3 * MiB);
  CHECK(pool.stats(device).reserved_bytes == 3 * MiB);  // exactly the block: 8 MiB is too small to carve
  ManagedBuffer b = take(pool, device, 5 * MiB);
  CHECK(device_used(device) == 8 * MiB);
}

TEST_CASE("a full segment that cannot serve a request goes back before the device is asked", "[pool][arena]") {
  Device device = sim(16 * MiB);
  GpuMemoryPool pool;
  { ManagedBuffer a = take(pool, device, 6 * MiB); }  // an exact 6 MiB segment, now free
  ManagedBuffer b = take(pool, device, 12 * MiB);      // does not fit in it: it is freed first
  PoolStats s = pool.stats(device);
  CHECK(s.reserved_bytes == 12 * MiB);
  CHECK(s.peak_reserved_bytes == 12 * MiB);
  CHECK(s.trims == 1);
}

TEST_CASE("large blocks are reused at once only on the stream that freed them", "[pool][arena][streams]") {
  Device device = sim(4 * GiB, /*deferred=*/true);
  GpuMemoryPool pool;
  auto s1 = device.create_stream();
  auto s2 = device.create_stream();
  REQUIRE(s1);
  REQUIRE(s2);
  void* first = nullptr;
  {
    auto a = pool.get_managed_buffer(device, 2 * MiB, Precision::Bytes, *s1);
    REQUIRE(a);
    first = a->raw_data();
  }
  auto on_s2 = pool.get_managed_buffer(device, 2 * MiB, Precision::Bytes, *s2);
  REQUIRE(on_s2);
  CHECK(on_s2->raw_data() != first);
  auto on_s1 = pool.get_managed_buffer(device, 2 * MiB, Precision::Bytes, *s1);
  REQUIRE(on_s1);
  CHECK(on_s1->raw_data() == first);
  // Declared use on s2 with queued work: the block waits for it, then merges back.
  bool ran = false;
  REQUIRE(on_s1->record_stream(*s2));
  REQUIRE(device.enqueue_host_work(*s2, [&] { ran = true; }));
  REQUIRE(on_s1->release());
  auto meanwhile = pool.get_managed_buffer(device, 2 * MiB, Precision::Bytes, *s1);
  REQUIRE(meanwhile);
  CHECK(meanwhile->raw_data() != first);
  REQUIRE(s2->synchronize());
  CHECK(ran);
  meanwhile = ManagedBuffer();
  on_s2 = ManagedBuffer();
  CHECK(pool.emergency_cleanup_all() > 0);
  CHECK(device_used(device) == 0);
}

TEST_CASE("a random 1 B - 4 MiB trace reserves little above what it requests", "[pool][arena][fragmentation]") {
  // The class-per-block cache alone reserved about 2x the peak request on this kind of trace.
  Device device = sim(16 * GiB);
  GpuMemoryPool pool;
  std::vector<std::optional<ManagedBuffer>> slots(200);
  std::uint64_t state = 12345;
  auto next = [&] { state = state * 6364136223846793005ull + 1442695040888963407ull; return state >> 33; };
  for (int op = 0; op < 6000; ++op) {
    auto& slot = slots[next() % slots.size()];
    if (slot) slot.reset();
    else slot = take(pool, device, 1 + next() % (4 * MiB));
  }
  PoolStats s = pool.stats(device);
  double ratio = static_cast<double>(s.peak_reserved_bytes) / static_cast<double>(s.peak_requested_bytes);
  INFO("peak reserved " << s.peak_reserved_bytes << ", peak requested " << s.peak_requested_bytes);
  CHECK(ratio < 1.2);
  slots.clear();
  pool.emergency_cleanup_all();
  CHECK(device_used(device) == 0);
}

TEST_CASE("a block carved from a segment holds its own size, not its class's", "[pool][arena]") {
  Device device = sim(4 * GiB);
  PoolConfig config;
  config.thread_caches = false;
  GpuMemoryPool pool(config);
  // 1 MiB + 1 byte: its class holds 1 MiB + 64 KiB; the block holds 1 MiB + 256 B.
  ManagedBuffer a = take(pool, device, MiB + 1);
  CHECK(a.capacity_bytes() == MiB + 256);
  CHECK(pool.stats(device).in_use_bytes == MiB + 256);
  // The next block starts right after it, and the two leave the rest of the segment free.
  ManagedBuffer b = take(pool, device, 3 * MiB - 1000);
  CHECK(b.capacity_bytes() == 3 * MiB - 768);
  CHECK(static_cast<std::byte*>(b.raw_data()) == static_cast<std::byte*>(a.raw_data()) + MiB + 256);
  PoolStats s = pool.stats(device);
  CHECK(s.in_use_bytes == 4 * MiB - 512);
  CHECK(s.fragmentation.largest_cached_block == 28 * MiB + 512);
}

TEST_CASE("a freed range of a class serves a request of that class only where it is large enough",
          "[pool][arena]") {
  Device device = sim(4 * GiB);
  GpuMemoryPool pool;  // with thread caches: the freed block waits in this thread's cache
  std::optional<ManagedBuffer> small = take(pool, device, MiB + 1000);
  ManagedBuffer fence = take(pool, device, 4 * MiB);  // keeps the freed range from merging
  void* small_at = small->raw_data();
  small.reset();
  // Same class (1 MiB .. 1 MiB + 64 KiB), more bytes: the cached block is too small for it.
  ManagedBuffer larger = take(pool, device, MiB + 5000);
  CHECK(larger.raw_data() != small_at);
  CHECK(larger.capacity_bytes() >= MiB + 5000);
  // Fewer bytes: the cached block serves it.
  ManagedBuffer smaller = take(pool, device, MiB + 500);
  CHECK(smaller.raw_data() == small_at);
  CHECK(smaller.capacity_bytes() == MiB + 1024);
  // Writing the whole of each is within its block: the blocks do not overlap.
  auto* a = static_cast<std::byte*>(larger.raw_data());
  auto* b = static_cast<std::byte*>(smaller.raw_data());
  CHECK((a >= b + smaller.capacity_bytes() || b >= a + larger.capacity_bytes()));
}

TEST_CASE("threads that move to arena shards of their own take whole free segments from the "
          "shared one before asking the device",
          "[pool][arena][threads]") {
  Device device = sim(8 * GiB);
  GpuMemoryPool pool;
  // This thread alone, on the shared shard: twenty 32 MiB segments, then every block freed —
  // more than the threads below can hold blocks in at once, so some stay wholly free.
  {
    std::vector<ManagedBuffer> held;
    for (int i = 0; i < 200; ++i) held.push_back(take(pool, device, 3 * MiB));
  }
  const std::uint64_t device_allocations = pool.stats(device).device_allocations;
  REQUIRE(device_allocations == 20);
  // Four threads of large requests of varying sizes, at most two live each, started together:
  // they meet on the shared shard's lock and move to shards of their own, which start empty.
  constexpr int kThreads = 4;
  std::barrier start(kThreads);
  std::atomic<int> refused{0};  // counted here: Catch's assertions are for the main thread
  auto run = [&](std::uint64_t seed) {
    std::mt19937_64 engine(seed);
    std::optional<ManagedBuffer> held[2];
    start.arrive_and_wait();
    for (int i = 0; i < 50'000; ++i) {
      const std::size_t bytes = MiB + (engine() % (3 * 4096)) * 256;  // 1 to 4 MiB
      auto buffer = pool.allocate_bytes(device, bytes);
      if (!buffer) {
        refused.fetch_add(1);
        return;
      }
      held[i % 2] = std::move(*buffer);
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(run, t + 1);
  for (std::thread& t : threads) t.join();
  CHECK(refused.load() == 0);
  // Their shards took the shared shard's free segments: no device call.
  CHECK(pool.stats(device).device_allocations == device_allocations);
}
