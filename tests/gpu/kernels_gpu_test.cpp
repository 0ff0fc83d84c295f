// gpupool:kernels on a real CUDA device ([gpu]: CTest skips these; tools/gpu-check.sh runs them).
// Same checks as tests/kernels_test.cpp: fp64 reference, per-precision tolerances (fp32 2e-5,
// tf32 4e-3, fp16 2e-3, bf16 1.6e-2, int8 2.5e-2, relative to ‖q‖²+‖x‖² / ‖q‖‖x‖ / 1), knn as
// sets with a tie tolerance, pytorch#42479, poisoned outputs.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>
import gpupool;
#include "../support/knn_reference.hpp"
#include "../support/convert_stored_check.hpp"
#include "../support/upper_bounds_check.hpp"

using namespace gpupool;
using gpupool::test::crowded_corpus;
using gpupool::test::inexact_queries;
using gpupool::test::reference_distance;
using gpupool::test::reference_row;
using gpupool::test::seeded_values;

namespace {

const float kGpuNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<float> gpu_random(std::size_t n) {
  static std::mt19937 engine{std::random_device{}()};
  std::uniform_real_distribution<float> magnitude(0.05f, 1.0f);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> v(n);
  for (auto& x : v) x = negative(engine) ? -magnitude(engine) : magnitude(engine);
  return v;
}

struct GpuCtx {
  Device device;
  GpuMemoryPool pool;
};

GpuCtx gpu_ctx() {
  auto device = Device::cuda(0);
  REQUIRE(device);
  return GpuCtx{*device, GpuMemoryPool{}};
}

ManagedBuffer gpu_fp32(GpuCtx& c, const std::vector<float>& host) {
  auto b = c.pool.get_managed_buffer(c.device, host.size(), Precision::Fp32);
  REQUIRE(b);
  REQUIRE(b->upload(std::span<const float>(host)));
  return std::move(*b);
}

struct GpuInput {
  ManagedBuffer data;
  std::optional<ManagedBuffer> scales;
};

GpuInput gpu_input(GpuCtx& c, const std::vector<float>& host, std::size_t dim, Precision p) {
  GpuInput in;
  ManagedBuffer src = gpu_fp32(c, host);
  if (p == Precision::Fp32) {
    in.data = std::move(src);
    return in;
  }
  auto b = c.pool.get_managed_buffer(c.device, host.size(), p);
  REQUIRE(b);
  if (p == Precision::Int8) {
    auto s = c.pool.get_managed_buffer(c.device, host.size() / dim, Precision::Fp32);
    REQUIRE(s);
    REQUIRE(convert(src, *b, {.dim = dim, .scales = &*s}));
    in.scales = std::move(*s);
  } else {
    REQUIRE(convert(src, *b, {.dim = dim}));
  }
  in.data = std::move(*b);
  return in;
}

// Every input precision in the modes that change its kernels (fp32: accurate and TF32).
constexpr std::array<std::pair<Precision, ComputeMode>, 5> kPrecisionModes{
    {{Precision::Fp32, ComputeMode::Fp32Accurate},
     {Precision::Fp32, ComputeMode::Tf32},
     {Precision::Fp16, ComputeMode::Fp32Accurate},
     {Precision::Bf16, ComputeMode::Fp32Accurate},
     {Precision::Int8, ComputeMode::Fp32Accurate}}};

double gpu_tol(Precision p, ComputeMode mode) {
  switch (p) {
    case Precision::Fp32: return mode == ComputeMode::Tf32 ? 4e-3 : 2e-5;
    case Precision::Fp16: return 2e-3;
    case Precision::Bf16: return 1.6e-2;
    default: return 2.5e-2;
  }
}

// Entries of a knn result that disagree with fp64 as sets: a row missing, repeated or out of
// range, a distance off by more than the tolerance, a row kept that is clearly not among the k
// nearest or one left out that clearly is (ties within 2 × the tolerance may go either way), rows
// out of order.
std::size_t knn_mismatches(const std::vector<float>& qh, const std::vector<float>& xh,
                           std::size_t dim, std::size_t k, Metric m, double tol,
                           const KnnResult& nn) {
  auto d = *nn.distances.to_host<float>();
  auto id = *indices_to_host(nn.indices);
  std::size_t nq = qh.size() / dim, n = xh.size() / dim;
  return gpupool::test::sum_over_queries(nq, [&](std::size_t i) -> std::size_t {
    std::size_t bad = 0;
    auto reference = reference_row(&qh[i * dim], xh, dim, k, m);
    const std::vector<double>& ref = reference.distance;
    double kth = reference.kth;
    std::vector<double> slack(n);
    for (std::size_t j = 0; j < n; ++j) slack[j] = tol * reference.scale[j] + 1e-6;
    std::set<std::int32_t> seen;
    for (std::size_t r = 0; r < k; ++r) {
      std::int32_t j = id[i * k + r];
      if (j < 0 || static_cast<std::size_t>(j) >= n || !seen.insert(j).second) { ++bad; continue; }
      if (!(std::abs(d[i * k + r] - ref[j]) <= slack[j])) ++bad;
      if (!(ref[j] <= kth + 2 * slack[j])) ++bad;
      if (r > 0 && !(d[i * k + r - 1] <= d[i * k + r])) ++bad;
    }
    for (std::size_t j = 0; j < n; ++j)
      if (ref[j] < kth - 2 * slack[j] && !seen.count(static_cast<std::int32_t>(j))) ++bad;
    return bad;
  });
}

// Entries of a Q × N matrix (row-major, `got`) off its fp64 reference by more than
// tol × scale + slack (the queries spread over the cores).
std::size_t matrix_mismatches(const std::vector<float>& got, const std::vector<float>& qh,
                              const std::vector<float>& xh, std::size_t dim, Metric m, double tol,
                              double slack = 1e-6) {
  const std::size_t nq = qh.size() / dim, n = xh.size() / dim;
  return gpupool::test::sum_over_queries(nq, [&](std::size_t i) {
    std::size_t wrong = 0;
    for (std::size_t j = 0; j < n; ++j) {
      double scale;
      double ref = reference_distance(&qh[i * dim], &xh[j * dim], dim, m, &scale);
      if (!(std::abs(got[i * n + j] - ref) <= tol * scale + slack)) ++wrong;
    }
    return wrong;
  });
}

// The Q × N matrix of one precision, metric and mode against fp64, on fresh random rows; the
// output buffer holds `past_end` more poisoned floats, which must stay poisoned.
void check_large_matrix(GpuCtx& c, std::size_t nq, std::size_t n, std::size_t dim, Precision p,
                        Metric m, std::size_t past_end,
                        ComputeMode mode = ComputeMode::Fp32Accurate) {
  INFO(to_string(p) << " " << to_string(m) << " " << to_string(mode) << " " << nq << "×" << n
                    << "×" << dim);
  auto qh = gpu_random(nq * dim), xh = gpu_random(n * dim);
  GpuInput q = gpu_input(c, qh, dim, p), x = gpu_input(c, xh, dim, p);
  ManagedBuffer out = gpu_fp32(c, std::vector<float>(nq * n + past_end, kGpuNaN));
  DistanceOptions o{.dim = dim, .metric = m, .mode = mode,
                    .query_scales = q.scales ? &*q.scales : nullptr,
                    .corpus_scales = x.scales ? &*x.scales : nullptr};
  REQUIRE(l2_distance(q.data, x.data, out, o));
  auto got = *out.to_host<float>();
  CHECK(std::all_of(got.begin() + nq * n, got.end(), [](float v) { return std::isnan(v); }));
  got.resize(nq * n);
  CHECK(matrix_mismatches(got, qh, xh, dim, m, gpu_tol(p, mode)) == 0);
}

}  // namespace

TEST_CASE("GPU distances match fp64 for every precision, metric and mode", "[gpu][kernels]") {
  GpuCtx c = gpu_ctx();
  // Which path (cuda_kernels::fused_matrix): dim 37 and 1 cuBLAS; 1000 the fused kernel
  // (distance_matrix.cu) for fp32-accurate only (int8: dim % 16 != 0; the rest: rows over
  // 1 KiB); 64 the fused kernel for every precision; 3 queries of dim 16 the fused kernel for
  // int8 only. The fused shapes span several 128 × 128 tiles with partial ones at both edges;
  // 150 × 516 (N a multiple of 4) takes the kernels' 16-byte stores of whole tiles, with 22
  // queries in the last query tile (one warp's 16 and another's 6).
  for (auto [nq, n, dim] : {std::tuple{7, 19, 37}, std::tuple{1, 1, 1}, std::tuple{70, 130, 1000},
                            std::tuple{130, 301, 64}, std::tuple{150, 516, 128},
                            std::tuple{3, 129, 16}})
    for (Precision p : {Precision::Fp32, Precision::Fp16, Precision::Bf16, Precision::Int8})
      for (Metric m : {Metric::L2, Metric::InnerProduct, Metric::Cosine})
        for (ComputeMode mode : {ComputeMode::Fp32Accurate, ComputeMode::Tf32}) {
          INFO(to_string(p) << " " << to_string(m) << " " << to_string(mode) << " " << nq << "×"
                            << n << "×" << dim);
          auto qh = gpu_random(nq * dim), xh = gpu_random(n * dim);
          GpuInput q = gpu_input(c, qh, dim, p), x = gpu_input(c, xh, dim, p);
          ManagedBuffer out = gpu_fp32(c, std::vector<float>(nq * n, kGpuNaN));
          DistanceOptions o{.dim = static_cast<std::size_t>(dim), .metric = m, .mode = mode,
                            .query_scales = q.scales ? &*q.scales : nullptr,
                            .corpus_scales = x.scales ? &*x.scales : nullptr};
          REQUIRE(l2_distance(q.data, x.data, out, o));
          CHECK(matrix_mismatches(*out.to_host<float>(), qh, xh, static_cast<std::size_t>(dim), m,
                                  gpu_tol(p, mode)) == 0);
        }
}

