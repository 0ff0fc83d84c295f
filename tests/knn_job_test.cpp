// The exact-kNN job (tools/knn): every input format, a base larger than the simulated device,
// out-of-memory retries, bad and corrupt inputs, the output writers, recall@k with ties, and
// Fashion-MNIST — always checked against an fp64 brute force (tie-tolerant) and, where the
// computation is the same, against one knn() call over the whole base.
#include <catch2/catch.hpp>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <expected>
#include <filesystem>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <system_error>
#include <unistd.h>
#include <vector>
#include <rapidcheck.h>
#include <rapidcheck/catch.h>
#include "support/vector_files.hpp"
#include "chunk_plan.hpp"
#include "exact_knn.hpp"
#include "recall.hpp"

using namespace gpupool;
using namespace gpupool::exact;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() /
            ("gpupool-knn-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  fs::path operator/(const std::string& name) const { return path_ / name; }
  std::size_t file_count() const {
    return static_cast<std::size_t>(std::distance(fs::directory_iterator(path_), fs::directory_iterator()));
  }

 private:
  fs::path path_;
};

VectorSet random_floats(std::size_t rows, std::size_t dim, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  VectorSet set{rows, dim, std::vector<float>(rows * dim)};
  for (float& v : set.values) v = value(rng);
  return set;
}

template <class T>
std::vector<T> random_ints(std::size_t count, int low, int high, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> value(low, high);
  std::vector<T> out(count);
  for (T& v : out) v = static_cast<T>(value(rng));
  return out;
}

template <class T>
VectorSet as_floats(const std::vector<T>& values, std::size_t dim) {
  return {values.size() / dim, dim, std::vector<float>(values.begin(), values.end())};
}

double distance64(const float* q, const float* x, std::size_t dim, Metric metric) {
  double sum = 0, dot = 0, qq = 0, xx = 0;
  for (std::size_t c = 0; c < dim; ++c) {
    double a = q[c], b = x[c];
    sum += (a - b) * (a - b);
    dot += a * b;
    qq += a * a;
    xx += b * b;
  }
  if (metric == Metric::L2) return sum;
  if (metric == Metric::InnerProduct) return -dot;
  if (qq == 0 || xx == 0) return 1;
  return 1 - dot / std::sqrt(qq * xx);
}

// The tolerance's scale, as docs/kernels.md defines it per metric.
double scale64(const float* q, const float* x, std::size_t dim, Metric metric) {
  double qq = 0, xx = 0;
  for (std::size_t c = 0; c < dim; ++c) {
    qq += double{q[c]} * q[c];
    xx += double{x[c]} * x[c];
  }
  if (metric == Metric::L2) return qq + xx;
  if (metric == Metric::InnerProduct) return std::sqrt(qq * xx);
  return 1;
}

// Exact kNN up to ties, against an fp64 loop over `sampled` queries: every answer is a distinct
// base row whose true distance is no worse than the true k-th distance (within tol × scale), and
// its reported distance is its true one. Returns the number of violations (0 = exact).
std::size_t brute_force_mismatches(const VectorSet& queries, const VectorSet& base,
                                   const Neighbours& got, Metric metric, double tol,
                                   std::size_t sampled) {
  std::size_t bad = 0, k = got.k, step = std::max<std::size_t>(1, queries.rows / sampled);
  std::vector<double> all(base.rows);
  for (std::size_t q = 0; q < queries.rows; q += step) {
    const float* qv = queries.values.data() + q * queries.dim;
    for (std::size_t j = 0; j < base.rows; ++j)
      all[j] = distance64(qv, base.values.data() + j * base.dim, base.dim, metric);
    std::vector<double> sorted = all;
    std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(k - 1), sorted.end());
    double kth = sorted[k - 1];
    std::vector<std::int32_t> ids(got.indices.begin() + static_cast<std::ptrdiff_t>(q * k),
                                  got.indices.begin() + static_cast<std::ptrdiff_t>((q + 1) * k));
    for (std::size_t j = 0; j < k; ++j) {
      std::int32_t id = ids[j];
      if (id < 0 || static_cast<std::size_t>(id) >= base.rows) { ++bad; continue; }
      const float* xv = base.values.data() + static_cast<std::size_t>(id) * base.dim;
      double allowed = tol * scale64(qv, xv, base.dim, metric);
      if (all[id] > kth + allowed) ++bad;
      if (std::fabs(got.distances[q * k + j] - all[id]) > allowed) ++bad;
      if (j > 0 && got.distances[q * k + j] < got.distances[q * k + j - 1]) ++bad;
    }
    std::sort(ids.begin(), ids.end());
    if (std::adjacent_find(ids.begin(), ids.end()) != ids.end()) ++bad;
  }
  return bad;
}

