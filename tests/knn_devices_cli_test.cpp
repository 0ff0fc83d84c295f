// `gpupool knn --devices` and `mpirun -np N gpupool knn`, run as a user runs them: the files of a
// job split over several simulated devices, and over MPI processes, byte-identical to one device's
// (Fashion-MNIST where installed, and a synthetic base whose rows do not divide evenly), every
// output format, each device's pool figures, bad --devices, a failing device and a failing rank.
// Built where the command is (GPUPOOL_CLI_PATH); the MPI cases where MPI is (GPUPOOL_MPIEXEC), run
// by CTest with Open MPI's run-as-root variables set for them alone (tests/CMakeLists.txt).
#include <catch2/catch.hpp>
#ifdef GPUPOOL_CLI_PATH
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <string>
#include <sys/wait.h>
#include <system_error>
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
using gpupool::testing::shell;

namespace {

constexpr const char* kFashionMnist = "/usr/share/datasets/fashion-mnist";

// The first `rows` images of a Fashion-MNIST IDX file, as .bvecs (uint8, as stored).
void write_fashion_rows(const std::string& idx, std::size_t rows, const std::string& out) {
  auto reader = io::VectorReader::open(idx);
  REQUIRE(reader);
  rows = std::min(rows, reader->rows());
  std::vector<float> values(rows * reader->dim());
  REQUIRE(reader->read(values, rows) == rows);
  std::vector<std::uint8_t> bytes(values.begin(), values.end());
  test::write_bytes(out, test::texmex_bytes(bytes, reader->dim()));
}

bool fashion_mnist_installed() {
  std::error_code error;
  return fs::is_regular_file(fs::path(kFashionMnist) / "train-images-idx3-ubyte.gz", error) &&
         fs::is_regular_file(fs::path(kFashionMnist) / "t10k-images-idx3-ubyte.gz", error);
}

bool same_bytes(const std::string& a, const std::string& b) {
  return fs::exists(a) && fs::exists(b) && test::read_bytes(a) == test::read_bytes(b);
}

// Both output files of `prefix` equal those of `reference` byte for byte.
void check_same_files(const std::string& prefix, const std::string& reference, const std::string& format) {
  const std::string ids = format == "npy" ? ".neighbors.npy" : ".neighbors.ivecs";
  const std::string distances = format == "npy" ? ".distances.npy" : ".distances.fvecs";
  CHECK(same_bytes(prefix + ids, reference + ids));
  CHECK(same_bytes(prefix + distances, reference + distances));
}

// A synthetic job: 1003 base rows (prime: no count of devices divides them), 23 queries.
struct SyntheticJob {
  TempDir dir{"devices"};
  std::string base = dir.file("base.fvecs"), query = dir.file("query.fvecs");
  explicit SyntheticJob(bool spread = false) {
    test::write_bytes(base, test::texmex_bytes(test::random_rows(1003, 16, 5, spread), 16));
    test::write_bytes(query, test::texmex_bytes(test::random_rows(23, 16, 6, spread), 16));
  }
  std::string args(const std::string& out, const std::string& extra) const {
    return "knn --base " + base + " --query " + query + " --k 10 --quiet --out " + out + " " + extra;
  }
};

}  // namespace

TEST_CASE("gpupool knn --devices: several simulated devices write one device's files, every format",
          "[cli][devices]") {
  SyntheticJob job;
  auto [format, extra] = GENERATE(std::pair<std::string, std::string>{"ivecs", ""},
                                  std::pair<std::string, std::string>{"npy", "--out-format npy"},
                                  std::pair<std::string, std::string>{"npy", "--out-format npy --distance-type fp64"},
                                  std::pair<std::string, std::string>{"ivecs", "--metric ip"},
                                  std::pair<std::string, std::string>{"ivecs", "--metric cos --max-chunk-rows 50"});
  CAPTURE(format, extra);
  const std::string one = job.dir.file("one"), several = job.dir.file("several");
  REQUIRE(gpupool_cli(job.args(one, extra + " --device sim")).status == 0);
  for (const std::string devices : {"sim,sim", "sim:1MiB,sim,sim:256KiB", "sim,sim,sim,sim"}) {
    CAPTURE(devices);
    Outcome run = gpupool_cli(job.args(several, extra + " --devices " + devices));
    REQUIRE(run.status == 0);
    check_same_files(several, one, format);
  }
}

TEST_CASE("gpupool knn --devices, fast fp16: files equal one device's where blocks set the rounding",
          "[cli][devices]") {
  SyntheticJob job(true);
  const std::string extra = "--fast --precision fp16 --max-chunk-rows 100";
  const std::string one = job.dir.file("one"), several = job.dir.file("several"), other = job.dir.file("other");
  REQUIRE(gpupool_cli(job.args(one, extra + " --device sim")).status == 0);
  // The data makes the block boundaries matter: 150-row blocks give other files.
  REQUIRE(gpupool_cli(job.args(other, "--fast --precision fp16 --max-chunk-rows 150 --device sim")).status == 0);
  CHECK_FALSE(same_bytes(other + ".distances.fvecs", one + ".distances.fvecs"));
  REQUIRE(gpupool_cli(job.args(several, extra + " --devices sim,sim,sim")).status == 0);
  check_same_files(several, one, "ivecs");
}

