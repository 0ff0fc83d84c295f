// ShardedCorpus on CUDA: one GPU named twice (two shards, two threads, one device), and one shard
// on each GPU where there are several, answer as the whole corpus on one. Tagged [gpu]: CTest
// skips these, tools/gpu-check.sh runs them.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>
import gpupool;
#include "../support/gpu_device.hpp"

using namespace gpupool;
using gpupool::testing::gpu;

namespace {

// Values of magnitude 0.05 to 1 and random sign: no zeros, fresh every run.
std::vector<float> fresh_values(std::size_t n) {
  static std::mt19937 engine{std::random_device{}()};
  std::uniform_real_distribution<float> magnitude(0.05f, 1.0f);
  std::vector<float> values(n);
  for (float& v : values) v = (engine() & 1) ? -magnitude(engine) : magnitude(engine);
  return values;
}

// `found` (from shards) holds `expected`'s lists (from one device): the same indices, the same
// distances within fp32 rounding.
void check_same_lists(const ShardedKnnResult& found, const ShardedKnnResult& expected) {
  CHECK(found.indices == expected.indices);
  REQUIRE(found.distances.size() == expected.distances.size());
  for (std::size_t i = 0; i < found.distances.size(); ++i)
    CHECK(std::abs(found.distances[i] - expected.distances[i]) <=
          1e-6f * std::max(1.0f, std::abs(expected.distances[i])));
}

// `values` rounded to fp16: the host copy and a pool buffer on `device` holding it.
struct HalfValues {
  std::vector<Half> host;
  ManagedBuffer on_device;
};
HalfValues upload_as_half(GpuMemoryPool& pool, const Device& device,
                          const std::vector<float>& values) {
  std::vector<Half> host(values.size());
  std::transform(values.begin(), values.end(), host.begin(), to_half);
  auto buffer = pool.get_managed_buffer(device, host.size(), Precision::Fp16);
  REQUIRE(buffer);
  REQUIRE(buffer->upload(std::span<const Half>(host)));
  return {std::move(host), std::move(*buffer)};
}

}  // namespace

TEST_CASE("cuda sharded corpus: two shards on one GPU answer as the whole corpus",
          "[gpu][shards]") {
  constexpr std::size_t kDim = 128, kRows = 100'003, kQueries = 16, kK = 10;
  Device device = gpu();
  GpuMemoryPool pool;
  const std::vector<float> rows = fresh_values(kRows * kDim);
  const std::vector<float> queries = fresh_values(kQueries * kDim);
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
    check_same_lists(*found, *expected);
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
  const std::vector<float> rows = fresh_values(kRows * kDim);
  const std::vector<float> queries = fresh_values(kQueries * kDim);
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
    check_same_lists(*found, *expected);
    CHECK(found->shard_seconds.size() == devices.size());
  }
}

// The norms each shard keeps (row_norms at creation, read by every search) give the distances knn
// gives computing its own: fp16 rows, few queries (8) and tiled (40), L2 and cosine, rank by rank
// within fp16's tolerance (a near tie may swap two rows, never a distance).
TEST_CASE("cuda sharded corpus: its kept norms give knn's own distances", "[gpu][shards]") {
  constexpr std::size_t kDim = 128, kRows = 100'003, kK = 10;
  Device device = gpu();
  GpuMemoryPool pool;
  const HalfValues rows = upload_as_half(pool, device, fresh_values(kRows * kDim));
  const std::vector<Device> twice{device, device};
  auto halves = ShardedCorpus::create(pool, twice, std::as_bytes(std::span(rows.host)), kDim,
                                      Precision::Fp16);
  REQUIRE(halves);
  for (std::size_t nq : {8u, 40u}) {
    const HalfValues queries = upload_as_half(pool, device, fresh_values(nq * kDim));
    for (Metric metric : {Metric::L2, Metric::Cosine}) {
      INFO(nq << " queries, " << to_string(metric));
      auto expected = knn(pool, queries.on_device, rows.on_device, kK,
                          {.dim = kDim, .metric = metric});
      REQUIRE(expected);
      auto expected_d = expected->distances.to_host<float>();
      REQUIRE(expected_d);
      auto found =
          halves->knn(std::as_bytes(std::span(queries.host)), kK, {.metric = metric});
      if (!found) FAIL(found.error().to_string());
      REQUIRE(found->distances.size() == expected_d->size());
      std::size_t off = 0;
      for (std::size_t i = 0; i < expected_d->size(); ++i)
        off += !(std::abs(found->distances[i] - (*expected_d)[i]) <=
                 2e-3f * std::max(1.0f, std::abs((*expected_d)[i])));
      CHECK(off == 0);
    }
  }
}
