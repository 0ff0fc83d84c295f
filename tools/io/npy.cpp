// NumPy .npy files: "\x93NUMPY", version, header length, a Python dict literal
// {'descr': '<f4', 'fortran_order': False, 'shape': (rows, dim), } padded with spaces, the data.
// Read: 2-D C-order little-endian <f4 <f2 |u1 |i1 <i4. Written: <f4, <i4, <f8 and <i8, version 1.0.
#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <fmt/format.h>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>
#include "detail.hpp"

namespace gpupool::io::detail {

namespace {

constexpr std::string_view kMagic = "\x93NUMPY";
constexpr std::size_t kMaxHeaderBytes = std::size_t{1} << 20;

// The parts of the header dict gpupool needs; the parser accepts exactly the Python literals
// NumPy writes (strings, True/False, tuples of integers; a list descr is noted as structured).
struct NpyHeader {
  std::optional<std::string> descr;
  bool structured = false;
  std::optional<bool> fortran_order;
  std::optional<std::vector<std::uint64_t>> shape;
};

class HeaderParser {
 public:
  explicit HeaderParser(std::string_view text) : text_(text) {}

  // nullopt on success, else what is wrong and where.
  std::optional<std::string> parse(NpyHeader& out) {
    skip_space();
    if (!eat('{')) return problem("expected '{' to start the header dict");
    while (true) {
      skip_space();
      if (eat('}')) break;
      std::string key;
      if (!parse_string(key)) return problem("expected a quoted key");
      skip_space();
      if (!eat(':')) return problem(fmt::format("expected ':' after key '{}'", key));
      skip_space();
      if (key == "descr") {
        if (out.descr || out.structured) return problem("key 'descr' appears twice");
        if (peek() == '[') {
          if (!skip_brackets()) return problem("unterminated list in 'descr'");
          out.structured = true;
        } else {
          std::string descr;
          if (!parse_string(descr)) return problem("expected a quoted dtype for 'descr'");
          out.descr = descr;
        }
      } else if (key == "fortran_order") {
        if (out.fortran_order) return problem("key 'fortran_order' appears twice");
        if (eat_word("True")) out.fortran_order = true;
        else if (eat_word("False")) out.fortran_order = false;
        else return problem("expected True or False for 'fortran_order'");
      } else if (key == "shape") {
        if (out.shape) return problem("key 'shape' appears twice");
        std::vector<std::uint64_t> shape;
        if (auto bad = parse_shape(shape)) return bad;
        out.shape = std::move(shape);
      } else {
        return problem(fmt::format("unexpected key '{}' (expected only 'descr', 'fortran_order' "
                                   "and 'shape')",
                                   key));
      }
      skip_space();
      if (eat(',')) continue;
      skip_space();
      if (eat('}')) break;
      return problem("expected ',' or '}' after a value");
    }
    skip_space();
    if (pos_ != text_.size()) return problem("unexpected text after the header dict");
    if (!out.descr && !out.structured) return std::string("the header has no 'descr' key");
    if (!out.fortran_order) return std::string("the header has no 'fortran_order' key");
    if (!out.shape) return std::string("the header has no 'shape' key");
    return std::nullopt;
  }

 private:
  std::string problem(std::string_view what) const {
    return fmt::format("{} at header byte {}", what, pos_);
  }
  char peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  bool eat(char c) {
    if (peek() != c) return false;
    ++pos_;
    return true;
  }
  bool eat_word(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }
  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  bool parse_string(std::string& out) {
    char quote = peek();
    if (quote != '\'' && quote != '"') return false;
    std::size_t end = text_.find(quote, pos_ + 1);
    if (end == std::string_view::npos) return false;
    out.assign(text_.substr(pos_ + 1, end - pos_ - 1));
    pos_ = end + 1;
    return true;
  }
  bool skip_brackets() {
    int depth = 0;
    while (pos_ < text_.size()) {
      char c = text_[pos_];
      if (c == '\'' || c == '"') {
        std::string ignored;
        if (!parse_string(ignored)) return false;
        continue;
      }
      ++pos_;
      if (c == '[' || c == '(') ++depth;
      if ((c == ']' || c == ')') && --depth == 0) return true;
    }
    return false;
  }
  std::optional<std::string> parse_shape(std::vector<std::uint64_t>& shape) {
    if (!eat('(')) return problem("expected a tuple '(...)' for 'shape'");
    while (true) {
      skip_space();
      if (eat(')')) return std::nullopt;
      std::uint64_t value = 0;
      const char* first = text_.data() + pos_;
      const char* last = text_.data() + text_.size();
      auto [end, ec] = std::from_chars(first, last, value);
      if (ec == std::errc::result_out_of_range) return problem("shape entry out of range");
      if (ec != std::errc{} || end == first)
        return problem("expected a non-negative integer in 'shape'");
      pos_ += static_cast<std::size_t>(end - first);
      eat('L');  // Python 2 long literal, as in files from old NumPy versions
      shape.push_back(value);
      skip_space();
      if (eat(',')) continue;
      skip_space();
      if (eat(')')) return std::nullopt;
      return problem("expected ',' or ')' in 'shape'");
    }
  }

