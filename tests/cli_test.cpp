// The gpupool command, run as a user runs it: knn on small files (outputs, JSON summary, memory
// limit), bad arguments, a corrupt base file, recall, and --help. Built where the command is
// (tools/CMakeLists.txt defines GPUPOOL_CLI_PATH; the sanitizer presets build no tools).
#include <catch2/catch.hpp>
#ifdef GPUPOOL_CLI_PATH
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <string>
#include <sys/stat.h>
#include <sys/wait.h>
#include <system_error>
#include <tuple>
#include <type_traits>
#include <unistd.h>
#include <vector>
#include "support/vector_files.hpp"
#include "exact_knn.hpp"
#include "support/temp_dir.hpp"
#include "support/cli_runner.hpp"

using namespace gpupool;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

using gpupool::testing::TempDir;
using gpupool::testing::Outcome;
using gpupool::testing::gpupool_cli;

namespace {

exact::VectorSet random_set(std::size_t rows, std::size_t dim, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  exact::VectorSet set{rows, dim, std::vector<float>(rows * dim)};
  for (float& v : set.values) v = value(rng);
  return set;
}

void write_set(const std::string& path, const exact::VectorSet& set) {
  REQUIRE(io::write_fvecs(path, set.rows, set.dim, std::span<const float>(set.values)));
}

// The same job through the library, on a roomy simulated device.
exact::Neighbours library_result(const exact::VectorSet& queries, const std::string& base_path,
                                 std::size_t k, Metric metric) {
  auto device = Device::simulated({.capacity = 64 * MiB});
  REQUIRE(device);
  GpuMemoryPool pool;
  auto base = io::VectorReader::open(base_path);
  REQUIRE(base);
  auto result = exact::run_exact_knn(pool, *device, queries, *base, {.k = k, .metric = metric});
  REQUIRE(result);
  return result->neighbours;
}

template <class T>
std::vector<T> read_table(const std::string& path, std::size_t rows, std::size_t cols) {
  auto reader = io::VectorReader::open(path);
  REQUIRE(reader);
  REQUIRE((reader->rows() == rows && reader->dim() == cols));
  std::vector<T> values(rows * cols);
  if constexpr (std::is_same_v<T, float>) REQUIRE(reader->read(values, rows) == rows);
  else REQUIRE(reader->read_ints(values, rows) == rows);
  return values;
}

}  // namespace

TEST_CASE("gpupool knn writes the library's neighbours and a JSON summary", "[cli]") {
  TempDir dir{"cli"};
  exact::VectorSet queries = random_set(10, 8, 1), base = random_set(600, 8, 2);
  write_set(dir.file("q.fvecs"), queries);
  write_set(dir.file("b.fvecs"), base);
  auto [metric_name, metric, format] = GENERATE(std::tuple{"l2", Metric::L2, "ivecs"},
                                                std::tuple{"ip", Metric::InnerProduct, "npy"});
  CAPTURE(metric_name, format);
  Outcome run = gpupool_cli(("knn --base " + dir.file("b.fvecs") + " --query " + dir.file("q.fvecs") +
                                     " --k 7 --metric " + metric_name + " --out-format " + format +
                                     " --device sim:64MiB --max-chunk-rows 128 --quiet --json --out " +
                                     dir.file("sub/run")), false);
  REQUIRE(run.status == 0);
  auto json = nlohmann::json::parse(run.output);
  CHECK(json["queries"] == 10);
  CHECK(json["base_rows"] == 600);
  CHECK(json["k"] == 7);
  CHECK(json["chunks"] == 5);  // 600 rows in chunks of at most 128
  CHECK(json["retries"] == 0);
  CHECK(json["seconds"].get<double>() > 0);
  double step_seconds = 0;
  for (const char* step : {"preparing_queries", "starting_device", "waiting_for_base", "uploading",
                           "searching", "merging"}) {
    CAPTURE(step);
    CHECK(json["times"][step].get<double>() >= 0);
    step_seconds += json["times"][step].get<double>();
  }
  CHECK(step_seconds <= json["seconds"].get<double>());
  CHECK(json["times"]["other"].get<double>() ==
        Approx(json["seconds"].get<double>() - step_seconds).margin(1e-9));
  CHECK(json["pool"]["peak_reserved_bytes"].get<std::size_t>() > 0);
  bool npy = std::string(format) == "npy";
  std::string ids_file = dir / (npy ? "sub/run.neighbors.npy" : "sub/run.neighbors.ivecs");
  std::string distances_file = dir / (npy ? "sub/run.distances.npy" : "sub/run.distances.fvecs");
  CHECK(json["neighbors_file"] == ids_file);
  exact::Neighbours expected = library_result(queries, dir.file("b.fvecs"), 7, metric);
  CHECK(read_table<std::int32_t>(ids_file, 10, 7) == expected.indices);
  CHECK(read_table<float>(distances_file, 10, 7) == expected.distances);
}

