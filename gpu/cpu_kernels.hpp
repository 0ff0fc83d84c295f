// Internal: the CPU kernels of the host-simulated device (gpu/cpu_kernels.cpp).
//
// Plain C++ on raw host pointers in the kernels' vocabulary (gpu/kernel_vocabulary.hpp), no
// gpupool types: gpu/kernels.cpp validates every argument first, and the simulated device's
// kernel backend (gpu/cpu_backend.cpp) calls these from Device::enqueue_host_work, so they run in
// stream order. They cannot fail: every size and pointer has been checked by the caller.
//
// Numerics: everything is computed in fp32 with fp32 accumulation. L2 uses the direct form
// sum((q - x)^2) — never the GEMM form |q|^2 + |x|^2 - 2 q.x — so points that are close to each
// other far from the origin keep their distance exactly (pytorch#42479: 512695 vs 512804 → 11881).
#pragma once

#include "kernel_vocabulary.hpp"

#include <bit>
#include <cstddef>
#include <cstdint>

namespace gpupool::cpu_kernels {

// The kernels are called in the vocabulary they share with the CUDA kernels and the module.
using kernels::Element;
using kernels::Matrix;
using kernels::Metric;

// ---- scalar conversions (round to nearest even; NaN stays NaN, overflow becomes infinity) ----
inline std::uint16_t float_to_half(float value) noexcept {
  constexpr std::uint32_t f32_infinity = 255u << 23;
  constexpr std::uint32_t f16_max = (127u + 16u) << 23;
  constexpr std::uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  std::uint32_t f = std::bit_cast<std::uint32_t>(value);
  std::uint32_t sign = f & 0x80000000u;
  f ^= sign;
  std::uint16_t out;
  if (f >= f16_max) {
    out = f > f32_infinity ? 0x7e00 : 0x7c00;
  } else if (f < (113u << 23)) {  // the half is subnormal or zero
    float shifted = std::bit_cast<float>(f) + std::bit_cast<float>(denorm_magic);
    out = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(shifted) - denorm_magic);
  } else {
    std::uint32_t mantissa_odd = (f >> 13) & 1u;
    f += (static_cast<std::uint32_t>(15 - 127) << 23) + 0xfffu;
    f += mantissa_odd;
    out = static_cast<std::uint16_t>(f >> 13);
  }
  return static_cast<std::uint16_t>(out | (sign >> 16));
}

inline float half_to_float(std::uint16_t h) noexcept {
  std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in fp32
    float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline std::uint16_t float_to_bfloat16(float value) noexcept {
  std::uint32_t f = std::bit_cast<std::uint32_t>(value);
  if ((f & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((f >> 16) | 0x0040u);
  f += 0x7fffu + ((f >> 16) & 1u);
  return static_cast<std::uint16_t>(f >> 16);
}

inline float bfloat16_to_float(std::uint16_t b) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

// ---- kernels; `threads` = how many host threads to use (>= 1) ----

// out[i * corpus.rows + j] = distance(queries row i, corpus row j), clamped at 0 for L2 and
// Cosine (NaN stays NaN). InnerProduct gives -dot, Cosine 1 - cos (1 when either norm is 0).
void pairwise_distance(const Matrix& queries, const Matrix& corpus, std::size_t dim,
                       Metric metric, float* out, int threads);

// The k smallest distances per query, ascending, ties (and NaNs, which sort last) by smaller
// index. Tiles over the corpus with `tile` scratch of tile_rows * tile_cols floats, so the
// Q x N matrix never exists. out_indices are int32.
void knn(const Matrix& queries, const Matrix& corpus, std::size_t dim, Metric metric,
         std::size_t k, float* tile, std::size_t tile_rows, std::size_t tile_cols,
         float* out_distances, std::int32_t* out_indices, int threads);

// Exact re-rank: for every query row q of `queries` (fp32, rows × dim), the distances of its
// `candidates` corpus rows (candidate_indices[q * candidates + c]; -1 = an empty slot, kept as
// NaN / -1) computed from the fp32 `corpus` exactly as pairwise_distance computes them (so the
// values are bit-identical to an fp32 knn's), and the k best of those in knn's order into out.
void rerank(const float* queries, const float* corpus, std::size_t rows, std::size_t dim,
            Metric metric, const std::int32_t* candidate_indices, std::size_t candidates,
            std::size_t k, float* out_distances, std::int32_t* out_indices, int threads);

// knn's upper bounds: in each query's sorted list of k, the entries whose distance is not at
// most bounds[q] (NaN ones included) become index -1, distance NaN.
void apply_upper_bounds(const float* bounds, std::size_t queries, std::size_t k,
                        float* distances, std::int32_t* indices);

// out[i] = squared L2 norm of row i (dequantised for Int8).
void row_norms(const Matrix& vectors, std::size_t dim, float* out, int threads);

// fp32 rows → fp16 / bf16 / int8 (symmetric per-row scale max|x| / 127, written to scales;
// a row with a NaN or infinity gets scale NaN and zeros), and back: to Fp32 from any of them.
void convert(const Matrix& in, std::size_t dim, Element out_element, void* out,
             float* out_scales, int threads);

// out[i] = (stored[i] + offset) · 2^exponent for `count` values stored as uint8 / int8 / fp16 /
// fp32 (`stored_element` 0..3 in that order), written as out_element: fp32 / fp16 / bf16 rounded
// to nearest even, int8 rounded half away from zero and saturated to [-128, 127], NaN to 0.
void convert_stored(const void* stored, int stored_element, std::size_t count, float offset,
                    int exponent, Element out_element, void* out, int threads);

// Merges `lists` sorted-or-not candidate lists of `list_length` (distance, index) pairs per
// query into the k best, same order as knn. Index -1 marks an empty slot: it sorts after all.
void merge_topk(const float* distances, const std::int32_t* indices, std::size_t queries,
                std::size_t lists, std::size_t list_length, std::size_t k, float* out_distances,
                std::int32_t* out_indices, int threads);

// Folds `candidates` (distance, index) pairs per query, each index but -1 plus index_offset,
// into the query's sorted running list of k in place (the k best of both, knn's order): the
// candidates sorted (unless they are), then merged with the list.
void fold_topk(const float* distances, const std::int32_t* indices, std::size_t queries,
               std::size_t candidates, std::size_t k, std::int64_t index_offset,
               float* running_distances, std::int32_t* running_indices, int threads);

}  // namespace gpupool::cpu_kernels
