// VectorReader: opens the format's row source and converts its rows to float32 or int32.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <exception>
#include <fmt/format.h>
#include <memory>
#include <new>
#include <optional>
#include <type_traits>
#include <vector>
#include "detail.hpp"

namespace gpupool::io {

struct VectorReader::Impl {
  std::filesystem::path path;
  VectorFormat format;
  ElementType type;
  std::size_t rows;
  std::size_t dim;
  std::size_t position = 0;
  std::unique_ptr<detail::RowSource> source;
  std::vector<std::byte> scratch;
  std::optional<GpuError> failure;  // the first error of a read; the reader is spent after it
};

namespace {

float half_to_float(std::uint16_t h) {
  std::uint32_t sign = std::uint32_t{h & 0x8000u} << 16;
  std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    float value = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -value : value;
  }
  std::uint32_t bits = exponent == 31 ? sign | 0x7f800000u | mantissa << 13  // inf, NaN
                                      : sign | (exponent + 112) << 23 | mantissa << 13;
  return std::bit_cast<float>(bits);
}

constexpr std::int32_t kExactFloatInt = 1 << 24;

// Converts count packed values of type from src to out. first_row is for messages.
template <class T>
Result<void> convert(const VectorReader::Impl& r, const std::byte* src, std::size_t count,
                     std::size_t first_row, T* out) {
  switch (r.type) {
    case ElementType::UInt8:
      for (std::size_t i = 0; i < count; ++i) out[i] = static_cast<T>(std::to_integer<std::uint8_t>(src[i]));
      return {};
    case ElementType::Int8:
      for (std::size_t i = 0; i < count; ++i)
        out[i] = static_cast<T>(static_cast<std::int8_t>(std::to_integer<std::uint8_t>(src[i])));
      return {};
    case ElementType::Float16:
      if constexpr (std::is_same_v<T, float>) {
        for (std::size_t i = 0; i < count; ++i) {
          std::uint16_t h;
          std::memcpy(&h, src + 2 * i, 2);
          out[i] = half_to_float(h);
        }
        return {};
      }
      break;
    case ElementType::Int32:
      if constexpr (std::is_same_v<T, float>) {
        for (std::size_t i = 0; i < count; ++i) {
          std::int32_t v;
          std::memcpy(&v, src + 4 * i, 4);
          if (v > kExactFloatInt || v < -kExactFloatInt)
            return make_error(
                ErrorKind::InvalidInput,
                fmt::format("{}: row {}, value {} is {}, which float32 cannot hold exactly (only "
                            "integers up to 2^24 = 16777216 in magnitude); read this file as "
                            "int32 (read_ints) instead",
                            detail::quoted(r.path), first_row + i / r.dim, i % r.dim, v));
          out[i] = static_cast<float>(v);
        }
        return {};
      } else {
        std::memcpy(out, src, 4 * count);
        return {};
      }
    case ElementType::Float32:
      if constexpr (std::is_same_v<T, float>) {
        std::memcpy(out, src, 4 * count);
        return {};
      }
      break;
  }
  return make_error(ErrorKind::Internal, "gpupool::io: conversion not covered");
}

template <class T>
Result<std::size_t> read_rows(VectorReader::Impl& r, std::span<T> out, std::size_t max_rows) {
  constexpr bool to_float = std::is_same_v<T, float>;
  if (r.failure)
    return make_error(ErrorKind::InvalidState,
                      "an earlier read failed, the reader cannot go on: " + r.failure->message());
  if (max_rows == 0)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: read asked for 0 rows; max_rows must be at least 1",
                                  detail::quoted(r.path)));
  if (!to_float && (r.type == ElementType::Float32 || r.type == ElementType::Float16))
    return make_error(ErrorKind::Unsupported,
                      fmt::format("{}: the file holds {} values, which cannot be read as int32; "
                                  "read them as float32 (read)",
                                  detail::quoted(r.path), to_string(r.type)));
  std::size_t n = std::min(max_rows, r.rows - r.position);
  if (n == 0) return std::size_t{0};
  if (out.size() / r.dim < n)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: the output holds {} values, too few for {} rows of "
                                  "dimension {} ({} values)",
                                  detail::quoted(r.path), out.size(), n, r.dim, n * r.dim));
  std::size_t esize = detail::element_size(r.type);
  bool direct = (to_float && r.type == ElementType::Float32) ||
                (!to_float && r.type == ElementType::Int32);
  std::size_t row_bytes = r.dim * esize;
  std::size_t per_block = std::max<std::size_t>(1, detail::kBlockBytes / row_bytes);
  auto fail = [&](GpuError error) -> Result<std::size_t> {
    r.failure = error;
    return std::unexpected(std::move(error));
  };
  for (std::size_t done = 0; done < n;) {
    std::size_t count = std::min(per_block, n - done);
    T* dst = out.data() + done * r.dim;
    std::size_t first = r.position + done;
    if (direct) {
      if (auto got = r.source->read_rows(first, count, reinterpret_cast<std::byte*>(dst)); !got)
        return fail(got.error());
    } else {
      if (r.scratch.size() < count * row_bytes) r.scratch.resize(count * row_bytes);
      if (auto got = r.source->read_rows(first, count, r.scratch.data()); !got)
        return fail(got.error());
      if (auto ok = convert(r, r.scratch.data(), count * r.dim, first, dst); !ok)
        return fail(ok.error());
    }
    done += count;
  }
  r.position += n;
  return n;
}

