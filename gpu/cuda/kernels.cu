// CUDA kernels of gpupool:kernels: cuBLAS GEMM-form distances with an fp32 epilogue, a direct-form
// int8 kernel, row norms, conversions and a block-per-query running top-k selection.
#include "kernels.cuh"
#include "distance_matrix.cuh"
#include "distance_rules.cuh"
#include "piece_squares.cuh"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

namespace gpupool::cuda_kernels {

namespace {

Status cuda_status(cudaError_t e, const char* what) {
  Status s;
  if (e != cudaSuccess) {
    s.cuda = static_cast<int>(e);
    s.what = what;
  }
  return s;
}
Status launch_status(const char* what) { return cuda_status(cudaGetLastError(), what); }

// One cuBLAS handle per device, used under a lock (cublasSetStream + enqueue).
std::mutex g_handles_mutex;
std::map<int, cublasHandle_t> g_handles;

__device__ __forceinline__ float load(const void* data, Element e, std::size_t index) {
  switch (e) {
    case Element::Fp32: return static_cast<const float*>(data)[index];
    case Element::Fp16: return __half2float(static_cast<const __half*>(data)[index]);
    case Element::Bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[index]);
    case Element::Int8: return static_cast<float>(static_cast<const std::int8_t*>(data)[index]);
  }
  return 0.0f;
}

__global__ void row_norms_kernel(Matrix m, std::size_t dim, float* out) {
  std::size_t row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= m.rows) return;
  float acc = 0.0f;
  for (std::size_t c = lane; c < dim; c += 32) {
    float v = load(m.data, m.element, row * dim + c);
    acc += v * v;
  }
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  if (lane == 0) {
    float s = m.element == Element::Int8 ? m.scales[row] : 1.0f;
    out[row] = acc * s * s;
  }
}

// Row norms of fp16 / bf16 / int8 rows that are whole, aligned 16-byte pieces: `group` lanes (a
// power of two, at most 32) a row, one 16-byte load per piece. row_norms_kernel's one value per
// lane ran at 1.8 TB/s on an H200 for fp16 rows of 256 bytes (149 µs for 2^20 rows). Fp32 rows
// stay there: scale_to_fp16_kernel sums in its order.
// One kernel an element type (piece_squares.cuh's sum, the resident matrix's too).
template <Element kElement>
__global__ void row_norms_pieces_kernel(Matrix m, std::size_t pieces, unsigned group, float* out) {
  const std::size_t thread = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  const std::size_t row = thread / group;
  const unsigned lane = thread % group;
  float acc = 0.0f;
  if (row < m.rows) {
    const uint4* src = static_cast<const uint4*>(m.data) + row * pieces;
    for (std::size_t p = lane; p < pieces; p += group) acc += piece_squares<kElement>(src[p]);
  }
  for (unsigned offset = group / 2; offset > 0; offset /= 2)
    acc += __shfl_down_sync(0xffffffffu, acc, offset, group);
  if (lane != 0 || row >= m.rows) return;
  float s = kElement == Element::Int8 ? m.scales[row] : 1.0f;
  out[row] = acc * s * s;
}

// The figures of query row i and corpus row j that finish() reads, loaded ahead.
struct PairFigures {
  float q_norm = 0.0f, x_norm = 0.0f, q_scale = 1.0f, x_scale = 1.0f;
};
__device__ __forceinline__ float query_norm(const Epilogue& e, std::size_t i) {
  return e.q_norms ? e.q_norms[i] : 0.0f;
}
__device__ __forceinline__ float query_scale(const Epilogue& e, std::size_t i) {
  return e.q_scales ? e.q_scales[i] : 1.0f;
}
__device__ __forceinline__ void load_row_figures(const Epilogue& e, std::size_t j, PairFigures& f) {
  if (e.x_norms) f.x_norm = e.x_norms[j];
  if (e.x_scales) f.x_scale = e.x_scales[j];
}

// A GEMM dot product → the pair's distance. Int8 inputs reach the GEMM widened to fp16 (exact:
// |q| <= 127), so their dot products still carry the per-row scales.
__device__ __forceinline__ float finish(float dot, const Epilogue& e, const PairFigures& f,
                                        std::size_t i, std::size_t j) {
  if (e.q_scales) dot *= f.q_scale * f.x_scale;
  return finish_distance(dot, e.metric, f.q_norm, f.x_norm, e.q32 ? e.q32 + i * e.dim : nullptr,
                         e.x32 ? e.x32 + j * e.dim : nullptr, e.dim);
}

__device__ __forceinline__ float finish(float dot, const Epilogue& e, std::size_t i, std::size_t j) {
  PairFigures f{query_norm(e, i), 0.0f, query_scale(e, i), 1.0f};
  load_row_figures(e, j, f);
  return finish(dot, e, f, i, j);
}

// kEpiloguePerThread independent elements per thread: one per thread left the pass at about
// 2 TB/s, latency-bound.
constexpr int kEpiloguePerThread = 4;

__global__ void epilogue_kernel(float* out, std::size_t ld, std::size_t nq, std::size_t nx,
                                Epilogue e) {
  std::size_t first = blockIdx.x * static_cast<std::size_t>(blockDim.x) * kEpiloguePerThread;
  std::size_t i = blockIdx.y;
  if (i >= nq) return;
  float dot[kEpiloguePerThread];
#pragma unroll
  for (int v = 0; v < kEpiloguePerThread; ++v) {
    std::size_t j = first + v * blockDim.x + threadIdx.x;
    dot[v] = j < nx ? out[i * ld + j] : 0.0f;
  }
#pragma unroll
  for (int v = 0; v < kEpiloguePerThread; ++v) {
    std::size_t j = first + v * blockDim.x + threadIdx.x;
    if (j < nx) out[i * ld + j] = finish(dot[v], e, i, j);
  }
}

