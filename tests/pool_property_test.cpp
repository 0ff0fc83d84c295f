// Property: random sequences of pool operations keep every invariant of tests/support/pool_model.hpp.
#include <catch2/catch.hpp>
#include <rapidcheck.h>
#include <rapidcheck/catch.h>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>
import gpupool;
#include "support/pool_model.hpp"

using gpupool::testing::PoolModelChecker;
using gpupool::testing::PoolOp;

namespace rc {
template <>
struct Arbitrary<PoolOp> {
  static Gen<PoolOp> arbitrary() {
    // Allocations and frees dominate, as in real use; the rest are sprinkled in.
    auto kind = gen::weightedElement<PoolOp::Kind>({{30, PoolOp::Alloc}, {20, PoolOp::Free},
                                                    {6, PoolOp::Release}, {6, PoolOp::Batch},
                                                    {4, PoolOp::Trim}, {2, PoolOp::Cleanup},
                                                    {3, PoolOp::SetLimit}, {2, PoolOp::ClearLimit},
                                                    {2, PoolOp::SetCacheCap}});
    return gen::build<PoolOp>(gen::set(&PoolOp::kind, kind),
                              gen::set(&PoolOp::a, gen::arbitrary<std::uint32_t>()),
                              gen::set(&PoolOp::b, gen::arbitrary<std::uint32_t>()));
  }
};
}  // namespace rc

namespace {
const char* kind_name(PoolOp::Kind kind) {
  constexpr const char* names[] = {"alloc", "free", "release", "batch", "trim", "cleanup",
                                   "set_limit", "clear_limit", "set_cache_cap"};
  return kind < PoolOp::kKinds ? names[kind] : "?";
}
}  // namespace

namespace gpupool::testing {
inline void showValue(const PoolOp& op, std::ostream& os) {
  os << kind_name(op.kind) << "(" << op.a << ", " << op.b << ")";
}
}  // namespace gpupool::testing

TEST_CASE("pool property: random operation sequences match the model", "[pool][property]") {
  rc::prop("alloc/free/batch/trim/cleanup/limits keep the pool equal to its model",
           [](const std::vector<PoolOp>& ops) {
             PoolModelChecker checker;
             for (const PoolOp& op : ops) {
               auto failure = checker.apply(op);
               RC_ASSERT(failure.value_or("") == "");
             }
             auto failure = checker.finish();
             RC_ASSERT(failure.value_or("") == "");
           });
}

TEST_CASE("pool property: with virtual segments too", "[pool][property][virtual]") {
  rc::prop("alloc/free/batch/trim/cleanup/limits over virtual segments match the model",
           [](const std::vector<PoolOp>& ops) {
             PoolModelChecker checker(PoolModelChecker::make_device(), /*virtual_segments=*/true);
             for (const PoolOp& op : ops) {
               auto failure = checker.apply(op);
               RC_ASSERT(failure.value_or("") == "");
             }
             auto failure = checker.finish();
             RC_ASSERT(failure.value_or("") == "");
           });
}

TEST_CASE("pool model: a fixed sequence that fills, overflows and empties the device", "[pool][property]") {
  // A deterministic run through the same checker, so a broken checker cannot pass silently:
  // the ops below must hit both the success and the failure branch of the fit rule.
  PoolModelChecker checker;
  std::vector<PoolOp> ops;
  for (std::uint32_t i = 0; i < 40; ++i) ops.push_back({PoolOp::Alloc, 21 + 22 * (i * 50000u), i});
  ops.push_back({PoolOp::SetLimit, 3, 0});  // 1 MiB
  for (std::uint32_t i = 0; i < 10; ++i) ops.push_back({PoolOp::Free, i, 0});
  ops.push_back({PoolOp::Batch, 5, 3});
  ops.push_back({PoolOp::Trim, 0, 0});
  ops.push_back({PoolOp::ClearLimit, 0, 0});
  for (const PoolOp& op : ops) {
    auto failure = checker.apply(op);
    INFO(failure.value_or(""));
    REQUIRE_FALSE(failure);
  }
  auto failure = checker.finish();
  INFO(failure.value_or(""));
  REQUIRE_FALSE(failure);
}

TEST_CASE("pool model: the pool fuzzer's seed corpus replays clean", "[pool][property]") {
  // Each file is an input of fuzz/fuzz_pool.cpp, some of them failures it found once (named for
  // what they exercise): they stay fixed here whether or not the fuzzer is built.
  const std::filesystem::path corpus = std::filesystem::path(GPUPOOL_SOURCE_DIR) / "fuzz/corpus/fuzz_pool";
  std::size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(corpus)) {
    std::ifstream in(entry.path(), std::ios::binary);
    std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    INFO(entry.path().filename().string());
    for (bool virtual_segments : {false, true}) {
      INFO("virtual segments: " << virtual_segments);
      PoolModelChecker checker(PoolModelChecker::make_device(), virtual_segments);
      for (std::size_t at = 0; at + gpupool::testing::kBytesPerOp <= bytes.size(); at += gpupool::testing::kBytesPerOp)
        REQUIRE(checker.apply(gpupool::testing::decode_op(bytes.data() + at)).value_or("") == "");
      REQUIRE(checker.finish().value_or("") == "");
    }
    ++files;
  }
  CHECK(files >= 5);
}
