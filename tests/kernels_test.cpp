// gpupool:kernels on a simulated device: every precision and metric against an fp64 reference,
// knn compared as sets with a tie tolerance, odd shapes, pytorch#42479, stream order, tiling
// within the pool's limit, NaN behaviour and every validation error. Small shapes: fast under
// ASan/TSan.
//
// Tolerances (|got − ref| ≤ tol × scale, scale = ‖q‖² + ‖x‖² for L2, ‖q‖‖x‖ for inner product,
// 1 for cosine), with the reference computed in fp64 from the ORIGINAL fp32 data, so the input
// rounding of each precision is part of the error:
//   fp32 2e-5 (fp32 accumulation over up to 1000 elements), fp16 2e-3 (11-bit mantissa),
//   bf16 1.6e-2 (8-bit mantissa), int8 2.5e-2 (per-row scale max|x|/127, step/2 per element).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>
import gpupool;
#include "support/knn_reference.hpp"
#include "support/convert_stored_check.hpp"
#include "support/upper_bounds_check.hpp"

using namespace gpupool;
using gpupool::test::crowded_corpus;
using gpupool::test::inexact_queries;
using gpupool::test::reference_distance;
using gpupool::test::reference_row;
using gpupool::test::seeded_values;

namespace {

constexpr Precision kInputPrecisions[] = {Precision::Fp32, Precision::Fp16, Precision::Bf16,
                                          Precision::Int8};
constexpr Metric kMetrics[] = {Metric::L2, Metric::InnerProduct, Metric::Cosine};
const float kNaN = std::numeric_limits<float>::quiet_NaN();

double tolerance(Precision p) {
  switch (p) {
    case Precision::Fp32: return 2e-5;
    case Precision::Fp16: return 2e-3;
    case Precision::Bf16: return 1.6e-2;
    case Precision::Int8: return 2.5e-2;
    default: return 0;
  }
}

std::mt19937& rng() {
  static std::mt19937 engine{std::random_device{}()};
  return engine;
}

// Fresh random values in [-1, -0.05] ∪ [0.05, 1]: never zero.
std::vector<float> random_values(std::size_t n) {
  std::uniform_real_distribution<float> magnitude(0.05f, 1.0f);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> v(n);
  for (auto& x : v) x = negative(rng()) ? -magnitude(rng()) : magnitude(rng());
  return v;
}

struct Ctx {
  Device device;
  GpuMemoryPool pool;
};

Ctx make_ctx(std::size_t capacity = 64 * MiB, bool deferred = false) {
  auto device = Device::simulated({.capacity = capacity, .deferred_streams = deferred,
                                   .worker_threads = 3});
  REQUIRE(device);
  return Ctx{*device, GpuMemoryPool{}};
}

ManagedBuffer fp32_buffer(Ctx& c, const std::vector<float>& host) {
  auto b = c.pool.get_managed_buffer(c.device, host.size(), Precision::Fp32);
  REQUIRE(b);
  REQUIRE(b->upload(std::span<const float>(host)));
  return std::move(*b);
}

// A buffer of `n` fp32 NaNs: outputs are poisoned before every run.
ManagedBuffer poisoned(Ctx& c, std::size_t n) { return fp32_buffer(c, std::vector<float>(n, kNaN)); }

// Makes the pool's next allocations of these sizes come back poisoned (all bits set: NaN for
// fp32, -1 for int32), by caching blocks full of it.
void poison_cache(Ctx& c, std::size_t floats, std::size_t index_bytes) {
  auto d = c.pool.get_managed_buffer(c.device, floats, Precision::Fp32);
  auto i = c.pool.get_managed_buffer(c.device, index_bytes, Precision::Bytes);
  REQUIRE(d);
  REQUIRE(i);
  std::vector<std::byte> ones(std::max(floats * 4, index_bytes), std::byte{0xff});
  REQUIRE(d->upload(std::span<const std::byte>(ones.data(), floats * 4)));
  REQUIRE(i->upload(std::span<const std::byte>(ones.data(), index_bytes)));
}

struct Input {
  ManagedBuffer data;
  std::optional<ManagedBuffer> scales;  // int8 only
  const ManagedBuffer* scales_ptr() const { return scales ? &*scales : nullptr; }
};

Input make_input(Ctx& c, const std::vector<float>& host, std::size_t dim, Precision p) {
  Input in;
  switch (p) {
    case Precision::Fp32: in.data = fp32_buffer(c, host); break;
    case Precision::Fp16: {
      std::vector<Half> h;
      for (float v : host) h.push_back(to_half(v));
      auto b = c.pool.get_managed_buffer(c.device, h.size(), p);
      REQUIRE(b);
      REQUIRE(b->upload(std::span<const Half>(h)));
      in.data = std::move(*b);
      break;
    }
    case Precision::Bf16: {
      std::vector<BFloat16> h;
      for (float v : host) h.push_back(to_bfloat16(v));
      auto b = c.pool.get_managed_buffer(c.device, h.size(), p);
      REQUIRE(b);
      REQUIRE(b->upload(std::span<const BFloat16>(h)));
      in.data = std::move(*b);
      break;
    }
    case Precision::Int8: {
      ManagedBuffer source = fp32_buffer(c, host);
      auto q = c.pool.get_managed_buffer(c.device, host.size(), Precision::Int8);
      auto s = c.pool.get_managed_buffer(c.device, host.size() / dim, Precision::Fp32);
      REQUIRE(q);
      REQUIRE(s);
      auto ok = convert(source, *q, {.dim = dim, .scales = &*s});
      REQUIRE(ok);
      in.data = std::move(*q);
      in.scales = std::move(*s);
      break;
    }
    default: FAIL("not an input precision");
  }
  return in;
}

struct Shape {
  std::size_t nq, n, dim;
};

DistanceOptions options_for(std::size_t dim, Metric metric, const Input& q, const Input& x) {
  return DistanceOptions{.dim = dim, .metric = metric, .mode = ComputeMode::Fp32Accurate,
                         .query_scales = q.scales_ptr(), .corpus_scales = x.scales_ptr()};
}

void check_distances(Ctx& c, Shape s, Precision p, Metric metric) {
  INFO("precision " << to_string(p) << ", metric " << to_string(metric) << ", nq " << s.nq
                    << ", n " << s.n << ", dim " << s.dim);
  auto qh = random_values(s.nq * s.dim), xh = random_values(s.n * s.dim);
  Input q = make_input(c, qh, s.dim, p), x = make_input(c, xh, s.dim, p);
  ManagedBuffer out = poisoned(c, s.nq * s.n);
  auto ok = l2_distance(q.data, x.data, out, options_for(s.dim, metric, q, x));
  REQUIRE(ok);
  auto got = out.to_host<float>();
  REQUIRE(got);
  double tol = tolerance(p);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < s.nq; ++i)
    for (std::size_t j = 0; j < s.n; ++j) {
      const float* qr = qh.data() + i * s.dim;
      const float* xr = xh.data() + j * s.dim;
      double scale;
      double ref = reference_distance(qr, xr, s.dim, metric, &scale);
      double g = (*got)[i * s.n + j];
      double limit = tol * scale + 1e-6;
      if (!(std::abs(g - ref) <= limit)) {
        if (bad++ < 5) {
          UNSCOPED_INFO("(" << i << ", " << j << "): got " << g << ", fp64 " << ref
                            << ", allowed ±" << limit);
        }
      }
      if (metric != Metric::InnerProduct && g < 0) ++bad;  // clamped at 0
    }
  CHECK(bad == 0);
}

