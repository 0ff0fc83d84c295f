// Pointer-only allocations (GpuMemoryPool::allocate_pointer / free_pointer / with_pointer): the
// pool keeps each block's buffer, parked in the allocating thread's cache, until it is freed by
// any thread — or by the pool's last handle going.
#include <catch2/catch.hpp>
#include <rapidcheck.h>
#include <rapidcheck/catch.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <thread>
#include <utility>
#include <vector>
import gpupool;

using namespace gpupool;

namespace {
Device sim(std::size_t capacity = 256 * MiB) {
  auto device = Device::simulated({.capacity = capacity});
  REQUIRE(device);
  return *device;
}
std::size_t device_used(const Device& device) {
  auto info = device.memory_info();
  return info->total - info->free;
}
void* allocate(GpuMemoryPool& pool, const Device& device, std::size_t bytes,
               const Stream* stream = nullptr) {
  auto ptr = pool.allocate_pointer(device, bytes, stream);
  REQUIRE(ptr);
  REQUIRE(*ptr != nullptr);
  return *ptr;
}
// For worker threads, where Catch2's assertions are not safe: an allocation that counts its
// failures (and gives null) for the main thread to check.
void* allocate_in_worker(GpuMemoryPool& pool, const Device& device, std::size_t bytes,
                         std::atomic<int>& failures) {
  auto ptr = pool.allocate_pointer(device, bytes);
  if (!ptr || !*ptr) {
    ++failures;
    return nullptr;
  }
  return *ptr;
}
std::size_t size_of(GpuMemoryPool& pool, const void* ptr) {
  std::size_t bytes = 0;
  if (!pool.with_pointer(ptr, [&](ManagedBuffer& buffer) { bytes = buffer.size_bytes(); })) return 0;
  return bytes;
}
}  // namespace

TEST_CASE("pointer allocations: freed once, then reused from the thread's cache", "[pool][pointer]") {
  Device device = sim();
  GpuMemoryPool pool;
  void* ptr = allocate(pool, device, 3000);
  CHECK(size_of(pool, ptr) == 3000);
  CHECK(pool.stats(device).live_buffers == 1);
  CHECK(pool.stats(device).requested_bytes == 3000);
  CHECK(pool.free_pointer(ptr) == PointerFree::freed);
  CHECK(pool.free_pointer(ptr) == PointerFree::not_found);  // a double free is refused
  CHECK(size_of(pool, ptr) == 0);
  const PoolStats freed = pool.stats(device);
  CHECK(freed.live_buffers == 0);
  CHECK(freed.in_use_bytes == 0);
  CHECK(freed.requested_bytes == 0);
  void* again = allocate(pool, device, 3000);
  CHECK(again == ptr);
  const PoolStats reused = pool.stats(device);
  CHECK(reused.cache_hits == freed.cache_hits + 1);
  CHECK(reused.device_allocations == freed.device_allocations);
  CHECK(pool.free_pointer(again) == PointerFree::freed);
}

TEST_CASE("pointer allocations: foreign pointers are never adopted", "[pool][pointer]") {
  Device device = sim();
  GpuMemoryPool pool, other;
  auto buffer = pool.allocate_bytes(device, 5000);
  REQUIRE(buffer);
  void* elsewhere = allocate(other, device, 5000);
  int on_host = 0;
  CHECK(pool.free_pointer(buffer->raw_data()) == PointerFree::not_found);  // a buffer's, not parked
  CHECK(pool.free_pointer(elsewhere) == PointerFree::not_found);           // another pool's
  CHECK(pool.free_pointer(&on_host) == PointerFree::not_found);
  CHECK(pool.free_pointer(nullptr) == PointerFree::not_found);
  CHECK(static_cast<char*>(elsewhere) + 256 != nullptr);
  CHECK(other.free_pointer(static_cast<char*>(elsewhere) + 256) == PointerFree::not_found);
  CHECK(buffer->valid());
  CHECK(pool.stats(device).live_buffers == 1);
  CHECK(other.stats(device).live_buffers == 1);
  CHECK(other.free_pointer(elsewhere) == PointerFree::freed);
}

