// The exact-kNN job over several simulated devices (tools/knn/sharded_knn.hpp): the split of the
// base, the merge of the devices' lists, and the result — ids, fp32 and fp64 distances — equal bit
// for bit to the one-device job's, in the exact and the fast mode, with devices of different sizes
// and a fault injected into one of them.
#include <catch2/catch.hpp>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <system_error>
#include <unistd.h>
#include <vector>
#include "support/temp_dir.hpp"
#include "support/vector_files.hpp"
#include "exact_knn.hpp"
#include "sharded_knn.hpp"

using namespace gpupool;
using namespace gpupool::exact;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

using gpupool::testing::TempDir;

namespace {

VectorSet query_set(std::size_t rows, std::size_t dim, std::uint64_t seed, bool spread = false) {
  return VectorSet{rows, dim, test::random_rows(rows, dim, seed, spread)};
}

Neighbours one_device(const VectorSet& queries, const fs::path& base, const JobOptions& options) {
  auto device = Device::simulated({.capacity = std::size_t{64} << 20});
  REQUIRE(device);
  GpuMemoryPool pool;
  auto reader = io::VectorReader::open(base);
  REQUIRE(reader);
  auto result = run_exact_knn(pool, *device, queries, *reader, options);
  REQUIRE(result);
  return result->neighbours;
}

std::vector<DeviceSlot> sim_slots(const std::vector<std::size_t>& capacities) {
  std::vector<DeviceSlot> slots;
  for (std::size_t capacity : capacities) {
    auto device = Device::simulated({.capacity = capacity});
    REQUIRE(device);
    slots.push_back(DeviceSlot{GpuMemoryPool(), *device});
  }
  return slots;
}

void check_same(const Neighbours& got, const Neighbours& want) {
  CHECK(got.queries == want.queries);
  CHECK(got.k == want.k);
  CHECK(got.indices == want.indices);
  // Bit for bit: == on floats would let -0 pass for +0.
  REQUIRE(got.distances.size() == want.distances.size());
  CHECK(std::memcmp(got.distances.data(), want.distances.data(), got.distances.size() * sizeof(float)) == 0);
  CHECK(got.distances_fp64 == want.distances_fp64);
  CHECK(got.ranked_distances == want.ranked_distances);
  CHECK(got.integer_distances == want.integer_distances);
  CHECK(got.beyond_fp32 == want.beyond_fp32);
}

}  // namespace

TEST_CASE("split_rows: contiguous shares covering the range, cut on the grid, none below k", "[knn][sharded]") {
  SECTION("rows that do not divide evenly") {
    auto shares = split_rows({0, 1003}, 3, 1, 10);
    REQUIRE(shares.size() == 3);
    CHECK(shares[0].first_row == 0);
    CHECK(shares[0].rows == 334);
    CHECK(shares[1].first_row == 334);
    CHECK(shares[1].rows == 334);
    CHECK(shares[2].first_row == 668);
    CHECK(shares[2].rows == 335);
  }
  SECTION("cuts on the grid of the file, from a range that starts off it") {
    auto shares = split_rows({150, 900}, 4, 100, 1);
    std::size_t next = 150;
    for (const RowShare& s : shares) {
      CHECK(s.first_row == next);
      if (s.first_row != 150 && s.rows > 0) CHECK(s.first_row % 100 == 0);
      next = s.first_row + s.rows;
    }
    CHECK(next == 1050);
  }
  SECTION("too few rows for every device: the small shares join a neighbour") {
    auto shares = split_rows({0, 25}, 4, 1, 10);
    std::size_t covered = 0, used = 0;
    for (const RowShare& s : shares) {
      CHECK(s.first_row == covered);
      covered += s.rows;
      if (s.rows > 0) {
        ++used;
        CHECK(s.rows >= 10);
      }
    }
    CHECK(covered == 25);
    CHECK(used == 2);
  }
  SECTION("fewer blocks than devices: the others get nothing") {
    auto shares = split_rows({0, 250}, 4, 100, 5);
    std::size_t used = 0;
    for (const RowShare& s : shares) used += s.rows > 0 ? 1 : 0;
    CHECK(used == 3);
    CHECK(shares.back().first_row + shares.back().rows == 250);
  }
}