Result<std::size_t> read_stored_rows(VectorReader::Impl& r, std::span<std::byte> out,
                                     std::size_t max_rows) {
  if (r.failure)
    return make_error(ErrorKind::InvalidState,
                      "an earlier read failed, the reader cannot go on: " + r.failure->message());
  if (max_rows == 0)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: read asked for 0 rows; max_rows must be at least 1",
                                  detail::quoted(r.path)));
  if (r.type == ElementType::Int32)
    return make_error(ErrorKind::Unsupported,
                      fmt::format("{}: the file holds int32 values, which have no stored form the "
                                  "kernels take; read them as float32 (read) or int32 (read_ints)",
                                  detail::quoted(r.path)));
  std::size_t n = std::min(max_rows, r.rows - r.position);
  if (n == 0) return std::size_t{0};
  const std::size_t row_bytes = r.dim * detail::element_size(r.type);
  if (out.size() / row_bytes < n)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: the output holds {} bytes, too few for {} rows of {} bytes",
                                  detail::quoted(r.path), out.size(), n, row_bytes));
  if (auto got = r.source->read_rows(r.position, n, out.data()); !got) {
    r.failure = got.error();
    return std::unexpected(got.error());
  }
  r.position += n;
  return n;
}

// read(*r) with no exception escaping: a failure is the reader's from then on.
template <class Read>
Result<std::size_t> guarded_read(VectorReader::Impl* r, Read read) {
  if (!r)
    return make_error(ErrorKind::InvalidState, "read from a VectorReader that was moved from");
  try {
    return read(*r);
  } catch (const std::bad_alloc&) {
    GpuError error(ErrorKind::OutOfMemory,
                   fmt::format("{}: out of host memory while reading", detail::quoted(r->path)));
    r->failure = error;
    return std::unexpected(error);
  } catch (const std::exception& e) {
    GpuError error(ErrorKind::Internal, fmt::format("{}: unexpected exception while reading: {}",
                                                    detail::quoted(r->path), e.what()));
    r->failure = error;
    return std::unexpected(error);
  }
}

}  // namespace

Result<VectorReader> VectorReader::open(const std::filesystem::path& path) {
  auto format = detect_format(path);
  if (!format) return std::unexpected(format.error());
  return open(path, *format);
}