// One knn() call over the whole base on a roomy simulated device: what the job must equal.
Neighbours single_call(const VectorSet& queries, const VectorSet& base, std::size_t k, Metric metric) {
  auto device = Device::simulated({.capacity = 256 * MiB});
  REQUIRE(device);
  GpuMemoryPool pool;
  auto q = pool.get_managed_buffer(*device, queries.values.size(), Precision::Fp32);
  auto x = pool.get_managed_buffer(*device, base.values.size(), Precision::Fp32);
  REQUIRE(q);
  REQUIRE(x);
  REQUIRE(q->upload(std::span<const float>(queries.values)));
  REQUIRE(x->upload(std::span<const float>(base.values)));
  auto found = gpupool::knn(pool, *q, *x, k, {.dim = queries.dim, .metric = metric});
  REQUIRE(found);
  auto d = found->distances.to_host<float>();
  auto i = indices_to_host(found->indices);
  REQUIRE(d);
  REQUIRE(i);
  return {queries.rows, k, *d, *i};
}

struct Run {
  Result<JobResult> result;
  std::vector<Progress> progress;
};

Run run_job(const VectorSet& queries, const fs::path& base_file, JobOptions options,
            std::size_t capacity = 64 * MiB, std::optional<FaultInjection> faults = std::nullopt) {
  auto device = Device::simulated({.capacity = capacity});
  REQUIRE(device);
  if (faults) REQUIRE(device->inject_faults(*faults));
  GpuMemoryPool pool;
  auto base = io::VectorReader::open(base_file);
  REQUIRE(base);
  auto progress = std::make_shared<std::vector<Progress>>();
  options.on_progress = [progress](const Progress& p) { progress->push_back(p); };
  auto result = run_exact_knn(pool, *device, queries, *base, options);
  return {std::move(result), *progress};
}

fs::path write_fvecs_file(const TempDir& dir, const std::string& name, const VectorSet& set) {
  fs::path path = dir / name;
  REQUIRE(io::write_fvecs(path, set.rows, set.dim, std::span<const float>(set.values)));
  return path;
}

}  // namespace

