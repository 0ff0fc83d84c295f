// Peer access on CUDA: what one GPU can show (itself, and refusals against a simulated device),
// and with two or more GPUs the pool opening both kinds of segments to a peer. Tagged [gpu]:
// CTest skips these, tools/gpu-check.sh runs them on the GPU machine.
#include <catch2/catch.hpp>

#include <cstddef>
#include <vector>
import gpupool;
#include "../support/gpu_device.hpp"

using namespace gpupool;
using gpupool::testing::gpu;

namespace {
bool reaches(const Device& accessor, const ManagedBuffer& buffer, const Device& owner) {
  const auto* first = static_cast<const std::byte*>(buffer.raw_data());
  auto at_first = accessor.can_access(first, owner);
  auto at_last = accessor.can_access(first + buffer.size_bytes() - 1, owner);
  if (!at_first) FAIL(at_first.error().to_string());
  if (!at_last) FAIL(at_last.error().to_string());
  return *at_first && *at_last;
}

ManagedBuffer take(GpuMemoryPool& pool, const Device& device, std::size_t bytes) {
  auto buffer = pool.get_managed_buffer(device, bytes, Precision::Bytes);
  if (!buffer) FAIL(buffer.error().to_string());
  return std::move(*buffer);
}
}  // namespace

TEST_CASE("cuda peers: a GPU reaches itself, never a simulated device", "[gpu][peers]") {
  Device device = gpu();
  auto simulated = Device::simulated({.capacity = 64 * MiB});
  REQUIRE(simulated);
  CHECK(device.can_access_peer(device));
  CHECK(device.peer_access_enabled(device));
  REQUIRE(device.enable_peer_access(device));
  CHECK_FALSE(device.can_access_peer(*simulated));
  CHECK_FALSE(simulated->can_access_peer(device));
  auto refused = device.enable_peer_access(*simulated);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().kind() == ErrorKind::InvalidInput);

  std::vector<std::byte> host(64);
  auto not_device_memory = device.can_access(host.data(), device);
  REQUIRE_FALSE(not_device_memory);
  CHECK(not_device_memory.error().kind() == ErrorKind::InvalidInput);

  for (bool virtual_segments : {false, true}) {
    GpuMemoryPool pool(PoolConfig{.virtual_segments = virtual_segments});
    ManagedBuffer small = take(pool, device, 4 * KiB);
    ManagedBuffer large = take(pool, device, 5 * MiB);
    CHECK(reaches(device, small, device));
    CHECK(reaches(device, large, device));
    auto from_simulated = simulated->can_access(large.raw_data(), device);
    REQUIRE(from_simulated);
    CHECK_FALSE(*from_simulated);
    REQUIRE(pool.enable_peer_access(device, device));
  }
}

TEST_CASE("cuda peers: a pool opens plain and virtual segments to another GPU", "[gpu][peers]") {
  const int count = Device::cuda_device_count();
  if (count < 2) {
    WARN("one GPU here: the two-GPU half of peer access is not exercised");
    return;
  }
  auto owner = Device::cuda(0), accessor = Device::cuda(1);
  REQUIRE(owner);
  REQUIRE(accessor);
  if (!accessor->can_access_peer(*owner)) {
    auto refused = accessor->enable_peer_access(*owner);
    REQUIRE_FALSE(refused);
    CHECK(refused.error().kind() == ErrorKind::InvalidInput);
    return;
  }
  for (bool virtual_segments : {false, true}) {
    GpuMemoryPool pool(PoolConfig{.virtual_segments = virtual_segments});
    ManagedBuffer before = take(pool, *owner, 5 * MiB);
    if (virtual_segments) CHECK_FALSE(reaches(*accessor, before, *owner));
    REQUIRE(pool.enable_peer_access(*owner, *accessor));
    CHECK(accessor->peer_access_enabled(*owner));
    CHECK(reaches(*accessor, before, *owner));
    ManagedBuffer after = take(pool, *owner, 40 * MiB);  // new segments or pages
    CHECK(reaches(*accessor, after, *owner));
  }
}
