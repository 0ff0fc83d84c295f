// Virtual memory on the simulated device, and the pool's virtual segments over it
// (PoolConfig::virtual_segments): pages get memory as blocks touch them and go back to the device
// from between live blocks, so under a limit free space anywhere serves the next block.
#include <catch2/catch.hpp>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>
import gpupool;
#include "support/sim_device.hpp"

using namespace gpupool;
using gpupool::testing::device_used;
using gpupool::testing::sim;
using gpupool::testing::take;

namespace {
constexpr std::size_t kPage = 2 * MiB;

PoolConfig virtual_segments(std::optional<std::size_t> limit = std::nullopt) {
  return PoolConfig{.max_pool_size = limit, .virtual_segments = true};
}
}  // namespace

TEST_CASE("simulated virtual memory: reserve, map, use, unmap, release", "[device][virtual]") {
  Device device = sim(64 * MiB);
  REQUIRE(device.page_bytes() == kPage);
  auto base = device.reserve_addresses(8 * kPage);
  REQUIRE(base);
  CHECK(reinterpret_cast<std::uintptr_t>(*base) % kPage == 0);
  CHECK(device_used(device) == 0);  // addresses cost no memory

  std::vector<PhysicalPage> pages;
  for (int i = 0; i < 3; ++i) {
    auto page = device.create_page();
    REQUIRE(page);
    pages.push_back(*page);
  }
  CHECK(device_used(device) == 3 * kPage);
  REQUIRE(device.map_pages(*base, pages));
  auto* bytes = static_cast<std::byte*>(*base);
  // A copy across the pages' boundaries reaches every byte.
  std::vector<std::uint8_t> host(3 * kPage);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<std::uint8_t>(i * 7 + 3);
  REQUIRE(device.copy(bytes, host.data(), host.size(), CopyKind::HostToDevice, device.default_stream()));
  std::vector<std::uint8_t> back(host.size());
  REQUIRE(device.copy(back.data(), bytes, back.size(), CopyKind::DeviceToHost, device.default_stream()));
  CHECK(back == host);
  // Past the mapped pages the range has no memory: copies there are refused, not crashes.
  auto refused = device.fill(bytes + 2 * kPage, 0, 2 * kPage, device.default_stream());
  REQUIRE_FALSE(refused);
  CHECK(refused.error().kind() == ErrorKind::InvalidInput);

  // The middle page out, another in: its neighbours keep their bytes.
  REQUIRE(device.unmap_pages(bytes + kPage, 1));
  CHECK_FALSE(device.fill(bytes + kPage, 0, 1, device.default_stream()));
  device.release_page(pages[1]);
  CHECK(device_used(device) == 2 * kPage);
  auto fresh = device.create_page();
  REQUIRE(fresh);
  REQUIRE(device.map_pages(bytes + kPage, std::vector{*fresh}));
  REQUIRE(device.copy(back.data(), bytes, back.size(), CopyKind::DeviceToHost, device.default_stream()));
  CHECK(std::memcmp(back.data(), host.data(), kPage) == 0);
  CHECK(std::memcmp(back.data() + 2 * kPage, host.data() + 2 * kPage, kPage) == 0);

  // A page released while mapped lives until it is unmapped, as on CUDA.
  device.release_page(pages[0]);
  CHECK(device_used(device) == 3 * kPage);
  REQUIRE(device.unmap_pages(bytes, 3));
  device.release_page(*fresh);
  device.release_page(pages[2]);
  CHECK(device_used(device) == 0);
  device.release_addresses(*base, 8 * kPage);
}