TEST_CASE("gpupool knn: exact by default, --verify, --fast and fp64 / int64 distances", "[cli]") {
  TempDir dir{"cli"};
  std::vector<std::uint8_t> base(500 * 16), queries(6 * 16);
  std::mt19937 rng(7);
  for (auto& v : base) v = static_cast<std::uint8_t>(rng() % 256);
  for (auto& v : queries) v = static_cast<std::uint8_t>(rng() % 256);
  test::write_bytes(dir.file("b.bvecs"), test::texmex_bytes(base, 16));
  test::write_bytes(dir.file("q.bvecs"), test::texmex_bytes(queries, 16));
  const std::string files = " --base " + dir.file("b.bvecs") + " --query " + dir.file("q.bvecs");
  Outcome exact = gpupool_cli("knn --device sim:64MiB --k 5 --quiet --json --verify 6 --out-format npy "
                              "--distance-type int64 --max-chunk-rows 128 --out " + dir.file("e") + files,
                              false);
  REQUIRE(exact.status == 0);
  auto json = nlohmann::json::parse(exact.output);
  CHECK(json["mode"] == "exact");
  CHECK(json["exact"]["integer_chunks"] == 4);
  CHECK(json["bytes"]["uploaded"] == 500 * 16);  // the bytes as stored
  CHECK(json["bytes"]["read"] == 500 * 16);
  CHECK(json["times"]["other"].get<double>() >= 0);
  auto int64 = test::read_bytes(dir.file("e.distances.npy"));
  CHECK(int64.size() == 128 + 6 * 5 * 8);
  std::int64_t nearest = -1;
  std::memcpy(&nearest, int64.data() + 128, 8);
  std::int64_t want = -1;  // query 0's nearest, by an integer brute force
  for (std::size_t r = 0; r < 500; ++r) {
    std::int64_t d = 0;
    for (std::size_t c = 0; c < 16; ++c) {
      const std::int64_t diff = std::int64_t{queries[c]} - base[r * 16 + c];
      d += diff * diff;
    }
    if (want < 0 || d < want) want = d;
  }
  CHECK(nearest == want);
  Outcome fast = gpupool_cli("knn --device sim:64MiB --k 5 --quiet --json --fast --precision fp16 --out " +
                             dir.file("f") + files, false);
  REQUIRE(fast.status == 0);
  CHECK(nlohmann::json::parse(fast.output)["mode"] == "fast");
  CHECK(nlohmann::json::parse(fast.output)["precision"] == "fp16");
}