TEST_CASE("merge_neighbours: ties across shares go to the smaller row, and shapes must agree", "[knn][sharded]") {
  const double inf = std::numeric_limits<double>::infinity();
  Neighbours a{.queries = 1, .k = 3, .distances = {1, 2, 2}, .distances_fp64 = {1, 2, 2},
               .indices = {5, 0, 7}, .integer_distances = true, .beyond_fp32 = {},
               .beyond_fp32_distance = 0, .ranked_distances = {}};
  Neighbours b{.queries = 1, .k = 3, .distances = {2, 3, 9}, .distances_fp64 = {2, 3, 9},
               .indices = {0, 1, 2}, .integer_distances = true, .beyond_fp32 = {},
               .beyond_fp32_distance = 0, .ranked_distances = {}};
  // Share b starts at row 3: its row 0 is row 3 of the file, between a's rows 0 and 7.
  std::vector<ShareLists> shares{{&a, 0}, {&b, 3}};
  auto merged = merge_neighbours(shares, false);
  REQUIRE(merged);
  CHECK(merged->indices == std::vector<std::int32_t>{5, 0, 3});
  CHECK(merged->distances_fp64 == std::vector<double>{1, 2, 2});
  CHECK(merged->integer_distances);

  // Fast mode: ranked by the fp64 values the lists were folded by, which fp32 may not tell apart
  // (here 1 + 2^-40 and 1 both round to 1.0f), so the row of the smaller value comes first even
  // though its row number is larger; a short list's -1 entries are skipped.
  Neighbours fast_a{.queries = 1, .k = 2, .distances = {1, 1}, .distances_fp64 = {},
                    .indices = {0, -1}, .integer_distances = false, .beyond_fp32 = {},
                    .beyond_fp32_distance = 0, .ranked_distances = {1 + std::ldexp(1.0, -40), inf}};
  Neighbours fast_b{.queries = 1, .k = 2, .distances = {1, 4}, .distances_fp64 = {},
                    .indices = {0, 1}, .integer_distances = false, .beyond_fp32 = {},
                    .beyond_fp32_distance = 0, .ranked_distances = {1, 4}};
  std::vector<ShareLists> fast_shares{{&fast_a, 0}, {&fast_b, 10}};
  auto fast = merge_neighbours(fast_shares, true);
  REQUIRE(fast);
  CHECK(fast->indices == std::vector<std::int32_t>{10, 0});
  CHECK(fast->ranked_distances == std::vector<double>{1, 1 + std::ldexp(1.0, -40)});
  CHECK(fast->distances_fp64.empty());

  Neighbours wrong = b;
  wrong.k = 2;
  std::vector<ShareLists> mismatched{{&a, 0}, {&wrong, 3}};
  auto refused = merge_neighbours(mismatched, false);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().kind() == ErrorKind::InvalidInput);
}

TEST_CASE("several devices give the one-device job's lists, exact mode, rows not dividing evenly",
          "[knn][sharded]") {
  TempDir dir{"sharded"};
  const std::size_t rows = 1003, dim = 24, k = 10;
  const fs::path base = dir / "base.fvecs";
  test::write_bytes(base, test::texmex_bytes(test::random_rows(rows, dim, 7, false), dim));
  const VectorSet queries = query_set(41, dim, 8);
  const JobOptions options{.k = k, .max_chunk_rows = 97};
  const Neighbours want = one_device(queries, base, options);
  for (std::size_t devices : {1, 2, 3, 4}) {
    CAPTURE(devices);
    // Devices of different sizes: their chunks differ, their lists may not.
    std::vector<std::size_t> capacities;
    for (std::size_t i = 0; i < devices; ++i) capacities.push_back((std::size_t{1} << 20) << i);
    const auto slots = sim_slots(capacities);
    auto result = run_sharded_knn(slots, queries, base, options);
    REQUIRE(result);
    check_same(result->neighbours, want);
    std::size_t covered = 0;
    for (const DevicePart& part : result->parts) {
      CHECK(part.share.first_row == covered);
      covered += part.share.rows;
      if (part.share.rows > 0) CHECK(part.summary.pool.peak_reserved_bytes > 0);
    }
    CHECK(covered == rows);
  }
}