TEST_CASE("gpupool knn --devices shows each device's share, time and pool figures", "[cli][devices]") {
  SyntheticJob job;
  Outcome run = gpupool_cli(job.args(job.dir.file("run"), "--devices sim,sim:4MiB,sim --json"), false);
  REQUIRE(run.status == 0);
  const auto json = nlohmann::json::parse(run.output);
  REQUIRE(json["devices"].size() == 3);
  std::size_t next_row = 0;
  for (const auto& device : json["devices"]) {
    CHECK(device["first_row"] == next_row);
    next_row += device["rows"].get<std::size_t>();
    CHECK(device["rows"].get<std::size_t>() > 0);
    CHECK(device["seconds"].get<double>() > 0);
    CHECK(device["chunks"].get<std::size_t>() > 0);
    CHECK(device["pool"]["peak_reserved_bytes"].get<std::size_t>() > 0);
    CHECK(device["pool"]["allocations"].get<std::size_t>() > 0);
  }
  CHECK(next_row == 1003);
  CHECK(json["base_rows"] == 1003);
  CHECK_THAT(json["devices"][1]["device"].get<std::string>(), Contains("4.00 MiB"));

  // all: every GPU, or without one the one default device (GPUPOOL_DEVICE, else a simulated one).
  Outcome all = gpupool_cli(job.args(job.dir.file("all"), "--devices all --json"), false);
  REQUIRE(all.status == 0);
  CHECK(nlohmann::json::parse(all.output)["devices"].size() ==
        static_cast<std::size_t>(std::max(1, Device::cuda_device_count())));
  check_same_files(job.dir.file("all"), job.dir.file("run"), "ivecs");

  Outcome text = gpupool_cli(job.args(job.dir.file("run"), "--devices sim,sim"), false);
  REQUIRE(text.status == 0);
  CHECK_THAT(text.output, Contains("device 0 sim") && Contains("base rows 0..500 (501 rows)") &&
                              Contains("device 1 sim") && Contains("base rows 501..1002 (502 rows)") &&
                              Contains("peak reserved"));
}

TEST_CASE("gpupool knn --devices: Fashion-MNIST on three devices equals one device", "[cli][devices]") {
  if (!fashion_mnist_installed()) {
    WARN("Fashion-MNIST is not installed at " << kFashionMnist << " (dataset-fashion-mnist)");
    return;
  }
  TempDir dir{"devices"};
  const std::string base = std::string(kFashionMnist) + "/train-images-idx3-ubyte.gz";
  const std::string query = dir.file("query.bvecs");
  write_fashion_rows(std::string(kFashionMnist) + "/t10k-images-idx3-ubyte.gz", 100, query);
  const std::string args = "knn --base " + base + " --query " + query +
                           " --quiet --out-format npy --distance-type int64 --out ";
  REQUIRE(gpupool_cli(args + dir.file("one --device sim")).status == 0);
  // The gzip base: each device inflates the rows before its share.
  REQUIRE(gpupool_cli(args + dir.file("three --devices sim,sim:256MiB,sim")).status == 0);
  check_same_files(dir.file("three"), dir.file("one"), "npy");
}

TEST_CASE("gpupool knn --devices: bad lists are refused naming the item, and a failing device writes nothing",
          "[cli][devices]") {
  SyntheticJob job;
  const std::string out = job.dir.file("out");
  struct Case {
    std::string options, message;
  };
  for (const Case& c : {Case{"--devices sim,,sim", "--devices 'sim,,sim': item 2 is empty"},
                        Case{"--devices sim,gpu:1", "--devices item 2 'gpu:1'"},
                        Case{"--devices sim, --quiet", "item 2 is empty"},
                        Case{"--device sim --devices sim,sim", "give one of them"}}) {
    CAPTURE(c.options);
    Outcome run = gpupool_cli(job.args(out, c.options));
    CHECK(run.status == 1);
    CHECK_THAT(run.output, Contains(c.message));
    CHECK_FALSE(fs::exists(out + ".neighbors.ivecs"));
  }
  // An earlier pair of files stays as it was when a device fails mid-job.
  REQUIRE(gpupool_cli(job.args(out, "--device sim")).status == 0);
  const auto ids = test::read_bytes(out + ".neighbors.ivecs");
  Outcome failed = gpupool_cli(job.args(out, "--metric ip --devices sim,sim:512B,sim"));
  CHECK(failed.status == 1);
  CHECK_THAT(failed.output, Contains("device 1") && Contains("512 B") && Contains("out of"));
  CHECK(test::read_bytes(out + ".neighbors.ivecs") == ids);
  for (const auto& entry : fs::directory_iterator(fs::path(out).parent_path()))
    CHECK_THAT(entry.path().filename().string(), !Contains(".tmp-"));
}