// fp32 → three tf32 parts laid out side by side, so that one TF32 GEMM over 3·dim sums
// hi·hi + hi·lo + lo·hi (3×TF32: close to fp32 accuracy on the tensor cores). hi is a rounded
// to tf32 (10 mantissa bits, exact in what the tensor cores read), lo = a − hi (exact in fp32).
// Queries are laid out [hi, hi, lo], corpus rows [hi, lo, hi].
__global__ void split_tf32_kernel(const float* in, std::size_t rows, std::size_t dim, bool corpus,
                                  float* out) {
  std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (t >= rows * dim) return;
  std::size_t r = t / dim, c = t % dim;
  float a = in[t];
  float hi = __uint_as_float((__float_as_uint(a) + 0x1000u) & 0xffffe000u);
  if (!isfinite(a)) hi = a;
  float lo = a - hi;
  float* row = out + r * 3 * dim;
  row[c] = hi;
  row[dim + c] = corpus ? lo : hi;
  row[2 * dim + c] = corpus ? hi : lo;
}

// The power of two that scale_to_fp16 and split_to_fp16 scale a row by (its largest |value|
// into [2^14, 2^15)), from the row's largest |value| and whether all its values are finite: none
// (scalable false) for a row that is not finite or lies outside scale_to_fp16's exponent range.
struct Fp16Scale {
  int exponent = 0;
  bool scalable = false;
  Fp16Scale() = default;
  __device__ Fp16Scale(float largest, bool finite)
      : exponent(largest > 0.0f ? ilogbf(largest) : 0),
        scalable(finite && exponent >= kScaledFp16MinExponent &&
                 exponent <= kScaledFp16MaxExponent) {}
  __device__ float inverse() const { return scalable ? ldexpf(1.0f, 14 - exponent) : 1.0f; }
  __device__ float back() const { return ldexpf(1.0f, exponent - 14); }
};

// A warp's pass over one fp32 row: its squared norm (lane 0's, summed in row_norms_kernel's
// order: the same bits) and its Fp16Scale.
struct RowScale {
  float norm = 0.0f;
  Fp16Scale scale;
  __device__ RowScale(const float* src, std::size_t dim, unsigned lane) {
    float largest = 0.0f;
    bool finite = true;
#pragma unroll 4
    for (std::size_t c = lane; c < dim; c += 32) {
      float v = src[c];
      norm += v * v;
      finite &= fabsf(v) <= 3.402823466e38f;  // false for NaN and infinity
      largest = fmaxf(largest, fabsf(v));
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
      norm += __shfl_down_sync(0xffffffffu, norm, offset);
    }
    scale = Fp16Scale(largest, __all_sync(0xffffffffu, finite));
  }
};

// One warp per row: RowScale's pass, then the scaled copy (see scale_to_fp16 in kernels.cuh).
// One pass over the fp32 rows for both.
__global__ void scale_to_fp16_kernel(const float* in, std::size_t rows, std::size_t dim,
                                     std::size_t padded_dim, __half* out, float* scales,
                                     float* norms) {
  std::size_t row = (blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x) / 32;
  unsigned lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float* src = in + row * dim;
  const RowScale scan(src, dim, lane);
  const float inverse = scan.scale.inverse();
  __half* dst = out + row * padded_dim;
#pragma unroll 4
  for (std::size_t c = lane; c < padded_dim; c += 32) {
    float v = c < dim ? src[c] * inverse : 0.0f;
    dst[c] = scan.scale.scalable || c >= dim ? __float2half_rn(v) : __float2half_rn(NAN);
  }
  if (lane != 0) return;
  scales[row] = scan.scale.scalable ? scan.scale.back() : 1.0f;
  if (norms) norms[row] = scan.norm;
}

