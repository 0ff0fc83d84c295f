// ShardedCorpus on simulated devices: a corpus cut over several devices (one of them named
// twice) answers exactly as knn over the whole corpus on one device — same rows, same distances,
// ties by the smaller row across a shard boundary — in every precision and metric; and it
// refuses what it cannot search, naming the shard whose device failed.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <vector>
import gpupool;
#include "support/sim_device.hpp"

using namespace gpupool;
using gpupool::testing::sim;

namespace {

// Fresh random values in [-1, -0.05] ∪ [0.05, 1]: never zero.
std::vector<float> random_values(std::size_t n) {
  static std::mt19937 engine{std::random_device{}()};
  std::uniform_real_distribution<float> magnitude(0.05f, 1.0f);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> values(n);
  for (float& v : values) v = negative(engine) ? -magnitude(engine) : magnitude(engine);
  return values;
}

// The values as `precision` stores them (int8: symmetric per-row quantisation, scales beside).
struct Stored {
  std::vector<std::byte> bytes;
  std::vector<float> scales;
};
Stored store(const std::vector<float>& values, std::size_t dim, Precision precision) {
  Stored out;
  const std::size_t n = values.size();
  out.bytes.resize(n * element_size(precision));
  for (std::size_t i = 0; i < n; ++i) {
    switch (precision) {
      case Precision::Fp32: std::memcpy(&out.bytes[4 * i], &values[i], 4); break;
      case Precision::Fp16: {
        const Half h = to_half(values[i]);
        std::memcpy(&out.bytes[2 * i], &h, 2);
        break;
      }
      case Precision::Bf16: {
        const BFloat16 b = to_bfloat16(values[i]);
        std::memcpy(&out.bytes[2 * i], &b, 2);
        break;
      }
      default: break;
    }
  }
  if (precision == Precision::Int8) {
    for (std::size_t row = 0; row < n / dim; ++row) {
      float largest = 0;
      for (std::size_t j = 0; j < dim; ++j) largest = std::max(largest, std::abs(values[row * dim + j]));
      const float scale = largest / 127.0f;
      out.scales.push_back(scale);
      for (std::size_t j = 0; j < dim; ++j)
        out.bytes[row * dim + j] =
            static_cast<std::byte>(static_cast<std::int8_t>(std::lround(values[row * dim + j] / scale)));
    }
  }
  return out;
}

// knn over the whole corpus on one device, to the host.
ShardedKnnResult one_device(GpuMemoryPool& pool, const Device& device, const Stored& corpus,
                            const Stored& queries, std::size_t dim, Precision precision,
                            std::size_t k, Metric metric) {
  auto sharded = ShardedCorpus::create(pool, std::span(&device, 1), corpus.bytes, dim, precision,
                                       corpus.scales);
  REQUIRE(sharded);
  REQUIRE(sharded->shard_count() == 1);
  auto found = sharded->knn(queries.bytes, k, {.metric = metric, .query_scales = queries.scales});
  REQUIRE(found);
  return std::move(*found);
}

}  // namespace

TEST_CASE("a sharded corpus answers as knn over the whole corpus on one device",
          "[kernels][shards]") {
  constexpr std::size_t kDim = 24, kRows = 1003, kQueries = 13;
  Device a = sim(1 * GiB), b = sim(1 * GiB), c = sim(1 * GiB);
  GpuMemoryPool pool;
  const std::vector<float> corpus_values = random_values(kRows * kDim);
  const std::vector<float> query_values = random_values(kQueries * kDim);
  for (Precision precision : {Precision::Fp32, Precision::Fp16, Precision::Bf16, Precision::Int8})
    for (Metric metric : {Metric::L2, Metric::InnerProduct, Metric::Cosine}) {
      INFO(to_string(precision) << " metric " << static_cast<int>(metric));
      const Stored corpus = store(corpus_values, kDim, precision);
      const Stored queries = store(query_values, kDim, precision);
      const std::size_t k = 10;
      ShardedKnnResult expected = one_device(pool, a, corpus, queries, kDim, precision, k, metric);
      // Three devices, one of them twice: four shards of 251, 251, 251 and 250 rows.
      const std::vector<Device> devices{a, b, c, b};
      auto sharded = ShardedCorpus::create(pool, devices, corpus.bytes, kDim, precision, corpus.scales);
      REQUIRE(sharded);
      REQUIRE(sharded->shard_count() == 4);
      CHECK(sharded->shard_rows(0) == 251);
      CHECK(sharded->shard_rows(3) == 250);
      CHECK(sharded->shard_first_row(3) == 753);
      auto found = sharded->knn(queries.bytes, k, {.metric = metric, .query_scales = queries.scales});
      REQUIRE(found);
      CHECK(found->shard_seconds.size() == 4);
      CHECK(found->indices == expected.indices);
      REQUIRE(found->distances.size() == expected.distances.size());
      CHECK(std::memcmp(found->distances.data(), expected.distances.data(),
                        expected.distances.size() * sizeof(float)) == 0);
    }
}

