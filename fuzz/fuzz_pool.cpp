// Fuzzes GpuMemoryPool: the input bytes are decoded into pool operations (alloc, free, release,
// batch, trim, cleanup, limit and cache-cap changes), run on a simulated device and checked after
// each one by the model of tests/support/pool_model.hpp, the same invariants as the rapidcheck
// property. Every 6 bytes make one operation: a kind byte, 4 bytes of operand a, 1 byte of b.
// One simulated device serves every input (each checker gives it every byte back); the total of
// operations and their rate are printed at exit. Built a second time as fuzz_pool_virtual, with
// GPUPOOL_FUZZ_VIRTUAL_SEGMENTS: the same on a pool of virtual segments.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
import gpupool;
#include "op_counter.hpp"
#include "support/pool_model.hpp"

namespace {

using gpupool::testing::decode_op;
using gpupool::testing::kBytesPerOp;
using gpupool::testing::PoolModelChecker;

constexpr std::size_t kMaxOps = 2000;
#if GPUPOOL_FUZZ_VIRTUAL_SEGMENTS
constexpr bool kVirtualSegments = true;
constexpr const char* kName = "fuzz_pool_virtual";
#else
constexpr bool kVirtualSegments = false;
constexpr const char* kName = "fuzz_pool";
#endif

[[noreturn]] void violated(std::size_t index, const std::string& what) {
  std::fprintf(stderr, "%s: invariant violated at operation %zu: %s\n", kName, index, what.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const gpupool::Device device = PoolModelChecker::make_device();
  PoolModelChecker checker(device, kVirtualSegments);
  std::size_t ops = std::min(size / kBytesPerOp, kMaxOps);
  gpupool::fuzzing::OpCounter::of(kName).add(ops);
  for (std::size_t i = 0; i < ops; ++i)
    if (auto failure = checker.apply(decode_op(data + i * kBytesPerOp))) violated(i, *failure);
  if (auto failure = checker.finish()) violated(ops, *failure);
  return 0;
}