// One warp per row of dim % 4 == 0 floats from a 16-byte aligned start, a 16-byte piece a lane:
// the row's largest |value|, finiteness and squared norm, then its hi and lo halves (split_to_fp16
// in kernels.cuh), zeros with scale NaN where the row cannot be scaled. (RowScale's pass and a
// value a lane, as scale_to_fp16 runs, took 0.54 ms for 2^20 rows of 128: 2 TB/s.)
__global__ void split_to_fp16_kernel(const float4* in, std::size_t rows, std::size_t pieces,
                                     std::size_t half_pieces, uint2* out, float* scales,
                                     float* norms) {
  const std::size_t row = (blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x) / 32;
  const unsigned lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float4* src = in + row * pieces;
  float largest = 0.0f, norm = 0.0f;
  bool finite = true;
  for (std::size_t p = lane; p < pieces; p += 32) {
    const float4 v = src[p];
    norm += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    constexpr float kMax = 3.402823466e38f;  // each test false for NaN and infinity
    finite &= fabsf(v.x) <= kMax && fabsf(v.y) <= kMax && fabsf(v.z) <= kMax && fabsf(v.w) <= kMax;
    largest = fmaxf(largest, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
    norm += __shfl_xor_sync(0xffffffffu, norm, offset);
  }
  finite = __all_sync(0xffffffffu, finite);
  const Fp16Scale scale(largest, finite);
  const float inverse = scale.scalable ? scale.inverse() : 0.0f;  // 0: zeros
  uint2* dst = out + row * 2 * half_pieces;
  for (std::size_t p = lane; p < half_pieces; p += 32) {
    const float4 v = p < pieces ? src[p] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float scaled[4] = {v.x * inverse, v.y * inverse, v.z * inverse, v.w * inverse};
    __half hi[4], lo[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // scaled: exact (a power of two); scaled − hi: exact in fp32
      hi[i] = __float2half_rn(scaled[i]);
      lo[i] = __float2half_rn(scaled[i] - __half2float(hi[i]));
    }
    dst[p] = *reinterpret_cast<const uint2*>(hi);
    dst[half_pieces + p] = *reinterpret_cast<const uint2*>(lo);
  }
  if (lane != 0) return;
  scales[row] = scale.scalable ? scale.back() : NAN;
  if (norms) norms[row] = norm;
}

__global__ void widen_int8_kernel(const std::int8_t* in, std::size_t n, __half* out) {
  std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (t < n) out[t] = __int2half_rn(in[t]);
}

__global__ void topk_init_kernel(float* d, std::int32_t* idx, std::size_t count) {
  std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (t < count) {
    d[t] = __int_as_float(0x7fc00000);
    idx[t] = -1;
  }
}

__global__ void apply_upper_bounds_kernel(const float* bounds, std::size_t rows, std::size_t k,
                                          float* d, std::int32_t* idx) {
  std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (t >= rows * k || d[t] <= bounds[t / k]) return;
  d[t] = __int_as_float(0x7fc00000);
  idx[t] = -1;
}

__device__ void bitonic_sort(float* d, int* id, int n) {  // n a power of two, whole block
  for (int size = 2; size <= n; size <<= 1)
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < n / 2; t += blockDim.x) {
        int lo = 2 * t - (t & (stride - 1)), hi = lo + stride;
        bool ascending = (lo & size) == 0;
        if (better(d[hi], id[hi], d[lo], id[lo]) == ascending) {
          float td = d[lo]; d[lo] = d[hi]; d[hi] = td;
          int ti = id[lo]; id[lo] = id[hi]; id[hi] = ti;
        }
      }
      __syncthreads();
    }
}

// The corpus row of candidate column `column` (Epilogue::piece_length: gathered pieces). Columns
// and rows are int32 indices, so 32-bit division (a 64-bit one is a long subroutine).
__device__ __forceinline__ int corpus_row(const Epilogue& e, std::int64_t column) {
  if (e.piece_length == 0) return static_cast<int>(column);
  auto c = static_cast<std::uint32_t>(column), length = static_cast<std::uint32_t>(e.piece_length);
  return static_cast<int>(c / length * static_cast<std::uint32_t>(e.piece_period) + c % length);
}

// 128 threads × 7 independent loads each per step: small blocks (12 fit on an SM, so 1024 rows
// run in one wave; 256-thread blocks at 42 registers took two) with many reads in flight, and one
// step's 896 candidates always fit beside k <= 1024 in the 2048 slots (256 threads × 4, in two
// waves, took 1.4 ms per 1 GiB tile on an H100). 7, not 8: a first step beside k <= 128 then
// sorts 1024 slots, not 2048 (every row sorts at once: that sort was most of a kNN sample's top-k
// pass).
constexpr int kTopkThreads = 128;
constexpr int kTopkPerThread = 7;
static_assert(kTopkThreads * kTopkPerThread + 1024 <= static_cast<int>(kTopkSlots));
// Eight blocks a multiprocessor (at most 64 registers a thread), so that 1024 rows still run in
// one wave on 132 multiprocessors.
constexpr int kTopkBlocksPerMultiprocessor = 8;

// A candidate's index with `base` added (fold_topk: a chunk's rows counted from the corpus's
// first); -1, an empty slot, stays -1.
__device__ __forceinline__ int offset_index(int index, std::int64_t base) {
  return index < 0 ? index : static_cast<int>(index + base);
}