TEST_CASE("gpupool knn at extreme magnitudes: fp16 scaled into range, fp32 overflow refused",
          "[cli]") {
  TempDir dir{"cli"};
  auto scaled = [](exact::VectorSet set, float scale) {
    for (float& v : set.values) v *= scale;
    return set;
  };
  // N(0,1)·10^5 overflowed fp16 before it was scaled: every distance was inf or NaN.
  write_set(dir.file("b.fvecs"), scaled(random_set(400, 16, 61), 1e5f));
  write_set(dir.file("q.fvecs"), scaled(random_set(5, 16, 62), 1e5f));
  const std::string files = " --base " + dir.file("b.fvecs") + " --query " + dir.file("q.fvecs");
  Outcome exact = gpupool_cli("knn --device sim:64MiB --k 10 --quiet --out " + dir.file("e") + files, true);
  REQUIRE(exact.status == 0);
  Outcome fp16 = gpupool_cli("knn --device sim:64MiB --k 10 --quiet --json --fast --precision fp16 "
                             "--out " + dir.file("f") + files, false);
  REQUIRE(fp16.status == 0);
  CHECK(nlohmann::json::parse(fp16.output)["non_finite_distances"] == 0);
  Outcome recall = gpupool_cli("recall --k 10 --min-recall 0.9 --truth " + dir.file("e.neighbors.ivecs") +
                               " --result " + dir.file("f.neighbors.ivecs"), true);
  CHECK(recall.status == 0);

  // 10^21: squared distances beyond fp32's range — refused as fp32, written as fp64.
  write_set(dir.file("hb.fvecs"), scaled(random_set(300, 8, 63), 1e21f));
  write_set(dir.file("hq.fvecs"), scaled(random_set(3, 8, 64), 1e21f));
  const std::string huge = " --base " + dir.file("hb.fvecs") + " --query " + dir.file("hq.fvecs");
  Outcome refused = gpupool_cli("knn --device sim:64MiB --k 5 --quiet --out " + dir.file("h") + huge, true);
  CHECK(refused.status == 1);
  CHECK_THAT(refused.output, Contains("beyond fp32's range") && Contains("--distance-type fp64"));
  CHECK_FALSE(fs::exists(dir.file("h.neighbors.ivecs")));
  Outcome fp64 = gpupool_cli("knn --device sim:64MiB --k 5 --quiet --out-format npy --distance-type fp64 "
                             "--out " + dir.file("h") + huge, true);
  CHECK(fp64.status == 0);
  CHECK(fs::exists(dir.file("h.distances.npy")));
}

TEST_CASE("gpupool knn under a memory limit streams a base larger than the limit", "[cli]") {
  TempDir dir{"cli"};
  write_set(dir.file("q.fvecs"), random_set(4, 64, 3));
  write_set(dir.file("b.fvecs"), random_set(2048, 64, 4));  // 512 KiB of fp32
  Outcome run = gpupool_cli("knn --base " + dir.file("b.fvecs") + " --query " + dir.file("q.fvecs") +
                            " --k 3 --device sim:64MiB --memory-limit 128KiB --json --out " + dir.file("r"));
  REQUIRE(run.status == 0);
  CHECK_THAT(run.output, Contains("knn: 2048/2048 base rows (100%)"));  // progress log lines
  auto json = nlohmann::json::parse(run.output.substr(run.output.find('{')));
  CHECK(json["chunks"].get<int>() >= 4);
  CHECK(json["pool"]["peak_reserved_bytes"].get<std::size_t>() <= 128 * 1024);
}

TEST_CASE("gpupool knn searches queries larger than the memory limit in blocks", "[cli]") {
  TempDir dir{"cli"};
  exact::VectorSet queries = random_set(1500, 32, 7);  // 187.5 KiB of fp32 under a 128 KiB limit
  write_set(dir.file("q.fvecs"), queries);
  write_set(dir.file("b.fvecs"), random_set(700, 32, 8));
  Outcome run = gpupool_cli("knn --base " + dir.file("b.fvecs") + " --query " + dir.file("q.fvecs") +
                            " --k 5 --device sim:64MiB --memory-limit 128KiB --json --out " + dir.file("r"));
  REQUIRE(run.status == 0);
  CHECK_THAT(run.output, Contains("knn: queries 0..") && Contains(" of 1500: "));  // progress names the block
  auto json = nlohmann::json::parse(run.output.substr(run.output.find('{')));
  CHECK(json["query_blocks"].get<int>() >= 3);
  CHECK(json["largest_query_block"].get<int>() < 1500);
  CHECK(json["query_block_retries"] == 0);
  CHECK(json["pool"]["peak_reserved_bytes"].get<std::size_t>() <= 128 * 1024);
  exact::Neighbours expected = library_result(queries, dir.file("b.fvecs"), 5, Metric::L2);
  CHECK(read_table<std::int32_t>(dir.file("r.neighbors.ivecs"), 1500, 5) == expected.indices);
  CHECK(read_table<float>(dir.file("r.distances.fvecs"), 1500, 5) == expected.distances);
}