// The resident (wgmma) kernels hand each block a run of (query tile, corpus tile) pairs: with 3
// query tiles and 469 corpus tiles over one block a multiprocessor (132 on an H100 / H200), a
// block's run spans two query tiles (its queries change mid-run), is longer than the kernels'
// stages (the copy engine refills them), and ends on an odd or an even count (the two sets of
// accumulators finish either way). The last query tile holds 44 queries, the last corpus tile
// 96 rows. The output buffer is longer than the matrix: what lies past it stays poisoned (the
// last query tile's stores skip the rows of queries that do not exist).
TEST_CASE("GPU distance matrix over long runs of corpus tiles", "[gpu][kernels]") {
  GpuCtx c = gpu_ctx();
  const std::size_t nq = 300, n = 60000, dim = 128;
  for (Precision p : {Precision::Fp16, Precision::Bf16, Precision::Int8})
    for (Metric m : {Metric::L2, Metric::Cosine}) check_large_matrix(c, nq, n, dim, p, m, 4 * n);
}

// A corpus over half the L2 (38 MB against an H100's 50 MB and an H200's 60 MB) with 5 query
// tiles: the resident matrix then runs 130 blocks (26 a query tile, resident::blocks_in_step)
// instead of a wave of 132, each block a run of one query tile's corpus tiles; the last tile has
// 116 rows and the last query tile 88 queries.
TEST_CASE("GPU distance matrix over a corpus larger than half the L2", "[gpu][kernels]") {
  GpuCtx c = gpu_ctx();
  check_large_matrix(c, 600, 150004, 128, Precision::Fp16, Metric::L2, 0);
  check_large_matrix(c, 600, 150004, 128, Precision::Int8, Metric::Cosine, 0);
}

// Query tiles that a thread block cluster can share (resident::Lockstep) over a corpus larger
// than half the L2: 8 query tiles (clusters of 8 blocks, each block of a cluster on the same
// run of corpus tiles for its own query tile, meeting every 8 tiles), the last corpus tile 4
// rows; then 6 query tiles of int8 rows of 256 bytes (clusters of 2) and cosine. The runs are
// interleaved (run r of R takes corpus tiles r, r + R, ...: some runs one tile more than others,
// the partial last tile in run 1024 mod R). The corpus norms come from the tiles in shared memory
// (cuda_kernels::matrix_sums_corpus_norms).
TEST_CASE("GPU distance matrix in lockstep clusters", "[gpu][kernels]") {
  GpuCtx c = gpu_ctx();
  check_large_matrix(c, 1024, 131076, 128, Precision::Fp16, Metric::L2, 64);
  check_large_matrix(c, 768, 150004, 256, Precision::Int8, Metric::Cosine, 0);
}

// Each store form of the resident matrix on whole tiles (N a multiple of 4) and partial ones:
// the 512-byte row stores (fp16, bf16 and tf32 rows of up to 256 bytes, written 8 of a warp's
// 16 rows at a time) and the 128-byte stores of four rows (int8, and fp32-accurate's halves at
// D = 64). 150 queries leave 22 in the last query tile (one warp's 16, another's 6: its second
// 8 rows absent), 152 leave 24 (a warp with exactly 8); the last corpus tile has 4 rows.
TEST_CASE("GPU distance matrix's row and slice stores on whole and partial tiles",
          "[gpu][kernels]") {
  GpuCtx c = gpu_ctx();
  for (std::size_t nq : {std::size_t{150}, std::size_t{152}}) {
    check_large_matrix(c, nq, 1028, 64, Precision::Fp16, Metric::L2, 2 * 1028);
    check_large_matrix(c, nq, 1028, 128, Precision::Bf16, Metric::Cosine, 2 * 1028);
    check_large_matrix(c, nq, 1028, 64, Precision::Fp32, Metric::L2, 2 * 1028,
                       ComputeMode::Tf32);
    check_large_matrix(c, nq, 1028, 64, Precision::Int8, Metric::InnerProduct, 2 * 1028);
    check_large_matrix(c, nq, 1028, 64, Precision::Fp32, Metric::Cosine, 2 * 1028);
  }
}

// Rows of 257 to 512 bytes: the resident matrix's two-stage pipeline (64 KB stages and query
// tile, distance_matrix.cu's WideMatrixPipeline). tf32 rows of D = 128 (512 bytes, four chunks)
// over long runs that change query tile mid-run and refill the two stages hundreds of times, then
// in lockstep clusters (8 query tiles, a corpus over half the L2); fp16 rows of 400 bytes (the
// last chunk half zero-filled), bf16 of 512, int8 of 304; fp32-accurate on fp16 halves; every
// metric; partial last tiles.
TEST_CASE("GPU distance matrix on rows of up to 512 bytes", "[gpu][kernels]") {
  GpuCtx c = gpu_ctx();
  for (Metric m : {Metric::L2, Metric::InnerProduct, Metric::Cosine})
    check_large_matrix(c, 300, 60000, 128, Precision::Fp32, m, 3 * 60000, ComputeMode::Tf32);
  check_large_matrix(c, 1024, 131076, 128, Precision::Fp32, Metric::L2, 64, ComputeMode::Tf32);
  check_large_matrix(c, 300, 60000, 200, Precision::Fp16, Metric::L2, 0);
  check_large_matrix(c, 130, 5001, 256, Precision::Bf16, Metric::InnerProduct, 0);
  check_large_matrix(c, 260, 20004, 304, Precision::Int8, Metric::Cosine, 0);
  // fp32-accurate: fp16 halves of 128 values a row (512 bytes), long runs and lockstep clusters.
  check_large_matrix(c, 300, 60000, 128, Precision::Fp32, Metric::L2, 0);
  check_large_matrix(c, 1024, 131076, 120, Precision::Fp32, Metric::Cosine, 0);
}

// l2_distance's temporaries (the row norms) come from out's pool: they show in its counts,
// go back to it, and stay under its hard limit. With the limit at what is in use the call
// fails with PoolLimitExceeded before anything runs (out stays poisoned), and works again once
// the limit is lifted.
TEST_CASE("GPU l2_distance takes its scratch from out's pool, within its limit",
          "[gpu][kernels][pool]") {
  GpuCtx c = gpu_ctx();
  const std::size_t nq = 200, n = 3000, dim = 64;
  auto qh = gpu_random(nq * dim), xh = gpu_random(n * dim);
  GpuInput q = gpu_input(c, qh, dim, Precision::Fp16), x = gpu_input(c, xh, dim, Precision::Fp16);
  ManagedBuffer out = gpu_fp32(c, std::vector<float>(nq * n, kGpuNaN));
  const DistanceOptions o{.dim = dim, .metric = Metric::L2};

  const PoolStats before = c.pool.stats(c.device);
  c.pool.reset_peaks(c.device);
  REQUIRE(l2_distance(q.data, x.data, out, o));
  REQUIRE(c.device.synchronize());
  const PoolStats after = c.pool.stats(c.device);
  CHECK(after.allocations == before.allocations + 1);
  CHECK(after.peak_requested_bytes >= before.requested_bytes + nq * sizeof(float));
  CHECK(after.in_use_bytes == before.in_use_bytes);

  ManagedBuffer fresh = gpu_fp32(c, std::vector<float>(nq * n, kGpuNaN));
  c.pool.emergency_cleanup(c.device);
  const std::size_t in_use = c.pool.stats(c.device).in_use_bytes;
  REQUIRE(c.pool.set_max_pool_size(c.device, in_use));
  auto refused = l2_distance(q.data, x.data, fresh, o);
  REQUIRE(!refused);
  CHECK(refused.error().kind() == ErrorKind::PoolLimitExceeded);
  CHECK(refused.error().message().find("scratch") != std::string::npos);
  auto untouched = *fresh.to_host<float>();
  CHECK(std::all_of(untouched.begin(), untouched.end(), [](float v) { return std::isnan(v); }));

  REQUIRE(c.pool.set_max_pool_size(c.device, in_use + (std::size_t{64} << 20)));
  REQUIRE(l2_distance(q.data, x.data, fresh, o));
  CHECK(matrix_mismatches(*fresh.to_host<float>(), qh, xh, dim, Metric::L2,
                          gpu_tol(Precision::Fp16, ComputeMode::Fp32Accurate)) == 0);
}

// fp32-accurate rows that split_to_fp16 cannot scale (largest |value| 2^-50 or 2^50: outside
// [2^-40, 2^41); +inf; NaN) come out of the fp16-halves matrix as the fp32 rows give them, beside
// a zero row and ordinary ones; queries too (2^-45, 2^45). Rows of 100 values: halves of 128, the
// two-stage pipeline. Finite results within fp32-accurate's tolerance (no absolute slack: the
// tiny rows' products are ~2^-50), infinite ones equal, NaN where fp64 gives NaN. With
// GPUPOOL_WGMMA=0 the same rows go through 3×TF32, which re-computes its NaN products from the
// fp32 rows (before it did, the infinite inner products came out NaN).
TEST_CASE("GPU fp32-accurate matrix on fp16 halves takes rows they cannot scale from fp32",
          "[gpu][kernels]") {
  GpuCtx c = gpu_ctx();
  const std::size_t nq = 70, n = 300, dim = 100;
  auto qh = gpu_random(nq * dim), xh = gpu_random(n * dim);
  auto scale_row = [dim](std::vector<float>& rows, std::size_t r, float by) {
    for (std::size_t i = 0; i < dim; ++i) rows[r * dim + i] *= by;
  };
  scale_row(xh, 5, 0x1p-50f);
  scale_row(xh, 6, 0x1p50f);
  xh[7 * dim + 3] = std::numeric_limits<float>::infinity();
  xh[8 * dim + 99] = kGpuNaN;
  scale_row(xh, 9, 0.0f);
  scale_row(qh, 3, 0x1p-45f);
  scale_row(qh, 4, 0x1p45f);
  ManagedBuffer q = gpu_fp32(c, qh), x = gpu_fp32(c, xh);
  for (Metric m : {Metric::L2, Metric::InnerProduct, Metric::Cosine}) {
    INFO(to_string(m));
    ManagedBuffer out = gpu_fp32(c, std::vector<float>(nq * n, kGpuNaN));
    REQUIRE(l2_distance(q, x, out, {.dim = dim, .metric = m}));
    auto got = *out.to_host<float>();
    std::size_t bad = 0;
    for (std::size_t i = 0; i < nq; ++i)
      for (std::size_t j = 0; j < n; ++j) {
        double scale;
        const double ref = reference_distance(&qh[i * dim], &xh[j * dim], dim, m, &scale);
        const float v = got[i * n + j];
        // ±inf: the halves' exact re-compute gives it, and so does 3×TF32's (GPUPOOL_WGMMA=0,
        // other GPUs), whose split makes inf into inf and inf − inf (docs/kernels.md, NaN).
        const bool right = std::isnan(ref)   ? std::isnan(v)
                           : std::isinf(ref) ? double(v) == ref
                                             : std::abs(v - ref) <= 2e-5 * scale;
        if (!right) {
          if (bad < 5) UNSCOPED_INFO("pair " << i << ", " << j << ": " << v << " against " << ref);
          ++bad;
        }
      }
    CHECK(bad == 0);
  }
}

