// gpupool:kernels on a CUDA device (CUDA builds only): wraps gpu/cuda/kernels.cu, maps CUDA and
// cuBLAS statuses to GpuError, and takes every kNN temporary from the pool. Arguments arrive
// validated from gpu/kernels.cpp.
module;
#include "cuda/few_queries_knn.cuh"
#include "cuda/kernels.cuh"
#include "cuda/knn_filter.cuh"
#include "cuda/sample_minima.cuh"
#include "knn_plan.hpp"

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
import :pool_access;

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

// GPUPOOL_KNN_TILE_BYTES (if set): the plan's cap on the Q × tile distance buffer
// (knn_plan::capped_tile_cols), 0 where unset.
std::size_t tile_bytes_cap() {
  const char* text = std::getenv("GPUPOOL_KNN_TILE_BYTES");
  if (!text || !*text) return 0;
  return std::strtoull(text, nullptr, 10);
}

}  // namespace

Result<void> cuda_pairwise_distance(const Device& device, const Stream& stream,
                                    const CudaMatrix& queries, const CudaMatrix& corpus,
                                    const DistanceOptions& options, const ManagedBuffer& out) {
  if (auto ok = use_device(device, "l2_distance"); !ok) return ok;
  const cudak::Matrix q = matrix(queries), x = matrix(corpus);
  const cudak::Metric metric = metric_of(options.metric);
  const bool tf32 = options.mode == ComputeMode::Tf32;
  // The norms (and int8 widenings, fp32-accurate's fp16 halves) in one temporary from out's
  // pool, so that the call stays within the pool's limit and reuses cached memory; returned in
  // stream order. Where the halves do not fit, fp32-accurate runs without them (3×TF32).
  auto take = [&](const cudak::PairwiseScratch& l) -> Result<ManagedBuffer> {
    if (l.bytes == 0) return ManagedBuffer{};
    return BufferAccess::temporary_beside(out, l.bytes, stream);
  };
  cudak::PairwiseScratch layout = cudak::pairwise_scratch(q, x, options.dim, metric, tf32, true);
  auto scratch = take(layout);
  if (!scratch && layout.x_halves != cudak::PairwiseScratch::kNone) {
    layout = cudak::pairwise_scratch(q, x, options.dim, metric, tf32, false);
    scratch = take(layout);
  }
  if (!scratch)
    return std::unexpected(scratch.error().with_context(fmt::format(
        "l2_distance: allocating {} bytes of scratch (row norms{}) from out's pool", layout.bytes,
        layout.q16 != cudak::PairwiseScratch::kNone ? ", int8 widenings" : "")));
  return check(cudak::pairwise(device.properties().ordinal, q, x, options.dim, metric, tf32,
                               layout, scratch->raw_data(), static_cast<float*>(out.raw_data()),
                               stream.native()),
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

// The scratch of `plan`: its tile shrinks (halved) while the pool has less room than it said.
Result<KnnScratch> knn_scratch(GpuMemoryPool& pool, const Device& device, const Stream& stream,
                               const knn_plan::KnnProblem& problem, const knn_plan::KnnPlan& plan,
                               std::size_t& tile_cols, std::size_t& slices) {
  KnnScratch s;
  auto take = [&](ManagedBuffer& into, std::size_t n, Precision p, std::string_view what) {
    auto b = knn_temporary(pool, device, n, p, stream, what);
    if (b) into = std::move(*b);
    return b.has_value() ? Result<void>{} : Result<void>(std::unexpected(b.error()));
  };
  if (plan.norms)
    if (auto ok = take(s.norms, problem.queries + problem.rows, Precision::Fp32, "row norms"); !ok)
      return std::unexpected(ok.error());
  tile_cols = plan.tile_cols;
  auto tile = pool.get_managed_buffer(device, problem.queries * tile_cols, Precision::Fp32, stream);
  while (!tile && tile.error().is_out_of_memory() && tile_cols > std::min<std::size_t>(problem.rows, 64)) {
    tile_cols = (tile_cols + 1) / 2;
    tile = pool.get_managed_buffer(device, problem.queries * tile_cols, Precision::Fp32, stream);
  }
  if (!tile) return std::unexpected(tile.error().with_context("knn: allocating the distance tile"));
  s.tile = std::move(*tile);
  slices = cudak::topk_slices(problem.queries, tile_cols, problem.k);
  if (slices > 1) {
    std::size_t lists = problem.queries * slices * problem.k;
    if (auto ok = take(s.part_d, lists, Precision::Fp32, "partial top-k lists"); !ok)
      return std::unexpected(ok.error());
    if (auto ok = take(s.part_i, lists * 4, Precision::Bytes, "partial top-k lists"); !ok)
      return std::unexpected(ok.error());
  }
  if (problem.int8) {
    if (auto ok = take(s.q16, problem.queries * problem.dim, Precision::Fp16, "int8 widening"); !ok)
      return std::unexpected(ok.error());
    if (auto ok = take(s.x16, tile_cols * problem.dim, Precision::Fp16, "int8 widening"); !ok)
      return std::unexpected(ok.error());
  }
  if (plan.split) {  // without room for the split: plain fp32 FMA instead
    auto q3 = pool.get_managed_buffer(device, problem.queries * 3 * problem.dim, Precision::Fp32, stream);
    auto x3 = pool.get_managed_buffer(device, tile_cols * 3 * problem.dim, Precision::Fp32, stream);
    if (q3 && x3) s.q3 = std::move(*q3), s.x3 = std::move(*x3);
    else if (!(q3 ? x3 : q3).error().is_out_of_memory())
      return std::unexpected((q3 ? x3 : q3).error().with_context("knn: allocating 3xTF32 splits"));
  }
  return s;
}

}  // namespace

namespace {

// The plan's view of one cuda_knn call (a chunk of queries against the whole corpus).
knn_plan::KnnProblem knn_problem(const CudaMatrix& queries, const CudaMatrix& corpus,
                                 const DistanceOptions& options, std::size_t k,
                                 std::size_t tile_cols) {
  return {.queries = queries.rows, .rows = corpus.rows, .dim = options.dim, .k = k,
          .value_bytes = element_size(corpus.precision),
          .fp32 = corpus.precision == Precision::Fp32,
          .int8 = corpus.precision == Precision::Int8,
          .accurate = options.mode == ComputeMode::Fp32Accurate,
          .inner_product = options.metric == Metric::InnerProduct,
          .l2 = options.metric == Metric::L2,
          .tile_cols = tile_cols, .tile_bytes_cap = tile_bytes_cap()};
}

// What the filter kernels take of the corpus rows and of fp32-accurate's scaled copies, on the
// current device.
knn_plan::KernelCapabilities kernel_capabilities(const CudaMatrix& corpus, std::size_t dim) {
  const cudak::Element element = element_of(corpus.precision);
  return {.filter_reads_rows = cudak::tiles_read_rows(element, dim),
          .resident_filter_on_corpus = cudak::resident_filter_runs(element, dim, corpus.data),
          .resident_filter_on_scaled_copies = cudak::resident_filter_takes(
              cudak::Element::Fp16, cudak::scaled_fp16_dim(dim))};
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

// Where the tiled path reads corpus rows: the corpus itself, or the sample's pieces gathered side
// by side (cudak::gather_pieces), whose columns map back to corpus rows through `pieces`.
struct RowSource {
  cudak::Matrix x;               // the rows (and int8 scales)
  const float* norms = nullptr;  // their squared norms (L2, cosine)
  const float* fp32 = nullptr;   // the fp32 rows, for the L2 cancellation re-compute
  cudak::FilterSample pieces;    // length 0: the corpus itself
};

// One cuda_knn call: its inputs, the pool's temporaries, and the steps of both paths. Tiled: the
// GEMM writes a tile's dot products, the top-k pass turns them into distances as it reads them
// and folds them into the running lists. Int8 goes through the fp16 GEMM on exact widenings, the
// scales applied in that pass; fp32-accurate through one TF32 GEMM over 3·dim split values
// (3×TF32), the L2 cancellation re-compute in fp32. Filtered (large corpora, k <= 256, see
// knn_plan::filter_plan): a sample of the corpus gives each query a threshold (its k-th best, through the
// tiled path, or the k-th best of its group minima, cudak::sample_minima), then
// cudak::knn_filter compares every row's distance with it in the GEMM's registers and keeps only
// those that beat it, which one top-k pass (after an exact re-rank in fp32-accurate mode) merges
// in.
class KnnRun {
 public:
  KnnRun(GpuMemoryPool& pool, const Device& device, const Stream& stream,
         const CudaMatrix& queries, const CudaMatrix& corpus, const DistanceOptions& options,
         std::size_t k, float* out_distances, std::int32_t* out_indices,
         const float* upper_bounds)
      : pool_(pool), device_(device), stream_(stream), native_(stream.native()),
        queries_(queries), corpus_(corpus), options_(options), k_(k), dim_(options.dim),
        out_d_(out_distances), out_i_(out_indices), bounds_(upper_bounds), q_(matrix(queries)),
        x_(matrix(corpus)), int8_(corpus.precision == Precision::Int8) {
    e_.metric = metric_of(options.metric);
    e_.dim = dim_;
  }

  Result<void> run(std::size_t tile_cols, KnnPath& path) {
    path = KnnPath::Tiled;
    if (auto ok = use_device(device_, kOp); !ok) return ok;
    if (auto ok = plan(tile_cols); !ok) return ok;
    if (auto ok = prepare(); !ok) return ok;
    if (auto ok = init(); !ok) return ok;
    // The scratch goes back to the pool ordered on the stream.
    if (!filter_.on) return fold(whole_corpus(), 0, x_.rows);
    bool overflowed = false;
    if (auto ok = filter_.minima ? sample_minima() : fold_sample(); !ok) return ok;
    if (auto ok = filter(overflowed); !ok) return ok;
    if (overflowed && filter_.minima && filter_.lower_bound)
      if (auto ok = filter_after_exact_sample(overflowed); !ok) return ok;
    path = overflowed ? KnnPath::FilterFellBack : KnnPath::Filtered;
    if (!overflowed) return {};
    // Rows in an order that defeats the sample (a list overflowed): everything again, tiled.
    if (auto ok = init(); !ok) return ok;
    return fold(whole_corpus(), 0, x_.rows);
  }

 private:
  static constexpr std::string_view kOp = "knn";

  Result<void> ok(const cudak::Status& s) const { return check(s, kOp, device_); }


  // The plan (knn_plan::plan_knn), the filter's copies (fp32-accurate) and the scratch.
  Result<void> plan(std::size_t tile_cols) {
    const knn_plan::KnnProblem problem = knn_problem(queries_, corpus_, options_, k_, tile_cols);
    const knn_plan::KernelCapabilities capabilities = kernel_capabilities(corpus_, dim_);
    knn_plan::KnnPlan plan = knn_plan::plan_knn(problem, capabilities);
    if (plan.scaled_copies) {
      auto made = scaled_copies(pool_, device_, stream_, queries_.rows + corpus_.rows, dim_);
      if (!made) return std::unexpected(made.error());
      copies_ = std::move(*made);
      if (!copies_.rows.valid()) plan = knn_plan::plan_knn(problem, capabilities, false);
    }
    filter_ = plan.filter;
    options_.mode = plan.accurate ? ComputeMode::Fp32Accurate : ComputeMode::Tf32;
    refine_ = plan.refine;
    auto scratch = knn_scratch(pool_, device_, stream_, problem, plan, tile_cols, slices_);
    if (!scratch) return std::unexpected(scratch.error());
    scratch_ = std::move(*scratch);
    tile_cols_ = tile_cols;
    return {};
  }

  // Norms (with the filter's copies, from the same pass), and the queries as the GEMM reads them.
  Result<void> prepare() {
    qn_ = static_cast<float*>(scratch_.norms.raw_data());
    fq_ = q_, fx_ = x_, fdim_ = dim_;
    if (copies_.rows.valid()) {
      fdim_ = cudak::scaled_fp16_dim(dim_);
      auto r = scale_for_filter(device_, stream_, queries_, corpus_, dim_, copies_, qn_, fq_, fx_);
      if (!r) return r;
    } else if (qn_) {
      if (auto r = ok(cudak::row_norms(q_, dim_, qn_, native_)); !r) return r;
      if (auto r = ok(cudak::row_norms(x_, dim_, qn_ + q_.rows, native_)); !r) return r;
    }
    gq_ = q_;
    split_ = scratch_.x3.valid();
    tf32_ = options_.mode == ComputeMode::Tf32 || split_;
    if (split_) {
      auto* q3 = static_cast<float*>(scratch_.q3.raw_data());
      if (auto r = ok(cudak::split_tf32(q_, 0, q_.rows, dim_, false, q3, native_)); !r) return r;
      gq_ = cudak::Matrix{q3, cudak::Element::Fp32, nullptr, q_.rows};
      gdim_ = 3 * dim_;
    }
    if (int8_) {
      if (auto r = ok(cudak::widen_int8(q_, 0, q_.rows, dim_, scratch_.q16.raw_data(), native_)); !r)
        return r;
      gq_ = cudak::Matrix{scratch_.q16.raw_data(), cudak::Element::Fp16, nullptr, q_.rows};
    }
    return {};
  }

  Result<void> init() { return ok(cudak::topk_init(out_d_, out_i_, q_.rows * k_, native_)); }

  RowSource whole_corpus() const {
    return {x_, qn_ ? qn_ + q_.rows : nullptr,
            refine_ ? static_cast<const float*>(corpus_.data) : nullptr, {}};
  }

  // Rows [first, first + count) of `source` through the tiled path into the running lists.
  Result<void> fold(const RowSource& source, std::size_t first, std::size_t count) {
    auto* tile = static_cast<float*>(scratch_.tile.raw_data());
    for (std::size_t x0 = first; x0 < first + count; x0 += tile_cols_) {
      std::size_t nx = std::min(tile_cols_, first + count - x0);
      cudak::Matrix gx = source.x;  // what the GEMM reads, from gx0 on
      std::size_t gx0 = x0;
      if (split_) {  // this tile's rows split to the start of x3
        auto* x3 = static_cast<float*>(scratch_.x3.raw_data());
        if (auto r = ok(cudak::split_tf32(source.x, x0, nx, dim_, true, x3, native_)); !r) return r;
        gx = cudak::Matrix{x3, cudak::Element::Fp32, nullptr, nx}, gx0 = 0;
      }
      if (int8_) {  // this tile's rows widened to the start of x16
        void* x16 = scratch_.x16.raw_data();
        if (auto r = ok(cudak::widen_int8(source.x, x0, nx, dim_, x16, native_)); !r) return r;
        gx = cudak::Matrix{x16, cudak::Element::Fp16, nullptr, nx}, gx0 = 0;
        e_.q_scales = q_.scales;
        e_.x_scales = source.x.scales + x0;
      }
      if (auto r = ok(cudak::dot_products(device_.properties().ordinal, gq_, gx, gx0, nx, gdim_,
                                          tf32_, tile, tile_cols_, native_));
          !r)
        return r;
      if (auto r = select(source, x0, nx, tile); !r) return r;
    }
    return {};
  }

  // A tile's dot products (rows x0.. of `source`) → distances → the running lists.
  Result<void> select(const RowSource& source, std::size_t x0, std::size_t nx, const float* tile) {
    e_.q_norms = qn_;
    e_.x_norms = source.norms ? source.norms + x0 : nullptr;
    e_.q32 = source.fp32 ? static_cast<const float*>(queries_.data) : nullptr;
    e_.x32 = source.fp32 ? source.fp32 + x0 * dim_ : nullptr;
    e_.piece_period = source.pieces.period;
    e_.piece_length = source.pieces.length;
    auto base = static_cast<std::int64_t>(x0);
    if (slices_ > 1)
      return ok(cudak::topk_update_split(tile, q_.rows, nx, tile_cols_, base, k_, slices_,
                                         static_cast<float*>(scratch_.part_d.raw_data()),
                                         static_cast<std::int32_t*>(scratch_.part_i.raw_data()),
                                         out_d_, out_i_, native_, &e_));
    return ok(cudak::topk_update(tile, nullptr, q_.rows, nx, tile_cols_, base, k_, out_d_, out_i_,
                                 native_, &e_));
  }

  // The sample's pieces gathered side by side (rows, norms, int8 scales): the tiled path or the
  // minima kernel reads them as one corpus (one launch each instead of one per piece).
  struct GatheredSample {
    ManagedBuffer rows, extras;
    RowSource source;
  };
  // `from`: the corpus (x_, dim_) or, for the bound's minima, its scaled copies (fx_, fdim_).
  Result<GatheredSample> gather_sample(const cudak::Matrix& from, std::size_t dim) {
    const cudak::FilterSample& s = filter_.sample;
    std::size_t rows = cudak::kFilterPieces * s.length;
    std::size_t row_bytes = dim * cudak::element_bytes(from.element);
    GatheredSample g;
    for (auto [into, elements, precision] :
         {std::tuple{&g.rows, rows * row_bytes, Precision::Bytes},
          std::tuple{&g.extras, 2 * rows, Precision::Fp32}}) {
      auto b = knn_temporary(pool_, device_, elements, precision, stream_, "the kNN filter's sample");
      if (!b) return std::unexpected(b.error());
      *into = std::move(*b);
    }
    auto* norms = static_cast<float*>(g.extras.raw_data());
    float* scales = norms + rows;
    auto gather = [&](const void* from, std::size_t bytes, void* to) {
      return ok(cudak::gather_pieces(from, bytes, cudak::kFilterPieces, s.period, s.length, to,
                                     native_));
    };
    if (auto r = gather(from.data, row_bytes, g.rows.raw_data()); !r) return std::unexpected(r.error());
    if (qn_)
      if (auto r = gather(qn_ + q_.rows, sizeof(float), norms); !r) return std::unexpected(r.error());
    if (from.scales)
      if (auto r = gather(from.scales, sizeof(float), scales); !r) return std::unexpected(r.error());
    // The fp32 rows for the tiled path's L2 re-compute (not the scaled copies the minima read).
    const bool fp32_rows = refine_ && from.element == cudak::Element::Fp32;
    g.source = {cudak::Matrix{g.rows.raw_data(), from.element, from.scales ? scales : nullptr, rows},
                qn_ ? norms : nullptr,
                fp32_rows ? static_cast<const float*>(g.rows.raw_data()) : nullptr, s};
    return g;
  }

  // The sample folded into the running lists through the tiled path: the filter's thresholds are
  // their k-th entries, and it skips the sample's rows.
  Result<void> fold_sample() {
    auto sample = gather_sample(x_, dim_);
    if (!sample) return std::unexpected(sample.error());
    return fold(sample->source, 0, sample->source.x.rows);
  }

  // Each query's threshold from the sample's group minima (cudak::sample_minima) into
  // thresholds_ (Q floats of the minima's scratch, which stays until the filter has read them).
  Result<void> sample_minima() {
    auto sample = gather_sample(fx_, fdim_);
    if (!sample) return std::unexpected(sample.error());
    std::size_t groups = sample->source.x.rows / cudak::kMinimaGroupRows;
    auto minima = knn_temporary(pool_, device_, q_.rows * (groups + 1), Precision::Fp32, stream_,
                                "the kNN filter's sample minima");
    if (!minima) return std::unexpected(minima.error());
    minima_ = std::move(*minima);
    thresholds_ = static_cast<float*>(minima_.raw_data()) + q_.rows * groups;
    cudak::MinimaArgs a{.q = fq_, .x = sample->source.x, .dim = fdim_, .metric = e_.metric,
                        .q_norms = qn_, .x_norms = sample->source.norms, .k = k_,
                        .lower_bound = lower_bound(),
                        .minima = static_cast<float*>(minima_.raw_data()),
                        .thresholds = thresholds_};
    return ok(cudak::sample_minima(a, native_));
  }

  // The bound's minima are of upper bounds, so its thresholds lie up to the error bound above
  // the sample's k-th exact distance, and the filter keeps rows up to the bound below them: rows
  // crowded within that window (closer than about 2^-9 of their distance) can overflow the lists
  // where the sample's exact k-th would not. Before the whole call goes tiled, the filter runs
  // once more with that k-th (the sample through the tiled path), as without the minima.
  Result<void> filter_after_exact_sample(bool& overflowed) {
    filter_.minima = false;
    thresholds_ = nullptr;  // the filter takes the running lists' k-th
    if (auto ok = init(); !ok) return ok;
    if (auto ok = fold_sample(); !ok) return ok;
    return filter(overflowed);
  }

  // FilterArgs::lower_bound: fp32-accurate's error bound on the scaled copies' distances, else 0.
  // Its slack grows with dim for the fp32 sums (MMA, norms, re-rank): dim · 2^-23.
  float lower_bound() const {
    return filter_.lower_bound ? cudak::kScaledFp16ProductError + dim_ * 0x1p-23f : 0.0f;
  }

  // Every row outside the sample (every row, after the minima) through cudak::knn_filter into
  // candidate lists, re-ranked exactly in fp32-accurate mode, then merged into the running lists.
  // overflowed: a list was too short (the call must redo the work tiled).
  Result<void> filter(bool& overflowed) {
    auto lists = filter_lists(pool_, device_, stream_, q_.rows, filter_.capacity);
    if (!lists) return std::unexpected(lists.error());
    auto* cand_d = static_cast<float*>(lists->distances.raw_data());
    auto* cand_i = static_cast<std::int32_t*>(lists->indices.raw_data());
    auto* counts = static_cast<std::uint32_t*>(lists->counts.raw_data());
    if (auto r = device_.fill(lists->counts.raw_data(), 0, q_.rows * 4, stream_); !r) return r;
    cudak::FilterArgs f{.q = fq_, .x = fx_, .dim = fdim_, .metric = e_.metric,
                        .q_norms = qn_, .x_norms = qn_ ? qn_ + q_.rows : nullptr,
                        .run_d = out_d_, .run_i = out_i_, .k = k_,
                        .sample = filter_.minima ? cudak::FilterSample{} : filter_.sample,
                        .thresholds = thresholds_, .bounds = bounds_, .cand_d = cand_d,
                        .cand_i = cand_i, .counts = counts,
                        .capacity = filter_.capacity};
    f.lower_bound = lower_bound();
    if (auto r = ok(cudak::knn_filter(f, native_)); !r) return r;
    if (filter_.lower_bound)
      if (auto r = ok(cudak::rerank_distances(static_cast<const float*>(queries_.data),
                                              static_cast<const float*>(corpus_.data), q_.rows,
                                              dim_, e_.metric, cand_i, filter_.capacity, cand_d,
                                              native_, counts));
          !r)
        return r;
    if (auto r = ok(cudak::topk_update(cand_d, cand_i, q_.rows, filter_.capacity,
                                       filter_.capacity, 0, k_, out_d_, out_i_, native_, nullptr,
                                       counts));
        !r)
      return r;
    return ok(cudak::filter_overflowed(counts, q_.rows, filter_.capacity, native_, overflowed));
  }

  GpuMemoryPool& pool_;
  const Device& device_;
  const Stream& stream_;
  void* native_;
  const CudaMatrix& queries_;
  const CudaMatrix& corpus_;
  DistanceOptions options_;  // TF32 mode may become fp32-accurate (the plan's accurate filter)
  std::size_t k_, dim_;
  float* out_d_;
  std::int32_t* out_i_;
  const float* bounds_;  // knn's upper bounds on the device, or null
  cudak::Matrix q_, x_;
  bool int8_, refine_ = false;
  cudak::Epilogue e_;
  knn_plan::FilterPlan filter_;
  ScaledCopies copies_;
  ManagedBuffer minima_;            // the sample's group minima, then the thresholds
  float* thresholds_ = nullptr;
  KnnScratch scratch_;
  std::size_t tile_cols_ = 0, slices_ = 1;
  float* qn_ = nullptr;
  cudak::Matrix gq_{};           // the queries as the GEMM reads them
  cudak::Matrix fq_{}, fx_{};    // what the filter multiplies (fp32-accurate: the scaled copies)
  std::size_t gdim_ = dim_, fdim_ = dim_;
  bool split_ = false, tf32_ = false;
};

}  // namespace

// Few queries (cudak::few_queries_takes): one pass over the corpus, which is then the whole cost
// (docs/kernels.md, "Few queries"), and no tiles. False where it does not apply or its partial
// lists do not fit the pool: the caller goes on to cuda_knn. GPUPOOL_FEW_QUERIES=0 switches it
// off, for comparisons.
Result<bool> cuda_knn_few_queries(GpuMemoryPool& pool, const Device& device, const Stream& stream,
                                  const CudaMatrix& queries, const CudaMatrix& corpus,
                                  const DistanceOptions& options, std::size_t k,
                                  float* out_distances, std::int32_t* out_indices) {
  const char* off = std::getenv("GPUPOOL_FEW_QUERIES");
  const cudak::Matrix q = matrix(queries), x = matrix(corpus);
  if ((off && std::string_view(off) == "0") || !cudak::few_queries_takes(q, x, options.dim, k))
    return false;
  if (auto ok = use_device(device, "knn"); !ok) return std::unexpected(ok.error());
  const cudak::FewQueriesArgs a{
      .q = q, .x = x, .dim = options.dim, .metric = metric_of(options.metric),
      .exact_l2 = options.metric == Metric::L2 && corpus.precision == Precision::Fp32 &&
                  options.mode == ComputeMode::Fp32Accurate,
      .k = k, .out_d = out_distances, .out_i = out_indices};
  const std::size_t blocks = cudak::few_queries_blocks(a);
  if (blocks == 0) return false;
  const std::size_t entries = queries.rows * blocks * k;
  auto part_d = pool.get_managed_buffer(device, entries, Precision::Fp32, stream);
  auto part_i = pool.get_managed_buffer(device, entries * 4, Precision::Bytes, stream);
  for (auto* b : {&part_d, &part_i})
    if (!*b && !b->error().is_out_of_memory())
      return std::unexpected(b->error().with_context("knn: allocating the partial lists"));
  if (!part_d || !part_i) return false;
  if (auto ok = check(cudak::few_queries_knn(a, blocks, static_cast<float*>(part_d->raw_data()),
                                             static_cast<std::int32_t*>(part_i->raw_data()),
                                             stream.native()),
                      "knn", device);
      !ok)
    return std::unexpected(ok.error());
  return true;
}

Result<void> cuda_knn(GpuMemoryPool& pool, const Device& device, const Stream& stream,
                      const CudaMatrix& queries, const CudaMatrix& corpus,
                      const DistanceOptions& options, std::size_t k, std::size_t tile_cols,
                      float* out_distances, std::int32_t* out_indices, KnnPath& path,
                      const float* upper_bounds) {
  KnnRun run(pool, device, stream, queries, corpus, options, k, out_distances, out_indices,
             upper_bounds);
  return run.run(tile_cols, path);
}

Result<void> cuda_apply_upper_bounds(const Device& device, const Stream& stream,
                                     const float* upper_bounds, std::size_t queries, std::size_t k,
                                     float* distances, std::int32_t* indices) {
  if (auto ok = use_device(device, "knn"); !ok) return ok;
  return check(cudak::apply_upper_bounds(upper_bounds, queries, k, distances, indices,
                                         stream.native()),
               "knn", device);
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

Result<void> cuda_convert_stored(const Device& device, const Stream& stream, const void* in,
                                 std::size_t count, const StoredConvertOptions& options,
                                 Precision out_precision, void* out) {
  if (auto ok = use_device(device, "convert_stored"); !ok) return ok;
  return check(cudak::convert_stored(in, static_cast<int>(options.element), count,
                                     static_cast<float>(options.offset), options.exponent,
                                     element_of(out_precision),
                                     out, stream.native()),
               "convert_stored", device);
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

// The top-k kernel's own update: the running lists are what it folds candidates into.
Result<void> cuda_fold_topk(const Device& device, const Stream& stream, const float* distances,
                            const std::int32_t* indices, const FoldTopkOptions& options,
                            float* running_distances, std::int32_t* running_indices) {
  constexpr std::string_view op = "fold_topk";
  if (auto ok = use_device(device, op); !ok) return ok;
  return check(cudak::topk_update(distances, indices, options.queries, options.candidates,
                                  options.candidates, options.index_offset, options.k,
                                  running_distances, running_indices, stream.native()),
               op, device);
}

}  // namespace gpupool