TEST_CASE("gpupool knn refuses bad arguments and corrupt files, leaving no output", "[cli]") {
  TempDir dir{"cli"};
  write_set(dir.file("q.fvecs"), random_set(3, 4, 5));
  exact::VectorSet base = random_set(300, 4, 6);
  write_set(dir.file("b.fvecs"), base);
  std::string files = " --base " + dir.file("b.fvecs") + " --query " + dir.file("q.fvecs") + " --out " + dir.file("o");
  auto refused = [&](const std::string& args, int status) {
    Outcome run = gpupool_cli("knn --device sim " + args);
    CHECK(run.status == status);
    CHECK_FALSE(fs::exists(dir.file("o.neighbors.ivecs")));
    return run.output;
  };
  // Usage errors (2) name the option: no wrapped negatives, no fractions.
  for (const char* bad : {"--k 0", "--k -1", "--k 1025", "--k 2.5", "--max-chunk-rows -1",
                          "--max-chunk-rows 0", "--verify -3"}) {
    CAPTURE(bad);
    const std::string option = std::string(bad).substr(0, std::string(bad).find(' '));
    CHECK_THAT(refused(files + " " + bad, 2), Contains(option) && Contains("a whole number from"));
  }
  CHECK_THAT(refused(files + " --k 301", 1), Contains("k = 301") && Contains("300 rows"));
  CHECK_THAT(refused(files + " --metric l1", 1), Contains("--metric l1") && Contains("l2, ip or cos"));
  CHECK_THAT(refused(files + " --precision fp64", 1), Contains("--precision fp64"));
  CHECK_THAT(refused(files + " --precision fp16", 1), Contains("--fast"));
  CHECK_THAT(refused(files + " --fast --verify 3", 1), Contains("--verify"));
  CHECK_THAT(refused(files + " --allow-non-finite", 1), Contains("--allow-non-finite") && Contains("--fast"));
  CHECK_THAT(refused(files + " --distance-type fp64", 1), Contains("--out-format npy"));
  CHECK_THAT(refused(files + " --distance-type fp128 --out-format npy", 1),
             Contains("--distance-type fp128") && Contains("fp32, fp64 or int64"));
  CHECK_THAT(refused(files + " --memory-limit lots", 1), Contains("--memory-limit lots"));
  CHECK_THAT(refused(files + " --out-format csv", 1), Contains("--out-format csv"));
  CHECK_THAT(refused("--query " + dir.file("q.fvecs"), 2), Contains("--base is required"));
  CHECK_THAT(refused("--base " + dir.file("none.fvecs --query ") + dir.file("q.fvecs"), 1),
             Contains("none.fvecs"));

  // Outputs are checked before the job: a prefix that names a folder, an output that is an input,
  // a folder that cannot be written.
  const std::string inputs = " --base " + dir.file("b.fvecs") + " --query " + dir.file("q.fvecs");
  CHECK_THAT(refused(inputs + " --out ''", 1), Contains("--out ''") && Contains("prefix"));
  CHECK_THAT(refused(inputs + " --out " + dir.file("sub/"), 1), Contains("names files, not a folder"));
  fs::copy_file(dir.file("q.fvecs"), dir.file("in.distances.fvecs"));
  CHECK_THAT(refused("--base " + dir.file("b.fvecs") + " --query " + dir.file("in.distances.fvecs") +
                         " --out " + dir.file("in"), 1),
             Contains("which is the input") && Contains("in.distances.fvecs"));
  CHECK(test::read_bytes(dir.file("in.distances.fvecs")) == test::read_bytes(dir.file("q.fvecs")));
  if (::geteuid() != 0) {  // root writes anywhere
    fs::create_directories(dir.file("locked"));
    fs::permissions(dir.file("locked"), fs::perms::owner_read | fs::perms::owner_exec);
    CHECK_THAT(refused(inputs + " --out " + dir.file("locked/o"), 1),
               Contains("locked") && Contains("cannot create the temporary file"));
    fs::permissions(dir.file("locked"), fs::perms::owner_all);
  }
  const std::string too_long(239, 'n');  // + .neighbors.ivecs fits NAME_MAX, + .tmp-PID not
  CHECK_THAT(refused(inputs + " --out " + dir.file(too_long), 1), Contains("cannot create the temporary file"));
  CHECK_FALSE(fs::exists(dir / (too_long + ".neighbors.ivecs")));

  // A FIFO with no writer is refused, not waited on.
  REQUIRE(::mkfifo((dir.file("fifo.fvecs")).c_str(), 0600) == 0);
  CHECK_THAT(refused("--base " + dir.file("fifo.fvecs --query ") + dir.file("q.fvecs --out ") + dir.file("o"), 1),
             Contains("fifo.fvecs") && Contains("not a regular file"));

  // A file cut short in its last record.
  test::Bytes whole = test::texmex_bytes(base.values, 4);
  test::write_bytes(dir.file("cut.fvecs"), test::Bytes(whole.begin(), whole.end() - 3));
  CHECK_THAT(refused("--base " + dir.file("cut.fvecs --query ") + dir.file("q.fvecs --out ") + dir.file("o"), 1),
             Contains("cut.fvecs") && Contains("whole records"));

  // Record 250 claims another dimension: found mid-stream, after chunks were done.
  test::Bytes bytes = test::texmex_bytes(base.values, 4);
  bytes[250 * (4 + 4 * sizeof(float))] = 9;
  test::write_bytes(dir.file("b.fvecs"), bytes);
  CHECK_THAT(refused(files + " --k 2 --max-chunk-rows 50", 1),
             Contains("b.fvecs") && Contains("record 250") && Contains("dimension 9"));
  CHECK_FALSE(fs::exists(dir.file("o.distances.fvecs")));
}