// The tightest bounds the devices can share are the whole answer's own k-th distances: a job that
// starts with them (as if other devices had already found the k nearest) must keep every row at the
// bound — ties included — and give the same lists, on float and on integer data.
TEST_CASE("a job started with the answer's k-th distances as shared bounds gives the same lists",
          "[knn][sharded]") {
  TempDir dir{"sharded"};
  const std::size_t dim = 16, k = 12;
  std::mt19937_64 random(5);
  auto check_seeded = [&](const fs::path& base, const VectorSet& queries) {
    const JobOptions options{.k = k, .max_chunk_rows = 64};
    const Neighbours want = one_device(queries, base, options);
    REQUIRE(want.distances_fp64.size() == queries.rows * k);
    SharedBounds seeded(queries.rows);
    for (std::size_t q = 0; q < queries.rows; ++q) seeded.lower(q, want.distances_fp64[q * k + k - 1]);
    JobOptions bounded = options;
    bounded.shared_bounds = &seeded;
    check_same(one_device(queries, base, bounded), want);
    // The devices of a sharded job lower the same bounds as they go.
    auto sharded = run_sharded_knn(sim_slots({2 << 20, 2 << 20, 2 << 20}), queries, base, bounded);
    REQUIRE(sharded);
    check_same(sharded->neighbours, want);
    for (std::size_t q = 0; q < queries.rows; ++q)
      CHECK(seeded.kth(q) == want.distances_fp64[q * k + k - 1]);
  };
  SECTION("float rows") {
    const fs::path base = dir / "base.fvecs";
    test::write_bytes(base, test::texmex_bytes(test::random_rows(700, dim, 9, false), dim));
    check_seeded(base, query_set(23, dim, 10));
  }
  SECTION("integer rows of four values: many rows tie at the k-th") {
    std::vector<std::uint8_t> values(700 * dim);
    for (auto& v : values) v = static_cast<std::uint8_t>(random() % 4);
    const fs::path base = dir / "base.bvecs";
    test::write_bytes(base, test::texmex_bytes(values, dim));
    VectorSet queries{19, dim, {}};
    for (std::size_t i = 0; i < queries.rows * dim; ++i)
      queries.values.push_back(static_cast<float>(random() % 4));
    check_seeded(base, queries);
  }
}

TEST_CASE("several devices on integer data: exact integer distances, int64-writable", "[knn][sharded]") {
  TempDir dir{"sharded"};
  const std::size_t rows = 777, dim = 32, k = 16;
  std::mt19937_64 random(3);
  std::vector<std::uint8_t> values(rows * dim);
  for (auto& v : values) v = static_cast<std::uint8_t>(random());
  const fs::path base = dir / "base.bvecs";
  test::write_bytes(base, test::texmex_bytes(values, dim));
  VectorSet queries{29, dim, {}};
  for (std::size_t i = 0; i < queries.rows * dim; ++i)
    queries.values.push_back(static_cast<float>(static_cast<std::uint8_t>(random())));
  const JobOptions options{.k = k, .max_chunk_rows = 128};
  const Neighbours want = one_device(queries, base, options);
  REQUIRE(want.integer_distances);
  auto result = run_sharded_knn(sim_slots({4 << 20, 4 << 20, 4 << 20}), queries, base, options);
  REQUIRE(result);
  check_same(result->neighbours, want);
}