// Whether the resident (wgmma) kernels run: compute capability 9.0, not switched off with
// GPUPOOL_WGMMA=0 (tools/gpu-check.sh runs the kernel tests both ways).
bool resident_kernels_run(const GpuCtx& c) {
  const DeviceProperties& props = c.device.properties();
  const char* wgmma = std::getenv("GPUPOOL_WGMMA");
  return props.compute_capability_major == 9 && props.compute_capability_minor == 0 &&
         !(wgmma && std::string(wgmma) == "0");
}

// Where out's pool cannot spare the fp16 halves (4 · 128 bytes a row here) the fp32-accurate
// matrix runs without them (3×TF32 on tile_product.cuh) instead of failing; with room, it takes
// them (the pool's peak shows them). The tight pool is a pool of its own, holding nothing but out
// and 1 MiB more under its limit: room for the norms, not for the 2 MiB of halves.
TEST_CASE("GPU fp32-accurate matrix runs without its fp16 halves where the pool has no room",
          "[gpu][kernels][pool]") {
  GpuCtx c = gpu_ctx();
  const std::size_t nq = 128, n = 4000, dim = 128;
  auto qh = gpu_random(nq * dim), xh = gpu_random(n * dim);
  ManagedBuffer q = gpu_fp32(c, qh), x = gpu_fp32(c, xh);
  const std::size_t out_bytes = nq * n * sizeof(float), halves_bytes = (nq + n) * 2 * 128 * 2;
  auto check_matrix = [&](const ManagedBuffer& out) {
    CHECK(matrix_mismatches(*out.to_host<float>(), qh, xh, dim, Metric::L2,
                            gpu_tol(Precision::Fp32, ComputeMode::Fp32Accurate), 0.0) == 0);
  };
  const std::vector<float> poison(nq * n, kGpuNaN);

  GpuMemoryPool tight_pool;
  REQUIRE(tight_pool.set_max_pool_size(c.device, out_bytes + (std::size_t{1} << 20)));
  auto tight = tight_pool.get_managed_buffer(c.device, nq * n, Precision::Fp32);
  REQUIRE(tight);
  REQUIRE(tight->upload(std::span<const float>(poison)));
  REQUIRE(l2_distance(q, x, *tight, {.dim = dim}));
  REQUIRE(c.device.synchronize());
  CHECK(tight_pool.stats(c.device).peak_requested_bytes < out_bytes + halves_bytes);
  check_matrix(*tight);

  ManagedBuffer roomy = gpu_fp32(c, poison);
  const std::size_t requested = c.pool.stats(c.device).requested_bytes;
  c.pool.reset_peaks(c.device);
  REQUIRE(l2_distance(q, x, roomy, {.dim = dim}));
  REQUIRE(c.device.synchronize());
  // The halves need the resident kernel.
  if (resident_kernels_run(c))
    CHECK(c.pool.stats(c.device).peak_requested_bytes >= requested + halves_bytes);
  check_matrix(roomy);
}

TEST_CASE("GPU fp32-accurate L2 is exact for pytorch#42479", "[gpu][kernels]") {
  GpuCtx c = gpu_ctx();
  ManagedBuffer q = gpu_fp32(c, {512695.0f}), x = gpu_fp32(c, {512804.0f, 512695.0f});
  ManagedBuffer out = gpu_fp32(c, {kGpuNaN, kGpuNaN});
  REQUIRE(l2_distance(q, x, out, {.dim = 1}));
  CHECK(*out.to_host<float>() == std::vector<float>{11881.0f, 0.0f});
  auto nn = knn(c.pool, q, x, 2, {.dim = 1});
  REQUIRE(nn);
  CHECK(*nn->distances.to_host<float>() == std::vector<float>{0.0f, 11881.0f});
  CHECK(*indices_to_host(nn->indices) == std::vector<std::int32_t>{1, 0});
}

TEST_CASE("GPU fp32-accurate L2 recomputes cancelled pairs in the fused matrix kernel",
          "[gpu][kernels]") {
  // pytorch#42479's points in 4 dimensions, 64 queries (the fused kernel takes fp32 rows with
  // dim % 4 == 0 and 64+ queries): ‖q‖² ≈ 10^12, so the GEMM form has nothing left of the
  // distance 109² = 11881.
  GpuCtx c = gpu_ctx();
  const float a = 512695.0f, b = 512804.0f;
  const std::size_t nq = 64;
  ManagedBuffer q = gpu_fp32(c, std::vector<float>(nq * 4, a));
  ManagedBuffer x = gpu_fp32(c, {b, a, a, a, a, a, a, a, a, b, a, b});
  ManagedBuffer out = gpu_fp32(c, std::vector<float>(nq * 3, kGpuNaN));
  REQUIRE(l2_distance(q, x, out, {.dim = 4}));
  auto got = *out.to_host<float>();
  for (std::size_t i = 0; i < nq; ++i)
    CHECK(std::vector<float>(got.begin() + i * 3, got.begin() + i * 3 + 3) ==
          std::vector<float>{11881.0f, 0.0f, 23762.0f});
}

TEST_CASE("GPU knn matches fp64 as sets", "[gpu][kernels]") {
  GpuCtx c = gpu_ctx();
  // fp32-accurate tiles: 300 queries take 3×TF32, 128 or fewer plain fp32 FMA (gpu/knn_plan.cpp,
  // wants_split). The last three use few queries over many rows: the sliced top-k path (partial
  // lists merged) for D = 33 and k = 1024, the few-queries kernel for (7, 40000, 16, 1), as for
  // (5, 300, 24, 10) (few_queries_takes).
  for (auto [nq, n, dim, k] : {std::tuple{5, 300, 24, 10}, std::tuple{3, 5000, 17, 1024},
                               std::tuple{64, 20000, 128, 100}, std::tuple{300, 6000, 40, 10},
                               std::tuple{1, 3, 1, 3}, std::tuple{1, 100003, 33, 100},
                               std::tuple{2, 60000, 8, 1024}, std::tuple{7, 40000, 16, 1}})
    for (Precision p : {Precision::Fp32, Precision::Fp16, Precision::Bf16, Precision::Int8})
      for (Metric m : {Metric::L2, Metric::Cosine}) {
        INFO(to_string(p) << " " << to_string(m) << " " << nq << "×" << n << "×" << dim << " k " << k);
        auto qh = gpu_random(nq * dim), xh = gpu_random(n * dim);
        GpuInput q = gpu_input(c, qh, dim, p), x = gpu_input(c, xh, dim, p);
        auto nn = knn(c.pool, q.data, x.data, k,
                      {.dim = static_cast<std::size_t>(dim), .metric = m,
                       .query_scales = q.scales ? &*q.scales : nullptr,
                       .corpus_scales = x.scales ? &*x.scales : nullptr});
        REQUIRE(nn);
        CHECK(knn_mismatches(qh, xh, dim, k, m, gpu_tol(p, ComputeMode::Fp32Accurate), *nn) == 0);
      }
}

// Whether knn should take the fused filter (gpu/knn_plan.cpp, filter_plan): corpora of 65536+
// rows, k <= 256, 64+ queries, and either fp32-accurate mode (it filters scaled fp16 copies of
// the rows, padded to whole 16-byte chunks, and re-ranks exactly: any dim) or rows it reads as
// dim % 16 == 0) of at most 1024 bytes, or longer fp16 / bf16 / int8 rows where the streamed
// (wgmma) filter kernel runs (`streamed`: resident_kernels_run).
bool filtered(std::size_t nq, std::size_t n, std::size_t dim, std::size_t k, Precision p,
              ComputeMode mode, bool streamed = false) {
  std::size_t element = p == Precision::Fp32 ? 4 : p == Precision::Int8 ? 1 : 2;
  std::size_t row_bytes = dim * element;
  bool accurate = p == Precision::Fp32 && mode == ComputeMode::Fp32Accurate;
  bool readable = row_bytes % 16 == 0 && (row_bytes <= 1024 || (streamed && element < 4));
  return n >= 65536 && k <= 256 && nq >= 64 && (accurate || readable);
}

// Whether knn takes the few-queries kernel (gpu/cuda/few_queries_knn.cuh, few_queries_takes):
// up to 8 queries (int8: 32), k <= 128, rows of whole 16-byte pieces and at most 512 bytes. Its
// path reads as tiled.
bool few_queries(std::size_t nq, std::size_t dim, std::size_t k, Precision p) {
  std::size_t row_bytes = dim * (p == Precision::Fp32 ? 4 : p == Precision::Int8 ? 1 : 2);
  return nq <= (p == Precision::Int8 ? 32u : 8u) && k <= 128 && row_bytes % 16 == 0 &&
         row_bytes <= 512;
}

// A pool whose cached blocks of the result's sizes hold poison (0x7f bytes: distances 3.4e38,
// indices out of range), so that an entry knn leaves unwritten shows as a mismatch.
void poison_results(GpuCtx& c, std::size_t nq, std::size_t k) {
  for (Precision p : {Precision::Fp32, Precision::Bytes}) {
    std::size_t count = p == Precision::Fp32 ? nq * k : nq * k * 4;
    auto b = c.pool.get_managed_buffer(c.device, count, p);
    REQUIRE(b);
    REQUIRE(c.device.fill(b->raw_data(), 0x7f, nq * k * 4, b->stream()));
    REQUIRE(b->stream().synchronize());
  }
}

