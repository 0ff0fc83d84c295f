// What the [gpu] suites share: the GPU they run on, a check that a step succeeded, and fresh
// random bytes for data that must never pass for stale memory. Include after `import gpupool;`
// and <catch2/catch.hpp>.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace gpupool::testing {

// cuda:0; the test fails (CTest skips [gpu] cases where there is no GPU) when there is none.
inline Device gpu() {
  REQUIRE(Device::cuda_device_count() > 0);
  auto device = Device::cuda(0);
  if (!device) FAIL(device.error().to_string());
  return *device;
}

// New bytes every run, so a stale buffer can never pass for a copied one.
inline std::vector<std::uint8_t> random_bytes(std::size_t n) {
  static std::mt19937_64 engine{std::random_device{}()};
  std::vector<std::uint8_t> bytes(n);
  for (std::size_t i = 0; i < n; i += 8) {
    std::uint64_t word = engine();
    std::memcpy(bytes.data() + i, &word, std::min<std::size_t>(8, n - i));
  }
  return bytes;
}

}  // namespace gpupool::testing

// Fails the test with the error when a Result<...> holds one.
#define REQUIRE_OK(expr)                                                      \
  do {                                                                        \
    auto gpupool_ok_ = (expr);                                                \
    if (!gpupool_ok_) FAIL(#expr << ": " << gpupool_ok_.error().to_string()); \
  } while (0)