TEST_CASE("gpupool recall reports recall@k, with ties when distances are given", "[cli]") {
  TempDir dir{"cli"};
  std::vector<std::int32_t> truth{0, 1, 2, 3, 4, 5}, result{1, 0, 7, 3, 4, 5};
  std::vector<float> truth_d{1, 2, 3, 1, 2, 3}, result_d{1, 2, 3, 1, 2, 3};  // 7 ties the 3rd
  REQUIRE(io::write_ivecs(dir.file("t.ivecs"), 2, 3, std::span<const std::int32_t>(truth)));
  REQUIRE(io::write_ivecs(dir.file("r.ivecs"), 2, 3, std::span<const std::int32_t>(result)));
  REQUIRE(io::write_fvecs(dir.file("td.fvecs"), 2, 3, std::span<const float>(truth_d)));
  REQUIRE(io::write_fvecs(dir.file("rd.fvecs"), 2, 3, std::span<const float>(result_d)));
  std::string ids = "recall --truth " + dir.file("t.ivecs") + " --result " + dir.file("r.ivecs") + " --k 3";
  Outcome plain = gpupool_cli(ids);
  CHECK(plain.status == 0);
  CHECK_THAT(plain.output, Contains("recall@3 = 0.833333") && Contains("ties not recognised"));
  std::string with_distances = ids + " --truth-distances " + dir.file("td.fvecs") +
                               " --result-distances " + dir.file("rd.fvecs");
  Outcome tied = gpupool_cli(with_distances + " --json");
  REQUIRE(tied.status == 0);
  auto json = nlohmann::json::parse(tied.output);
  CHECK(json["recall"].get<double>() == Approx(1.0));
  CHECK(json["tie_hits"] == 1);
  Outcome below = gpupool_cli(ids + " --min-recall 0.9");
  CHECK(below.status == 1);
  CHECK_THAT(below.output, Contains("below --min-recall 0.9"));
  for (const char* bad : {" --min-recall nan", " --min-recall 1.5", " --tolerance inf",
                          " --tolerance -1", " --k -1"}) {
    CAPTURE(bad);
    Outcome refused = gpupool_cli(with_distances + bad);
    CHECK(refused.status == 2);
    CHECK_THAT(refused.output, Contains(std::string(bad).substr(1, std::string(bad).find(' ', 1) - 1)));
  }
  Outcome wrong_k = gpupool_cli(ids.substr(0, ids.size() - 1) + "4");
  CHECK(wrong_k.status == 1);
  CHECK_THAT(wrong_k.output, Contains("at least k = 4"));
}

