// Test support: convert_stored on any device against a host model, for every stored element and
// output precision — shared by the simulated device's suite and the [gpu] one. Outputs are
// poisoned first; inputs are fresh random values (whole numbers in range, fractions, extremes).
// Include after `import gpupool;`.
#pragma once
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <utility>
#include <vector>

namespace gpupool::test {

// What convert_stored must give for value v (+ offset) scaled by 2^exponent in `out`, as fp64.
inline double stored_model(double v, std::int32_t exponent, Precision out) {
  const float scaled = std::scalbn(static_cast<float>(v), exponent);
  switch (out) {
    case Precision::Int8:
      return std::isnan(scaled) ? 0.0 : std::clamp(std::round(double{scaled}), -128.0, 127.0);
    case Precision::Fp16: return to_float(to_half(scaled));
    case Precision::Bf16: return to_float(to_bfloat16(scaled));
    default: return scaled;
  }
}

inline double read_converted(const std::vector<std::byte>& bytes, std::size_t i, Precision p) {
  if (p == Precision::Int8) return static_cast<std::int8_t>(std::to_integer<std::uint8_t>(bytes[i]));
  if (p == Precision::Fp32) {
    float f;
    std::memcpy(&f, bytes.data() + 4 * i, 4);
    return f;
  }
  std::uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  return p == Precision::Fp16 ? to_float(Half{h}) : to_float(BFloat16{h});
}

inline void check_convert_stored(GpuMemoryPool& pool, const Device& device) {
  std::mt19937 rng(std::random_device{}());
  const std::size_t count = 3001;  // odd: the kernel's last group of values is partial
  for (StoredElement element : {StoredElement::UInt8, StoredElement::Int8, StoredElement::Fp16,
                                StoredElement::Fp32}) {
    // Stored values: random bytes, or floats mixing whole numbers, fractions and extremes.
    std::vector<std::byte> stored(count * stored_size(element));
    std::vector<double> values(count);
    std::uniform_int_distribution<int> byte(0, 255);
    std::uniform_real_distribution<float> real(-300.0f, 300.0f);
    for (std::size_t i = 0; i < count; ++i) {
      if (element == StoredElement::UInt8 || element == StoredElement::Int8) {
        stored[i] = static_cast<std::byte>(byte(rng));
        values[i] = element == StoredElement::UInt8
                        ? std::to_integer<std::uint8_t>(stored[i])
                        : static_cast<std::int8_t>(std::to_integer<std::uint8_t>(stored[i]));
        continue;
      }
      float f = i % 3 == 0 ? std::round(real(rng)) : real(rng);
      if (i == 7) f = std::numeric_limits<float>::quiet_NaN();
      if (i == 8) f = 1e6f;
      if (element == StoredElement::Fp16) {
        const std::uint16_t h = to_half(f).bits;
        std::memcpy(stored.data() + 2 * i, &h, 2);
        values[i] = to_float(Half{h});
      } else {
        std::memcpy(stored.data() + 4 * i, &f, 4);
        values[i] = f;
      }
    }
    auto in = pool.get_managed_buffer(device, stored.size(), Precision::Bytes);
    REQUIRE(in);
    REQUIRE(in->upload(std::span<const std::byte>(stored)));
    for (Precision out_precision : {Precision::Fp32, Precision::Fp16, Precision::Bf16, Precision::Int8})
      for (auto [offset, exponent] : {std::pair{0, 0}, {-128, 0}, {1000, 0}, {0, -140}, {0, 100},
                                      {-128, -3}}) {
        CAPTURE(to_string(element), to_string(out_precision), offset, exponent);
        auto out = pool.get_managed_buffer(device, count, out_precision);
        REQUIRE(out);
        std::vector<std::byte> poison(out->size_bytes(), std::byte{0xff});
        REQUIRE(out->upload(std::span<const std::byte>(poison)));
        REQUIRE(convert_stored(*in, *out,
                               {.element = element, .offset = offset, .exponent = exponent}));
        std::vector<std::byte> got(out->size_bytes());
        REQUIRE(out->download(std::span<std::byte>(got)));
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < count; ++i) {
          const double want = stored_model(values[i] + offset, exponent, out_precision);
          const double have = read_converted(got, i, out_precision);
          if (!(have == want || (std::isnan(have) && std::isnan(want)))) ++wrong;
        }
        CHECK(wrong == 0);
      }
  }
  // Bad arguments name themselves.
  auto in = pool.get_managed_buffer(device, 6, Precision::Bytes);
  auto small = pool.get_managed_buffer(device, 2, Precision::Fp32);
  auto bytes = pool.get_managed_buffer(device, 8, Precision::Bytes);
  REQUIRE((in && small && bytes));
  auto too_small = convert_stored(*in, *small, {.element = StoredElement::UInt8});
  REQUIRE_FALSE(too_small);
  CHECK(too_small.error().kind() == ErrorKind::InvalidInput);
  CHECK_FALSE(convert_stored(*in, *bytes, {.element = StoredElement::UInt8}));
  auto odd = convert_stored(*in, *small, {.element = StoredElement::Fp32});
  REQUIRE_FALSE(odd);
  CHECK(odd.error().message().find("6 bytes") != std::string::npos);
  CHECK_FALSE(convert_stored(*in, *small, {.element = StoredElement::UInt8, .offset = 1 << 25}));
  auto steep = convert_stored(*in, *small, {.element = StoredElement::UInt8, .exponent = 600});
  REQUIRE_FALSE(steep);
  CHECK(steep.error().message().find("exponent 600") != std::string::npos);
}

}  // namespace gpupool::test
