// Fuzzes VectorReader: the input is written to a file under each format's extension (.fvecs,
// .bvecs, .ivecs, .idx, .npy) and read to the end, as float32 and, for integer files, as int32.
// Invariants: no crash or sanitizer report; an opened file reads exactly rows() rows of dim()
// values, never writing past them; errors are GpuErrors that name the file, and spend the reader.
// A TEXMEX input that reads is also repeated into a file of several 256 KiB stretches and read in
// one call (the reader then reads records straight into the caller's rows and moves them over
// their headers): it must give the input's values as many times over.
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

// Counts the repeated files read and says how many at exit, so that CI's log shows that the check
// ran (OpCounter keeps the target's one figure: files read as every format).
void repeated_files_read() {
  static std::uint64_t count = [] {
    std::atexit([] {
      std::fprintf(stderr, "fuzz_vector_readers: %llu TEXMEX inputs also read repeated past a few "
                           "stretches\n", static_cast<unsigned long long>(count));
    });
    return std::uint64_t{0};
  }();
  ++count;
}

// A TEXMEX input whose values read as `values` (rows × dim), repeated until the file passes 600 KiB
// and read as float32 in one call and in calls of `chunk_seed`-chosen sizes.
void check_repeated_texmex(const std::uint8_t* data, std::size_t size, const fs::path& path,
                           const std::vector<float>& values, std::size_t chunk_seed) {
  constexpr std::size_t kFileBytes = 600 << 10;
  const std::size_t copies = (kFileBytes + size - 1) / size;
  const fs::path repeated = work_dir() / ("repeated" + path.extension().string());
  {
    std::FILE* file = std::fopen(repeated.c_str(), "wb");
    if (!file) violated("cannot create the repeated file", repeated);
    for (std::size_t c = 0; c < copies; ++c)
      if (std::fwrite(data, 1, size, file) != size) violated("cannot write the repeated file", repeated);
    std::fclose(file);
  }
  const std::size_t per_copy = values.size();
  for (const bool one_call : {true, false}) {
    auto reader = VectorReader::open(repeated);
    if (!reader) violated("a repeated readable file that does not open", repeated);
    const std::size_t rows = reader->rows(), dim = reader->dim();
    if (rows * dim != per_copy * copies) violated("a repeated file of another size", repeated);
    std::vector<float> all(rows * dim);
    const std::size_t chunk = one_call ? rows : 1 + (chunk_seed * 7919) % (rows + 1);
    for (std::size_t done = 0; done < rows;) {
      const std::size_t want = std::min(chunk, rows - done);
      auto got = reader->read(std::span<float>(all).subspan(done * dim, want * dim), want);
      if (!got || *got != want) violated("a repeated readable file that does not read", repeated);
      done += want;
    }
    for (std::size_t c = 0; c < copies; ++c)
      if (std::memcmp(all.data() + c * per_copy, values.data(), per_copy * sizeof(float)) != 0)
        violated("a repeated file that reads other values", repeated);
  }
  std::error_code ignored;
  fs::remove(repeated, ignored);
  repeated_files_read();
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
    const bool texmex = std::strcmp(extension, ".fvecs") == 0 || std::strcmp(extension, ".bvecs") == 0 ||
                        std::strcmp(extension, ".ivecs") == 0;
    if (texmex && floats_ok && !floats.empty()) {
      check_repeated_texmex(data, size, path, floats, chunk_seed);
    }
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
