// Test support shared by the CPU and GPU kernel tests: the fp64 reference kNN, reproducible data
// that crowds rows around the queries, and the judge of "is this the exact fp32 kNN".
// Include after `import gpupool;` (it uses gpupool::Metric).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <set>
#include <thread>
#include <vector>

namespace gpupool::test {

// The fp64 distance by the metric's definition, and in `scale` what its fp32 error is relative
// to: ‖q‖² + ‖x‖² for L2 (the GEMM form), ‖q‖‖x‖ for inner product, 1 for cosine.
inline double reference_distance(const float* q, const float* x, std::size_t dim, Metric metric,
                                 double* scale = nullptr) {
  double l2 = 0, dot = 0, qq = 0, xx = 0;
  for (std::size_t i = 0; i < dim; ++i) {
    double a = q[i], b = x[i];
    l2 += (a - b) * (a - b);
    dot += a * b;
    qq += a * a;
    xx += b * b;
  }
  if (scale)
    *scale = metric == Metric::L2 ? qq + xx : metric == Metric::InnerProduct ? std::sqrt(qq * xx) : 1.0;
  switch (metric) {
    case Metric::L2: return l2;
    case Metric::InnerProduct: return -dot;
    case Metric::Cosine: return (qq == 0 || xx == 0) ? 1.0 : 1.0 - dot / std::sqrt(qq * xx);
  }
  return 0;
}

// Σ count(i) over the queries i < nq, the queries spread over the machine's cores: the fp64
// references dominate the kernel tests' time (the GPU machine has 16 cores, CI 2). `count` must be
// safe to call from several threads at once (no Catch2 macros: Catch2 is not thread-safe).
template <class Count>
std::size_t sum_over_queries(std::size_t nq, Count&& count) {
  std::size_t workers = std::min<std::size_t>(std::max(1u, std::thread::hardware_concurrency()), nq);
  std::vector<std::size_t> partial(workers, 0);
  std::vector<std::thread> threads;
  for (std::size_t w = 0; w < workers; ++w)
    threads.emplace_back([&, w] {
      for (std::size_t i = w; i < nq; i += workers) partial[w] += count(i);
    });
  for (std::thread& t : threads) t.join();
  std::size_t total = 0;
  for (std::size_t p : partial) total += p;
  return total;
}

// One query against every corpus row (xh holds rows of dim floats): the fp64 distances, their
// error scales, and the k-th smallest distance.
struct ReferenceRow {
  std::vector<double> distance, scale;
  double kth = 0;
};

inline ReferenceRow reference_row(const float* q, const std::vector<float>& xh, std::size_t dim,
                                  std::size_t k, Metric metric) {
  std::size_t n = xh.size() / dim;
  ReferenceRow row{std::vector<double>(n), std::vector<double>(n)};
  for (std::size_t j = 0; j < n; ++j)
    row.distance[j] = reference_distance(q, &xh[j * dim], dim, metric, &row.scale[j]);
  std::vector<double> sorted = row.distance;
  std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end());
  row.kth = sorted[k - 1];
  return row;
}

// Reproducible values in [-1, -0.05] ∪ [0.05, 1] (never zero): the re-rank tests assert that the
// low precision alone gets neighbours wrong on their data, so the data must not change per run.
inline std::vector<float> seeded_values(std::size_t n, unsigned seed) {
  std::mt19937 engine{seed};
  std::uniform_real_distribution<float> magnitude(0.05f, 1.0f);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> v(n);
  for (auto& x : v) x = negative(engine) ? -magnitude(engine) : magnitude(engine);
  return v;
}

// Corpus rows that crowd around the queries: rows [0, crowded_rows) are query i + spread × noise
// (noise uniform in [-1, 1]) for i = row mod nq, the rest are seeded_values. Around each query the
// distances then lie closer together than the low precision can tell apart.
inline std::vector<float> crowded_corpus(const std::vector<float>& qh, std::size_t nq,
                                         std::size_t n, std::size_t dim, std::size_t crowded_rows,
                                         float spread, unsigned seed) {
  std::vector<float> xh = seeded_values(n * dim, seed);
  std::mt19937 engine{seed + 1000};
  std::uniform_real_distribution<float> noise(-1.0f, 1.0f);
  for (std::size_t r = 0; r < crowded_rows && r < n; ++r)
    for (std::size_t c = 0; c < dim; ++c)
      xh[r * dim + c] = qh[(r % nq) * dim + c] + spread * noise(engine);
  return xh;
}

// The queries whose result (Q × k distances d and indices id) is not the exact kNN of the fp32
// data as a set, judged against fp64 with fp32's tie tolerance 2e-5: relative to the distance
// itself for L2 (the re-rank's direct form), to ‖q‖‖x‖ for inner product, absolute for cosine. A
// query misses on an invalid or repeated index, a row beyond the k-th reference distance + 2 ×
// slack, or a row clearly inside the k nearest left out; with `distances`, also on a distance off
// its fp64 value by more than the slack, rows out of ascending order, or a negative L2 / cosine.
inline std::size_t inexact_queries(const std::vector<float>& qh, const std::vector<float>& xh,
                                   std::size_t dim, std::size_t k, Metric metric,
                                   const std::vector<float>& d, const std::vector<std::int32_t>& id,
                                   bool distances) {
  std::size_t nq = qh.size() / dim, n = xh.size() / dim;
  return sum_over_queries(nq, [&](std::size_t i) -> std::size_t {
    ReferenceRow ref = reference_row(&qh[i * dim], xh, dim, k, metric);
    auto slack = [&](std::size_t j) {
      return 2e-5 * (metric == Metric::L2 ? ref.distance[j] : ref.scale[j]) + 1e-9;
    };
    std::set<std::int32_t> seen;
    bool bad = false;
    for (std::size_t r = 0; r < k && !bad; ++r) {
      std::int32_t j = id[i * k + r];
      float dist = d[i * k + r];
      bad = j < 0 || static_cast<std::size_t>(j) >= n || !seen.insert(j).second ||
            !(ref.distance[j] <= ref.kth + 2 * slack(j));
      if (!bad && distances)
        bad = !(std::abs(dist - ref.distance[j]) <= slack(j)) ||
              (r > 0 && !(d[i * k + r - 1] <= dist)) ||
              (metric != Metric::InnerProduct && dist < 0);
    }
    for (std::size_t j = 0; j < n && !bad; ++j)
      bad = ref.distance[j] < ref.kth - 2 * slack(j) && seen.count(static_cast<std::int32_t>(j)) == 0;
    return bad ? 1 : 0;
  });
}

}  // namespace gpupool::test