TEST_CASE("simulated virtual memory refuses what CUDA refuses", "[device][virtual]") {
  Device device = sim(8 * MiB);
  CHECK(device.reserve_addresses(0).error().kind() == ErrorKind::InvalidInput);
  CHECK(device.reserve_addresses(kPage + 4096).error().kind() == ErrorKind::InvalidInput);
  auto base = device.reserve_addresses(4 * kPage);
  REQUIRE(base);
  auto* bytes = static_cast<std::byte*>(*base);
  auto page = device.create_page();
  REQUIRE(page);
  CHECK(device.map_pages(bytes + 4096, std::vector{*page}).error().kind() == ErrorKind::InvalidInput);
  CHECK(device.map_pages(bytes + 4 * kPage, std::vector{*page}).error().kind() == ErrorKind::InvalidInput);
  CHECK(device.map_pages(bytes, std::vector{PhysicalPage{999}}).error().kind() == ErrorKind::InvalidInput);
  CHECK(device.unmap_pages(bytes, 1).error().kind() == ErrorKind::InvalidInput);  // not mapped
  REQUIRE(device.map_pages(bytes, std::vector{*page}));
  CHECK(device.map_pages(bytes + kPage, std::vector{*page}).error().kind() == ErrorKind::InvalidInput);
  CHECK(device.unmap_pages(bytes, 0).error().kind() == ErrorKind::InvalidInput);
  // Pages count against the capacity and take injected faults like allocations.
  std::vector<PhysicalPage> more;
  for (int i = 0; i < 3; ++i) more.push_back(*device.create_page());
  auto full = device.create_page();
  REQUIRE_FALSE(full);
  CHECK(full.error().kind() == ErrorKind::OutOfMemory);
  device.release_page(more.back());
  more.pop_back();
  REQUIRE(device.inject_faults({.fail_nth_allocation = 1}));
  CHECK(device.create_page().error().kind() == ErrorKind::OutOfMemory);
  for (PhysicalPage p : more) device.release_page(p);
  REQUIRE(device.unmap_pages(bytes, 1));
  device.release_page(*page);
  device.release_addresses(*base, 4 * kPage);
  CHECK(device_used(device) == 0);
  CHECK_FALSE(Device::simulated({.page_bytes = 1000}));
}

TEST_CASE("virtual segments: blocks get memory for the pages they touch", "[pool][virtual]") {
  Device device = sim(1 * GiB);
  GpuMemoryPool pool(virtual_segments());
  ManagedBuffer a = take(pool, device, 3 * MiB);  // pages 0 and 1
  ManagedBuffer b = take(pool, device, 2 * MiB);  // shares page 1, reaches page 2
  PoolStats s = pool.stats(device);
  CHECK(s.reserved_bytes == 3 * kPage);
  CHECK(device_used(device) == 3 * kPage);
  CHECK(static_cast<std::byte*>(b.raw_data()) == static_cast<std::byte*>(a.raw_data()) + 3 * MiB);
  CHECK(s.fragmentation.stranded_bytes == 1 * MiB);  // the free part of page 2
  std::vector<std::byte> host(3 * MiB, std::byte{1});
  REQUIRE(a.upload(std::span<const std::byte>(host)));
  // Freed and asked for again: the same pages, nothing new from the device.
  { ManagedBuffer gone = std::move(a); }
  ManagedBuffer again = take(pool, device, 3 * MiB);
  CHECK(pool.stats(device).reserved_bytes == 3 * kPage);
  CHECK(pool.stats(device).device_allocations == 3);
}

TEST_CASE("virtual segments: under the limit, free space between live blocks serves any block",
          "[pool][virtual]") {
  Device device = sim(1 * GiB);
  GpuMemoryPool pool(PoolConfig{.max_pool_size = 32 * MiB, .virtual_segments = true,
                                .thread_caches = false});
  // Two 8 MiB holes between live blocks, the limit reached: a 12 MiB block fits neither hole.
  ManagedBuffer a = take(pool, device, 8 * MiB);
  ManagedBuffer x = take(pool, device, 2 * MiB);
  ManagedBuffer b = take(pool, device, 8 * MiB);
  ManagedBuffer y = take(pool, device, 14 * MiB);
  CHECK(pool.stats(device).reserved_bytes == 32 * MiB);
  { ManagedBuffer gone = std::move(a); }
  { ManagedBuffer gone = std::move(b); }
  CHECK(pool.stats(device).fragmentation.stranded_bytes == 0);  // whole free pages
  ManagedBuffer c = take(pool, device, 12 * MiB);  // the holes' pages went back, c got new ones
  std::vector<std::byte> host(12 * MiB, std::byte{7});
  REQUIRE(c.upload(std::span<const std::byte>(host)));
  PoolStats s = pool.stats(device);
  CHECK(s.reserved_bytes == 28 * MiB);
  CHECK(device_used(device) == s.reserved_bytes);
}

