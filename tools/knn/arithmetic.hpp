// gpupool::exact — which arithmetic the device runs a chunk in, and how far its distances can be
// from the fp64 ones the exact job ranks by.
//
// Integer data (every value of the queries and the chunk a whole number) goes to the device as
// int8 (shifted by -128 for uint8 under L2, which L2 does not see) or fp16 (whole numbers up to
// 2048), where every product is exact and, while D · max|q| · max|x| < 2^24, every sum of them
// too: only the epilogue's few fp32 roundings remain (none while every intermediate stays below
// 2^24 — then the device's distances are the exact ones). Everything else is computed in fp32
// (fp32-accurate kNN: fp32 FMAs or 3xTF32), whose error is bounded by
// c · (‖q‖ + max‖x‖)² with c = (4D + 128) · 2^-24, about twice the textbook bound of a dot product
// in fp32 (D · 2^-24 relative per dot product and norm, the 3xTF32 split's 3 · 2^-22 per product,
// the epilogue's roundings), so that an accumulation that rounds toward zero is covered too.
//
// The exact job trusts a device distance d̃ only through this bound: a row outside a chunk's
// candidates has d̃ >= the last candidate's, so its fp64 distance is at least that minus the bound.
//
// Values of any magnitude: the fp32 forms, and every form of the fast mode but exact integers,
// reach the device multiplied by a power of two (the arithmetic's exponent) that brings the
// queries' and the chunk's largest magnitude into [2^6, 2^7) — far from fp16's overflow and every
// format's underflow, with squared distances far inside fp32. A power of two scales every fp32
// result by exactly its square (L2, inner product; cosine not at all) while nothing falls below
// fp32's normal range, so the device's distances come back by an exact multiplication
// (distance_unit), and what does fall below it is covered by an absolute term in the bound.
//
// This header imports gpupool: include it after your other headers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>
#include "stored_rows.hpp"
import gpupool;

namespace gpupool::exact {

struct Arithmetic {
  Precision precision = Precision::Fp32;  // what the device computes on
  std::int32_t offset = 0;                // added to every value on the way (int8 of uint8 rows)
  bool integer = false;                   // whole-number values: exact products
  bool exact_sums = false;                // integer, and every dot product and norm exact in fp32
  std::int32_t exponent = 0;              // values reach the device multiplied by 2^exponent
  bool operator==(const Arithmetic&) const = default;
};

std::string_view describe(const Arithmetic& arithmetic) noexcept;

// The exact job's arithmetic for a chunk whose rows have `chunk` stats against queries with
// `queries` stats: integer forms where both are whole numbers in range, else fp32.
Arithmetic exact_arithmetic(const ValueStats& queries, const ValueStats& chunk, Metric metric,
                            std::size_t dim) noexcept;

// The exponent that brings the largest magnitude of `queries` and `chunk` into [2^6, 2^7) (0 when
// there is none, or it is not finite).
std::int32_t range_exponent(const ValueStats& queries, const ValueStats& chunk) noexcept;

// What a device distance under `arithmetic` is multiplied by to be one of the data's own: 2^-2e
// for L2 and inner product, 1 for cosine.
double distance_unit(const Arithmetic& arithmetic, Metric metric) noexcept;

// What a bound is taken over, in the data's own units (offset included): the query's norm², the
// largest and the smallest non-zero one of the chunk's rows, and the largest magnitude of a value
// of the queries or the chunk.
struct BoundNorms {
  double query_norm2 = 0;
  double row_norm2_max = 0;
  double row_norm2_min = 0;
  double largest = 0;
};

// The largest |d̃ - d| (in the data's units) of a pair with these norms under `arithmetic`; 0 where
// the device's distances are exact, +inf where nothing can be said (cosine of rows that vanish
// in the device's range).
double error_bound(const Arithmetic& arithmetic, Metric metric, std::size_t dim,
                   const BoundNorms& norms) noexcept;

// The largest and smallest non-zero norm² of rows with `stats` seen with `offset` added to every
// value.
double offset_norm2_max(const ValueStats& stats, std::int32_t offset, std::size_t dim) noexcept;
double offset_norm2_min(const ValueStats& stats, std::int32_t offset) noexcept;

}  // namespace gpupool::exact
