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

double offset_norm2_max(const ValueStats& stats, std::int32_t offset, std::size_t dim) noexcept {
  if (offset == 0) return stats.max_norm2;
  const double m = max_abs_with(stats, offset);
  return static_cast<double>(dim) * m * m;
}

double error_bound(const Arithmetic& a, Metric metric, std::size_t dim, double query_norm2,
                   double row_norm2_max) noexcept {
  const double q = std::sqrt(query_norm2), x = std::sqrt(row_norm2_max);
  const double c = (4.0 * static_cast<double>(dim) + 128.0) * kUnit;
  if (a.exact_sums) {
    // Dot products and norms are exact fp32 integers; what is left is the epilogue's roundings
    // of numbers no larger than ‖q‖² + ‖x‖² + 2‖q‖‖x‖: none while that stays below 2^24.
    if (metric == Metric::Cosine) return 16 * kUnit;
    const double largest = metric == Metric::L2 ? (q + x) * (q + x) : q * x;
    return largest < kFp32Exact ? 0.0 : 4 * ulp(largest);
  }
  switch (metric) {
    case Metric::L2: return c * (q + x) * (q + x);
    case Metric::InnerProduct: return c * q * x + 4 * kUnit * q * x;
    case Metric::Cosine: return 2 * c + 16 * kUnit;
  }
  return c * (q + x) * (q + x);
}

}  // namespace gpupool::exact
