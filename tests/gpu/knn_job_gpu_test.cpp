// The exact knn job on a CUDA device: the host's fp64 brute force, bit for bit (ids, fp32 and fp64
// distances), for integer data on the integer path and for float data built to defeat fp32 —
// under every metric, for chunks of every size, under a pool limit that forces small chunks and
// query blocks, and equal to the job on the simulated device.
#include <catch2/catch.hpp>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <system_error>
#include <unistd.h>
#include <vector>
#include "../support/vector_files.hpp"
#include "exact_knn.hpp"
#include "../support/exact_reference.hpp"  // after the import of gpupool (in exact_knn.hpp)
#include "../support/gpu_device.hpp"

using namespace gpupool;
using gpupool::testing::gpu;
using namespace gpupool::exact;
namespace fs = std::filesystem;

namespace {


class ScratchDir {
 public:
  ScratchDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() / ("gpupool-knn-gpu-test-" + std::to_string(::getpid()) +
                                         "-" + std::to_string(counter++));
    fs::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
};

// A fresh seed every run: the job must be exact on any data of the kind, not on one draw.
std::uint32_t fresh_seed() {
  static std::random_device source;
  const std::uint32_t seed = source();
  UNSCOPED_INFO("seed " << seed);
  return seed;
}

struct Data {
  VectorSet queries, base;
  fs::path file;
};

// uint8 rows of few distinct values (exact ties everywhere, settled by row) and a few large ones,
// stored as .bvecs; integer queries.
Data byte_data(const ScratchDir& dir, std::uint32_t seed) {
  const std::size_t dim = 48, rows = 4000, queries = 60;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> small(0, 3), large(180, 255);
  std::vector<std::uint8_t> bytes(rows * dim), query_bytes(queries * dim);
  for (std::size_t i = 0; i < bytes.size(); ++i)
    bytes[i] = static_cast<std::uint8_t>(i % 7 == 0 ? large(rng) : small(rng));
  for (auto& b : query_bytes) b = static_cast<std::uint8_t>(small(rng));
  const fs::path file = dir / "base.bvecs";
  test::write_bytes(file, test::texmex_bytes(bytes, dim));
  return {{queries, dim, std::vector<float>(query_bytes.begin(), query_bytes.end())},
          {rows, dim, std::vector<float>(bytes.begin(), bytes.end())},
          file};
}

// fp32 rows on a large common offset, in pairs one ulp apart in one coordinate: fp32's GEMM
// form cannot tell them apart (its error is ~1e-4 of ‖q‖² + ‖x‖²), only the fp64 re-rank can.
Data offset_data(const ScratchDir& dir, std::uint32_t seed) {
  const std::size_t dim = 40, rows = 3000, queries = 50;
  std::mt19937 rng(seed);
  std::normal_distribution<float> noise(0.0f, 0.02f);
  VectorSet base{rows, dim, std::vector<float>(rows * dim)};
  VectorSet query{queries, dim, std::vector<float>(queries * dim)};
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < dim; ++c)
      base.values[r * dim + c] = r % 2 == 1 && c != 0 ? base.values[(r - 1) * dim + c]
                                 : r % 2 == 1          ? std::nextafter(base.values[(r - 1) * dim],
                                                                        2000.0f)
                                                       : 1000.0f + noise(rng);
  for (float& v : query.values) v = 1000.0f + noise(rng);
  const fs::path file = dir / "base.fvecs";
  REQUIRE(io::write_fvecs(file, rows, dim, std::span<const float>(base.values)));
  return {std::move(query), std::move(base), file};
}

// One dimension, values 1e4 apart by thousandths (pytorch#42479: fp32 GEMM-form L2 ranks them
// by rounding noise).
Data line_data(const ScratchDir& dir, std::uint32_t seed) {
  const std::size_t rows = 2000, queries = 30;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> near(9999.0f, 10001.0f);
  VectorSet base{rows, 1, std::vector<float>(rows)};
  VectorSet query{queries, 1, std::vector<float>(queries)};
  for (std::size_t r = 0; r < rows; ++r) base.values[r] = 9999.0f + 0.001f * static_cast<float>(r);
  for (float& v : query.values) v = near(rng);
  const fs::path file = dir / "base.fvecs";
  REQUIRE(io::write_fvecs(file, rows, 1, std::span<const float>(base.values)));
  return {std::move(query), std::move(base), file};
}

Neighbours run_job(const Device& device, const Data& data, const JobOptions& options,
                   std::optional<std::size_t> pool_limit = std::nullopt) {
  PoolConfig config;
  config.max_pool_size = pool_limit;
  GpuMemoryPool pool(config);
  auto base = io::VectorReader::open(data.file);
  REQUIRE(base);
  auto result = run_exact_knn(pool, device, data.queries, *base, options);
  if (!result) FAIL(result.error().to_string());
  return std::move(result->neighbours);
}

void check_same(const Neighbours& got, const Neighbours& expected) {
  CHECK(got.indices == expected.indices);
  CHECK(got.distances == expected.distances);
  CHECK(got.distances_fp64 == expected.distances_fp64);
}

// The job on the GPU in three chunkings and on the simulated device, each against the host's
// fp64 brute force.
void check_everywhere(const Data& data, Metric metric, std::size_t k) {
  CAPTURE(to_string(metric), k);
  const Neighbours expected = test::fp64_reference(data.queries, data.base, k, metric);
  const Device device = gpu();
  {
    INFO("GPU, default chunks");
    check_same(run_job(device, data, {.k = k, .metric = metric}), expected);
  }
  {
    INFO("GPU, chunks of 333 rows");
    check_same(run_job(device, data, {.k = k, .metric = metric, .max_chunk_rows = 333}), expected);
  }
  {
    INFO("GPU, a pool limit of 2 MiB (small chunks, query blocks)");
    check_same(run_job(device, data, {.k = k, .metric = metric}, std::size_t{2} << 20), expected);
  }
  {
    INFO("simulated device");
    auto sim = Device::simulated({.capacity = std::size_t{256} << 20});
    REQUIRE(sim);
    check_same(run_job(*sim, data, {.k = k, .metric = metric, .max_chunk_rows = 1000}), expected);
  }
}

}  // namespace

TEST_CASE("GPU exact knn job: uint8 rows on the integer path equal the fp64 brute force",
          "[gpu][knn-job]") {
  ScratchDir dir;
  const Data data = byte_data(dir, fresh_seed());
  const Metric metric = GENERATE(Metric::L2, Metric::InnerProduct, Metric::Cosine);
  check_everywhere(data, metric, 25);
}

TEST_CASE("GPU exact knn job: float rows built to defeat fp32 equal the fp64 brute force",
          "[gpu][knn-job]") {
  ScratchDir dir;
  const std::uint32_t seed = fresh_seed();
  const Metric metric = GENERATE(Metric::L2, Metric::InnerProduct, Metric::Cosine);
  SECTION("near-duplicates on a large offset") {
    check_everywhere(offset_data(dir, seed), metric, 20);
  }
  SECTION("one dimension (pytorch#42479)") { check_everywhere(line_data(dir, seed), metric, 10); }
}