TEST_CASE("the streamed job equals one knn call and an fp64 brute force in every input format",
          "[knn-job]") {
  TempDir dir;
  constexpr std::size_t rows = 700, dim = 12, k = 9;
  Metric metric = GENERATE(Metric::L2, Metric::InnerProduct, Metric::Cosine);
  VectorSet queries = random_floats(23, dim, 1);
  auto check = [&](const fs::path& path, const VectorSet& base) {
    CAPTURE(path.filename().string(), to_string(metric));
    // Uneven chunks of 97 rows, so the last one is short and chunk borders fall anywhere.
    auto run = run_job(queries, path, {.k = k, .metric = metric, .max_chunk_rows = 97});
    REQUIRE(run.result);
    const Neighbours& got = run.result->neighbours;
    CHECK(run.result->summary.chunks == (rows + 96) / 97);
    CHECK(brute_force_mismatches(queries, base, got, metric, 2e-5, queries.rows) == 0);
    Neighbours one = single_call(queries, base, k, metric);
    CHECK(got.indices == one.indices);
    CHECK(got.distances == one.distances);
  };
  SECTION("fvecs") {
    VectorSet base = random_floats(rows, dim, 2);
    check(write_fvecs_file(dir, "base.fvecs", base), base);
  }
  SECTION("bvecs") {
    auto bytes = random_ints<std::uint8_t>(rows * dim, 0, 255, 3);
    test::write_bytes(dir / "base.bvecs", test::texmex_bytes(bytes, dim));
    check(dir / "base.bvecs", as_floats(bytes, dim));
  }
  SECTION("IDX, plain and gzip") {
    auto bytes = random_ints<std::uint8_t>(rows * dim, 0, 255, 4);
    test::write_bytes(dir / "base-idx3-ubyte", test::idx_bytes(bytes, dim));
    test::write_gzip(dir / "base-idx3-ubyte.gz", test::idx_bytes(bytes, dim));
    check(dir / "base-idx3-ubyte", as_floats(bytes, dim));
    check(dir / "base-idx3-ubyte.gz", as_floats(bytes, dim));
  }
  SECTION("npy float32") {
    VectorSet base = random_floats(rows, dim, 5);
    test::write_bytes(dir / "base.npy", test::npy_bytes(base.values, dim, "<f4"));
    check(dir / "base.npy", base);
  }
  SECTION("npy float16") {
    VectorSet wide = random_floats(rows, dim, 6);
    std::vector<std::uint16_t> halves;
    VectorSet base{rows, dim, {}};
    for (float v : wide.values) {
      halves.push_back(to_half(v).bits);
      base.values.push_back(to_float(Half{halves.back()}));
    }
    test::write_bytes(dir / "base.npy", test::npy_bytes(halves, dim, "<f2"));
    check(dir / "base.npy", base);
  }
  SECTION("ivecs and npy int32") {
    auto ints = random_ints<std::int32_t>(rows * dim, -100000, 100000, 9);
    REQUIRE(io::write_ivecs(dir / "base.ivecs", rows, dim, std::span<const std::int32_t>(ints)));
    REQUIRE(io::write_npy(dir / "base.npy", rows, dim, std::span<const std::int32_t>(ints)));
    check(dir / "base.ivecs", as_floats(ints, dim));
    check(dir / "base.npy", as_floats(ints, dim));
  }
  SECTION("npy uint8 and int8") {
    auto unsigned_bytes = random_ints<std::uint8_t>(rows * dim, 0, 255, 8);
    test::write_bytes(dir / "u.npy", test::npy_bytes(unsigned_bytes, dim, "|u1"));
    check(dir / "u.npy", as_floats(unsigned_bytes, dim));
    auto signed_bytes = random_ints<std::int8_t>(rows * dim, -128, 127, 7);
    test::write_bytes(dir / "i.npy", test::npy_bytes(signed_bytes, dim, "|i1"));
    check(dir / "i.npy", as_floats(signed_bytes, dim));
  }
}

TEST_CASE("a base larger than the simulated device is streamed in chunks that fit", "[knn-job]") {
  TempDir dir;
  VectorSet queries = random_floats(16, 128, 11);
  VectorSet base = random_floats(8192, 128, 12);  // 4 MiB of fp32 on a 1 MiB device
  fs::path path = write_fvecs_file(dir, "big.fvecs", base);
  auto run = run_job(queries, path, {.k = 10}, 1 * MiB);
  REQUIRE(run.result);
  const JobSummary& summary = run.result->summary;
  CHECK(summary.chunks >= 5);
  CHECK(summary.pool.peak_reserved_bytes <= 1 * MiB);
  CHECK(summary.base_rows == 8192);
  CHECK(brute_force_mismatches(queries, base, run.result->neighbours, Metric::L2, 2e-5, 16) == 0);
  Neighbours one = single_call(queries, base, 10, Metric::L2);
  CHECK(run.result->neighbours.indices == one.indices);
}