// knn compared as sets: every returned index is within tolerance of the k-th reference distance,
// its distance matches the reference, rows ascend, no index repeats, and every corpus row clearly
// closer than the k-th reference distance was returned.
void check_knn(Ctx& c, Shape s, std::size_t k, Precision p, Metric metric) {
  INFO("precision " << to_string(p) << ", metric " << to_string(metric) << ", nq " << s.nq
                    << ", n " << s.n << ", dim " << s.dim << ", k " << k);
  auto qh = random_values(s.nq * s.dim), xh = random_values(s.n * s.dim);
  Input q = make_input(c, qh, s.dim, p), x = make_input(c, xh, s.dim, p);
  poison_cache(c, s.nq * k, s.nq * k * 4);
  auto result = knn(c.pool, q.data, x.data, k, options_for(s.dim, metric, q, x));
  REQUIRE(result);
  CHECK(result->queries == s.nq);
  CHECK(result->k == k);
  CHECK(result->path == KnnPath::Tiled);  // the simulated device has no fused filter
  CHECK(to_string(result->path) == "tiled");
  CHECK(result->distances.precision() == Precision::Fp32);
  CHECK(result->indices.precision() == Precision::Bytes);
  auto dist = result->distances.to_host<float>();
  auto idx = indices_to_host(result->indices);
  REQUIRE(dist);
  REQUIRE(idx);
  REQUIRE(dist->size() == s.nq * k);
  REQUIRE(idx->size() == s.nq * k);
  double tol = tolerance(p);
  for (std::size_t i = 0; i < s.nq; ++i) {
    auto reference = reference_row(qh.data() + i * s.dim, xh, s.dim, k, metric);
    const std::vector<double>& ref = reference.distance;
    double kth = reference.kth;
    std::vector<double> slack(s.n);
    for (std::size_t j = 0; j < s.n; ++j) slack[j] = tol * reference.scale[j] + 1e-6;
    std::set<std::int32_t> seen;
    for (std::size_t r = 0; r < k; ++r) {
      std::int32_t j = (*idx)[i * k + r];
      float d = (*dist)[i * k + r];
      INFO("query " << i << ", rank " << r << ": index " << j << ", distance " << d);
      REQUIRE(j >= 0);
      REQUIRE(static_cast<std::size_t>(j) < s.n);
      CHECK(seen.insert(j).second);
      CHECK(std::abs(d - ref[j]) <= slack[j]);
      CHECK(ref[j] <= kth + 2 * slack[j]);
      if (r > 0) CHECK((*dist)[i * k + r - 1] <= d);
      if (metric != Metric::InnerProduct) CHECK(d >= 0);
    }
    for (std::size_t j = 0; j < s.n; ++j)
      if (ref[j] < kth - 2 * slack[j]) {
        INFO("query " << i << ": corpus row " << j << " at " << ref[j] << " < k-th " << kth);
        CHECK(seen.count(static_cast<std::int32_t>(j)) == 1);
      }
  }
}

// ---- re-rank helpers ----

struct HostKnn {
  std::vector<float> d;
  std::vector<std::int32_t> i;
};

HostKnn run_knn(Ctx& c, const ManagedBuffer& q, const ManagedBuffer& x, std::size_t k,
                const DistanceOptions& o, std::size_t nq) {
  poison_cache(c, nq * k, nq * k * 4);
  auto r = knn(c.pool, q, x, k, o);
  REQUIRE(r);
  auto d = r->distances.to_host<float>();
  auto i = indices_to_host(r->indices);
  REQUIRE(d);
  REQUIRE(i);
  REQUIRE(d->size() == nq * k);
  REQUIRE(i->size() == nq * k);
  return {std::move(*d), std::move(*i)};
}


DistanceOptions rerank_options(std::size_t dim, Metric metric, const Input& q, const Input& x,
                               const ManagedBuffer& q32, const ManagedBuffer& x32,
                               std::size_t candidates = 0) {
  DistanceOptions o = options_for(dim, metric, q, x);
  o.rerank = {.queries = &q32, .corpus = &x32, .candidates = candidates};
  return o;
}

// Re-ranked low-precision knn against the exact kNN; returns how many queries the low precision
// alone got wrong (as index sets). On the simulated device the re-rank computes distances as the
// fp32 kernels do, so whenever every true neighbour is a candidate (always when C = N) the result
// is the fp32 knn's, bit for bit: `same_as_fp32` asserts that.
std::size_t check_rerank(Ctx& c, Shape s, std::size_t k, Precision p, Metric metric, unsigned seed,
                         std::size_t candidates = 0, bool same_as_fp32 = true,
                         float spread = 0.0f) {
  INFO("precision " << to_string(p) << ", metric " << to_string(metric) << ", nq " << s.nq
                    << ", n " << s.n << ", dim " << s.dim << ", k " << k << ", candidates "
                    << candidates << ", spread " << spread);
  auto qh = seeded_values(s.nq * s.dim, seed);
  auto xh = spread > 0 ? crowded_corpus(qh, s.nq, s.n, s.dim, s.nq * (s.n / (2 * s.nq)), spread,
                                        seed + 1)
                       : seeded_values(s.n * s.dim, seed + 1);
  Input q = make_input(c, qh, s.dim, p), x = make_input(c, xh, s.dim, p);
  ManagedBuffer q32 = fp32_buffer(c, qh), x32 = fp32_buffer(c, xh);
  HostKnn plain = run_knn(c, q.data, x.data, k, options_for(s.dim, metric, q, x), s.nq);
  HostKnn reranked = run_knn(c, q.data, x.data, k,
                             rerank_options(s.dim, metric, q, x, q32, x32, candidates), s.nq);
  CHECK(inexact_queries(qh, xh, s.dim, k, metric, reranked.d, reranked.i, /*distances=*/true) == 0);
  if (same_as_fp32) {
    HostKnn exact = run_knn(c, q32, x32, k, {.dim = s.dim, .metric = metric}, s.nq);
    CHECK(reranked.i == exact.i);
    CHECK(reranked.d == exact.d);
  }
  return inexact_queries(qh, xh, s.dim, k, metric, plain.d, plain.i, /*distances=*/false);
}