// One block per (row, slice of `slice` candidates): the running top-k list sits sorted in slots
// [0, k); candidates better than its worst are appended after it; when the slots could overflow,
// sort and keep the first k. Block (row, s) folds its slice into list row * gridDim.y + s.
// With epilogue.dim != 0, candidates are dot products turned into distances as they are read.
__global__ void __launch_bounds__(kTopkThreads, kTopkBlocksPerMultiprocessor)
    topk_update_kernel(const float* cand, const std::int32_t* cand_idx,
                                   std::size_t count, std::size_t slice, std::size_t cand_ld,
                                   std::int64_t base, int k, float* run_d, std::int32_t* run_i,
                                   Epilogue epilogue, const std::uint32_t* row_counts) {
  __shared__ float sd[kTopkSlots];
  __shared__ int si[kTopkSlots];
  __shared__ int added;
  std::size_t row = blockIdx.x;
  std::size_t list = row * gridDim.y + blockIdx.y;
  if (row_counts && row_counts[row] < count) count = row_counts[row];
  std::size_t first = blockIdx.y * slice;
  if (first >= count) return;  // the whole block: no barrier is skipped by part of it
  std::size_t last = first + slice < count ? first + slice : count;
  for (int t = threadIdx.x; t < static_cast<int>(kTopkSlots); t += blockDim.x) {
    sd[t] = t < k ? run_d[list * k + t] : __int_as_float(0x7fc00000);
    si[t] = t < k ? run_i[list * k + t] : -1;
  }
  if (threadIdx.x == 0) added = 0;
  __syncthreads();
  const int capacity = static_cast<int>(kTopkSlots) - k;
  auto compact = [&] {
    int n = 1;
    while (n < k + added) n <<= 1;
    bitonic_sort(sd, si, n);
    for (int t = k + threadIdx.x; t < n; t += blockDim.x) {
      sd[t] = __int_as_float(0x7fc00000);
      si[t] = -1;
    }
    __syncthreads();
    if (threadIdx.x == 0) added = 0;
    __syncthreads();
  };
  const std::size_t step = static_cast<std::size_t>(blockDim.x) * kTopkPerThread;
  const float* row_cand = cand + row * cand_ld;
  PairFigures query;  // this row's figures, once
  if (epilogue.dim != 0) query = {query_norm(epilogue, row), 0.0f, query_scale(epilogue, row), 1.0f};
  for (std::size_t start = first; start < last; start += step) {
    int pending = added;  // every thread reads it before anyone changes it
    bool unfilled = si[k - 1] < 0;  // fewer than k so far: every candidate would be appended
    const std::size_t end = start + step < last ? start + step : last;
    __syncthreads();
    // Compact when the slots could overflow, and as soon as a list short of k has candidates:
    // its worst then becomes a real threshold before the next step appends everything again.
    if (pending + static_cast<int>(step) > capacity || (unfilled && pending > 0)) compact();
    float worst_d = sd[k - 1];
    int worst_i = si[k - 1];
    // The step's loads all go out before any is used (candidates and their rows' figures).
    float d[kTopkPerThread];
    PairFigures f[kTopkPerThread];
#pragma unroll
    for (int v = 0; v < kTopkPerThread; ++v) {
      std::size_t j = start + v * blockDim.x + threadIdx.x;
      d[v] = j < end ? row_cand[j] : 0.0f;
      f[v] = query;
      if (epilogue.dim != 0 && j < end) load_row_figures(epilogue, j, f[v]);
    }
#pragma unroll
    for (int v = 0; v < kTopkPerThread; ++v) {
      std::size_t j = start + v * blockDim.x + threadIdx.x;
      if (j >= end) continue;
      float value = d[v];
      if (epilogue.dim != 0) value = finish(value, epilogue, f[v], row, j);
      // A candidate worse than the list's worst (both numbers, the worst a real row: any row
      // beats an empty slot, index -1) loses whatever its index, so its index (a load, or a
      // gathered column's corpus row) is looked up only for the rest: most candidates.
      if (worst_i >= 0 && value > worst_d) continue;
      int id = cand_idx ? offset_index(cand_idx[row * cand_ld + j], base)
                        : corpus_row(epilogue, base + j);
      if (better(value, id, worst_d, worst_i)) {
        int pos = atomicAdd(&added, 1);
        sd[k + pos] = value;
        si[k + pos] = id;
      }
    }
    __syncthreads();
  }
  if (added > 0) compact();
  for (int t = threadIdx.x; t < k; t += blockDim.x) {
    run_d[list * k + t] = sd[t];
    run_i[list * k + t] = si[t];
  }
}

// One warp per (query row, candidate): lane l sums elements l, l + 32, ... of the pair with
// fp32 FMA in that order (a warp reads 128 contiguous bytes of the candidate's row per step), then
// an xor butterfly adds the lanes in a fixed order, so every run gives the same bits.
constexpr int kRerankWarps = 8;
constexpr std::size_t kRerankBlocks = 4096;  // about 4 waves of 8 blocks per SM (132 SMs)