  std::string_view text_;
  std::size_t pos_ = 0;
};

std::string shape_text(const std::vector<std::uint64_t>& shape) {
  std::string text = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  if (shape.size() == 1) text += ",";
  return text + ")";
}

// The element type of a descr gpupool reads, or nullopt.
std::optional<ElementType> element_of_descr(std::string_view descr) {
  if (descr.size() != 3) return std::nullopt;
  char order = descr[0];
  std::string_view kind = descr.substr(1);
  bool one_byte = kind == "u1" || kind == "i1";
  if (one_byte) {
    if (order != '|' && order != '<' && order != '>' && order != '=') return std::nullopt;
    return kind == "u1" ? ElementType::UInt8 : ElementType::Int8;
  }
  if (order != '<' && order != '=') return std::nullopt;  // '=' is native: little-endian here
  if (kind == "f4") return ElementType::Float32;
  if (kind == "f2") return ElementType::Float16;
  if (kind == "i4") return ElementType::Int32;
  return std::nullopt;
}

class NpySource final : public RowSource {
 public:
  NpySource(InputFile file, std::size_t row_bytes, std::uint64_t data_offset)
      : file_(std::move(file)), row_bytes_(row_bytes), data_offset_(data_offset) {}
  Result<void> read_rows(std::size_t first_row, std::size_t n, std::byte* dst) override {
    auto got = file_.read(dst, n * row_bytes_);
    if (!got) return std::unexpected(got.error());
    if (*got < n * row_bytes_)
      return make_error(ErrorKind::InvalidInput,
                        fmt::format("{}: row {} is truncated: the file ended after {} of its {} "
                                    "bytes (was it cut short while being read?)",
                                    quoted(file_.path()), first_row + *got / row_bytes_,
                                    *got % row_bytes_, row_bytes_));
    return {};
  }
  bool seekable() const noexcept override { return true; }
  Result<void> seek_row(std::size_t row) override {
    return file_.seek(data_offset_ + static_cast<std::uint64_t>(row) * row_bytes_);
  }