// knn of host rows (queries qh, corpus xh, `dim` values a row) in precision p, from poisoned
// result memory (poison_results); synchronized, so that the inputs may go when it returns.
Result<KnnResult> poisoned_knn(GpuCtx& c, const std::vector<float>& qh,
                               const std::vector<float>& xh, std::size_t dim, std::size_t k,
                               Precision p, Metric m) {
  GpuInput q = gpu_input(c, qh, dim, p), x = gpu_input(c, xh, dim, p);
  poison_results(c, qh.size() / dim, k);
  auto nn = knn(c.pool, q.data, x.data, k,
                {.dim = dim, .metric = m, .query_scales = q.scales ? &*q.scales : nullptr,
                 .corpus_scales = x.scales ? &*x.scales : nullptr});
  REQUIRE(c.device.synchronize());
  return nn;
}

// The few-queries kernel: every precision and metric, 1 to 8 queries (int8 up to 32: several
// groups of 8, a partial group), k = 1, 10, 100, corpora that are no multiple of its 128-row
// rounds or slices, rows of one partial 64-byte chunk (dim 40: 80 or 160 bytes) up to 512 bytes
// (fp16 dim 256, fp32 dim 128), against fp64, from poisoned result memory; past its rule (64
// queries), the path the rest of knn takes.
TEST_CASE("GPU knn for few queries matches fp64 as sets", "[gpu][kernels][few][long]") {
  GpuCtx c = gpu_ctx();
  for (auto [nq, n, dim, k] : {std::tuple{1, 70001, 128, 10}, std::tuple{3, 70001, 128, 100},
                               std::tuple{8, 70001, 128, 1}, std::tuple{64, 70001, 128, 10},
                               std::tuple{64, 30001, 128, 100}, std::tuple{8, 40000, 40, 10},
                               std::tuple{3, 20000, 256, 10}, std::tuple{17, 5000, 64, 100},
                               std::tuple{32, 70001, 128, 10}, std::tuple{1, 130, 32, 100}})
    for (Precision p : {Precision::Fp32, Precision::Fp16, Precision::Bf16, Precision::Int8})
      for (Metric m : {Metric::L2, Metric::InnerProduct, Metric::Cosine}) {
        INFO(to_string(p) << " " << to_string(m) << " " << nq << "×" << n << "×" << dim << " k " << k);
        auto qh = gpu_random(nq * dim), xh = gpu_random(n * dim);
        auto nn = poisoned_knn(c, qh, xh, dim, k, p, m);
        REQUIRE(nn);
        if (few_queries(nq, dim, k, p)) CHECK(nn->path == KnnPath::Tiled);
        else CHECK(nn->path == (filtered(nq, n, dim, k, p, ComputeMode::Fp32Accurate)
                                    ? KnnPath::Filtered
                                    : KnnPath::Tiled));
        CHECK(knn_mismatches(qh, xh, dim, k, m, gpu_tol(p, ComputeMode::Fp32Accurate), *nn) == 0);
      }
}

// knn with the caller's corpus norms (DistanceOptions::corpus_norms, as row_norms writes them) on
// every path that reads norms: few queries (1, 8; int8 20), the filter (64 queries; D = 960 on
// the streamed kernel), fp32-accurate's scaled copies and small corpora (tiled). Right
// norms: the fp64 result. Norms of other rows (each 1.5 times its own, plus 1): inner product's
// result stays right; L2 and cosine distances change, so the norms were read — except where fp32
// rows are filtered, whose kept rows' distances are recomputed from the rows, and where the
// few-queries kernel takes fp32 or int8 rows, which sums their squares itself.
TEST_CASE("GPU knn reads the caller's corpus norms on every path", "[gpu][kernels][norms]") {
  GpuCtx c = gpu_ctx();
  for (auto [nq, n, dim, k] : {std::tuple{1, 70001, 128, 10}, std::tuple{8, 70001, 128, 100},
                               std::tuple{20, 30001, 128, 10}, std::tuple{64, 70001, 128, 10},
                               std::tuple{64, 65600, 960, 10}, std::tuple{40, 3000, 32, 10}})
    for (auto [p, mode] : kPrecisionModes)
      for (Metric m : {Metric::L2, Metric::InnerProduct, Metric::Cosine}) {
        // D = 960: the streamed filter's 16-bit and int8 rows, L2 (the long filter case has the rest)
        if (dim == 960 && (p == Precision::Fp32 || p == Precision::Bf16 || m != Metric::L2)) continue;
        INFO(to_string(p) << " " << to_string(mode) << " " << to_string(m) << " " << nq << "×"
                          << n << "×" << dim << " k " << k);
        auto qh = gpu_random(nq * dim), xh = gpu_random(n * dim);
        GpuInput q = gpu_input(c, qh, dim, p), x = gpu_input(c, xh, dim, p);
        auto norms = c.pool.get_managed_buffer(c.device, n, Precision::Fp32);
        REQUIRE(norms);
        REQUIRE(row_norms(x.data, *norms, dim, x.scales ? &*x.scales : nullptr));
        auto others = *norms->to_host<float>();
        for (float& v : others) v = 1.5f * v + 1.0f;
        ManagedBuffer wrong = gpu_fp32(c, others);
        DistanceOptions options{.dim = static_cast<std::size_t>(dim), .metric = m, .mode = mode,
                                .query_scales = q.scales ? &*q.scales : nullptr,
                                .corpus_scales = x.scales ? &*x.scales : nullptr,
                                .corpus_norms = &*norms};
        poison_results(c, nq, k);
        auto nn = knn(c.pool, q.data, x.data, k, options);
        REQUIRE(nn);
        CHECK(knn_mismatches(qh, xh, dim, k, m, gpu_tol(p, mode), *nn) == 0);
        options.corpus_norms = &wrong;
        auto off = knn(c.pool, q.data, x.data, k, options);
        REQUIRE(off);
        if (m == Metric::InnerProduct) {
          CHECK(knn_mismatches(qh, xh, dim, k, m, gpu_tol(p, mode), *off) == 0);
        } else if (!(p == Precision::Fp32 && nn->path != KnnPath::Tiled) &&
                   !((p == Precision::Fp32 || p == Precision::Int8) &&
                     few_queries(nq, dim, k, p))) {
          auto right_d = *nn->distances.to_host<float>(), off_d = *off->distances.to_host<float>();
          std::size_t same = 0;
          for (std::size_t i = 0; i < right_d.size(); ++i) same += right_d[i] == off_d[i];
          CHECK(same < right_d.size() / 2);
        }
      }
}

// Orders that load the blocks' lists unevenly, for the merge of the blocks' lists: every row
// equal (every block's list is full of ties, and the k nearest are the first k rows, all in the
// first block's slice), and rows on a ray away from the queries in ascending or descending order
// (the k nearest in the first or the last block's slice).
TEST_CASE("GPU knn for few queries with the nearest rows in one slice", "[gpu][kernels][few]") {
  GpuCtx c = gpu_ctx();
  const std::size_t n = 70001, dim = 64;
  for (std::size_t nq : {1u, 8u})
    for (std::size_t k : {10u, 100u})
      for (Precision p : {Precision::Fp32, Precision::Fp16, Precision::Bf16, Precision::Int8}) {
        INFO(to_string(p) << " " << nq << " queries, k " << k);
        auto qh = gpu_random(nq * dim), row = gpu_random(dim);
        std::vector<float> xh;
        for (std::size_t r = 0; r < n; ++r) xh.insert(xh.end(), row.begin(), row.end());
        auto nn = poisoned_knn(c, qh, xh, dim, k, p, Metric::L2);
        REQUIRE(nn);
        auto dist = *nn->distances.to_host<float>();
        auto id = *indices_to_host(nn->indices);
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < nq; ++i)
          for (std::size_t r = 0; r < k; ++r)
            wrong += id[i * k + r] != static_cast<std::int32_t>(r) || dist[i * k + r] != dist[i * k];
        CHECK(wrong == 0);
        for (bool descending : {false, true}) {
          INFO((descending ? "descending" : "ascending"));
          std::vector<float> ray(n * dim), queries(nq * dim);
          for (std::size_t r = 0; r < n; ++r) {
            const float t = static_cast<float>(descending ? n - r : r + 1) / n;
            for (std::size_t j = 0; j < dim; ++j) ray[r * dim + j] = t * row[j];
          }
          for (std::size_t i = 0; i < nq; ++i)
            for (std::size_t j = 0; j < dim; ++j)
              queries[i * dim + j] = -row[j] * static_cast<float>(i + 1) / n;
          auto near = poisoned_knn(c, queries, ray, dim, k, p, Metric::L2);
          REQUIRE(near);
          CHECK(knn_mismatches(queries, ray, dim, k, Metric::L2,
                               gpu_tol(p, ComputeMode::Fp32Accurate), *near) == 0);
        }
      }
}

// The same on a small corpus, sized for compute-sanitizer (tools/gpu-check.sh's memcheck step):
// one query (the whole block sorts its list), two to four (groups of warps a list), 6, 8 and 20
// (a warp a list), lists of 128 and 256 entries; each with the corpus norms computed and given.
TEST_CASE("GPU knn for few queries on a small corpus", "[gpu][kernels][few]") {
  GpuCtx c = gpu_ctx();
  for (auto [nq, n, dim, k] : {std::tuple{1, 5003, 128, 10}, std::tuple{2, 3001, 64, 100},
                               std::tuple{3, 5003, 128, 10}, std::tuple{4, 2500, 128, 100},
                               std::tuple{6, 2000, 64, 10}, std::tuple{8, 2500, 64, 100},
                               std::tuple{20, 3001, 128, 10}})
    for (Precision p : {Precision::Fp32, Precision::Fp16, Precision::Bf16, Precision::Int8})
      for (Metric m : {Metric::L2, Metric::Cosine}) {
        INFO(to_string(p) << " " << to_string(m) << " " << nq << "×" << n << "×" << dim << " k " << k);
        auto qh = gpu_random(nq * dim), xh = gpu_random(n * dim);
        auto nn = poisoned_knn(c, qh, xh, dim, k, p, m);
        REQUIRE(nn);
        CHECK(knn_mismatches(qh, xh, dim, k, m, gpu_tol(p, ComputeMode::Fp32Accurate), *nn) == 0);
        // Again with the corpus norms given (the stages then carry them).
        GpuInput q = gpu_input(c, qh, dim, p), x = gpu_input(c, xh, dim, p);
        auto norms = c.pool.get_managed_buffer(c.device, n, Precision::Fp32);
        REQUIRE(norms);
        REQUIRE(row_norms(x.data, *norms, dim, x.scales ? &*x.scales : nullptr));
        poison_results(c, nq, k);
        auto given = knn(c.pool, q.data, x.data, k,
                         {.dim = static_cast<std::size_t>(dim), .metric = m,
                          .query_scales = q.scales ? &*q.scales : nullptr,
                          .corpus_scales = x.scales ? &*x.scales : nullptr,
                          .corpus_norms = &*norms});
        REQUIRE(given);
        CHECK(knn_mismatches(qh, xh, dim, k, m, gpu_tol(p, ComputeMode::Fp32Accurate), *given) == 0);
      }
}

