// Stored rows, their scan and the fp64 distances (see stored_rows.hpp).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define GPUPOOL_SCAN_AVX2 1
#else
#define GPUPOOL_SCAN_AVX2 0
#endif
#include "parallel.hpp"
#include "stored_rows.hpp"

namespace gpupool::exact {

namespace {

double half_value(std::uint16_t h) noexcept {
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  double magnitude = exponent == 0    ? std::ldexp(static_cast<double>(mantissa), -24)
                     : exponent == 31 ? (mantissa ? std::numeric_limits<double>::quiet_NaN()
                                                  : std::numeric_limits<double>::infinity())
                                      : std::ldexp(static_cast<double>(mantissa + 1024), exponent - 25);
  return (h & 0x8000) ? -magnitude : magnitude;
}

// Whether v is a whole number, without a call (std::nearbyint is one on baseline x86-64, and cost
// the scan 5× its time): magnitudes from 2^23 up are whole in the fp16 / fp32 values scanned,
// smaller ones survive truncation exactly. NaN and ±inf come out whole: the finite test catches
// them.
inline bool whole(double v) noexcept {
  return !(std::fabs(v) < 0x1p23) || static_cast<double>(static_cast<std::int32_t>(v)) == v;
}

// A scan's figures, folded in row by row: scan_with and scan_fp32_avx2 give each row's lanes to
// it the same way, so their figures agree to the bit.
class ScanTotals {
 public:
  // Row r: the sum of its squares, its extremes (NaN when a NaN value ended up there) and
  // whether every value is whole.
  void add_row(std::size_t r, double norm2, double row_lo, double row_hi, bool row_integer) noexcept {
    // NaN fails every comparison and ±inf makes the norm infinite: one test per row.
    if (s_.finite && !(std::isfinite(norm2) && row_lo == row_lo && row_hi == row_hi)) {
      s_.finite = false;
      s_.first_nonfinite_row = r;
    }
    integer_ &= row_integer;
    lo_ = std::min(lo_, row_lo);
    hi_ = std::max(hi_, row_hi);
    max_norm2_ = std::max(max_norm2_, norm2);
    if (norm2 > 0) min_norm2_ = std::min(min_norm2_, norm2);
  }
  ValueStats finish(std::size_t rows) noexcept {
    s_.rows = rows;
    s_.integer = integer_ && s_.finite;
    s_.min = lo_;
    s_.max = hi_;
    // The fp64 sums are rounded: a relative 2^-40 over covers any dim this job takes.
    s_.max_norm2 = max_norm2_ * (1 + 0x1p-40);
    s_.min_norm2 = min_norm2_ * (1 - 0x1p-40);
    return s_;
  }

