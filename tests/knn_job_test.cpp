// The exact-kNN job (tools/knn): every input format, a base larger than the simulated device,
// out-of-memory retries, bad and corrupt inputs, the output writers, recall@k with ties, and
// Fashion-MNIST — always checked against an fp64 brute force (tie-tolerant) and, where the
// computation is the same, against one knn() call over the whole base.
#include <catch2/catch.hpp>
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <expected>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <ranges>
#include <set>
#include <span>
#include <string>
#include <system_error>
#include <chrono>
#include <thread>
#include <unistd.h>
#if defined(__linux__)
#include <sched.h>
#endif
#include <vector>
#include <rapidcheck.h>
#include <rapidcheck/catch.h>
#include <cstring>
#include <limits>
#include "support/vector_files.hpp"
#include "arithmetic.hpp"
#include "base_stream.hpp"
#include "exact_knn.hpp"
#include "job_sizing.hpp"
#include "parallel.hpp"
#include "recall.hpp"
#include "support/exact_reference.hpp"  // after the import of gpupool (in exact_knn.hpp)
#include "support/knn_reference.hpp"
#include "support/temp_dir.hpp"

using namespace gpupool;
using namespace gpupool::exact;
using gpupool::test::fp64_reference;
using gpupool::test::reference_distance;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

using gpupool::testing::TempDir;

namespace {

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
      all[j] = reference_distance(qv, base.values.data() + j * base.dim, base.dim, metric);
    std::vector<double> sorted = all;
    std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(k - 1), sorted.end());
    double kth = sorted[k - 1];
    std::vector<std::int32_t> ids(got.indices.begin() + static_cast<std::ptrdiff_t>(q * k),
                                  got.indices.begin() + static_cast<std::ptrdiff_t>((q + 1) * k));
    for (std::size_t j = 0; j < k; ++j) {
      std::int32_t id = ids[j];
      if (id < 0 || static_cast<std::size_t>(id) >= base.rows) { ++bad; continue; }
      const float* xv = base.values.data() + static_cast<std::size_t>(id) * base.dim;
      double scale = 0;
      reference_distance(qv, xv, base.dim, metric, &scale);
      double allowed = tol * scale;
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
  return {queries.rows, k, *d, {}, *i, false};
}

struct Run {
  Result<JobResult> result;
  std::vector<Progress> progress;
};

// What a test may change about the device and the pool of a run.
struct Setup {
  std::size_t capacity = 64 * MiB;
  std::optional<FaultInjection> faults;
  PoolConfig pool;
  // Work on a stream waits until something synchronizes with it (SimulatedDeviceConfig): copies
  // on one stream and the kernels that read them on another are then ordered only by events.
  bool deferred_streams = false;
  // Called after every chunk, with the device (to shrink it, say).
  std::function<void(const Device&, const Progress&)> after_chunk;
};

Run run_job_with(const VectorSet& queries, const fs::path& base_file, JobOptions options,
                 const Setup& setup) {
  auto device = Device::simulated({.capacity = setup.capacity,
                                   .deferred_streams = setup.deferred_streams});
  REQUIRE(device);
  if (setup.faults) REQUIRE(device->inject_faults(*setup.faults));
  GpuMemoryPool pool(setup.pool);
  auto base = io::VectorReader::open(base_file);
  REQUIRE(base);
  auto progress = std::make_shared<std::vector<Progress>>();
  Device& on = *device;
  options.on_progress = [progress, &on, &setup](const Progress& p) {
    progress->push_back(p);
    if (setup.after_chunk) setup.after_chunk(on, p);
  };
  auto result = run_exact_knn(pool, *device, queries, *base, options);
  return {std::move(result), *progress};
}

Run run_job(const VectorSet& queries, const fs::path& base_file, JobOptions options,
            std::size_t capacity = 64 * MiB, std::optional<FaultInjection> faults = std::nullopt) {
  return run_job_with(queries, base_file, std::move(options), {.capacity = capacity, .faults = faults});
}

// The job's answer is the fp64 brute force's, bit for bit (ids, fp32 and fp64 distances), and
// passes the independent tie-tolerant fp64 check.
void check_exact(const Run& run, const VectorSet& queries, const VectorSet& base, std::size_t k,
                 std::size_t sampled, Metric metric = Metric::L2) {
  REQUIRE(run.result);
  const Neighbours& got = run.result->neighbours;
  CHECK(brute_force_mismatches(queries, base, got, metric, 2e-6, sampled) == 0);
  Neighbours exact = fp64_reference(queries, base, k, metric);
  CHECK(got.indices == exact.indices);
  CHECK(got.distances == exact.distances);
  CHECK(got.distances_fp64 == exact.distances_fp64);
}

// Within every pass over the base the progress only moves forward, and every pass that finishes
// ends at the whole base: no row skipped, none counted twice.
void check_passes(const std::vector<Progress>& progress, std::size_t base_rows) {
  REQUIRE_FALSE(progress.empty());
  for (std::size_t i = 1; i < progress.size(); ++i) {
    const Progress &before = progress[i - 1], &now = progress[i];
    bool same_block = now.queries_done == before.queries_done && now.block_queries == before.block_queries;
    bool forward = same_block && now.base_rows_done > before.base_rows_done;
    bool next_block = before.base_rows_done == base_rows &&
                      now.queries_done == before.queries_done + before.block_queries;
    // A block whose pass ran out of memory starts again, smaller (or as large, once).
    bool redone = now.queries_done == before.queries_done &&
                  (now.block_queries < before.block_queries || now.base_rows_done <= before.base_rows_done);
    CAPTURE(i, before.queries_done, before.block_queries, before.base_rows_done, now.queries_done,
            now.block_queries, now.base_rows_done);
    CHECK((forward || next_block || redone));
    CHECK(now.chunks >= before.chunks);
  }
  CHECK(progress.back().base_rows_done == base_rows);
  CHECK(progress.back().queries_done + progress.back().block_queries == progress.back().queries);
  CHECK(progress.back().fraction() == Approx(1.0));
}

fs::path write_fvecs_file(const TempDir& dir, const std::string& name, const VectorSet& set) {
  fs::path path = dir / name;
  REQUIRE(io::write_fvecs(path, set.rows, set.dim, std::span<const float>(set.values)));
  return path;
}

}  // namespace