// Every row twice (rows j and j + n/2 equal): whatever row of a tie the lists keep, the copy of
// smaller index must be kept too, across the blocks' lists and their merge. And rows with NaN
// sort after every number, in index order.
TEST_CASE("GPU knn for few queries breaks ties by index and sorts NaN last", "[gpu][kernels][few]") {
  GpuCtx c = gpu_ctx();
  const std::size_t copies = 2, n = copies * 40000, dim = 64;
  for (std::size_t nq : {1u, 8u, 64u})
    for (std::size_t k : {1u, 10u, 100u})
      for (Precision p : {Precision::Fp32, Precision::Fp16, Precision::Bf16, Precision::Int8})
        for (Metric m : {Metric::L2, Metric::InnerProduct}) {
          INFO(to_string(p) << " " << to_string(m) << " " << nq << " queries, k " << k);
          auto qh = gpu_random(nq * dim), base = gpu_random(n / copies * dim);
          std::vector<float> xh;
          for (std::size_t copy = 0; copy < copies; ++copy) xh.insert(xh.end(), base.begin(), base.end());
          auto nn = poisoned_knn(c, qh, xh, dim, k, p, m);
          REQUIRE(nn);
          CHECK(knn_mismatches(qh, xh, dim, k, m, gpu_tol(p, ComputeMode::Fp32Accurate), *nn) == 0);
          auto id = *indices_to_host(nn->indices);
          std::size_t missing = 0;
          for (std::size_t i = 0; i < nq; ++i) {
            std::set<std::int32_t> kept(id.begin() + i * k, id.begin() + (i + 1) * k);
            for (std::int32_t r : kept)
              if (r >= std::int32_t(n / copies)) missing += kept.count(r - std::int32_t(n / copies)) == 0;
          }
          CHECK(missing == 0);
        }
  // 150 of 200 rows NaN (fp32, dim 16: 64-byte rows): 50 numbers ascending, then NaN by index.
  const std::size_t rows = 200, d = 16, k = 100;
  auto qh = gpu_random(3 * d), xh = gpu_random(rows * d);
  std::vector<std::int32_t> nan_rows;
  for (std::size_t r = 0; r < rows; ++r)
    if (r % 4 != 1) xh[r * d + r % d] = kGpuNaN, nan_rows.push_back(static_cast<std::int32_t>(r));
  ManagedBuffer qb = gpu_fp32(c, qh), xb = gpu_fp32(c, xh);
  auto nn = knn(c.pool, qb, xb, k, {.dim = d});
  REQUIRE(nn);
  auto dist = *nn->distances.to_host<float>();
  auto id = *indices_to_host(nn->indices);
  for (std::size_t i = 0; i < 3; ++i) {
    INFO("query " << i);
    for (std::size_t r = 0; r < 50; ++r) {
      CHECK(id[i * k + r] % 4 == 1);
      CHECK(!std::isnan(dist[i * k + r]));
      if (r > 0) CHECK(dist[i * k + r - 1] <= dist[i * k + r]);
    }
    for (std::size_t r = 50; r < k; ++r) {
      CHECK(std::isnan(dist[i * k + r]));
      CHECK(id[i * k + r] == nan_rows[r - 50]);
    }
  }
}


// knn of the host rows qh, xh as the inputs q, x (made from them in precision p) in `mode`: the
// path the rules above give it (filtered) and the neighbours against fp64.
void check_filter_rules(GpuCtx& c, const std::vector<float>& qh, const std::vector<float>& xh,
                        const GpuInput& q, const GpuInput& x, std::size_t dim, std::size_t k,
                        Precision p, ComputeMode mode, Metric m) {
  auto nn = knn(c.pool, q.data, x.data, k,
                {.dim = dim, .metric = m, .mode = mode,
                 .query_scales = q.scales ? &*q.scales : nullptr,
                 .corpus_scales = x.scales ? &*x.scales : nullptr});
  REQUIRE(nn);
  const bool expect_filter = filtered(qh.size() / dim, xh.size() / dim, dim, k, p, mode,
                                      resident_kernels_run(c));
  CHECK(nn->path == (expect_filter ? KnnPath::Filtered : KnnPath::Tiled));
  CHECK(knn_mismatches(qh, xh, dim, k, m, gpu_tol(p, mode), *nn) == 0);
}

TEST_CASE("GPU knn's fused filter matches fp64 as sets", "[gpu][kernels][filter][long]") {
  GpuCtx c = gpu_ctx();
  // Filtered (or not, by the rule above): dim 35 (only fp32-accurate, padded to 40), D = 264
  // (TF32 rows of 1056 bytes tile; fp16's 528-byte and int8's 264-byte rows take the streamed
  // kernel where wgmma runs), Q = 63 (too few queries).
  // 200 queries: runs of 8-9 pairs a block on the resident kernels (see the matrix test above).
  // K = 256 at D = 64: fp16 / bf16 thresholds from 512 group minima, the k-th at their median.
  for (auto [nq, n, dim, k] : {std::tuple{70, 70001, 64, 10}, std::tuple{64, 66000, 35, 100},
                               std::tuple{65, 65536, 264, 256}, std::tuple{63, 65600, 32, 10},
                               std::tuple{200, 70001, 128, 10}, std::tuple{200, 66000, 64, 100},
                               std::tuple{70, 65536, 64, 256}})
    for (auto [p, mode] : kPrecisionModes)
      for (Metric m : {Metric::L2, Metric::InnerProduct, Metric::Cosine}) {
        INFO(to_string(p) << " " << to_string(mode) << " " << to_string(m) << " " << nq << "×"
                          << n << "×" << dim << " k " << k);
        auto qh = gpu_random(nq * dim), xh = gpu_random(n * dim);
        GpuInput q = gpu_input(c, qh, dim, p), x = gpu_input(c, xh, dim, p);
        check_filter_rules(c, qh, xh, q, x, dim, k, p, mode, m);
      }
}

// Rows longer than the resident kernel holds (over 256 bytes), on the streamed kernel where wgmma
// runs (else mma.sync tiles, or the tiled path past 1024 bytes): D = 960 (15 whole chunks of
// fp16, int8's 960 bytes end inside one), D = 1000 (fp16 rows end inside a chunk; int8's are no
// whole 16-byte pieces: tiled); 130 queries (a partial second query tile), corpora no multiple
// of the 256-row tiles. One input a shape (making it takes longer than the searches).
TEST_CASE("GPU knn's fused filter streams long rows", "[gpu][kernels][filter][long]") {
  GpuCtx c = gpu_ctx();
  for (auto [nq, n, dim, k] : {std::tuple{130, 65600, 960, 10}, std::tuple{130, 65537, 1000, 100}}) {
    const auto qh = gpu_random(nq * dim), xh = gpu_random(n * dim);
    for (auto [p, mode] : kPrecisionModes) {
      GpuInput q = gpu_input(c, qh, dim, p), x = gpu_input(c, xh, dim, p);
      for (Metric m : {Metric::L2, Metric::InnerProduct, Metric::Cosine}) {
        if (dim != 960 && m != Metric::L2) continue;  // every metric at one D
        INFO(to_string(p) << " " << to_string(mode) << " " << to_string(m) << " " << nq << "×"
                          << n << "×" << dim << " k " << k);
        poison_results(c, nq, k);
        check_filter_rules(c, qh, xh, q, x, dim, k, p, mode, m);
      }
    }
  }
}

TEST_CASE("GPU knn's upper bounds cut each list at its query's bound, filtered and tiled",
          "[gpu][kernels][filter]") {
  GpuCtx c = gpu_ctx();
  for (auto [nq, n, dim, k] : {std::tuple{70, 70001, 64, 10}, std::tuple{200, 66000, 128, 100},
                               std::tuple{5, 3000, 24, 10}})
    for (auto [p, mode] : {std::pair{Precision::Fp32, ComputeMode::Fp32Accurate},
                           std::pair{Precision::Fp32, ComputeMode::Tf32},
                           std::pair{Precision::Fp16, ComputeMode::Fp32Accurate},
                           std::pair{Precision::Int8, ComputeMode::Fp32Accurate}})
      for (Metric m : {Metric::L2, Metric::InnerProduct, Metric::Cosine}) {
        INFO(to_string(p) << " " << to_string(mode) << " " << to_string(m) << " " << nq << "×"
                          << n << "×" << dim << " k " << k);
        auto qh = gpu_random(nq * dim), xh = gpu_random(n * dim);
        GpuInput q = gpu_input(c, qh, dim, p), x = gpu_input(c, xh, dim, p);
        const DistanceOptions options{.dim = static_cast<std::size_t>(dim), .metric = m,
                                      .mode = mode,
                                      .query_scales = q.scales ? &*q.scales : nullptr,
                                      .corpus_scales = x.scales ? &*x.scales : nullptr};
        CHECK(gpupool::test::check_upper_bounds(c.pool, c.device, q.data, x.data, k, options,
                                                nq) > 0);
      }
}

