// What the simulated-device suites of the pool share: a fresh device, what it holds, and a
// buffer that must be granted. Include after `import gpupool;` and <catch2/catch.hpp>.
#pragma once
#include <cstddef>
#include <utility>

namespace gpupool::testing {

inline Device sim(std::size_t capacity, bool deferred = false) {
  auto device = Device::simulated({.capacity = capacity, .deferred_streams = deferred});
  REQUIRE(device);
  return *device;
}

// The bytes the device has handed out (to the pool under test).
inline std::size_t device_used(const Device& device) {
  auto info = device.memory_info();
  return info->total - info->free;
}

// A buffer of `bytes` bytes on `stream` (the device's default stream when none is given).
inline ManagedBuffer take(GpuMemoryPool& pool, const Device& device, std::size_t bytes,
                          const Stream& stream = {}) {
  auto buffer = stream.device_id() < 0
                    ? pool.get_managed_buffer(device, bytes, Precision::Bytes)
                    : pool.get_managed_buffer(device, bytes, Precision::Bytes, stream);
  REQUIRE(buffer);
  return std::move(*buffer);
}

}  // namespace gpupool::testing
