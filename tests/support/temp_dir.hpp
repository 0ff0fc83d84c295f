// A fresh folder under the system's temporary one for a test's files, removed with everything in
// it when the test's scope ends (also when a REQUIRE fails).
#pragma once
#include <atomic>
#include <cstddef>
#include <filesystem>
#include <iterator>
#include <string>
#include <string_view>
#include <system_error>
#include <unistd.h>

namespace gpupool::testing {

class TempDir {
 public:
  // `purpose` names the folder (gpupool-PURPOSE-test-PID-N), so a leftover says where it came from.
  explicit TempDir(std::string_view purpose) {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("gpupool-" + std::string(purpose) + "-test-" + std::to_string(::getpid()) + "-" +
             std::to_string(counter++));
    std::filesystem::create_directories(path_);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }
  // The same as a string, for command lines.
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }
  std::size_t file_count() const {
    return static_cast<std::size_t>(std::distance(std::filesystem::directory_iterator(path_),
                                                  std::filesystem::directory_iterator()));
  }

 private:
  std::filesystem::path path_;
};

}  // namespace gpupool::testing