TEST_CASE("virtual segments: without a page budget, pages stay mapped for the next block",
          "[pool][virtual]") {
  Device device = sim(1 * GiB);
  // Off by default: its moves recur in a workload that repeats (docs/pool.md).
  CHECK_FALSE(PoolConfig{}.virtual_page_slack.has_value());
  GpuMemoryPool pool(PoolConfig{.virtual_segments = true, .thread_caches = false});
  ManagedBuffer a = take(pool, device, 8 * MiB);
  ManagedBuffer x = take(pool, device, 2 * MiB);
  { ManagedBuffer gone = std::move(a); }
  ManagedBuffer b = take(pool, device, 6 * MiB);   // in a's pages
  ManagedBuffer c = take(pool, device, 12 * MiB);  // beyond: new pages; a's rest stays cached
  PoolStats s = pool.stats(device);
  CHECK(s.reserved_bytes == 22 * MiB);
  CHECK(s.cached_bytes == 2 * MiB);
  CHECK(s.device_allocations == 11);
}

TEST_CASE("virtual segments: pages stay mapped for the next block within the page budget",
          "[pool][virtual]") {
  Device device = sim(1 * GiB);
  GpuMemoryPool pool(PoolConfig{.virtual_segments = true, .virtual_page_slack = 0.25,
                                .thread_caches = false});
  ManagedBuffer a = take(pool, device, 8 * MiB);
  ManagedBuffer x = take(pool, device, 2 * MiB);
  { ManagedBuffer gone = std::move(a); }
  ManagedBuffer b = take(pool, device, 6 * MiB);
  // 22 MiB reserved for 20 in use: within 1.25 x, so a's last free page stays where it is.
  ManagedBuffer c = take(pool, device, 12 * MiB);
  PoolStats s = pool.stats(device);
  CHECK(s.reserved_bytes == 22 * MiB);
  CHECK(s.cached_bytes == 2 * MiB);
  CHECK(s.device_allocations == 11);
  CHECK(s.device_frees == 0);
}

TEST_CASE("virtual segments: a block past the page budget takes free pages from between live "
          "blocks", "[pool][virtual]") {
  Device device = sim(1 * GiB);
  GpuMemoryPool pool(
      PoolConfig{.virtual_segments = true, .virtual_page_slack = 0.01, .thread_caches = false});
  ManagedBuffer a = take(pool, device, 10 * MiB);
  ManagedBuffer x = take(pool, device, 2 * MiB);  // keeps a's pages apart from the range's end
  { ManagedBuffer gone = std::move(a); }
  CHECK(pool.stats(device).reserved_bytes == 12 * MiB);
  // 12 MiB fit no hole: the block goes past x. Mapping 6 new pages would reserve 24 MiB for 14
  // in use; instead a's 5 free pages move to it and 1 page is new.
  ManagedBuffer c = take(pool, device, 12 * MiB);
  PoolStats s = pool.stats(device);
  CHECK(s.in_use_bytes == 14 * MiB);
  CHECK(s.reserved_bytes == 14 * MiB);
  CHECK(s.cached_bytes == 0);
  CHECK(s.device_allocations == 7);
  CHECK(s.device_frees == 0);
  CHECK(device_used(device) == 14 * MiB);
  // The moved pages hold the block's bytes; a's old addresses have no memory now.
  std::vector<std::byte> host(12 * MiB);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<std::byte>(i * 13 + 1);
  REQUIRE(c.upload(std::span<const std::byte>(host)));
  std::vector<std::byte> back(host.size());
  REQUIRE(c.download(std::span<std::byte>(back)));
  CHECK(back == host);
  // Freed again, the block's pages serve the next block in place: no more moves.
  { ManagedBuffer gone = std::move(c); }
  ManagedBuffer d = take(pool, device, 12 * MiB);
  CHECK(pool.stats(device).reserved_bytes == 14 * MiB);
  CHECK(pool.stats(device).device_allocations == 7);
}