TEST_CASE("the streamed job equals the fp64 brute force bit for bit in every input format",
          "[knn-job]") {
  TempDir dir{"knn"};
  constexpr std::size_t rows = 700, dim = 12, k = 9;
  Metric metric = GENERATE(Metric::L2, Metric::InnerProduct, Metric::Cosine);
  VectorSet queries = random_floats(23, dim, 1);
  auto check = [&](const fs::path& path, const VectorSet& base) {
    CAPTURE(path.filename().string(), to_string(metric));
    // Uneven chunks of 97 rows, so the last one is short and chunk borders fall anywhere.
    auto run = run_job(queries, path, {.k = k, .metric = metric, .max_chunk_rows = 97});
    check_exact(run, queries, base, k, queries.rows, metric);
    CHECK(run.result->summary.chunks == (rows + 96) / 97);
    // The device's own answer differs only where fp32 rounding does.
    Neighbours one = single_call(queries, base, k, metric);
    CHECK(brute_force_mismatches(queries, base, one, metric, 2e-5, queries.rows) == 0);
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

TEST_CASE("parallel_ranges: every item once, from several callers at once on the kept threads",
          "[knn-job]") {
  // Four callers (the devices of one job) share the kept threads; each call's items are visited
  // exactly once, whatever runs them, and a call returns only once all of its ranges are done.
  constexpr std::size_t kCallers = 4, kItems = 10'000;
  std::vector<std::vector<std::atomic<int>>> visits(kCallers);
  for (auto& v : visits) v = std::vector<std::atomic<int>>(kItems);
  std::vector<int> complete(kCallers, 0);
  std::vector<std::thread> callers;
  for (std::size_t c = 0; c < kCallers; ++c)
    callers.emplace_back([&, c] {
      for (int round = 0; round < 20; ++round)
        exact::parallel_ranges(kItems, 16, [&](std::size_t begin, std::size_t end) {
          for (std::size_t i = begin; i < end; ++i) visits[c][i].fetch_add(1);
        });
      int all = 1;
      for (const auto& v : visits[c]) all &= v.load() == 20;
      complete[c] = all;
    });
  for (auto& t : callers) t.join();
  CHECK(complete == std::vector<int>(kCallers, 1));
}

#if defined(__linux__)
TEST_CASE("the job's host work runs on the cores the process may use, not on every core of the host",
          "[knn-job]") {
  cpu_set_t original;
  CPU_ZERO(&original);
  REQUIRE(sched_getaffinity(0, sizeof original, &original) == 0);
  int core = 0;
  while (!CPU_ISSET(core, &original)) ++core;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(core, &one);
  REQUIRE(sched_setaffinity(0, sizeof one, &one) == 0);  // as mpirun binds a process to a core
  const std::size_t bound = exact::usable_cores();
  std::atomic<int> calls{0};
  exact::parallel_ranges(1000, 1, [&](std::size_t begin, std::size_t end) {
    ++calls;
    CHECK((begin == 0 && end == 1000));
  });
  const std::size_t reading = exact::reading_parts(std::size_t{1} << 30, static_cast<unsigned>(bound));
  REQUIRE(sched_setaffinity(0, sizeof original, &original) == 0);
  CHECK(bound == 1);
  CHECK(calls == 1);  // one range on this thread: no threads crowding the one core
  CHECK(reading == 1);
  CHECK(exact::usable_cores() == static_cast<std::size_t>(CPU_COUNT(&original)));
}
#endif

TEST_CASE("a base larger than the simulated device is streamed in chunks that fit", "[knn-job]") {
  TempDir dir{"knn"};
  VectorSet queries = random_floats(16, 128, 11);
  VectorSet base = random_floats(8192, 128, 12);  // 4 MiB of fp32 on a 1 MiB device
  fs::path path = write_fvecs_file(dir, "big.fvecs", base);
  auto run = run_job(queries, path, {.k = 10}, 1 * MiB);
  check_exact(run, queries, base, 10, 16);
  const JobSummary& summary = run.result->summary;
  CHECK(summary.chunks >= 5);
  CHECK(summary.query_blocks == 1);
  CHECK(summary.pool.peak_reserved_bytes <= 1 * MiB);
  CHECK(summary.pool.peak_reserved_bytes >= base.values.size() * sizeof(float) / summary.chunks);
  CHECK(summary.base_rows == 8192);
  REQUIRE(run.progress.size() == summary.chunks);
  check_passes(run.progress, 8192);
  // Where the time went: the queries' preparation and every device step of every chunk took
  // some, and together with the device's start and the waits for the base no more than the job.
  const JobTimes& t = summary.times;
  CHECK(t.uploading > 0);
  CHECK(t.searching > 0);
  CHECK(t.merging > 0);
  CHECK(t.preparing_queries > 0);
  CHECK(t.starting_device >= 0);
  CHECK(t.waiting_for_base >= 0);
  CHECK(t.staged() == Approx(t.preparing_queries + t.starting_device + t.waiting_for_base +
                             t.uploading + t.searching + t.merging));
  CHECK(t.staged() <= summary.seconds);
}

TEST_CASE("queries larger than the simulated device are searched in blocks, each streaming the base",
          "[knn-job]") {
  TempDir dir{"knn"};
  VectorSet queries = random_floats(2500, 128, 13);  // 1.2 MiB of fp32 on a 1 MiB device
  VectorSet base = random_floats(1500, 128, 14);
  fs::path path = write_fvecs_file(dir, "base.fvecs", base);
  auto run = run_job(queries, path, {.k = 10}, 1 * MiB);
  check_exact(run, queries, base, 10, 125);
  const JobSummary& summary = run.result->summary;
  CHECK(summary.query_blocks >= 3);
  CHECK(summary.largest_query_block * 128 * sizeof(float) <= 1 * MiB / 2);
  CHECK(summary.chunks >= summary.query_blocks);
  CHECK(summary.pool.peak_reserved_bytes <= 1 * MiB);
  check_passes(run.progress, 1500);
}

// Query blocks and chunks of one size each (even_batch_size; after the first pass, the largest
// chunk that worked, not grown further): the blocks the pool handed out for one chunk serve the
// next, and one query block's serve the next block. Sized to the headroom alone, the chunks were
// 1357 and 643 rows (then larger as the batching grew them), each size asking for room that only
// trimming the other's cached blocks gave: 530 of 1092 allocations went to the device and 519
// blocks were trimmed.
TEST_CASE("a job's query blocks and chunks reuse the pool's blocks", "[knn-job]") {
  TempDir dir{"knn"};
  VectorSet queries = random_floats(4000, 16, 27);  // 250 KiB on a 256 KiB device: 39 blocks
  VectorSet base = random_floats(2000, 16, 28);
  fs::path path = write_fvecs_file(dir, "base.fvecs", base);
  auto run = run_job(queries, path, {.k = 10}, 256 * KiB);
  check_exact(run, queries, base, 10, 400);
  const JobSummary& summary = run.result->summary;
  CHECK(summary.query_blocks >= 30);
  CHECK(summary.chunks >= 2 * summary.query_blocks);
  // The first pass's growing chunks may trim; no later pass does so for each of its chunks.
  CHECK(summary.pool.device_allocations < summary.query_blocks);
  CHECK(summary.pool.trims < summary.query_blocks);
  CHECK(summary.pool.hit_rate() >= 0.9);
}

TEST_CASE("every query block's pass starts where the caller's reader stood", "[knn-job]") {
  TempDir dir{"knn"};
  VectorSet queries = random_floats(1200, 64, 15);  // 300 KiB on a 256 KiB device
  VectorSet whole = random_floats(400, 64, 16);
  fs::path path = write_fvecs_file(dir, "base.fvecs", whole);
  auto device = Device::simulated({.capacity = 256 * KiB});
  REQUIRE(device);
  GpuMemoryPool pool;
  auto reader = io::VectorReader::open(path);
  REQUIRE(reader);
  std::vector<float> skipped(150 * 64);
  REQUIRE(reader->read(skipped, 150) == 150u);  // the job gets rows 150..399, as rows 0..249
  auto result = run_exact_knn(pool, *device, queries, *reader, {.k = 7});
  REQUIRE(result);
  CHECK(result->summary.query_blocks >= 3);
  CHECK(result->summary.base_rows == 250);
  VectorSet tail{250, 64, std::vector<float>(whole.values.begin() + 150 * 64, whole.values.end())};
  Neighbours exact = fp64_reference(queries, tail, 7, Metric::L2);
  CHECK(result->neighbours.indices == exact.indices);
  CHECK(result->neighbours.distances == exact.distances);
}

TEST_CASE("a chunk that runs out of device memory is bisected and no finished chunk is redone",
          "[knn-job]") {
  TempDir dir{"knn"};
  VectorSet queries = random_floats(8, 32, 21);
  VectorSet base = random_floats(3000, 32, 22);
  fs::path path = write_fvecs_file(dir, "base.fvecs", base);
  // Every allocation over 16 KiB fails: chunks of more than 128 rows (128 B each) cannot exist.
  auto run = run_job(queries, path, {.k = 5}, 64 * MiB, FaultInjection{.fail_above_bytes = 16 * KiB});
  check_exact(run, queries, base, 5, 8);
  const JobSummary& summary = run.result->summary;
  CHECK(summary.retries >= 1);
  CHECK(summary.query_block_retries == 0);
  CHECK(summary.largest_chunk_rows * 32 * sizeof(float) <= 16 * KiB);
  CHECK(summary.largest_chunk_rows >= 64);  // the bisection ends near the largest size that fits
  CHECK(summary.pool.out_of_memory_errors >= 1);
  REQUIRE(run.progress.size() == summary.chunks);
  check_passes(run.progress, 3000);
}

TEST_CASE("each chunk's rows go up while the chunk before is searched, the answer exact",
          "[knn-job]") {
  TempDir dir{"knn"};
  VectorSet queries = random_floats(12, 24, 31);
  VectorSet base = random_floats(1200, 24, 32);
  fs::path path = write_fvecs_file(dir, "base.fvecs", base);
  const std::uint64_t chunk_bytes = 200 * 24 * sizeof(float);
  for (bool deferred : {false, true}) {
    CAPTURE(deferred);
    // Six chunks of 200 rows, each a block of its own. A block goes up ahead when it is read
    // by the time the search before it starts: the pause after each chunk gives the reading
    // threads time to finish the next block (on a loaded host some may still be reading).
    Setup setup{.deferred_streams = deferred,
                .after_chunk = [](const Device&, const Progress&) {
                  std::this_thread::sleep_for(std::chrono::milliseconds(50));
                }};
    auto run = run_job_with(queries, path, JobOptions{.k = 6, .max_chunk_rows = 200}, setup);
    check_exact(run, queries, base, 6, 12);
    const JobSummary& summary = run.result->summary;
    REQUIRE(summary.chunks == 6);
    CHECK(summary.counts.bytes_uploaded == 6 * chunk_bytes);
    CHECK(summary.counts.bytes_uploaded_ahead >= chunk_bytes);
    CHECK(summary.counts.bytes_uploaded_ahead <= 5 * chunk_bytes);
    CHECK(summary.counts.bytes_uploaded_ahead % chunk_bytes == 0);  // whole chunks only
  }
}

TEST_CASE("out-of-memory injected at every allocation of a job is recovered, the answer exact",
          "[knn-job]") {
  TempDir dir{"knn"};
  VectorSet queries = random_floats(12, 24, 23);
  VectorSet base = random_floats(1200, 24, 24);
  fs::path path = write_fvecs_file(dir, "base.fvecs", base);
  // No uploads ahead, whose buffers come when the reading allows, and no caching: every buffer
  // is a device allocation, so fault N lands on the Nth buffer the job asks for, the same in
  // every run (chunk uploads, the queries' copy, knn outputs and tile).
  JobOptions options{.k = 6, .max_chunk_rows = 200, .upload_ahead = false};
  Setup setup{.pool = PoolConfig{.caching = false, .segments = false}};
  auto clean = run_job_with(queries, path, options, setup);
  check_exact(clean, queries, base, 6, 12);
  const std::size_t allocations = clean.result->summary.pool.device_allocations;
  REQUIRE(allocations >= 1 + 6 * 3);  // the queries, then 6 chunks of at least 3 buffers
  CHECK(clean.result->summary.retries == 0);
  CHECK(clean.result->summary.counts.bytes_uploaded_ahead == 0);
  std::size_t recovered_by_batching = 0;
  for (std::size_t n = 1; n <= allocations; ++n) {
    CAPTURE(n);
    setup.faults = FaultInjection{.fail_nth_allocation = n};
    auto run = run_job_with(queries, path, options, setup);
    check_exact(run, queries, base, 6, 12);
    const JobSummary& summary = run.result->summary;
    CHECK(summary.pool.out_of_memory_errors == 1);
    check_passes(run.progress, 1200);
    CHECK(run.progress.back().retries == summary.retries);
    // The kNN kernel halves its own tile when that allocation fails; every other failure is the
    // batching library's to retry, and the summary counts it.
    if (summary.retries > 0) ++recovered_by_batching;
    if (n == 1) CHECK((summary.retries == 1 && summary.query_block_retries == 0));  // chunk 1's upload
  }
  CHECK(recovered_by_batching >= allocations - clean.result->summary.chunks);  // one tile per chunk
}

TEST_CASE("out-of-memory injected while chunks go up ahead leaves the answer exact", "[knn-job]") {
  TempDir dir{"knn"};
  VectorSet queries = random_floats(12, 24, 25);
  VectorSet base = random_floats(1200, 24, 26);
  fs::path path = write_fvecs_file(dir, "base.fvecs", base);
  // Uploads ahead ask for their buffers when the reading allows, so fault N lands on one of them
  // in some runs and on another buffer in others: whichever it is, the job recovers (a failed
  // upload ahead leaves its chunk to upload in its turn) and the answer is exact.
  Setup setup{.pool = PoolConfig{.caching = false, .segments = false},
              .after_chunk = [](const Device&, const Progress&) {
                std::this_thread::sleep_for(std::chrono::milliseconds(5));
              }};
  const JobOptions options{.k = 6, .max_chunk_rows = 200};
  for (std::size_t n = 1; n <= 40; n += 3) {
    CAPTURE(n);
    setup.faults = FaultInjection{.fail_nth_allocation = n};
    auto run = run_job_with(queries, path, options, setup);
    check_exact(run, queries, base, 6, 12);
    CHECK(run.result->summary.pool.out_of_memory_errors <= 1);
  }
}

TEST_CASE("a device that shrinks during the job: smaller chunks after, the answer exact",
          "[knn-job]") {
  TempDir dir{"knn"};
  VectorSet queries = random_floats(16, 64, 25);
  VectorSet base = random_floats(8192, 64, 26);  // 2 MiB
  fs::path path = write_fvecs_file(dir, "base.fvecs", base);
  Setup setup{.capacity = 8 * MiB};
  setup.after_chunk = [](const Device& device, const Progress& p) {
    if (p.chunks == 2) CHECK(device.set_simulated_capacity(512 * KiB));  // no REQUIRE: no throwing through the job
  };
  auto run = run_job_with(queries, path, {.k = 10, .max_chunk_rows = 2048}, setup);
  check_exact(run, queries, base, 10, 16);
  check_passes(run.progress, 8192);
  REQUIRE(run.progress.size() >= 4);
  CHECK(run.progress[1].base_rows_done == 2 * 2048);  // full chunks before the shrink
  for (std::size_t i = 2; i < run.progress.size(); ++i) {
    std::size_t rows = run.progress[i].base_rows_done - run.progress[i - 1].base_rows_done;
    CHECK(rows * 64 * sizeof(float) <= 512 * KiB / 2);  // a chunk and its tile fit what is left
  }
}

TEST_CASE("a device too small for one query and one base row fails, saying what the job needs",
          "[knn-job]") {
  TempDir dir{"knn"};
  VectorSet queries = random_floats(4, 128, 31);
  fs::path path = write_fvecs_file(dir, "base.fvecs", random_floats(100, 128, 32));
  // Everything over 256 B (the smallest block) fails: a row of 128 fp32 values (512 B) never fits.
  auto run = run_job(queries, path, {.k = 10}, 64 * MiB, FaultInjection{.fail_above_bytes = 256});
  REQUIRE_FALSE(run.result);
  CHECK(run.result.error().is_out_of_memory());
  CHECK_THAT(run.result.error().message(), Contains("queries 0..0") && Contains("one base row") &&
                                               Contains("query 0 does not fit") &&
                                               Contains("no pool limit is set"));
  // Under a pool limit the advice is to raise it.
  Setup limited{.capacity = 64 * MiB, .faults = FaultInjection{.fail_above_bytes = 256}};
  limited.pool.max_pool_size = 32 * MiB;
  auto capped = run_job_with(queries, path, {.k = 10}, limited);
  REQUIRE_FALSE(capped.result);
  CHECK_THAT(capped.result.error().message(), Contains("raise --memory-limit"));
}

TEST_CASE("the running lists live on the host: a device that holds one row and k = 100 still works",
          "[knn-job]") {
  TempDir dir{"knn"};
  VectorSet queries = random_floats(3, 4, 33);
  VectorSet base = random_floats(150, 4, 34);
  fs::path path = write_fvecs_file(dir, "base.fvecs", base);
  // 256 B: a few rows of 16 B and a few candidates at a time, never a list of 100.
  auto run = run_job(queries, path, {.k = 100}, 64 * MiB, FaultInjection{.fail_above_bytes = 256});
  check_exact(run, queries, base, 100, 3);
  CHECK(run.result->summary.largest_chunk_rows < 100);
}

TEST_CASE("fast-mode runs in fp16, bf16 and int8 are exact up to their precision", "[knn-job]") {
  TempDir dir{"knn"};
  VectorSet queries = random_floats(12, 48, 41);
  VectorSet base = random_floats(900, 48, 42);
  fs::path path = write_fvecs_file(dir, "base.fvecs", base);
  auto [precision, tol] = GENERATE(std::pair{Precision::Fp16, 2e-3}, std::pair{Precision::Bf16, 1.6e-2},
                                   std::pair{Precision::Int8, 2.5e-2});
  Metric metric = GENERATE(Metric::L2, Metric::InnerProduct);
  CAPTURE(to_string(precision), to_string(metric));
  auto run = run_job(queries, path, {.k = 8, .metric = metric, .fast = true,
                                     .precision = precision, .max_chunk_rows = 200});
  REQUIRE(run.result);
  CHECK(run.result->summary.precision == precision);
  CHECK(run.result->summary.fast);
  CHECK(run.result->neighbours.distances_fp64.empty());
  CHECK(brute_force_mismatches(queries, base, run.result->neighbours, metric, tol, 12) == 0);
}

namespace {
fs::path write_bvecs_file(const TempDir& dir, const std::string& name,
                          const std::vector<std::uint8_t>& bytes, std::size_t dim) {
  test::write_bytes(dir / name, test::texmex_bytes(bytes, dim));
  return dir / name;
}
}  // namespace

TEST_CASE("integer data runs on exact integer arithmetic: ids and distances exact, ties by row",
          "[knn-job]") {
  TempDir dir{"knn"};
  const std::size_t dim = 32, rows = 3000;
  Metric metric = GENERATE(Metric::L2, Metric::InnerProduct, Metric::Cosine);
  CAPTURE(to_string(metric));
  // Few distinct values: many exact ties, which only (distance, row) order settles.
  auto bytes = random_ints<std::uint8_t>(rows * dim, 0, 3, 81);
  auto query_bytes = random_ints<std::uint8_t>(40 * dim, 0, 3, 82);
  for (std::size_t i = 0; i < rows * dim; i += 7) bytes[i] = static_cast<std::uint8_t>(200 + i % 55);
  VectorSet base = as_floats(bytes, dim), queries = as_floats(query_bytes, dim);
  fs::path path = write_bvecs_file(dir, "base.bvecs", bytes, dim);
  auto run = run_job(queries, path, {.k = 20, .metric = metric, .max_chunk_rows = 700});
  check_exact(run, queries, base, 20, 40, metric);
  const JobSummary& summary = run.result->summary;
  CHECK(summary.counts.integer_chunks == summary.chunks);
  CHECK(summary.counts.float_chunks == 0);
  CHECK(summary.counts.bytes_uploaded == rows * dim);  // uint8 rows uploaded as bytes
  CHECK(summary.counts.bytes_read == rows * dim);
  CHECK(run.result->neighbours.integer_distances == (metric != Metric::Cosine));
  if (metric == Metric::L2)
    for (double d : run.result->neighbours.distances_fp64) CHECK(d == std::floor(d));
}

TEST_CASE("integer queries against uint8 / int8 rows: int64 sums give the fp64 sums' bits",
          "[knn-job]") {
  std::mt19937 rng(std::random_device{}());
  for (std::size_t dim : {1u, 7u, 128u, 960u}) {
    const std::size_t rows = 40, nq = 5;
    std::uniform_int_distribution<int> byte(0, 255), query(-32768, 32768);
    std::vector<std::byte> stored(rows * dim);
    for (auto& b : stored) b = static_cast<std::byte>(byte(rng));
    std::vector<float> q(nq * dim);
    for (std::size_t i = 0; i < q.size(); ++i)
      q[i] = static_cast<float>(i % 5 == 0 ? query(rng) : byte(rng) - 128);  // extremes and bytes
    q[0] = -32768.0f;
    const HostQueries integer = host_queries(q, nq, dim);
    REQUIRE_FALSE(integer.integers.empty());
    HostQueries plain = integer;
    plain.integers.clear();  // the fp64 sums
    std::vector<double> scratch(dim);
    for (StoredElement element : {StoredElement::UInt8, StoredElement::Int8}) {
      const StoredRows base{stored.data(), element, rows, dim};
      for (Metric metric : {Metric::L2, Metric::InnerProduct, Metric::Cosine})
        for (std::size_t i = 0; i < nq; ++i)
          for (std::size_t r = 0; r < rows; ++r) {
            CAPTURE(dim, to_string(element), to_string(metric), i, r);
            const double fast = exact_distance(integer, i, base, r, metric, scratch.data());
            const double fp64 = exact_distance(plain, i, base, r, metric, scratch.data());
            REQUIRE(std::bit_cast<std::uint64_t>(fast) == std::bit_cast<std::uint64_t>(fp64));
          }
    }
  }
  // Past 2^15 or with a fraction the queries keep the fp64 sums.
  CHECK(host_queries(std::vector<float>{32769.0f}, 1, 1).integers.empty());
  CHECK(host_queries(std::vector<float>{0.5f}, 1, 1).integers.empty());
}

TEST_CASE("the scan of float rows agrees with a plain model of every value", "[knn-job]") {
  // Values from a small set of kinds (whole, fraction, large, NaN, ±inf, -0) in rows of any width,
  // so that every lane of the scan and its tail meets each kind.
  const float kinds[] = {3.0f, -7.0f, 0.5f, -0.0f, 4194303.5f, 1e30f, 8388607.0f,
                         std::numeric_limits<float>::quiet_NaN(),
                         std::numeric_limits<float>::infinity()};
  rc::prop("scan_values matches the model", [&] {
    const auto dim = *rc::gen::inRange<std::size_t>(1, 40);
    const auto rows = *rc::gen::inRange<std::size_t>(1, 6);
    const auto picks = *rc::gen::container<std::vector<std::size_t>>(
        rows * dim, rc::gen::inRange<std::size_t>(0, 9));
    std::vector<float> values(rows * dim);
    for (std::size_t i = 0; i < values.size(); ++i)
      values[i] = kinds[picks[i] % (*rc::gen::inRange(0, 4) == 0 ? 9 : 7)];
    const ValueStats got = scan_values(StoredRows{reinterpret_cast<const std::byte*>(values.data()),
                                                  StoredElement::Fp32, rows, dim});
    bool finite = true, integer = true;
    std::size_t first_bad = 0;
    double lo = std::numeric_limits<double>::infinity(), hi = -lo, norm2_max = 0;
    for (std::size_t r = 0; r < rows; ++r) {
      double norm2 = 0;
      for (std::size_t c = 0; c < dim; ++c) {
        const double v = values[r * dim + c];
        if (!std::isfinite(v) && finite) finite = false, first_bad = r;
        integer = integer && v == std::floor(v);
        lo = std::min(lo, v), hi = std::max(hi, v), norm2 += v * v;
      }
      norm2_max = std::max(norm2_max, norm2);
    }
    RC_ASSERT(got.finite == finite);
    if (!finite) {
      RC_ASSERT(got.first_nonfinite_row == first_bad);
      RC_ASSERT(!got.integer);
      return;
    }
    RC_ASSERT(got.integer == integer);
    RC_ASSERT(got.min == lo);
    RC_ASSERT(got.max == hi);
    RC_ASSERT(got.max_norm2 >= norm2_max);  // an upper bound, within a relative 2^-40
    RC_ASSERT(got.max_norm2 <= norm2_max * (1 + 0x1p-39));
  });
}

TEST_CASE("the AVX2 scan of fp32 rows gives the baseline scan's figures to the bit", "[knn-job]") {
  if (!cpu_has_avx2()) {
    WARN("this CPU has no AVX2: scan_values takes the baseline scan, nothing to compare");
    return;
  }
  // Any bit pattern: fractions, whole numbers, ±2^23 and past, subnormals, -0, NaN, ±inf.
  rc::prop("scan_fp32(avx2) == scan_fp32(baseline)", [] {
    const auto dim = *rc::gen::inRange<std::size_t>(1, 70);
    const auto rows = *rc::gen::inRange<std::size_t>(1, 5);
    const auto kind = *rc::gen::inRange(0, 4);
    std::vector<float> values(rows * dim);
    for (float& v : values) {
      if (kind == 0) v = *rc::gen::arbitrary<float>();  // includes NaN and ±inf
      else if (kind == 1) v = static_cast<float>(*rc::gen::inRange(-40000, 40000));  // whole
      else if (kind == 2)
        v = std::ldexp(static_cast<float>(*rc::gen::inRange(-1000, 1000)), *rc::gen::inRange(-30, 30));
      else  // embedding-like: sums whose rounding depends on their order
        v = static_cast<float>(*rc::gen::inRange(-1'000'000, 1'000'000)) * 1.0e-6f;
    }
    const StoredRows stored{reinterpret_cast<const std::byte*>(values.data()), StoredElement::Fp32,
                            rows, dim};
    const ValueStats wide = scan_fp32(stored, true), plain = scan_fp32(stored, false);
    auto bits = [](double d) { return std::bit_cast<std::uint64_t>(d); };
    RC_ASSERT(wide.rows == plain.rows);
    RC_ASSERT(wide.finite == plain.finite);
    RC_ASSERT(wide.first_nonfinite_row == plain.first_nonfinite_row);
    RC_ASSERT(wide.integer == plain.integer);
    RC_ASSERT(bits(wide.min) == bits(plain.min));
    RC_ASSERT(bits(wide.max) == bits(plain.max));
    RC_ASSERT(bits(wide.max_norm2) == bits(plain.max_norm2));
    RC_ASSERT(bits(wide.min_norm2) == bits(plain.min_norm2));
  });
}

TEST_CASE("float files of whole numbers take the integer path, and one fraction sends its chunk to fp32",
          "[knn-job]") {
  TempDir dir{"knn"};
  const std::size_t dim = 16, rows = 1200;
  auto ints = random_ints<std::int32_t>(rows * dim, 0, 255, 83);
  VectorSet base = as_floats(ints, dim);
  VectorSet queries = as_floats(random_ints<std::int32_t>(10 * dim, 0, 255, 84), dim);
  static constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();
  std::size_t fraction_at = GENERATE(std::size_t{0}, std::size_t{1200 * 16 - 1}, kNone);
  CAPTURE(fraction_at);
  if (fraction_at != kNone) base.values[fraction_at] += 0.5f;
  fs::path path = write_fvecs_file(dir, "base.fvecs", base);
  auto run = run_job(queries, path, {.k = 10, .max_chunk_rows = 400});
  check_exact(run, queries, base, 10, 10);
  const JobSummary& summary = run.result->summary;
  CHECK(summary.chunks == 3);
  CHECK(summary.counts.float_chunks == (fraction_at == kNone ? 0u : 1u));
  CHECK(summary.counts.integer_chunks + summary.counts.float_chunks == 3);
}

// Data built to defeat fp32: a large common offset (the GEMM form's |q|² + |x|² - 2 q·x cancels
// away every digit that tells the rows apart), near-duplicates, and pytorch#42479's 1-D case.
TEST_CASE("float data in the exact mode equals fp64 where fp32 alone cannot tell the rows apart",
          "[knn-job]") {
  TempDir dir{"knn"};
  SECTION("a large common offset and near-duplicates") {
    const std::size_t dim = 24, rows = 2000;
    std::mt19937 rng(85);
    std::normal_distribution<float> noise(0.0f, 1.0f);
    VectorSet base{rows, dim, std::vector<float>(rows * dim)};
    for (float& v : base.values) v = 3000.0f + noise(rng);
    for (std::size_t r = 1000; r < 1300; ++r)  // near-duplicates of row 7
      for (std::size_t c = 0; c < dim; ++c)
        base.values[r * dim + c] = base.values[7 * dim + c] + 1e-3f * noise(rng);
    VectorSet queries{30, dim, std::vector<float>(30 * dim)};
    for (float& v : queries.values) v = 3000.0f + noise(rng);
    fs::path path = write_fvecs_file(dir, "offset.fvecs", base);
    Metric metric = GENERATE(Metric::L2, Metric::InnerProduct, Metric::Cosine);
    CAPTURE(to_string(metric));
    auto run = run_job(queries, path, {.k = 15, .metric = metric, .max_chunk_rows = 500});
    check_exact(run, queries, base, 15, 30, metric);
    CHECK(run.result->summary.counts.float_chunks == run.result->summary.chunks);
    CHECK(run.result->summary.counts.fold.recomputed > 0);
  }
  SECTION("pytorch#42479: 1-D points far from the origin") {
    VectorSet base{3, 1, {512695.0f, 512804.0f, 512700.5f}};
    VectorSet queries{1, 1, {512804.0f}};
    fs::path path = write_fvecs_file(dir, "line.fvecs", base);
    auto run = run_job(queries, path, {.k = 3});
    check_exact(run, queries, base, 3, 1);
    CHECK(run.result->neighbours.indices == std::vector<std::int32_t>{1, 2, 0});
    CHECK(run.result->neighbours.distances_fp64 == std::vector<double>{0, 103.5 * 103.5, 109.0 * 109});
  }
}

namespace {
// Random values times `scale`; with `mixed`, every other row times 2^-70 more (cosine then meets
// rows that vanish beside the others in fp32).
VectorSet scaled_floats(std::size_t rows, std::size_t dim, float scale, bool mixed,
                        std::uint32_t seed) {
  VectorSet set = random_floats(rows, dim, seed);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < dim; ++c)
      set.values[r * dim + c] *= mixed && r % 2 == 1 ? std::ldexp(scale, -70) : scale;
  return set;
}

// The share of each query's true k nearest rows that `got` found.
double recall_against(const Neighbours& truth, const Neighbours& got) {
  std::size_t found = 0;
  for (std::size_t q = 0; q < truth.queries; ++q) {
    auto first = truth.indices.begin() + static_cast<std::ptrdiff_t>(q * truth.k);
    std::set<std::int32_t> wanted(first, first + static_cast<std::ptrdiff_t>(truth.k));
    for (std::size_t j = 0; j < got.k; ++j) found += wanted.count(got.indices[q * got.k + j]);
  }
  return static_cast<double>(found) / static_cast<double>(truth.queries * truth.k);
}
}  // namespace

TEST_CASE("values of any magnitude: exact in every metric, the fast mode's forms scaled to range",
          "[knn-job]") {
  TempDir dir{"knn"};
  const std::size_t dim = 16, k = 10;
  // 1e17: squared distances near fp32's top; 1e-30: fp32 products underflow; 1e-42: subnormal
  // values; mixed: rows 2^70 apart in one chunk.
  auto [scale, mixed] = GENERATE(std::pair{1e17f, false}, std::pair{1e-30f, false},
                                 std::pair{1e-42f, false}, std::pair{1e10f, true});
  Metric metric = GENERATE(Metric::L2, Metric::InnerProduct, Metric::Cosine);
  CAPTURE(scale, mixed, to_string(metric));
  VectorSet queries = scaled_floats(20, dim, scale, mixed, 301);
  VectorSet base = scaled_floats(1500, dim, scale, mixed, 302);
  fs::path path = write_fvecs_file(dir, "scaled.fvecs", base);
  Neighbours truth = fp64_reference(queries, base, k, metric);

  auto exact = run_job(queries, path, {.k = k, .metric = metric, .max_chunk_rows = 400});
  REQUIRE(exact.result);
  CHECK(exact.result->neighbours.indices == truth.indices);
  CHECK(exact.result->neighbours.distances_fp64 == truth.distances_fp64);
  CHECK(exact.result->neighbours.distances == truth.distances);

  for (Precision precision : {Precision::Fp32, Precision::Fp16, Precision::Bf16, Precision::Int8}) {
    CAPTURE(to_string(precision));
    auto fast = run_job(queries, path, {.k = k, .metric = metric, .fast = true,
                                        .precision = precision, .max_chunk_rows = 400});
    if (mixed && precision == Precision::Fp16) {  // 2^70 apart: more than fp16 can hold
      REQUIRE_FALSE(fast.result);
      CHECK_THAT(fast.result.error().message(),
                 Contains(" has norm ") && Contains("use --precision bf16 or fp32"));
      continue;
    }
    REQUIRE(fast.result);
    CHECK(fast.result->summary.counts.non_finite_distances == 0);
    CHECK(recall_against(truth, fast.result->neighbours) >= 0.9);
    for (std::size_t i = 0; i < truth.distances.size(); ++i) {
      // Every precision keeps at least 7 bits (int8): the fast distances are the true ones (as
      // fp32 writes them) to a few per cent of the distances' own scale.
      const double want = truth.distances[i], got = fast.result->neighbours.distances[i];
      const double own_scale =
          metric == Metric::Cosine ? 1.0 : std::fabs(truth.distances[k - 1]) + std::fabs(want);
      if (!(std::fabs(got - want) <= 0.1 * own_scale + 2 * std::numeric_limits<float>::denorm_min())) {
        CAPTURE(i, want, got);
        CHECK(false);
        break;
      }
    }
  }
}

TEST_CASE("the range exponent brings the largest value into 2^6 .. 2^7, bounds cover what vanishes",
          "[knn-job]") {
  auto stats_of = [](double largest, double min_norm2) {
    ValueStats s;
    s.rows = 1;
    s.min = -largest;
    s.max = largest / 2;
    s.max_norm2 = largest * largest;
    s.min_norm2 = min_norm2;
    return s;
  };
  for (double largest : {1e-42, 3e-20, 1.0, 127.9, 128.0, 6e4, 1e19, 3e38}) {
    CAPTURE(largest);
    const std::int32_t e = range_exponent(stats_of(largest / 4, 1), stats_of(largest, 1));
    CHECK(std::ldexp(largest, e) >= 64);
    CHECK(std::ldexp(largest, e) < 128);
    const Arithmetic a{Precision::Fp32, 0, false, false, e};
    CHECK(distance_unit(a, Metric::L2) == std::ldexp(1.0, -2 * e));
    CHECK(distance_unit(a, Metric::InnerProduct) == std::ldexp(1.0, -2 * e));
    CHECK(distance_unit(a, Metric::Cosine) == 1.0);
  }
  CHECK(range_exponent(ValueStats{}, ValueStats{}) == 0);  // nothing to scale
  // Cosine: rows that vanish in the device's range leave nothing to trust; ordinary ones barely
  // move the bound.
  const Arithmetic fp32{Precision::Fp32, 0, false, false, 0};
  const BoundNorms ordinary{.query_norm2 = 4, .row_norm2_max = 9, .row_norm2_min = 1, .largest = 2};
  const double usual = error_bound(fp32, Metric::Cosine, 64, ordinary);
  CHECK(usual < 1e-4);
  BoundNorms vanishing = ordinary;
  vanishing.row_norm2_min = 1e-80;
  CHECK(error_bound(fp32, Metric::Cosine, 64, vanishing) > 1);
  vanishing.row_norm2_min = 1e-20;
  CHECK(error_bound(fp32, Metric::Cosine, 64, vanishing) > usual);
  // L2 in the data's units: scaling the data by 2^-60 scales the bound by 2^-120.
  const BoundNorms big{.query_norm2 = 0x1p120, .row_norm2_max = 0x1p122, .row_norm2_min = 1,
                       .largest = 0x1p61};
  const BoundNorms small{.query_norm2 = 1, .row_norm2_max = 4, .row_norm2_min = 0x1p-120,
                         .largest = 2};
  const Arithmetic scaled_big{Precision::Fp32, 0, false, false, -55};
  const Arithmetic scaled_small{Precision::Fp32, 0, false, false, 5};
  CHECK(error_bound(scaled_big, Metric::L2, 32, big) ==
        std::ldexp(error_bound(scaled_small, Metric::L2, 32, small), 120));
  // Whole numbers never vanish: exact sums stay exact.
  const Arithmetic integer{Precision::Int8, 0, true, true, 0};
  CHECK(error_bound(integer, Metric::L2, 32, small) == 0);
}

TEST_CASE("distances beyond fp32's range are written as fp64, never as inf", "[knn-job]") {
  TempDir dir{"knn"};
  VectorSet queries = scaled_floats(4, 8, 1e21f, false, 311);
  VectorSet base = scaled_floats(300, 8, 1e21f, false, 312);
  fs::path path = write_fvecs_file(dir, "huge.fvecs", base);
  auto exact = run_job(queries, path, {.k = 5});
  REQUIRE(exact.result);
  const Neighbours& got = exact.result->neighbours;
  CHECK(got.indices == fp64_reference(queries, base, 5, Metric::L2).indices);
  auto as_fp32 = write_neighbours(got, dir / "a", OutputFormat::Texmex);
  REQUIRE_FALSE(as_fp32);
  CHECK_THAT(as_fp32.error().message(),
             Contains("query 0's neighbour 0") && Contains("beyond fp32's range") &&
                 Contains("--distance-type fp64"));
  CHECK_FALSE(fs::exists(dir / "a.neighbors.ivecs"));
  CHECK(write_neighbours(got, dir / "b", OutputFormat::Npy, DistanceType::Fp64));
  auto fast = run_job(queries, path, {.k = 5, .fast = true});
  REQUIRE(fast.result);
  auto fast_fp32 = write_neighbours(fast.result->neighbours, dir / "c", OutputFormat::Npy);
  REQUIRE_FALSE(fast_fp32);
  CHECK_THAT(fast_fp32.error().message(), Contains("the exact mode writes them as fp64"));
}

// A chunk the first candidates cannot prove (more near-ties at the k-th than candidates) is
// searched again with more, and past knn's limit computed row by row — never guessed.
TEST_CASE("unprovable chunks are widened, then computed row by row, the answer exact", "[knn-job]") {
  TempDir dir{"knn"};
  const std::size_t dim = 8;
  std::size_t copies = GENERATE(std::size_t{100}, std::size_t{2500});
  CAPTURE(copies);
  VectorSet base = random_floats(copies + 500, dim, 86);
  for (std::size_t r = 200; r < 200 + copies; ++r)  // copies of row 3: all tie at its distance
    std::copy_n(base.values.begin() + 3 * dim, dim, base.values.begin() + r * dim);
  VectorSet queries = random_floats(4, dim, 87);
  for (std::size_t c = 0; c < dim; ++c) queries.values[c] = base.values[3 * dim + c] + 0.01f;
  fs::path path = write_fvecs_file(dir, "ties.fvecs", base);
  auto run = run_job(queries, path, {.k = 10});
  check_exact(run, queries, base, 10, 4);
  const JobCounts& counts = run.result->summary.counts;
  CHECK(counts.widened_queries >= 1);
  CHECK((counts.exhaustive_queries >= 1) == (copies > kMaxK));
  // Ties go to the smaller rows: row 3, then the first copies.
  CHECK(run.result->neighbours.indices[0] == 3);
  CHECK(run.result->neighbours.indices[1] == 200);
}

TEST_CASE("the exact mode's output is the same bits for every chunking, memory and query block",
          "[knn-job]") {
  TempDir dir{"knn"};
  VectorSet queries = random_floats(300, 32, 88);
  VectorSet base = random_floats(3000, 32, 89);
  fs::path path = write_fvecs_file(dir, "base.fvecs", base);
  auto reference = run_job(queries, path, {.k = 12}, 64 * MiB);
  REQUIRE(reference.result);
  for (auto [capacity, chunk] : {std::pair{64 * MiB, std::size_t{97}}, std::pair{256 * KiB, std::size_t{1} << 20},
                                 std::pair{96 * KiB, std::size_t{333}}}) {
    CAPTURE(capacity, chunk);
    auto run = run_job(queries, path, {.k = 12, .max_chunk_rows = chunk}, capacity);
    REQUIRE(run.result);
    CHECK(run.result->neighbours.indices == reference.result->neighbours.indices);
    CHECK(run.result->neighbours.distances == reference.result->neighbours.distances);
    CHECK(run.result->neighbours.distances_fp64 == reference.result->neighbours.distances_fp64);
    if (capacity == 96 * KiB) CHECK(run.result->summary.query_blocks > 1);
  }
}

TEST_CASE("NaN and infinity are refused, naming the row, unless the fast mode allows them",
          "[knn-job]") {
  TempDir dir{"knn"};
  VectorSet queries = random_floats(5, 4, 90);
  VectorSet base = random_floats(300, 4, 91);
  base.values[4 * 250 + 2] = std::numeric_limits<float>::infinity();
  fs::path path = write_fvecs_file(dir, "inf.fvecs", base);
  auto run = run_job(queries, path, {.k = 3, .max_chunk_rows = 100});
  REQUIRE_FALSE(run.result);
  CHECK(run.result.error().kind() == ErrorKind::InvalidInput);
  CHECK_THAT(run.result.error().message(), Contains(path.string()) && Contains("base row 250"));
  // The fast mode refuses them too, unless asked to rank them (the documented rule).
  auto fast = run_job(queries, path, {.k = 3, .fast = true, .max_chunk_rows = 100});
  REQUIRE_FALSE(fast.result);
  CHECK_THAT(fast.result.error().message(), Contains("base row 250") && Contains("--allow-non-finite"));
  auto allowed = run_job(queries, path,
                         {.k = 3, .fast = true, .allow_non_finite = true, .max_chunk_rows = 100});
  REQUIRE(allowed.result);
  CHECK(allowed.result->summary.counts.non_finite_distances == 0);  // the inf row is never near
  VectorSet bad_queries = queries;
  bad_queries.values[4 * 3] = std::numeric_limits<float>::quiet_NaN();
  const fs::path finite = write_fvecs_file(dir, "ok.fvecs", random_floats(50, 4, 92));
  for (bool fast_mode : {false, true}) {
    auto refused = run_job(bad_queries, finite, {.k = 3, .fast = fast_mode});
    REQUIRE_FALSE(refused.result);
    CHECK_THAT(refused.result.error().message(), Contains("query row 3"));
  }
  // Allowed, the NaN query's distances are NaN, and the summary counts them.
  auto counted = run_job(bad_queries, finite, {.k = 3, .fast = true, .allow_non_finite = true});
  REQUIRE(counted.result);
  CHECK(counted.result->summary.counts.non_finite_distances == 3);
}

TEST_CASE("verify_neighbours recomputes queries in fp64 and names the first that differs", "[knn-job]") {
  TempDir dir{"knn"};
  VectorSet queries = random_floats(40, 16, 93);
  VectorSet base = random_floats(1500, 16, 94);
  fs::path path = write_fvecs_file(dir, "base.fvecs", base);
  auto run = run_job(queries, path, {.k = 10, .max_chunk_rows = 400});
  REQUIRE(run.result);
  Neighbours got = run.result->neighbours;
  auto verified = verify_neighbours(got, queries, path, Metric::L2, 40);
  REQUIRE(verified);
  CHECK(verified->queries == 40);
  SECTION("a planted wrong id") {
    std::swap(got.indices[17 * 10 + 4], got.indices[17 * 10 + 5]);
    auto caught = verify_neighbours(got, queries, path, Metric::L2, 40);
    REQUIRE_FALSE(caught);
    CHECK_THAT(caught.error().message(), Contains("query 17") && Contains("rank 4"));
  }
  SECTION("a planted distance off by one ulp") {
    got.distances[29 * 10] = std::nextafter(got.distances[29 * 10], 1e9f);
    auto caught = verify_neighbours(got, queries, path, Metric::L2, 40);
    REQUIRE_FALSE(caught);
    CHECK_THAT(caught.error().message(), Contains("query 29") && Contains("rank 0"));
  }
}

TEST_CASE("exact distances are written as fp64 or int64 npy", "[knn-job]") {
  TempDir dir{"knn"};
  Neighbours n{2, 2, {1.0f, 4.0f, 9.0f, 16777216.0f}, {1.0, 4.0, 9.0, 16777217.0}, {3, 1, 0, 2}, true};
  auto fp64 = write_neighbours(n, dir / "a", OutputFormat::Npy, DistanceType::Fp64);
  REQUIRE(fp64);
  auto int64 = write_neighbours(n, dir / "b", OutputFormat::Npy, DistanceType::Int64);
  REQUIRE(int64);
  auto bytes = test::read_bytes(int64->distances);
  REQUIRE(bytes.size() == 128 + 4 * 8);
  std::int64_t last = 0;
  std::memcpy(&last, bytes.data() + 128 + 3 * 8, 8);
  CHECK(last == 16777217);  // beyond fp32's integers
  CHECK_FALSE(write_neighbours(n, dir / "c", OutputFormat::Texmex, DistanceType::Fp64));
  n.integer_distances = false;
  auto refused = write_neighbours(n, dir / "d", OutputFormat::Npy, DistanceType::Int64);
  REQUIRE_FALSE(refused);
  CHECK_THAT(refused.error().message(), Contains("integer"));
}

TEST_CASE("bad job inputs are refused, naming the value and what was expected", "[knn-job]") {
  TempDir dir{"knn"};
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
  CHECK_THAT(refused(queries, {.k = 5, .fast = true, .precision = Precision::Bytes}),
             Contains("precision = bytes"));
  CHECK_THAT(refused(queries, {.k = 5, .max_chunk_rows = 0}), Contains("max_chunk_rows = 0"));
}

TEST_CASE("a corrupt base file stops the job with the file and the record named", "[knn-job]") {
  TempDir dir{"knn"};
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
  // The outer batches are of queries, and say so.
  CHECK_THAT(run.result.error().message(), Contains("batch of queries 0..1") && !Contains("items"));
  CHECK_FALSE(run.progress.empty());  // chunks before the bad record were processed
}

TEST_CASE("results are written atomically as ivecs + fvecs or npy, and read back exactly",
          "[knn-job]") {
  TempDir dir{"knn"};
  Neighbours n{3, 2, {0.5f, 1.5f, 0.25f, 0.75f, 2.0f, 3.0f}, {}, {4, 1, 0, 2, 9, 7}, false};
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
    TempDir other{"knn"};
    fs::create_directories(other / "run.distances.fvecs");  // a directory where the file goes
    auto failed = write_neighbours(n, other / "run", OutputFormat::Texmex);
    REQUIRE_FALSE(failed);
    CHECK(failed.error().kind() == ErrorKind::Io);
    CHECK_FALSE(fs::exists(other / "run.neighbors.ivecs"));
    CHECK(other.file_count() == 1);
  }
}