Result<VectorReader> VectorReader::open(const std::filesystem::path& path, VectorFormat format) {
  try {
    Result<detail::OpenedSource> opened = [&]() -> Result<detail::OpenedSource> {
      switch (format) {
        case VectorFormat::Fvecs:
        case VectorFormat::Bvecs:
        case VectorFormat::Ivecs: return detail::open_texmex(path, format);
        case VectorFormat::Idx: return detail::open_idx(path);
        case VectorFormat::Npy: return detail::open_npy(path);
      }
      return make_error(ErrorKind::InvalidInput,
                        fmt::format("{}: unknown vector format {}", detail::quoted(path),
                                    static_cast<int>(format)));
    }();
    if (!opened) return std::unexpected(opened.error());
    auto impl = std::make_unique<Impl>(Impl{path, format, opened->type, opened->rows, opened->dim, 0,
                                            std::move(opened->source), {}, std::nullopt});
    return VectorReader(std::move(impl));
  } catch (const std::bad_alloc&) {
    return make_error(ErrorKind::OutOfMemory,
                      fmt::format("{}: out of host memory while opening", detail::quoted(path)));
  } catch (const std::exception& e) {
    return make_error(ErrorKind::Internal, fmt::format("{}: unexpected exception while opening: {}",
                                                       detail::quoted(path), e.what()));
  }
}

VectorReader::VectorReader(std::unique_ptr<Impl> impl) noexcept : impl_(std::move(impl)) {}
VectorReader::VectorReader(VectorReader&&) noexcept = default;
VectorReader& VectorReader::operator=(VectorReader&&) noexcept = default;
VectorReader::~VectorReader() = default;

// The accessors of a moved-from reader answer as an empty one.
const std::filesystem::path& VectorReader::path() const noexcept {
  static const std::filesystem::path none;
  return impl_ ? impl_->path : none;
}
VectorFormat VectorReader::format() const noexcept { return impl_ ? impl_->format : VectorFormat::Fvecs; }
ElementType VectorReader::element_type() const noexcept {
  return impl_ ? impl_->type : ElementType::Float32;
}
std::size_t VectorReader::rows() const noexcept { return impl_ ? impl_->rows : 0; }
std::size_t VectorReader::dim() const noexcept { return impl_ ? impl_->dim : 0; }
std::size_t VectorReader::rows_read() const noexcept { return impl_ ? impl_->position : 0; }

Result<std::size_t> VectorReader::read(std::span<float> out, std::size_t max_rows) {
  return guarded_read(impl_.get(), [&](Impl& r) { return read_rows(r, out, max_rows); });
}

Result<std::size_t> VectorReader::read_ints(std::span<std::int32_t> out, std::size_t max_rows) {
  return guarded_read(impl_.get(), [&](Impl& r) { return read_rows(r, out, max_rows); });
}

Result<std::size_t> VectorReader::read_stored(std::span<std::byte> out, std::size_t max_rows) {
  return guarded_read(impl_.get(), [&](Impl& r) { return read_stored_rows(r, out, max_rows); });
}

std::size_t element_bytes(ElementType type) noexcept { return detail::element_size(type); }

bool VectorReader::seekable() const noexcept { return impl_ && impl_->source->seekable(); }

Result<void> VectorReader::seek(std::size_t row) {
  if (!impl_) return make_error(ErrorKind::InvalidState, "seek on a VectorReader that was moved from");
  Impl& r = *impl_;
  if (r.failure)
    return make_error(ErrorKind::InvalidState,
                      "an earlier read failed, the reader cannot go on: " + r.failure->message());
  if (row > r.rows)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: cannot seek to row {}: the file has {} rows (0 to {} are "
                                  "places to read from)",
                                  detail::quoted(r.path), row, r.rows, r.rows));
  if (!r.source->seekable())
    return make_error(ErrorKind::Unsupported,
                      fmt::format("{}: cannot seek to row {}: the rows of a gzip file are read in "
                                  "order only",
                                  detail::quoted(r.path), row));
  if (auto ok = r.source->seek_row(row); !ok) return ok;
  r.position = row;
  return {};
}

}  // namespace gpupool::io
