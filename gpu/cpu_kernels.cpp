// The CPU kernels of the host-simulated device: blocked over queries and corpus rows, spread over
// std::threads by query block. See gpu/cpu_kernels.hpp for the contract and the numerics.
#include "cpu_kernels.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <thread>
#include <utility>
#include <vector>

namespace gpupool::cpu_kernels {

namespace {

constexpr std::size_t kQueryBlock = 16;   // query rows held as fp32 at a time
constexpr std::size_t kCorpusBlock = 64;  // corpus rows held as fp32 at a time

// Runs fn(begin, end) over [0, count) split into at most `threads` contiguous ranges. Falls back
// to running inline if a thread cannot be started (the kernels have no way to fail).
template <class Fn>
void parallel_for(std::size_t count, int threads, Fn&& fn) {
  if (count == 0) return;
  std::size_t workers = std::min<std::size_t>(static_cast<std::size_t>(std::max(threads, 1)), count);
  if (workers <= 1) {
    fn(std::size_t{0}, count);
    return;
  }
  std::size_t step = (count + workers - 1) / workers;
  std::vector<std::thread> pool;
  pool.reserve(workers);
  std::size_t begin = 0;
  for (; begin < count; begin += step) {
    std::size_t end = std::min(count, begin + step);
    try {
      pool.emplace_back([&fn, begin, end] { fn(begin, end); });
    } catch (...) {  // std::system_error: do the rest here
      fn(begin, count);
      break;
    }
  }
  for (auto& t : pool) t.join();
}

float element_at(const Matrix& m, std::size_t index) noexcept {
  switch (m.element) {
    case Element::Fp32: return static_cast<const float*>(m.data)[index];
    case Element::Fp16: return half_to_float(static_cast<const std::uint16_t*>(m.data)[index]);
    case Element::Bf16: return bfloat16_to_float(static_cast<const std::uint16_t*>(m.data)[index]);
    case Element::Int8: return static_cast<float>(static_cast<const std::int8_t*>(m.data)[index]);
  }
  return 0.0f;
}

// Rows [first, first + count) of m as fp32 (Int8 dequantised: scale * q) into dst.
void load_rows(const Matrix& m, std::size_t first, std::size_t count, std::size_t dim,
               float* dst) noexcept {
  if (m.element == Element::Fp32) {
    std::memcpy(dst, static_cast<const float*>(m.data) + first * dim, count * dim * sizeof(float));
    return;
  }
  for (std::size_t r = 0; r < count; ++r) {
    float scale = m.element == Element::Int8 ? m.scales[first + r] : 1.0f;
    std::size_t base = (first + r) * dim;
    for (std::size_t c = 0; c < dim; ++c) dst[r * dim + c] = element_at(m, base + c) * scale;
  }
}

// fp32 accumulation in 8 interleaved partial sums (the order is fixed: results are reproducible).
float dot(const float* a, const float* b, std::size_t dim) noexcept {
  float acc[8] = {};
  std::size_t c = 0;
  for (; c + 8 <= dim; c += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[c + l] * b[c + l];
  for (; c < dim; ++c) acc[c & 7] += a[c] * b[c];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// Clamps below at `low` but keeps NaN (std::max(0.f, NaN) would turn NaN into 0).
float clamp_low(float value, float low) noexcept { return value < low ? low : value; }

// The distance from the raw sum (L2: sum of squared differences, else the dot product).
float finish_distance(float raw, float q_norm, float x_norm, Metric metric) noexcept {
  switch (metric) {
    case Metric::L2: return clamp_low(raw, 0.0f);
    case Metric::InnerProduct: return -raw;
    case Metric::Cosine: {
      if (q_norm == 0.0f || x_norm == 0.0f) return std::isnan(raw) ? raw : 1.0f;
      float value = 1.0f - raw / (q_norm * x_norm);
      return value > 2.0f ? 2.0f : clamp_low(value, 0.0f);
    }
  }
  return 0.0f;
}

// Euclidean norms (only Cosine needs them).
void norms(const float* rows, std::size_t count, std::size_t dim, float* out) noexcept {
  for (std::size_t r = 0; r < count; ++r) out[r] = std::sqrt(dot(rows + r * dim, rows + r * dim, dim));
}

// ---- register-blocked raw sums: QN query rows × XN corpus rows at once ----
// Each pair accumulates in 8 interleaved partial sums (lane l takes elements c = l mod 8), one
// 8-lane vector, reduced in dot()'s fixed order: the results are reproducible and the same in
// every build (no FMA contraction: the file is built with -ffp-contract=off), while every loaded
// query and corpus vector is reused XN resp. QN times.
typedef float Lanes8 __attribute__((vector_size(32), aligned(4)));
// In the generic build an 8-lane vector takes two SSE registers; it never crosses a call that is
// not inlined, so the ABI note clang gives for it does not matter here.
#pragma clang diagnostic ignored "-Wpsabi"

[[gnu::always_inline]] inline Lanes8 load8(const float* p) noexcept {
  Lanes8 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

[[gnu::always_inline]] inline float reduce8(Lanes8 a) noexcept {
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

template <int QN, int XN, bool Squared>
[[gnu::always_inline]] inline void raw_tile(const float* q, const float* x, std::size_t dim,
                                            float* out, std::size_t out_stride) noexcept {
  Lanes8 acc[QN][XN] = {};
  std::size_t c = 0;
  for (; c + 8 <= dim; c += 8) {
    Lanes8 xv[XN];
    for (int j = 0; j < XN; ++j) xv[j] = load8(x + j * dim + c);
    for (int i = 0; i < QN; ++i) {
      Lanes8 qv = load8(q + i * dim + c);
      for (int j = 0; j < XN; ++j) {
        if constexpr (Squared) {
          Lanes8 d = qv - xv[j];
          acc[i][j] += d * d;
        } else {
          acc[i][j] += qv * xv[j];
        }
      }
    }
  }
  for (; c < dim; ++c)
    for (int i = 0; i < QN; ++i)
      for (int j = 0; j < XN; ++j) {
        float a = q[i * dim + c], b = x[j * dim + c];
        if constexpr (Squared) acc[i][j][c & 7] += (a - b) * (a - b);
        else acc[i][j][c & 7] += a * b;
      }
  for (int i = 0; i < QN; ++i)
    for (int j = 0; j < XN; ++j) out[i * out_stride + j] = reduce8(acc[i][j]);
}

// The same with two corpus rows side by side in one 16-lane vector (lanes 0-7 row j, 8-15 row
// j + 1): each half keeps exactly the partial sums of one pair, so the results do not change, and
// AVX-512 does twice the pairs per instruction. QN query rows × 2·XP corpus rows.
typedef float Lanes16 __attribute__((vector_size(64), aligned(4)));

template <int QN, int XP, bool Squared>
[[gnu::always_inline]] inline void raw_tile_paired(const float* q, const float* x, std::size_t dim,
                                                   float* out, std::size_t out_stride) noexcept {
  Lanes16 acc[QN][XP] = {};
  std::size_t c = 0;
  for (; c + 8 <= dim; c += 8) {
    Lanes16 xv[XP];
    for (int p = 0; p < XP; ++p)
      xv[p] = __builtin_shufflevector(load8(x + 2 * p * dim + c), load8(x + (2 * p + 1) * dim + c),
                                      0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int i = 0; i < QN; ++i) {
      Lanes8 half = load8(q + i * dim + c);
      Lanes16 qv = __builtin_shufflevector(half, half, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
      for (int p = 0; p < XP; ++p) {
        if constexpr (Squared) {
          Lanes16 d = qv - xv[p];
          acc[i][p] += d * d;
        } else {
          acc[i][p] += qv * xv[p];
        }
      }
    }
  }
  for (; c < dim; ++c)
    for (int i = 0; i < QN; ++i)
      for (int j = 0; j < 2 * XP; ++j) {
        float a = q[i * dim + c], b = x[j * dim + c];
        std::size_t lane = static_cast<std::size_t>(j % 2) * 8 + (c & 7);
        if constexpr (Squared) acc[i][j / 2][lane] += (a - b) * (a - b);
        else acc[i][j / 2][lane] += a * b;
      }
  for (int i = 0; i < QN; ++i)
    for (int p = 0; p < XP; ++p) {
      Lanes16 a = acc[i][p];
      out[i * out_stride + 2 * p] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
      out[i * out_stride + 2 * p + 1] =
          ((a[8] + a[9]) + (a[10] + a[11])) + ((a[12] + a[13]) + (a[14] + a[15]));
    }
}

template <bool Squared>
[[gnu::always_inline]] inline void raw_block_paired_impl(const float* q, std::size_t nq,
                                                         const float* x, std::size_t nx,
                                                         std::size_t dim, float* out,
                                                         std::size_t out_stride) noexcept {
  std::size_t i = 0;
  for (; i + 4 <= nq; i += 4) {
    std::size_t j = 0;
    for (; j + 4 <= nx; j += 4)
      raw_tile_paired<4, 2, Squared>(q + i * dim, x + j * dim, dim, out + i * out_stride + j, out_stride);
    for (; j < nx; ++j)
      raw_tile<4, 1, Squared>(q + i * dim, x + j * dim, dim, out + i * out_stride + j, out_stride);
  }
  for (; i < nq; ++i)
    for (std::size_t j = 0; j < nx; ++j)
      raw_tile<1, 1, Squared>(q + i * dim, x + j * dim, dim, out + i * out_stride + j, out_stride);
}

// out[i * out_stride + j] = raw sum of query row i and corpus row j, 4 × 2 pairs at a time.
template <bool Squared>
[[gnu::always_inline]] inline void raw_block_impl(const float* q, std::size_t nq, const float* x,
                                                  std::size_t nx, std::size_t dim, float* out,
                                                  std::size_t out_stride) noexcept {
  std::size_t i = 0;
  for (; i + 4 <= nq; i += 4) {
    std::size_t j = 0;
    for (; j + 2 <= nx; j += 2)
      raw_tile<4, 2, Squared>(q + i * dim, x + j * dim, dim, out + i * out_stride + j, out_stride);
    for (; j < nx; ++j)
      raw_tile<4, 1, Squared>(q + i * dim, x + j * dim, dim, out + i * out_stride + j, out_stride);
  }
  for (; i < nq; ++i)
    for (std::size_t j = 0; j < nx; ++j)
      raw_tile<1, 1, Squared>(q + i * dim, x + j * dim, dim, out + i * out_stride + j, out_stride);
}

void raw_block_generic(bool squared, const float* q, std::size_t nq, const float* x, std::size_t nx,
                       std::size_t dim, float* out, std::size_t stride) noexcept {
  if (squared) raw_block_impl<true>(q, nq, x, nx, dim, out, stride);
  else raw_block_impl<false>(q, nq, x, nx, dim, out, stride);
}

#if defined(__x86_64__) && !defined(__AVX2__)
// The same code compiled for AVX2 (one 8-lane vector per pair), chosen at run time.
__attribute__((target("avx2"))) void raw_block_avx2(bool squared, const float* q, std::size_t nq,
                                                    const float* x, std::size_t nx, std::size_t dim,
                                                    float* out, std::size_t stride) noexcept {
  if (squared) raw_block_impl<true>(q, nq, x, nx, dim, out, stride);
  else raw_block_impl<false>(q, nq, x, nx, dim, out, stride);
}
__attribute__((target("avx512f"))) void raw_block_avx512(bool squared, const float* q,
                                                       std::size_t nq, const float* x,
                                                       std::size_t nx, std::size_t dim, float* out,
                                                       std::size_t stride) noexcept {
  if (squared) raw_block_paired_impl<true>(q, nq, x, nx, dim, out, stride);
  else raw_block_paired_impl<false>(q, nq, x, nx, dim, out, stride);
}
bool has_avx512() noexcept {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return supported;
}
bool has_avx2() noexcept {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return supported;
}
#endif

void raw_block(bool squared, const float* q, std::size_t nq, const float* x, std::size_t nx,
               std::size_t dim, float* out, std::size_t stride) noexcept {
#if defined(__x86_64__) && !defined(__AVX2__)
  if (has_avx512()) return raw_block_avx512(squared, q, nq, x, nx, dim, out, stride);
  if (has_avx2()) return raw_block_avx2(squared, q, nq, x, nx, dim, out, stride);
#endif
  raw_block_generic(squared, q, nq, x, nx, dim, out, stride);
}

// Rows [first, first + count) of m as fp32: the data itself for Fp32, else converted into dst.
const float* rows_as_fp32(const Matrix& m, std::size_t first, std::size_t count,
                          std::size_t dim, float* dst) noexcept {
  if (m.element == Element::Fp32) return static_cast<const float*>(m.data) + first * dim;
  load_rows(m, first, count, dim, dst);
  return dst;
}

// Distances of queries [q0, q0 + nq) against corpus rows [x0, x0 + nx) into out (row stride
// out_stride, column 0 = corpus row x0), blocked so both sides are converted to fp32 once per block.
void distance_block(const Matrix& queries, std::size_t q0, std::size_t nq,
                    const Matrix& corpus, std::size_t x0, std::size_t nx, std::size_t dim,
                    Metric metric, float* out, std::size_t out_stride) {
  std::vector<float> qbuf(queries.element == Element::Fp32 ? 0 : kQueryBlock * dim);
  std::vector<float> xbuf(corpus.element == Element::Fp32 ? 0 : kCorpusBlock * dim);
  float qn[kQueryBlock] = {}, xn[kCorpusBlock] = {};
  for (std::size_t qb = 0; qb < nq; qb += kQueryBlock) {
    std::size_t qcount = std::min(kQueryBlock, nq - qb);
    const float* q = rows_as_fp32(queries, q0 + qb, qcount, dim, qbuf.data());
    if (metric == Metric::Cosine) norms(q, qcount, dim, qn);
    for (std::size_t xb = 0; xb < nx; xb += kCorpusBlock) {
      std::size_t xcount = std::min(kCorpusBlock, nx - xb);
      const float* x = rows_as_fp32(corpus, x0 + xb, xcount, dim, xbuf.data());
      if (metric == Metric::Cosine) norms(x, xcount, dim, xn);
      float* block = out + qb * out_stride + xb;
      raw_block(metric == Metric::L2, q, qcount, x, xcount, dim, block, out_stride);
      for (std::size_t i = 0; i < qcount; ++i)
        for (std::size_t j = 0; j < xcount; ++j)
          block[i * out_stride + j] = finish_distance(block[i * out_stride + j], qn[i], xn[j], metric);
    }
  }
}

// The selection order: smaller distance first, NaN after every number, ties by smaller index,
// index -1 (an empty slot) after everything.
bool better(float da, std::int32_t ia, float db, std::int32_t ib) noexcept {
  if ((ia < 0) != (ib < 0)) return ib < 0;
  bool na = std::isnan(da), nb = std::isnan(db);
  if (na != nb) return nb;
  if (!na && da != db) return da < db;
  return ia < ib;
}

// A max-heap (worst on top) of up to k entries held in two parallel arrays.
struct TopK {
  float* d;
  std::int32_t* i;
  std::size_t k;
  std::size_t size = 0;

  void sift_down(std::size_t pos, std::size_t n) noexcept {
    for (;;) {
      std::size_t worst = pos, l = 2 * pos + 1, r = l + 1;
      if (l < n && better(d[worst], i[worst], d[l], i[l])) worst = l;
      if (r < n && better(d[worst], i[worst], d[r], i[r])) worst = r;
      if (worst == pos) return;
      std::swap(d[pos], d[worst]);
      std::swap(i[pos], i[worst]);
      pos = worst;
    }
  }
  void offer(float dist, std::int32_t index) noexcept {
    if (size < k) {
      std::size_t pos = size++;
      d[pos] = dist;
      i[pos] = index;
      while (pos > 0) {
        std::size_t parent = (pos - 1) / 2;
        if (!better(d[parent], i[parent], d[pos], i[pos])) break;
        std::swap(d[pos], d[parent]);
        std::swap(i[pos], i[parent]);
        pos = parent;
      }
    } else if (better(dist, index, d[0], i[0])) {
      d[0] = dist;
      i[0] = index;
      sift_down(0, size);
    }
  }
  // Heap → ascending order (best first).
  void finish() noexcept {
    for (std::size_t n = size; n > 1; --n) {
      std::swap(d[0], d[n - 1]);
      std::swap(i[0], i[n - 1]);
      sift_down(0, n - 1);
    }
  }
};

}  // namespace

void pairwise_distance(const Matrix& queries, const Matrix& corpus, std::size_t dim,
                       Metric metric, float* out, int threads) {
  parallel_for(queries.rows, threads, [&](std::size_t begin, std::size_t end) {
    distance_block(queries, begin, end - begin, corpus, 0, corpus.rows, dim, metric,
                   out + begin * corpus.rows, corpus.rows);
  });
}

void knn(const Matrix& queries, const Matrix& corpus, std::size_t dim, Metric metric,
         std::size_t k, float* tile, std::size_t tile_rows, std::size_t tile_cols,
         float* out_distances, std::int32_t* out_indices, int threads) {
  for (std::size_t q0 = 0; q0 < queries.rows; q0 += tile_rows) {
    std::size_t nq = std::min(tile_rows, queries.rows - q0);
    parallel_for(nq, threads, [&](std::size_t begin, std::size_t end) {
      std::vector<TopK> heaps;
      heaps.reserve(end - begin);
      for (std::size_t r = begin; r < end; ++r)
        heaps.push_back(TopK{out_distances + (q0 + r) * k, out_indices + (q0 + r) * k, k});
      for (std::size_t x0 = 0; x0 < corpus.rows; x0 += tile_cols) {
        std::size_t nx = std::min(tile_cols, corpus.rows - x0);
        float* rows = tile + begin * tile_cols;  // this thread's rows of the tile
        distance_block(queries, q0 + begin, end - begin, corpus, x0, nx, dim, metric, rows,
                       tile_cols);
        for (std::size_t r = 0; r < end - begin; ++r) {
          TopK& heap = heaps[r];
          for (std::size_t j = 0; j < nx; ++j) {
            float dist = rows[r * tile_cols + j];
            // Most candidates lose to the current k-th: skip the call for those (a NaN on either
            // side fails the comparison and goes through offer's full ordering).
            if (heap.size == k && dist > heap.d[0]) continue;
            heap.offer(dist, static_cast<std::int32_t>(x0 + j));
          }
        }
      }
      for (auto& heap : heaps) heap.finish();
    });
  }
}

void apply_upper_bounds(const float* bounds, std::size_t queries, std::size_t k,
                        float* distances, std::int32_t* indices) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (std::size_t q = 0; q < queries; ++q)
    for (std::size_t j = 0; j < k; ++j) {
      const std::size_t at = q * k + j;
      if (distances[at] <= bounds[q]) continue;
      distances[at] = nan;
      indices[at] = -1;
    }
}

void rerank(const float* queries, const float* corpus, std::size_t rows, std::size_t dim,
            Metric metric, const std::int32_t* candidate_indices, std::size_t candidates,
            std::size_t k, float* out_distances, std::int32_t* out_indices, int threads) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  bool squared = metric == Metric::L2;
  parallel_for(rows, threads, [&](std::size_t begin, std::size_t end) {
    for (std::size_t r = begin; r < end; ++r) {
      const float* q = queries + r * dim;
      float q_norm = 0.0f;
      if (metric == Metric::Cosine) norms(q, 1, dim, &q_norm);
      TopK heap{out_distances + r * k, out_indices + r * k, k};
      for (std::size_t c = 0; c < candidates; ++c) {
        std::int32_t j = candidate_indices[r * candidates + c];
        if (j < 0) {
          heap.offer(nan, -1);
          continue;
        }
        // One pair through the same 8-lane tile as distance_block: the same sums, bit for bit.
        const float* x = corpus + static_cast<std::size_t>(j) * dim;
        float raw = 0.0f, x_norm = 0.0f;
        if (squared) raw_tile<1, 1, true>(q, x, dim, &raw, 1);
        else raw_tile<1, 1, false>(q, x, dim, &raw, 1);
        if (metric == Metric::Cosine) norms(x, 1, dim, &x_norm);
        heap.offer(finish_distance(raw, q_norm, x_norm, metric), j);
      }
      heap.finish();
    }
  });
}

void convert_stored(const void* stored, int stored_element, std::size_t count, float offset,
                    int exponent, Element out_element, void* out, int threads) {
  auto value = [&](std::size_t i) -> float {
    switch (stored_element) {
      case 0: return static_cast<const std::uint8_t*>(stored)[i];
      case 1: return static_cast<const std::int8_t*>(stored)[i];
      case 2: return half_to_float(static_cast<const std::uint16_t*>(stored)[i]);
      default: return static_cast<const float*>(stored)[i];
    }
  };
  parallel_for(count, threads, [&](std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; ++i) {
      float v = value(i) + offset;
      if (exponent != 0) v = std::scalbn(v, exponent);
      switch (out_element) {
        case Element::Fp32: static_cast<float*>(out)[i] = v; break;
        case Element::Fp16: static_cast<std::uint16_t*>(out)[i] = float_to_half(v); break;
        case Element::Bf16: static_cast<std::uint16_t*>(out)[i] = float_to_bfloat16(v); break;
        case Element::Int8:
          static_cast<std::int8_t*>(out)[i] =
              std::isnan(v) ? std::int8_t{0}
                            : static_cast<std::int8_t>(std::clamp(std::round(v), -128.0f, 127.0f));
          break;
      }
    }
  });
}

void row_norms(const Matrix& vectors, std::size_t dim, float* out, int threads) {
  parallel_for(vectors.rows, threads, [&](std::size_t begin, std::size_t end) {
    std::vector<float> row(dim);
    for (std::size_t r = begin; r < end; ++r) {
      load_rows(vectors, r, 1, dim, row.data());
      out[r] = dot(row.data(), row.data(), dim);
    }
  });
}

void convert(const Matrix& in, std::size_t dim, Element out_element, void* out,
             float* out_scales, int threads) {
  parallel_for(in.rows, threads, [&](std::size_t begin, std::size_t end) {
    std::vector<float> row(dim);
    for (std::size_t r = begin; r < end; ++r) {
      load_rows(in, r, 1, dim, row.data());
      std::size_t base = r * dim;
      switch (out_element) {
        case Element::Fp32:
          std::memcpy(static_cast<float*>(out) + base, row.data(), dim * sizeof(float));
          break;
        case Element::Fp16:
          for (std::size_t c = 0; c < dim; ++c)
            static_cast<std::uint16_t*>(out)[base + c] = float_to_half(row[c]);
          break;
        case Element::Bf16:
          for (std::size_t c = 0; c < dim; ++c)
            static_cast<std::uint16_t*>(out)[base + c] = float_to_bfloat16(row[c]);
          break;
        case Element::Int8: {
          float max_abs = 0.0f;
          bool finite = true;
          for (float v : row) {
            finite = finite && std::isfinite(v);
            max_abs = std::max(max_abs, std::fabs(v));
          }
          auto* q = static_cast<std::int8_t*>(out) + base;
          if (!finite || max_abs == 0.0f) {
            std::fill(q, q + dim, std::int8_t{0});
            out_scales[r] = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
            break;
          }
          float scale = max_abs / 127.0f;
          for (std::size_t c = 0; c < dim; ++c) {
            float v = std::nearbyint(row[c] / scale);
            q[c] = static_cast<std::int8_t>(std::clamp(v, -127.0f, 127.0f));
          }
          out_scales[r] = scale;
          break;
        }
      }
    }
  });
}

void merge_topk(const float* distances, const std::int32_t* indices, std::size_t queries,
                std::size_t lists, std::size_t list_length, std::size_t k, float* out_distances,
                std::int32_t* out_indices, int threads) {
  std::size_t per_query = lists * list_length;
  parallel_for(queries, threads, [&](std::size_t begin, std::size_t end) {
    for (std::size_t q = begin; q < end; ++q) {
      TopK heap{out_distances + q * k, out_indices + q * k, k};
      for (std::size_t c = 0; c < per_query; ++c)
        heap.offer(distances[q * per_query + c], indices[q * per_query + c]);
      heap.finish();
    }
  });
}

// The running list is sorted (the contract); the candidates are sorted here unless they already
// are (knn's output is), then both are merged, the first k kept: linear where a heap of k + C
// offers per query took longer than the searches it merged on the simulated device.
void fold_topk(const float* distances, const std::int32_t* indices, std::size_t queries,
               std::size_t candidates, std::size_t k, std::int64_t index_offset,
               float* running_distances, std::int32_t* running_indices, int threads) {
  using Entry = std::pair<float, std::int32_t>;
  auto before = [](const Entry& a, const Entry& b) {
    return better(a.first, a.second, b.first, b.second);
  };
  parallel_for(queries, threads, [&](std::size_t begin, std::size_t end) {
    std::vector<Entry> running(k), offered(candidates);
    for (std::size_t q = begin; q < end; ++q) {
      float* run_d = running_distances + q * k;
      std::int32_t* run_i = running_indices + q * k;
      for (std::size_t j = 0; j < k; ++j) running[j] = {run_d[j], run_i[j]};
      for (std::size_t c = 0; c < candidates; ++c) {
        const std::int32_t index = indices[q * candidates + c];
        offered[c] = {distances[q * candidates + c],
                      index < 0 ? index : static_cast<std::int32_t>(index + index_offset)};
      }
      if (!std::is_sorted(offered.begin(), offered.end(), before))
        std::sort(offered.begin(), offered.end(), before);
      std::size_t i = 0, c = 0;
      for (std::size_t j = 0; j < k; ++j) {
        const bool take_offered =
            c < candidates && (i == k || before(offered[c], running[i]));
        const Entry& e = take_offered ? offered[c++] : running[i++];
        run_d[j] = e.first;
        run_i[j] = e.second;
      }
    }
  });
}

}  // namespace gpupool::cpu_kernels