__device__ void rerank_slot(const float* q, const float* x32, std::size_t dim, Metric metric,
                            int j, float* out, int lane) {
  if (j < 0) {
    if (lane == 0) *out = __int_as_float(0x7fc00000);
    return;
  }
  const float* x = x32 + static_cast<std::size_t>(j) * dim;
  float acc = 0.0f, qq = 0.0f, xx = 0.0f;
  for (std::size_t e = lane; e < dim; e += 32) {
    float a = q[e], b = x[e];
    if (metric == Metric::L2) {
      float d = a - b;
      acc = fmaf(d, d, acc);
    } else {
      acc = fmaf(a, b, acc);
      if (metric == Metric::Cosine) {
        qq = fmaf(a, a, qq);
        xx = fmaf(b, b, xx);
      }
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    qq += __shfl_xor_sync(0xffffffffu, qq, offset);
    xx += __shfl_xor_sync(0xffffffffu, xx, offset);
  }
  if (lane != 0) return;
  // L2 is already the direct-form sum; inner product and cosine share the GEMM epilogue's
  // finish (qq / xx as the squared norms of this one pair).
  *out = metric == Metric::L2 ? clamp_low(acc, 0.0f)
                              : finish_distance(acc, metric, qq, xx, nullptr, nullptr, 0);
}

// Block (row, y) takes the row's candidates y·8 + w, stepping by gridDim.y·8 (w: its warp), up to
// the row's count: the filter's lists are mostly empty slots (capacity 4× the expected count),
// which a warp per slot paid for (ncu: about 1.1 ms an fp32-accurate kNN call, docs/kernels.md).
__global__ void __launch_bounds__(kRerankWarps * 32)
    rerank_kernel(const float* q32, const float* x32, std::size_t dim, Metric metric,
                  const std::int32_t* cand_i, std::size_t candidates, float* cand_d,
                  const std::uint32_t* row_counts) {
  std::size_t row = blockIdx.x;
  std::size_t used = candidates;
  if (row_counts) used = min(used, static_cast<std::size_t>(row_counts[row]));
  std::size_t step = static_cast<std::size_t>(gridDim.y) * kRerankWarps;
  for (std::size_t c = blockIdx.y * kRerankWarps + threadIdx.x / 32; c < used; c += step) {
    std::size_t slot = row * candidates + c;
    rerank_slot(q32 + row * dim, x32, dim, metric, cand_i[slot], &cand_d[slot], threadIdx.x % 32);
  }
}

__global__ void convert_elementwise_kernel(Matrix in, std::size_t dim, std::size_t n, Element out_e,
                                           void* out) {
  std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (t >= n) return;
  float v = load(in.data, in.element, t);
  if (in.element == Element::Int8) v *= in.scales[t / dim];
  switch (out_e) {
    case Element::Fp32: static_cast<float*>(out)[t] = v; break;
    case Element::Fp16: static_cast<__half*>(out)[t] = __float2half_rn(v); break;
    case Element::Bf16: static_cast<__nv_bfloat16*>(out)[t] = __float2bfloat16_rn(v); break;
    default: break;
  }
}

__device__ float load_stored(const void* stored, int element, std::size_t i) {
  switch (element) {
    case 0: return static_cast<const std::uint8_t*>(stored)[i];
    case 1: return static_cast<const std::int8_t*>(stored)[i];
    case 2: return __half2float(static_cast<const __half*>(stored)[i]);
    default: return static_cast<const float*>(stored)[i];
  }
}

// Grid-stride over the values; each thread converts kStoredPerThread neighbours per step so that
// byte-wide loads and stores still move whole words per warp.
constexpr unsigned kStoredPerThread = 4;
__global__ void convert_stored_kernel(const void* stored, int element, std::size_t count,
                                      float offset, int exponent, Element out_e, void* out) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x * kStoredPerThread;
  for (std::size_t first = (blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x) *
                           kStoredPerThread;
       first < count; first += stride) {
    const std::size_t end = first + kStoredPerThread < count ? first + kStoredPerThread : count;
    for (std::size_t i = first; i < end; ++i) {
      float v = load_stored(stored, element, i) + offset;
      if (exponent != 0) v = scalbnf(v, exponent);
      switch (out_e) {
        case Element::Fp32: static_cast<float*>(out)[i] = v; break;
        case Element::Fp16: static_cast<__half*>(out)[i] = __float2half_rn(v); break;
        case Element::Bf16: static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v); break;
        case Element::Int8:
          static_cast<std::int8_t*>(out)[i] =
              isnan(v) ? std::int8_t{0}
                       : static_cast<std::int8_t>(fminf(fmaxf(roundf(v), -128.0f), 127.0f));
          break;
      }
    }
  }
}

// fp32 → int8, one block (256 threads) per row: scale = max|x| / 127 (0 for a zero row, NaN with
// zeros for a row holding NaN or infinity).
__global__ void quantize_kernel(const float* in, std::size_t dim, std::int8_t* out, float* scales) {
  __shared__ float maxima[256];
  __shared__ int finite_all;
  std::size_t row = blockIdx.x;
  if (threadIdx.x == 0) finite_all = 1;
  __syncthreads();
  float m = 0.0f;
  for (std::size_t c = threadIdx.x; c < dim; c += blockDim.x) {
    float v = in[row * dim + c];
    if (!isfinite(v)) finite_all = 0;
    m = fmaxf(m, fabsf(v));
  }
  maxima[threadIdx.x] = m;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s /= 2) {
    if (static_cast<int>(threadIdx.x) < s)
      maxima[threadIdx.x] = fmaxf(maxima[threadIdx.x], maxima[threadIdx.x + s]);
    __syncthreads();
  }
  float max_abs = maxima[0];
  bool finite = finite_all != 0;
  float scale = max_abs / 127.0f;
  for (std::size_t c = threadIdx.x; c < dim; c += blockDim.x) {
    float q = 0.0f;
    if (finite && max_abs != 0.0f) q = fminf(fmaxf(rintf(in[row * dim + c] / scale), -127.f), 127.f);
    out[row * dim + c] = static_cast<std::int8_t>(q);
  }
  if (threadIdx.x == 0) scales[row] = !finite ? __int_as_float(0x7fc00000) : (max_abs == 0.f ? 0.f : scale);
}

unsigned blocks_for(std::size_t n, unsigned threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

}  // namespace

Status set_device(int ordinal) { return cuda_status(cudaSetDevice(ordinal), "cudaSetDevice"); }