TEST_CASE("several devices decide integer arithmetic as one device: a fraction in one share makes the job's distances fp64",
          "[knn][sharded]") {
  TempDir dir{"sharded"};
  const std::size_t rows = 901, dim = 8, k = 5;
  std::mt19937_64 random(4);
  std::vector<float> values(rows * dim);
  for (float& v : values) v = static_cast<float>(random() % 200) - 100.0f;
  const VectorSet queries{13, dim, std::vector<float>(values.begin(), values.begin() + 13 * dim)};
  for (bool fraction : {false, true}) {
    CAPTURE(fraction);
    std::vector<float> base_values = values;
    if (fraction) base_values[700 * dim + 3] += 0.5f;  // in the last of three shares
    const fs::path base = dir / (fraction ? "fraction.fvecs" : "whole.fvecs");
    test::write_bytes(base, test::texmex_bytes(base_values, dim));
    const JobOptions options{.k = k, .max_chunk_rows = 256};
    const Neighbours want = one_device(queries, base, options);
    CHECK(want.integer_distances == !fraction);
    auto result = run_sharded_knn(sim_slots({8 << 20, 8 << 20, 8 << 20}), queries, base, options);
    REQUIRE(result);
    check_same(result->neighbours, want);
  }
}

TEST_CASE("several devices, fast fp16: shares cut at the one-device job's blocks keep its lists",
          "[knn][sharded]") {
  TempDir dir{"sharded"};
  const std::size_t rows = 1050, dim = 16, k = 8;
  const fs::path base = dir / "base.fvecs";
  // Every block of 100 rows twice as large as the one before: fp16's scaling is per block.
  test::write_bytes(base, test::texmex_bytes(test::random_rows(rows, dim, 11, true), dim));
  const VectorSet queries = query_set(23, dim, 12, true);
  JobOptions options{.k = k, .fast = true, .precision = Precision::Fp16, .max_chunk_rows = 100};
  const Neighbours want = one_device(queries, base, options);
  // The data is such that other block boundaries give other fp16 distances: a split that did
  // not keep the one-device blocks would show here.
  JobOptions other_blocks = options;
  other_blocks.max_chunk_rows = 150;
  CHECK(one_device(queries, base, other_blocks).distances != want.distances);
  for (std::size_t devices : {2, 3, 4}) {
    CAPTURE(devices);
    auto result = run_sharded_knn(sim_slots(std::vector<std::size_t>(devices, 8 << 20)), queries,
                                  base, options);
    REQUIRE(result);
    check_same(result->neighbours, want);
    for (const DevicePart& part : result->parts)
      if (part.share.first_row != 0 && part.share.rows > 0) CHECK(part.share.first_row % 100 == 0);
  }
}

TEST_CASE("a fault injected into one device mid-job: retried, or a clean error naming it",
          "[knn][sharded]") {
  TempDir dir{"sharded"};
  const std::size_t rows = 1003, dim = 24, k = 10;
  const fs::path base = dir / "base.fvecs";
  test::write_bytes(base, test::texmex_bytes(test::random_rows(rows, dim, 21, false), dim));
  const VectorSet queries = query_set(31, dim, 22);
  // No uploads ahead: their buffers come when the reading allows, and fault N must land on the
  // same buffer in every run.
  const JobOptions options{.k = k, .max_chunk_rows = 64, .upload_ahead = false};
  const Neighbours want = one_device(queries, base, options);

  SECTION("one allocation fails: the chunk is retried, no row lost or counted twice") {
    auto slots = sim_slots({8 << 20, 8 << 20, 8 << 20});
    // No cache to fall back on: the pool's own ladder cannot hide the failure from the job.
    slots[1].pool = GpuMemoryPool(PoolConfig{.caching = false});
    REQUIRE(slots[1].device.inject_faults({.fail_nth_allocation = 12, .fail_above_bytes = {}}));
    auto result = run_sharded_knn(slots, queries, base, options);
    REQUIRE(result);
    check_same(result->neighbours, want);
    CHECK(result->parts[1].summary.pool.out_of_memory_errors >= 1);
    CHECK(result->parts[1].summary.retries >= 1);
    CHECK(result->parts[0].summary.retries == 0);
  }
  SECTION("every allocation above a size fails: the job ends with that device's error") {
    auto slots = sim_slots({8 << 20, 8 << 20, 8 << 20});
    REQUIRE(slots[2].device.inject_faults({.fail_nth_allocation = {}, .fail_above_bytes = 16}));
    auto result = run_sharded_knn(slots, queries, base, options);
    REQUIRE_FALSE(result);
    CHECK(result.error().is_out_of_memory());
    CHECK_THAT(result.error().to_string(), Contains("device 2") && Contains("base rows 668..1002"));
  }
}
