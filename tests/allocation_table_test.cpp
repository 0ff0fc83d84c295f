// The C ABI's table of live allocations (interop/allocation_table.hpp): every buffer found by its
// address until it is freed, exactly once, across table growth and threads.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstddef>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

import gpupool;
#include "../interop/allocation_table.hpp"
#include "support/sim_device.hpp"

using namespace gpupool;
using gpupool::interop::AllocationTable;
using gpupool::testing::sim;
using gpupool::testing::take;
using Removal = AllocationTable::Removal;

namespace {

std::size_t live_buffers(const GpuMemoryPool& pool, const Device& device) {
  return pool.stats(device).live_buffers;
}

Removal free_now(AllocationTable& table, const void* ptr) {
  return table.remove_if(ptr, [](ManagedBuffer&) { return true; });
}

}  // namespace

TEST_CASE("AllocationTable: finds each buffer by address until it is freed, once", "[c-abi]") {
  Device device = sim(std::size_t{1} << 30);
  GpuMemoryPool pool;
  AllocationTable table;
  // Far more live buffers than the first table holds: inserts move on to larger tables.
  std::vector<void*> addresses;
  for (int i = 0; i < 6000; ++i) {
    ManagedBuffer buffer = take(pool, device, 256 + static_cast<std::size_t>(i % 7) * 512);
    addresses.push_back(buffer.raw_data());
    table.insert(std::move(buffer));
  }
  REQUIRE(live_buffers(pool, device) == addresses.size());
  for (void* ptr : addresses) {
    std::size_t bytes = 0;
    REQUIRE(table.with(ptr, [&](ManagedBuffer& buffer) { bytes = buffer.size_bytes(); }));
    CHECK(bytes >= 256);
  }
  std::mt19937 random(std::random_device{}());
  std::shuffle(addresses.begin(), addresses.end(), random);
  for (std::size_t i = 0; i < addresses.size(); ++i) {
    REQUIRE(free_now(table, addresses[i]) == Removal::freed);
    REQUIRE(free_now(table, addresses[i]) == Removal::absent);  // a second free finds nothing
    REQUIRE(live_buffers(pool, device) == addresses.size() - i - 1);
  }
  CHECK_FALSE(table.with(addresses.front(), [](ManagedBuffer&) {}));
}

TEST_CASE("AllocationTable: refuses addresses it never held", "[c-abi]") {
  Device device = sim(std::size_t{64} << 20);
  GpuMemoryPool pool;
  AllocationTable table;
  ManagedBuffer buffer = take(pool, device, 4096);
  auto* base = static_cast<std::byte*>(buffer.raw_data());
  table.insert(std::move(buffer));
  int foreign = 0;
  for (const void* ptr : {static_cast<const void*>(base + 256), static_cast<const void*>(base + 1),
                          static_cast<const void*>(&foreign), static_cast<const void*>(nullptr)})
    CHECK(free_now(table, ptr) == Removal::absent);
  CHECK(live_buffers(pool, device) == 1);
  CHECK(free_now(table, base) == Removal::freed);
}

TEST_CASE("AllocationTable: a buffer kept by remove_if, or visited by a throwing visitor, stays",
          "[c-abi]") {
  Device device = sim(std::size_t{64} << 20);
  GpuMemoryPool pool;
  AllocationTable table;
  ManagedBuffer buffer = take(pool, device, 1000);
  void* ptr = buffer.raw_data();
  table.insert(std::move(buffer));
  CHECK(table.remove_if(ptr, [](ManagedBuffer&) { return false; }) == Removal::kept);
  CHECK_THROWS_AS(table.with(ptr, [](ManagedBuffer&) { throw std::runtime_error("visitor"); }),
                  std::runtime_error);
  CHECK(live_buffers(pool, device) == 1);
  CHECK(free_now(table, ptr) == Removal::freed);
  CHECK(live_buffers(pool, device) == 0);
}

TEST_CASE("AllocationTable: buffers left in it go back to their pool with it", "[c-abi]") {
  Device device = sim(std::size_t{64} << 20);
  GpuMemoryPool pool;
  {
    AllocationTable table;
    for (int i = 0; i < 3000; ++i) table.insert(take(pool, device, 512));
    CHECK(live_buffers(pool, device) == 3000);
  }
  CHECK(live_buffers(pool, device) == 0);
}

TEST_CASE("AllocationTable: threads free what other threads inserted", "[c-abi]") {
  Device device = sim(std::size_t{1} << 30);
  GpuMemoryPool pool;
  AllocationTable table;
  constexpr int kThreads = 4, kPerThread = 3000;
  std::mutex handed_mutex;
  std::vector<void*> handed;  // inserted, waiting for any thread to free them
  std::atomic<int> freed{0}, wrong{0};
  auto work = [&](int seed) {
    std::mt19937 random(static_cast<unsigned>(seed));
    for (int i = 0; i < kPerThread; ++i) {
      auto buffer = pool.get_managed_buffer(device, 256 + random() % 300000, Precision::Bytes);
      if (!buffer) {  // Catch2's assertions are for the main thread
        ++wrong;
        continue;
      }
      void* ptr = buffer->raw_data();
      table.insert(std::move(*buffer));
      std::vector<void*> mine;
      {
        std::lock_guard lock(handed_mutex);
        handed.push_back(ptr);
        while (handed.size() > 64) {  // free someone's, often another thread's
          std::size_t pick = random() % handed.size();
          mine.push_back(handed[pick]);
          handed[pick] = handed.back();
          handed.pop_back();
        }
      }
      for (void* address : mine) {
        if (free_now(table, address) == Removal::freed) ++freed;
        else ++wrong;
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(work, t + 1);
  for (auto& thread : threads) thread.join();
  for (void* ptr : handed) {
    if (free_now(table, ptr) == Removal::freed) ++freed;
    else ++wrong;
  }
  CHECK(wrong == 0);
  CHECK(freed == kThreads * kPerThread);
  CHECK(live_buffers(pool, device) == 0);
}
