// ShardedCorpus on CUDA: one GPU named twice (two shards, two threads, one device) answers as
// the whole corpus on it. Tagged [gpu]: CTest skips these, tools/gpu-check.sh runs them.
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