// The launch helpers set each kernel's shared-memory attribute and read its occupancy once per
// device (gpu/cuda/per_device.cuh), not once per process: on a host with several GPUs the
// kernels, having run on cuda:0 first, must launch and be right on every other device too. With
// one GPU this checks cuda:0 alone (and says so).
TEST_CASE("GPU kernels launch and are right on every device", "[gpu][kernels]") {
  const int devices = Device::cuda_device_count();
  REQUIRE(devices >= 1);
  if (devices == 1) WARN("one CUDA device: only cuda:0 is checked");
  for (int ordinal = 0; ordinal < devices; ++ordinal) {
    INFO("cuda:" << ordinal);
    auto device = Device::cuda(ordinal);
    REQUIRE(device);
    GpuCtx c{*device, GpuMemoryPool{}};
    // The resident (wgmma) matrix where the GPU has it, and the mma.sync tiles (3×TF32).
    check_large_matrix(c, 200, 3000, 64, Precision::Fp16, Metric::L2, 16);
    check_large_matrix(c, 200, 3000, 64, Precision::Fp32, Metric::L2, 16);
    // The kNN filter (the resident stream's plain launch).
    const std::size_t nq = 70, n = 70001, dim = 64, k = 10;
    auto qh = gpu_random(nq * dim), xh = gpu_random(n * dim);
    GpuInput q = gpu_input(c, qh, dim, Precision::Fp16), x = gpu_input(c, xh, dim, Precision::Fp16);
    auto nn = knn(c.pool, q.data, x.data, k, {.dim = dim, .metric = Metric::L2});
    REQUIRE(nn);
    CHECK(nn->path == KnnPath::Filtered);
    CHECK(knn_mismatches(qh, xh, dim, k, Metric::L2,
                         gpu_tol(Precision::Fp16, ComputeMode::Fp32Accurate), *nn) == 0);
  }
}

// Fp32-accurate kNN filters on scaled fp16 products (10 mantissa bits, as TF32) with an error
// bound, then re-ranks what it kept in fp32: on rows crowded closer than TF32 can tell apart, it
// must still be the exact fp32 kNN. TF32 products alone are not (the tiled path with 63 queries,
// too few for the filter: that shows the data is hard enough); TF32 mode where the filter runs
// takes fp32-accurate's filter (gpu/knn_plan.cpp's plan_knn, where that one runs on
// the resident kernels), so it is exact too.
// Rows this crowded overflow the lists under the thresholds of the bound's group minima (upper
// bounds); the call must then filter again with the sample's exact k-th, and end filtered.
// dim 20: the fp16 copies are padded to 24.
TEST_CASE("GPU knn's filter is exact in fp32-accurate mode on crowded rows",
          "[gpu][kernels][filter]") {
  GpuCtx c = gpu_ctx();
  const std::size_t nq = 64, n = 70000, dim = 20, k = 10;
  for (auto [m, spread] : {std::pair{Metric::L2, 0.01f}, std::pair{Metric::InnerProduct, 0.003f},
                           std::pair{Metric::Cosine, 0.01f}}) {
    INFO(to_string(m));
    auto qh = seeded_values(nq * dim, 42);
    auto xh = crowded_corpus(qh, nq, n, dim, n / 2, spread, 43);
    const std::vector<float> tiled_qh(qh.begin(), qh.end() - dim);
    ManagedBuffer q = gpu_fp32(c, qh), tiled_q = gpu_fp32(c, tiled_qh), x = gpu_fp32(c, xh);
    for (ComputeMode mode : {ComputeMode::Fp32Accurate, ComputeMode::Tf32}) {
      INFO(to_string(mode));
      auto nn = knn(c.pool, q, x, k, {.dim = dim, .metric = m, .mode = mode});
      REQUIRE(nn);
      CHECK(nn->path == KnnPath::Filtered);
      // TF32 mode filters on its own products where fp32-accurate's filter is not resident.
      if (mode == ComputeMode::Fp32Accurate || resident_kernels_run(c))
        CHECK(inexact_queries(qh, xh, dim, k, m, *nn->distances.to_host<float>(),
                              *indices_to_host(nn->indices), true) == 0);
    }
    auto tf32 = knn(c.pool, tiled_q, x, k, {.dim = dim, .metric = m, .mode = ComputeMode::Tf32});
    REQUIRE(tf32);
    CHECK(tf32->path == KnnPath::Tiled);
    std::size_t tf32_wrong =
        inexact_queries(tiled_qh, xh, dim, k, m, *tf32->distances.to_host<float>(),
                        *indices_to_host(tf32->indices), false);
    INFO(tf32_wrong << " of " << nq - 1 << " queries wrong in TF32");
    if (m != Metric::Cosine) CHECK(tf32_wrong >= 1);
  }
}

// Rows the fp16 copies cannot scale (largest |value| below 2^-40 or above 2^40: NaN in the copy)
// must still reach the exact re-rank. Queries near the origin: the tiny rows are every query's
// nearest in L2, the huge ones the best inner products of half the queries.
TEST_CASE("GPU knn's fp32-accurate filter keeps rows its fp16 copies cannot scale",
          "[gpu][kernels][filter]") {
  GpuCtx c = gpu_ctx();
  const std::size_t nq = 64, n = 70000, dim = 32, k = 10;
  auto qh = gpu_random(nq * dim), xh = gpu_random(n * dim);
  for (float& v : qh) v *= 1e-3f;
  const std::vector<std::size_t> tiny{100, 20000, 40000, 69999}, huge{7, 30000, 50000};
  for (std::size_t r : tiny)
    for (std::size_t e = 0; e < dim; ++e) xh[r * dim + e] *= 0x1p-50f;
  for (std::size_t r : huge)
    for (std::size_t e = 0; e < dim; ++e) xh[r * dim + e] *= 0x1p45f;
  ManagedBuffer q = gpu_fp32(c, qh), x = gpu_fp32(c, xh);
  for (Metric m : {Metric::L2, Metric::InnerProduct, Metric::Cosine}) {
    INFO(to_string(m));
    auto nn = knn(c.pool, q, x, k, {.dim = dim, .metric = m});
    REQUIRE(nn);
    CHECK(nn->path == KnnPath::Filtered);
    auto d = *nn->distances.to_host<float>();
    auto id = *indices_to_host(nn->indices);
    CHECK(inexact_queries(qh, xh, dim, k, m, d, id, true) == 0);
    if (m == Metric::L2)
      for (std::size_t i = 0; i < nq; ++i)
        for (std::size_t r : tiny)
          CHECK(std::count(id.begin() + i * k, id.begin() + (i + 1) * k, std::int32_t(r)) == 1);
  }
}

// Without room in the pool for the filter's fp16 copies, fp32-accurate kNN takes the tiled path
// (the same answer); with room, the same call filters.
TEST_CASE("GPU fp32-accurate knn goes tiled when the filter's copies do not fit",
          "[gpu][kernels][filter]") {
  auto device = Device::cuda(0);
  REQUIRE(device);
  const std::size_t nq = 64, n = 70000, dim = 128, k = 10;
  auto qh = gpu_random(nq * dim), xh = gpu_random(n * dim);
  auto inputs = [&](GpuMemoryPool& pool) {
    auto q = pool.get_managed_buffer(*device, qh.size(), Precision::Fp32);
    auto x = pool.get_managed_buffer(*device, xh.size(), Precision::Fp32);
    REQUIRE(q);
    REQUIRE(x);
    REQUIRE(q->upload(std::span<const float>(qh)));
    REQUIRE(x->upload(std::span<const float>(xh)));
    return std::pair{std::move(*q), std::move(*x)};
  };
  std::size_t inputs_bytes = 0;
  {
    GpuMemoryPool probe(PoolConfig{.segments = false});
    auto held = inputs(probe);
    inputs_bytes = probe.stats(*device).reserved_bytes;
  }
  // The copies need (nq + n) · 128 · 2 bytes, about 17.9 MB; the tiled path fits in 8 MiB.
  for (auto [room, path] : {std::pair{std::size_t{8} << 20, KnnPath::Tiled},
                            std::pair{std::size_t{64} << 20, KnnPath::Filtered}}) {
    INFO(room << " bytes beside the inputs");
    GpuMemoryPool pool(PoolConfig{.max_pool_size = inputs_bytes + room, .segments = false});
    auto [q, x] = inputs(pool);
    auto nn = knn(pool, q, x, k, {.dim = dim});
    REQUIRE(nn);
    CHECK(nn->path == path);
    CHECK(knn_mismatches(qh, xh, dim, k, Metric::L2, gpu_tol(Precision::Fp32, ComputeMode::Fp32Accurate), *nn) == 0);
  }
}

// With the tile capped at 1024 columns (GPUPOOL_KNN_TILE_BYTES), k = 256 leaves the candidate
// lists 512 slots, which only a sample larger than the corpus could keep from overflowing: the
// filter is off and fp32-accurate knn must go tiled (it once made the filter's copies anyway and
// then failed asking the pool for a sample of 0 bytes).
TEST_CASE("GPU fp32-accurate knn goes tiled when a capped tile leaves the filter no room",
          "[gpu][kernels][filter]") {
  GpuCtx c = gpu_ctx();
  const std::size_t nq = 64, n = 70000, dim = 128, k = 256;
  struct TileCap {
    TileCap() { ::setenv("GPUPOOL_KNN_TILE_BYTES", "262144", 1); }
    ~TileCap() { ::unsetenv("GPUPOOL_KNN_TILE_BYTES"); }
  } cap;
  auto qh = gpu_random(nq * dim), xh = gpu_random(n * dim);
  ManagedBuffer q = gpu_fp32(c, qh), x = gpu_fp32(c, xh);
  auto nn = knn(c.pool, q, x, k, {.dim = dim});
  REQUIRE(nn);
  CHECK(nn->path == KnnPath::Tiled);
  CHECK(knn_mismatches(qh, xh, dim, k, Metric::L2,
                       gpu_tol(Precision::Fp32, ComputeMode::Fp32Accurate), *nn) == 0);
}

// Rows sorted from far to near: the sample's thresholds come mostly from far rows, so nearly every
// row after the last sample piece beats them and the lists overflow; the call must notice and
// redo the work tiled, with the same answer.
TEST_CASE("GPU knn's filter falls back to tiles when the row order defeats its sample",
          "[gpu][kernels][filter]") {
  GpuCtx c = gpu_ctx();
  const std::size_t nq = 64, n = 70001, dim = 32, k = 10;
  auto qh = gpu_random(nq * dim), xh = gpu_random(n * dim);
  for (float& v : qh) v *= 0.01f;  // queries near the origin
  for (std::size_t j = 0; j < n; ++j) {  // row j on the sphere of radius 4 - 3j/n
    float* row = &xh[j * dim];
    double len = 0;
    for (std::size_t e = 0; e < dim; ++e) len += double(row[e]) * row[e];
    float radius = 4.0f - 3.0f * static_cast<float>(j) / n;
    for (std::size_t e = 0; e < dim; ++e) row[e] = static_cast<float>(row[e] / std::sqrt(len)) * radius;
  }
  for (Precision p : {Precision::Fp32, Precision::Fp16, Precision::Int8}) {
    INFO(to_string(p));
    GpuInput q = gpu_input(c, qh, dim, p), x = gpu_input(c, xh, dim, p);
    auto nn = knn(c.pool, q.data, x.data, k,
                  {.dim = dim, .query_scales = q.scales ? &*q.scales : nullptr,
                   .corpus_scales = x.scales ? &*x.scales : nullptr});
    REQUIRE(nn);
    CHECK(nn->path == KnnPath::FilterFellBack);
    CHECK(knn_mismatches(qh, xh, dim, k, Metric::L2, gpu_tol(p, ComputeMode::Fp32Accurate), *nn) == 0);
  }
}