namespace {

// `rows` random rows of 3 values in dir/base.fvecs, and a reader of it.
struct BaseFile {
  VectorSet base;
  io::VectorReader reader;
};
BaseFile base_of_3_values(const TempDir& dir, std::size_t rows, std::uint32_t seed) {
  VectorSet base = random_floats(rows, 3, seed);
  auto reader = io::VectorReader::open(write_fvecs_file(dir, "base.fvecs", base));
  REQUIRE(reader);
  return {std::move(base), std::move(*reader)};
}

}  // namespace

// The values of every block of a pass, side by side, and the blocks' stats appended.
struct PassRead {
  std::vector<float> values;
  std::set<const std::byte*> blocks;
  std::vector<std::size_t> first_rows;
  ValueStats stats;
  std::optional<GpuError> error;
};
PassRead read_pass(BaseBlocks& blocks) {
  PassRead out;
  for (;;) {
    auto block = blocks.next();
    if (!block) {
      out.error = block.error();
      return out;
    }
    if (!*block) return out;
    const BaseBlock& b = **block;
    out.blocks.insert(b.memory->data());
    out.first_rows.push_back(b.first_row);
    out.stats.append(b.stats);
    std::vector<double> row(b.rows.dim);
    for (std::size_t r = 0; r < b.rows.rows; ++r) {
      b.rows.row_values(r, row.data());
      out.values.insert(out.values.end(), row.begin(), row.end());
    }
  }
}

