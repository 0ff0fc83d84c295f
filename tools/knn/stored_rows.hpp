// gpupool::exact — base rows as the file stores them, what the reading threads learn about their
// values, and the fp64 distances the exact job ranks by.
//
// Rows stay in their stored type (uint8, int8, fp16, fp32) from the file to the device; the host
// never widens them. The host touches values only to scan a block of a float file once while it
// is hot from the read (finiteness, integrality, range, largest norm: what decides the device
// arithmetic and its error bound) and to compute the fp64 distances of the few candidates that
// may enter a query's list.
//
// This header imports gpupool: include it after your other headers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>
#include "vector_io.hpp"
import gpupool;

namespace gpupool::exact {

// How `type` is kept in the job's host blocks and uploaded: int32 files are read as fp32 (exact
// up to 2^24, the reader refuses larger values), every other type as stored.
StoredElement stored_element(io::ElementType type) noexcept;

// `rows` rows of `dim` values of `element`, packed, row-major.
struct StoredRows {
  const std::byte* data = nullptr;
  StoredElement element = StoredElement::Fp32;
  std::size_t rows = 0;
  std::size_t dim = 0;

  std::size_t row_bytes() const noexcept { return dim * stored_size(element); }
  std::span<const std::byte> bytes() const noexcept { return {data, rows * row_bytes()}; }
  StoredRows slice(std::size_t first, std::size_t count) const noexcept {
    return {data + first * row_bytes(), element, count, dim};
  }
  // Row `row`'s values as fp64 (exact for every stored type) into out (dim values).
  void row_values(std::size_t row, double* out) const noexcept;
};

// What a scan of some rows found. Integer types are known without a scan (known_stats).
struct ValueStats {
  std::size_t rows = 0;
  bool finite = true;                  // no NaN or ±inf
  std::size_t first_nonfinite_row = 0; // the first row holding one (rows counted from the scan's first)
  bool integer = true;                 // every value a whole number
  double min = std::numeric_limits<double>::infinity();
  double max = -std::numeric_limits<double>::infinity();
  double max_norm2 = 0;                // the largest squared L2 norm of a row (slightly over: see scan)
  double min_norm2 = std::numeric_limits<double>::infinity();  // the smallest non-zero one (slightly under)

  double max_abs() const noexcept { return rows == 0 ? 0 : (-min > max ? -min : max); }
  // Folds in the stats of the `other.rows` rows that follow these.
  void append(const ValueStats& other) noexcept;
};

// Reads every value once (per-value work, done by the reading thread while the block is hot).
ValueStats scan_values(const StoredRows& rows) noexcept;
// scan_values of fp32 rows with AVX2 (which the CPU must have: cpu_has_avx2) or with baseline
// vectors: the same figures either way. scan_values picks by the CPU.
ValueStats scan_fp32(const StoredRows& rows, bool avx2) noexcept;
// Whether this is an x86-64 CPU with AVX2 (false elsewhere).
bool cpu_has_avx2() noexcept;
// What uint8 / int8 rows are bound to be (their type's range, the largest norm it allows);
// fp16 / fp32 rows are scanned instead.
ValueStats known_stats(StoredElement element, std::size_t rows, std::size_t dim) noexcept;
bool stats_known_by_type(StoredElement element) noexcept;

// The query set's rows as fp64, with their squared norms (the exact job's host side).
struct HostQueries {
  std::size_t rows = 0;
  std::size_t dim = 0;
  std::vector<double> values;  // rows × dim
  std::vector<double> norm2;   // per row
  ValueStats stats;
  // The values as int32 where every one is a whole number of magnitude at most 2^15 (so that a
  // difference with an int8 / uint8 value squares within int32); empty otherwise.
  std::vector<std::int32_t> integers;
  const double* row(std::size_t q) const noexcept { return values.data() + q * dim; }
};
HostQueries host_queries(std::span<const float> values, std::size_t rows, std::size_t dim);

// The distance the exact job ranks by, as fp64 sums in one fixed order would give it (so that
// every device, chunking and run gives the same bits): L2 Σ (q_i - x_i)², inner product
// -Σ q_i x_i, cosine 1 - Σ q_i x_i / sqrt(‖q‖² ‖x‖²) clamped to [0, 2] (1 when either norm is 0).
// Integer queries against uint8 / int8 rows sum in int64: exact, so the same bits as the fp64
// sums (exact too, below 2^53), several times faster. `scratch` holds dim values.
double exact_distance(const HostQueries& queries, std::size_t query, const StoredRows& base,
                      std::size_t row, Metric metric, double* scratch) noexcept;

}  // namespace gpupool::exact
