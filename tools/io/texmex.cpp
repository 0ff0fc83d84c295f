// TEXMEX (SIFT/GIST) vector files: every record is a little-endian int32 dimension followed by
// that many values, float32 (.fvecs), uint8 (.bvecs) or int32 (.ivecs).
#include <algorithm>
#include <cstring>
#include <fmt/format.h>
#include <memory>
#include <vector>
#include "detail.hpp"

namespace gpupool::io::detail {

namespace {

ElementType element_of(VectorFormat format) {
  switch (format) {
    case VectorFormat::Bvecs: return ElementType::UInt8;
    case VectorFormat::Ivecs: return ElementType::Int32;
    default: return ElementType::Float32;
  }
}

class TexmexSource final : public RowSource {
 public:
  TexmexSource(InputFile file, VectorFormat format, std::size_t dim)
      : file_(std::move(file)), format_(format), dim_(dim),
        value_bytes_(dim * element_size(element_of(format))), record_bytes_(4 + value_bytes_) {}

  // Records are read straight into `dst` wherever what is left of it holds them (a record is 4
  // bytes longer than its row), a stretch at a time, and each stretch's values are moved down
  // over its headers while the stretch is still in the core's cache. Every byte then crosses
  // memory once on its way in, where a copy out of a buffer of our own would add a pass over the
  // rows (bench/base_reading_bench measures the difference). Only the last stretch or two of a
  // call, whose records would overhang `dst`, go through stretch_.
  Result<void> read_rows(std::size_t first_row, std::size_t n, std::byte* dst) override {
    const std::size_t per_stretch = std::max<std::size_t>(1, kStretchBytes / record_bytes_);
    for (std::size_t done = 0; done < n;) {
      const std::size_t count = std::min(per_stretch, n - done);
      const std::size_t want = count * record_bytes_;
      std::byte* const out = dst + done * value_bytes_;
      const bool in_place = (n - done) * value_bytes_ >= want;
      if (!in_place && stretch_.size() < want) stretch_.resize(want);
      std::byte* const records = in_place ? out : stretch_.data();
      auto got = file_.read(records, want);
      if (!got) return std::unexpected(got.error());
      if (*got < want) {
        // The size was checked when opening: the file shrank since.
        std::size_t record = first_row + done + *got / record_bytes_;
        return make_error(ErrorKind::InvalidInput,
                          fmt::format("{}: record {} (byte offset {}) is truncated: the file ended "
                                      "after {} of its {} bytes (was it cut short while being read?)",
                                      quoted(file_.path()), record,
                                      static_cast<std::uint64_t>(record) * record_bytes_,
                                      *got % record_bytes_, record_bytes_));
      }
      // Front to back: row i's values land at or below record i's, and the records after it
      // still lie above every row written so far.
      for (std::size_t i = 0; i < count; ++i) {
        const std::byte* record = records + i * record_bytes_;
        if (auto ok = check_dimension(record, first_row + done + i); !ok) return ok;
        std::memmove(out + i * value_bytes_, record + 4, value_bytes_);
      }
      done += count;
    }
    return {};
  }
  bool seekable() const noexcept override { return true; }
  Result<void> seek_row(std::size_t row) override {
    return file_.seek(static_cast<std::uint64_t>(row) * record_bytes_);
  }

 private:
  // A stretch fits a core's L2 cache beside what else the reading thread touches.
  static constexpr std::size_t kStretchBytes = std::size_t{256} << 10;

  Result<void> check_dimension(const std::byte* record, std::size_t index) const {
    std::int32_t record_dim;
    std::memcpy(&record_dim, record, 4);
    if (record_dim >= 0 && static_cast<std::size_t>(record_dim) == dim_) [[likely]] return {};
    return make_error(
        ErrorKind::InvalidInput,
        fmt::format("{}: record {} (byte offset {}) has dimension {}, but record 0 has {}; "
                    "every record of a .{} file must have the same dimension (is the file "
                    "corrupt, or not a .{} file?)",
                    quoted(file_.path()), index, static_cast<std::uint64_t>(index) * record_bytes_,
                    record_dim, dim_, to_string(format_), to_string(format_)));
  }

  InputFile file_;
  VectorFormat format_;
  std::size_t dim_;
  std::size_t value_bytes_;
  std::size_t record_bytes_;
  std::vector<std::byte> stretch_;  // the records of a stretch that would overhang the caller's rows
};

}  // namespace

Result<OpenedSource> open_texmex(const std::filesystem::path& path, VectorFormat format) {
  auto file = InputFile::open(path);
  if (!file) return std::unexpected(file.error());
  ElementType type = element_of(format);
  std::uint64_t size = file->size();
  if (size == 0) return OpenedSource{std::make_unique<TexmexSource>(std::move(*file), format, 0),
                        type, 0, 0};
  std::int32_t first_dim = 0;
  auto got = file->read(&first_dim, 4);
  if (!got) return std::unexpected(got.error());
  if (*got < 4)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: the file has only {} bytes, too few for the 4-byte dimension "
                                  "that starts record 0 of a .{} file",
                                  quoted(path), size, to_string(format)));
  if (first_dim <= 0)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: record 0 announces dimension {}; expected a positive int32 "
                                  "(is this really a .{} file?)",
                                  quoted(path), first_dim, to_string(format)));
  std::uint64_t esize = element_size(type);
  std::uint64_t record_bytes = 4 + static_cast<std::uint64_t>(first_dim) * esize;
  if (record_bytes > size)
    return make_error(
        ErrorKind::InvalidInput,
        fmt::format("{}: record 0 announces dimension {}, a record of {}, but the whole file has "
                    "only {}: the file is truncated, or the dimension is wrong (is this really a "
                    ".{} file?)",
                    quoted(path), first_dim, format_bytes(record_bytes), format_bytes(size),
                    to_string(format)));
  if (size % record_bytes != 0) {
    std::uint64_t whole = size / record_bytes;
    return make_error(
        ErrorKind::InvalidInput,
        fmt::format("{}: the file size {} bytes is not a whole number of {}-byte records (4-byte "
                    "dimension + {} values of {} bytes, the dimension of record 0): after {} whole "
                    "records, record {} (byte offset {}) has only {} bytes; the file is truncated "
                    "or not a .{} file",
                    quoted(path), size, record_bytes, first_dim, esize, whole, whole,
                    whole * record_bytes, size % record_bytes, to_string(format)));
  }
  if (auto seek = file->seek(0); !seek) return std::unexpected(seek.error());
  auto rows = static_cast<std::size_t>(size / record_bytes);
  auto dim = static_cast<std::size_t>(first_dim);
  return OpenedSource{std::make_unique<TexmexSource>(std::move(*file), format, dim), type,
                      rows, dim};
}

}  // namespace gpupool::io::detail