// A fresh block costs its zero fill and a page fault every 4 KiB on the reading thread, so
// blocks whose rows are all gone come back.
TEST_CASE("the base's blocks are read into blocks whose rows are gone", "[knn-job]") {
  TempDir dir{"knn"};
  auto [base, reader] = base_of_3_values(dir, 12, 72);
  BaseBlocks blocks(reader, 12, 2, std::make_shared<BlockRecycler>());  // six blocks of 2 rows
  PassRead pass = read_pass(blocks);
  REQUIRE_FALSE(pass.error);
  CHECK(pass.values == base.values);
  CHECK(pass.first_rows == std::vector<std::size_t>{0, 2, 4, 6, 8, 10});
  CHECK(pass.blocks.size() <= 4);  // the one in use, the one handed out next, two being read
  CHECK(blocks.bytes_read() == 12 * 3 * sizeof(float));

  SECTION("the recycler keeps four blocks, and a shared block comes back with its last handle") {
    auto recycler = std::make_shared<BlockRecycler>();
    for (int b = 0; b < 5; ++b) {
      auto block = HostBlock::allocate(std::nullopt, 8);
      REQUIRE(block);
      CHECK_FALSE(block->pinned());
      recycler->give(std::move(*block));
    }
    std::set<const std::byte*> kept;
    for (int b = 0; b < 4; ++b) {  // kept blocks for sizes they hold, resized
      auto block = recycler->take(6);
      REQUIRE(block);
      CHECK(block->size() == 6);
      CHECK(block->capacity() == 8);
      kept.insert(block->data());
    }
    CHECK(kept.size() == 4);
    auto fresh = recycler->take(6);  // none kept any more: a new one
    REQUIRE(fresh);
    CHECK(fresh->capacity() == 6);
    const std::byte* data = fresh->data();
    auto shared = BlockRecycler::share(recycler, std::move(*fresh));
    auto second = shared;
    shared.reset();
    second.reset();  // the last handle
    auto back = recycler->take(4);
    REQUIRE(back);
    CHECK(back->data() == data);
    CHECK(back->size() == 4);
  }

  SECTION("with a device, blocks are its pinned memory") {
    auto device = Device::simulated();
    REQUIRE(device);
    BlockRecycler pinned(*device);
    auto block = pinned.take(16);
    REQUIRE(block);
    CHECK(block->pinned());
    CHECK(block->size() == 16);
  }
}