#ifdef GPUPOOL_MPIEXEC
namespace {

// `mpirun -np N gpupool knn ARGS` on this host (CTest sets the run-as-root variables).
Outcome mpirun(std::size_t processes, const std::string& args) {
  return shell(std::string(GPUPOOL_MPIEXEC) + " -np " + std::to_string(processes) +
               " --oversubscribe " + GPUPOOL_CLI_PATH + " " + args);
}

}  // namespace

TEST_CASE("mpirun -np 1..4 gpupool knn writes the one-process files", "[cli][mpi]") {
  SyntheticJob job;
  const std::string one = job.dir.file("one"), npy_one = job.dir.file("npy-one");
  REQUIRE(gpupool_cli(job.args(one, "--device sim")).status == 0);
  REQUIRE(gpupool_cli(job.args(npy_one, "--out-format npy --distance-type fp64 --device sim")).status == 0);
  for (std::size_t processes : {1, 2, 3, 4}) {
    CAPTURE(processes);
    const std::string out = job.dir / ("mpi" + std::to_string(processes));
    Outcome run = mpirun(processes, job.args(out, "--device sim"));
    INFO(run.output);
    REQUIRE(run.status == 0);
    check_same_files(out, one, "ivecs");
  }
  // Two devices in each of three processes, npy with fp64 distances.
  Outcome run = mpirun(3, job.args(job.dir.file("npy-mpi"), "--out-format npy --distance-type fp64 --devices sim,sim"));
  INFO(run.output);
  REQUIRE(run.status == 0);
  check_same_files(job.dir.file("npy-mpi"), npy_one, "npy");
  CHECK_THAT(run.output, Contains("processes: 3 (MPI)") && Contains("rank 2 device"));
}

TEST_CASE("mpirun gpupool knn --fast keeps the one-process blocks", "[cli][mpi]") {
  SyntheticJob job(true);
  const std::string extra = "--fast --precision fp16 --max-chunk-rows 100 --device sim";
  REQUIRE(gpupool_cli(job.args(job.dir.file("one"), extra)).status == 0);
  Outcome run = mpirun(4, job.args(job.dir.file("mpi"), extra));
  INFO(run.output);
  REQUIRE(run.status == 0);
  check_same_files(job.dir.file("mpi"), job.dir.file("one"), "ivecs");
}

TEST_CASE("mpirun gpupool knn on Fashion-MNIST equals one process, and a gzip base is refused", "[cli][mpi]") {
  if (!fashion_mnist_installed()) {
    WARN("Fashion-MNIST is not installed at " << kFashionMnist << " (dataset-fashion-mnist)");
    return;
  }
  TempDir dir{"devices"};
  const std::string gzip_base = std::string(kFashionMnist) + "/train-images-idx3-ubyte.gz";
  const std::string base = dir.file("train.bvecs"), query = dir.file("query.bvecs");
  write_fashion_rows(gzip_base, 60000, base);
  write_fashion_rows(std::string(kFashionMnist) + "/t10k-images-idx3-ubyte.gz", 50, query);
  const std::string args = " --query " + query + " --quiet --device sim --out ";
  REQUIRE(gpupool_cli("knn --base " + gzip_base + args + dir.file("one")).status == 0);
  Outcome run = mpirun(3, "knn --base " + base + args + dir.file("mpi"));
  INFO(run.output);
  REQUIRE(run.status == 0);
  check_same_files(dir.file("mpi"), dir.file("one"), "ivecs");

  Outcome refused = mpirun(2, "knn --base " + gzip_base + args + dir.file("gz"));
  CHECK(refused.status != 0);
  CHECK_THAT(refused.output, Contains("gzip-compressed") && Contains("decompress it first"));
  CHECK_FALSE(fs::exists(dir.file("gz.neighbors.ivecs")));
}

TEST_CASE("mpirun gpupool knn: a failing rank ends every rank, promptly, with its error", "[cli][mpi]") {
  SyntheticJob job;
  const std::string out = job.dir.file("out");
  // Rank 2 gets a device too small for one query and one row; ranks 0 and 1 have work to do.
  const std::string args = job.args(out, "--max-chunk-rows 8");
  const auto start = std::chrono::steady_clock::now();
  Outcome run = shell(std::string(GPUPOOL_MPIEXEC) + " --oversubscribe -np 2 " + GPUPOOL_CLI_PATH +
                      " " + args + " --device sim : -np 1 " + GPUPOOL_CLI_PATH + " " + args +
                      " --device sim:512B");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO(run.output);
  CHECK(run.status != 0);
  CHECK(seconds < 60);
  CHECK_THAT(run.output, Contains("rank 2 of 3") && Contains("512 B"));
  CHECK_FALSE(fs::exists(out + ".neighbors.ivecs"));
  CHECK_FALSE(fs::exists(out + ".distances.fvecs"));
}
#endif  // GPUPOOL_MPIEXEC

#endif  // GPUPOOL_CLI_PATH