TEST_CASE("a chunk that runs out of device memory is halved and no finished chunk is redone",
          "[knn-job]") {
  TempDir dir;
  VectorSet queries = random_floats(8, 32, 21);
  VectorSet base = random_floats(3000, 32, 22);
  fs::path path = write_fvecs_file(dir, "base.fvecs", base);
  // Every allocation over 16 KiB fails: chunks of more than 128 rows (128 B each) cannot exist.
  auto run = run_job(queries, path, {.k = 5}, 64 * MiB, FaultInjection{.fail_above_bytes = 16 * KiB});
  REQUIRE(run.result);
  const JobSummary& summary = run.result->summary;
  CHECK(summary.retries >= 1);
  CHECK(summary.largest_chunk_rows * 32 * sizeof(float) <= 16 * KiB);
  CHECK(summary.pool.out_of_memory_errors >= 1);
  // Progress only moves forward and adds up to the base exactly once.
  REQUIRE(run.progress.size() == summary.chunks);
  std::size_t previous = 0;
  for (const Progress& p : run.progress) {
    CHECK(p.base_rows_done > previous);
    previous = p.base_rows_done;
  }
  CHECK(previous == 3000);
  CHECK(brute_force_mismatches(queries, base, run.result->neighbours, Metric::L2, 2e-5, 8) == 0);
  Neighbours one = single_call(queries, base, 5, Metric::L2);
  CHECK(run.result->neighbours.indices == one.indices);
}

TEST_CASE("a device too small for even one chunk fails with the rows and the file named",
          "[knn-job]") {
  TempDir dir;
  VectorSet queries = random_floats(64, 4, 31);  // 1 KiB
  fs::path path = write_fvecs_file(dir, "base.fvecs", random_floats(100, 4, 32));
  // Everything over 2 KiB fails: the queries and a chunk fit, the merge's 64 × 2k candidates never.
  auto run = run_job(queries, path, {.k = 8}, 64 * MiB, FaultInjection{.fail_above_bytes = 2 * KiB});
  REQUIRE_FALSE(run.result);
  CHECK(run.result.error().is_out_of_memory());
  CHECK_THAT(run.result.error().message(), Contains("base rows 0..0") && Contains(path.string()) &&
                                               Contains("one base row"));
}

TEST_CASE("fp16, bf16 and int8 runs are exact up to their precision", "[knn-job]") {
  TempDir dir;
  VectorSet queries = random_floats(12, 48, 41);
  VectorSet base = random_floats(900, 48, 42);
  fs::path path = write_fvecs_file(dir, "base.fvecs", base);
  auto [precision, tol] = GENERATE(std::pair{Precision::Fp16, 2e-3}, std::pair{Precision::Bf16, 1.6e-2},
                                   std::pair{Precision::Int8, 2.5e-2});
  Metric metric = GENERATE(Metric::L2, Metric::InnerProduct);
  CAPTURE(to_string(precision), to_string(metric));
  auto run = run_job(queries, path, {.k = 8, .metric = metric, .precision = precision,
                                     .max_chunk_rows = 200});
  REQUIRE(run.result);
  CHECK(run.result->summary.precision == precision);
  CHECK(brute_force_mismatches(queries, base, run.result->neighbours, metric, tol, 12) == 0);
}

TEST_CASE("bad job inputs are refused, naming the value and what was expected", "[knn-job]") {
  TempDir dir;
  VectorSet queries = random_floats(3, 8, 51);
  fs::path path = write_fvecs_file(dir, "base.fvecs", random_floats(50, 8, 52));
  auto refused = [&](const VectorSet& q, JobOptions options) {
    auto run = run_job(q, path, std::move(options));
    REQUIRE_FALSE(run.result);
    CHECK(run.result.error().kind() == ErrorKind::InvalidInput);
    return run.result.error().message();
  };
  CHECK_THAT(refused(queries, {.k = 0}), Contains("k = 0") && Contains("1..1024"));
  CHECK_THAT(refused(queries, {.k = 1025}), Contains("k = 1025"));
  CHECK_THAT(refused(queries, {.k = 51}),
             Contains("k = 51") && Contains("50 rows") && Contains(path.string()) && Contains("k <= 50"));
  CHECK_THAT(refused(random_floats(3, 9, 53), {.k = 5}),
             Contains("dimension 8") && Contains("the queries have 9") && Contains(path.string()));
  CHECK_THAT(refused(VectorSet{0, 8, {}}, {.k = 5}), Contains("0 rows"));
  CHECK_THAT(refused(queries, {.k = 5, .precision = Precision::Bytes}), Contains("precision = bytes"));
  CHECK_THAT(refused(queries, {.k = 5, .max_chunk_rows = 0}), Contains("max_chunk_rows = 0"));
}