Status row_norms(const Matrix& m, std::size_t dim, float* out, void* stream) {
  if (m.rows == 0) return {};
  auto s = static_cast<cudaStream_t>(stream);
  const std::size_t row_bytes = dim * element_bytes(m.element);
  const bool pieces = m.element != Element::Fp32 && row_bytes % 16 == 0 &&
                      reinterpret_cast<std::uintptr_t>(m.data) % 16 == 0;
  if (pieces) {
    const std::size_t per_row = row_bytes / 16;
    unsigned group = 1;
    while (group < 32 && group < per_row) group *= 2;
    const dim3 blocks(blocks_for(m.rows * group, 256));
    switch (m.element) {
      case Element::Int8:
        row_norms_pieces_kernel<Element::Int8><<<blocks, 256, 0, s>>>(m, per_row, group, out);
        break;
      case Element::Bf16:
        row_norms_pieces_kernel<Element::Bf16><<<blocks, 256, 0, s>>>(m, per_row, group, out);
        break;
      default:
        row_norms_pieces_kernel<Element::Fp16><<<blocks, 256, 0, s>>>(m, per_row, group, out);
    }
  } else {
    row_norms_kernel<<<blocks_for(m.rows, 8), 256, 0, s>>>(m, dim, out);
  }
  return launch_status("row_norms kernel");
}

Status dot_products(int ordinal, const Matrix& q, const Matrix& x, std::size_t x0, std::size_t nx,
                    std::size_t dim, bool tf32, float* out, std::size_t ld, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (q.rows == 0 || nx == 0) return {};
  if (nx > INT_MAX || q.rows > INT_MAX || dim > INT_MAX || ld > INT_MAX) {
    Status st;
    st.cublas = CUBLAS_STATUS_INVALID_VALUE;
    st.what = "cublasGemmEx (a dimension exceeds INT_MAX)";
    return st;
  }
  cudaDataType_t type = x.element == Element::Fp32   ? CUDA_R_32F
                        : x.element == Element::Fp16 ? CUDA_R_16F
                                                     : CUDA_R_16BF;
  std::size_t esize = x.element == Element::Fp32 ? 4 : 2;
  cublasComputeType_t compute =
      (x.element == Element::Fp32 && tf32) ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const float alpha = 1.0f, beta = 0.0f;
  {
    std::lock_guard lock(g_handles_mutex);
    cublasHandle_t& handle = g_handles[ordinal];
    if (!handle) {
      cublasStatus_t st = cublasCreate(&handle);
      if (st != CUBLAS_STATUS_SUCCESS) {
        handle = nullptr;
        Status r;
        r.cublas = static_cast<int>(st);
        r.what = "cublasCreate";
        return r;
      }
    }
    cublasStatus_t st = cublasSetStream(handle, s);
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasSetMathMode(handle, compute == CUBLAS_COMPUTE_32F_FAST_TF32
                                         ? CUBLAS_TF32_TENSOR_OP_MATH
                                         : CUBLAS_DEFAULT_MATH);
    // Column-major view: C (nx × nq, ldc = ld) = X^T (nx × dim) · Q (dim × nq).
    const void* a = static_cast<const char*>(x.data) + x0 * dim * esize;
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(nx),
                        static_cast<int>(q.rows), static_cast<int>(dim), &alpha, a, type,
                        static_cast<int>(dim), q.data, type, static_cast<int>(dim), &beta, out,
                        CUDA_R_32F, static_cast<int>(ld), compute, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) {
      Status r;
      r.cublas = static_cast<int>(st);
      r.what = "cublasGemmEx";
      return r;
    }
  }
  return {};
}

Status distances(int ordinal, const Matrix& q, const Matrix& x, std::size_t x0, std::size_t nx,
                 std::size_t dim, bool tf32, const Epilogue& epilogue, float* out, std::size_t ld,
                 void* stream) {
  if (q.rows == 0 || nx == 0) return {};
  if (Status st = dot_products(ordinal, q, x, x0, nx, dim, tf32, out, ld, stream); !st.ok())
    return st;
  dim3 grid(blocks_for(nx, 256 * kEpiloguePerThread), static_cast<unsigned>(q.rows));
  epilogue_kernel<<<grid, 256, 0, static_cast<cudaStream_t>(stream)>>>(out, ld, q.rows, nx,
                                                                       epilogue);
  return launch_status("distance epilogue kernel");
}

Status widen_int8(const Matrix& m, std::size_t row0, std::size_t rows, std::size_t dim,
                  void* out, void* stream) {
  std::size_t n = rows * dim;
  if (n == 0) return {};
  widen_int8_kernel<<<blocks_for(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const std::int8_t*>(m.data) + row0 * dim, n, static_cast<__half*>(out));
  return launch_status("int8 widen kernel");
}

Status scale_to_fp16(const float* in, std::size_t rows, std::size_t dim, void* out, float* scales,
                     float* norms, void* stream) {
  if (rows == 0) return {};
  scale_to_fp16_kernel<<<blocks_for(rows, 8), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      in, rows, dim, scaled_fp16_dim(dim), static_cast<__half*>(out), scales, norms);
  return launch_status("fp16 scaling kernel");
}

Status split_to_fp16(const float* in, std::size_t rows, std::size_t dim, void* out, float* scales,
                     float* norms, void* stream) {
  if (rows == 0) return {};
  if (dim % 4 != 0 || reinterpret_cast<std::uintptr_t>(in) % 16 != 0 ||
      reinterpret_cast<std::uintptr_t>(out) % 16 != 0)
    return cuda_failure(cudaErrorInvalidValue,
                        "fp16 halves kernel (rows of whole 16-byte pieces, 16-byte aligned)");
  split_to_fp16_kernel<<<blocks_for(rows, 8), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const float4*>(in), rows, dim / 4, fp16_halves_dim(dim) / 4,
      static_cast<uint2*>(out), scales, norms);
  return launch_status("fp16 halves kernel");
}