TEST_CASE("pointer allocations: bad requests get the allocate_bytes errors", "[pool][pointer]") {
  Device device = sim(16 * MiB);
  Device other_device = sim();
  GpuMemoryPool pool;
  auto zero = pool.allocate_pointer(device, 0);
  REQUIRE(!zero);
  CHECK(zero.error().kind() == ErrorKind::InvalidInput);
  auto too_big = pool.allocate_pointer(device, 64 * MiB);
  REQUIRE(!too_big);
  CHECK(too_big.error().is_out_of_memory());
  const Stream foreign = other_device.default_stream();
  auto wrong_stream = pool.allocate_pointer(device, 100, &foreign);
  REQUIRE(!wrong_stream);
  CHECK(wrong_stream.error().kind() == ErrorKind::InvalidInput);
  CHECK(pool.stats(device).live_buffers == 0);
}

TEST_CASE("pointer allocations: another thread frees them, also after the allocator exits",
          "[pool][pointer]") {
  Device device = sim();
  GpuMemoryPool pool;
  std::vector<void*> made;
  std::atomic<int> failures{0};
  std::thread([&] {
    for (std::size_t i = 1; i <= 200; ++i)
      made.push_back(allocate_in_worker(pool, device, i * 1000, failures));
  }).join();  // its cache is detached now, the pointers still parked in it
  REQUIRE(failures == 0);
  REQUIRE(made.size() == 200);
  CHECK(pool.stats(device).live_buffers == 200);
  for (std::size_t i = 0; i < made.size(); ++i) CHECK(size_of(pool, made[i]) == (i + 1) * 1000);
  std::thread([&] {
    for (std::size_t i = 0; i < made.size(); i += 2)
      if (pool.free_pointer(made[i]) != PointerFree::freed) ++failures;
  }).join();
  CHECK(failures == 0);
  for (std::size_t i = 1; i < made.size(); i += 2) CHECK(pool.free_pointer(made[i]) == PointerFree::freed);
  for (void* ptr : made) CHECK(pool.free_pointer(ptr) == PointerFree::not_found);
  const PoolStats stats = pool.stats(device);
  CHECK(stats.live_buffers == 0);
  CHECK(stats.in_use_bytes == 0);
  CHECK(stats.requested_bytes == 0);
  CHECK(stats.allocations == stats.frees);
}

TEST_CASE("pointer allocations: threads free each other's while they allocate", "[pool][pointer]") {
  Device device = sim(1024 * MiB);
  GpuMemoryPool pool;
  constexpr int kThreads = 4, kRounds = 2000;
  std::vector<std::vector<void*>> made(kThreads);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i)
        made[t].push_back(allocate_in_worker(pool, device, 256 + 64 * (i % 50), failures));
    });
  for (auto& thread : threads) thread.join();
  REQUIRE(failures == 0);
  threads.clear();
  // Each thread frees the next one's pointers while allocating and freeing its own.
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      const auto& theirs = made[(t + 1) % kThreads];
      for (int i = 0; i < kRounds; ++i) {
        if (pool.free_pointer(theirs[i]) != PointerFree::freed) ++failures;
        void* own = allocate_in_worker(pool, device, 512 + 256 * (i % 7), failures);
        if (own && pool.free_pointer(own) != PointerFree::freed) ++failures;
      }
    });
  for (auto& thread : threads) thread.join();
  CHECK(failures == 0);
  const PoolStats stats = pool.stats(device);
  CHECK(stats.live_buffers == 0);
  CHECK(stats.in_use_bytes == 0);
  CHECK(stats.allocations == stats.frees);
}

