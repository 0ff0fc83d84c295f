// gzip data inflated with zlib's inflate (see gzip_reader.hpp).
#include <algorithm>
#include <cstring>
#include <fmt/format.h>
#include <new>
#include <utility>
#include <zlib.h>
#include "gzip_reader.hpp"

namespace gpupool::io::detail {

namespace {

constexpr std::size_t kInputBytes = std::size_t{1} << 17;
constexpr int kGzipWindow = 16 + MAX_WBITS;  // 16: gzip wrapping, not zlib's
constexpr unsigned char kGzipMagic[2] = {0x1f, 0x8b};

}  // namespace

void GzipReader::StreamEnd::operator()(z_stream_s* stream) const noexcept {
  inflateEnd(stream);
  delete stream;
}

GzipReader::GzipReader(InputFile file) : file_(std::move(file)) {}
GzipReader::GzipReader(GzipReader&&) noexcept = default;
GzipReader& GzipReader::operator=(GzipReader&&) noexcept = default;
GzipReader::~GzipReader() = default;

Result<GzipReader> GzipReader::open(InputFile file) {
  GzipReader reader(std::move(file));
  auto* stream = new (std::nothrow) z_stream{};
  if (!stream)
    return make_error(ErrorKind::OutOfMemory,
                      fmt::format("{}: no memory for zlib's stream", quoted(reader.path())));
  if (inflateInit2(stream, kGzipWindow) != Z_OK) {
    delete stream;
    return make_error(ErrorKind::OutOfMemory,
                      fmt::format("{}: zlib could not start inflating", quoted(reader.path())));
  }
  reader.stream_.reset(stream);
  reader.input_.resize(kInputBytes);
  return reader;
}

Result<bool> GzipReader::refill() {
  z_stream& s = *stream_;
  const std::size_t kept = s.avail_in;
  consumed_before_ += static_cast<std::uint64_t>(s.next_in ? s.next_in - input_.data() : 0);
  if (kept > 0) std::memmove(input_.data(), s.next_in, kept);
  auto got = file_.read(input_.data() + kept, input_.size() - kept);
  if (!got) return std::unexpected(got.error());
  s.next_in = input_.data();
  s.avail_in = static_cast<uInt>(kept + *got);
  return *got > 0;
}

GpuError GzipReader::inflate_error(int code, std::string_view where) const {
  if (code == Z_MEM_ERROR)
    return GpuError(ErrorKind::OutOfMemory,
                    fmt::format("{}: zlib ran out of memory {}", quoted(path()), where));
  return GpuError(ErrorKind::InvalidInput,
                  fmt::format("{}: corrupt gzip data {} (zlib: {})", quoted(path()), where,
                              stream_->msg ? stream_->msg : "bad data"));
}

Result<void> GzipReader::next_member(std::string_view where) {
  z_stream& s = *stream_;
  while (s.avail_in < 2) {
    auto more = refill();
    if (!more) return std::unexpected(more.error());
    if (!*more) break;
  }
  if (s.avail_in == 0) {
    ended_ = true;
    return {};
  }
  if (s.avail_in < 2 || std::memcmp(s.next_in, kGzipMagic, 2) != 0) {
    const std::uint64_t at = consumed_before_ + static_cast<std::uint64_t>(s.next_in - input_.data());
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: {} bytes of other data follow the gzip data, from byte {} "
                                  "of {} ({}); the file is damaged or is not one gzip file",
                                  quoted(path()), file_.size() - at, at, file_.size(), where));
  }
  inflateReset(&s);
  member_ended_ = false;
  return {};
}

Result<std::size_t> GzipReader::read(void* dst, std::size_t n, std::string_view where) {
  z_stream& s = *stream_;
  auto* out = static_cast<unsigned char*>(dst);
  std::size_t done = 0;
  while (done < n && !ended_) {
    if (member_ended_) {
      if (auto ok = next_member(where); !ok) return std::unexpected(ok.error());
      continue;
    }
    if (s.avail_in == 0) {
      auto more = refill();
      if (!more) return std::unexpected(more.error());
      if (!*more)
        return make_error(ErrorKind::InvalidInput,
                          fmt::format("{}: the gzip data is cut short {}; the file is truncated",
                                      quoted(path()), where));
    }
    const auto room = static_cast<uInt>(std::min<std::size_t>(n - done, std::size_t{1} << 30));
    s.next_out = out + done;
    s.avail_out = room;
    const int code = inflate(&s, Z_NO_FLUSH);
    done += room - s.avail_out;
    if (code == Z_STREAM_END) member_ended_ = true;
    else if (code != Z_OK && code != Z_BUF_ERROR) return std::unexpected(inflate_error(code, where));
  }
  return done;
}

}  // namespace gpupool::io::detail
