// Test support: writes small vector files of every format the readers take, byte by byte, so the
// knn job and the gpupool command can be tested on real files without the library's writers.
#pragma once
#include <bit>
#include <cstdint>
#include <random>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>
#include <zlib.h>

namespace gpupool::test {

using Bytes = std::vector<std::uint8_t>;

inline void put_u32_le(Bytes& out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}
inline void put_u32_be(Bytes& out, std::uint32_t v) {
  for (int i = 3; i >= 0; --i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}

inline void write_bytes(const std::filesystem::path& path, const Bytes& bytes) {
  std::ofstream file(path, std::ios::binary);
  file.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

inline Bytes read_bytes(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
}

inline void write_gzip(const std::filesystem::path& path, const Bytes& bytes) {
  gzFile file = gzopen(path.c_str(), "wb");
  gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(file);
}

// TEXMEX: every record is an int32 dimension and `dim` values of the element's bytes.
template <class T>
Bytes texmex_bytes(const std::vector<T>& values, std::size_t dim) {
  Bytes out;
  for (std::size_t r = 0; r < values.size() / dim; ++r) {
    put_u32_le(out, static_cast<std::uint32_t>(dim));
    const auto* first = reinterpret_cast<const std::uint8_t*>(values.data() + r * dim);
    out.insert(out.end(), first, first + dim * sizeof(T));
  }
  return out;
}

// IDX unsigned bytes as rows × 2 × (dim / 2) images (dim even): one row = dim values.
inline Bytes idx_bytes(const std::vector<std::uint8_t>& values, std::size_t dim) {
  Bytes out;
  put_u32_be(out, 0x00000803u);
  put_u32_be(out, static_cast<std::uint32_t>(values.size() / dim));
  put_u32_be(out, 2);
  put_u32_be(out, static_cast<std::uint32_t>(dim / 2));
  out.insert(out.end(), values.begin(), values.end());
  return out;
}

// .npy version 1.0 with dtype `descr` ("<f4", "<f2", "|u1", "|i1", "<i4"), C order.
template <class T>
Bytes npy_bytes(const std::vector<T>& values, std::size_t dim, const std::string& descr) {
  std::string header = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (" +
                       std::to_string(values.size() / dim) + ", " + std::to_string(dim) + "), }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  Bytes out{0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  out.push_back(static_cast<std::uint8_t>(header.size() & 0xff));
  out.push_back(static_cast<std::uint8_t>(header.size() >> 8));
  out.insert(out.end(), header.begin(), header.end());
  const auto* first = reinterpret_cast<const std::uint8_t*>(values.data());
  out.insert(out.end(), first, first + values.size() * sizeof(T));
  return out;
}

// rows × dim values in [-1, 1]. With `spread`, magnitudes spread over 2^-24..1 (log-uniform) and
// every block of 100 rows twice as large as the one before: the fast mode's fp16 scaling, chosen
// per block from its largest value, then decides which small values fall below fp16's normal
// range — a row's fp16 distance depends on the block it is computed in.
inline std::vector<float> random_rows(std::size_t rows, std::size_t dim, std::uint64_t seed, bool spread) {
  std::mt19937_64 random(seed);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f), exponent(-24.0f, 0.0f);
  std::vector<float> out(rows * dim);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t d = 0; d < dim; ++d)
      out[r * dim + d] = spread ? std::copysign(std::exp2(exponent(random)), value(random)) *
                                      std::ldexp(1.0f, static_cast<int>(r / 100))
                                : value(random);
  return out;
}

}  // namespace gpupool::test