template <class T>
void check_invalid(const Result<T>& r, std::initializer_list<const char*> fragments) {
  REQUIRE_FALSE(r);
  CHECK(r.error().kind() == ErrorKind::InvalidInput);
  for (const char* f : fragments) CHECK_THAT(r.error().message(), Catch::Contains(f));
}

}  // namespace

TEST_CASE("distances match fp64 for every precision and metric", "[kernels]") {
  Ctx c = make_ctx();
  for (Precision p : kInputPrecisions)
    for (Metric m : kMetrics) check_distances(c, {7, 19, 37}, p, m);
}

TEST_CASE("distances on odd shapes", "[kernels]") {
  Ctx c = make_ctx();
  for (Shape s : {Shape{1, 1, 1}, Shape{1, 5, 1}, Shape{3, 2, 9}, Shape{2, 65, 17},
                  Shape{17, 3, 15}, Shape{2, 3, 1000}})
    for (Precision p : kInputPrecisions) check_distances(c, s, p, Metric::L2);
  check_distances(c, {2, 3, 1000}, Precision::Fp32, Metric::Cosine);
  check_distances(c, {2, 3, 1000}, Precision::Fp32, Metric::InnerProduct);
}

TEST_CASE("the pool overload allocates a Q×N fp32 result", "[kernels]") {
  Ctx c = make_ctx();
  auto qh = random_values(4 * 6), xh = random_values(9 * 6);
  ManagedBuffer q = fp32_buffer(c, qh), x = fp32_buffer(c, xh);
  auto out = l2_distance(c.pool, q, x, {.dim = 6});
  REQUIRE(out);
  CHECK(out->precision() == Precision::Fp32);
  CHECK(out->element_count() == 4 * 9);
  auto got = out->to_host<float>();
  REQUIRE(got);
  for (std::size_t i = 0; i < 4; ++i)
    for (std::size_t j = 0; j < 9; ++j)
      CHECK((*got)[i * 9 + j] ==
            Approx(reference_distance(&qh[i * 6], &xh[j * 6], 6, Metric::L2)).epsilon(2e-5));
}

TEST_CASE("fp32-accurate L2 is exact for pytorch#42479", "[kernels]") {
  Ctx c = make_ctx();
  ManagedBuffer q = fp32_buffer(c, {512695.0f}), x = fp32_buffer(c, {512804.0f, 512695.0f});
  ManagedBuffer out = poisoned(c, 2);
  for (ComputeMode mode : {ComputeMode::Fp32Accurate, ComputeMode::Tf32}) {
    REQUIRE(l2_distance(q, x, out, {.dim = 1, .mode = mode}));
    auto got = out.to_host<float>();
    REQUIRE(got);
    CHECK((*got)[0] == 11881.0f);
    CHECK((*got)[1] == 0.0f);
  }
  auto nn = knn(c.pool, q, x, 2, {.dim = 1});
  REQUIRE(nn);
  CHECK(*nn->distances.to_host<float>() == std::vector<float>{0.0f, 11881.0f});
  CHECK(*indices_to_host(nn->indices) == std::vector<std::int32_t>{1, 0});
}

TEST_CASE("knn matches fp64 as sets for every precision and metric", "[kernels]") {
  Ctx c = make_ctx();
  for (Precision p : kInputPrecisions)
    for (Metric m : kMetrics) check_knn(c, {5, 300, 24}, 10, p, m);
}

// The simulated device computes its distances directly and reads no norms: given corpus norms
// (row_norms') are accepted and leave the result as it was, bit for bit.
TEST_CASE("knn takes the corpus norms row_norms wrote", "[kernels]") {
  Ctx c = make_ctx();
  const std::size_t nq = 3, n = 200, dim = 24, k = 10;
  auto q = fp32_buffer(c, random_values(nq * dim)), x = fp32_buffer(c, random_values(n * dim));
  auto norms = poisoned(c, n);
  REQUIRE(row_norms(x, norms, dim));
  for (Metric m : kMetrics) {
    INFO(to_string(m));
    auto plain = knn(c.pool, q, x, k, {.dim = dim, .metric = m});
    auto given = knn(c.pool, q, x, k, {.dim = dim, .metric = m, .corpus_norms = &norms});
    REQUIRE(plain);
    REQUIRE(given);
    CHECK(*given->distances.to_host<float>() == *plain->distances.to_host<float>());
    CHECK(*indices_to_host(given->indices) == *indices_to_host(plain->indices));
  }
}

TEST_CASE("knn on odd shapes", "[kernels]") {
  Ctx c = make_ctx();
  check_knn(c, {1, 1, 1}, 1, Precision::Fp32, Metric::L2);
  check_knn(c, {1, 40, 1}, 40, Precision::Fp32, Metric::L2);  // k = N
  check_knn(c, {3, 50, 13}, 1, Precision::Fp16, Metric::L2);
  check_knn(c, {2, 20, 1000}, 7, Precision::Fp32, Metric::L2);
  check_knn(c, {33, 700, 5}, 64, Precision::Bf16, Metric::Cosine);
  check_knn(c, {2, 1100, 3}, 1024, Precision::Fp32, Metric::L2);  // k = kMaxK
}

TEST_CASE("knn breaks ties by the smaller index", "[kernels]") {
  Ctx c = make_ctx();
  std::size_t dim = 3;
  auto q = random_values(dim);
  auto corpus = random_values(12 * dim);
  for (std::size_t row : {9u, 3u, 7u, 11u})  // exact copies of the query
    std::copy(q.begin(), q.end(), corpus.begin() + row * dim);
  ManagedBuffer qb = fp32_buffer(c, q), xb = fp32_buffer(c, corpus);
  auto nn = knn(c.pool, qb, xb, 3, {.dim = dim});
  REQUIRE(nn);
  CHECK(*nn->distances.to_host<float>() == std::vector<float>{0, 0, 0});
  CHECK(*indices_to_host(nn->indices) == std::vector<std::int32_t>{3, 7, 9});
}

