// Test support: knn's upper bounds on any device against a model — the unbounded result with
// every entry beyond its query's bound turned into an empty slot (index -1, NaN). Bounds of every
// kind per query: none (+inf), exactly an entry's distance (a tie is within), between two
// entries, below them all. Shared by the simulated device's suite and the [gpu] one; results
// come back into poisoned pool blocks. Include after `import gpupool;`.
#pragma once
#include <catch2/catch.hpp>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <vector>

namespace gpupool::test {

struct HostLists {
  std::vector<float> distances;
  std::vector<std::int32_t> indices;
};

inline HostLists knn_to_host(GpuMemoryPool& pool, const Device& device, const ManagedBuffer& q,
                             const ManagedBuffer& x, std::size_t k, const DistanceOptions& options,
                             std::size_t queries, KnnPath* path = nullptr) {
  {  // the next result blocks come from the cache, all bits set (NaN, index -1)
    auto d = pool.get_managed_buffer(device, queries * k, Precision::Fp32);
    auto i = pool.get_managed_buffer(device, queries * k * 4, Precision::Bytes);
    REQUIRE(d);
    REQUIRE(i);
    std::vector<std::byte> ones(queries * k * 4, std::byte{0xff});
    REQUIRE(d->upload(std::span<const std::byte>(ones)));
    REQUIRE(i->upload(std::span<const std::byte>(ones)));
  }
  auto found = knn(pool, q, x, k, options);
  REQUIRE(found);
  if (path) *path = found->path;
  auto d = found->distances.to_host<float>();
  auto i = indices_to_host(found->indices);
  REQUIRE(d);
  REQUIRE(i);
  return {std::move(*d), std::move(*i)};
}

// Query r's bound from its unbounded list (ascending, k entries): kind r % 4.
inline float bound_for(std::size_t r, const float* list, std::size_t k, std::mt19937& rng) {
  std::uniform_int_distribution<std::size_t> entry(0, k - 1);
  switch (r % 4) {
    case 0: return std::numeric_limits<float>::infinity();
    case 1: return list[entry(rng)];  // rows at exactly the bound are within it
    case 2: {
      const std::size_t j = entry(rng);
      return j + 1 < k ? list[j] + (list[j + 1] - list[j]) / 2 : list[j];
    }
    default: return list[0] - 1.0f - std::abs(list[0]);  // below every row
  }
}

// `options` without upper bounds; the call must be deterministic (same path both times).
// Returns how many entries the bounds cut, for callers that need the case to bite.
inline std::size_t check_upper_bounds(GpuMemoryPool& pool, const Device& device,
                                      const ManagedBuffer& q, const ManagedBuffer& x,
                                      std::size_t k, DistanceOptions options, std::size_t queries) {
  KnnPath unbounded_path{}, bounded_path{};
  const HostLists all = knn_to_host(pool, device, q, x, k, options, queries, &unbounded_path);
  std::mt19937 rng(std::random_device{}());
  std::vector<float> bounds(queries);
  for (std::size_t r = 0; r < queries; ++r)
    bounds[r] = bound_for(r, all.distances.data() + r * k, k, rng);
  options.upper_bounds = bounds;
  const HostLists got = knn_to_host(pool, device, q, x, k, options, queries, &bounded_path);
  CHECK(bounded_path == unbounded_path);
  std::size_t cut = 0, wrong = 0;
  for (std::size_t r = 0; r < queries; ++r)
    for (std::size_t j = 0; j < k; ++j) {
      const std::size_t at = r * k + j;
      const bool within = all.distances[at] <= bounds[r];
      cut += within ? 0 : 1;
      const bool same = within ? got.indices[at] == all.indices[at] &&
                                     got.distances[at] == all.distances[at]
                               : got.indices[at] == -1 && std::isnan(got.distances[at]);
      if (!same && wrong++ < 5)
        UNSCOPED_INFO("query " << r << " slot " << j << ": bound " << bounds[r] << ", unbounded ("
                               << all.distances[at] << ", " << all.indices[at] << "), bounded ("
                               << got.distances[at] << ", " << got.indices[at] << ")");
    }
  CHECK(wrong == 0);
  return cut;
}

}  // namespace gpupool::test