TEST_CASE("virtual segments: a move gives the free pages the block does not need back",
          "[pool][virtual]") {
  Device device = sim(1 * GiB);
  auto other = device.create_stream();
  REQUIRE(other);
  GpuMemoryPool pool(
      PoolConfig{.virtual_segments = true, .virtual_page_slack = 0.01, .thread_caches = false});
  { ManagedBuffer cached = take(pool, device, 20 * MiB, *other); }  // 20 MiB on another stream
  ManagedBuffer p = take(pool, device, 10 * MiB);
  ManagedBuffer q = take(pool, device, 2 * MiB);
  ManagedBuffer r = take(pool, device, 10 * MiB);
  { ManagedBuffer gone = std::move(p); }
  { ManagedBuffer gone = std::move(r); }
  PoolStats s = pool.stats(device);
  CHECK(s.reserved_bytes == 42 * MiB);
  CHECK(s.in_use_bytes == 2 * MiB);
  // 12 MiB fit r's place and 1 page more. 44 MiB reserved would pass 1.01 x the 22 MiB most in
  // use: p's 5 free pages move, one to the block, the other 4 back to the device.
  ManagedBuffer c = take(pool, device, 12 * MiB);
  s = pool.stats(device);
  CHECK(s.in_use_bytes == 14 * MiB);
  CHECK(s.reserved_bytes == 34 * MiB);  // the other stream's 20 and the 14 in use
  CHECK(s.device_frees == 4);
  CHECK(device_used(device) == 34 * MiB);
}

TEST_CASE("virtual segments: a move keeps the initial reservation", "[pool][virtual]") {
  Device device = sim(1 * GiB);
  GpuMemoryPool pool(PoolConfig{.initial_reservation = 32 * MiB,
                                .reservation_block_bytes = 32 * MiB,
                                .virtual_segments = true,
                                .virtual_page_slack = 0.01,
                                .thread_caches = false});
  ManagedBuffer a = take(pool, device, 16 * MiB);  // the reservation's first half
  ManagedBuffer b = take(pool, device, 2 * MiB);
  { ManagedBuffer gone = std::move(a); }
  CHECK(pool.stats(device).reserved_bytes == 32 * MiB);
  // 17 MiB fit no hole: past b, 2 pages beyond the reservation. 2 of a's free pages move to it,
  // and the other 6 stay: the budget never falls below the reservation asked for.
  ManagedBuffer c = take(pool, device, 17 * MiB);
  PoolStats s = pool.stats(device);
  CHECK(s.reserved_bytes == 32 * MiB);
  CHECK(s.device_frees == 0);
}

TEST_CASE("virtual segments: the page budget outlives reset_peaks until the pool holds nothing",
          "[pool][virtual]") {
  Device device = sim(1 * GiB);
  GpuMemoryPool pool(
      PoolConfig{.virtual_segments = true, .virtual_page_slack = 0.01, .thread_caches = false});
  auto fragment_then_grow = [&] {
    ManagedBuffer a = take(pool, device, 10 * MiB);
    ManagedBuffer x = take(pool, device, 2 * MiB);
    { ManagedBuffer gone = std::move(a); }
    ManagedBuffer c = take(pool, device, 12 * MiB);
    return pool.stats(device).reserved_bytes;
  };
  { ManagedBuffer earlier = take(pool, device, 20 * MiB); }  // 20 MiB in use once
  pool.reset_peaks(device);  // the pool still holds the 20 MiB: its budget stays
  // The 12 MiB block needs 2 pages beyond the 20 MiB mapped: 2 of a's free pages move to it,
  // and reserved stays at the 20 MiB once in use (not at the 14 in use since the reset).
  CHECK(fragment_then_grow() == 20 * MiB);
  pool.emergency_cleanup(device);
  CHECK(pool.stats(device).reserved_bytes == 0);
  pool.reset_peaks(device);  // nothing held: the budget starts again from what comes next
  CHECK(fragment_then_grow() == 14 * MiB);
}