TEST_CASE("knn tiles the corpus within the pool's limit", "[kernels]") {
  Ctx c = make_ctx();
  std::size_t nq = 64, n = 4096, dim = 4, k = 5;
  auto qh = random_values(nq * dim), xh = random_values(n * dim);
  ManagedBuffer q = fp32_buffer(c, qh), x = fp32_buffer(c, xh);
  // Q×N fp32 would be 1 MiB; the pool may hold only 256 KiB in all.
  REQUIRE(c.pool.set_max_pool_size(c.device, 256 * KiB));
  c.pool.reset_peaks(c.device);
  auto nn = knn(c.pool, q, x, k, {.dim = dim});
  REQUIRE(nn);
  CHECK(c.pool.stats(c.device).peak_in_use_bytes <= 256 * KiB);
  auto dist = nn->distances.to_host<float>();
  auto idx = indices_to_host(nn->indices);
  REQUIRE(dist);
  REQUIRE(idx);
  for (std::size_t i = 0; i < nq; ++i) {
    std::vector<std::pair<double, std::int32_t>> ref;
    for (std::size_t j = 0; j < n; ++j)
      ref.emplace_back(reference_distance(&qh[i * dim], &xh[j * dim], dim, Metric::L2),
                       static_cast<std::int32_t>(j));
    std::partial_sort(ref.begin(), ref.begin() + k, ref.end());
    for (std::size_t r = 0; r < k; ++r)
      CHECK((*dist)[i * k + r] == Approx(ref[r].first).epsilon(1e-5).margin(1e-6));
  }
}

TEST_CASE("NaN distances sort last and propagate", "[kernels]") {
  Ctx c = make_ctx();
  std::size_t dim = 4;
  auto qh = random_values(dim), xh = random_values(5 * dim);
  xh[2 * dim + 1] = kNaN;
  ManagedBuffer q = fp32_buffer(c, qh), x = fp32_buffer(c, xh);
  for (Metric m : kMetrics) {
    ManagedBuffer out = poisoned(c, 5);
    REQUIRE(l2_distance(q, x, out, {.dim = dim, .metric = m}));
    auto got = *out.to_host<float>();
    for (std::size_t j = 0; j < 5; ++j) CHECK(std::isnan(got[j]) == (j == 2));
    auto nn = knn(c.pool, q, x, 5, {.dim = dim, .metric = m});
    REQUIRE(nn);
    auto d = *nn->distances.to_host<float>();
    auto i = *indices_to_host(nn->indices);
    CHECK(std::isnan(d[4]));
    CHECK(i[4] == 2);
  }
}

TEST_CASE("knn's upper bounds cut each list at its query's bound", "[kernels]") {
  Ctx c = make_ctx();
  const Shape s{9, 300, 12};
  for (Precision p : kInputPrecisions)
    for (Metric m : kMetrics) {
      CAPTURE(to_string(p), to_string(m));
      auto qh = random_values(s.nq * s.dim), xh = random_values(s.n * s.dim);
      Input q = make_input(c, qh, s.dim, p), x = make_input(c, xh, s.dim, p);
      CHECK(gpupool::test::check_upper_bounds(c.pool, c.device, q.data, x.data, 10,
                                              options_for(s.dim, m, q, x), s.nq) > 0);
    }
}

TEST_CASE("knn's upper bounds apply to the re-ranked result", "[kernels][rerank]") {
  Ctx c = make_ctx();
  const Shape s{8, 400, 16};
  auto qh = random_values(s.nq * s.dim), xh = random_values(s.n * s.dim);
  Input q = make_input(c, qh, s.dim, Precision::Fp16), x = make_input(c, xh, s.dim, Precision::Fp16);
  ManagedBuffer q32 = fp32_buffer(c, qh), x32 = fp32_buffer(c, xh);
  CHECK(gpupool::test::check_upper_bounds(
            c.pool, c.device, q.data, x.data, 5,
            rerank_options(s.dim, Metric::L2, q, x, q32, x32), s.nq) > 0);
}

TEST_CASE("knn's upper bounds leave out NaN distances", "[kernels]") {
  Ctx c = make_ctx();
  std::size_t dim = 4;
  auto qh = random_values(dim), xh = random_values(5 * dim);
  xh[2 * dim + 1] = kNaN;
  ManagedBuffer q = fp32_buffer(c, qh), x = fp32_buffer(c, xh);
  const std::vector<float> none{std::numeric_limits<float>::infinity()};
  auto nn = knn(c.pool, q, x, 5, {.dim = dim, .upper_bounds = none});
  REQUIRE(nn);
  auto d = *nn->distances.to_host<float>();
  auto i = *indices_to_host(nn->indices);
  for (std::size_t r = 0; r < 4; ++r) CHECK(i[r] != 2);
  CHECK(i[4] == -1);
  CHECK(std::isnan(d[4]));
}

TEST_CASE("work is ordered after inputs on other streams", "[kernels]") {
  Ctx c = make_ctx(64 * MiB, /*deferred=*/true);
  std::size_t dim = 5, nq = 3, n = 8;
  auto qh = random_values(nq * dim), xh = random_values(n * dim);
  ManagedBuffer q = fp32_buffer(c, qh), x = fp32_buffer(c, xh);
  auto stream = c.device.create_stream();
  REQUIRE(stream);
  auto out = c.pool.get_managed_buffer(c.device, nq * n, Precision::Fp32, *stream);
  REQUIRE(out);
  REQUIRE(out->upload(std::span<const float>(std::vector<float>(nq * n, kNaN))));
  REQUIRE(l2_distance(q, x, *out, {.dim = dim}));
  auto got = out->to_host<float>();  // synchronizes the out stream only
  REQUIRE(got);
  for (std::size_t i = 0; i < nq; ++i)
    for (std::size_t j = 0; j < n; ++j)
      CHECK((*got)[i * n + j] ==
            Approx(reference_distance(&qh[i * dim], &xh[j * dim], dim, Metric::L2)).epsilon(2e-5));
  auto nn = knn(c.pool, q, x, 2, {.dim = dim});
  REQUIRE(nn);
  CHECK(nn->distances.to_host<float>()->size() == nq * 2);
}

TEST_CASE("re-ranked knn is the exact fp32 knn where the low precision alone is not",
          "[kernels][rerank]") {
  Ctx c = make_ctx();
  // Data on which each precision alone misses neighbours beyond fp32's tie tolerance, found by
  // trying spreads: rows crowded around each query (crowded_corpus) for L2 and inner product,
  // closer for fp16 than for bf16 / int8 (too close and the true neighbours are no longer among
  // the low precision's top C); for cosine the tolerance is absolute (2e-5) and fp16's error about
  // 1e-5, so fp16 needs many queries in 64 dimensions (where random cosines crowd around 1).
  struct Case {
    Precision p;
    Metric m;
    Shape s;
    float spread;  // 0: plain seeded_values
  };
  const Shape crowd{32, 4000, 20};
  for (Case t : {Case{Precision::Fp16, Metric::L2, crowd, 0.01f},
                 Case{Precision::Fp16, Metric::InnerProduct, crowd, 0.01f},
                 Case{Precision::Fp16, Metric::Cosine, {256, 4000, 64}, 0.0f},
                 Case{Precision::Bf16, Metric::L2, crowd, 0.03f},
                 Case{Precision::Bf16, Metric::InnerProduct, crowd, 0.03f},
                 Case{Precision::Bf16, Metric::Cosine, crowd, 0.1f},
                 Case{Precision::Int8, Metric::L2, crowd, 0.03f},
                 Case{Precision::Int8, Metric::InnerProduct, crowd, 0.03f},
                 Case{Precision::Int8, Metric::Cosine, crowd, 0.1f}}) {
    std::size_t wrong = check_rerank(c, t.s, 10, t.p, t.m, 42, 0, true, t.spread);
    INFO(to_string(t.p) << " " << to_string(t.m) << ": " << wrong << " of " << t.s.nq
                        << " queries wrong without re-rank");
    CHECK(wrong >= 1);  // so the re-rank had something to correct
  }
}

