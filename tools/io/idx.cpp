// IDX files (the MNIST format), plain or gzip-compressed: bytes 0x00 0x00, a type byte, the number
// of dimensions n, n big-endian uint32 sizes, then the values. Only unsigned bytes (type 0x08) are
// supported; an N x d1 x ... x dk file is N vectors of d1*...*dk values (a 1-D file: N of 1).
#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <fmt/format.h>
#include <functional>
#include <memory>
#include <string>
#include <vector>
#include "detail.hpp"
#include "gzip_reader.hpp"
#include "read_ahead.hpp"

namespace gpupool::io::detail {

namespace {

// How far ahead of its reader a gzip file is inflated: Fashion-MNIST's 47 MB whole.
constexpr std::size_t kGzipAheadBytes = std::size_t{64} << 20;
// zlib's documented limit for deflate: no stream expands more than 1032 times.
constexpr std::uint64_t kMaxDeflateRatio = 1032;

using ReadExact = std::function<Result<std::size_t>(void*, std::size_t)>;

struct IdxHeader {
  std::size_t header_bytes = 0;
  std::vector<std::uint32_t> dims;
  std::size_t rows = 0;
  std::size_t dim = 0;
  std::uint64_t payload = 0;
};

std::string dims_text(const std::vector<std::uint32_t>& dims) {
  std::string text;
  for (std::size_t i = 0; i < dims.size(); ++i) text += (i ? " x " : "") + std::to_string(dims[i]);
  return text;
}

std::string_view idx_type_name(std::uint8_t type) {
  switch (type) {
    case 0x08: return "unsigned byte";
    case 0x09: return "signed byte";
    case 0x0B: return "int16";
    case 0x0C: return "int32";
    case 0x0D: return "float32";
    case 0x0E: return "float64";
    default: return {};
  }
}

// Reads and checks the header through read (which returns fewer bytes only at the end of data).
Result<IdxHeader> read_header(const std::filesystem::path& path, std::string_view what,
                              const ReadExact& read) {
  std::array<std::uint8_t, 4> magic{};
  auto got = read(magic.data(), 4);
  if (!got) return std::unexpected(got.error());
  if (*got < 4)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: {} has only {} bytes, too few for the 4-byte IDX header",
                                  quoted(path), what, *got));
  if (magic[0] != 0 || magic[1] != 0)
    return make_error(
        ErrorKind::InvalidInput,
        fmt::format("{}: bad IDX magic: {} starts with bytes 0x{:02x} 0x{:02x}, expected 0x00 0x00 "
                    "(an IDX file starts with two zero bytes, a type byte and the number of "
                    "dimensions)",
                    quoted(path), what, magic[0], magic[1]));
  std::uint8_t type = magic[2];
  std::string_view type_name = idx_type_name(type);
  if (type_name.empty())
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: bad IDX header: type byte 0x{:02x} (byte 2) is not an IDX "
                                  "type; expected 0x08 (unsigned byte)",
                                  quoted(path), type));
  if (type != 0x08)
    return make_error(ErrorKind::Unsupported,
                      fmt::format("{}: IDX element type 0x{:02x} ({}) is not supported; only 0x08 "
                                  "(unsigned byte) files can be read",
                                  quoted(path), type, type_name));
  std::size_t ndims = magic[3];
  if (ndims == 0)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: bad IDX header: the number of dimensions (byte 3) is 0; "
                                  "expected at least 1 (the item count)",
                                  quoted(path)));
  std::vector<std::uint8_t> raw(4 * ndims);
  got = read(raw.data(), raw.size());
  if (!got) return std::unexpected(got.error());
  if (*got < raw.size())
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: truncated IDX header: {} dimensions need {} bytes of sizes "
                                  "after the first 4, but {} ends after {}",
                                  quoted(path), ndims, raw.size(), what, *got));
  IdxHeader header;
  header.header_bytes = 4 + raw.size();
  for (std::size_t i = 0; i < ndims; ++i) {
    const std::uint8_t* b = raw.data() + 4 * i;
    header.dims.push_back(std::uint32_t{b[0]} << 24 | std::uint32_t{b[1]} << 16 |
                          std::uint32_t{b[2]} << 8 | std::uint32_t{b[3]});
  }
  std::uint64_t dim = 1;
  for (std::size_t i = 1; i < ndims; ++i)
    if (!checked_mul(dim, header.dims[i], dim) || dim > kMaxDim) {
      dim = kMaxDim + 1;
      break;
    }
  if (dim == 0 || dim > kMaxDim)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: IDX dimensions {} make vectors of {} values; expected 1 to "
                                  "{} values per item",
                                  quoted(path), dims_text(header.dims),
                                  dim == 0 ? std::string("0") : std::string("too many"), kMaxDim));
  header.rows = header.dims[0];
  header.dim = static_cast<std::size_t>(dim);
  header.payload = static_cast<std::uint64_t>(header.rows) * dim;  // < 2^32 * 2^31: fits
  return header;
}

class IdxPlainSource final : public RowSource {
 public:
  IdxPlainSource(InputFile file, std::size_t dim, std::uint64_t header_bytes)
      : file_(std::move(file)), dim_(dim), header_bytes_(header_bytes) {}
  Result<void> read_rows(std::size_t first_row, std::size_t n, std::byte* dst) override {
    auto got = file_.read(dst, n * dim_);
    if (!got) return std::unexpected(got.error());
    if (*got < n * dim_)
      return make_error(ErrorKind::InvalidInput,
                        fmt::format("{}: IDX item {} is truncated: the file ended after {} of its "
                                    "{} bytes (was it cut short while being read?)",
                                    quoted(file_.path()), first_row + *got / dim_, *got % dim_, dim_));
    return {};
  }
  bool seekable() const noexcept override { return true; }
  Result<void> seek_row(std::size_t row) override {
    return file_.seek(header_bytes_ + static_cast<std::uint64_t>(row) * dim_);
  }