TEST_CASE("gpupool bench --trace adds a recorded trace to the fragmentation rows", "[cli]") {
  TempDir dir{"cli"};
  // A recorded trace as `gpupool replay` reads it: 1 MiB and 3 MiB live together (4 MiB, the
  // peak), then 512 KiB; the free of an allocation made before the recording is left out.
  const std::string trace_path = dir.file("small-run.csv");
  std::ofstream(trace_path)
      << "seq,time_ns,event,device,id,bytes,block_bytes,precision,stream,in_use_bytes,"
         "reserved_bytes,limit_bytes\n"
         "0,0,alloc,0,1,1048576,1048576,bytes,0,1048576,33554432,1073741824\n"
         "1,10,alloc,0,2,3145728,3145728,bytes,0,4194304,33554432,1073741824\n"
         "2,20,free,0,99,4096,4096,bytes,0,4194304,33554432,1073741824\n"
         "3,30,free,0,1,1048576,1048576,bytes,0,3145728,33554432,1073741824\n"
         "4,40,alloc,0,3,524288,524288,bytes,0,3670016,33554432,1073741824\n"
         "5,50,free,0,2,3145728,3145728,bytes,0,524288,33554432,1073741824\n";
  const std::string json_path = dir.file("bench.json");
  Outcome run = gpupool_cli("bench --quick --only fragmentation --trace " + trace_path +
                                " --json " + json_path, true, "GPUPOOL_DEVICE=sim:16GiB");
  REQUIRE(run.status == 0);
  CHECK_THAT(run.output, Contains("small-run"));
  std::ifstream lines(json_path);
  int rows = 0;
  for (std::string line; std::getline(lines, line);) {
    auto json = nlohmann::json::parse(line);
    if (json["bench"] != "fragmentation" || json["trace"] != "small-run") continue;
    ++rows;
    // 4 MiB at the peak, in 32 MiB segments or in pages: never less than the peak request
    CHECK(json["fragmentation"].get<double>() >= 1.0);
  }
  CHECK(rows == 3);  // device segments, virtual segments, virtual segments with a page budget
  Outcome missing = gpupool_cli("bench --quick --trace " + dir.file("absent.csv"), true,
                                "GPUPOOL_DEVICE=sim:16GiB");
  CHECK(missing.status == 2);
  CHECK_THAT(missing.output, Contains("absent.csv"));
}

TEST_CASE("gpupool bench --devices spreads the threads over devices and reports each one's pool",
          "[cli]") {
  TempDir dir{"cli"};
  const std::string json_path = dir.file("bench.json");
  Outcome run = gpupool_cli("bench --quick --only threads --threads 1,3 --devices 3 --json " +
                                json_path, true, "GPUPOOL_DEVICE=sim:16GiB");
  REQUIRE(run.status == 0);
  CHECK_THAT(run.output, Contains("3 threads, 3 dev"));
  std::ifstream lines(json_path);
  std::map<std::string, std::set<std::string>> devices_of;  // allocator → devices reported
  int threads_rows = 0;
  for (std::string line; std::getline(lines, line);) {
    auto json = nlohmann::json::parse(line);
    if (json["bench"] == "threads") {
      ++threads_rows;
      CHECK(json["devices"] == 3);
    } else {
      REQUIRE(json["bench"] == "devices");
      devices_of[json["allocator"]].insert(json["on_device"].get<std::string>());
      // every device served the thread put on it (3 threads on 3 devices)
      CHECK(json["allocations"].get<std::uint64_t>() > 0);
    }
  }
  CHECK(threads_rows == 6);  // 1 and 3 threads; device segments, virtual, with a page budget
  CHECK(devices_of["gpupool"].size() == 3);
  CHECK(devices_of["gpupool/virtual"].size() == 3);
  CHECK(devices_of["gpupool/budget"].size() == 3);
  for (const char* count : {"0", "x", "65", "2,3"}) {
    CAPTURE(count);
    Outcome refused = gpupool_cli(std::string("bench --quick --only threads --devices ") + count,
                                  true, "GPUPOOL_DEVICE=sim:16GiB");
    CHECK(refused.status == 2);
    CHECK_THAT(refused.output, Contains("--devices"));
  }
}