TEST_CASE("re-ranked knn on odd shapes", "[kernels][rerank]") {
  Ctx c = make_ctx();
  for (Precision p : {Precision::Fp16, Precision::Bf16, Precision::Int8}) {
    check_rerank(c, {1, 500, 16}, 5, p, Metric::L2, 7);        // one query
    check_rerank(c, {4, 30, 12}, 10, p, Metric::L2, 8);        // N = 30 < C = 42: all re-ranked
    check_rerank(c, {3, 200, 1}, 4, p, Metric::L2, 9);         // D = 1
    check_rerank(c, {5, 300, 13}, 7, p, Metric::Cosine, 10);   // D not a multiple of 8
    check_rerank(c, {2, 40, 37}, 40, p, Metric::InnerProduct, 11);  // k = N
  }
  check_rerank(c, {3, 1100, 3}, 512, Precision::Bf16, Metric::L2, 12);  // C = 2k = kMaxK
}

TEST_CASE("re-rank candidates: explicit, capped at N, or just k", "[kernels][rerank]") {
  Ctx c = make_ctx();
  // More candidates than rows: capped at N, every row re-ranked, so always the exact result.
  check_rerank(c, {6, 300, 8}, 10, Precision::Bf16, Metric::L2, 21, /*candidates=*/1024);
  check_rerank(c, {6, 300, 8}, 10, Precision::Int8, Metric::Cosine, 22, /*candidates=*/64);
  // C = k: the low precision's own k rows, re-ordered by their exact distances.
  Shape s{8, 400, 10};
  std::size_t k = 6;
  auto qh = seeded_values(s.nq * s.dim, 23), xh = seeded_values(s.n * s.dim, 24);
  Input q = make_input(c, qh, s.dim, Precision::Bf16), x = make_input(c, xh, s.dim, Precision::Bf16);
  ManagedBuffer q32 = fp32_buffer(c, qh), x32 = fp32_buffer(c, xh);
  HostKnn plain = run_knn(c, q.data, x.data, k, options_for(s.dim, Metric::L2, q, x), s.nq);
  HostKnn reranked =
      run_knn(c, q.data, x.data, k, rerank_options(s.dim, Metric::L2, q, x, q32, x32, k), s.nq);
  ManagedBuffer all = poisoned(c, s.nq * s.n);
  REQUIRE(l2_distance(q32, x32, all, {.dim = s.dim}));
  auto exact = *all.to_host<float>();
  for (std::size_t i = 0; i < s.nq; ++i) {
    std::set<std::int32_t> a(plain.i.begin() + i * k, plain.i.begin() + (i + 1) * k);
    std::set<std::int32_t> b(reranked.i.begin() + i * k, reranked.i.begin() + (i + 1) * k);
    CHECK(a == b);
    for (std::size_t r = 0; r < k; ++r) {
      CHECK(reranked.d[i * k + r] == exact[i * s.n + reranked.i[i * k + r]]);
      if (r > 0) CHECK(reranked.d[i * k + r - 1] <= reranked.d[i * k + r]);
    }
  }
}

TEST_CASE("re-rank separates rows the low precision cannot, ties by index", "[kernels][rerank]") {
  Ctx c = make_ctx();
  std::size_t dim = 8;
  auto qh = seeded_values(dim, 31), xh = seeded_values(12 * dim, 32);
  qh[0] = 0.5f;
  for (std::size_t row : {9u, 3u, 7u}) std::copy(qh.begin(), qh.end(), xh.begin() + row * dim);
  // Row 1 differs from the query by 2^-12 in one element: below half a bf16 step at 0.5 (2^-9),
  // so in bf16 it is a fourth exact copy, and the one with the smallest index.
  std::copy(qh.begin(), qh.end(), xh.begin() + 1 * dim);
  xh[1 * dim] = 0.5f + 0x1p-12f;
  Input q = make_input(c, qh, dim, Precision::Bf16), x = make_input(c, xh, dim, Precision::Bf16);
  ManagedBuffer q32 = fp32_buffer(c, qh), x32 = fp32_buffer(c, xh);
  HostKnn plain = run_knn(c, q.data, x.data, 3, options_for(dim, Metric::L2, q, x), 1);
  CHECK(plain.i == std::vector<std::int32_t>{1, 3, 7});
  CHECK(plain.d == std::vector<float>{0, 0, 0});
  HostKnn reranked =
      run_knn(c, q.data, x.data, 3, rerank_options(dim, Metric::L2, q, x, q32, x32), 1);
  CHECK(reranked.i == std::vector<std::int32_t>{3, 7, 9});
  CHECK(reranked.d == std::vector<float>{0, 0, 0});
  HostKnn four = run_knn(c, q.data, x.data, 4, rerank_options(dim, Metric::L2, q, x, q32, x32), 1);
  CHECK(four.i == std::vector<std::int32_t>{3, 7, 9, 1});
  CHECK(four.d[3] == 0x1p-24f);  // (2^-12)^2, exact in fp32
}

TEST_CASE("re-rank waits for originals on other streams", "[kernels][rerank]") {
  Ctx c = make_ctx(64 * MiB, /*deferred=*/true);
  Shape s{3, 100, 6};
  auto qh = seeded_values(s.nq * s.dim, 41), xh = seeded_values(s.n * s.dim, 42);
  Input q = make_input(c, qh, s.dim, Precision::Fp16), x = make_input(c, xh, s.dim, Precision::Fp16);
  auto stream = c.device.create_stream();
  REQUIRE(stream);
  auto x32 = c.pool.get_managed_buffer(c.device, xh.size(), Precision::Fp32, *stream);
  REQUIRE(x32);
  REQUIRE(x32->upload(std::span<const float>(xh)));
  ManagedBuffer q32 = fp32_buffer(c, qh);
  HostKnn reranked =
      run_knn(c, q.data, x.data, 4, rerank_options(s.dim, Metric::L2, q, x, q32, *x32), s.nq);
  CHECK(inexact_queries(qh, xh, s.dim, 4, Metric::L2, reranked.d, reranked.i, true) == 0);
}

