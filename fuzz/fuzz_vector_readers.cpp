// Fuzzes VectorReader: the input is written to a file under each format's extension (.fvecs,
// .bvecs, .ivecs, .idx, .npy) and read to the end, as float32 and, for integer files, as int32.
// Invariants: no crash or sanitizer report; an opened file reads exactly rows() rows of dim()
// values, never writing past them; errors are GpuErrors that name the file, and spend the reader.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <system_error>
#include <type_traits>
#include <unistd.h>
#include <vector>
#include "op_counter.hpp"
#include "vector_io.hpp"

namespace {

namespace fs = std::filesystem;
using namespace gpupool;
using namespace gpupool::io;

[[noreturn]] void violated(const char* what, const fs::path& path) {
  std::fprintf(stderr, "fuzz_vector_readers: invariant violated for %s: %s\n", path.c_str(), what);
  std::abort();
}

// A directory of this process, removed at exit. Heap-held so that it outlives static destructors.
const fs::path& work_dir() {
  static const fs::path* dir = [] {
    auto* path = new fs::path(fs::temp_directory_path() /
                              ("gpupool-fuzz-vector-readers-" + std::to_string(::getpid())));
    fs::create_directories(*path);
    std::atexit([] {
      std::error_code ignored;
      fs::remove_all(work_dir(), ignored);
    });
    return path;
  }();
  return *dir;
}

void check_error(const GpuError& error, const fs::path& path) {
  if (error.message().empty()) violated("an error without a message", path);
  if (error.kind() != ErrorKind::Io && error.kind() != ErrorKind::OutOfMemory &&
      error.message().find(path.string()) == std::string::npos)
    violated("an error that does not name the file", path);
}

// Reads the file to the end through read (T = float) or read_ints (T = int32). Returns the values
// when every read succeeded.
template <class T>
std::vector<T> read_through(const fs::path& path, std::size_t chunk_seed, bool& ok) {
  ok = false;
  auto reader = VectorReader::open(path);
  if (!reader) {
    check_error(reader.error(), path);
    return {};
  }
  const std::size_t rows = reader->rows(), dim = reader->dim();
  if (rows > 0 && dim == 0) violated("rows without a dimension", path);
  std::vector<T> all;
  if (rows == 0) {
    std::vector<T> none;
    auto got = [&] {
      if constexpr (std::is_same_v<T, float>) return reader->read(none, 1);
      else return reader->read_ints(none, 1);
    }();
    if (got && *got != 0) violated("rows read from an empty file", path);
    ok = got.has_value();
    return all;
  }
  // Chunks of varying size, never more than ~64 KiB of values (a row alone may be bigger).
  std::size_t chunk = std::max<std::size_t>(1, std::min<std::size_t>(1 + chunk_seed % 17, 16384 / dim));
  constexpr std::size_t kGuard = 8;
  std::vector<T> buffer(chunk * dim + kGuard);
  const T sentinel = static_cast<T>(-12345);
  std::size_t total = 0;
  while (true) {
    std::fill(buffer.begin(), buffer.end(), sentinel);
    std::span<T> out(buffer.data(), chunk * dim);
    auto got = [&] {
      if constexpr (std::is_same_v<T, float>) return reader->read(out, chunk);
      else return reader->read_ints(out, chunk);
    }();
    if (!got) {
      check_error(got.error(), path);
      auto again = [&] {
        if constexpr (std::is_same_v<T, float>) return reader->read(out, chunk);
        else return reader->read_ints(out, chunk);
      }();
      if (again || again.error().kind() != ErrorKind::InvalidState)
        violated("a reader that goes on after an error", path);
      return {};
    }
    if (*got > chunk) violated("more rows than asked for", path);
    for (std::size_t i = *got * dim; i < buffer.size(); ++i)
      if (std::memcmp(&buffer[i], &sentinel, sizeof(T)) != 0) violated("a write past the rows read", path);
    if (*got == 0) break;
    total += *got;
    if (total > rows) violated("more rows than rows()", path);
    if (reader->rows_read() != total) violated("rows_read() disagrees with the reads", path);
    all.insert(all.end(), buffer.begin(), buffer.begin() + static_cast<std::ptrdiff_t>(*got * dim));
  }
  if (total != rows) violated("the reads ended before rows()", path);
  if (all.size() != rows * dim) violated("rows * dim values were not read", path);
  ok = true;
  return all;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const char* const kExtensions[] = {".fvecs", ".bvecs", ".ivecs", ".idx", ".npy"};
  const fs::path& dir = work_dir();
  gpupool::fuzzing::OpCounter::of("fuzz_vector_readers", "files read as every format").add(1);
  fs::path current = dir / "input";
  {
    std::FILE* file = std::fopen(current.c_str(), "wb");
    if (!file) violated("cannot create the input file", current);
    if (size && std::fwrite(data, 1, size, file) != size) violated("cannot write the input file", current);
    std::fclose(file);
  }
  std::size_t chunk_seed = size ? data[size - 1] : 0;
  for (const char* extension : kExtensions) {
    fs::path path = dir / (std::string("input") + extension);
    std::error_code error;
    fs::rename(current, path, error);
    if (error) violated("cannot rename the input file", path);
    current = path;

    bool floats_ok = false, ints_ok = false;
    std::vector<float> floats = read_through<float>(path, chunk_seed, floats_ok);
    auto reader = VectorReader::open(path);
    bool integer = reader && (reader->element_type() != ElementType::Float32 &&
                              reader->element_type() != ElementType::Float16);
    if (!integer) continue;
    std::vector<std::int32_t> ints = read_through<std::int32_t>(path, chunk_seed + 5, ints_ok);
    if (floats_ok && (!ints_ok || ints.size() != floats.size()))
      violated("an integer file that reads as float32 but not as int32", path);
    if (floats_ok)
      for (std::size_t i = 0; i < ints.size(); ++i)
        if (static_cast<float>(ints[i]) != floats[i]) violated("float32 and int32 reads differ", path);
  }
  std::error_code ignored;
  fs::remove(current, ignored);
  return 0;
}
