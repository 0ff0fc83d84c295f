// ShardedCorpus on CUDA: one GPU named twice (two shards, two threads, one device), and one shard
// on each GPU where there are several, answer as the whole corpus on one. Tagged [gpu]: CTest skips these, tools/gpu-check.sh runs them.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>
import gpupool;
#include "../support/gpu_device.hpp"

using namespace gpupool;
using gpupool::testing::gpu;

TEST_CASE("cuda sharded corpus: two shards on one GPU answer as the whole corpus",
          "[gpu][shards]") {
  constexpr std::size_t kDim = 128, kRows = 100'003, kQueries = 16, kK = 10;
  Device device = gpu();
  GpuMemoryPool pool;
  std::mt19937 engine{std::random_device{}()};
  std::uniform_real_distribution<float> magnitude(0.05f, 1.0f);
  auto fresh = [&](std::size_t n) {
    std::vector<float> values(n);
    for (float& v : values) v = (engine() & 1) ? -magnitude(engine) : magnitude(engine);
    return values;
  };
  const std::vector<float> rows = fresh(kRows * kDim), queries = fresh(kQueries * kDim);
  const auto row_bytes = std::as_bytes(std::span(rows));
  const auto query_bytes = std::as_bytes(std::span(queries));

  auto whole = ShardedCorpus::create(pool, std::span(&device, 1), row_bytes, kDim, Precision::Fp32);
  REQUIRE(whole);
  const std::vector<Device> twice{device, device};
  auto halves = ShardedCorpus::create(pool, twice, row_bytes, kDim, Precision::Fp32);
  REQUIRE(halves);
  REQUIRE(halves->shard_count() == 2);
  for (Metric metric : {Metric::L2, Metric::InnerProduct}) {
    auto expected = whole->knn(query_bytes, kK, {.metric = metric});
    auto found = halves->knn(query_bytes, kK, {.metric = metric});
    if (!expected) FAIL(expected.error().to_string());
    if (!found) FAIL(found.error().to_string());
    CHECK(found->indices == expected->indices);
    for (std::size_t i = 0; i < found->distances.size(); ++i)
      CHECK(std::abs(found->distances[i] - expected->distances[i]) <=
            1e-6f * std::max(1.0f, std::abs(expected->distances[i])));
  }
}

TEST_CASE("cuda sharded corpus: one shard on every GPU answers as the whole corpus on one",
          "[gpu][shards]") {
  const int count = Device::cuda_device_count();
  if (count < 2) {
    WARN("one GPU here: shards on several GPUs are not exercised");
    return;
  }
  constexpr std::size_t kDim = 96, kRows = 200'003, kQueries = 33, kK = 17;
  std::vector<Device> devices;
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    auto device = Device::cuda(ordinal);
    REQUIRE(device);
    devices.push_back(*device);
  }
  GpuMemoryPool pool;
  std::mt19937 engine{std::random_device{}()};
  std::uniform_real_distribution<float> magnitude(0.05f, 1.0f);
  auto fresh = [&](std::size_t n) {
    std::vector<float> values(n);
    for (float& v : values) v = (engine() & 1) ? -magnitude(engine) : magnitude(engine);
    return values;
  };
  const std::vector<float> rows = fresh(kRows * kDim), queries = fresh(kQueries * kDim);
  const auto row_bytes = std::as_bytes(std::span(rows));
  const auto query_bytes = std::as_bytes(std::span(queries));
  auto whole = ShardedCorpus::create(pool, std::span(devices.data(), 1), row_bytes, kDim,
                                     Precision::Fp32);
  REQUIRE(whole);
  auto spread = ShardedCorpus::create(pool, devices, row_bytes, kDim, Precision::Fp32);
  REQUIRE(spread);
  REQUIRE(spread->shard_count() == devices.size());
  for (Metric metric : {Metric::L2, Metric::InnerProduct, Metric::Cosine}) {
    auto expected = whole->knn(query_bytes, kK, {.metric = metric});
    auto found = spread->knn(query_bytes, kK, {.metric = metric});
    if (!expected) FAIL(expected.error().to_string());
    if (!found) FAIL(found.error().to_string());
    CHECK(found->indices == expected->indices);
    for (std::size_t i = 0; i < found->distances.size(); ++i)
      CHECK(std::abs(found->distances[i] - expected->distances[i]) <=
            1e-6f * std::max(1.0f, std::abs(expected->distances[i])));
    CHECK(found->shard_seconds.size() == devices.size());
  }
}