// A corpus tile full of one query's neighbours (100 copies of it, 76 in one 128-row tile) is more
// than its warp's 32 slots for kept products in the resident filter hold: the rest take the exact
// test at once. A zero row (cosine: distance 1) passes the quick test as NaN and must be dropped
// by the exact one. A NaN query passes every quick test: its result is k NaN distances, ties by
// index, whichever path the call takes.
TEST_CASE("GPU knn's filter keeps a tile full of neighbours and copes with a NaN query",
          "[gpu][kernels][filter]") {
  GpuCtx c = gpu_ctx();
  const std::size_t nq = 128, n = 70001, dim = 64, k = 10, copied = 5, nan_query = 7;
  for (auto [p, mode] : {std::pair{Precision::Fp16, ComputeMode::Fp32Accurate},
                         std::pair{Precision::Bf16, ComputeMode::Fp32Accurate},
                         std::pair{Precision::Fp32, ComputeMode::Fp32Accurate}})
    for (Metric m : {Metric::L2, Metric::InnerProduct, Metric::Cosine}) {
      INFO(to_string(p) << " " << to_string(m));
      auto qh = gpu_random(nq * dim), xh = gpu_random(n * dim);
      for (std::size_t j = 1000; j < 1100; ++j)
        std::copy(qh.begin() + copied * dim, qh.begin() + (copied + 1) * dim, xh.begin() + j * dim);
      std::fill(xh.begin() + 2000 * dim, xh.begin() + 2001 * dim, 0.0f);
      GpuInput q = gpu_input(c, qh, dim, p), x = gpu_input(c, xh, dim, p);
      DistanceOptions o{.dim = dim, .metric = m, .mode = mode,
                        .query_scales = q.scales ? &*q.scales : nullptr,
                        .corpus_scales = x.scales ? &*x.scales : nullptr};
      auto nn = knn(c.pool, q.data, x.data, k, o);
      REQUIRE(nn);
      CHECK(nn->path == KnnPath::Filtered);
      CHECK(knn_mismatches(qh, xh, dim, k, m, gpu_tol(p, mode), *nn) == 0);
      auto id = *indices_to_host(nn->indices);
      for (std::size_t r = 0; r < k; ++r) {
        CHECK(id[copied * k + r] >= 1000);
        CHECK(id[copied * k + r] < 1100);
      }

      qh[nan_query * dim + 3] = kGpuNaN;
      GpuInput with_nan = gpu_input(c, qh, dim, p);
      o.query_scales = with_nan.scales ? &*with_nan.scales : nullptr;
      auto nan_nn = knn(c.pool, with_nan.data, x.data, k, o);
      REQUIRE(nan_nn);
      // Fp16 / bf16 thresholds from the sample's minima: the NaN query's is NaN, so it keeps only
      // its first k rows and the call stays filtered.
      if (p != Precision::Fp32) CHECK(nan_nn->path == KnnPath::Filtered);
      auto nan_d = *nan_nn->distances.to_host<float>();
      auto nan_id = *indices_to_host(nan_nn->indices);
      for (std::size_t r = 0; r < k; ++r) {
        CHECK(std::isnan(nan_d[nan_query * k + r]));
        CHECK(nan_id[nan_query * k + r] == static_cast<std::int32_t>(r));
        CHECK(nan_id[copied * k + r] >= 1000);
        CHECK(nan_id[copied * k + r] < 1100);
      }
    }
}

// The streamed kernel (rows over 256 bytes) beside a NaN query: every product of that query
// passes the quick test, so its warps' slots overflow on every tile and the rest take the exact
// test out of line (keep_unstaged). The other queries' answers are those of the same call
// without the NaN, bit for bit (each query's threshold and candidates are its own).
TEST_CASE("GPU knn's streamed filter answers the other queries alike beside a NaN query",
          "[gpu][kernels][filter]") {
  GpuCtx c = gpu_ctx();
  const std::size_t nq = 128, n = 65600, dim = 960, k = 10, nan_query = 7;
  auto qh = gpu_random(nq * dim);
  const auto xh = gpu_random(n * dim);
  auto qh_nan = qh;
  qh_nan[nan_query * dim + 3] = kGpuNaN;
  for (Precision p : {Precision::Fp16, Precision::Bf16})
    for (Metric m : {Metric::L2, Metric::Cosine}) {
      INFO(to_string(p) << " " << to_string(m));
      GpuInput q = gpu_input(c, qh, dim, p), q_nan = gpu_input(c, qh_nan, dim, p),
               x = gpu_input(c, xh, dim, p);
      const DistanceOptions o{.dim = dim, .metric = m};
      poison_results(c, nq, k);
      auto clean = knn(c.pool, q.data, x.data, k, o);
      poison_results(c, nq, k);
      auto with_nan = knn(c.pool, q_nan.data, x.data, k, o);
      REQUIRE(clean);
      REQUIRE(with_nan);
      CHECK(clean->path == KnnPath::Filtered);
      CHECK(with_nan->path == KnnPath::Filtered);
      const auto d = *clean->distances.to_host<float>(), nan_d = *with_nan->distances.to_host<float>();
      const auto id = *indices_to_host(clean->indices), nan_id = *indices_to_host(with_nan->indices);
      std::size_t differing = 0;
      for (std::size_t i = 0; i < nq * k; ++i) {
        if (i / k == nan_query) {
          CHECK(std::isnan(nan_d[i]));
          CHECK(nan_id[i] == static_cast<std::int32_t>(i % k));
        } else if (id[i] != nan_id[i] || std::bit_cast<std::uint32_t>(d[i]) !=
                                              std::bit_cast<std::uint32_t>(nan_d[i])) {
          ++differing;
        }
      }
      CHECK(differing == 0);
    }
}

// Every row twice (rows j and j + n/2 equal, and so their products): a query's k-th distance is
// shared by two rows, and the sample holds copies too. The filter must keep the rows that tie
// with its thresholds (where they come from the sample's group minima: every row at or under
// one), so that of every row the answer holds it holds the copy of smaller index as well.
TEST_CASE("GPU knn's filter breaks ties at its thresholds by index", "[gpu][kernels][filter]") {
  GpuCtx c = gpu_ctx();
  const std::size_t nq = 128, copies = 2, n = copies * 40000, dim = 64;
  for (std::size_t k : {10u, 100u})
    for (Precision p : {Precision::Fp16, Precision::Bf16, Precision::Int8})
      for (Metric m : {Metric::L2, Metric::InnerProduct, Metric::Cosine}) {
        INFO(to_string(p) << " " << to_string(m) << " k " << k);
        auto qh = gpu_random(nq * dim), base = gpu_random(n / copies * dim);
        std::vector<float> xh;
        for (std::size_t copy = 0; copy < copies; ++copy) xh.insert(xh.end(), base.begin(), base.end());
        GpuInput q = gpu_input(c, qh, dim, p), x = gpu_input(c, xh, dim, p);
        auto nn = knn(c.pool, q.data, x.data, k,
                      {.dim = dim, .metric = m, .query_scales = q.scales ? &*q.scales : nullptr,
                       .corpus_scales = x.scales ? &*x.scales : nullptr});
        REQUIRE(nn);
        CHECK(nn->path == KnnPath::Filtered);
        CHECK(knn_mismatches(qh, xh, dim, k, m, gpu_tol(p, ComputeMode::Fp32Accurate), *nn) == 0);
        auto id = *indices_to_host(nn->indices);
        std::size_t missing = 0;
        for (std::size_t i = 0; i < nq; ++i) {
          std::set<std::int32_t> kept(id.begin() + i * k, id.begin() + (i + 1) * k);
          for (std::int32_t r : kept)
            for (auto copy = r % std::int32_t(n / copies); copy < r; copy += std::int32_t(n / copies))
              missing += kept.count(copy) == 0;
        }
        CHECK(missing == 0);
      }
}

TEST_CASE("GPU knn breaks ties by index and sorts NaN last", "[gpu][kernels]") {
  GpuCtx c = gpu_ctx();
  std::size_t dim = 3;
  auto q = gpu_random(dim), xh = gpu_random(12 * dim);
  for (std::size_t row : {9u, 3u, 7u}) std::copy(q.begin(), q.end(), xh.begin() + row * dim);
  xh[5 * dim] = kGpuNaN;
  ManagedBuffer qb = gpu_fp32(c, q), xb = gpu_fp32(c, xh);
  auto nn = knn(c.pool, qb, xb, 12, {.dim = dim});
  REQUIRE(nn);
  auto id = *indices_to_host(nn->indices);
  CHECK(id[0] == 3);
  CHECK(id[1] == 7);
  CHECK(id[2] == 9);
  CHECK(id[11] == 5);
  CHECK(std::isnan((*nn->distances.to_host<float>())[11]));
}

