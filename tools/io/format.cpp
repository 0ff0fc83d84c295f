// Format names, detection by file name, and the input file shared by the readers.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <fmt/format.h>
#include <new>
#include <optional>
#include <string>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>
#include "detail.hpp"

namespace gpupool::io {

std::string_view to_string(VectorFormat format) noexcept {
  switch (format) {
    case VectorFormat::Fvecs: return "fvecs";
    case VectorFormat::Bvecs: return "bvecs";
    case VectorFormat::Ivecs: return "ivecs";
    case VectorFormat::Idx: return "IDX";
    case VectorFormat::Npy: return "npy";
  }
  return "?";
}

std::string_view to_string(ElementType type) noexcept {
  switch (type) {
    case ElementType::Float32: return "float32";
    case ElementType::Float16: return "float16";
    case ElementType::UInt8: return "uint8";
    case ElementType::Int8: return "int8";
    case ElementType::Int32: return "int32";
  }
  return "?";
}

namespace {

bool ends_with(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

// "train-images-idx3-ubyte", "t10k.idx1-ubyte", "data.idx".
bool is_idx_name(std::string_view name) {
  if (ends_with(name, ".idx")) return true;
  if (!ends_with(name, "-ubyte")) return false;
  name.remove_suffix(6);
  std::size_t digits = 0;
  while (digits < name.size() && std::isdigit(static_cast<unsigned char>(name[name.size() - 1 - digits])))
    ++digits;
  if (digits == 0) return false;
  name.remove_suffix(digits);
  return ends_with(name, "idx");
}

std::optional<VectorFormat> format_of_name(std::string_view name) {
  if (ends_with(name, ".fvecs")) return VectorFormat::Fvecs;
  if (ends_with(name, ".bvecs")) return VectorFormat::Bvecs;
  if (ends_with(name, ".ivecs")) return VectorFormat::Ivecs;
  if (ends_with(name, ".npy")) return VectorFormat::Npy;
  if (is_idx_name(name)) return VectorFormat::Idx;
  return std::nullopt;
}

}  // namespace

Result<VectorFormat> detect_format(const std::filesystem::path& path) {
  try {
    std::string name = path.filename().string();
    std::ranges::transform(name, name.begin(),
                           [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    bool gzipped = ends_with(name, ".gz");
    std::string_view base = name;
    if (gzipped) base.remove_suffix(3);
    std::optional<VectorFormat> format = format_of_name(base);
    if (format && (*format == VectorFormat::Idx || !gzipped)) return *format;
    if (format)
      return make_error(ErrorKind::Unsupported,
                        fmt::format("{}: gzip-compressed {} files are not supported (only IDX "
                                    "files may be compressed); decompress it first, e.g. gunzip -k",
                                    detail::quoted(path), to_string(*format)));
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: cannot tell the vector format from the file name; expected "
                                  "one ending in .fvecs, .bvecs, .ivecs, .npy, .idx or -idx<N>-ubyte "
                                  "(the IDX ones optionally with .gz)",
                                  detail::quoted(path)));
  } catch (const std::bad_alloc&) {
    return make_error(ErrorKind::OutOfMemory, "out of host memory while detecting a file format");
  }
}

}  // namespace gpupool::io

namespace gpupool::io::detail {

std::size_t element_size(ElementType type) noexcept {
  switch (type) {
    case ElementType::Float32:
    case ElementType::Int32: return 4;
    case ElementType::Float16: return 2;
    case ElementType::UInt8:
    case ElementType::Int8: return 1;
  }
  return 1;
}

std::string quoted(const std::filesystem::path& path) { return "'" + path.string() + "'"; }

Result<InputFile> InputFile::open(const std::filesystem::path& path) {
  // O_NONBLOCK: a FIFO without a writer would block open() itself; it is refused below instead.
  int fd;
  do fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    int err = errno;
    return make_error(ErrorKind::Io,
                      fmt::format("{}: cannot open for reading: {}", quoted(path), std::strerror(err)));
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    int err = errno;
    ::close(fd);
    return make_error(ErrorKind::Io, fmt::format("{}: cannot query the file: {}", quoted(path),
                                                 std::strerror(err)));
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: not a regular file (a directory, pipe or device); vector "
                                  "files are read from regular files only",
                                  quoted(path)));
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  return InputFile(path, fd, static_cast<std::uint64_t>(info.st_size));
}

InputFile::InputFile(InputFile&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)), size_(other.size_) {}

InputFile& InputFile::operator=(InputFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    size_ = other.size_;
  }
  return *this;
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

Result<std::size_t> InputFile::read(void* dst, std::size_t n) {
  auto* out = static_cast<std::byte*>(dst);
  std::size_t done = 0;
  while (done < n) {
    std::size_t want = std::min<std::size_t>(n - done, std::size_t{1} << 30);
    ssize_t got = ::read(fd_, out + done, want);
    if (got < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      return make_error(ErrorKind::Io,
                        fmt::format("{}: read failed: {}", quoted(path_), std::strerror(err)));
    }
    if (got == 0) break;
    done += static_cast<std::size_t>(got);
  }
  return done;
}

Result<void> RowSource::seek_row(std::size_t row) {
  return make_error(ErrorKind::Unsupported,
                    fmt::format("cannot seek to row {}: the rows of this file are read in order "
                                "only (gzip data)", row));
}

Result<void> InputFile::seek(std::uint64_t offset) {
  if (::lseek(fd_, static_cast<off_t>(offset), SEEK_SET) < 0) {
    int err = errno;
    return make_error(ErrorKind::Io, fmt::format("{}: cannot seek to byte {}: {}", quoted(path_),
                                                 offset, std::strerror(err)));
  }
  return {};
}

}  // namespace gpupool::io::detail