TEST_CASE("gpupool bench runs the pool benchmark and writes JSON lines", "[cli]") {
  TempDir dir{"cli"};
  std::string json_path = dir.file("bench.json");
  Outcome run = gpupool_cli("bench --quick --threads 1,2 --limit 1.5 --json " + json_path, true,
                            "GPUPOOL_DEVICE=sim:16GiB");
  REQUIRE(run.status == 0);
  CHECK_THAT(run.output, Contains("fragmentation") && Contains("gpupool"));
  std::ifstream lines(json_path);
  std::set<std::string> benches;
  for (std::string line; std::getline(lines, line);) {
    auto json = nlohmann::json::parse(line);
    benches.insert(json["bench"].get<std::string>());
    if (json["bench"] == "fragmentation") {
      CHECK(json["fragmentation"].get<double>() >= 1.0);
      // the limited rows: the pool stayed within its hard limit of 1.5 × the trace's peak
      if (json["trace"].get<std::string>().ends_with("under 1.50x"))
        CHECK(json["fragmentation"].get<double>() <= 1.5);
    } else {
      CHECK(json["ns_per_op"].get<double>() > 0);
      // each pair and trace row says how fast the core ran just before it
      if (json["bench"] == "pair" || json["bench"] == "trace") CHECK(json["core_check_ns"].get<double>() > 0);
    }
  }
  CHECK(benches ==
        std::set<std::string>{"pair", "trace", "threads", "fragmentation", "limited trace"});
  // --heap-pad moves the pools on the heap and changes nothing else; too large a pad is refused
  Outcome padded = gpupool_cli("bench --quick --only pair --heap-pad 48", true, "GPUPOOL_DEVICE=sim:16GiB");
  CHECK(padded.status == 0);
  CHECK_THAT(padded.output, Contains("core check"));
  for (const char* pad : {"-1", "2000000", "4k"}) {
    CAPTURE(pad);
    Outcome refused = gpupool_cli(std::string("bench --only pair --heap-pad ") + pad, true,
                                  "GPUPOOL_DEVICE=sim:16GiB");
    CHECK(refused.status == 2);
    CHECK_THAT(refused.output, Contains("--heap-pad"));
  }
  for (const char* limit : {"0.5", "abc", "5", "1.2x"}) {
    CAPTURE(limit);
    Outcome refused = gpupool_cli(std::string("bench --limit ") + limit, true,
                                  "GPUPOOL_DEVICE=sim:16GiB");
    CHECK(refused.status == 2);
    CHECK_THAT(refused.output, Contains("--limit"));
  }
  Outcome bad = gpupool_cli("bench --threads");
  CHECK(bad.status == 2);
  for (const char* threads : {"abc,-3,0", "0", "2,", "1025"}) {
    CAPTURE(threads);
    Outcome refused = gpupool_cli(std::string("bench --threads ") + threads, true,
                                  "GPUPOOL_DEVICE=sim:16GiB");
    CHECK(refused.status == 2);
    CHECK_THAT(refused.output, Contains("--threads"));
  }
  Outcome only = gpupool_cli("bench --only bogus", true, "GPUPOOL_DEVICE=sim:16GiB");
  CHECK(only.status == 2);
  CHECK_THAT(only.output, Contains("--only"));
  Outcome unwritable = gpupool_cli("bench --quick --only pair --json " + dir.file("absent/x.json"), true,
                                   "GPUPOOL_DEVICE=sim:16GiB");
  CHECK(unwritable.status == 1);
  CHECK_THAT(unwritable.output, Contains("absent/x.json"));
}