TEST_CASE("virtual segments: threads whose blocks pass the page budget keep every block's bytes",
          "[pool][virtual][threads]") {
  // Sizes that vary tenfold leave holes that later blocks do not fit: pages move while other
  // threads allocate, free, and read the budget's figures (every thread cache's lock).
  Device device = sim(1 * GiB);
  GpuMemoryPool pool(PoolConfig{.virtual_segments = true, .virtual_page_slack = 0.01});
  constexpr int kThreads = 4, kSteps = 300;
  std::vector<std::thread> threads;
  std::vector<int> failures(kThreads, 0);
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      std::mt19937 random(static_cast<unsigned>(t) + 1);
      std::uniform_int_distribution<std::size_t> bytes(5 * KiB, 3 * MiB);
      struct Held { ManagedBuffer buffer; std::uint8_t pattern; };
      std::vector<Held> held;
      auto intact = [&](const Held& h) {
        std::vector<std::byte> ends(2);
        return h.buffer.download(std::span(ends).first(1)) &&
               h.buffer.download(std::span(ends).last(1), h.buffer.size_bytes() - 1) &&
               ends[0] == std::byte{h.pattern} && ends[1] == std::byte{h.pattern};
      };
      for (int step = 0; step < kSteps; ++step) {
        if (held.size() < 24 && (held.empty() || random() % 3 != 0)) {
          auto buffer = pool.get_managed_buffer(device, bytes(random), Precision::Bytes);
          if (!buffer) { ++failures[t]; continue; }
          const auto pattern = static_cast<std::uint8_t>(t * 64 + step % 64);
          if (!device.fill(buffer->raw_data(), pattern, buffer->size_bytes(), device.default_stream()))
            ++failures[t];
          held.push_back({std::move(*buffer), pattern});
        } else {
          const std::size_t i = random() % held.size();
          if (!intact(held[i])) ++failures[t];
          held.erase(held.begin() + static_cast<std::ptrdiff_t>(i));
        }
      }
      for (const Held& h : held)
        if (!intact(h)) ++failures[t];
    });
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) CHECK(failures[t] == 0);
  PoolStats s = pool.stats(device);
  CHECK(s.in_use_bytes == 0);
  CHECK(device_used(device) == s.reserved_bytes);
  pool.emergency_cleanup(device);
  CHECK(pool.stats(device).reserved_bytes == 0);
  CHECK(device_used(device) == 0);
}

TEST_CASE("virtual segments: pages move only after the work on them is done", "[pool][virtual]") {
  // Deferred streams: work waits until something synchronizes. A fill still queued on a freed
  // block must have run before its pages move (an unmapped page would fault here).
  Device device = sim(1 * GiB, /*deferred=*/true);
  auto stream = device.create_stream();
  REQUIRE(stream);
  GpuMemoryPool pool(
      PoolConfig{.virtual_segments = true, .virtual_page_slack = 0.01, .thread_caches = false});
  ManagedBuffer a = take(pool, device, 10 * MiB, *stream);
  ManagedBuffer x = take(pool, device, 2 * MiB, *stream);
  REQUIRE(device.fill(a.raw_data(), 0x5a, 10 * MiB, *stream));
  { ManagedBuffer gone = std::move(a); }
  ManagedBuffer c = take(pool, device, 12 * MiB, *stream);  // a's pages move to it
  CHECK(pool.stats(device).reserved_bytes == 14 * MiB);
  REQUIRE(stream->synchronize());
}

