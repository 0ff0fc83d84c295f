// gpupool:kernels on a CUDA device (CUDA builds only): wraps gpu/cuda/kernels.cu, maps CUDA and
// cuBLAS statuses to GpuError, and takes every kNN temporary from the pool. Arguments arrive
// validated from gpu/kernels.cpp.
module;
#include "cuda/kernels.cuh"
#include "cuda/knn_filter.cuh"

#include <cublas_v2.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <expected>
#include <fmt/format.h>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
module gpupool;

namespace gpupool {

namespace {

cudak::Element element_of(Precision p) {
  switch (p) {
    case Precision::Fp16: return cudak::Element::Fp16;
    case Precision::Bf16: return cudak::Element::Bf16;
    case Precision::Int8: return cudak::Element::Int8;
    default: return cudak::Element::Fp32;
  }
}

cudak::Metric metric_of(Metric m) {
  switch (m) {
    case Metric::InnerProduct: return cudak::Metric::InnerProduct;
    case Metric::Cosine: return cudak::Metric::Cosine;
    default: return cudak::Metric::L2;
  }
}

cudak::Matrix matrix(const CudaMatrix& m) {
  return cudak::Matrix{m.data, element_of(m.precision), m.scales, m.rows};
}

// cuBLAS statuses: CUBLAS_STATUS_ALLOC_FAILED is out-of-memory, the rest ErrorKind::Cublas.
GpuError cublas_status_error(int status, std::string_view what, int device) {
  const char* name = cublasGetStatusName(static_cast<cublasStatus_t>(status));
  std::string message = fmt::format("{}: {}", what, name ? name : "unknown cuBLAS status");
  ErrorKind kind = status == CUBLAS_STATUS_ALLOC_FAILED ? ErrorKind::OutOfMemory : ErrorKind::Cublas;
  return GpuError(kind, std::move(message), device, NativeStatus{StatusSource::Cublas, status});
}

Result<void> check(const cudak::Status& s, std::string_view op, const Device& device) {
  if (s.ok()) return {};
  std::string what = fmt::format("{}: {}", op, s.what);
  if (s.cublas != 0) return std::unexpected(cublas_status_error(s.cublas, what, device.id()));
  return std::unexpected(cuda_status_error(s.cuda, what, device.id()));
}

Result<void> use_device(const Device& device, std::string_view op) {
  return check(cudak::set_device(device.properties().ordinal), op, device);
}

// GPUPOOL_KNN_TILE_BYTES (if set) caps the Q × tile distance buffer below what the headroom
// allows, down to 256 columns: a tile that stays in the L2 cache is written by the GEMM and read
// by the top-k pass without a trip to device memory (kernel_bench compares the two).
std::size_t capped_tile_cols(std::size_t tile_cols, std::size_t q_rows, std::size_t n_rows) {
  const char* text = std::getenv("GPUPOOL_KNN_TILE_BYTES");
  if (!text || !*text) return tile_cols;
  std::size_t bytes = std::strtoull(text, nullptr, 10);
  if (bytes == 0) return tile_cols;
  std::size_t cols = bytes / (q_rows * sizeof(float));
  std::size_t fewest = std::min<std::size_t>({n_rows, 256, tile_cols});
  return std::max(std::min(cols, tile_cols), fewest);
}

}  // namespace

Result<void> cuda_pairwise_distance(const Device& device, const Stream& stream,
                                    const CudaMatrix& queries, const CudaMatrix& corpus,
                                    const DistanceOptions& options, float* out) {
  if (auto ok = use_device(device, "l2_distance"); !ok) return ok;
  return check(cudak::pairwise(device.properties().ordinal, matrix(queries), matrix(corpus),
                               options.dim, metric_of(options.metric),
                               options.mode == ComputeMode::Tf32, out, stream.native()),
               "l2_distance", device);
}

namespace {

// Every temporary of one cuda_knn call, from the pool on the work stream (returned in its order).
struct KnnScratch {
  ManagedBuffer norms;           // Q + N squared norms (L2, cosine)
  ManagedBuffer tile;            // Q × tile_cols dot products
  ManagedBuffer part_d, part_i;  // sliced top-k: Q × slices × k partial lists
  ManagedBuffer q16, x16;        // int8: queries and one corpus tile widened to fp16
  ManagedBuffer q3, x3;          // fp32-accurate: queries and one corpus tile split for 3×TF32
};

// Fp32-accurate kNN runs 3×TF32 (see cudak::split_tf32) on tiles whose split copy (3·dim floats a
// row) takes at most as much as the distance tile, or 256 MiB, whichever is more.
std::size_t split_tile_cols(std::size_t tile_cols, std::size_t q_rows, std::size_t dim) {
  std::size_t budget = std::max<std::size_t>(q_rows * tile_cols * sizeof(float), 256u << 20);
  std::size_t cols = budget / (3 * dim * sizeof(float));
  return std::max<std::size_t>(std::min(cols, tile_cols), std::min<std::size_t>(tile_cols, 256));
}

bool wants_split(const CudaMatrix& corpus, const DistanceOptions& options) {
  return corpus.precision == Precision::Fp32 && options.mode == ComputeMode::Fp32Accurate;
}

Result<KnnScratch> knn_scratch(GpuMemoryPool& pool, const Device& device, const Stream& stream,
                               const CudaMatrix& queries, const CudaMatrix& corpus,
                               const DistanceOptions& options, std::size_t k,
                               std::size_t& tile_cols, std::size_t& slices) {
  KnnScratch s;
  auto take = [&](ManagedBuffer& into, std::size_t n, Precision p, std::string_view what) {
    auto b = knn_temporary(pool, device, n, p, stream, what);
    if (b) into = std::move(*b);
    return b.has_value() ? Result<void>{} : Result<void>(std::unexpected(b.error()));
  };
  // Inner product needs no norms, except for fp32-accurate's filter: its error bound scales
  // with |q|·|x|.
  if (options.metric != Metric::InnerProduct || wants_split(corpus, options))
    if (auto ok = take(s.norms, queries.rows + corpus.rows, Precision::Fp32, "row norms"); !ok)
      return std::unexpected(ok.error());
  tile_cols = capped_tile_cols(tile_cols, queries.rows, corpus.rows);
  if (wants_split(corpus, options)) tile_cols = split_tile_cols(tile_cols, queries.rows, options.dim);
  auto tile = pool.get_managed_buffer(device, queries.rows * tile_cols, Precision::Fp32, stream);
  while (!tile && tile.error().is_out_of_memory() && tile_cols > std::min<std::size_t>(corpus.rows, 64)) {
    tile_cols = (tile_cols + 1) / 2;
    tile = pool.get_managed_buffer(device, queries.rows * tile_cols, Precision::Fp32, stream);
  }
  if (!tile) return std::unexpected(tile.error().with_context("knn: allocating the distance tile"));
  s.tile = std::move(*tile);
  slices = cudak::topk_slices(queries.rows, tile_cols, k);
  if (slices > 1) {
    std::size_t lists = queries.rows * slices * k;
    if (auto ok = take(s.part_d, lists, Precision::Fp32, "partial top-k lists"); !ok)
      return std::unexpected(ok.error());
    if (auto ok = take(s.part_i, lists * 4, Precision::Bytes, "partial top-k lists"); !ok)
      return std::unexpected(ok.error());
  }
  if (corpus.precision == Precision::Int8) {
    if (auto ok = take(s.q16, queries.rows * options.dim, Precision::Fp16, "int8 widening"); !ok)
      return std::unexpected(ok.error());
    if (auto ok = take(s.x16, tile_cols * options.dim, Precision::Fp16, "int8 widening"); !ok)
      return std::unexpected(ok.error());
  }
  if (wants_split(corpus, options)) {  // without room for the split: plain fp32 FMA instead
    auto q3 = pool.get_managed_buffer(device, queries.rows * 3 * options.dim, Precision::Fp32, stream);
    auto x3 = pool.get_managed_buffer(device, tile_cols * 3 * options.dim, Precision::Fp32, stream);
    if (q3 && x3) s.q3 = std::move(*q3), s.x3 = std::move(*x3);
    else if (!(q3 ? x3 : q3).error().is_out_of_memory())
      return std::unexpected((q3 ? x3 : q3).error().with_context("knn: allocating 3xTF32 splits"));
  }
  return s;
}

}  // namespace

namespace {

// When the fused filter (cudak::knn_filter) runs, and with what sample and list capacity.
struct FilterPlan {
  bool on = false;
  cudak::FilterSample sample;
  std::size_t capacity = 0;  // candidate slots per query
  bool lower_bound = false;  // fp32-accurate: bounds on scaled fp16 copies, then the exact re-rank
};

// The filter pays for itself on large corpora, small k and enough queries to fill its 128-query
// tiles (H100, docs/benchmarks.md: Q = 1 ran 3× slower filtered). Where its distances are the
// result (fp16, bf16, TF32 mode) its mma.sync GEMM must not be the bottleneck: rows of 256 bytes
// ran 2.1-2.6× faster filtered, rows of 1920 and 3840 bytes (D = 960) 1.1-1.4× slower than
// cuBLAS's GEMM in the tiled path; the cut at 1024 bytes lies between (not measured there).
// Fp32-accurate filters at any D: its bounds on scaled fp16 copies (cudak::scale_to_fp16, rows
// padded to whole 16-byte chunks) replace an fp32 or 3×TF32 GEMM.
// The sample's rows go through the tiled path (its GEMMs are a few % of the work); it is sized so
// that about k·N/S rows per query beat its thresholds (for rows in no particular order),
// balancing the sample's cost against the candidates': S ≈ √(16·k·N). Lists hold 4× the expected
// count (a list that overflows sends the whole call to the tiled path), and take at most the
// tile's memory (2 × 4 bytes a slot).
constexpr std::size_t kFilterMaxK = 256;
constexpr std::size_t kFilterMinRows = 65536;
constexpr std::size_t kFilterMinQueries = 64;
constexpr std::size_t kFilterMaxExactRowBytes = 1024;

FilterPlan filter_plan(const CudaMatrix& queries, const CudaMatrix& corpus,
                       const DistanceOptions& options, std::size_t k, std::size_t tile_cols) {
  FilterPlan plan;
  std::size_t n = corpus.rows;
  if (k > kFilterMaxK || n < kFilterMinRows || queries.rows < kFilterMinQueries) return plan;
  if (corpus.precision == Precision::Fp32 && options.mode == ComputeMode::Fp32Accurate)
    plan.lower_bound = true;
  else if (!cudak::tiles_read_rows(element_of(corpus.precision), options.dim) ||
           options.dim * element_size(corpus.precision) > kFilterMaxExactRowBytes)
    return plan;
  std::size_t quarter = n / 4;
  auto root = static_cast<std::size_t>(std::sqrt(16.0 * static_cast<double>(k) * n));
  std::size_t sample = std::clamp<std::size_t>(root, 64 * k, quarter);
  std::size_t capacity = std::bit_ceil(std::max<std::size_t>(4 * k * n / sample, 2 * k));
  std::size_t most = std::bit_floor(std::max<std::size_t>(tile_cols / 2, 1));
  if (capacity > most) {  // less memory: a larger sample, fewer candidates
    capacity = most;
    sample = 4 * k * n / capacity;
  }
  std::size_t period = n / cudak::kFilterPieces;
  std::size_t length = (sample + cudak::kFilterPieces - 1) / cudak::kFilterPieces;
  if (capacity < 2 * k || 4 * length > period) return plan;
  plan.on = true;
  plan.sample = {period, length};
  plan.capacity = capacity;
  return plan;
}

// The filter's candidate lists (Q × capacity distances and indices) and their counts.
struct FilterLists {
  ManagedBuffer distances, indices, counts;
};

Result<FilterLists> filter_lists(GpuMemoryPool& pool, const Device& device, const Stream& stream,
                                 std::size_t rows, std::size_t capacity) {
  FilterLists lists;
  for (auto [into, elements, precision] :
       {std::tuple{&lists.distances, rows * capacity, Precision::Fp32},
        std::tuple{&lists.indices, rows * capacity * 4, Precision::Bytes},
        std::tuple{&lists.counts, rows * 4, Precision::Bytes}}) {
    auto b = knn_temporary(pool, device, elements, precision, stream, "kNN filter candidate lists");
    if (!b) return std::unexpected(b.error());
    *into = std::move(*b);
  }
  return lists;
}

// Fp32-accurate's filter reads scale_to_fp16 copies of the queries and the corpus (rows then
// scales, queries first): half the bytes of the fp32 rows, at the fp16 MMA rate. Empty buffers
// where the pool has no room for them: that call takes the tiled path instead.
struct ScaledCopies {
  ManagedBuffer rows, scales;
};

Result<ScaledCopies> scaled_copies(GpuMemoryPool& pool, const Device& device, const Stream& stream,
                                   std::size_t total_rows, std::size_t dim) {
  ScaledCopies copies;
  auto rows = pool.get_managed_buffer(device, total_rows * cudak::scaled_fp16_dim(dim),
                                      Precision::Fp16, stream);
  auto scales = pool.get_managed_buffer(device, total_rows, Precision::Fp32, stream);
  for (auto* b : {&rows, &scales})
    if (!*b && !b->error().is_out_of_memory())
      return std::unexpected(b->error().with_context("knn: allocating the filter's fp16 copies"));
  if (rows && scales) copies.rows = std::move(*rows), copies.scales = std::move(*scales);
  return copies;
}

// The scaled copies of queries and corpus, as the filter's operands (its q and x), and their
// squared norms into norms (queries first) in the same pass.
Result<void> scale_for_filter(const Device& device, const Stream& stream,
                              const CudaMatrix& queries, const CudaMatrix& corpus, std::size_t dim,
                              const ScaledCopies& copies, float* norms, cudak::Matrix& fq,
                              cudak::Matrix& fx) {
  auto* halves = static_cast<std::uint16_t*>(copies.rows.raw_data());
  auto* scales = static_cast<float*>(copies.scales.raw_data());
  std::size_t padded = cudak::scaled_fp16_dim(dim);
  fq = cudak::Matrix{halves, cudak::Element::Fp16, scales, queries.rows};
  fx = cudak::Matrix{halves + queries.rows * padded, cudak::Element::Fp16, scales + queries.rows,
                     corpus.rows};
  for (auto [from, to, to_norms] : {std::tuple{&queries, &fq, norms},
                                    std::tuple{&corpus, &fx, norms + queries.rows}})
    if (auto ok = check(cudak::scale_to_fp16(static_cast<const float*>(from->data), from->rows,
                                             dim, const_cast<void*>(to->data),
                                             const_cast<float*>(to->scales), to_norms,
                                             stream.native()),
                        "knn", device);
        !ok)
      return ok;
  return {};
}

}  // namespace

// Two paths. Tiled: the GEMM writes a tile's dot products, the top-k pass turns them into distances
// as it reads them and folds them into the running lists. Int8 goes through the fp16 GEMM on exact
// widenings, the scales applied in that pass; fp32-accurate through one TF32 GEMM over 3·dim split
// values (3×TF32), the L2 cancellation re-compute in fp32. Filtered (large corpora, k <= 256, see
// filter_plan): a sample of the corpus takes the tiled path, then cudak::knn_filter compares every
// other row's distance with its query's k-th so far in the GEMM's registers and keeps only those
// that beat it, which one top-k pass (after an exact re-rank in fp32-accurate mode) merges in.
Result<void> cuda_knn(GpuMemoryPool& pool, const Device& device, const Stream& stream,
                      const CudaMatrix& queries, const CudaMatrix& corpus,
                      const DistanceOptions& options, std::size_t k, std::size_t tile_cols,
                      float* out_distances, std::int32_t* out_indices, KnnPath& path) {
  constexpr std::string_view op = "knn";
  path = KnnPath::Tiled;
  if (auto ok = use_device(device, op); !ok) return ok;
  void* native = stream.native();
  int ordinal = device.properties().ordinal;
  std::size_t dim = options.dim, slices = 1;
  FilterPlan filter = filter_plan(queries, corpus, options, k,
                                  capped_tile_cols(tile_cols, queries.rows, corpus.rows));
  ScaledCopies copies;
  if (filter.lower_bound) {
    auto made = scaled_copies(pool, device, stream, queries.rows + corpus.rows, dim);
    if (!made) return std::unexpected(made.error());
    copies = std::move(*made);
    filter.on = copies.rows.valid();
  }
  if (filter.on)  // tiles for the sample's pieces only (and the rare fallback)
    tile_cols = std::min(tile_cols, std::max<std::size_t>(filter.sample.length, 4096));
  auto scratch = knn_scratch(pool, device, stream, queries, corpus, options, k, tile_cols, slices);
  if (!scratch) return std::unexpected(scratch.error());
  cudak::Matrix q = matrix(queries), x = matrix(corpus);
  bool int8 = corpus.precision == Precision::Int8;

  cudak::Epilogue e;
  e.metric = metric_of(options.metric);
  e.dim = dim;
  auto* qn = static_cast<float*>(scratch->norms.raw_data());
  cudak::Matrix fq = q, fx = x;  // what the filter multiplies
  if (copies.rows.valid()) {       // the norms come from the same pass as the copies
    if (auto ok = scale_for_filter(device, stream, queries, corpus, dim, copies, qn, fq, fx); !ok)
      return ok;
  } else if (qn) {
    if (auto ok = check(cudak::row_norms(q, dim, qn, native), op, device); !ok) return ok;
    if (auto ok = check(cudak::row_norms(x, dim, qn + q.rows, native), op, device); !ok) return ok;
  }
  bool refine = options.metric == Metric::L2 && !int8 && corpus.precision == Precision::Fp32 &&
                options.mode == ComputeMode::Fp32Accurate;
  cudak::Matrix gq = q, gx = x;  // what the GEMM reads
  std::size_t gdim = dim;
  bool split = scratch->x3.valid();
  bool tf32 = options.mode == ComputeMode::Tf32 || split;
  if (split) {
    auto* q3 = static_cast<float*>(scratch->q3.raw_data());
    if (auto ok = check(cudak::split_tf32(q, 0, q.rows, dim, false, q3, native), op, device); !ok)
      return ok;
    gq = cudak::Matrix{q3, cudak::Element::Fp32, nullptr, q.rows};
    gx = cudak::Matrix{scratch->x3.raw_data(), cudak::Element::Fp32, nullptr, 0};
    gdim = 3 * dim;
  }
  if (int8) {
    if (auto ok = check(cudak::widen_int8(q, 0, q.rows, dim, scratch->q16.raw_data(), native), op,
                        device);
        !ok)
      return ok;
    gq = cudak::Matrix{scratch->q16.raw_data(), cudak::Element::Fp16, nullptr, q.rows};
    gx = cudak::Matrix{scratch->x16.raw_data(), cudak::Element::Fp16, nullptr, 0};
  }
  auto init = [&] {
    return check(cudak::topk_init(out_distances, out_indices, q.rows * k, native), op, device);
  };
  auto* t = static_cast<float*>(scratch->tile.raw_data());
  // Corpus rows [first, first + count) through the tiled path into the running lists.
  auto fold = [&](std::size_t first, std::size_t count) -> Result<void> {
    for (std::size_t x0 = first; x0 < first + count; x0 += tile_cols) {
      std::size_t nx = std::min(tile_cols, first + count - x0);
      std::size_t gx0 = x0;
      if (split) {  // this tile's rows split to the start of x3
        if (auto ok = check(cudak::split_tf32(x, x0, nx, dim, true,
                                              static_cast<float*>(scratch->x3.raw_data()), native),
                            op, device);
            !ok)
          return ok;
        gx.rows = nx;
        gx0 = 0;
      }
      if (int8) {  // this tile's rows widened to the start of x16
        if (auto ok = check(cudak::widen_int8(x, x0, nx, dim, scratch->x16.raw_data(), native),
                            op, device);
            !ok)
          return ok;
        gx.rows = nx;
        gx0 = 0;
        e.q_scales = q.scales;
        e.x_scales = x.scales + x0;
      }
      cudak::Status st =
          cudak::dot_products(ordinal, gq, gx, gx0, nx, gdim, tf32, t, tile_cols, native);
      if (auto ok = check(st, op, device); !ok) return ok;
      e.q_norms = qn;
      e.x_norms = qn ? qn + q.rows + x0 : nullptr;
      e.q32 = refine ? static_cast<const float*>(queries.data) : nullptr;
      e.x32 = refine ? static_cast<const float*>(corpus.data) + x0 * dim : nullptr;
      auto base = static_cast<std::int64_t>(x0);
      st = slices > 1
               ? cudak::topk_update_split(t, q.rows, nx, tile_cols, base, k, slices,
                                          static_cast<float*>(scratch->part_d.raw_data()),
                                          static_cast<std::int32_t*>(scratch->part_i.raw_data()),
                                          out_distances, out_indices, native, &e)
               : cudak::topk_update(t, nullptr, q.rows, nx, tile_cols, base, k, out_distances,
                                    out_indices, native, &e);
      if (auto ok = check(st, op, device); !ok) return ok;
    }
    return {};
  };
  if (auto ok = init(); !ok) return ok;
  if (!filter.on) return fold(0, x.rows);  // the scratch goes back to the pool ordered on `stream`

  for (std::size_t piece = 0; piece < cudak::kFilterPieces; ++piece)
    if (auto ok = fold(piece * filter.sample.period, filter.sample.length); !ok) return ok;
  auto lists = filter_lists(pool, device, stream, q.rows, filter.capacity);
  if (!lists) return std::unexpected(lists.error());
  auto* cand_d = static_cast<float*>(lists->distances.raw_data());
  auto* cand_i = static_cast<std::int32_t*>(lists->indices.raw_data());
  auto* counts = static_cast<std::uint32_t*>(lists->counts.raw_data());
  if (auto ok = device.fill(lists->counts.raw_data(), 0, q.rows * 4, stream); !ok) return ok;
  std::size_t fdim = copies.rows.valid() ? cudak::scaled_fp16_dim(dim) : dim;
  cudak::FilterArgs f{.q = fq, .x = fx, .dim = fdim, .metric = e.metric, .q_norms = qn,
                      .x_norms = qn ? qn + q.rows : nullptr, .run_d = out_distances,
                      .run_i = out_indices, .k = k, .sample = filter.sample,
                      .cand_d = cand_d, .cand_i = cand_i, .counts = counts,
                      .capacity = filter.capacity};
  // The bound's slack grows with dim for the fp32 sums (MMA, norms, re-rank): dim · 2^-23.
  if (filter.lower_bound) f.lower_bound = cudak::kScaledFp16ProductError + dim * 0x1p-23f;
  if (auto ok = check(cudak::knn_filter(f, native), op, device); !ok) return ok;
  if (filter.lower_bound)
    if (auto ok = check(cudak::rerank_distances(static_cast<const float*>(queries.data),
                                                static_cast<const float*>(corpus.data), q.rows,
                                                dim, e.metric, cand_i, filter.capacity, cand_d,
                                                native, counts),
                        op, device);
        !ok)
      return ok;
  if (auto ok = check(cudak::topk_update(cand_d, cand_i, q.rows, filter.capacity,
                                         filter.capacity, 0, k, out_distances, out_indices, native,
                                         nullptr, counts),
                      op, device);
      !ok)
    return ok;
  bool overflowed = false;
  if (auto ok = check(cudak::filter_overflowed(counts, q.rows, filter.capacity, native, overflowed),
                      op, device);
      !ok)
    return ok;
  path = overflowed ? KnnPath::FilterFellBack : KnnPath::Filtered;
  if (!overflowed) return {};
  // Rows in an order that defeats the sample (a list overflowed): everything again, tiled.
  if (auto ok = init(); !ok) return ok;
  return fold(0, x.rows);
}

Result<void> cuda_row_norms(const Device& device, const Stream& stream, const CudaMatrix& vectors,
                            std::size_t dim, float* out) {
  if (auto ok = use_device(device, "row_norms"); !ok) return ok;
  return check(cudak::row_norms(matrix(vectors), dim, out, stream.native()), "row_norms", device);
}

Result<void> cuda_convert(const Device& device, const Stream& stream, const CudaMatrix& in,
                          std::size_t dim, Precision out_precision, void* out, float* out_scales) {
  if (auto ok = use_device(device, "convert"); !ok) return ok;
  return check(cudak::convert(matrix(in), dim, element_of(out_precision), out, out_scales,
                              stream.native()),
               "convert", device);
}

// The exact distances of every candidate into candidate_distances, then the existing top-k
// kernel (with the candidates' own indices, as merge_topk) picks the k best per query.
Result<void> cuda_rerank(const Device& device, const Stream& stream, const CudaRerank& rerank,
                         Metric metric, float* candidate_distances,
                         const std::int32_t* candidate_indices, float* out_distances,
                         std::int32_t* out_indices) {
  constexpr std::string_view op = "knn (re-rank)";
  if (auto ok = use_device(device, op); !ok) return ok;
  void* native = stream.native();
  if (auto ok = check(cudak::rerank_distances(rerank.queries, rerank.corpus, rerank.rows,
                                              rerank.dim, metric_of(metric), candidate_indices,
                                              rerank.candidates, candidate_distances, native),
                      op, device);
      !ok)
    return ok;
  if (auto ok = check(cudak::topk_init(out_distances, out_indices, rerank.rows * rerank.k, native),
                      op, device);
      !ok)
    return ok;
  return check(cudak::topk_update(candidate_distances, candidate_indices, rerank.rows,
                                  rerank.candidates, rerank.candidates, 0, rerank.k,
                                  out_distances, out_indices, native),
               op, device);
}

Result<void> cuda_merge_topk(const Device& device, const Stream& stream, const float* distances,
                             const std::int32_t* indices, const MergeTopkOptions& options,
                             float* out_distances, std::int32_t* out_indices) {
  constexpr std::string_view op = "merge_topk";
  if (auto ok = use_device(device, op); !ok) return ok;
  void* native = stream.native();
  if (auto ok = check(cudak::topk_init(out_distances, out_indices, options.queries * options.k,
                                       native), op, device);
      !ok)
    return ok;
  std::size_t per_query = options.lists * options.list_length;
  return check(cudak::topk_update(distances, indices, options.queries, per_query, per_query, 0,
                                  options.k, out_distances, out_indices, native),
               op, device);
}

}  // namespace gpupool
