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
  bool operator==(const Arithmetic&) const = default;
};

std::string_view describe(const Arithmetic& arithmetic) noexcept;

// The exact job's arithmetic for a chunk whose rows have `chunk` stats against queries with
// `queries` stats: integer forms where both are whole numbers in range, else fp32.
Arithmetic exact_arithmetic(const ValueStats& queries, const ValueStats& chunk, Metric metric,
                            std::size_t dim) noexcept;

// The largest |d̃ - d| of a pair with query norm² `query_norm2` (of the values as the device sees
// them, offset included) and rows of norm² at most `row_norm2_max`, under `arithmetic`; 0 where
// the device's distances are exact.
double error_bound(const Arithmetic& arithmetic, Metric metric, std::size_t dim,
                   double query_norm2, double row_norm2_max) noexcept;

// The norm² bound of rows with `stats` seen with `offset` added to every value.
double offset_norm2_max(const ValueStats& stats, std::int32_t offset, std::size_t dim) noexcept;

}  // namespace gpupool::exact