TEST_CASE("a corrupt base file stops the job with the file and the record named", "[knn-job]") {
  TempDir dir;
  VectorSet queries = random_floats(2, 4, 61);
  VectorSet good = random_floats(300, 4, 62);
  test::Bytes bytes = test::texmex_bytes(good.values, 4);
  // Record 200 claims dimension 5: the reader finds it when the job gets there.
  std::size_t record = 200, offset = record * (4 + 4 * sizeof(float));
  bytes[offset] = 5;
  fs::path path = dir / "changing.fvecs";
  test::write_bytes(path, bytes);
  auto run = run_job(queries, path, {.k = 3, .max_chunk_rows = 64});
  REQUIRE_FALSE(run.result);
  CHECK(run.result.error().kind() == ErrorKind::InvalidInput);
  CHECK_THAT(run.result.error().message(), Contains(path.string()) && Contains("record 200"));
  CHECK_FALSE(run.progress.empty());  // chunks before the bad record were processed
}

TEST_CASE("results are written atomically as ivecs + fvecs or npy, and read back exactly",
          "[knn-job]") {
  TempDir dir;
  Neighbours n{3, 2, {0.5f, 1.5f, 0.25f, 0.75f, 2.0f, 3.0f}, {4, 1, 0, 2, 9, 7}};
  auto format = GENERATE(OutputFormat::Texmex, OutputFormat::Npy);
  auto files = write_neighbours(n, dir / "run", format);
  REQUIRE(files);
  CHECK(files->neighbours.filename() == (format == OutputFormat::Npy ? "run.neighbors.npy"
                                                                     : "run.neighbors.ivecs"));
  auto ids = io::VectorReader::open(files->neighbours);
  auto distances = io::VectorReader::open(files->distances);
  REQUIRE(ids);
  REQUIRE(distances);
  CHECK((ids->rows() == 3 && ids->dim() == 2 && distances->rows() == 3 && distances->dim() == 2));
  std::vector<std::int32_t> id_values(6, -7);
  std::vector<float> distance_values(6, -7.0f);
  CHECK(ids->read_ints(id_values, 3) == 3u);
  CHECK(distances->read(distance_values, 3) == 3u);
  CHECK(id_values == n.indices);
  CHECK(distance_values == n.distances);

  SECTION("a failed second file takes the first one away again") {
    TempDir other;
    fs::create_directories(other / "run.distances.fvecs");  // a directory where the file goes
    auto failed = write_neighbours(n, other / "run", OutputFormat::Texmex);
    REQUIRE_FALSE(failed);
    CHECK(failed.error().kind() == ErrorKind::Io);
    CHECK_FALSE(fs::exists(other / "run.neighbors.ivecs"));
    CHECK(other.file_count() == 1);
  }
}