TEST_CASE("gpupool replay runs a recorded trace under another configuration", "[cli]") {
  TempDir dir{"cli"};
  auto device = Device::simulated({.capacity = 64 * MiB});
  REQUIRE(device);
  GpuMemoryPool pool;
  REQUIRE(enable_tracing(pool, {.history_capacity = 1000}));
  {
    std::vector<ManagedBuffer> live;
    for (std::size_t i = 1; i <= 8; ++i) {
      auto buffer = pool.get_managed_buffer(*device, i * 3000 + 17, Precision::Bytes);  // class blocks
      REQUIRE(buffer);
      live.push_back(std::move(*buffer));
    }
  }
  const std::size_t recorded_peak = pool.stats(*device).peak_reserved_bytes;
  std::string trace = dir.file("run.csv");
  REQUIRE(write_trace(history(pool), trace, TraceFormat::Csv));

  Outcome text = gpupool_cli("replay " + trace);
  CHECK(text.status == 0);
  CHECK_THAT(text.output, Contains("replay on"));
  Outcome json_run = gpupool_cli("replay " + trace + " --json", /*with_stderr=*/false);
  REQUIRE(json_run.status == 0);
  auto json = nlohmann::json::parse(json_run.output);
  CHECK(json["allocations"] == 8);
  CHECK(json["frees"] == 8);
  CHECK(json["peak_reserved"].get<std::size_t>() == recorded_peak);
  Outcome limited = gpupool_cli("replay " + trace + " --json --memory-limit 40000", false);
  REQUIRE(limited.status == 0);
  CHECK(nlohmann::json::parse(limited.output)["replay_ooms"].get<std::size_t>() > 0);

  Outcome percent = gpupool_cli("replay " + trace + " --memory-limit 50%");
  CHECK(percent.status == 1);
  CHECK_THAT(percent.output, Contains("needs --device"));
  Outcome missing = gpupool_cli("replay " + (dir.file("absent.csv")));
  CHECK(missing.status == 1);
  CHECK_THAT(missing.output, Contains("absent.csv"));
  // Nothing to replay is an error, not "events 0".
  std::ofstream(dir.file("empty.csv")).flush();
  for (const std::string& nothing : {dir.file("empty.csv"), std::string("/dev/null"), dir.file("")}) {
    CAPTURE(nothing);
    Outcome refused = gpupool_cli("replay " + nothing);
    CHECK(refused.status == 1);
    CHECK_THAT(refused.output, Contains("no events") || Contains("not a regular file"));
  }
  Outcome zero = gpupool_cli("replay " + trace + " --memory-limit 0");
  CHECK(zero.status == 1);
  CHECK_THAT(zero.output, Contains("--memory-limit") && Contains("not 0"));
  CHECK(gpupool_cli("replay " + trace + " --cache-limit 0").status == 0);
}

TEST_CASE("gpupool info shows the pool configuration from the environment", "[cli]") {
  Outcome info = gpupool_cli("info --device sim:64MiB", true);
  CHECK(info.status == 0);
  CHECK_THAT(info.output, Contains("round trip") && Contains("pool: caching"));
  Outcome limited = gpupool_cli("info --device sim:64MiB", true, "GPUPOOL_MEMORY_LIMIT=1GiB GPUPOOL_POOL=none");
  CHECK(limited.status == 0);
  CHECK_THAT(limited.output, Contains("pass-through") && Contains("hard limit 1.00 GiB"));
  Outcome bad = gpupool_cli("info --device sim:64MiB", true, "GPUPOOL_CACHE_LIMIT=plenty");
  CHECK(bad.status == 1);
  CHECK_THAT(bad.output, Contains("GPUPOOL_CACHE_LIMIT") && Contains("plenty"));
  // A cache limit of 0 caches nothing; a hard limit of 0 is refused.
  Outcome no_cache = gpupool_cli("info --device sim:64MiB", true, "GPUPOOL_CACHE_LIMIT=0");
  CHECK(no_cache.status == 0);
  CHECK_THAT(no_cache.output, Contains("cache limit 0 B"));
  Outcome no_memory = gpupool_cli("info --device sim:64MiB", true, "GPUPOOL_MEMORY_LIMIT=0");
  CHECK(no_memory.status == 1);
  CHECK_THAT(no_memory.output, Contains("GPUPOOL_MEMORY_LIMIT") && Contains("not 0"));
  // Percentages are of the chosen device, whatever GPUPOOL_DEVICE says.
  Outcome share = gpupool_cli("info --device sim:64MiB", true,
                              "GPUPOOL_DEVICE=cuda:7 GPUPOOL_MEMORY_LIMIT=50%");
  CHECK(share.status == 0);
  CHECK_THAT(share.output, Contains("hard limit 32.00 MiB"));
}

TEST_CASE("gpupool --help names the subcommands and the default job", "[cli]") {
  Outcome help = gpupool_cli("--help");
  CHECK(help.status == 0);
  CHECK_THAT(help.output, Contains("knn") && Contains("recall") && Contains("info") &&
                              Contains("fashion-mnist"));
  Outcome knn_help = gpupool_cli("knn --help");
  CHECK(knn_help.status == 0);
  CHECK_THAT(knn_help.output, Contains("--memory-limit") && Contains(".neighbors.ivecs"));
}
#endif  // GPUPOOL_CLI_PATH
