// gpupool::io: vector files in every format — round trips, conversions, chunked reads, every kind
// of corrupt file, the real Fashion-MNIST test set, and atomic writes.
#include <catch2/catch.hpp>
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <system_error>
#include <unistd.h>
#include <vector>
#include <zlib.h>
#include "vector_io.hpp"
#include "support/temp_dir.hpp"

using namespace gpupool;
using namespace gpupool::io;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

using gpupool::testing::TempDir;

namespace {

using Bytes = std::vector<std::uint8_t>;

void write_file(const fs::path& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

Bytes read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), {});
}

template <class T>
void put(Bytes& out, T value) {
  std::uint8_t raw[sizeof(T)];
  std::memcpy(raw, &value, sizeof(T));  // little-endian host
  out.insert(out.end(), raw, raw + sizeof(T));
}

void put_be32(Bytes& out, std::uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<std::uint8_t>(value >> shift));
}

// One TEXMEX record with the given dimension field and values.
template <class T>
void put_record(Bytes& out, std::int32_t dim_field, const std::vector<T>& values) {
  put(out, dim_field);
  for (T v : values) put(out, v);
}

// An IDX file: two zero bytes, the type, the dims (big-endian), the payload.
Bytes idx_file(std::uint8_t type, const std::vector<std::uint32_t>& dims, const Bytes& payload) {
  Bytes out{0, 0, type, static_cast<std::uint8_t>(dims.size())};
  for (auto d : dims) put_be32(out, d);
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

// A .npy file, version 1.0, with the given header dict text and payload.
Bytes npy_file(const std::string& dict, const Bytes& payload) {
  Bytes out{0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  std::string header = dict + "\n";
  put(out, static_cast<std::uint16_t>(header.size()));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

Bytes gzip(const Bytes& data) {
  z_stream stream{};
  REQUIRE(deflateInit2(&stream, Z_BEST_COMPRESSION, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  Bytes out(deflateBound(&stream, data.size()));
  stream.next_in = const_cast<Bytef*>(data.data());
  stream.avail_in = static_cast<uInt>(data.size());
  stream.next_out = out.data();
  stream.avail_out = static_cast<uInt>(out.size());
  REQUIRE(deflate(&stream, Z_FINISH) == Z_STREAM_END);
  out.resize(stream.total_out);
  deflateEnd(&stream);
  return out;
}

Bytes iota_bytes(std::size_t n, std::uint8_t start = 0) {
  Bytes out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<std::uint8_t>(start + i * 7);
  return out;
}

VectorReader open_ok(const fs::path& path) {
  auto reader = VectorReader::open(path);
  INFO(path.string());
  if (!reader) FAIL(reader.error().to_string());
  return std::move(*reader);
}

// All rows through read() (chunk rows at a time).
std::vector<float> read_all(VectorReader& reader, std::size_t chunk) {
  std::vector<float> all;
  std::vector<float> buffer(chunk * reader.dim());
  while (true) {
    auto got = reader.read(buffer, chunk);
    if (!got) FAIL(got.error().to_string());
    if (*got == 0) break;
    all.insert(all.end(), buffer.begin(), buffer.begin() + static_cast<std::ptrdiff_t>(*got * reader.dim()));
  }
  CHECK(reader.rows_read() == reader.rows());
  return all;
}

std::vector<std::int32_t> read_all_ints(VectorReader& reader, std::size_t chunk) {
  std::vector<std::int32_t> all;
  std::vector<std::int32_t> buffer(chunk * reader.dim());
  while (true) {
    auto got = reader.read_ints(buffer, chunk);
    if (!got) FAIL(got.error().to_string());
    if (*got == 0) break;
    all.insert(all.end(), buffer.begin(), buffer.begin() + static_cast<std::ptrdiff_t>(*got * reader.dim()));
  }
  return all;
}

// The error of opening path, or of reading it to the end when opening succeeds.
GpuError first_error(const fs::path& path) {
  auto reader = VectorReader::open(path);
  if (!reader) return reader.error();
  std::vector<float> buffer(4 * std::max<std::size_t>(reader->dim(), 1));
  while (true) {
    auto got = reader->read(buffer, 4);
    if (!got) return got.error();
    if (*got == 0) break;
  }
  FAIL("expected an error for " << path.string());
  return GpuError(ErrorKind::Internal, "unreachable");
}

void check_error(const fs::path& path, ErrorKind kind, std::initializer_list<std::string> parts) {
  GpuError error = first_error(path);
  INFO(error.to_string());
  CHECK(error.kind() == kind);
  CHECK_THAT(error.message(), Contains(path.string()));
  for (const std::string& part : parts) CHECK_THAT(error.message(), Contains(part));
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("formats are recognised by file name", "[io]") {
  CHECK(detect_format("a/base.fvecs") == VectorFormat::Fvecs);
  CHECK(detect_format("q.BVECS") == VectorFormat::Bvecs);
  CHECK(detect_format("gt.ivecs") == VectorFormat::Ivecs);
  CHECK(detect_format("x.npy") == VectorFormat::Npy);
  CHECK(detect_format("x.idx") == VectorFormat::Idx);
  CHECK(detect_format("t10k-images-idx3-ubyte.gz") == VectorFormat::Idx);
  CHECK(detect_format("train-labels-idx1-ubyte") == VectorFormat::Idx);
  CHECK(detect_format("x.idx.gz") == VectorFormat::Idx);
  auto unknown = detect_format("data.bin");
  REQUIRE_FALSE(unknown);
  CHECK(unknown.error().kind() == ErrorKind::InvalidInput);
  CHECK_THAT(unknown.error().message(), Contains("data.bin") && Contains(".fvecs"));
  auto gz = detect_format("base.fvecs.gz");
  REQUIRE_FALSE(gz);
  CHECK(gz.error().kind() == ErrorKind::Unsupported);
  CHECK_THAT(gz.error().message(), Contains("gunzip"));
  CHECK_FALSE(detect_format("idx-ubyte"));
  CHECK_FALSE(detect_format("x.npy.gz"));
}

TEST_CASE("fvecs and ivecs round trip exactly through the writers", "[io]") {
  TempDir dir{"io"};
  const float special[] = {0.0f, -0.0f, 1.5f, -3.25f, 1e-38f, std::numeric_limits<float>::max(),
                           std::numeric_limits<float>::denorm_min(),
                           std::numeric_limits<float>::infinity(), 0.1f, -7e12f, 42.0f, 1.0f / 3};
  std::vector<float> values(special, special + 12);
  auto fvecs = dir / "v.fvecs";
  REQUIRE(write_fvecs(fvecs, 4, 3, values));
  CHECK(fs::file_size(fvecs) == 4 * (4 + 3 * 4));
  VectorReader reader = open_ok(fvecs);
  CHECK(reader.format() == VectorFormat::Fvecs);
  CHECK(reader.element_type() == ElementType::Float32);
  CHECK(reader.rows() == 4);
  CHECK(reader.dim() == 3);
  CHECK(reader.path() == fvecs);
  CHECK(same_bits(read_all(reader, 4), values));
  std::vector<std::int32_t> ints(3);
  auto as_ints = VectorReader::open(fvecs)->read_ints(ints, 1);
  REQUIRE_FALSE(as_ints);
  CHECK(as_ints.error().kind() == ErrorKind::Unsupported);

  std::vector<std::int32_t> ids{0, -1, std::numeric_limits<std::int32_t>::max(),
                                std::numeric_limits<std::int32_t>::min(), 16777216, -16777216};
  auto ivecs = dir / "gt.ivecs";
  REQUIRE(write_ivecs(ivecs, 3, 2, ids));
  VectorReader id_reader = open_ok(ivecs);
  CHECK(id_reader.element_type() == ElementType::Int32);
  CHECK(id_reader.rows() == 3);
  CHECK(id_reader.dim() == 2);
  CHECK(read_all_ints(id_reader, 2) == ids);

  // As float32: exact where float32 is exact, an error naming row and value where it is not.
  std::vector<std::int32_t> small{5, -16777216, 16777216, 123};
  REQUIRE(write_ivecs(ivecs, 2, 2, small));
  VectorReader small_reader = open_ok(ivecs);
  CHECK(read_all(small_reader, 1) == std::vector<float>{5.0f, -16777216.0f, 16777216.0f, 123.0f});
  REQUIRE(write_ivecs(ivecs, 2, 2, std::vector<std::int32_t>{1, 2, 3, 16777217}));
  check_error(ivecs, ErrorKind::InvalidInput, {"row 1", "16777217", "read_ints"});
}

TEST_CASE("bvecs bytes convert exactly to float32 and int32", "[io]") {
  TempDir dir{"io"};
  Bytes file;
  std::vector<std::uint8_t> row0{0, 1, 127, 128, 255}, row1{9, 8, 7, 6, 5};
  put_record(file, 5, row0);
  put_record(file, 5, row1);
  auto path = dir / "b.bvecs";
  write_file(path, file);
  VectorReader reader = open_ok(path);
  CHECK(reader.element_type() == ElementType::UInt8);
  CHECK(reader.rows() == 2);
  CHECK(reader.dim() == 5);
  CHECK(read_all(reader, 1) == std::vector<float>{0, 1, 127, 128, 255, 9, 8, 7, 6, 5});
  VectorReader again = open_ok(path);
  CHECK(read_all_ints(again, 2) == std::vector<std::int32_t>{0, 1, 127, 128, 255, 9, 8, 7, 6, 5});
}

// The TEXMEX reader reads records straight into the caller's rows, a stretch at a time, and moves
// the values down over the headers; a call's last records go through a buffer of its own. Files of
// many stretches, read in one call and in calls that end anywhere, must come back exactly.
TEST_CASE("TEXMEX rows come back exactly however the reads split them", "[io]") {
  TempDir dir{"io"};
  std::mt19937 random(Catch::rngSeed());
  SECTION("bvecs") {
    const std::size_t rows = 6000 + random() % 500, dim = 100;  // 104-byte records: 2,520 a stretch
    Bytes file, values;
    for (std::size_t r = 0; r < rows; ++r) {
      std::vector<std::uint8_t> row(dim);
      for (auto& v : row) v = static_cast<std::uint8_t>(random());
      put_record(file, static_cast<std::int32_t>(dim), row);
      values.insert(values.end(), row.begin(), row.end());
    }
    const auto path = dir / "many.bvecs";
    write_file(path, file);
    for (const std::vector<std::size_t>& split : std::vector<std::vector<std::size_t>>{
             {rows}, {1, 2519, 2521, 1, rows}, {2520, 2520, rows}, {7, 3, 1000, rows}}) {
      CAPTURE(split);
      VectorReader reader = open_ok(path);
      std::vector<std::byte> got(rows * dim, std::byte{0xA5});
      std::size_t done = 0;
      for (std::size_t want : split) {
        auto read = reader.read_stored(std::span(got).subspan(done * dim), std::min(want, rows - done));
        REQUIRE(read);
        done += *read;
      }
      REQUIRE(done == rows);
      CHECK(std::memcmp(got.data(), values.data(), values.size()) == 0);
    }
  }
  SECTION("fvecs") {
    const std::size_t rows = 5000 + random() % 500, dim = 37;  // 152-byte records: 1,724 a stretch
    Bytes file;
    std::vector<float> values;
    std::uniform_real_distribution<float> value(-1e6f, 1e6f);
    for (std::size_t r = 0; r < rows; ++r) {
      std::vector<float> row(dim);
      for (auto& v : row) v = value(random);
      put_record(file, static_cast<std::int32_t>(dim), row);
      values.insert(values.end(), row.begin(), row.end());
    }
    const auto path = dir / "many.fvecs";
    write_file(path, file);
    VectorReader whole = open_ok(path);
    CHECK(same_bits(read_all(whole, rows), values));
    VectorReader pieces = open_ok(path);
    CHECK(same_bits(read_all(pieces, 1723), values));
  }
  SECTION("a bad record is found wherever its stretch was read to") {
    const std::size_t rows = 6000, dim = 100;
    const std::vector<std::uint8_t> row(dim, 7);
    for (std::size_t bad : {std::size_t{3000}, rows - 1}) {  // read in place; through the buffer
      CAPTURE(bad);
      Bytes file;
      for (std::size_t r = 0; r < rows; ++r)
        put_record(file, r == bad ? static_cast<std::int32_t>(dim + 1) : static_cast<std::int32_t>(dim), row);
      const auto path = dir / "bad.bvecs";
      write_file(path, file);
      VectorReader reader = open_ok(path);
      std::vector<std::byte> got(rows * dim);
      auto read = reader.read_stored(got, rows);
      REQUIRE_FALSE(read);
      CHECK(read.error().kind() == ErrorKind::InvalidInput);
      CHECK_THAT(read.error().message(), Contains("record " + std::to_string(bad) + " ") &&
                                             Contains("dimension " + std::to_string(dim + 1)));
    }
  }
}

TEST_CASE("npy files round trip and every supported dtype converts exactly", "[io]") {
  TempDir dir{"io"};
  std::vector<float> values{1.0f, -2.5f, 3e-20f, 4e20f, -0.0f, 6.0f};
  auto f4 = dir / "f.npy";
  REQUIRE(write_npy(f4, 2, 3, values));
  Bytes raw = read_file(f4);
  REQUIRE(raw.size() > 10);
  std::uint16_t header_len = static_cast<std::uint16_t>(raw[8] | raw[9] << 8);
  CHECK((10 + header_len) % 64 == 0);
  CHECK(raw.size() == 10u + header_len + values.size() * 4);
  std::string header(raw.begin() + 10, raw.begin() + 10 + header_len);
  CHECK_THAT(header, Contains("'descr': '<f4'") && Contains("'shape': (2, 3)"));
  CHECK(header.back() == '\n');
  VectorReader reader = open_ok(f4);
  CHECK(reader.format() == VectorFormat::Npy);
  CHECK(reader.rows() == 2);
  CHECK(reader.dim() == 3);
  CHECK(same_bits(read_all(reader, 2), values));

  std::vector<std::int32_t> ids{7, -8, 2147483647, 0};
  auto i4 = dir / "i.npy";
  REQUIRE(write_npy(i4, 4, 1, ids));
  VectorReader id_reader = open_ok(i4);
  CHECK(id_reader.element_type() == ElementType::Int32);
  CHECK(id_reader.rows() == 4);
  CHECK(id_reader.dim() == 1);
  CHECK(read_all_ints(id_reader, 3) == ids);

  // float16: normal, negative, largest, smallest subnormal, zero signs, infinity.
  Bytes halves;
  for (std::uint16_t h : {0x3c00, 0xc000, 0x7bff, 0x0001, 0x8000, 0x7c00, 0x3555, 0x0400})
    put(halves, h);
  auto f2 = dir / "h.npy";
  write_file(f2, npy_file("{'descr': '<f2', 'fortran_order': False, 'shape': (2, 4), }", halves));
  VectorReader half_reader = open_ok(f2);
  CHECK(half_reader.element_type() == ElementType::Float16);
  std::vector<float> got = read_all(half_reader, 2);
  REQUIRE(got.size() == 8);
  CHECK(got[0] == 1.0f);
  CHECK(got[1] == -2.0f);
  CHECK(got[2] == 65504.0f);
  CHECK(got[3] == std::ldexp(1.0f, -24));
  CHECK(got[4] == 0.0f);
  CHECK(std::signbit(got[4]));
  CHECK(got[5] == std::numeric_limits<float>::infinity());
  CHECK(got[6] == 0.333251953125f);
  CHECK(got[7] == std::ldexp(1.0f, -14));

  auto u1 = dir / "u.npy";
  write_file(u1, npy_file("{'descr': '|u1', 'fortran_order': False, 'shape': (1, 3), }", {0, 200, 255}));
  VectorReader u1_reader = open_ok(u1);
  CHECK(read_all(u1_reader, 1) == std::vector<float>{0, 200, 255});
  auto i1 = dir / "s.npy";
  // Keys in another order, double quotes and a Python 2 long: NumPy reads these too.
  write_file(i1, npy_file("{\"shape\": (3L, 1L), 'fortran_order': False, 'descr': '|i1'}", {0x80, 0x7f, 0xff}));
  VectorReader i1_reader = open_ok(i1);
  CHECK(i1_reader.element_type() == ElementType::Int8);
  CHECK(read_all_ints(i1_reader, 8) == std::vector<std::int32_t>{-128, 127, -1});

  // An empty array is fine.
  auto empty = dir / "e.npy";
  REQUIRE(write_npy(empty, 0, 16, std::span<const float>{}));
  VectorReader empty_reader = open_ok(empty);
  CHECK(empty_reader.rows() == 0);
  CHECK(empty_reader.dim() == 16);
  CHECK(read_all(empty_reader, 4).empty());
}

TEST_CASE("IDX files, plain and gzip, of any dimensions", "[io]") {
  TempDir dir{"io"};
  Bytes payload = iota_bytes(4 * 2 * 3);
  Bytes file = idx_file(0x08, {4, 2, 3}, payload);
  auto plain = dir / "x-idx3-ubyte";
  write_file(plain, file);
  auto packed = dir / "x-idx3-ubyte.gz";
  write_file(packed, gzip(file));
  for (const auto& path : {plain, packed}) {
    VectorReader reader = open_ok(path);
    CHECK(reader.format() == VectorFormat::Idx);
    CHECK(reader.element_type() == ElementType::UInt8);
    CHECK(reader.rows() == 4);
    CHECK(reader.dim() == 6);
    std::vector<float> expected(payload.begin(), payload.end());
    CHECK(read_all(reader, 3) == expected);
  }
  auto labels = dir / "l.idx";
  write_file(labels, idx_file(0x08, {5}, {1, 2, 3, 4, 9}));
  VectorReader label_reader = open_ok(labels);
  CHECK(label_reader.rows() == 5);
  CHECK(label_reader.dim() == 1);
  CHECK(read_all_ints(label_reader, 2) == std::vector<std::int32_t>{1, 2, 3, 4, 9});
  // A plain file named .gz is read as what it is.
  auto misnamed = dir / "m.idx.gz";
  write_file(misnamed, file);
  VectorReader misnamed_reader = open_ok(misnamed);
  CHECK(misnamed_reader.rows() == 4);
}

TEST_CASE("chunked reads give the same rows as one read, across block boundaries", "[io]") {
  TempDir dir{"io"};
  // 2000 rows of 300 float32: 2.4 MB, more than the reader's 1 MiB blocks.
  const std::size_t rows = 2000, dim = 300;
  std::vector<float> values(rows * dim);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) * 0.5f - 1000.0f;
  std::vector<std::int32_t> ints(rows * dim);
  std::iota(ints.begin(), ints.end(), -5000);
  Bytes bytes = iota_bytes(rows * dim, 3);
  Bytes bvecs;
  for (std::size_t r = 0; r < rows; ++r) {
    put(bvecs, static_cast<std::int32_t>(dim));
    bvecs.insert(bvecs.end(), bytes.begin() + static_cast<std::ptrdiff_t>(r * dim),
                 bytes.begin() + static_cast<std::ptrdiff_t>((r + 1) * dim));
  }
  REQUIRE(write_fvecs(dir / "a.fvecs", rows, dim, values));
  REQUIRE(write_npy(dir / "a.npy", rows, dim, values));
  REQUIRE(write_ivecs(dir / "a.ivecs", rows, dim, ints));
  write_file(dir / "a.bvecs", bvecs);
  write_file(dir / "a-idx3-ubyte.gz", gzip(idx_file(0x08, {2000, 20, 15}, bytes)));
  std::vector<float> byte_values(bytes.begin(), bytes.end());
  std::vector<float> int_values(ints.begin(), ints.end());

  struct Case {
    std::string name;
    const std::vector<float>* expected;
  };
  for (const Case& c : {Case{"a.fvecs", &values}, Case{"a.npy", &values}, Case{"a.ivecs", &int_values},
                        Case{"a.bvecs", &byte_values}, Case{"a-idx3-ubyte.gz", &byte_values}}) {
    INFO(c.name);
    VectorReader whole = open_ok(dir / c.name);
    REQUIRE(whole.rows() == rows);
    REQUIRE(whole.dim() == dim);
    std::vector<float> one(rows * dim);
    REQUIRE(whole.read(one, rows) == rows);
    CHECK(whole.read(one, rows) == 0u);
    CHECK(same_bits(one, *c.expected));
    for (std::size_t chunk : {1, 7, 999, 1999, 4096}) {
      INFO("chunk " << chunk);
      VectorReader reader = open_ok(dir / c.name);
      CHECK(same_bits(read_all(reader, chunk), one));
    }
  }
  VectorReader id_reader = open_ok(dir / "a.ivecs");
  CHECK(read_all_ints(id_reader, 333) == ints);
}

// Several readers of one file, each at its own rows, read a base in parallel (the knn job's
// BaseRows): every uncompressed format jumps to a row; gzip IDX cannot.
TEST_CASE("readers seek to a row in every uncompressed format", "[io]") {
  TempDir dir{"io"};
  const std::size_t rows = 700, dim = 5;
  Bytes bytes = iota_bytes(rows * dim, 11);
  std::vector<float> values(bytes.begin(), bytes.end());
  for (float& v : values) v = v * 0.25f - 7.0f;
  std::vector<std::int32_t> ints(rows * dim);
  std::iota(ints.begin(), ints.end(), -900);
  REQUIRE(write_fvecs(dir / "s.fvecs", rows, dim, values));
  REQUIRE(write_npy(dir / "s.npy", rows, dim, values));
  REQUIRE(write_ivecs(dir / "s.ivecs", rows, dim, ints));
  write_file(dir / "s-idx2-ubyte", idx_file(0x08, {700, 5}, bytes));
  write_file(dir / "s-idx2-ubyte.gz", gzip(idx_file(0x08, {700, 5}, bytes)));
  std::vector<float> byte_values(bytes.begin(), bytes.end());
  std::vector<float> int_values(ints.begin(), ints.end());
  struct Case {
    std::string name;
    const std::vector<float>* expected;
  };
  for (const Case& c : {Case{"s.fvecs", &values}, Case{"s.npy", &values},
                        Case{"s.ivecs", &int_values}, Case{"s-idx2-ubyte", &byte_values}}) {
    INFO(c.name);
    VectorReader reader = open_ok(dir / c.name);
    CHECK(reader.seekable());
    std::vector<float> got(3 * dim);
    for (std::size_t row : {std::size_t{433}, std::size_t{0}, std::size_t{697}, std::size_t{250}}) {
      INFO("row " << row);
      REQUIRE(reader.seek(row));
      CHECK(reader.rows_read() == row);
      REQUIRE(reader.read(got, 3) == 3u);
      CHECK(reader.rows_read() == row + 3);
      CHECK(same_bits(got, std::vector<float>(c.expected->begin() + row * dim,
                                              c.expected->begin() + (row + 3) * dim)));
    }
    REQUIRE(reader.seek(rows));  // the end is a place: nothing left to read
    CHECK(reader.read(got, 3) == 0u);
    auto past = reader.seek(rows + 1);
    REQUIRE_FALSE(past);
    CHECK(past.error().kind() == ErrorKind::InvalidInput);
    CHECK_THAT(past.error().message(), Contains("row 701") && Contains("700 rows"));
    REQUIRE(reader.seek(1));  // a refused seek leaves the reader usable
    REQUIRE(reader.read(got, 1) == 1u);
    CHECK(same_bits(std::vector<float>(got.begin(), got.begin() + dim),
                    std::vector<float>(c.expected->begin() + dim, c.expected->begin() + 2 * dim)));
  }
  VectorReader packed = open_ok(dir / "s-idx2-ubyte.gz");
  CHECK_FALSE(packed.seekable());
  auto refused = packed.seek(10);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().kind() == ErrorKind::Unsupported);
  CHECK_THAT(refused.error().message(), Contains("s-idx2-ubyte.gz") && Contains("gzip"));
  CHECK(read_all(packed, 64) == byte_values);  // and it still reads in order

  // After a failed read the reader is spent, and a moved-from one has nothing to seek.
  Bytes corrupt = read_file(dir / "s.fvecs");
  corrupt[9 * (4 + dim * sizeof(float))] = 6;  // record 9 claims dimension 6
  write_file(dir / "c.fvecs", corrupt);
  VectorReader spent = open_ok(dir / "c.fvecs");
  std::vector<float> all(rows * dim);
  REQUIRE_FALSE(spent.read(all, rows));
  auto after_failure = spent.seek(0);
  REQUIRE_FALSE(after_failure);
  CHECK(after_failure.error().kind() == ErrorKind::InvalidState);
  CHECK_THAT(after_failure.error().message(), Contains("earlier read failed") && Contains("record 9"));
  VectorReader taken = std::move(spent);
  auto moved = spent.seek(0);  // NOLINT: a moved-from reader
  REQUIRE_FALSE(moved);
  CHECK(moved.error().kind() == ErrorKind::InvalidState);
  CHECK_THAT(moved.error().message(), Contains("moved from"));
}

TEST_CASE("reads check their arguments and stop at the end", "[io]") {
  TempDir dir{"io"};
  auto path = dir / "v.fvecs";
  REQUIRE(write_fvecs(path, 3, 2, std::vector<float>{1, 2, 3, 4, 5, 6}));
  VectorReader reader = open_ok(path);
  std::vector<float> buffer(4);
  auto zero = reader.read(buffer, 0);
  REQUIRE_FALSE(zero);
  CHECK(zero.error().kind() == ErrorKind::InvalidInput);
  auto small = reader.read(std::span<float>(buffer).first(3), 2);
  REQUIRE_FALSE(small);
  CHECK(small.error().kind() == ErrorKind::InvalidInput);
  CHECK_THAT(small.error().message(), Contains("3 values"));
  // Argument errors do not spend the reader.
  CHECK(reader.read(buffer, 2) == 2u);
  CHECK(reader.rows_read() == 2);
  CHECK(buffer == std::vector<float>{1, 2, 3, 4});
  // Only what is left is needed room for.
  CHECK(reader.read(std::span<float>(buffer).first(2), 100) == 1u);
  CHECK(buffer[0] == 5.0f);
  CHECK(buffer[1] == 6.0f);
  CHECK(reader.read(buffer, 2) == 0u);
  CHECK(reader.read(std::span<float>{}, 2) == 0u);

  VectorReader moved = std::move(reader);
  CHECK(moved.rows() == 3);
  CHECK(reader.rows() == 0);  // NOLINT: a moved-from reader answers as an empty one
  auto from_moved = reader.read(buffer, 1);
  REQUIRE_FALSE(from_moved);
  CHECK(from_moved.error().kind() == ErrorKind::InvalidState);

  // An empty TEXMEX file has no rows (and so no dimension).
  REQUIRE(write_fvecs(dir / "e.fvecs", 0, 8, std::span<const float>{}));
  CHECK(fs::file_size(dir / "e.fvecs") == 0);
  VectorReader empty = open_ok(dir / "e.fvecs");
  CHECK(empty.rows() == 0);
  CHECK(empty.dim() == 0);
  CHECK(empty.read(buffer, 1) == 0u);
}

TEST_CASE("corrupt TEXMEX files are refused, naming the file and the record", "[io]") {
  TempDir dir{"io"};
  std::vector<float> four{1, 2, 3, 4};
  SECTION("dimension changes mid-file") {
    Bytes file;
    for (int i = 0; i < 3; ++i) put_record(file, 4, four);
    put_record(file, 5, four);  // claims 5 values, followed by a well-formed record
    put_record(file, 4, four);
    auto path = dir / "changing.fvecs";
    write_file(path, file);
    auto reader = VectorReader::open(path);
    REQUIRE(reader);
    CHECK(reader->rows() == 5);
    std::vector<float> buffer(5 * 4);
    CHECK(reader->read(buffer, 2) == 2u);  // rows before the bad record come through
    auto bad = reader->read(buffer, 3);
    REQUIRE_FALSE(bad);
    CHECK(bad.error().kind() == ErrorKind::InvalidInput);
    CHECK_THAT(bad.error().message(), Contains(path.string()) && Contains("record 3") &&
                                          Contains("dimension 5") && Contains("record 0 has 4") &&
                                          Contains("byte offset 60"));
    // The reader is spent after a failure.
    auto after = reader->read(buffer, 1);
    REQUIRE_FALSE(after);
    CHECK(after.error().kind() == ErrorKind::InvalidState);
    CHECK_THAT(after.error().message(), Contains("record 3"));
  }
  SECTION("a size that is not a whole number of records (truncated)") {
    Bytes file;
    for (int i = 0; i < 3; ++i) put_record(file, 4, four);
    file.resize(file.size() - 3);
    auto path = dir / "cut.fvecs";
    write_file(path, file);
    check_error(path, ErrorKind::InvalidInput, {"record 2", "57 bytes", "20-byte records", "17 bytes", "truncated"});
  }
  SECTION("trailing bytes after whole records") {
    Bytes file;
    for (int i = 0; i < 2; ++i) put_record(file, 4, std::vector<std::int32_t>{1, 2, 3, 4});
    file.push_back(0);
    auto path = dir / "tail.ivecs";
    write_file(path, file);
    check_error(path, ErrorKind::InvalidInput, {"record 2", "41 bytes"});
  }
  SECTION("zero, negative and huge dimensions") {
    Bytes zero;
    put_record(zero, 0, std::vector<float>{});
    write_file(dir / "zero.fvecs", zero);
    check_error(dir / "zero.fvecs", ErrorKind::InvalidInput, {"record 0", "dimension 0"});
    Bytes negative;
    put_record(negative, -3, four);
    write_file(dir / "negative.bvecs", negative);
    check_error(dir / "negative.bvecs", ErrorKind::InvalidInput, {"record 0", "dimension -3"});
    Bytes huge;
    put_record(huge, 0x7fffffff, four);
    write_file(dir / "huge.fvecs", huge);
    check_error(dir / "huge.fvecs", ErrorKind::InvalidInput, {"record 0", "dimension 2147483647", "20 B"});
  }
  SECTION("too short for a dimension") {
    write_file(dir / "tiny.ivecs", {1, 0});
    check_error(dir / "tiny.ivecs", ErrorKind::InvalidInput, {"2 bytes", "record 0"});
  }
  SECTION("missing files and directories") {
    check_error(dir / "absent.fvecs", ErrorKind::Io, {"No such file"});
    fs::create_directory(dir / "folder.fvecs");
    check_error(dir / "folder.fvecs", ErrorKind::InvalidInput, {"not a regular file"});
  }
}

TEST_CASE("corrupt IDX files are refused", "[io]") {
  TempDir dir{"io"};
  Bytes payload = iota_bytes(3 * 4);
  SECTION("bad magic") {
    Bytes file = idx_file(0x08, {3, 4}, payload);
    file[0] = 0x12;
    write_file(dir / "m.idx", file);
    check_error(dir / "m.idx", ErrorKind::InvalidInput, {"magic", "0x12"});
  }
  SECTION("unsupported and unknown types") {
    write_file(dir / "f.idx", idx_file(0x0D, {3, 1}, Bytes(12)));
    check_error(dir / "f.idx", ErrorKind::Unsupported, {"0x0d", "float32", "0x08"});
    write_file(dir / "u.idx", idx_file(0x42, {3, 4}, payload));
    check_error(dir / "u.idx", ErrorKind::InvalidInput, {"0x42"});
  }
  SECTION("no dimensions, or rows of zero values") {
    write_file(dir / "n.idx", idx_file(0x08, {}, {}));
    check_error(dir / "n.idx", ErrorKind::InvalidInput, {"number of dimensions"});
    write_file(dir / "z.idx", idx_file(0x08, {3, 0, 4}, {}));
    check_error(dir / "z.idx", ErrorKind::InvalidInput, {"3 x 0 x 4"});
  }
  SECTION("truncated header") {
    Bytes file = idx_file(0x08, {3, 4}, {});
    file.resize(9);
    write_file(dir / "h.idx", file);
    check_error(dir / "h.idx", ErrorKind::InvalidInput, {"truncated IDX header"});
    write_file(dir / "h2.idx", {0, 0});
    check_error(dir / "h2.idx", ErrorKind::InvalidInput, {"2 bytes"});
  }
  SECTION("payload too short or too long, plain") {
    Bytes short_payload(payload.begin(), payload.end() - 5);
    write_file(dir / "s.idx", idx_file(0x08, {3, 4}, short_payload));
    check_error(dir / "s.idx", ErrorKind::InvalidInput, {"too short", "item 1", "3 x 4", "truncated"});
    Bytes long_payload = payload;
    long_payload.push_back(1);
    write_file(dir / "l.idx", idx_file(0x08, {3, 4}, long_payload));
    check_error(dir / "l.idx", ErrorKind::InvalidInput, {"too long", "1 extra"});
  }
  SECTION("payload too short or too long, gzip") {
    Bytes short_payload(payload.begin(), payload.end() - 5);
    write_file(dir / "s.idx.gz", gzip(idx_file(0x08, {3, 4}, short_payload)));
    check_error(dir / "s.idx.gz", ErrorKind::InvalidInput, {"shorter", "item 1"});
    Bytes long_payload = payload;
    long_payload.push_back(1);
    write_file(dir / "l.idx.gz", gzip(idx_file(0x08, {3, 4}, long_payload)));
    check_error(dir / "l.idx.gz", ErrorKind::InvalidInput, {"longer", "1 more bytes"});
    write_file(dir / "e.idx.gz", gzip(idx_file(0x08, {0, 4}, {7})));
    check_error(dir / "e.idx.gz", ErrorKind::InvalidInput, {"longer"});
    // More than the compressed size can hold: refused at open, before any reading.
    write_file(dir / "big.idx.gz", gzip(idx_file(0x08, {60000, 28, 28}, payload)));
    auto big = VectorReader::open(dir / "big.idx.gz");
    REQUIRE_FALSE(big);
    CHECK_THAT(big.error().message(), Contains("60000 x 28 x 28") && Contains("deflate"));
  }
  SECTION("corrupt and cut gzip data") {
    Bytes data = idx_file(0x08, {100, 50}, iota_bytes(5000));
    Bytes packed = gzip(data);
    Bytes corrupt = packed;
    corrupt[packed.size() - 6] ^= 0xff;  // inside the CRC32 trailer
    write_file(dir / "crc.idx.gz", corrupt);
    check_error(dir / "crc.idx.gz", ErrorKind::InvalidInput, {"corrupt gzip data", "zlib"});
    Bytes garbage = packed;
    garbage[10] = 0xff;  // first deflate block: final, of the reserved type 3
    write_file(dir / "bad.idx.gz", garbage);
    check_error(dir / "bad.idx.gz", ErrorKind::InvalidInput, {"gzip"});
    Bytes cut(packed.begin(), packed.begin() + static_cast<std::ptrdiff_t>(packed.size() / 2));
    write_file(dir / "cut.idx.gz", cut);
    check_error(dir / "cut.idx.gz", ErrorKind::InvalidInput, {"cut short", "truncated"});
    // Data after the gzip member (which gzread would skip) is refused, its offset named.
    Bytes trailing = packed;
    for (std::uint8_t b : {0x00, 0x42, 0x13}) trailing.push_back(b);
    write_file(dir / "tail.idx.gz", trailing);
    check_error(dir / "tail.idx.gz", ErrorKind::InvalidInput,
                {"3 bytes of other data follow the gzip data", "from byte " + std::to_string(packed.size())});
    Bytes one_byte = packed;
    one_byte.push_back(0x1f);  // half of a gzip magic: not a member either
    write_file(dir / "half.idx.gz", one_byte);
    check_error(dir / "half.idx.gz", ErrorKind::InvalidInput, {"1 bytes of other data"});
  }
  SECTION("gzip members one after another read as one stream") {
    Bytes data = idx_file(0x08, {100, 50}, iota_bytes(5000));
    const std::size_t half = 2003;  // inside a row
    Bytes joined = gzip(Bytes(data.begin(), data.begin() + half));
    Bytes second = gzip(Bytes(data.begin() + half, data.end()));
    joined.insert(joined.end(), second.begin(), second.end());
    write_file(dir / "two.idx.gz", joined);
    auto reader = VectorReader::open(dir / "two.idx.gz");
    REQUIRE(reader);
    std::vector<std::uint8_t> rows(5000);
    auto got = reader->read_stored(std::as_writable_bytes(std::span(rows)), 100);
    REQUIRE(got);
    CHECK(*got == 100);
    CHECK(Bytes(rows.begin(), rows.end()) == iota_bytes(5000));
  }
}

TEST_CASE("corrupt and unsupported npy files are refused", "[io]") {
  TempDir dir{"io"};
  Bytes six(6 * 4, 0);
  auto npy = [&](const std::string& name, const std::string& dict, const Bytes& payload) {
    write_file(dir / name, npy_file(dict, payload));
    return dir / name;
  };
  check_error(npy("magic.npy", "", {}), ErrorKind::InvalidInput, {});  // header too short for a dict
  Bytes not_npy{'P', 'K', 3, 4, 0, 0, 0, 0, 0, 0, 0, 0};
  write_file(dir / "zip.npy", not_npy);
  check_error(dir / "zip.npy", ErrorKind::InvalidInput, {"not a .npy file"});
  check_error(npy("garbage.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), ", six),
              ErrorKind::InvalidInput, {"bad .npy header"});
  check_error(npy("nokey.npy", "{'descr': '<f4', 'shape': (2, 3)}", six), ErrorKind::InvalidInput,
              {"no 'fortran_order'"});
  check_error(npy("extra.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'x': 1}", six),
              ErrorKind::InvalidInput, {"unexpected key 'x'"});
  check_error(npy("f8.npy", "{'descr': '<f8', 'fortran_order': False, 'shape': (1, 3), }", six),
              ErrorKind::Unsupported, {"'<f8'", "<f4"});
  check_error(npy("be.npy", "{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }", six),
              ErrorKind::Unsupported, {"big-endian"});
  check_error(npy("rec.npy", "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (6,), }", six),
              ErrorKind::Unsupported, {"structured"});
  check_error(npy("fortran.npy", "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", six),
              ErrorKind::Unsupported, {"Fortran"});
  check_error(npy("3d.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2, 3), }", six),
              ErrorKind::InvalidInput, {"3 dimensions", "(1, 2, 3)", "2-D"});
  check_error(npy("1d.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (6,), }", six),
              ErrorKind::InvalidInput, {"1 dimensions", "(6,)", "reshape"});
  check_error(npy("zero.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (6, 0), }", {}),
              ErrorKind::InvalidInput, {"(6, 0)"});
  check_error(npy("short.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 3), }", six),
              ErrorKind::InvalidInput, {"truncated", "row 2", "36 bytes"});
  check_error(npy("long.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 3), }", six),
              ErrorKind::InvalidInput, {"12 extra"});
  check_error(npy("huge.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999, 1000), }", six),
              ErrorKind::InvalidInput, {"too large"});
  Bytes v9 = npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", six);
  v9[6] = 9;
  write_file(dir / "v9.npy", v9);
  check_error(dir / "v9.npy", ErrorKind::Unsupported, {"version 9.0"});
}

TEST_CASE("the Fashion-MNIST test images read as IDX match an independent zlib read", "[io]") {
  const fs::path images = "/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz";
  INFO("tools/setup.sh installs the Debian package dataset-fashion-mnist");
  REQUIRE(fs::exists(images));
  VectorReader reader = open_ok(images);
  REQUIRE(reader.rows() == 10000);
  REQUIRE(reader.dim() == 784);
  std::vector<float> ours = read_all(reader, 1234);
  REQUIRE(ours.size() == 10000u * 784u);

  gzFile raw = gzopen(images.c_str(), "rb");
  REQUIRE(raw != nullptr);
  Bytes expected(16 + 10000 * 784 + 1);
  int got = gzread(raw, expected.data(), static_cast<unsigned>(expected.size()));
  gzclose(raw);
  REQUIRE(got == 16 + 10000 * 784);
  CHECK(expected[2] == 0x08);
  CHECK(expected[3] == 3);
  for (std::size_t i = 0; i < 784 * 3; ++i) {  // the first three images, pixel by pixel
    if (ours[i] != static_cast<float>(expected[16 + i])) FAIL("pixel " << i << " differs");
  }
  CHECK(std::equal(ours.begin(), ours.end(), expected.begin() + 16,
                   [](float a, std::uint8_t b) { return a == static_cast<float>(b); }));
  CHECK(*std::max_element(ours.begin(), ours.end()) == 255.0f);

  VectorReader labels = open_ok("/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz");
  CHECK(labels.rows() == 10000);
  CHECK(labels.dim() == 1);
  std::vector<std::int32_t> classes = read_all_ints(labels, 10000);
  CHECK(*std::max_element(classes.begin(), classes.end()) == 9);
  CHECK(std::count(classes.begin(), classes.end(), 0) == 1000);  // the test set is balanced
}

TEST_CASE("the writers are atomic: a failure leaves no file behind", "[io]") {
  TempDir dir{"io"};
  std::vector<float> values{1, 2, 3, 4};
  auto in_missing = dir / "no-such-dir" / "out.fvecs";
  for (auto result : {write_fvecs(in_missing, 2, 2, values), write_npy(in_missing, 2, 2, values),
                      write_ivecs(in_missing, 1, 4, std::vector<std::int32_t>{1, 2, 3, 4})}) {
    REQUIRE_FALSE(result);
    CHECK(result.error().kind() == ErrorKind::Io);
    CHECK_THAT(result.error().message(), Contains(in_missing.string()) && Contains("directory exist"));
  }
  CHECK_FALSE(fs::exists(dir / "no-such-dir"));
  CHECK(fs::is_empty(dir.path()));

  // A failure after the temporary file exists (the target is a directory): nothing is left.
  fs::create_directory(dir / "taken.npy");
  auto over_dir = write_npy(dir / "taken.npy", 2, 2, values);
  REQUIRE_FALSE(over_dir);
  CHECK_THAT(over_dir.error().message(), Contains("renaming"));
  std::size_t entries = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(dir.path())) ++entries;
  CHECK(entries == 1);

  // A bad shape leaves an existing file as it was.
  auto existing = dir / "keep.fvecs";
  REQUIRE(write_fvecs(existing, 2, 2, values));
  Bytes before = read_file(existing);
  auto mismatch = write_fvecs(existing, 3, 2, values);
  REQUIRE_FALSE(mismatch);
  CHECK(mismatch.error().kind() == ErrorKind::InvalidInput);
  CHECK_THAT(mismatch.error().message(), Contains("6 values") && Contains("4 were given"));
  CHECK(read_file(existing) == before);
  auto zero_dim = write_ivecs(existing, 0, 0, std::span<const std::int32_t>{});
  REQUIRE_FALSE(zero_dim);
  CHECK_THAT(zero_dim.error().message(), Contains("dimension 0"));
  // And a successful write replaces it whole.
  REQUIRE(write_fvecs(existing, 1, 4, values));
  VectorReader reader = open_ok(existing);
  CHECK(reader.rows() == 1);
  CHECK(reader.dim() == 4);
  entries = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(dir.path())) ++entries;
  CHECK(entries == 2);  // taken.npy/ and keep.fvecs: no temporary files
}