TEST_CASE("a sharded corpus breaks ties by the smaller row across shards, and k may pass a shard",
          "[kernels][shards]") {
  constexpr std::size_t kDim = 8;
  Device a = sim(256 * MiB), b = sim(256 * MiB);
  GpuMemoryPool pool;
  // 10 rows over two shards of 5; rows 3 and 7 (one in each shard) are the same vector, the
  // query's nearest; every other row is farther.
  std::vector<float> rows = random_values(10 * kDim);
  std::vector<float> query = random_values(kDim);
  for (std::size_t j = 0; j < kDim; ++j) {
    rows[3 * kDim + j] = rows[7 * kDim + j] = query[j];
    for (std::size_t r : {0u, 1u, 2u, 4u, 5u, 6u, 8u, 9u}) rows[r * kDim + j] += 3.0f;
  }
  const std::vector<Device> devices{b, a};
  auto sharded = ShardedCorpus::create(pool, devices, std::as_bytes(std::span(rows)), kDim,
                                       Precision::Fp32);
  REQUIRE(sharded);
  auto found = sharded->knn(std::as_bytes(std::span(query)), 8);  // more than a shard's 5 rows
  REQUIRE(found);
  REQUIRE(found->indices.size() == 8);
  CHECK(found->indices[0] == 3);
  CHECK(found->indices[1] == 7);
  CHECK(found->distances[0] == found->distances[1]);
  for (std::size_t i = 1; i < 8; ++i) CHECK(found->distances[i - 1] <= found->distances[i]);
}

TEST_CASE("a sharded corpus with fewer rows than devices uses as many shards as rows",
          "[kernels][shards]") {
  Device a = sim(64 * MiB);
  GpuMemoryPool pool;
  const std::vector<float> rows = random_values(2 * 4);
  const std::vector<Device> devices{a, a, a};
  auto sharded = ShardedCorpus::create(pool, devices, std::as_bytes(std::span(rows)), 4,
                                       Precision::Fp32);
  REQUIRE(sharded);
  CHECK(sharded->shard_count() == 2);
  auto found = sharded->knn(std::as_bytes(std::span(rows)), 2);
  REQUIRE(found);
  CHECK(found->indices == std::vector<std::int64_t>{0, 1, 1, 0});
}

TEST_CASE("a sharded corpus refuses what it cannot search and names a failing shard",
          "[kernels][shards]") {
  Device a = sim(256 * MiB);
  GpuMemoryPool pool;
  const std::vector<float> rows = random_values(6 * 4);
  const auto bytes = std::as_bytes(std::span(rows));
  auto kind = [](const auto& result) { return result.error().kind(); };

  auto no_devices = ShardedCorpus::create(pool, {}, bytes, 4, Precision::Fp32);
  REQUIRE_FALSE(no_devices);
  CHECK(kind(no_devices) == ErrorKind::InvalidInput);
  const std::vector<Device> devices{a};
  auto ragged = ShardedCorpus::create(pool, devices, bytes.first(bytes.size() - 4), 4, Precision::Fp32);
  REQUIRE_FALSE(ragged);
  CHECK(kind(ragged) == ErrorKind::InvalidInput);
  auto raw_bytes = ShardedCorpus::create(pool, devices, bytes, 4, Precision::Bytes);
  REQUIRE_FALSE(raw_bytes);
  CHECK(kind(raw_bytes) == ErrorKind::InvalidInput);
  auto int8_without_scales = ShardedCorpus::create(pool, devices, bytes, 16, Precision::Int8);
  REQUIRE_FALSE(int8_without_scales);
  CHECK(kind(int8_without_scales) == ErrorKind::InvalidInput);

  auto sharded = ShardedCorpus::create(pool, devices, bytes, 4, Precision::Fp32);
  REQUIRE(sharded);
  auto too_many = sharded->knn(bytes.first(16), 7);  // 6 rows
  REQUIRE_FALSE(too_many);
  CHECK(kind(too_many) == ErrorKind::InvalidInput);
  auto ragged_queries = sharded->knn(bytes.first(12), 1);
  REQUIRE_FALSE(ragged_queries);
  CHECK(kind(ragged_queries) == ErrorKind::InvalidInput);

  // A device that cannot hold its share: the error says which shard and device.
  Device tiny = sim(64 * KiB);
  const std::vector<float> large = random_values(64 * 1024);
  const std::vector<Device> two{a, tiny};
  auto full = ShardedCorpus::create(pool, two, std::as_bytes(std::span(large)), 64, Precision::Fp32);
  REQUIRE_FALSE(full);
  CHECK(kind(full) == ErrorKind::OutOfMemory);
  CHECK_THAT(full.error().message(), Catch::Contains("shard 1"));
}