Status gather_pieces(const void* rows, std::size_t row_bytes, std::size_t pieces,
                     std::size_t period, std::size_t length, void* out, void* stream) {
  if (pieces == 0 || length == 0) return {};
  return cuda_status(cudaMemcpy2DAsync(out, length * row_bytes, rows, period * row_bytes,
                                       length * row_bytes, pieces, cudaMemcpyDeviceToDevice,
                                       static_cast<cudaStream_t>(stream)),
                     "cudaMemcpy2DAsync (gathering the kNN sample)");
}

Status split_tf32(const Matrix& m, std::size_t row0, std::size_t rows, std::size_t dim,
                  bool corpus, float* out, void* stream) {
  std::size_t n = rows * dim;
  if (n == 0) return {};
  split_tf32_kernel<<<blocks_for(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const float*>(m.data) + row0 * dim, rows, dim, corpus, out);
  return launch_status("3xTF32 split kernel");
}

PairwiseScratch pairwise_scratch(const Matrix& q, const Matrix& x, std::size_t dim, Metric metric,
                                 bool tf32, bool halves) {
  PairwiseScratch s;
  auto take = [&s](std::size_t bytes) {
    const std::size_t offset = s.bytes;
    s.bytes += (bytes + 255) / 256 * 256;
    return offset;
  };
  const bool fused = fused_matrix(x.element, q.rows, dim, tf32);
  if (metric != Metric::InnerProduct) {
    s.q_norms = take(q.rows * sizeof(float));
    if (!(fused && matrix_sums_corpus_norms(x, q.rows, dim, !tf32)))
      s.x_norms = take(x.rows * sizeof(float));
  }
  if (!fused && x.element == Element::Int8) {
    s.q16 = take(q.rows * dim * 2);
    s.x16 = take(x.rows * dim * 2);
  }
  if (halves && matrix_takes_halves(q, x, dim, !tf32)) {
    const std::size_t row_bytes = 2 * fp16_halves_dim(dim) * sizeof(__half);
    s.q_halves = take(q.rows * row_bytes);
    s.x_halves = take(x.rows * row_bytes);
    s.q_scales = take(q.rows * sizeof(float));
    s.x_scales = take(x.rows * sizeof(float));
  }
  return s;
}

namespace {

// The fp32-accurate matrix's operands as split_to_fp16's halves (with the rows' norms, where
// `norms`, from the same pass), and the fused kernel's arguments on them.
Status split_operands(const Matrix& q, const Matrix& x, std::size_t dim, void* q_halves,
                      void* x_halves, float* q_scales, float* x_scales, float* q_norms,
                      float* x_norms, MatrixArgs& args, void* stream) {
  if (Status st = split_to_fp16(static_cast<const float*>(q.data), q.rows, dim, q_halves,
                                q_scales, q_norms, stream);
      !st.ok())
    return st;
  if (Status st = split_to_fp16(static_cast<const float*>(x.data), x.rows, dim, x_halves,
                                x_scales, x_norms, stream);
      !st.ok())
    return st;
  args.q_halves = q_halves;
  args.x_halves = x_halves;
  args.q.scales = q_scales;
  args.x.scales = x_scales;
  return {};
}

}  // namespace

Status pairwise(int ordinal, const Matrix& q, const Matrix& x, std::size_t dim, Metric metric,
                bool tf32, const PairwiseScratch& layout, void* scratch, float* out, void* stream) {
  auto at = [scratch](std::size_t offset) -> void* {
    return offset == PairwiseScratch::kNone ? nullptr : static_cast<char*>(scratch) + offset;
  };
  Epilogue e;
  e.metric = metric;
  e.dim = dim;
  e.q_norms = static_cast<const float*>(at(layout.q_norms));
  e.x_norms = static_cast<const float*>(at(layout.x_norms));
  if (layout.x_halves != PairwiseScratch::kNone) {
    MatrixArgs fused{q, x, dim, metric, !tf32, e.q_norms, e.x_norms, out};
    if (Status st = split_operands(q, x, dim, at(layout.q_halves), at(layout.x_halves),
                                   static_cast<float*>(at(layout.q_scales)),
                                   static_cast<float*>(at(layout.x_scales)),
                                   const_cast<float*>(e.q_norms), const_cast<float*>(e.x_norms),
                                   fused, stream);
        !st.ok())
      return st;
    return distance_matrix(fused, stream);
  }
  if (e.q_norms)
    if (Status st = row_norms(q, dim, const_cast<float*>(e.q_norms), stream); !st.ok()) return st;
  if (e.x_norms)
    if (Status st = row_norms(x, dim, const_cast<float*>(e.x_norms), stream); !st.ok()) return st;
  if (fused_matrix(x.element, q.rows, dim, tf32)) {
    MatrixArgs fused{q, x, dim, metric, !tf32, e.q_norms, e.x_norms, out};
    return distance_matrix(fused, stream);
  }
  if (metric == Metric::L2 && x.element == Element::Fp32 && !tf32) {  // cancellation re-compute
    e.q32 = static_cast<const float*>(q.data);
    e.x32 = static_cast<const float*>(x.data);
  }
  Matrix gq = q, gx = x;
  if (x.element == Element::Int8) {
    void* q16 = at(layout.q16);
    void* x16 = at(layout.x16);
    if (Status st = widen_int8(q, 0, q.rows, dim, q16, stream); !st.ok()) return st;
    if (Status st = widen_int8(x, 0, x.rows, dim, x16, stream); !st.ok()) return st;
    gq = Matrix{q16, Element::Fp16, nullptr, q.rows};
    gx = Matrix{x16, Element::Fp16, nullptr, x.rows};
    e.q_scales = q.scales;
    e.x_scales = x.scales;
  }
  return distances(ordinal, gq, gx, 0, x.rows, dim, tf32, e, out, x.rows, stream);
}

