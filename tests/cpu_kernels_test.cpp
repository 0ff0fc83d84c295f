// The simulated device's blocked distance kernels (gpu/cpu_kernels.cpp) against the documented
// fp32 summation order, bit for bit: 8 interleaved partial sums, reduced ((0+1)+(2+3))+((4+5)+
// (6+7)). Shapes cover the 4 × 4 and 4 × 2 register tiles, their remainders, and dimension tails.
#include <catch2/catch.hpp>
#include <cstdint>
#include <random>
#include <span>
#include <vector>
import gpupool;

using namespace gpupool;

namespace {

float documented_sum(const float* q, const float* x, std::size_t dim, bool squared) {
  float acc[8] = {};
  for (std::size_t c = 0; c < dim; ++c) {
    float term = squared ? (q[c] - x[c]) * (q[c] - x[c]) : q[c] * x[c];
    acc[c & 7] += term;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

std::vector<float> random_values(std::size_t count, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> value(-3.0f, 3.0f);
  std::vector<float> out(count);
  for (float& v : out) v = value(rng);
  return out;
}

}  // namespace

TEST_CASE("blocked CPU distances equal the documented fp32 summation bit for bit", "[cpu-kernels]") {
  auto device = Device::simulated({.capacity = 64 * MiB});
  REQUIRE(device);
  GpuMemoryPool pool;
  std::size_t dim = GENERATE(1, 7, 8, 13, 64, 785);
  std::size_t nq = GENERATE(1, 6), nx = GENERATE(3, 71);
  Metric metric = GENERATE(Metric::L2, Metric::InnerProduct);
  CAPTURE(dim, nq, nx, to_string(metric));
  auto qh = random_values(nq * dim, 1), xh = random_values(nx * dim, 2);
  auto q = pool.get_managed_buffer(*device, qh.size(), Precision::Fp32);
  auto x = pool.get_managed_buffer(*device, xh.size(), Precision::Fp32);
  REQUIRE((q && x));
  REQUIRE(q->upload(std::span<const float>(qh)));
  REQUIRE(x->upload(std::span<const float>(xh)));
  auto out = l2_distance(pool, *q, *x, {.dim = dim, .metric = metric});
  REQUIRE(out);
  auto got = out->to_host<float>();
  REQUIRE(got);
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < nq; ++i)
    for (std::size_t j = 0; j < nx; ++j) {
      float raw = documented_sum(qh.data() + i * dim, xh.data() + j * dim, dim, metric == Metric::L2);
      float expected = metric == Metric::L2 ? (raw < 0 ? 0 : raw) : -raw;
      if ((*got)[i * nx + j] != expected) ++mismatches;
    }
  CHECK(mismatches == 0);
}