TEST_CASE("chunk rows follow the headroom, and out-of-memory halves them", "[knn-job]") {
  ChunkCost cost{.bytes_per_row = 100, .fixed_bytes = 1000};
  CHECK(pick_chunk_rows(0, cost, 50) == 1);
  CHECK(pick_chunk_rows(1000 + 3 * 100 * 7, cost, 50) == 7);
  CHECK(pick_chunk_rows(std::size_t{1} << 40, cost, 50) == 50);
  rc::prop("more headroom never gives fewer rows", [](std::uint32_t a, std::uint32_t b) {
    ChunkCost c{.bytes_per_row = 384, .fixed_bytes = 4096};
    std::size_t low = std::min(a, b), high = std::max(a, b);
    RC_ASSERT(pick_chunk_rows(low, c, 1000) <= pick_chunk_rows(high, c, 1000));
  });

  auto device = Device::simulated({.capacity = 1 * MiB});
  REQUIRE(device);
  GpuMemoryPool pool;
  {
    auto cached = pool.get_managed_buffer(*device, 1000, Precision::Fp32);  // freed into the cache
    REQUIRE(cached);
  }
  REQUIRE(pool.stats(*device).cached_bytes > 0);
  ChunkPlan plan(pool, *device, cost, 1000);
  CHECK(plan.next_rows(5) == 5);
  GpuError oom(ErrorKind::OutOfMemory, "no room");
  CHECK(plan.shrink_after(oom, 600) == 300u);
  CHECK(pool.stats(*device).cached_bytes == 0);  // the cache was trimmed
  CHECK(plan.next_rows(100000) <= 300);
  CHECK(plan.shrink_after(GpuError(ErrorKind::PoolLimitExceeded, "limit"), 300) == 150u);
  CHECK(plan.retries() == 2);
  auto other = plan.shrink_after(GpuError(ErrorKind::Io, "disk"), 150);
  REQUIRE_FALSE(other);
  CHECK(other.error().kind() == ErrorKind::Io);
  auto last = plan.shrink_after(oom, 1);
  REQUIRE_FALSE(last);
  CHECK_THAT(last.error().message(), Contains("one base row"));
}

TEST_CASE("recall@k counts ties only with distances, and each id once", "[knn-job]") {
  RecallInputs in;
  in.truth = {2, 3, {1, 2, 3, 4, 5, 6}};
  in.result = {2, 3, {2, 1, 9, 6, 6, 4}};  // query 0: 9 is not in the truth; query 1: 6 twice
  auto plain = compute_recall(in, 3, 1e-5);
  REQUIRE(plain);
  CHECK(plain->hits == 4);
  CHECK(plain->recall == Approx(4.0 / 6));
  CHECK(plain->worst_query_recall == Approx(2.0 / 3));
  CHECK_FALSE(plain->tie_tolerant);

  in.truth_distances = Table<float>{2, 3, {0.1f, 0.2f, 0.3f, 1, 2, 3}};
  in.result_distances = Table<float>{2, 3, {0.1f, 0.2f, 0.3f, 1, 1, 3}};  // 9 ties the 3rd
  auto tied = compute_recall(in, 3, 1e-5);
  REQUIRE(tied);
  CHECK(tied->hits == 5);
  CHECK(tied->tie_hits == 1);
  in.result_distances->values[2] = 0.31f;  // no longer a tie
  CHECK(compute_recall(in, 3, 1e-5)->hits == 4);
  CHECK(compute_recall(in, 2, 1e-5)->recall == Approx(3.0 / 4));  // recall@2: 2,1 | 6,(6)

  auto refused = [&](const RecallInputs& bad, std::size_t k) {
    auto r = compute_recall(bad, k, 1e-5);
    REQUIRE_FALSE(r);
    CHECK(r.error().kind() == ErrorKind::InvalidInput);
    return r.error().message();
  };
  CHECK_THAT(refused(in, 4), Contains("3 neighbours per query") && Contains("k = 4"));
  CHECK_THAT(refused(in, 0), Contains("k = 0"));
  RecallInputs short_result = in;
  short_result.result = {1, 3, {1, 2, 3}};
  CHECK_THAT(refused(short_result, 3), Contains("1 queries") && Contains("expected 2"));
  RecallInputs one_sided = in;
  one_sided.result_distances.reset();
  CHECK_THAT(refused(one_sided, 3), Contains("only one"));
}