TEST_CASE("every bad re-rank argument is an InvalidInput naming it", "[kernels][rerank]") {
  Ctx c = make_ctx();
  Ctx other = make_ctx();
  auto qh = random_values(12), xh = random_values(20);  // 3 × 4 and 5 × 4
  Input q = make_input(c, qh, 4, Precision::Bf16), x = make_input(c, xh, 4, Precision::Bf16);
  ManagedBuffer q32 = fp32_buffer(c, qh), x32 = fp32_buffer(c, xh);
  ManagedBuffer short32 = fp32_buffer(c, random_values(8));
  ManagedBuffer foreign = fp32_buffer(other, xh);
  auto x16 = c.pool.get_managed_buffer(c.device, 20, Precision::Fp16);
  REQUIRE(x16);
  ManagedBuffer empty;
  auto with = [&](RerankOptions r) {
    DistanceOptions o{.dim = 4};
    o.rerank = r;
    return o;
  };

  check_invalid(knn(c.pool, q32, x32, 3, with({.queries = &q32, .corpus = &x32})),
                {"rerank.queries given for fp32 inputs", "fp16, bf16 or int8"});
  check_invalid(knn(c.pool, q32, x32, 3, with({.candidates = 9})),
                {"rerank.candidates = 9 given for fp32 inputs"});
  check_invalid(knn(c.pool, q.data, x.data, 3, with({.candidates = 9})),
                {"rerank.candidates = 9", "rerank.queries and rerank.corpus are missing"});
  check_invalid(knn(c.pool, q.data, x.data, 3, with({.queries = &q32})),
                {"rerank.corpus is missing", "both"});
  check_invalid(knn(c.pool, q.data, x.data, 3, with({.corpus = &x32})),
                {"rerank.queries is missing", "both"});
  check_invalid(knn(c.pool, q.data, x.data, 3, with({.queries = &empty, .corpus = &x32})),
                {"rerank.queries", "empty"});
  check_invalid(knn(c.pool, q.data, x.data, 3, with({.queries = &q32, .corpus = &*x16})),
                {"rerank.corpus is fp16", "expected fp32"});
  check_invalid(knn(c.pool, q.data, x.data, 3, with({.queries = &short32, .corpus = &x32})),
                {"rerank.queries holds 8 elements", "expected 12 = 3 rows × dim 4", "queries"});
  check_invalid(knn(c.pool, q.data, x.data, 3, with({.queries = &q32, .corpus = &q32})),
                {"rerank.corpus holds 12 elements", "expected 20 = 5 rows × dim 4", "corpus"});
  check_invalid(knn(c.pool, q.data, x.data, 3, with({.queries = &q32, .corpus = &foreign})),
                {"rerank.corpus is on device", "expected both on one device"});
  check_invalid(knn(c.pool, q.data, x.data, 3, with({.queries = &q32, .corpus = &x32, .candidates = 2})),
                {"rerank.candidates = 2", "expected k = 3 .. 1024"});
  check_invalid(knn(c.pool, q.data, x.data, 3,
                    with({.queries = &q32, .corpus = &x32, .candidates = 1025})),
                {"rerank.candidates = 1025", "expected k = 3 .. 1024"});
  ManagedBuffer out = poisoned(c, 15);
  check_invalid(l2_distance(q.data, x.data, out, with({.queries = &q32, .corpus = &x32})),
                {"l2_distance", "rerank.queries given", "only for knn"});
  check_invalid(l2_distance(c.pool, q.data, x.data, with({.candidates = 5})),
                {"l2_distance", "rerank.candidates = 5 given", "only for knn"});
  // A valid re-rank still works beside all of that.
  CHECK(knn(c.pool, q.data, x.data, 3, with({.queries = &q32, .corpus = &x32, .candidates = 5})));
  CHECK(default_rerank_candidates(10, 5000) == 42);
  CHECK(default_rerank_candidates(100, 5000) == 200);
  CHECK(default_rerank_candidates(1000, 5000) == 1024);
  CHECK(default_rerank_candidates(10, 30) == 30);
}

TEST_CASE("row_norms match fp64", "[kernels]") {
  Ctx c = make_ctx();
  for (Precision p : kInputPrecisions) {
    INFO(to_string(p));
    std::size_t rows = 9, dim = 21;
    auto h = random_values(rows * dim);
    Input in = make_input(c, h, dim, p);
    ManagedBuffer out = poisoned(c, rows);
    REQUIRE(row_norms(in.data, out, dim, in.scales_ptr()));
    auto got = *out.to_host<float>();
    for (std::size_t r = 0; r < rows; ++r) {
      double ref = 0;
      for (std::size_t i = 0; i < dim; ++i) ref += double(h[r * dim + i]) * h[r * dim + i];
      CHECK(std::abs(got[r] - ref) <= 2 * tolerance(p) * ref);
    }
  }
}

TEST_CASE("convert round-trips within each precision's rounding", "[kernels]") {
  Ctx c = make_ctx();
  std::size_t rows = 6, dim = 11;
  auto h = random_values(rows * dim);
  h[5 * dim + 3] = kNaN;  // row 5 holds a NaN
  ManagedBuffer src = fp32_buffer(c, h);
  for (Precision p : {Precision::Fp16, Precision::Bf16, Precision::Int8}) {
    INFO(to_string(p));
    auto mid = c.pool.get_managed_buffer(c.device, h.size(), p);
    auto scales = c.pool.get_managed_buffer(c.device, rows, Precision::Fp32);
    REQUIRE(mid);
    REQUIRE(scales);
    ManagedBuffer* s = p == Precision::Int8 ? &*scales : nullptr;
    REQUIRE(convert(src, *mid, {.dim = dim, .scales = s}));
    ManagedBuffer back = poisoned(c, h.size());
    REQUIRE(convert(*mid, back, {.dim = dim, .scales = s}));
    auto got = *back.to_host<float>();
    std::vector<float> sc = p == Precision::Int8 ? *scales->to_host<float>() : std::vector<float>{};
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t i = 0; i < dim; ++i) {
        float v = h[r * dim + i], g = got[r * dim + i];
        if (p == Precision::Int8 && r == 5) {
          CHECK(std::isnan(sc[r]));
          CHECK(std::isnan(g));
        } else if (std::isnan(v)) {
          CHECK(std::isnan(g));
        } else if (p == Precision::Fp16) {
          CHECK(g == to_float(to_half(v)));
          CHECK(std::abs(g - v) <= std::abs(v) * 0x1p-11f);
        } else if (p == Precision::Bf16) {
          CHECK(g == to_float(to_bfloat16(v)));
          CHECK(std::abs(g - v) <= std::abs(v) * 0x1p-8f);
        } else {
          CHECK(std::abs(g - v) <= sc[r] * 0.5001f);
        }
      }
  }
  CHECK(to_float(to_half(70000.0f)) == std::numeric_limits<float>::infinity());
  CHECK(to_float(to_half(1.0f)) == 1.0f);
  CHECK(to_float(to_bfloat16(-2.5f)) == -2.5f);
}

