// The device arithmetic of a chunk and its error bound (see arithmetic.hpp).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include "arithmetic.hpp"

namespace gpupool::exact {

namespace {

constexpr double kFp32Exact = 16777216.0;  // 2^24: integers below it are exact in fp32
constexpr double kUnit = 0x1p-24;          // fp32's unit roundoff
constexpr int kRangeTop = 7;               // range_exponent's target: [2^(top-1), 2^top)
// What one value, product or split part that falls below fp32's normal range can be off by on
// the device, in the device's units, per unit of the largest magnitude there (a 3xTF32 small
// part that vanishes costs up to 2^-126 times the part beside it), doubled.
constexpr double kVanishing = 0x1p-125;

bool fits(const ValueStats& s, double lo, double hi) noexcept {
  return s.rows == 0 || (s.min >= lo && s.max <= hi);
}

double max_abs_with(const ValueStats& s, std::int32_t offset) noexcept {
  if (s.rows == 0) return 0;
  return std::max(std::fabs(s.min + offset), std::fabs(s.max + offset));
}

// fp32's spacing at `magnitude`.
double ulp(double magnitude) noexcept {
  int exponent = 0;
  std::frexp(std::max(magnitude, 1.0), &exponent);
  return std::ldexp(1.0, exponent - 24);
}

}  // namespace

std::string_view describe(const Arithmetic& a) noexcept {
  if (!a.integer) return "fp32 (error-bounded, fp64 re-rank)";
  if (a.precision == Precision::Int8)
    return a.offset != 0 ? "int8 tensor cores (uint8 shifted by -128), exact sums"
           : a.exact_sums ? "int8 tensor cores, exact sums" : "int8 tensor cores";
  return a.exact_sums ? "fp16 on whole numbers, exact sums" : "fp16 on whole numbers";
}

Arithmetic exact_arithmetic(const ValueStats& queries, const ValueStats& chunk, Metric metric,
                            std::size_t dim) noexcept {
  Arithmetic a;
  if (!queries.integer || !chunk.integer || !queries.finite || !chunk.finite) return a;
  if (fits(queries, -128, 127) && fits(chunk, -128, 127)) {
    a = {Precision::Int8, 0, true, false};
  } else if (metric == Metric::L2 && fits(queries, 0, 255) && fits(chunk, 0, 255)) {
    a = {Precision::Int8, -128, true, false};
  } else if (fits(queries, -2048, 2048) && fits(chunk, -2048, 2048)) {
    a = {Precision::Fp16, 0, true, false};
  } else {
    return a;  // whole numbers too large for the exact forms: fp32 with its bound
  }
  const double d = static_cast<double>(dim);
  const double q = max_abs_with(queries, a.offset), x = max_abs_with(chunk, a.offset);
  a.exact_sums = d * std::max({q * x, q * q, x * x}) < kFp32Exact;
  return a;
}

std::int32_t range_exponent(const ValueStats& queries, const ValueStats& chunk) noexcept {
  const double m = std::max(queries.max_abs(), chunk.max_abs());
  if (!(m > 0) || !std::isfinite(m)) return 0;
  int exponent = 0;
  std::frexp(m, &exponent);  // m in [2^(exponent-1), 2^exponent)
  return kRangeTop - exponent;
}

double distance_unit(const Arithmetic& a, Metric metric) noexcept {
  return metric == Metric::Cosine ? 1.0 : std::ldexp(1.0, -2 * a.exponent);
}

double offset_norm2_max(const ValueStats& stats, std::int32_t offset, std::size_t dim) noexcept {
  if (offset == 0) return stats.max_norm2;
  const double m = max_abs_with(stats, offset);
  return static_cast<double>(dim) * m * m;
}

double offset_norm2_min(const ValueStats& stats, std::int32_t offset) noexcept {
  return offset == 0 ? stats.min_norm2 : 1.0;  // offsets only move whole numbers
}

double error_bound(const Arithmetic& a, Metric metric, std::size_t dim,
                   const BoundNorms& norms) noexcept {
  const double q = std::sqrt(norms.query_norm2), x = std::sqrt(norms.row_norm2_max);
  const double c = (4.0 * static_cast<double>(dim) + 128.0) * kUnit;
  if (a.exact_sums) {
    // Dot products and norms are exact fp32 integers; what is left is the epilogue's roundings
    // of numbers no larger than ‖q‖² + ‖x‖² + 2‖q‖‖x‖: none while that stays below 2^24.
    if (metric == Metric::Cosine) return 16 * kUnit;
    const double largest = metric == Metric::L2 ? (q + x) * (q + x) : q * x;
    return largest < kFp32Exact ? 0.0 : 4 * ulp(largest);
  }
  // Whole numbers never fall below fp32's normal range; scaled values, their products and split
  // parts may: up to kVanishing each, (4D + 128) of them in a distance, in device units.
  const double largest = std::max(1.0, std::ldexp(norms.largest, a.exponent));
  const double vanishing =
      a.integer ? 0.0 : (4.0 * static_cast<double>(dim) + 128.0) * kVanishing * largest;
  const double device_units = std::ldexp(1.0, 2 * a.exponent);  // a device norm² per data norm²
  switch (metric) {
    case Metric::L2: return c * (q + x) * (q + x) + vanishing / device_units;
    case Metric::InnerProduct: return c * q * x + 4 * kUnit * q * x + vanishing / device_units;
    case Metric::Cosine: {
      // A dot product off by v moves the cosine by v / (‖q‖‖x‖), a norm² off by v by about
      // v / ‖·‖²: taken at the smallest non-zero row (zero rows and queries are exact on the
      // device).
      double relative = 0;
      const double q2 = norms.query_norm2 * device_units, x2 = norms.row_norm2_min * device_units;
      if (q2 > 0 && std::isfinite(x2)) relative = 1 / std::sqrt(q2 * x2) + 1 / q2 + 1 / x2;
      else if (q2 > 0) relative = 1 / q2;
      return 2 * c + 16 * kUnit + 2 * vanishing * relative;
    }
  }
  return c * (q + x) * (q + x);
}

}  // namespace gpupool::exact
