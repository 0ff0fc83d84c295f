// io::FileGroup: files written together replace their targets together or not at all, and a
// writer's temporary file does not outlive SIGTERM.
#include <catch2/catch.hpp>
#include <atomic>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <sys/wait.h>
#include <system_error>
#include <unistd.h>
#include <vector>
#include "support/vector_files.hpp"
#include "vector_io.hpp"

using namespace gpupool;
namespace fs = std::filesystem;

namespace {

class ScratchDir {
 public:
  ScratchDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() /
            ("gpupool-group-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    fs::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  fs::path operator/(const std::string& name) const { return path_ / name; }
  // Files whose names say they are a writer's temporaries.
  std::size_t temporaries() const {
    std::size_t n = 0;
    for (const auto& entry : fs::directory_iterator(path_))
      n += entry.path().filename().string().find(".tmp-") != std::string::npos;
    return n;
  }

 private:
  fs::path path_;
};

std::vector<float> fresh_floats(std::size_t n) {
  static std::mt19937 rng{std::random_device{}()};
  std::uniform_real_distribution<float> value(-10.0f, 10.0f);
  std::vector<float> out(n);
  for (float& v : out) v = value(rng);
  return out;
}

}  // namespace

TEST_CASE("files written as a group replace their targets together or not at all", "[io]") {
  ScratchDir dir;
  const fs::path a = dir / "run.distances.fvecs", b = dir / "run.neighbors.ivecs";
  const std::vector<float> old_values = fresh_floats(6), new_values = fresh_floats(6);
  const std::vector<std::int32_t> old_ids{1, 2, 3, 4, 5, 6}, new_ids{6, 5, 4, 3, 2, 1};
  REQUIRE(io::write_fvecs(a, 2, 3, std::span<const float>(old_values)));
  REQUIRE(io::write_ivecs(b, 2, 3, std::span<const std::int32_t>(old_ids)));
  const test::Bytes old_a = test::read_bytes(a), old_b = test::read_bytes(b);

  SECTION("dropped before commit: the old pair stays, no temporaries") {
    {
      io::FileGroup group;
      REQUIRE(io::write_fvecs(a, 2, 3, std::span<const float>(new_values), &group));
      REQUIRE(io::write_ivecs(b, 2, 3, std::span<const std::int32_t>(new_ids), &group));
      CHECK(test::read_bytes(a) == old_a);
      CHECK(test::read_bytes(b) == old_b);
      CHECK(dir.temporaries() == 2);
    }
    CHECK(test::read_bytes(a) == old_a);
    CHECK(test::read_bytes(b) == old_b);
    CHECK(dir.temporaries() == 0);
  }
  SECTION("the second write fails: the old pair stays, no temporaries") {
    {
      io::FileGroup group;
      REQUIRE(io::write_fvecs(a, 2, 3, std::span<const float>(new_values), &group));
      CHECK_FALSE(io::write_ivecs(b, 2, 4, std::span<const std::int32_t>(new_ids), &group));
    }
    CHECK(test::read_bytes(a) == old_a);
    CHECK(test::read_bytes(b) == old_b);
    CHECK(dir.temporaries() == 0);
  }
  SECTION("committed: the new pair, no temporaries") {
    io::FileGroup group;
    REQUIRE(io::write_fvecs(a, 2, 3, std::span<const float>(new_values), &group));
    REQUIRE(io::write_ivecs(b, 2, 3, std::span<const std::int32_t>(new_ids), &group));
    REQUIRE(group.commit());
    auto values = io::VectorReader::open(a);
    REQUIRE(values);
    std::vector<float> back(6);
    REQUIRE(values->read(back, 2));
    CHECK(back == new_values);
    CHECK(test::read_bytes(b) != old_b);
    CHECK(dir.temporaries() == 0);
    REQUIRE(group.commit());  // nothing left to rename
  }
  SECTION("a rename that fails: reported, no mixed pair, no temporaries") {
    {
      io::FileGroup group;
      REQUIRE(io::write_fvecs(a, 2, 3, std::span<const float>(new_values), &group));
      REQUIRE(io::write_ivecs(b, 2, 3, std::span<const std::int32_t>(new_ids), &group));
      fs::remove(b);
      fs::create_directories(b / "in-the-way");  // a non-empty folder where the file goes
      auto renamed = group.commit();
      REQUIRE_FALSE(renamed);
      CHECK(renamed.error().kind() == ErrorKind::Io);
      CHECK_THAT(renamed.error().message(), Catch::Contains("run.neighbors.ivecs"));
    }
    CHECK_FALSE(fs::exists(a));  // its new version was in place: taken away again
    CHECK(dir.temporaries() == 0);
  }
}

TEST_CASE("a writer's temporary file is removed on SIGTERM, which still ends the process", "[io]") {
  ScratchDir dir;
  const fs::path target = dir / "out.fvecs";
  const std::vector<float> values = fresh_floats(4000);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // the child: a pair half written, then the signal
    std::signal(SIGTERM, SIG_DFL);
    io::FileGroup group;
    if (!io::write_fvecs(target, 1000, 4, std::span<const float>(values), &group)) ::_exit(3);
    if (dir.temporaries() != 1) ::_exit(4);
    ::raise(SIGTERM);
    ::_exit(5);  // not reached: SIGTERM ends the child
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CAPTURE(status);
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGTERM);
  CHECK(dir.temporaries() == 0);
  CHECK_FALSE(fs::exists(target));
}