 private:
  InputFile file_;
  std::size_t row_bytes_;
  std::uint64_t data_offset_;  // the preamble's length: row 0's first byte
};

}  // namespace

Result<OpenedSource> open_npy(const std::filesystem::path& path) {
  auto file = InputFile::open(path);
  if (!file) return std::unexpected(file.error());
  std::uint64_t size = file->size();
  std::array<unsigned char, 12> pre{};
  auto got = file->read(pre.data(), 10);
  if (!got) return std::unexpected(got.error());
  if (*got < 10 || std::memcmp(pre.data(), kMagic.data(), kMagic.size()) != 0)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: not a .npy file: it does not start with the magic "
                                  "\"\\x93NUMPY\" and a version",
                                  quoted(path)));
  unsigned major = pre[6];
  if (major < 1 || major > 3)
    return make_error(ErrorKind::Unsupported,
                      fmt::format("{}: .npy format version {}.{} is not supported; expected 1.0, "
                                  "2.0 or 3.0",
                                  quoted(path), major, unsigned{pre[7]}));
  std::uint64_t header_len = 0;
  std::size_t prefix = 10;
  if (major == 1) {
    header_len = pre[8] | unsigned{pre[9]} << 8;
  } else {
    got = file->read(pre.data() + 10, 2);
    if (!got) return std::unexpected(got.error());
    if (*got < 2)
      return make_error(ErrorKind::InvalidInput,
                        fmt::format("{}: truncated .npy preamble: the file ends inside the header "
                                    "length",
                                    quoted(path)));
    header_len = pre[8] | unsigned{pre[9]} << 8 | std::uint32_t{pre[10]} << 16 |
                 std::uint32_t{pre[11]} << 24;
    prefix = 12;
  }
  if (header_len > kMaxHeaderBytes)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: bad .npy header: it claims to be {} bytes long, more than "
                                  "the {} a real header can need",
                                  quoted(path), header_len, kMaxHeaderBytes));
  std::string text(static_cast<std::size_t>(header_len), '\0');
  got = file->read(text.data(), text.size());
  if (!got) return std::unexpected(got.error());
  if (*got < text.size())
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: truncated .npy header: {} bytes announced, the file ends "
                                  "after {}",
                                  quoted(path), header_len, *got));
  NpyHeader header;
  if (auto bad = HeaderParser(text).parse(header))
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: bad .npy header: {}", quoted(path), *bad));
  if (header.structured)
    return make_error(ErrorKind::Unsupported,
                      fmt::format("{}: .npy arrays of a structured dtype (a list of fields) are "
                                  "not supported; expected a plain '<f4', '<f2', '|u1', '|i1' or "
                                  "'<i4' array",
                                  quoted(path)));
  std::optional<ElementType> type = element_of_descr(*header.descr);
  if (!type) {
    bool big_endian = !header.descr->empty() && header.descr->front() == '>';
    return make_error(
        ErrorKind::Unsupported,
        fmt::format("{}: .npy dtype '{}' is not supported{}; expected '<f4' (float32), '<f2' "
                    "(float16), '|u1' (uint8), '|i1' (int8) or '<i4' (int32); convert it, e.g. "
                    "np.save(path, a.astype('<f4'))",
                    quoted(path), *header.descr, big_endian ? " (big-endian)" : ""));
  }
  if (*header.fortran_order)
    return make_error(ErrorKind::Unsupported,
                      fmt::format("{}: the .npy array is stored in Fortran (column-major) order; "
                                  "only C order is supported: save np.ascontiguousarray(a)",
                                  quoted(path)));
  const std::vector<std::uint64_t>& shape = *header.shape;
  if (shape.size() != 2)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: the .npy array has {} dimensions, shape {}; expected a 2-D "
                                  "array (rows, dim){}",
                                  quoted(path), shape.size(), shape_text(shape),
                                  shape.size() == 1 ? " — reshape it to (n, 1) or (1, n)" : ""));
  if (shape[1] == 0 || shape[1] > kMaxDim)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: the .npy array has shape {}: rows of {} values; expected 1 "
                                  "to {} values per row",
                                  quoted(path), shape_text(shape), shape[1], kMaxDim));
  std::uint64_t row_bytes = shape[1] * element_size(*type);
  std::uint64_t payload = 0;
  if (!checked_mul(shape[0], row_bytes, payload) || shape[0] > SIZE_MAX)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: the .npy shape {} is too large to be real", quoted(path),
                                  shape_text(shape)));
  std::uint64_t offset = prefix + header_len;
  std::uint64_t body = size - offset;
  if (body < payload) {
    std::uint64_t row = body / row_bytes;
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: the .npy data is truncated: shape {} of '{}' needs {} bytes "
                                  "after the {}-byte header, but the file has {}: row {} (byte "
                                  "offset {}) is incomplete",
                                  quoted(path), shape_text(shape), *header.descr, payload, offset,
                                  body, row, offset + row * row_bytes));
  }
  if (body > payload)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{}: the .npy file is longer than its header announces: shape "
                                  "{} of '{}' needs {} bytes after the {}-byte header, but {} "
                                  "follow ({} extra)",
                                  quoted(path), shape_text(shape), *header.descr, payload, offset,
                                  body, body - payload));
  auto rows = static_cast<std::size_t>(shape[0]);
  auto dim = static_cast<std::size_t>(shape[1]);
  return OpenedSource{
      std::make_unique<NpySource>(std::move(*file), static_cast<std::size_t>(row_bytes), offset),
      *type, rows, dim};
}

std::string npy_preamble(std::string_view descr, std::size_t rows, std::size_t dim) {
  std::string dict = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': ({}, {}), }}",
                                 descr, rows, dim);
  // Magic (6) + version (2) + length (2) + dict + padding + '\n', a multiple of 64 bytes.
  std::size_t unpadded = 10 + dict.size() + 1;
  std::size_t total = (unpadded + 63) / 64 * 64;
  dict.append(total - unpadded, ' ');
  dict.push_back('\n');
  std::string out(kMagic);
  out.push_back('\x01');
  out.push_back('\x00');
  out.push_back(static_cast<char>(dict.size() & 0xff));
  out.push_back(static_cast<char>(dict.size() >> 8));
  return out + dict;
}

}  // namespace gpupool::io::detail