TEST_CASE("convert_stored turns stored values into the kernels' forms exactly", "[kernels]") {
  Ctx c = make_ctx();
  gpupool::test::check_convert_stored(c.pool, c.device);
}

TEST_CASE("merge_topk merges partial lists like one knn", "[kernels]") {
  Ctx c = make_ctx();
  std::size_t nq = 4, lists = 3, len = 6, k = 8;
  std::vector<float> d(nq * lists * len);
  std::vector<std::int32_t> idx(d.size());
  std::uniform_real_distribution<float> u(0.1f, 10.0f);
  for (std::size_t i = 0; i < d.size(); ++i) {
    d[i] = u(rng());
    idx[i] = static_cast<std::int32_t>(i % (lists * len));
  }
  d[1] = d[2];  // a tie: index 1 before index 2
  idx[lists * len + 4] = -1;  // an empty slot in query 1
  ManagedBuffer db = fp32_buffer(c, d);
  auto ib = c.pool.get_managed_buffer(c.device, idx.size() * 4, Precision::Bytes);
  REQUIRE(ib);
  REQUIRE(ib->upload(std::as_bytes(std::span(idx))));
  poison_cache(c, nq * k, nq * k * 4);
  ManagedBuffer od = poisoned(c, nq * k);
  auto oi = c.pool.get_managed_buffer(c.device, nq * k * 4, Precision::Bytes);
  REQUIRE(oi);
  REQUIRE(merge_topk(db, *ib, od, *oi, {.queries = nq, .lists = lists, .list_length = len, .k = k}));
  auto gd = *od.to_host<float>();
  auto gi = *indices_to_host(*oi);
  for (std::size_t q = 0; q < nq; ++q) {
    std::vector<std::pair<float, std::int32_t>> all;
    for (std::size_t j = 0; j < lists * len; ++j)
      if (idx[q * lists * len + j] >= 0)
        all.emplace_back(d[q * lists * len + j], idx[q * lists * len + j]);
    std::sort(all.begin(), all.end());
    for (std::size_t r = 0; r < k; ++r) {
      CHECK(gd[q * k + r] == all[r].first);
      CHECK(gi[q * k + r] == all[r].second);
    }
  }
}

namespace {
// knn's order of (distance, index) entries: index -1 (empty) last, NaN after every number, then
// by distance, ties by the smaller index.
bool knn_order(const std::pair<float, std::int32_t>& a, const std::pair<float, std::int32_t>& b) {
  if ((a.second < 0) != (b.second < 0)) return b.second < 0;
  if (std::isnan(a.first) != std::isnan(b.first)) return std::isnan(b.first);
  if (a.first != b.first) return a.first < b.first;
  return a.second < b.second;
}
}  // namespace

// Two chunks of a corpus folded into running lists that start empty: the lists end as the k best
// of both, the second chunk's indices offset by its first row. Ties across chunks (the smaller
// index first), NaN candidates (after numbers), empty candidate slots (-1, never offset) and a
// query with fewer than k real candidates in all (its last slots stay empty).
TEST_CASE("fold_topk folds chunks' candidates into running lists like one knn", "[kernels]") {
  Ctx c = make_ctx();
  const std::size_t nq = 5, k = 8, per = 12;
  const std::int64_t offset = 1000;
  std::uniform_real_distribution<float> u(0.1f, 10.0f);
  std::vector<float> d1(nq * per), d2(nq * per);
  std::vector<std::int32_t> i1(nq * per), i2(nq * per);
  for (std::size_t j = 0; j < nq * per; ++j) {
    d1[j] = u(rng());
    d2[j] = u(rng());
    i1[j] = i2[j] = static_cast<std::int32_t>(j % per);
  }
  d2[3] = d1[0] = 0.05f;  // query 0: a tie, chunk 1's row 0 before chunk 2's row 1003
  d2[5] = kNaN;           // query 0: NaN after every number
  i2[per + 2] = -1;       // query 1: an empty slot, not offset
  for (std::size_t j = 0; j < per; ++j) {  // query 4: 2 + 3 real candidates, k = 8
    if (j >= 2) i1[4 * per + j] = -1;
    if (j >= 3) i2[4 * per + j] = -1;
  }
  auto indices = [&](const std::vector<std::int32_t>& v) {
    auto b = c.pool.get_managed_buffer(c.device, v.size() * 4, Precision::Bytes);
    REQUIRE(b);
    REQUIRE(b->upload(std::as_bytes(std::span(v))));
    return std::move(*b);
  };
  ManagedBuffer run_d = fp32_buffer(c, std::vector<float>(nq * k, kNaN));
  ManagedBuffer run_i = indices(std::vector<std::int32_t>(nq * k, -1));
  ManagedBuffer c1d = fp32_buffer(c, d1), c1i = indices(i1), c2d = fp32_buffer(c, d2),
                c2i = indices(i2);
  REQUIRE(fold_topk(c1d, c1i, run_d, run_i, {.queries = nq, .candidates = per, .k = k}));
  REQUIRE(fold_topk(c2d, c2i, run_d, run_i,
                    {.queries = nq, .candidates = per, .k = k, .index_offset = offset}));
  auto gd = *run_d.to_host<float>();
  auto gi = *indices_to_host(run_i);
  for (std::size_t q = 0; q < nq; ++q) {
    INFO("query " << q);
    std::vector<std::pair<float, std::int32_t>> all;
    for (std::size_t j = q * per; j < (q + 1) * per; ++j) {
      if (i1[j] >= 0) all.emplace_back(d1[j], i1[j]);
      if (i2[j] >= 0) all.emplace_back(d2[j], static_cast<std::int32_t>(i2[j] + offset));
    }
    std::sort(all.begin(), all.end(), knn_order);
    for (std::size_t r = 0; r < k; ++r) {
      INFO("rank " << r);
      if (r >= all.size()) {
        CHECK(gi[q * k + r] == -1);
        continue;
      }
      CHECK(gi[q * k + r] == all[r].second);
      if (std::isnan(all[r].first)) CHECK(std::isnan(gd[q * k + r]));
      else CHECK(gd[q * k + r] == all[r].first);
    }
  }
  CHECK(gi[0] == 0);
  CHECK(gi[1] == 1003);
  CHECK(gi[4 * k + 5] == -1);
}