TEST_CASE("virtual segments: trims give pages back from the middle", "[pool][virtual]") {
  Device device = sim(1 * GiB);
  GpuMemoryPool pool(virtual_segments());
  ManagedBuffer a = take(pool, device, 16 * MiB);
  ManagedBuffer tail = take(pool, device, 1 * MiB);
  { ManagedBuffer gone = std::move(a); }
  CHECK(pool.stats(device).reserved_bytes == 18 * MiB);
  CHECK(pool.emergency_cleanup(device) == 16 * MiB);  // a plain segment would keep it: tail lives
  PoolStats s = pool.stats(device);
  CHECK(s.reserved_bytes == kPage);
  CHECK(s.fragmentation.stranded_bytes == 1 * MiB);
  CHECK(device_used(device) == kPage);
  { ManagedBuffer gone = std::move(tail); }
  pool.emergency_cleanup(device);
  CHECK(pool.stats(device).reserved_bytes == 0);
  CHECK(device_used(device) == 0);
}

TEST_CASE("virtual segments: the hard limit counts pages", "[pool][virtual]") {
  Device device = sim(1 * GiB);
  GpuMemoryPool pool(virtual_segments(16 * MiB));
  ManagedBuffer a = take(pool, device, 6 * MiB);
  ManagedBuffer b = take(pool, device, 6 * MiB);
  auto over = pool.get_managed_buffer(device, 6 * MiB, Precision::Bytes);
  REQUIRE_FALSE(over);
  CHECK(over.error().kind() == ErrorKind::PoolLimitExceeded);
  { ManagedBuffer gone = std::move(a); }
  ManagedBuffer c = take(pool, device, 4 * MiB);  // within a's pages
  CHECK(pool.stats(device).reserved_bytes <= 16 * MiB);
  CHECK(device_used(device) == pool.stats(device).reserved_bytes);
}

TEST_CASE("virtual segments: out of memory for pages runs the OOM ladder", "[pool][virtual]") {
  Device device = sim(16 * MiB);
  auto other = device.create_stream();
  REQUIRE(other);
  GpuMemoryPool pool(PoolConfig{.virtual_segments = true, .thread_caches = false});
  { ManagedBuffer cached = take(pool, device, 8 * MiB, *other); }  // 4 pages cached on `other`
  // The default stream's 14 MiB block needs 7 pages and the device has room for 4: the ladder
  // gives `other`'s cached pages back and the retry gets them.
  ManagedBuffer big = take(pool, device, 14 * MiB);
  PoolStats s = pool.stats(device);
  CHECK(s.reserved_bytes == 14 * MiB);
  CHECK(s.out_of_memory_errors == 0);
  CHECK(device_used(device) == 14 * MiB);
  // Refused pages surface as OutOfMemory with the pool's figures, and nothing stays reserved.
  { ManagedBuffer gone = std::move(big); }
  pool.emergency_cleanup(device);
  REQUIRE(device.inject_faults({.fail_above_bytes = 0}));
  auto refused = pool.get_managed_buffer(device, 4 * MiB, Precision::Bytes);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().kind() == ErrorKind::OutOfMemory);
  INFO(refused.error().message());
  CHECK(refused.error().message().find("requested 4.00 MiB") != std::string::npos);
  CHECK(pool.stats(device).reserved_bytes == 0);
  CHECK(pool.stats(device).out_of_memory_errors == 1);
  REQUIRE(device.inject_faults({}));
  CHECK(pool.get_managed_buffer(device, 4 * MiB, Precision::Bytes));
}

TEST_CASE("virtual segments: pages go back only after the work on them is done",
          "[pool][virtual]") {
  // Deferred streams: work waits until something synchronizes. A block freed with a fill still
  // queued must not lose its pages under the fill (an unmapped page would fault here).
  Device device = sim(1 * GiB, /*deferred=*/true);
  auto stream = device.create_stream();
  REQUIRE(stream);
  GpuMemoryPool pool(PoolConfig{.max_pool_size = 16 * MiB, .virtual_segments = true,
                                .thread_caches = false});
  ManagedBuffer keep = take(pool, device, 2 * MiB, *stream);
  {
    ManagedBuffer a = take(pool, device, 8 * MiB, *stream);
    REQUIRE(device.fill(a.raw_data(), 0x5a, 8 * MiB, *stream));
    ManagedBuffer b = take(pool, device, 2 * MiB, *stream);
    { ManagedBuffer gone = std::move(a); }
    ManagedBuffer big = take(pool, device, 12 * MiB, *stream);  // a's pages go back for it
    CHECK(pool.stats(device).reserved_bytes == 16 * MiB);
  }
  REQUIRE(stream->synchronize());
}