// Two chunks' candidates folded into running lists that start empty, the second's indices
// offset (the knn job's merge of a chunk into its query block's lists, on the device): the k
// best of both in knn's order. Ties across the chunks, random order within each.
TEST_CASE("GPU fold_topk folds chunks like one knn", "[gpu][kernels]") {
  GpuCtx c = gpu_ctx();
  const std::size_t nq = 300, k = 100, per = 250;
  const std::int64_t offset = 5000;
  auto d1 = gpu_random(nq * per), d2 = gpu_random(nq * per);
  std::vector<std::int32_t> i1(nq * per), i2(nq * per);
  std::mt19937 shuffle(7);
  for (std::size_t q = 0; q < nq; ++q) {
    std::iota(i1.begin() + q * per, i1.begin() + (q + 1) * per, 0);
    std::shuffle(i1.begin() + q * per, i1.begin() + (q + 1) * per, shuffle);
    std::copy_n(i1.begin() + q * per, per, i2.begin() + q * per);
    d2[q * per + 7] = d1[q * per + 3];  // a tie: chunk 1's row first
  }
  auto indices = [&](const std::vector<std::int32_t>& v) {
    auto b = c.pool.get_managed_buffer(c.device, v.size() * 4, Precision::Bytes);
    REQUIRE(b);
    REQUIRE(b->upload(std::as_bytes(std::span(v))));
    return std::move(*b);
  };
  ManagedBuffer run_d = gpu_fp32(c, std::vector<float>(nq * k, kGpuNaN));
  ManagedBuffer run_i = indices(std::vector<std::int32_t>(nq * k, -1));
  ManagedBuffer c1d = gpu_fp32(c, d1), c1i = indices(i1), c2d = gpu_fp32(c, d2), c2i = indices(i2);
  REQUIRE(fold_topk(c1d, c1i, run_d, run_i, {.queries = nq, .candidates = per, .k = k}));
  REQUIRE(fold_topk(c2d, c2i, run_d, run_i,
                    {.queries = nq, .candidates = per, .k = k, .index_offset = offset}));
  auto gd = *run_d.to_host<float>();
  auto gi = *indices_to_host(run_i);
  std::size_t wrong = 0;
  for (std::size_t q = 0; q < nq; ++q) {
    std::vector<std::pair<float, std::int32_t>> all;
    for (std::size_t j = q * per; j < (q + 1) * per; ++j) {
      all.emplace_back(d1[j], i1[j]);
      all.emplace_back(d2[j], static_cast<std::int32_t>(i2[j] + offset));
    }
    std::sort(all.begin(), all.end());
    for (std::size_t r = 0; r < k; ++r)
      wrong += gd[q * k + r] != all[r].first || gi[q * k + r] != all[r].second;
  }
  CHECK(wrong == 0);
}

TEST_CASE("GPU merge_topk and row_norms", "[gpu][kernels]") {
  GpuCtx c = gpu_ctx();
  std::size_t nq = 3, lists = 4, len = 50, k = 20;
  auto d = gpu_random(nq * lists * len);
  std::vector<std::int32_t> idx(d.size());
  for (std::size_t i = 0; i < d.size(); ++i) idx[i] = static_cast<std::int32_t>(i % (lists * len));
  ManagedBuffer db = gpu_fp32(c, d);
  auto ib = c.pool.get_managed_buffer(c.device, idx.size() * 4, Precision::Bytes);
  auto od = c.pool.get_managed_buffer(c.device, nq * k, Precision::Fp32);
  auto oi = c.pool.get_managed_buffer(c.device, nq * k * 4, Precision::Bytes);
  REQUIRE(ib);
  REQUIRE(od);
  REQUIRE(oi);
  REQUIRE(ib->upload(std::as_bytes(std::span(idx))));
  REQUIRE(merge_topk(db, *ib, *od, *oi, {.queries = nq, .lists = lists, .list_length = len, .k = k}));
  auto gd = *od->to_host<float>();
  auto gi = *indices_to_host(*oi);
  for (std::size_t q = 0; q < nq; ++q) {
    std::vector<std::pair<float, std::int32_t>> all;
    for (std::size_t j = 0; j < lists * len; ++j) all.emplace_back(d[q * lists * len + j], idx[q * lists * len + j]);
    std::sort(all.begin(), all.end());
    for (std::size_t r = 0; r < k; ++r) {
      CHECK(gd[q * k + r] == all[r].first);
      CHECK(gi[q * k + r] == all[r].second);
    }
  }
  auto v = gpu_random(9 * 21);
  ManagedBuffer vb = gpu_fp32(c, v), nb = gpu_fp32(c, std::vector<float>(9, kGpuNaN));
  REQUIRE(row_norms(vb, nb, 21));
  auto got = *nb.to_host<float>();
  for (std::size_t r = 0; r < 9; ++r) {
    double ref = 0;
    for (std::size_t i = 0; i < 21; ++i) ref += double(v[r * 21 + i]) * v[r * 21 + i];
    CHECK(got[r] == Approx(ref).epsilon(2e-5));
  }
  // Low-precision rows: 16-byte pieces where a row is whole pieces (fp16 dim 8, 128, 600 with 75
  // pieces a row: lanes loop; int8 dim 16, 1024), one value a lane otherwise (dim 21, 37). The
  // reference is the fp64 sum of the stored values (convert widens them exactly; int8 times its
  // scale).
  for (auto [p, dim] : {std::pair{Precision::Fp16, 8}, std::pair{Precision::Fp16, 128},
                        std::pair{Precision::Bf16, 600}, std::pair{Precision::Bf16, 21},
                        std::pair{Precision::Int8, 16}, std::pair{Precision::Int8, 1024},
                        std::pair{Precision::Int8, 37}}) {
    INFO(to_string(p) << " dim " << dim);
    std::size_t rows = 33;
    auto host = gpu_random(rows * dim);
    GpuInput in = gpu_input(c, host, dim, p);
    ManagedBuffer norms = gpu_fp32(c, std::vector<float>(rows, kGpuNaN));
    REQUIRE(row_norms(in.data, norms, dim, in.scales ? &*in.scales : nullptr));
    ManagedBuffer widened = gpu_fp32(c, std::vector<float>(rows * dim, kGpuNaN));
    REQUIRE(convert(in.data, widened, {.dim = std::size_t(dim),
                                       .scales = in.scales ? &*in.scales : nullptr}));
    auto stored = *widened.to_host<float>();  // the stored values, dequantised
    auto norms_got = *norms.to_host<float>();
    for (std::size_t r = 0; r < rows; ++r) {
      double ref = 0;
      for (std::size_t i = 0; i < std::size_t(dim); ++i)
        ref += double(stored[r * dim + i]) * stored[r * dim + i];
      CHECK(norms_got[r] == Approx(ref).epsilon(2e-5));
    }
  }
}

namespace {

// Re-ranked knn checked against the exact kNN; returns the queries the low precision alone got
// wrong (as index sets).
std::size_t gpu_check_rerank(GpuCtx& c, std::size_t nq, std::size_t n, std::size_t dim,
                             std::size_t k, Precision p, Metric m, float spread) {
  INFO(to_string(p) << " " << to_string(m) << " " << nq << "×" << n << "×" << dim << " k " << k
                    << " spread " << spread);
  auto qh = seeded_values(nq * dim, 42);
  auto xh = spread > 0 ? crowded_corpus(qh, nq, n, dim, n / 2, spread, 43) : seeded_values(n * dim, 43);
  GpuInput q = gpu_input(c, qh, dim, p), x = gpu_input(c, xh, dim, p);
  ManagedBuffer q32 = gpu_fp32(c, qh), x32 = gpu_fp32(c, xh);
  DistanceOptions o{.dim = dim, .metric = m, .query_scales = q.scales ? &*q.scales : nullptr,
                    .corpus_scales = x.scales ? &*x.scales : nullptr};
  auto plain = knn(c.pool, q.data, x.data, k, o);
  o.rerank = {.queries = &q32, .corpus = &x32};
  auto reranked = knn(c.pool, q.data, x.data, k, o);
  REQUIRE(plain);
  REQUIRE(reranked);
  auto rd = *reranked->distances.to_host<float>();
  auto ri = *indices_to_host(reranked->indices);
  CHECK(inexact_queries(qh, xh, dim, k, m, rd, ri, true) == 0);
  return inexact_queries(qh, xh, dim, k, m, *plain->distances.to_host<float>(),
                         *indices_to_host(plain->indices), false);
}

}  // namespace

TEST_CASE("GPU re-ranked knn is the exact fp32 knn where the low precision alone is not",
          "[gpu][kernels][rerank]") {
  GpuCtx c = gpu_ctx();
  // As tests/kernels_test.cpp, with more queries: half the corpus crowds around the queries.
  struct Case {
    Precision p;
    Metric m;
    std::size_t nq, n, dim;
    float spread;
  };
  for (Case t : {Case{Precision::Fp16, Metric::L2, 128, 16000, 20, 0.01f},
                 Case{Precision::Fp16, Metric::InnerProduct, 128, 16000, 20, 0.01f},
                 Case{Precision::Fp16, Metric::Cosine, 1024, 4000, 64, 0.0f},
                 Case{Precision::Bf16, Metric::L2, 128, 16000, 20, 0.03f},
                 Case{Precision::Bf16, Metric::InnerProduct, 128, 16000, 20, 0.03f},
                 Case{Precision::Bf16, Metric::Cosine, 128, 16000, 20, 0.1f},
                 Case{Precision::Int8, Metric::L2, 128, 16000, 20, 0.03f},
                 Case{Precision::Int8, Metric::InnerProduct, 128, 16000, 20, 0.03f},
                 Case{Precision::Int8, Metric::Cosine, 128, 16000, 20, 0.1f}}) {
    std::size_t wrong = gpu_check_rerank(c, t.nq, t.n, t.dim, 10, t.p, t.m, t.spread);
    INFO(to_string(t.p) << " " << to_string(t.m) << ": " << wrong << " of " << t.nq
                        << " queries wrong without re-rank");
    CHECK(wrong >= 1);
  }
  // Odd shapes: one query, N < C (every row re-ranked), D = 1, D not a multiple of 8, k = N.
  for (Precision p : {Precision::Fp16, Precision::Bf16, Precision::Int8}) {
    gpu_check_rerank(c, 1, 500, 16, 5, p, Metric::L2, 0.0f);
    gpu_check_rerank(c, 4, 30, 12, 10, p, Metric::L2, 0.0f);
    gpu_check_rerank(c, 3, 200, 1, 4, p, Metric::L2, 0.0f);
    gpu_check_rerank(c, 5, 300, 13, 7, p, Metric::Cosine, 0.0f);
    gpu_check_rerank(c, 2, 40, 37, 40, p, Metric::InnerProduct, 0.0f);
  }
}

TEST_CASE("convert_stored on the GPU turns stored values into the kernels' forms exactly", "[gpu]") {
  GpuCtx c = gpu_ctx();
  gpupool::test::check_convert_stored(c.pool, c.device);
}