 private:
  static constexpr double kInf = std::numeric_limits<double>::infinity();
  ValueStats s_;
  bool integer_ = true;
  double lo_ = kInf, hi_ = -kInf, max_norm2_ = 0, min_norm2_ = kInf;
};

// Scans values of one type: per-lane sums, extremes and integrality over kLanes interleaved
// columns, which the compiler vectorises (one fp64 sum chained over a row ran at 0.8 GB/s a
// thread; the lanes at 4.4 GB/s) — the reading threads scan every float block as they read it.
template <class Load>
ValueStats scan_with(const StoredRows& rows, Load load) noexcept {
  constexpr std::size_t kLanes = 8;
  constexpr double kInf = std::numeric_limits<double>::infinity();
  ScanTotals totals;
  for (std::size_t r = 0; r < rows.rows; ++r) {
    const std::size_t first = r * rows.dim;
    double sums[kLanes] = {}, lows[kLanes], highs[kLanes];
    bool wholes[kLanes];
    for (std::size_t l = 0; l < kLanes; ++l) lows[l] = kInf, highs[l] = -kInf, wholes[l] = true;
    auto take = [&](std::size_t lane, double v) {
      sums[lane] += v * v;
      wholes[lane] &= whole(v);
      lows[lane] = lows[lane] < v ? lows[lane] : v;  // NaN goes in: the finite test below sees it
      highs[lane] = highs[lane] > v ? highs[lane] : v;
    };
    std::size_t c = 0;
    for (; c + kLanes <= rows.dim; c += kLanes)
      for (std::size_t l = 0; l < kLanes; ++l) take(l, load(first + c + l));
    for (; c < rows.dim; ++c) take(0, load(first + c));
    double norm2 = 0, row_lo = kInf, row_hi = -kInf;
    bool row_integer = true;
    for (std::size_t l = 0; l < kLanes; ++l) {
      norm2 += sums[l];
      row_integer &= wholes[l];
      row_lo = row_lo < lows[l] ? row_lo : lows[l];
      row_hi = row_hi > highs[l] ? row_hi : highs[l];
    }
    totals.add_row(r, norm2, row_lo, row_hi, row_integer);
  }
  return totals.finish(rows.rows);
}

#if GPUPOOL_SCAN_AVX2
// scan_with for fp32 rows with AVX2: the same eight lanes, the same order of fp64 sums and the
// same comparisons, so the same figures to the bit, with each lane's extremes and integrality
// kept in fp32 (exact: fp32 → fp64 is monotonic and exact, and a value below 2^23 in magnitude is
// whole when its int32 truncation gives it back). The reading threads scan every fp32 block as
// they read it; at baseline x86-64 width the scan took 60% of their time.
[[gnu::target("avx2")]] ValueStats scan_fp32_avx2(const float* values, std::size_t rows,
                                                  std::size_t dim) noexcept {
  constexpr std::size_t kLanes = 8;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 two_23 = _mm256_set1_ps(0x1p23f);
  const __m256 all_set = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  ScanTotals totals;
  for (std::size_t r = 0; r < rows; ++r) {
    const float* row = values + r * dim;
    __m256d sums_low = _mm256_setzero_pd(), sums_high = _mm256_setzero_pd();
    __m256 lows = _mm256_set1_ps(kInf), highs = _mm256_set1_ps(-kInf), wholes = all_set;
    std::size_t c = 0;
    for (; c + kLanes <= dim; c += kLanes) {
      const __m256 v = _mm256_loadu_ps(row + c);
      const __m256d v_low = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
      const __m256d v_high = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
      sums_low = _mm256_add_pd(sums_low, _mm256_mul_pd(v_low, v_low));  // no FMA: scan_with's rounding
      sums_high = _mm256_add_pd(sums_high, _mm256_mul_pd(v_high, v_high));
      lows = _mm256_blendv_ps(v, lows, _mm256_cmp_ps(lows, v, _CMP_LT_OQ));
      highs = _mm256_blendv_ps(v, highs, _mm256_cmp_ps(highs, v, _CMP_GT_OQ));
      // Whole: not below 2^23 in magnitude (NaN and ±inf too: the finite test catches them), or
      // given back by truncation, which only values below 2^23 take.
      const __m256 small = _mm256_cmp_ps(_mm256_and_ps(v, magnitude), two_23, _CMP_LT_OQ);
      const __m256 truncated = _mm256_cvtepi32_ps(_mm256_cvttps_epi32(_mm256_and_ps(v, small)));
      const __m256 not_small = _mm256_andnot_ps(small, all_set);
      wholes = _mm256_and_ps(wholes, _mm256_or_ps(not_small, _mm256_cmp_ps(truncated, v, _CMP_EQ_OQ)));
    }
    alignas(32) double sums[kLanes];
    alignas(32) float row_lows[kLanes], row_highs[kLanes];
    _mm256_store_pd(sums, sums_low);
    _mm256_store_pd(sums + 4, sums_high);
    _mm256_store_ps(row_lows, lows);
    _mm256_store_ps(row_highs, highs);
    bool row_integer = _mm256_movemask_ps(wholes) == 0xff;
    for (; c < dim; ++c) {  // the tail goes to lane 0, as in scan_with
      const float v = row[c];
      sums[0] += static_cast<double>(v) * static_cast<double>(v);
      row_integer &= whole(v);
      row_lows[0] = row_lows[0] < v ? row_lows[0] : v;
      row_highs[0] = row_highs[0] > v ? row_highs[0] : v;
    }
    double norm2 = 0;
    float row_lo = kInf, row_hi = -kInf;
    for (std::size_t l = 0; l < kLanes; ++l) {
      norm2 += sums[l];
      row_lo = row_lo < row_lows[l] ? row_lo : row_lows[l];
      row_hi = row_hi > row_highs[l] ? row_hi : row_highs[l];
    }
    totals.add_row(r, norm2, row_lo, row_hi, row_integer);
  }
  return totals.finish(rows);
}
#endif  // GPUPOOL_SCAN_AVX2

}  // namespace

StoredElement stored_element(io::ElementType type) noexcept {
  switch (type) {
    case io::ElementType::UInt8: return StoredElement::UInt8;
    case io::ElementType::Int8: return StoredElement::Int8;
    case io::ElementType::Float16: return StoredElement::Fp16;
    case io::ElementType::Float32:
    case io::ElementType::Int32: return StoredElement::Fp32;
  }
  return StoredElement::Fp32;
}

void StoredRows::row_values(std::size_t row, double* out) const noexcept {
  const std::byte* at = data + row * row_bytes();
  switch (element) {
    case StoredElement::UInt8:
      for (std::size_t c = 0; c < dim; ++c) out[c] = std::to_integer<std::uint8_t>(at[c]);
      return;
    case StoredElement::Int8:
      for (std::size_t c = 0; c < dim; ++c)
        out[c] = static_cast<std::int8_t>(std::to_integer<std::uint8_t>(at[c]));
      return;
    case StoredElement::Fp16:
      for (std::size_t c = 0; c < dim; ++c) {
        std::uint16_t h;
        std::memcpy(&h, at + 2 * c, 2);
        out[c] = half_value(h);
      }
      return;
    case StoredElement::Fp32:
      for (std::size_t c = 0; c < dim; ++c) {
        float f;
        std::memcpy(&f, at + 4 * c, 4);
        out[c] = f;
      }
      return;
  }
}

void ValueStats::append(const ValueStats& other) noexcept {
  if (finite && !other.finite) first_nonfinite_row = rows + other.first_nonfinite_row;
  finite = finite && other.finite;
  integer = integer && other.integer;
  min = std::min(min, other.min);
  max = std::max(max, other.max);
  max_norm2 = std::max(max_norm2, other.max_norm2);
  min_norm2 = std::min(min_norm2, other.min_norm2);
  rows += other.rows;
}

bool stats_known_by_type(StoredElement element) noexcept {
  return element == StoredElement::UInt8 || element == StoredElement::Int8;
}

ValueStats known_stats(StoredElement element, std::size_t rows, std::size_t dim) noexcept {
  ValueStats s;
  s.rows = rows;
  s.min = element == StoredElement::UInt8 ? 0 : -128;
  s.max = element == StoredElement::UInt8 ? 255 : 127;
  s.max_norm2 = static_cast<double>(dim) * s.max_abs() * s.max_abs();
  s.min_norm2 = 1;  // whole numbers: a non-zero row has a value of magnitude 1 or more
  return s;
}

ValueStats scan_values(const StoredRows& rows) noexcept {
  switch (rows.element) {
    case StoredElement::UInt8:
    case StoredElement::Int8: {
      ValueStats s = known_stats(rows.element, rows.rows, rows.dim);
      return s;
    }
    case StoredElement::Fp16:
      return scan_with(rows, [&](std::size_t i) {
        std::uint16_t h;
        std::memcpy(&h, rows.data + 2 * i, 2);
        return half_value(h);
      });
    case StoredElement::Fp32: {
      return scan_fp32(rows, cpu_has_avx2());
    }
  }
  return {};
}

bool cpu_has_avx2() noexcept {
#if GPUPOOL_SCAN_AVX2
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
#else
  return false;
#endif
}

ValueStats scan_fp32(const StoredRows& rows, bool avx2) noexcept {
  const auto* values = reinterpret_cast<const float*>(rows.data);
#if GPUPOOL_SCAN_AVX2
  if (avx2) return scan_fp32_avx2(values, rows.rows, rows.dim);
#else
  (void)avx2;
#endif
  return scan_with(rows, [values](std::size_t i) { return static_cast<double>(values[i]); });
}

HostQueries host_queries(std::span<const float> values, std::size_t rows, std::size_t dim) {
  HostQueries q{rows, dim, std::vector<double>(rows * dim), std::vector<double>(rows), {}, {}};
  // Rows in ranges on every core: the copies' first touch of fresh pages dominates.
  const auto stored = reinterpret_cast<const std::byte*>(values.data());
  const std::size_t ranges = usable_cores();
  std::vector<ValueStats> stats(ranges);
  const std::size_t step = (rows + ranges - 1) / std::max<std::size_t>(ranges, 1);
  parallel_ranges(ranges, 1, [&](std::size_t first_range, std::size_t end_range) {
    for (std::size_t part = first_range; part < end_range; ++part) {
      const std::size_t begin = std::min(rows, part * step), end = std::min(rows, begin + step);
      for (std::size_t r = begin; r < end; ++r) {
        double norm2 = 0;
        for (std::size_t c = 0; c < dim; ++c) {
          const double v = values[r * dim + c];
          q.values[r * dim + c] = v;
          norm2 += v * v;
        }
        q.norm2[r] = norm2;
      }
      stats[part] = scan_values(StoredRows{stored + begin * dim * sizeof(float),
                                           StoredElement::Fp32, end - begin, dim});
    }
  });
  q.stats = stats[0];
  for (std::size_t part = 1; part < ranges; ++part) q.stats.append(stats[part]);
  if (q.stats.finite && q.stats.integer && q.stats.max_abs() <= 32768)
    q.integers.assign(q.values.begin(), q.values.end());
  return q;
}

namespace {

// Σ over the row of f(q_c, x_c) in int64, x read as stored (uint8 or int8).
template <class Byte, class Term>
std::int64_t integer_sum(const std::int32_t* q, const std::byte* row, std::size_t dim, Term term) {
  std::int64_t sum = 0;
  for (std::size_t c = 0; c < dim; ++c)
    sum += term(q[c], static_cast<std::int32_t>(static_cast<Byte>(row[c])));
  return sum;
}

// The same distance from int64 sums (see exact_distance), or NaN where it does not apply.
template <class Byte>
double integer_distance(const std::int32_t* q, double query_norm2, const std::byte* row,
                        std::size_t dim, Metric metric) noexcept {
  if (metric == Metric::L2)
    return static_cast<double>(integer_sum<Byte>(q, row, dim, [](std::int32_t a, std::int32_t b) {
      return static_cast<std::int64_t>((a - b) * (a - b));
    }));
  const auto dot = static_cast<double>(integer_sum<Byte>(
      q, row, dim, [](std::int32_t a, std::int32_t b) { return static_cast<std::int64_t>(a * b); }));
  if (metric == Metric::InnerProduct) return -dot;
  const auto norm2 = static_cast<double>(integer_sum<Byte>(
      q, row, dim, [](std::int32_t, std::int32_t b) { return static_cast<std::int64_t>(b * b); }));
  if (query_norm2 == 0 || norm2 == 0) return 1;
  return std::clamp(1 - dot / std::sqrt(query_norm2 * norm2), 0.0, 2.0);
}

}  // namespace

double exact_distance(const HostQueries& queries, std::size_t q, const StoredRows& base,
                      std::size_t row, Metric metric, double* scratch) noexcept {
  const double query_norm2 = queries.norm2[q];
  if (!queries.integers.empty()) {
    const std::int32_t* ints = queries.integers.data() + q * queries.dim;
    const std::byte* at = base.data + row * base.row_bytes();
    if (base.element == StoredElement::UInt8)
      return integer_distance<std::uint8_t>(ints, query_norm2, at, base.dim, metric);
    if (base.element == StoredElement::Int8)
      return integer_distance<std::int8_t>(ints, query_norm2, at, base.dim, metric);
  }
  const double* query = queries.row(q);
  base.row_values(row, scratch);
  const std::size_t dim = base.dim;
  if (metric == Metric::L2) {
    double sum = 0;
    for (std::size_t c = 0; c < dim; ++c) {
      const double d = query[c] - scratch[c];
      sum += d * d;
    }
    return sum;
  }
  double dot = 0, norm2 = 0;
  for (std::size_t c = 0; c < dim; ++c) {
    dot += query[c] * scratch[c];
    norm2 += scratch[c] * scratch[c];
  }
  if (metric == Metric::InnerProduct) return -dot;
  if (query_norm2 == 0 || norm2 == 0) return 1;
  return std::clamp(1 - dot / std::sqrt(query_norm2 * norm2), 0.0, 2.0);
}

}  // namespace gpupool::exact