TEST_CASE("GPUPOOL_SEGMENTS chooses the kind of segment", "[pool][virtual][config]") {
  Device device = sim(64 * MiB);
  setenv("GPUPOOL_SEGMENTS", "virtual", 1);
  auto config = PoolConfig::from_environment(device);
  REQUIRE(config);
  CHECK(config->virtual_segments);
  CHECK(config->segments);
  setenv("GPUPOOL_SEGMENTS", "none", 1);
  config = PoolConfig::from_environment(device);
  REQUIRE(config);
  CHECK_FALSE(config->segments);
  setenv("GPUPOOL_SEGMENTS", "device", 1);
  config = PoolConfig::from_environment(device);
  REQUIRE(config);
  CHECK_FALSE(config->virtual_segments);
  setenv("GPUPOOL_SEGMENTS", "mapped", 1);
  config = PoolConfig::from_environment(device);
  REQUIRE_FALSE(config);
  CHECK(config.error().message().find("GPUPOOL_SEGMENTS") != std::string::npos);
  unsetenv("GPUPOOL_SEGMENTS");
}

TEST_CASE("GPUPOOL_PAGE_SLACK sets the page budget of virtual segments", "[pool][virtual][config]") {
  Device device = sim(64 * MiB);
  auto config = PoolConfig::from_environment(device);
  REQUIRE(config);
  CHECK_FALSE(config->virtual_page_slack.has_value());
  setenv("GPUPOOL_PAGE_SLACK", "0.01", 1);
  config = PoolConfig::from_environment(device);
  REQUIRE(config);
  REQUIRE(config->virtual_page_slack.has_value());
  CHECK(*config->virtual_page_slack == 0.01);
  for (const char* bad : {"-0.5", "1%", "x", "0.01x", "nan", "inf"}) {
    CAPTURE(bad);
    setenv("GPUPOOL_PAGE_SLACK", bad, 1);
    config = PoolConfig::from_environment(device);
    REQUIRE_FALSE(config);
    CHECK(config.error().kind() == ErrorKind::InvalidInput);
    CHECK(config.error().message().find("GPUPOOL_PAGE_SLACK") != std::string::npos);
  }
  unsetenv("GPUPOOL_PAGE_SLACK");
}

TEST_CASE("virtual segments carve blocks above 4 KiB, plain segments only above 64 KiB",
          "[pool][virtual]") {
  Device device = sim(64 * MiB);
  // 8300 bytes: its class holds 8704, a carved block the request rounded up to 256 bytes.
  constexpr std::size_t kRequest = 8300, kClassBytes = 8704, kCarvedBytes = 8448;
  GpuMemoryPool plain,
      carved(PoolConfig{.virtual_segments = true, .thread_caches = false});  // frees reach the arena
  ManagedBuffer a = take(plain, device, kRequest);
  ManagedBuffer b = take(carved, device, kRequest);
  CHECK(a.capacity_bytes() == kClassBytes);
  CHECK(b.capacity_bytes() == kCarvedBytes);
  // Freed, the carved block merges with the free space around it: a block of another size
  // takes its place rather than a new page.
  const void* where = b.raw_data();
  b = ManagedBuffer();
  ManagedBuffer c = take(carved, device, 3 * kRequest);
  CHECK(c.raw_data() == where);
  // 4 KiB and less stay class blocks under both.
  CHECK(take(carved, device, 4000).capacity_bytes() == 4096);
}