Status topk_init(float* run_d, std::int32_t* run_i, std::size_t count, void* stream) {
  topk_init_kernel<<<blocks_for(count, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(run_d, run_i,
                                                                                         count);
  return launch_status("top-k init kernel");
}

Status apply_upper_bounds(const float* bounds, std::size_t rows, std::size_t k, float* run_d,
                          std::int32_t* run_i, void* stream) {
  std::size_t count = rows * k;
  if (count == 0) return {};
  apply_upper_bounds_kernel<<<blocks_for(count, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      bounds, rows, k, run_d, run_i);
  return launch_status("upper bounds kernel");
}

Status topk_update(const float* cand, const std::int32_t* cand_idx, std::size_t rows,
                   std::size_t count, std::size_t cand_ld, std::int64_t base, std::size_t k,
                   float* run_d, std::int32_t* run_i, void* stream, const Epilogue* epilogue,
                   const std::uint32_t* row_counts) {
  if (rows == 0 || count == 0) return {};
  Epilogue e = epilogue ? *epilogue : Epilogue{};
  topk_update_kernel<<<static_cast<unsigned>(rows), kTopkThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      cand, cand_idx, count, count, cand_ld, base, static_cast<int>(k), run_d, run_i, e, row_counts);
  return launch_status("top-k update kernel");
}

std::size_t topk_slices(std::size_t rows, std::size_t count, std::size_t k) {
  if (rows >= kTopkBusyBlocks) return 1;
  std::size_t wanted = (kTopkBusyBlocks + rows - 1) / rows;
  std::size_t by_length = count / kTopkMinSlice;
  std::size_t by_merge = kTopkMaxMerge / k;
  std::size_t slices = wanted < by_length ? wanted : by_length;
  slices = slices < by_merge ? slices : by_merge;
  return slices > 1 ? slices : 1;
}

Status topk_update_split(const float* cand, std::size_t rows, std::size_t count,
                         std::size_t cand_ld, std::int64_t base, std::size_t k,
                         std::size_t slices, float* part_d, std::int32_t* part_i, float* run_d,
                         std::int32_t* run_i, void* stream, const Epilogue* epilogue) {
  if (rows == 0 || count == 0) return {};
  auto s = static_cast<cudaStream_t>(stream);
  if (Status st = topk_init(part_d, part_i, rows * slices * k, stream); !st.ok()) return st;
  Epilogue e = epilogue ? *epilogue : Epilogue{};
  std::size_t slice = (count + slices - 1) / slices;
  dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(slices));
  topk_update_kernel<<<grid, kTopkThreads, 0, s>>>(cand, nullptr, count, slice, cand_ld, base,
                                                   static_cast<int>(k), part_d, part_i, e,
                                                   nullptr);
  if (Status st = launch_status("top-k slice kernel"); !st.ok()) return st;
  // The slices' lists (final distances, their own indices) into the running lists.
  return topk_update(part_d, part_i, rows, slices * k, slices * k, 0, k, run_d, run_i, stream);
}

Status rerank_distances(const float* queries, const float* corpus, std::size_t rows,
                        std::size_t dim, Metric metric, const std::int32_t* cand_i,
                        std::size_t candidates, float* cand_d, void* stream,
                        const std::uint32_t* row_counts) {
  if (rows == 0 || candidates == 0) return {};
  // Counted lists (mostly empty): about kRerankBlocks blocks in all. gridDim.y stays within
  // CUDA's 65535; the warps loop over the rest.
  std::size_t per_row = blocks_for(candidates, kRerankWarps);
  if (row_counts) per_row = std::min(per_row, (kRerankBlocks + rows - 1) / rows);
  per_row = std::min<std::size_t>(per_row, 65535);
  dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(per_row));
  rerank_kernel<<<grid, kRerankWarps * 32, 0, static_cast<cudaStream_t>(stream)>>>(
      queries, corpus, dim, metric, cand_i, candidates, cand_d, row_counts);
  return launch_status("re-rank distance kernel");
}

Status convert(const Matrix& in, std::size_t dim, Element out, void* out_data, float* out_scales,
               void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (out == Element::Int8) {
    quantize_kernel<<<static_cast<unsigned>(in.rows), 256, 0, s>>>(
        static_cast<const float*>(in.data), dim, static_cast<std::int8_t*>(out_data), out_scales);
    return launch_status("quantize kernel");
  }
  std::size_t n = in.rows * dim;
  convert_elementwise_kernel<<<blocks_for(n, 256), 256, 0, s>>>(in, dim, n, out, out_data);
  return launch_status("convert kernel");
}

Status convert_stored(const void* stored, int stored_element, std::size_t count, float offset,
                      int exponent, Element out, void* out_data, void* stream) {
  if (count == 0) return {};
  const std::size_t threads = (count + kStoredPerThread - 1) / kStoredPerThread;
  const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>((threads + 255) / 256, 65535u * 4));
  convert_stored_kernel<<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      stored, stored_element, count, offset, exponent, out, out_data);
  return launch_status("convert_stored kernel");
}

}  // namespace gpupool::cuda_kernels