TEST_CASE("recall from files reads ivecs, fvecs and npy", "[knn-job]") {
  TempDir dir;
  std::vector<std::int32_t> truth{0, 1, 2, 3}, result{1, 0, 3, 5};
  std::vector<float> truth_d{1, 2, 1, 2}, result_d{1, 2, 1, 2};
  REQUIRE(io::write_ivecs(dir / "t.ivecs", 2, 2, std::span<const std::int32_t>(truth)));
  REQUIRE(io::write_npy(dir / "r.npy", 2, 2, std::span<const std::int32_t>(result)));
  REQUIRE(io::write_fvecs(dir / "td.fvecs", 2, 2, std::span<const float>(truth_d)));
  REQUIRE(io::write_npy(dir / "rd.npy", 2, 2, std::span<const float>(result_d)));
  auto plain = recall_from_files({dir / "t.ivecs", dir / "r.npy", {}, {}}, 2, 1e-5);
  REQUIRE(plain);
  CHECK(plain->recall == Approx(0.75));
  auto tied = recall_from_files({dir / "t.ivecs", dir / "r.npy", dir / "td.fvecs", dir / "rd.npy"}, 2, 1e-5);
  REQUIRE(tied);
  CHECK(tied->recall == Approx(1.0));
  auto missing = recall_from_files({dir / "none.ivecs", dir / "r.npy", {}, {}}, 2, 1e-5);
  REQUIRE_FALSE(missing);
  CHECK_THAT(missing.error().message(), Contains("none.ivecs"));
}

namespace {

constexpr const char* kFashion = "/usr/share/datasets/fashion-mnist";

VectorSet read_rows(const fs::path& path, std::size_t rows) {
  auto reader = io::VectorReader::open(path);
  REQUIRE(reader);
  VectorSet set{rows, reader->dim(), std::vector<float>(rows * reader->dim())};
  REQUIRE(reader->read(set.values, rows) == rows);
  return set;
}

}  // namespace

TEST_CASE("Fashion-MNIST: 20 test images against all training images, 10 checked by an fp64 loop",
          "[knn-job][fashion-mnist]") {
  fs::path train = fs::path(kFashion) / "train-images-idx3-ubyte.gz";
  fs::path test_images = fs::path(kFashion) / "t10k-images-idx3-ubyte.gz";
  REQUIRE(fs::exists(train));  // tools/setup.sh installs dataset-fashion-mnist
  VectorSet queries = read_rows(test_images, 20);
  auto run = run_job(queries, train, {.k = 100}, 64 * MiB);
  REQUIRE(run.result);
  VectorSet base = read_rows(train, 60000);
  CHECK(run.result->summary.chunks >= 2);
  CHECK(brute_force_mismatches(queries, base, run.result->neighbours, Metric::L2, 1e-6, 10) == 0);
}

// Run by tools/test.sh after the release build's default job (`gpupool` with no arguments) has
// written its files: GPUPOOL_KNN_DEFAULT_PREFIX names them. Hidden from the ordinary runs.
TEST_CASE("the Fashion-MNIST default run's output matches an fp64 loop over sampled queries",
          "[.default-run]") {
  const char* prefix = std::getenv("GPUPOOL_KNN_DEFAULT_PREFIX");
  REQUIRE(prefix != nullptr);
  auto ids = io::VectorReader::open(std::string(prefix) + ".neighbors.ivecs");
  auto distances = io::VectorReader::open(std::string(prefix) + ".distances.fvecs");
  REQUIRE(ids);
  REQUIRE(distances);
  REQUIRE((ids->rows() == 10000 && ids->dim() == 100));
  REQUIRE((distances->rows() == 10000 && distances->dim() == 100));
  Neighbours got{10000, 100, std::vector<float>(10000 * 100), std::vector<std::int32_t>(10000 * 100)};
  REQUIRE(ids->read_ints(got.indices, 10000) == 10000u);
  REQUIRE(distances->read(got.distances, 10000) == 10000u);
  VectorSet queries = read_rows(fs::path(kFashion) / "t10k-images-idx3-ubyte.gz", 10000);
  VectorSet base = read_rows(fs::path(kFashion) / "train-images-idx3-ubyte.gz", 60000);
  CHECK(brute_force_mismatches(queries, base, got, Metric::L2, 1e-6, 20) == 0);
}