TEST_CASE("pointer allocations: a free on another stream waits for that stream to be recorded",
          "[pool][pointer]") {
  Device device = sim();
  GpuMemoryPool pool;
  auto first = device.create_stream();
  auto second = device.create_stream();
  REQUIRE(first);
  REQUIRE(second);
  void* ptr = allocate(pool, device, 4096, &*first);
  CHECK(pool.free_pointer(ptr, second->native()) == PointerFree::other_stream);
  CHECK(pool.free_pointer(ptr) == PointerFree::other_stream);  // the default stream is another too
  CHECK(size_of(pool, ptr) == 4096);  // still live
  Result<void> recorded;
  REQUIRE(pool.with_pointer(ptr, [&](ManagedBuffer& buffer) { recorded = buffer.record_stream(*second); }));
  REQUIRE(recorded);
  CHECK(pool.free_pointer(ptr, second->native()) == PointerFree::freed);
  CHECK(pool.stats(device).live_buffers == 0);
  void* on_first = allocate(pool, device, 4096, &*first);
  CHECK(pool.free_pointer(on_first, first->native()) == PointerFree::freed);
}

TEST_CASE("pointer allocations: never freed, they go back with the pool's last handle",
          "[pool][pointer]") {
  Device device = sim();
  REQUIRE(device_used(device) == 0);
  {
    GpuMemoryPool pool;
    GpuMemoryPool copy = pool;
    for (std::size_t bytes : {100ul, 70000ul, 3 * MiB}) allocate(pool, device, bytes);
    std::atomic<int> failures{0};
    std::thread([&] { allocate_in_worker(copy, device, 12345, failures); }).join();
    REQUIRE(failures == 0);
    CHECK(device_used(device) > 0);
  }
  CHECK(device_used(device) == 0);
}

TEST_CASE("pointer allocations: the history records them like buffers", "[pool][pointer][tracing]") {
  Device device = sim();
  GpuMemoryPool pool;
  REQUIRE(enable_tracing(pool, {.track_allocations = false, .history_capacity = 100}));
  void* ptr = allocate(pool, device, 1000);
  CHECK(pool.free_pointer(ptr) == PointerFree::freed);
  const Trace trace = history(pool);
  REQUIRE(trace.events.size() == 2);
  CHECK(trace.events[0].kind == TraceEventKind::Alloc);
  CHECK(trace.events[0].bytes == 1000);
  CHECK(trace.events[1].kind == TraceEventKind::Free);
  CHECK(trace.events[1].id == trace.events[0].id);
}

TEST_CASE("pointer allocations property: any sequence keeps exactly the live ones findable",
          "[pool][pointer][property]") {
  rc::prop("allocate/free in any order, sizes across classes and segments", [] {
    Device device = sim(512 * MiB);
    GpuMemoryPool pool;
    std::map<void*, std::size_t> live;  // the model: pointer → bytes asked for
    const auto ops = *rc::gen::container<std::vector<std::pair<bool, std::uint32_t>>>(
        rc::gen::pair(rc::gen::weightedElement<bool>({{3, true}, {2, false}}),
                      rc::gen::arbitrary<std::uint32_t>()));
    std::vector<void*> freed;
    for (const auto& [allocates, value] : ops) {
      if (allocates || live.empty()) {
        const std::size_t bytes = 1 + value % (value % 4 == 0 ? 4 * MiB : 64 * KiB);
        auto ptr = pool.allocate_pointer(device, bytes);
        RC_ASSERT(ptr.has_value());
        RC_ASSERT(live.emplace(*ptr, bytes).second);  // never an address that is still live
      } else {
        auto victim = std::next(live.begin(), static_cast<std::ptrdiff_t>(value % live.size()));
        RC_ASSERT(pool.free_pointer(victim->first) == PointerFree::freed);
        freed.push_back(victim->first);
        live.erase(victim);
      }
    }
    for (const auto& [ptr, bytes] : live) RC_ASSERT(size_of(pool, ptr) == bytes);
    for (void* ptr : freed)
      if (!live.contains(ptr)) RC_ASSERT(pool.free_pointer(ptr) == PointerFree::not_found);
    RC_ASSERT(pool.stats(device).live_buffers == live.size());
    for (const auto& [ptr, bytes] : live) RC_ASSERT(pool.free_pointer(ptr) == PointerFree::freed);
    const PoolStats stats = pool.stats(device);
    RC_ASSERT(stats.in_use_bytes == 0u);
    RC_ASSERT(stats.allocations == stats.frees);
  });
}
