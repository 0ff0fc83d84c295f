// Internals of gpupool::io shared by the format files; not part of the API.
#pragma once
#include <bit>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include "vector_io.hpp"

namespace gpupool::io::detail {

static_assert(std::endian::native == std::endian::little,
              "gpupool::io reads and writes little-endian files by copying bytes");

// Raw buffers of this size at most are read or converted at once (a bigger row goes alone).
inline constexpr std::size_t kBlockBytes = std::size_t{1} << 20;
// The largest dimension accepted from any file (a TEXMEX record stores it as an int32).
inline constexpr std::uint64_t kMaxDim = 0x7fffffff;

std::size_t element_size(ElementType type) noexcept;

// "'dir/name.fvecs'" for messages.
std::string quoted(const std::filesystem::path& path);

// out = a * b; false when that does not fit 64 bits.
inline bool checked_mul(std::uint64_t a, std::uint64_t b, std::uint64_t& out) noexcept {
  return !__builtin_mul_overflow(a, b, &out);
}

// A read-only regular file (POSIX descriptor), closed on destruction.
class InputFile {
 public:
  static Result<InputFile> open(const std::filesystem::path& path);
  InputFile(InputFile&& other) noexcept;
  InputFile& operator=(InputFile&& other) noexcept;
  ~InputFile();

  std::uint64_t size() const noexcept { return size_; }
  const std::filesystem::path& path() const noexcept { return path_; }
  // Reads up to n bytes; fewer only at the end of the file. Io error on a failing read.
  Result<std::size_t> read(void* dst, std::size_t n);
  Result<void> seek(std::uint64_t offset);

 private:
  InputFile(std::filesystem::path path, int fd, std::uint64_t size) noexcept
      : path_(std::move(path)), fd_(fd), size_(size) {}
  std::filesystem::path path_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

// A format's rows with headers stripped: dim values of one element type per row, packed.
class RowSource {
 public:
  virtual ~RowSource() = default;
  // Reads the next n rows (n * dim * element_size bytes) into dst. first_row is the index of the
  // first of them, for messages. May read the rest of the file to check it ends where it should.
  virtual Result<void> read_rows(std::size_t first_row, std::size_t n, std::byte* dst) = 0;
  // Whether seek_row works: where every row lies at a fixed byte offset (not in gzip data).
  virtual bool seekable() const noexcept { return false; }
  // Makes `row` the next row read_rows reads (seekable sources; the caller checks the range).
  virtual Result<void> seek_row(std::size_t row);
};

struct OpenedSource {
  std::unique_ptr<RowSource> source;
  ElementType type;
  std::size_t rows;
  std::size_t dim;
};

Result<OpenedSource> open_texmex(const std::filesystem::path& path, VectorFormat format);
Result<OpenedSource> open_idx(const std::filesystem::path& path);
Result<OpenedSource> open_npy(const std::filesystem::path& path);

// The complete .npy preamble (magic, version 1.0, header padded to 64 bytes) for a C-order array.
std::string npy_preamble(std::string_view descr, std::size_t rows, std::size_t dim);

}  // namespace gpupool::io::detail
