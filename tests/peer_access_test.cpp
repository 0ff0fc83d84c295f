// Several devices: peer access between simulated devices, and the pool opening its memory to a
// peer — at once for plain segments, page by page (now and for every later mapping) for virtual
// segments, whose pages are reached only by the devices each mapping names, as on CUDA.
#include <catch2/catch.hpp>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>
import gpupool;
#include "support/sim_device.hpp"

using namespace gpupool;
using gpupool::testing::sim;
using gpupool::testing::take;

namespace {
constexpr std::size_t kPage = 2 * MiB;

// Whether `accessor` may reach the buffer's first and last byte (a block may span pages).
bool reaches(const Device& accessor, const ManagedBuffer& buffer, const Device& owner) {
  const auto* first = static_cast<const std::byte*>(buffer.raw_data());
  auto at_first = accessor.can_access(first, owner);
  auto at_last = accessor.can_access(first + buffer.size_bytes() - 1, owner);
  REQUIRE(at_first);
  REQUIRE(at_last);
  return *at_first && *at_last;
}
}  // namespace

TEST_CASE("simulated devices are peers once enabled, one direction at a time", "[device][peers]") {
  Device a = sim(256 * MiB), b = sim(256 * MiB);
  CHECK(a.can_access_peer(b));
  CHECK(b.can_access_peer(a));
  CHECK(a.can_access_peer(a));
  CHECK(a.peer_access_enabled(a));  // a device always reaches its own memory
  CHECK_FALSE(b.peer_access_enabled(a));

  auto on_a = a.allocate(MiB);
  REQUIRE(on_a);
  CHECK(*a.can_access(*on_a, a));
  CHECK_FALSE(*b.can_access(*on_a, a));

  REQUIRE(b.enable_peer_access(a));
  REQUIRE(b.enable_peer_access(a));  // again: fine
  REQUIRE(a.enable_peer_access(a));  // itself: nothing to do
  CHECK(b.peer_access_enabled(a));
  CHECK_FALSE(a.peer_access_enabled(b));  // b → a says nothing of a → b
  CHECK(*b.can_access(*on_a, a));
  CHECK(*b.can_access(static_cast<std::byte*>(*on_a) + MiB - 1, a));
  REQUIRE(a.deallocate(*on_a));
}

TEST_CASE("peer access: an address that is not the owner's memory is refused", "[device][peers]") {
  Device a = sim(256 * MiB), b = sim(256 * MiB);
  auto on_b = b.allocate(MiB);
  REQUIRE(on_b);
  auto asked = a.can_access(*on_b, a);  // b's memory, asked of a as its owner
  REQUIRE_FALSE(asked);
  CHECK(asked.error().kind() == ErrorKind::InvalidInput);
  auto past = b.can_access(static_cast<std::byte*>(*on_b) + MiB, b);  // one past its end
  REQUIRE_FALSE(past);
  CHECK(past.error().kind() == ErrorKind::InvalidInput);
  REQUIRE(b.deallocate(*on_b));
}

TEST_CASE("a pool opens its plain segments to a peer through the device's peer access",
          "[pool][peers]") {
  Device owner = sim(1 * GiB), peer = sim(1 * GiB);
  GpuMemoryPool pool;
  ManagedBuffer small = take(pool, owner, 4 * KiB);  // a block of its own
  ManagedBuffer large = take(pool, owner, 3 * MiB);  // carved from a segment
  CHECK_FALSE(reaches(peer, small, owner));
  CHECK_FALSE(reaches(peer, large, owner));
  REQUIRE(pool.enable_peer_access(owner, peer));
  CHECK(peer.peer_access_enabled(owner));
  CHECK(reaches(peer, small, owner));
  CHECK(reaches(peer, large, owner));
  CHECK(reaches(owner, large, owner));
}

TEST_CASE("a pool opens the pages of its virtual segments to a peer, now and when it maps more",
          "[pool][peers][virtual]") {
  Device owner = sim(1 * GiB), peer = sim(1 * GiB), bystander = sim(1 * GiB);
  REQUIRE(owner.page_bytes() == kPage);
  GpuMemoryPool pool(PoolConfig{.virtual_segments = true});
  ManagedBuffer before = take(pool, owner, 5 * MiB);  // three pages, mapped before the grant
  CHECK(reaches(owner, before, owner));
  CHECK_FALSE(reaches(peer, before, owner));

  REQUIRE(pool.enable_peer_access(owner, peer));
  CHECK(reaches(peer, before, owner));
  CHECK_FALSE(reaches(bystander, before, owner));  // granted to the peer only

  ManagedBuffer after = take(pool, owner, 9 * MiB);  // needs pages the pool maps now
  CHECK(reaches(peer, after, owner));
  CHECK_FALSE(reaches(bystander, after, owner));

  // Pages given back and mapped again are granted again: access belongs to a mapping.
  before = ManagedBuffer();
  after = ManagedBuffer();
  REQUIRE(pool.emergency_cleanup(owner) > 0);
  CHECK(pool.stats(owner).reserved_bytes == 0);
  ManagedBuffer again = take(pool, owner, 7 * MiB);
  CHECK(reaches(peer, again, owner));

  // Enabling twice grants nothing twice and fails nothing.
  REQUIRE(pool.enable_peer_access(owner, peer));
  CHECK(reaches(peer, again, owner));
}

TEST_CASE("a pool's peer access to itself is nothing to do", "[pool][peers]") {
  Device owner = sim(256 * MiB);
  GpuMemoryPool pool(PoolConfig{.virtual_segments = true});
  ManagedBuffer buffer = take(pool, owner, 3 * MiB);
  REQUIRE(pool.enable_peer_access(owner, owner));
  CHECK(reaches(owner, buffer, owner));
  CHECK(pool.stats(owner).device_allocations > 0);
}

TEST_CASE("granting pages to a peer: only whole mapped pages, only to a simulated device",
          "[device][peers][virtual]") {
  Device owner = sim(256 * MiB), peer = sim(256 * MiB);
  auto base = owner.reserve_addresses(4 * kPage);
  REQUIRE(base);
  auto page = owner.create_page();
  REQUIRE(page);
  REQUIRE(owner.map_pages(*base, std::span(&*page, 1)));
  auto* bytes = static_cast<std::byte*>(*base);
  auto kind = [](const Result<void>& r) { return r.error().kind(); };

  auto part = owner.grant_access(bytes, kPage / 2, peer);  // not a whole page
  REQUIRE_FALSE(part);
  CHECK(kind(part) == ErrorKind::InvalidInput);
  auto unmapped = owner.grant_access(bytes + kPage, kPage, peer);  // nothing mapped there
  REQUIRE_FALSE(unmapped);
  CHECK(kind(unmapped) == ErrorKind::InvalidInput);
  CHECK_FALSE(*peer.can_access(bytes, owner));  // refusals granted nothing
  auto unmapped_address = peer.can_access(bytes + kPage, owner);
  REQUIRE_FALSE(unmapped_address);
  CHECK(unmapped_address.error().kind() == ErrorKind::InvalidInput);

  REQUIRE(owner.grant_access(bytes, kPage, peer));
  CHECK(*peer.can_access(bytes + kPage - 1, owner));
  REQUIRE(owner.unmap_pages(*base, 1));  // the grant ends with the mapping
  REQUIRE(owner.map_pages(*base, std::span(&*page, 1)));
  CHECK_FALSE(*peer.can_access(bytes, owner));
  REQUIRE(owner.unmap_pages(*base, 1));
  owner.release_page(*page);
  owner.release_addresses(*base, 4 * kPage);
}