TEST_CASE("every bad argument is an InvalidInput naming it", "[kernels]") {
  Ctx c = make_ctx();
  Ctx other = make_ctx();
  auto q = fp32_buffer(c, random_values(12));   // 3 × 4
  auto x = fp32_buffer(c, random_values(20));   // 5 × 4
  auto out = poisoned(c, 15);
  auto small = poisoned(c, 14);
  auto foreign = fp32_buffer(other, random_values(20));
  auto half = c.pool.get_managed_buffer(c.device, 20, Precision::Fp16);
  auto bytes = c.pool.get_managed_buffer(c.device, 20, Precision::Bytes);
  auto i8 = c.pool.get_managed_buffer(c.device, 20, Precision::Int8);
  REQUIRE(half);
  REQUIRE(bytes);
  REQUIRE(i8);
  ManagedBuffer empty;

  check_invalid(l2_distance(empty, x, out, {.dim = 4}), {"queries", "empty"});
  check_invalid(l2_distance(q, foreign, out, {.dim = 4}), {"corpus", "device"});
  check_invalid(l2_distance(q, x, out, {.dim = 0}), {"dim 0"});
  check_invalid(l2_distance(q, x, out, {.dim = 5}), {"queries", "12 elements", "dim 5"});
  check_invalid(l2_distance(q, x, small, {.dim = 4}), {"out", "too small", "14", "15"});
  check_invalid(l2_distance(q, *half, out, {.dim = 4}), {"corpus is fp16", "queries are fp32"});
  check_invalid(l2_distance(*bytes, *bytes, out, {.dim = 4}), {"bytes"});
  check_invalid(l2_distance(q, x, *half, {.dim = 4}), {"out is fp16", "expected fp32"});
  check_invalid(l2_distance(*i8, *i8, out, {.dim = 4}), {"query_scales", "missing"});
  check_invalid(l2_distance(q, x, out, {.dim = 4, .query_scales = &x}), {"query_scales", "int8"});
  check_invalid(l2_distance(q, x, out, {.dim = 4, .metric = static_cast<Metric>(9)}), {"metric 9"});
  check_invalid(l2_distance(c.pool, q, x, {.dim = 0}), {"dim 0"});

  check_invalid(knn(c.pool, q, x, 0, {.dim = 4}), {"k = 0", "1..1024"});
  check_invalid(knn(c.pool, q, x, 1025, {.dim = 4}), {"k = 1025"});
  check_invalid(knn(c.pool, q, x, 6, {.dim = 4}), {"k = 6", "larger than the corpus", "N = 5"});
  check_invalid(knn(c.pool, q, foreign, 1, {.dim = 4}), {"device"});
  const std::vector<float> two_bounds{1.0f, 2.0f}, nan_bound{1.0f, kNaN, 2.0f};
  check_invalid(knn(c.pool, q, x, 1, {.dim = 4, .upper_bounds = two_bounds}),
                {"upper_bounds", "2 values", "one per query, 3"});
  check_invalid(knn(c.pool, q, x, 1, {.dim = 4, .upper_bounds = nan_bound}),
                {"upper_bounds[1] is NaN"});
  check_invalid(l2_distance(q, x, out, {.dim = 4, .upper_bounds = two_bounds}),
                {"l2_distance", "upper_bounds", "only for knn"});
  auto four_norms = poisoned(c, 4);  // x has 5 rows
  check_invalid(knn(c.pool, q, x, 1, {.dim = 4, .corpus_norms = &four_norms}),
                {"corpus_norms", "too small", "4 elements", "one squared norm per corpus row"});
  check_invalid(knn(c.pool, q, x, 1, {.dim = 4, .corpus_norms = &*half}),
                {"corpus_norms is fp16", "expected fp32"});
  check_invalid(knn(c.pool, q, x, 1, {.dim = 4, .corpus_norms = &foreign}),
                {"corpus_norms", "device"});
  check_invalid(knn(c.pool, q, x, 1, {.dim = 4, .corpus_norms = &empty}),
                {"corpus_norms", "empty"});
  check_invalid(l2_distance(q, x, out, {.dim = 4, .corpus_norms = &out}),
                {"l2_distance", "corpus_norms", "only for knn"});

  check_invalid(row_norms(q, small, 5), {"vectors", "12 elements", "not a multiple of dim 5"});
  auto norms1 = poisoned(c, 2);
  check_invalid(row_norms(q, norms1, 4), {"out", "too small", "3"});
  check_invalid(row_norms(*i8, out, 4), {"scales", "missing"});

  check_invalid(convert(*half, *bytes, {.dim = 4}), {"fp16 → bytes"});
  check_invalid(convert(x, *i8, {.dim = 4}), {"scales", "missing"});
  check_invalid(convert(x, *half, {.dim = 4, .scales = &out}), {"scales given"});
  check_invalid(convert(x, *half, {.dim = 3}), {"in holds 20 elements", "not a multiple of dim 3"});

  auto idx = c.pool.get_managed_buffer(c.device, 15 * 4, Precision::Bytes);
  REQUIRE(idx);
  check_invalid(merge_topk(out, *idx, small, *idx, {.queries = 1, .lists = 3, .list_length = 5, .k = 16}),
                {"k = 16", "15"});
  check_invalid(merge_topk(out, *idx, small, *idx, {.queries = 1, .lists = 0, .list_length = 5, .k = 1}),
                {"lists 0"});
  check_invalid(merge_topk(out, out, small, *idx, {.queries = 1, .lists = 3, .list_length = 5, .k = 1}),
                {"indices is fp32", "expected bytes"});
  check_invalid(merge_topk(out, *idx, small, *idx, {.queries = 2, .lists = 3, .list_length = 5, .k = 1}),
                {"distances", "too small"});

  auto run_i = c.pool.get_managed_buffer(c.device, 3 * 5 * 4, Precision::Bytes);
  REQUIRE(run_i);
  check_invalid(fold_topk(out, *idx, small, *run_i, {.queries = 3, .candidates = 5, .k = 0}),
                {"k = 0", "1.."});
  check_invalid(fold_topk(out, *idx, small, *run_i, {.queries = 3, .candidates = 0, .k = 4}),
                {"candidates 0"});
  check_invalid(fold_topk(out, *idx, small, *run_i,
                          {.queries = 3, .candidates = 5, .k = 4, .index_offset = -1}),
                {"index_offset = -1", "int32"});
  check_invalid(fold_topk(out, out, small, *run_i, {.queries = 3, .candidates = 5, .k = 4}),
                {"candidate_indices is fp32", "expected bytes"});
  check_invalid(fold_topk(out, *idx, small, *run_i, {.queries = 3, .candidates = 5, .k = 5}),
                {"running_distances", "too small"});
  check_invalid(fold_topk(out, *idx, small, *run_i, {.queries = 1, .candidates = 16, .k = 4}),
                {"candidate_distances", "too small"});
  check_invalid(fold_topk(foreign, *idx, small, *run_i, {.queries = 1, .candidates = 5, .k = 4}),
                {"candidate_distances", "device"});

  check_invalid(indices_to_host(out), {"indices is fp32"});
}
