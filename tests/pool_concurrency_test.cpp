// Many threads on one pool at once: allocation, free, hand-off of buffers between threads, trims,
// cleanups, limit changes and stats readers. Run under the tsan preset, it is the data-race check.
#include <catch2/catch.hpp>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <vector>
import gpupool;

using namespace gpupool;

namespace {

constexpr int kWorkers = 12;
constexpr int kOpsPerWorker = 800;

// A mailbox: workers post buffers for the next worker to check and free (cross-thread frees).
struct Mailbox {
  std::mutex mutex;
  std::vector<std::pair<ManagedBuffer, std::uint8_t>> buffers;
};

bool holds_pattern(const ManagedBuffer& buffer, std::uint8_t pattern) {
  std::vector<std::byte> host(buffer.size_bytes());
  if (!buffer.download(host)) return false;
  for (std::byte b : host)
    if (b != std::byte{pattern}) return false;
  return true;
}

}  // namespace

TEST_CASE("12 threads allocate, free, hand off, trim and read stats at once", "[pool][threads]") {
  auto device = Device::simulated({.capacity = 256 * MiB});
  REQUIRE(device);
  GpuMemoryPool pool(PoolConfig{.max_cached_bytes = 32 * MiB});
  std::vector<Mailbox> mailboxes(kWorkers);
  std::atomic<int> corrupted{0}, unexpected_errors{0}, successes{0};
  std::atomic<bool> stop_background{false};
  std::atomic<int> pressure_events{0};
  pool.add_pressure_observer(0.5, [&](const PressureEvent& e) {
    if (e.pressure >= 0.5) pressure_events.fetch_add(1);
  });

  auto worker = [&](int id) {
    std::mt19937 rng(static_cast<unsigned>(1234 + id));
    std::uniform_int_distribution<std::size_t> size_dist(1, 64 * KiB);
    std::vector<std::pair<ManagedBuffer, std::uint8_t>> mine;
    for (int op = 0; op < kOpsPerWorker; ++op) {
      int choice = static_cast<int>(rng() % 10);
      if (choice < 5 || mine.empty()) {
        auto precision = static_cast<Precision>(rng() % kPrecisionCount);
        std::size_t elements = std::max<std::size_t>(1, size_dist(rng) / element_size(precision));
        auto buffer = pool.get_managed_buffer(*device, elements, precision);
        if (!buffer) {
          if (!buffer.error().is_out_of_memory()) unexpected_errors.fetch_add(1);
          continue;
        }
        auto pattern = static_cast<std::uint8_t>(rng());
        std::vector<std::byte> host(buffer->size_bytes(), std::byte{pattern});
        if (!buffer->upload(host)) unexpected_errors.fetch_add(1);
        mine.emplace_back(std::move(*buffer), pattern);
        successes.fetch_add(1);
      } else if (choice < 8) {
        std::size_t index = rng() % mine.size();
        if (!holds_pattern(mine[index].first, mine[index].second)) corrupted.fetch_add(1);
        mine.erase(mine.begin() + static_cast<std::ptrdiff_t>(index));
      } else {
        // Hand a buffer to the next worker, who checks and frees it on its thread.
        Mailbox& box = mailboxes[static_cast<std::size_t>((id + 1) % kWorkers)];
        std::lock_guard lock(box.mutex);
        box.buffers.push_back(std::move(mine.back()));
        mine.pop_back();
      }
      Mailbox& own = mailboxes[static_cast<std::size_t>(id)];
      std::vector<std::pair<ManagedBuffer, std::uint8_t>> received;
      {
        std::lock_guard lock(own.mutex);
        received.swap(own.buffers);
      }
      for (auto& [buffer, pattern] : received)
        if (!holds_pattern(buffer, pattern)) corrupted.fetch_add(1);
    }
  };

  // Background: trims, cleanups, limit changes and stats readers, racing the workers.
  auto janitor = [&] {
    std::mt19937 rng(99);
    while (!stop_background.load()) {
      switch (rng() % 4) {
        case 0: pool.trim(*device, (rng() % 8) * MiB); break;
        case 1: pool.emergency_cleanup(*device); break;
        case 2: (void)pool.set_max_pool_size(*device, (96 + rng() % 160) * MiB); break;
        default: {
          PoolStats s = pool.stats(*device);
          if (s.reserved_bytes < s.in_use_bytes && s.cached_bytes != 0) unexpected_errors.fetch_add(1);
          double p = pool.memory_pressure(*device);
          if (p < 0.0 || p > 1.0) unexpected_errors.fetch_add(1);
          (void)pool.total_stats();
        }
      }
      std::this_thread::yield();
    }
  };

  std::vector<std::thread> threads;
  for (int i = 0; i < kWorkers; ++i) threads.emplace_back(worker, i);
  std::thread background(janitor);
  for (auto& t : threads) t.join();
  stop_background = true;
  background.join();
  for (Mailbox& box : mailboxes) {
    for (auto& [buffer, pattern] : box.buffers)
      if (!holds_pattern(buffer, pattern)) corrupted.fetch_add(1);
    box.buffers.clear();
  }

  CHECK(corrupted == 0);
  CHECK(unexpected_errors == 0);
  CHECK(successes > kWorkers * kOpsPerWorker / 3);
  PoolStats s = pool.stats(*device);
  CHECK(s.in_use_bytes == 0);
  CHECK(s.requested_bytes == 0);
  CHECK(s.live_buffers == 0);
  CHECK(s.allocations == s.cache_hits + s.cache_misses);
  CHECK(s.reserved_bytes == s.cached_bytes);
  CHECK(s.cache_hits > 0);
  pool.emergency_cleanup_all();
  auto memory = device->memory_info();
  CHECK(memory->free == memory->total);
  PoolStats after = pool.stats(*device);
  CHECK(after.reserved_bytes == 0);
  CHECK(after.device_allocations == after.device_frees);
}