 private:
  InputFile file_;
  std::size_t dim_;
  std::uint64_t header_bytes_;
};

// After the announced payload: the data must end here (this also checks the gzip CRC).
Result<void> gz_expect_end(GzipReader& gz, const IdxHeader& header) {
  std::array<std::byte, 4096> extra;
  std::string where = fmt::format("while checking that the data ends after the {} items",
                                  header.rows);
  auto got = gz.read(extra.data(), extra.size(), where);
  if (!got) return std::unexpected(got.error());
  if (*got > 0)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: the decompressed IDX data is longer than its header "
                                  "announces: {} more bytes (at least) follow the {} items of "
                                  "{} bytes ({}); the header or the data is wrong",
                                  quoted(gz.path()), *got, header.rows, header.dim,
                                  dims_text(header.dims)));
  return {};
}

class IdxGzipSource final : public RowSource {
 public:
  IdxGzipSource(GzipReader gz, IdxHeader header) : gz_(std::move(gz)), header_(std::move(header)) {}

  Result<void> read_rows(std::size_t first_row, std::size_t n, std::byte* dst) override {
    std::size_t dim = header_.dim;
    std::string where = fmt::format("while reading IDX items {} to {}", first_row, first_row + n - 1);
    auto got = gz_.read(dst, n * dim, where);
    if (!got) return std::unexpected(got.error());
    if (*got < n * dim) {
      std::size_t item = first_row + *got / dim;
      return make_error(
          ErrorKind::InvalidInput,
          fmt::format("{}: the decompressed IDX data is shorter than its header announces: it ends "
                      "in item {} (after {} of its {} bytes), but the header ({}) announces {} "
                      "items; the file is truncated or the header is wrong",
                      quoted(gz_.path()), item, *got % dim, dim, dims_text(header_.dims), header_.rows));
    }
    if (first_row + n == header_.rows) return gz_expect_end(gz_, header_);
    return {};
  }

 private:
  GzipReader gz_;
  IdxHeader header_;
};

}  // namespace

Result<OpenedSource> open_idx(const std::filesystem::path& path) {
  auto file = InputFile::open(path);
  if (!file) return std::unexpected(file.error());
  std::uint64_t size = file->size();
  std::array<std::uint8_t, 2> start{};
  auto got = file->read(start.data(), 2);
  if (!got) return std::unexpected(got.error());
  bool gzipped = *got == 2 && start[0] == 0x1f && start[1] == 0x8b;

  if (!gzipped) {
    if (auto seek = file->seek(0); !seek) return std::unexpected(seek.error());
    auto header = read_header(path, "the file", [&](void* dst, std::size_t n) {
      return file->read(dst, n);
    });
    if (!header) return std::unexpected(header.error());
    std::uint64_t body = size - header->header_bytes;
    if (body < header->payload) {
      std::uint64_t item = body / header->dim;
      return make_error(
          ErrorKind::InvalidInput,
          fmt::format("{}: the IDX payload is too short: the header ({}) announces {} items of {} "
                      "bytes = {} bytes after the {}-byte header, but the file has {}: item {} "
                      "(byte offset {}) is incomplete; the file is truncated",
                      quoted(path), dims_text(header->dims), header->rows, header->dim,
                      header->payload, header->header_bytes, body, item,
                      header->header_bytes + item * header->dim));
    }
    if (body > header->payload)
      return make_error(
          ErrorKind::InvalidInput,
          fmt::format("{}: the IDX payload is too long: the header ({}) announces {} items of {} "
                      "bytes = {} bytes, but {} bytes follow the {}-byte header ({} extra); the "
                      "header or the file is wrong",
                      quoted(path), dims_text(header->dims), header->rows, header->dim,
                      header->payload, body, header->header_bytes, body - header->payload));
    std::size_t rows = header->rows, dim = header->dim;
    return OpenedSource{std::make_unique<IdxPlainSource>(std::move(*file), dim, header->header_bytes),
                        ElementType::UInt8, rows, dim};
  }

  if (auto seek = file->seek(0); !seek) return std::unexpected(seek.error());
  auto gz = GzipReader::open(std::move(*file));
  if (!gz) return std::unexpected(gz.error());
  auto header = read_header(path, "the decompressed data", [&](void* dst, std::size_t n) {
    return gz->read(dst, n, "while reading the IDX header");
  });
  if (!header) return std::unexpected(header.error());
  std::uint64_t total = header->header_bytes + header->payload;
  if (total / kMaxDeflateRatio > size)
    return make_error(
        ErrorKind::InvalidInput,
        fmt::format("{}: the IDX header ({}) announces {} decompressed bytes, more than a gzip file "
                    "of {} bytes can hold (deflate expands at most {} times); the file is "
                    "truncated or the header is wrong",
                    quoted(path), dims_text(header->dims), total, size, kMaxDeflateRatio));
  if (header->rows == 0)
    if (auto end = gz_expect_end(*gz, *header); !end) return std::unexpected(end.error());
  std::size_t rows = header->rows, dim = header->dim;
  // Inflating is the slow part of reading such a file: it starts now, on a thread of its own.
  auto inflating = std::make_unique<IdxGzipSource>(std::move(*gz), std::move(*header));
  return OpenedSource{std::make_unique<ReadAheadSource>(std::move(inflating), rows, dim,
                                                        kGzipAheadBytes),
                      ElementType::UInt8, rows, dim};
}

}  // namespace gpupool::io::detail
