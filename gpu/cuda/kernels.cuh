// Internal: the CUDA kernels of gpupool:kernels, behind the plain types of the kernels'
// vocabulary so that the CUDA kernel backend (gpu/cuda_backend.cpp) can call them (.cu files
// cannot import modules). Defined by what they compute: row_norms.cu, operand_copies.cu,
// conversions.cu, gemm_distances.cu, running_topk.cu, rerank_distances.cu (gpu/cuda/README.md
// maps the files). Streams are cudaStream_t passed as void*. Arguments are validated by the
// caller.
#pragma once

#include "../kernel_vocabulary.hpp"

#include <cstddef>
#include <cstdint>

namespace gpupool::cuda_kernels {

// The kernels are called in the vocabulary they share with the CPU kernels and the module.
using kernels::Element;
using kernels::element_bytes;
using kernels::Matrix;
using kernels::Metric;
using kernels::Status;

inline Status cuda_failure(int error, const char* what) {
  Status st;
  st.cuda = error;
  st.what = what;
  return st;
}

// Whether the fused tensor-core kernels (the distance matrix, the kNN filter) read rows of this
// element type and length: whole 16-byte chunks, the unit of their asynchronous copies. fp16 /
// bf16 with dim % 8 == 0, fp32 with dim % 4 == 0, int8 with dim % 16 == 0.
inline bool tiles_read_rows(Element element, std::size_t dim) {
  return dim * element_bytes(element) % 16 == 0;
}

inline constexpr std::size_t kTopkSlots = 2048;  // shared-memory candidates per query (k <= 1024)

Status set_device(int ordinal);
// Squared L2 norms of every row (dequantised), fp32 accumulation.
Status row_norms(const Matrix& m, std::size_t dim, float* out, void* stream);
// Where pairwise()'s temporaries (row norms, int8 rows widened to fp16) lie in the one block of
// scratch its caller provides (from the pool): byte offsets, 256-byte aligned, kNone where the
// call makes no such temporary; `bytes` in all (0: no scratch).
struct PairwiseScratch {
  static constexpr std::size_t kNone = ~std::size_t{0};
  std::size_t q_norms = kNone, x_norms = kNone, q16 = kNone, x16 = kNone;
  // fp32-accurate on the resident kernel: split_to_fp16's rows and scales
  std::size_t q_halves = kNone, x_halves = kNone, q_scales = kNone, x_scales = kNone;
  std::size_t bytes = 0;
};
// halves: the fp32-accurate matrix may take split_to_fp16's copies of both operands, where the
// resident kernel runs on them (matrix_takes_halves: q.rows + x.rows rows of 4 · h bytes more);
// false keeps it on the 3×TF32 kernel, for callers that cannot spare that memory.
PairwiseScratch pairwise_scratch(const Matrix& q, const Matrix& x, std::size_t dim, Metric metric,
                                 bool tf32, bool halves);
// The whole Q × N matrix: the fused kernel (distance_matrix.cuh) where it takes the rows, else
// cuBLAS and an epilogue pass. `layout`: pairwise_scratch of the same arguments; `scratch`: its
// `bytes` on the device.
Status pairwise(int ordinal, const Matrix& q, const Matrix& x, std::size_t dim, Metric metric,
                bool tf32, const PairwiseScratch& layout, void* scratch, float* out, void* stream);
// The GEMM part of distances() alone: out[i * ld + j] = q row i · x row x0 + j (fp32 / fp16 /
// bf16 only), for a caller that turns dot products into distances itself (topk_update's Epilogue).
Status dot_products(int ordinal, const Matrix& q, const Matrix& x, std::size_t x0, std::size_t nx,
                    std::size_t dim, bool tf32, float* out, std::size_t ld, void* stream);
// Turns candidate dot products into distances inside topk_update, so that the Q × tile matrix is
// read once (no separate epilogue pass). q_norms / x_norms as for distances(), x_norms and x32
// already offset to the tile's first row; q32 / x32: fp32 rows for the fp32-accurate L2 re-compute
// of cancelled pairs (null otherwise).
struct Epilogue {
  Metric metric = Metric::L2;
  const float* q_norms = nullptr;
  const float* x_norms = nullptr;
  const float* q32 = nullptr;
  const float* x32 = nullptr;
  std::size_t dim = 0;
  // Int8 inputs (GEMM on their fp16 widening): the per-row scales, x_scales offset like x_norms.
  const float* q_scales = nullptr;
  const float* x_scales = nullptr;
  // Candidates from rows gathered by gather_pieces (piece_length != 0): candidate base + j is
  // corpus row (p / piece_length) · piece_period + p % piece_length, p = base + j.
  std::size_t piece_period = 0;
  std::size_t piece_length = 0;
};
// Rows [p · period, p · period + length) of `rows` (row_bytes each) for p < pieces, side by side
// into out (pieces · length rows): one strided copy.
Status gather_pieces(const void* rows, std::size_t row_bytes, std::size_t pieces,
                     std::size_t period, std::size_t length, void* out, void* stream);
// out[i * ld + j] = distance(q row i, x row x0 + j) for j < nx: dot_products, then an epilogue
// pass (fp32 / fp16 / bf16 inputs; int8 ones widened first, see widen_int8).
Status distances(int ordinal, const Matrix& q, const Matrix& x, std::size_t x0, std::size_t nx,
                 std::size_t dim, bool tf32, const Epilogue& epilogue, float* out, std::size_t ld,
                 void* stream);
// Int8 rows [row0, row0 + rows) of m → fp16 (exactly: |value| <= 127), unscaled, into out.
Status widen_int8(const Matrix& m, std::size_t row0, std::size_t rows, std::size_t dim,
                  void* out, void* stream);
// Fp32 rows [row0, row0 + rows) of m → rows of 3·dim floats for a 3×TF32 GEMM (dot_products with
// tf32 = true and 3·dim): queries (corpus = false) as [hi, hi, lo], corpus rows as [hi, lo, hi].
Status split_tf32(const Matrix& m, std::size_t row0, std::size_t rows, std::size_t dim,
                  bool corpus, float* out, void* stream);
// Fp32 rows → fp16 rows of padded_dim values (dim rounded up to whole 16-byte chunks, zeros past
// dim), each row divided by its own power of two scale (scales[r]) so that its largest |value|
// lands in [2^14, 2^15): every value keeps fp16's 2^-11 relative rounding (values below 2^-14 of
// the row's largest become subnormals, off by at most 2^-39 of it), and scale × an fp16 product
// sum is exact. The fp32-accurate kNN filter's operands. A row that is not finite, or whose
// largest |value| lies outside [2^-40, 2^41), becomes NaN (scale 1), so that its products are
// NaN and the filter leaves it to the exact re-rank; a zero row stays zero. norms (if not null):
// the rows' squared norms as row_norms gives them, from the same pass.
inline constexpr int kScaledFp16MinExponent = -40;
inline constexpr int kScaledFp16MaxExponent = 40;
inline std::size_t scaled_fp16_dim(std::size_t dim) { return (dim + 7) / 8 * 8; }
Status scale_to_fp16(const float* in, std::size_t rows, std::size_t dim, void* out, float* scales,
                     float* norms, void* stream);
// Fp32 rows → rows of two fp16 halves, the fp32-accurate matrix's operands on the resident kernel
// (wgmma::Fp16Halves): values [0, h) of a row are its hi values, [h, 2h) its lo, where
// h = fp16_halves_dim(dim) (whole 128-byte chunks; zeros past dim). Each row is scaled as
// scale_to_fp16 scales it (scales[r]: the power of two back), hi = fp16(v) and lo = fp16(v − hi).
// A row that scale_to_fp16 cannot scale becomes zeros with scale NaN: its products come out NaN,
// and the matrix kernel computes that row's pairs from the fp32 rows. norms (if not null): the
// rows' squared norms from the same pass (fp32 sums, in its own order). Rows of whole 16-byte
// pieces (dim % 4 == 0) from a 16-byte aligned `in`, into a 16-byte aligned `out`.
#ifdef __CUDACC__
#define GPUPOOL_HOST_DEVICE __host__ __device__
#else
#define GPUPOOL_HOST_DEVICE
#endif
GPUPOOL_HOST_DEVICE constexpr std::size_t fp16_halves_dim(std::size_t dim) {
  return (dim + 63) / 64 * 64;
}
#undef GPUPOOL_HOST_DEVICE
Status split_to_fp16(const float* in, std::size_t rows, std::size_t dim, void* out, float* scales,
                     float* norms, void* stream);
// Running top-k lists (rows × k): empty (NaN, -1) before the first update.
Status topk_init(float* run_d, std::int32_t* run_i, std::size_t count, void* stream);
// knn's upper bounds: entries of the rows × k lists whose distance is not at most bounds[row]
// become index -1, distance NaN.
Status apply_upper_bounds(const float* bounds, std::size_t rows, std::size_t k, float* run_d,
                          std::int32_t* run_i, void* stream);
// Folds `count` candidates per row (row stride cand_ld; index cand_idx[...] + base, -1 kept, or
// base + column) into each row's sorted running top-k. With `epilogue`, candidates are dot products (column j
// pairs with corpus row base + j) and become distances on the way in. With `row_counts`, row r
// has only min(row_counts[r], count) candidates (the knn filter's lists).
Status topk_update(const float* cand, const std::int32_t* cand_idx, std::size_t rows,
                   std::size_t count, std::size_t cand_ld, std::int64_t base, std::size_t k,
                   float* run_d, std::int32_t* run_i, void* stream,
                   const Epilogue* epilogue = nullptr,
                   const std::uint32_t* row_counts = nullptr);
// Few rows (a handful of queries) leave most of the GPU idle with one block per row: the
// candidates of each row are then cut into `slices` (topk_slices), each folded into a partial
// list of its own (part_d / part_i: rows × slices × k, scratch), and those lists into the
// running top-k. topk_slices: 1 when rows alone keep the GPU busy, otherwise enough slices for
// kTopkBusyBlocks blocks, each at least kTopkMinSlice candidates, at most kTopkMaxMerge
// candidates left to merge per row.
inline constexpr std::size_t kTopkBusyBlocks = 1024;  // about one wave of top-k blocks (132 SMs)
inline constexpr std::size_t kTopkMinSlice = 2048;
inline constexpr std::size_t kTopkMaxMerge = 65536;
std::size_t topk_slices(std::size_t rows, std::size_t count, std::size_t k);
Status topk_update_split(const float* cand, std::size_t rows, std::size_t count,
                         std::size_t cand_ld, std::int64_t base, std::size_t k,
                         std::size_t slices, float* part_d, std::int32_t* part_i, float* run_d,
                         std::int32_t* run_i, void* stream, const Epilogue* epilogue);
// Exact re-rank distances: cand_d[r * candidates + c] = distance(queries row r, corpus row
// cand_i[r * candidates + c]) from the fp32 rows in the direct form (L2 Σ(q−x)², never the GEMM
// form), one warp per candidate reading the row coalesced over dim, fp32 FMA in a fixed order;
// index -1 gives NaN; slots at or past row_counts[r] (if given) are left alone. The selection is
// then topk_update with cand_i.
Status rerank_distances(const float* queries, const float* corpus, std::size_t rows,
                        std::size_t dim, Metric metric, const std::int32_t* cand_i,
                        std::size_t candidates, float* cand_d, void* stream,
                        const std::uint32_t* row_counts = nullptr);
// fp32 → fp16 / bf16 / int8 (per-row scale) or back to fp32.
Status convert(const Matrix& in, std::size_t dim, Element out, void* out_data, float* out_scales,
               void* stream);

// out[i] = (stored[i] + offset) · 2^exponent for `count` values stored as uint8 / int8 / fp16 /
// fp32 (stored_element 0..3), written as `out`: fp32 / fp16 / bf16 rounded to nearest even, int8
// rounded half away from zero, saturated to [-128, 127], NaN to 0.
Status convert_stored(const void* stored, int stored_element, std::size_t count, float offset,
                      int exponent, Element out, void* out_data, void* stream);

}  // namespace gpupool::cuda_kernels