TEST_CASE("the base's next two blocks are read while the caller works, in order", "[knn-job]") {
  TempDir dir{"knn"};
  auto [base, reader] = base_of_3_values(dir, 12, 73);
  BaseBlocks blocks(reader, 12, 2, std::make_shared<BlockRecycler>());  // six blocks of 2 rows
  // Waits (up to 10 s) for the reading threads to have the next block, without asking for it.
  auto wait_ready = [&] {
    for (int i = 0; i < 10'000 && !blocks.next_ready(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return blocks.next_ready();
  };
  REQUIRE(wait_ready());
  auto first = blocks.next();
  REQUIRE(first);
  REQUIRE(*first);
  CHECK((*first)->first_row == 0);
  // The second block was asked for with the first: it is read while the first is in use.
  REQUIRE(wait_ready());
  auto second = blocks.next();
  REQUIRE(second);
  REQUIRE(*second);
  CHECK((*second)->first_row == 2);
  PassRead rest = read_pass(blocks);
  REQUIRE_FALSE(rest.error);
  CHECK(rest.first_rows == std::vector<std::size_t>{4, 6, 8, 10});
  CHECK(rest.values == std::vector<float>(base.values.begin() + 4 * 3, base.values.end()));
  CHECK_FALSE(blocks.next_ready());  // after the last block: nothing more to hand out
}

TEST_CASE("the base's blocks hold rows as stored, with what the scan found", "[knn-job]") {
  TempDir dir{"knn"};
  SECTION("uint8 rows stay bytes, their range known by the type") {
    auto bytes = random_ints<std::uint8_t>(10 * 4, 0, 255, 74);
    test::write_bytes(dir / "b.bvecs", test::texmex_bytes(bytes, 4));
    auto reader = io::VectorReader::open(dir / "b.bvecs");
    REQUIRE(reader);
    BaseBlocks blocks(*reader, 10, 4, std::make_shared<BlockRecycler>());  // 4, 4 and 2 rows
    auto first = blocks.next();
    REQUIRE(first);
    REQUIRE(*first);
    CHECK((*first)->rows.element == StoredElement::UInt8);
    CHECK((*first)->rows.row_bytes() == 4);
    CHECK(std::memcmp((*first)->rows.data, bytes.data(), 16) == 0);
    CHECK((*first)->stats.integer);
    CHECK((*first)->stats.max == 255);
    first->reset();
    PassRead rest = read_pass(blocks);
    CHECK(rest.values == std::vector<float>(bytes.begin() + 16, bytes.end()));
    CHECK(blocks.bytes_read() == 40);
  }
  SECTION("float rows are scanned: finiteness, whole numbers, range and the largest norm") {
    VectorSet whole{6, 2, {1, 2, 3, -4, 0, 0, 5, 6, 7, 8, -9, 1}};
    fs::path path = write_fvecs_file(dir, "ints.fvecs", whole);
    auto reader = io::VectorReader::open(path);
    REQUIRE(reader);
    BaseBlocks blocks(*reader, 6, 4, std::make_shared<BlockRecycler>(), 2);
    PassRead pass = read_pass(blocks);
    CHECK(pass.values == whole.values);
    CHECK(pass.stats.rows == 6);
    CHECK(pass.stats.integer);
    CHECK(pass.stats.finite);
    CHECK(pass.stats.min == -9);
    CHECK(pass.stats.max == 8);
    CHECK(pass.stats.max_norm2 == Approx(113.0));  // 7² + 8²
    whole.values[11] = 1.5f;
    whole.values[3] = std::numeric_limits<float>::quiet_NaN();
    path = write_fvecs_file(dir, "mixed.fvecs", whole);
    auto mixed = io::VectorReader::open(path);
    REQUIRE(mixed);
    BaseBlocks again(*mixed, 6, 4, std::make_shared<BlockRecycler>());
    PassRead second = read_pass(again);
    CHECK_FALSE(second.stats.integer);
    CHECK_FALSE(second.stats.finite);
    CHECK(second.stats.first_nonfinite_row == 1);
  }
  SECTION("a read error ends the pass and names the record") {
    VectorSet base = random_floats(10, 3, 71);
    test::Bytes bytes = test::texmex_bytes(base.values, 3);
    bytes[6 * (4 + 3 * sizeof(float))] = 4;  // record 6 claims dimension 4
    test::write_bytes(dir / "bad.fvecs", bytes);
    auto bad = io::VectorReader::open(dir / "bad.fvecs");
    REQUIRE(bad);
    BaseBlocks cut(*bad, 10, 4, std::make_shared<BlockRecycler>());
    PassRead pass = read_pass(cut);
    CHECK(pass.values.size() == 4 * 3);  // the first block; the second holds record 6
    REQUIRE(pass.error);
    CHECK_THAT(pass.error->message(), Contains("record 6"));
  }
}

// A block read in pieces by readers of their own gives the rows one reader gives, in order,
// with the first reader left where a reader of the whole block stands; an error in a later
// piece names its record. Gzip IDX cannot seek: one reader.
TEST_CASE("the base's blocks are read in parallel pieces where the file can seek", "[knn-job]") {
  TempDir dir{"knn"};
  VectorSet base = random_floats(100, 3, 73);
  const fs::path fvecs = write_fvecs_file(dir, "base.fvecs", base);
  REQUIRE(io::write_npy(dir / "base.npy", 100, 3, base.values));
  for (const fs::path& path : {fvecs, dir / "base.npy"}) {
    INFO(path.filename());
    for (std::size_t parts : {2, 3, 7}) {
      INFO(parts << " pieces");
      auto reader = io::VectorReader::open(path);
      REQUIRE(reader);
      std::vector<float> skipped(3 * 10);
      REQUIRE(reader->read(skipped, 10) == 10u);  // the pass starts where the reader stands
      BaseBlocks blocks(*reader, 90, 16, std::make_shared<BlockRecycler>(), parts);  // 5 × 16 + 10
      PassRead pass = read_pass(blocks);
      REQUIRE_FALSE(pass.error);
      CHECK(pass.values == std::vector<float>(base.values.begin() + 30, base.values.end()));
      CHECK(pass.stats.rows == 90);
      CHECK(reader->rows_read() == 100);
    }
  }
  SECTION("an error in a later piece ends the pass at its block, naming the record") {
    test::Bytes bytes = test::texmex_bytes(base.values, 3);
    bytes[77 * (4 + 3 * sizeof(float))] = 4;  // record 77: block 4 (64..79), piece 3 of 3
    test::write_bytes(dir / "bad.fvecs", bytes);
    auto bad = io::VectorReader::open(dir / "bad.fvecs");
    REQUIRE(bad);
    BaseBlocks cut(*bad, 100, 16, std::make_shared<BlockRecycler>(), 3);
    PassRead pass = read_pass(cut);
    CHECK(pass.values.size() == 64 * 3);
    REQUIRE(pass.error);
    CHECK_THAT(pass.error->message(), Contains("record 77"));
  }
  SECTION("a gzip IDX base is read by one reader") {
    std::vector<std::uint8_t> pixels(100 * 4);
    for (std::size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<std::uint8_t>(i * 7);
    test::write_gzip(dir / "b-idx3-ubyte.gz", test::idx_bytes(pixels, 4));
    auto packed = io::VectorReader::open(dir / "b-idx3-ubyte.gz");
    REQUIRE(packed);
    REQUIRE_FALSE(packed->seekable());
    BaseBlocks blocks(*packed, 100, 16, std::make_shared<BlockRecycler>(), 4);
    PassRead pass = read_pass(blocks);
    REQUIRE_FALSE(pass.error);
    CHECK(pass.values == std::vector<float>(pixels.begin(), pixels.end()));
  }
}

TEST_CASE("query blocks and first chunks follow the headroom", "[knn-job]") {
  JobCosts fp32 = job_costs(10, 4, StoredElement::Fp32);
  CHECK(fp32.bytes_per_base_row == 40 + 40 + 10 + 4);  // as stored, fp32 form, int8 form, scale
  CHECK(fp32.chunk_bytes_per_query == 4 * 8 + 256 * 4);  // the candidates + a tile row
  CHECK(fp32.bytes_per_query == fp32.bytes_per_base_row + fp32.chunk_bytes_per_query);
  CHECK(job_costs(10, 4, StoredElement::UInt8).bytes_per_base_row == 10 + 40 + 10 + 4);

  // All queries when they fit in half the headroom, else as many as do, at least one.
  CHECK(pick_query_block(2 * 100 * fp32.bytes_per_query, 100, fp32) == 100);
  CHECK(pick_query_block(2 * 100 * fp32.bytes_per_query, 1000, fp32) == 100);
  CHECK(pick_query_block(0, 1000, fp32) == 1);
  // A third of what the block's per-chunk buffers leave, within [1, max].
  CHECK(pick_chunk_rows(0, 5, fp32, 50) == 1);
  CHECK(pick_chunk_rows(5 * fp32.chunk_bytes_per_query + 3 * fp32.bytes_per_base_row * 7, 5, fp32,
                        50) == 7);
  CHECK(pick_chunk_rows(std::size_t{1} << 40, 5, fp32, 50) == 50);
  CHECK(chunk_cap(60000, std::size_t{1} << 20) == 262144);  // a twentieth, but at least 2^18
  CHECK(chunk_cap(10000000, std::size_t{1} << 20) == 500000);
  CHECK(chunk_cap(1000000, 97) == 97);
  // The same number of batches, as equal as can be.
  CHECK(even_batch_size(2729, 5000) == 2500);
  CHECK(even_batch_size(372, 20000) == 371);  // 54 blocks: 53 of 371 and one of 337
  CHECK(even_batch_size(4096, 60000) == 4000);
  CHECK(even_batch_size(7, 7) == 7);
  CHECK(even_batch_size(10, 3) == 3);
  CHECK(even_batch_size(0, 5) == 0);
  CHECK(even_batch_size(5, 0) == 5);
  // A piece per 8 MiB of a block, at most 16 and at most the hardware threads.
  CHECK(reading_parts(256 * MiB, 16) == 16);
  CHECK(reading_parts(256 * MiB, 64) == 16);
  CHECK(reading_parts(256 * MiB, 2) == 2);
  CHECK(reading_parts(256 * MiB, 0) == 1);
  CHECK(reading_parts(20 * MiB, 16) == 2);
  CHECK(reading_parts(1 * MiB, 16) == 1);
  rc::prop("an even size keeps the batch count and is never larger", [](std::uint16_t a, std::uint32_t b) {
    const std::size_t size = std::size_t{a} + 1, total = std::size_t{b} + 1;
    const std::size_t even = even_batch_size(size, total);
    RC_ASSERT(even <= size);
    RC_ASSERT(even >= 1);
    RC_ASSERT((total + even - 1) / even == (total + size - 1) / size);
  });
  rc::prop("more headroom never gives fewer rows or queries", [](std::uint32_t a, std::uint32_t b) {
    JobCosts c = job_costs(96, 10, StoredElement::Fp32);
    std::size_t low = std::min(a, b), high = std::max(a, b);
    RC_ASSERT(pick_chunk_rows(low, 7, c, 1000) <= pick_chunk_rows(high, 7, c, 1000));
    RC_ASSERT(pick_query_block(low, 5000, c) <= pick_query_block(high, 5000, c));
  });
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
  TempDir dir{"knn"};
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
  CHECK(run.result->summary.counts.integer_chunks == run.result->summary.chunks);
  CHECK(run.result->neighbours.integer_distances);
  CHECK(brute_force_mismatches(queries, base, run.result->neighbours, Metric::L2, 0, 10) == 0);
  check_exact(run, queries, base, 100, 20);
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
  Neighbours got{10000, 100, std::vector<float>(10000 * 100), {}, std::vector<std::int32_t>(10000 * 100),
                 false};
  REQUIRE(ids->read_ints(got.indices, 10000) == 10000u);
  REQUIRE(distances->read(got.distances, 10000) == 10000u);
  VectorSet queries = read_rows(fs::path(kFashion) / "t10k-images-idx3-ubyte.gz", 10000);
  VectorSet base = read_rows(fs::path(kFashion) / "train-images-idx3-ubyte.gz", 60000);
  CHECK(brute_force_mismatches(queries, base, got, Metric::L2, 0, 20) == 0);
  // Bit for bit the host's own fp64 brute force, on a sample of the queries.
  VectorSet sample{50, queries.dim, {}};
  for (std::size_t q = 0; q < 10000; q += 200)
    sample.values.insert(sample.values.end(), queries.values.begin() + q * queries.dim,
                         queries.values.begin() + (q + 1) * queries.dim);
  Neighbours exact = fp64_reference(sample, base, 100, Metric::L2);
  for (std::size_t i = 0; i < 50; ++i) {
    CAPTURE(i * 200);
    CHECK(std::equal(exact.indices.begin() + i * 100, exact.indices.begin() + (i + 1) * 100,
                     got.indices.begin() + i * 200 * 100));
    CHECK(std::equal(exact.distances.begin() + i * 100, exact.distances.begin() + (i + 1) * 100,
                     got.distances.begin() + i * 200 * 100));
  }
}
