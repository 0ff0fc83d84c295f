// The kernel backend of a CUDA device (CUDA builds only): runs the CUDA kernels (gpu/cuda/, their
// plain-C++ headers), maps CUDA and cuBLAS statuses to GpuError, and takes every temporary from
// the pool. Arguments arrive validated from gpu/kernels.cpp.
module;
#include "cuda/few_queries_knn.cuh"
#include "cuda/kernels.cuh"
#include "cuda/knn_filter.cuh"
#include "cuda/sample_minima.cuh"
#include "kernel_vocabulary.hpp"
#include "knn_plan.hpp"

#include <cublas_v2.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <expected>
#include <fmt/format.h>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
module gpupool;
import :pool_access;
import :kernel_backend;

namespace gpupool {

namespace {

// cuBLAS statuses: CUBLAS_STATUS_ALLOC_FAILED is out-of-memory, the rest ErrorKind::Cublas.
GpuError cublas_status_error(int status, std::string_view what, int device) {
  const char* name = cublasGetStatusName(static_cast<cublasStatus_t>(status));
  std::string message = fmt::format("{}: {}", what, name ? name : "unknown cuBLAS status");
  ErrorKind kind =
      status == CUBLAS_STATUS_ALLOC_FAILED ? ErrorKind::OutOfMemory : ErrorKind::Cublas;
  return GpuError(kind, std::move(message), device, NativeStatus{StatusSource::Cublas, status});
}

Result<void> check(const kernels::Status& s, std::string_view op, const Device& device) {
  if (s.ok()) return {};
  std::string what = fmt::format("{}: {}", op, s.what);
  if (s.cublas != 0) return std::unexpected(cublas_status_error(s.cublas, what, device.id()));
  return std::unexpected(cuda_status_error(s.cuda, what, device.id()));
}

Result<void> use_device(const Device& device, std::string_view op) {
  return check(cuda_kernels::set_device(device.properties().ordinal), op, device);
}

// GPUPOOL_KNN_TILE_BYTES (if set): the plan's cap on the Q × tile distance buffer
// (knn_plan::capped_tile_cols), 0 where unset.
std::size_t tile_bytes_cap() {
  const char* text = std::getenv("GPUPOOL_KNN_TILE_BYTES");
  if (!text || !*text) return 0;
  return std::strtoull(text, nullptr, 10);
}

// l2_distance: KernelBackend::distances.
Result<void> pairwise_distance(const Device& device, const Stream& stream,
                               const DistanceProblem& problem, const ManagedBuffer& out) {
  if (auto ok = use_device(device, "l2_distance"); !ok) return ok;
  const kernels::Matrix &q = problem.queries, &x = problem.corpus;
  const std::size_t dim = problem.dim;
  // The norms (and int8 widenings, fp32-accurate's fp16 halves) in one temporary from out's
  // pool, so that the call stays within the pool's limit and reuses cached memory; returned in
  // stream order. Where the halves do not fit, fp32-accurate runs without them (3×TF32).
  auto take = [&](const cuda_kernels::PairwiseScratch& l) -> Result<ManagedBuffer> {
    if (l.bytes == 0) return ManagedBuffer{};
    return BufferAccess::temporary_beside(out, l.bytes, stream);
  };
  cuda_kernels::PairwiseScratch layout =
      cuda_kernels::pairwise_scratch(q, x, dim, problem.metric, problem.tf32, true);
  auto scratch = take(layout);
  if (!scratch && layout.x_halves != cuda_kernels::PairwiseScratch::kNone) {
    layout = cuda_kernels::pairwise_scratch(q, x, dim, problem.metric, problem.tf32, false);
    scratch = take(layout);
  }
  if (!scratch)
    return std::unexpected(scratch.error().with_context(fmt::format(
        "l2_distance: allocating {} bytes of scratch (row norms{}) from out's pool", layout.bytes,
        layout.q16 != cuda_kernels::PairwiseScratch::kNone ? ", int8 widenings" : "")));
  return check(cuda_kernels::pairwise(device.properties().ordinal, q, x, dim, problem.metric,
                                      problem.tf32, layout, scratch->raw_data(),
                                      static_cast<float*>(out.raw_data()), stream.native()),
               "l2_distance", device);
}

// What one knn call on a chunk of queries reads and writes: fixed for the whole call.
struct KnnCall {
  GpuMemoryPool& pool;
  const Device& device;
  const Stream& stream;
  void* native;  // the stream, as the kernels take it
  kernels::Matrix q, x;  // the chunk of queries, the corpus
  kernels::Metric metric;
  bool tf32;  // ComputeMode::Tf32
  std::size_t k, dim;
  float* out_d;  // the running lists, Q × k
  std::int32_t* out_i;
  const float* bounds;  // knn's upper bounds on the device, or null

  Result<void> ok(const kernels::Status& s) const { return check(s, "knn", device); }
};

// The plan's view of one knn call (a chunk of queries against the whole corpus).
knn_plan::KnnProblem knn_problem(const KnnCall& call, std::size_t tile_cols) {
  const kernels::Element element = call.x.element;
  return {.queries = call.q.rows, .rows = call.x.rows, .dim = call.dim, .k = call.k,
          .value_bytes = kernels::element_bytes(element),
          .fp32 = element == kernels::Element::Fp32,
          .int8 = element == kernels::Element::Int8,
          .accurate = !call.tf32,
          .inner_product = call.metric == kernels::Metric::InnerProduct,
          .l2 = call.metric == kernels::Metric::L2,
          .tile_cols = tile_cols, .tile_bytes_cap = tile_bytes_cap()};
}

// What the filter kernels take of the corpus rows (and the queries beside them) and of
// fp32-accurate's scaled copies, on the current device.
knn_plan::KernelCapabilities kernel_capabilities(const kernels::Matrix& queries,
                                                const kernels::Matrix& corpus, std::size_t dim) {
  const kernels::Element element = corpus.element;
  return {
      .filter_reads_rows = cuda_kernels::tiles_read_rows(element, dim),
      .resident_filter_on_corpus = cuda_kernels::resident_filter_runs(element, dim, corpus.data),
      .resident_filter_on_scaled_copies = cuda_kernels::resident_filter_takes(
          kernels::Element::Fp16, cuda_kernels::scaled_fp16_dim(dim)),
      .streamed_filter_on_corpus =
          cuda_kernels::streamed_filter_runs(element, dim, queries.data, corpus.data)};
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
  auto rows = pool.get_managed_buffer(device, total_rows * cuda_kernels::scaled_fp16_dim(dim),
                                      Precision::Fp16, stream);
  auto scales = pool.get_managed_buffer(device, total_rows, Precision::Fp32, stream);
  for (auto* b : {&rows, &scales})
    if (!*b && !b->error().is_out_of_memory())
      return std::unexpected(b->error().with_context("knn: allocating the filter's fp16 copies"));
  if (rows && scales) copies.rows = std::move(*rows), copies.scales = std::move(*scales);
  return copies;
}

// Every temporary of one knn call, allocated from its plan on the work stream and returned
// to the pool in that stream's order when the call ends.
struct KnnScratch {
  ScaledCopies copies;           // fp32-accurate's filter operands (plan.scaled_copies)
  ManagedBuffer norms;           // squared norms (L2, cosine; the bound's scale): Q, then N
                                 // unless the caller's corpus norms serve (own_corpus_norms)
  ManagedBuffer tile;            // Q × tile_cols dot products
  ManagedBuffer part_d, part_i;  // sliced top-k: Q × slices × k partial lists
  ManagedBuffer q16, x16;        // int8: queries and one corpus tile widened to fp16
  ManagedBuffer q3, x3;          // fp32-accurate: queries and one corpus tile split for 3×TF32
  std::size_t tile_cols = 0;     // the plan's, halved while the pool had less room than it said
  std::size_t slices = 1;        // top-k slices of a tile (cuda_kernels::topk_slices)
};

// Whether the call computes the corpus rows' norms itself: where it needs them and the caller
// gave none.
bool own_corpus_norms(const KnnCall& call, const knn_plan::KnnPlan& plan) {
  return plan.norms && !call.x.norms;
}

// The rest of `plan`'s scratch, beside the copies it already holds.
Result<KnnScratch> knn_scratch(const KnnCall& call, const knn_plan::KnnProblem& problem,
                               const knn_plan::KnnPlan& plan, ScaledCopies copies) {
  GpuMemoryPool& pool = call.pool;
  const Device& device = call.device;
  const Stream& stream = call.stream;
  KnnScratch scratch;
  scratch.copies = std::move(copies);
  auto take = [&](ManagedBuffer& into, std::size_t n, Precision p, std::string_view what) {
    auto b = knn_temporary(pool, device, n, p, stream, what);
    if (b) into = std::move(*b);
    return b.has_value() ? Result<void>{} : Result<void>(std::unexpected(b.error()));
  };
  if (plan.norms)
    if (auto ok = take(scratch.norms,
                       problem.queries + (own_corpus_norms(call, plan) ? problem.rows : 0),
                       Precision::Fp32, "row norms");
        !ok)
      return std::unexpected(ok.error());
  std::size_t tile_cols = plan.tile_cols;
  auto tile = pool.get_managed_buffer(device, problem.queries * tile_cols, Precision::Fp32, stream);
  while (!tile && tile.error().is_out_of_memory() &&
         tile_cols > std::min<std::size_t>(problem.rows, 64)) {
    tile_cols = (tile_cols + 1) / 2;
    tile = pool.get_managed_buffer(device, problem.queries * tile_cols, Precision::Fp32, stream);
  }
  if (!tile) return std::unexpected(tile.error().with_context("knn: allocating the distance tile"));
  scratch.tile = std::move(*tile);
  scratch.tile_cols = tile_cols;
  scratch.slices = cuda_kernels::topk_slices(problem.queries, tile_cols, problem.k);
  if (scratch.slices > 1) {
    std::size_t lists = problem.queries * scratch.slices * problem.k;
    if (auto ok = take(scratch.part_d, lists, Precision::Fp32, "partial top-k lists"); !ok)
      return std::unexpected(ok.error());
    if (auto ok = take(scratch.part_i, lists * 4, Precision::Bytes, "partial top-k lists"); !ok)
      return std::unexpected(ok.error());
  }
  if (problem.int8) {
    if (auto ok = take(scratch.q16, problem.queries * problem.dim, Precision::Fp16,
                       "int8 widening");
        !ok)
      return std::unexpected(ok.error());
    if (auto ok = take(scratch.x16, tile_cols * problem.dim, Precision::Fp16, "int8 widening"); !ok)
      return std::unexpected(ok.error());
  }
  if (plan.split) {  // without room for the split: plain fp32 FMA instead
    auto q3 =
        pool.get_managed_buffer(device, problem.queries * 3 * problem.dim, Precision::Fp32, stream);
    auto x3 = pool.get_managed_buffer(device, tile_cols * 3 * problem.dim, Precision::Fp32, stream);
    if (q3 && x3) scratch.q3 = std::move(*q3), scratch.x3 = std::move(*x3);
    else if (!(q3 ? x3 : q3).error().is_out_of_memory())
      return std::unexpected((q3 ? x3 : q3).error().with_context("knn: allocating 3xTF32 splits"));
  }
  return scratch;
}

struct PlannedCall {
  knn_plan::KnnPlan plan;
  KnnScratch scratch;
};

// The call's plan (knn_plan::plan_knn) and its scratch: fp32-accurate's copies first where the
// plan asks for them, and the plan again without them where the pool has no room.
Result<PlannedCall> plan_call(const KnnCall& call, std::size_t tile_cols) {
  const knn_plan::KnnProblem problem = knn_problem(call, tile_cols);
  const knn_plan::KernelCapabilities capabilities = kernel_capabilities(call.q, call.x, call.dim);
  knn_plan::KnnPlan plan = knn_plan::plan_knn(problem, capabilities);
  ScaledCopies copies;
  if (plan.scaled_copies) {
    auto made = scaled_copies(call.pool, call.device, call.stream,
                              call.q.rows + call.x.rows, call.dim);
    if (!made) return std::unexpected(made.error());
    copies = std::move(*made);
    if (!copies.rows.valid()) plan = knn_plan::plan_knn(problem, capabilities, false);
  }
  auto scratch = knn_scratch(call, problem, plan, std::move(copies));
  if (!scratch) return std::unexpected(scratch.error());
  return PlannedCall{plan, std::move(*scratch)};
}

// The operands as the kernels read them, made in the scratch before either path runs.
struct KnnOperands {
  const float* q_norms = nullptr;  // the queries' squared norms, or null
  const float* x_norms = nullptr;  // the corpus rows' (the scratch's or the caller's), or null
  kernels::Matrix gq{};            // the queries as the GEMM reads them (widened, split)
  std::size_t gdim = 0;          // values a row of gq
  bool split = false;            // corpus tiles split for 3×TF32 into x3
  bool int8 = false;             // corpus tiles widened to fp16 into x16
  bool tf32 = false;             // the GEMM may use TF32
  bool refine = false;           // L2 fp32-accurate: the top-k pass re-computes from fp32 rows
  kernels::Matrix fq{}, fx{};      // what the filter multiplies (fp32-accurate: the scaled copies)
  std::size_t fdim = 0;          // values a row of fq and fx
};

// The scaled copies of queries and corpus, as the filter's operands (its q and x), and their
// squared norms into q_norms and x_norms (if not null) in the same pass.
Result<void> scale_for_filter(const Device& device, const Stream& stream,
                              const kernels::Matrix& queries, const kernels::Matrix& corpus,
                              std::size_t dim, const ScaledCopies& copies, float* q_norms,
                              float* x_norms, kernels::Matrix& fq, kernels::Matrix& fx) {
  auto* halves = static_cast<std::uint16_t*>(copies.rows.raw_data());
  auto* scales = static_cast<float*>(copies.scales.raw_data());
  std::size_t padded = cuda_kernels::scaled_fp16_dim(dim);
  fq = kernels::Matrix{halves, kernels::Element::Fp16, scales, queries.rows};
  fx = kernels::Matrix{halves + queries.rows * padded, kernels::Element::Fp16,
                       scales + queries.rows, corpus.rows};
  for (auto [from, to, to_norms] : {std::tuple{&queries, &fq, q_norms},
                                    std::tuple{&corpus, &fx, x_norms}})
    if (auto ok = check(
            cuda_kernels::scale_to_fp16(static_cast<const float*>(from->data), from->rows, dim,
                                        const_cast<void*>(to->data), const_cast<float*>(to->scales),
                                        to_norms, stream.native()),
            "knn", device);
        !ok)
      return ok;
  return {};
}

// Norms (with the filter's copies, from the same pass), and the queries as the GEMM reads them.
Result<KnnOperands> prepare_operands(const KnnCall& call, const knn_plan::KnnPlan& plan,
                                     const KnnScratch& scratch) {
  KnnOperands operands;
  auto* norms = static_cast<float*>(scratch.norms.raw_data());
  const bool own = own_corpus_norms(call, plan);
  if (norms) operands.q_norms = norms, operands.x_norms = own ? norms + call.q.rows : call.x.norms;
  operands.fq = call.q, operands.fx = call.x, operands.fdim = call.dim;
  if (scratch.copies.rows.valid()) {
    operands.fdim = cuda_kernels::scaled_fp16_dim(call.dim);
    auto r = scale_for_filter(call.device, call.stream, call.q, call.x, call.dim, scratch.copies,
                              norms, own ? norms + call.q.rows : nullptr, operands.fq,
                              operands.fx);
    if (!r) return std::unexpected(r.error());
  } else if (norms) {
    if (auto r = call.ok(cuda_kernels::row_norms(call.q, call.dim, norms, call.native)); !r)
      return std::unexpected(r.error());
    if (own)
      if (auto r =
              call.ok(cuda_kernels::row_norms(call.x, call.dim, norms + call.q.rows, call.native));
          !r)
        return std::unexpected(r.error());
  }
  operands.gq = call.q;
  operands.gdim = call.dim;
  operands.split = scratch.x3.valid();
  operands.int8 = call.x.element == kernels::Element::Int8;
  operands.tf32 = !plan.accurate || operands.split;
  operands.refine = plan.refine;
  if (operands.split) {
    auto* q3 = static_cast<float*>(scratch.q3.raw_data());
    if (auto r = call.ok(
            cuda_kernels::split_tf32(call.q, 0, call.q.rows, call.dim, false, q3, call.native));
        !r)
      return std::unexpected(r.error());
    operands.gq = kernels::Matrix{q3, kernels::Element::Fp32, nullptr, call.q.rows};
    operands.gdim = 3 * call.dim;
  }
  if (operands.int8) {
    if (auto r = call.ok(cuda_kernels::widen_int8(call.q, 0, call.q.rows, call.dim,
                                                  scratch.q16.raw_data(), call.native));
        !r)
      return std::unexpected(r.error());
    operands.gq =
        kernels::Matrix{scratch.q16.raw_data(), kernels::Element::Fp16, nullptr, call.q.rows};
  }
  return operands;
}

// The running lists emptied.
Result<void> init_lists(const KnnCall& call) {
  return call.ok(
      cuda_kernels::topk_init(call.out_d, call.out_i, call.q.rows * call.k, call.native));
}

// Where the tiled path reads corpus rows: the corpus itself, or the sample's pieces gathered side
// by side (cuda_kernels::gather_pieces), whose columns map back to corpus rows through `pieces`.
struct RowSource {
  kernels::Matrix x;               // the rows (and int8 scales)
  const float* norms = nullptr;  // their squared norms (L2, cosine)
  const float* fp32 = nullptr;   // the fp32 rows, for the L2 cancellation re-compute
  cuda_kernels::FilterSample pieces;  // length 0: the corpus itself
};

RowSource whole_corpus(const KnnCall& call, const KnnOperands& operands) {
  return {call.x, operands.x_norms,
          operands.refine ? static_cast<const float*>(call.x.data) : nullptr, {}};
}

// The tiled path: rows [first, first + count) of `source` into the running lists, a tile at a
// time. The GEMM writes a tile's dot products, the top-k pass turns them into distances as it
// reads them and folds them in. Int8 goes through the fp16 GEMM on exact widenings, the scales
// applied in that pass; fp32-accurate through one TF32 GEMM over 3·dim split values (3×TF32),
// the L2 cancellation re-compute in fp32.
Result<void> run_tiled(const KnnCall& call, const KnnScratch& scratch, const KnnOperands& operands,
                       const RowSource& source, std::size_t first, std::size_t count) {
  auto* tile = static_cast<float*>(scratch.tile.raw_data());
  const std::size_t cols = scratch.tile_cols;
  cuda_kernels::Epilogue e;
  e.metric = call.metric;
  e.dim = call.dim;
  for (std::size_t x0 = first; x0 < first + count; x0 += cols) {
    std::size_t nx = std::min(cols, first + count - x0);
    kernels::Matrix gx = source.x;  // what the GEMM reads, from gx0 on
    std::size_t gx0 = x0;
    if (operands.split) {  // this tile's rows split to the start of x3
      auto* x3 = static_cast<float*>(scratch.x3.raw_data());
      if (auto r =
              call.ok(cuda_kernels::split_tf32(source.x, x0, nx, call.dim, true, x3, call.native));
          !r)
        return r;
      gx = kernels::Matrix{x3, kernels::Element::Fp32, nullptr, nx}, gx0 = 0;
    }
    if (operands.int8) {  // this tile's rows widened to the start of x16
      void* x16 = scratch.x16.raw_data();
      if (auto r = call.ok(cuda_kernels::widen_int8(source.x, x0, nx, call.dim, x16, call.native));
          !r)
        return r;
      gx = kernels::Matrix{x16, kernels::Element::Fp16, nullptr, nx}, gx0 = 0;
      e.q_scales = call.q.scales;
      e.x_scales = source.x.scales + x0;
    }
    if (auto r = call.ok(cuda_kernels::dot_products(call.device.properties().ordinal, operands.gq,
                                                    gx, gx0, nx, operands.gdim, operands.tf32, tile,
                                                    cols, call.native));
        !r)
      return r;
    // The tile's dot products (rows x0.. of `source`) → distances → the running lists.
    e.q_norms = operands.q_norms;
    e.x_norms = source.norms ? source.norms + x0 : nullptr;
    e.q32 = source.fp32 ? static_cast<const float*>(call.q.data) : nullptr;
    e.x32 = source.fp32 ? source.fp32 + x0 * call.dim : nullptr;
    e.piece_period = source.pieces.period;
    e.piece_length = source.pieces.length;
    auto base = static_cast<std::int64_t>(x0);
    auto* part_d = static_cast<float*>(scratch.part_d.raw_data());
    auto* part_i = static_cast<std::int32_t*>(scratch.part_i.raw_data());
    auto selected =
        scratch.slices > 1
            ? call.ok(cuda_kernels::topk_update_split(tile, call.q.rows, nx, cols, base, call.k,
                                                      scratch.slices, part_d, part_i, call.out_d,
                                                      call.out_i, call.native, &e))
            : call.ok(cuda_kernels::topk_update(tile, nullptr, call.q.rows, nx, cols, base, call.k,
                                                call.out_d, call.out_i, call.native, &e));
    if (!selected) return selected;
  }
  return {};
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

// The sample's pieces gathered side by side (rows, norms, int8 scales): the tiled path or the
// minima kernel reads them as one corpus (one launch each instead of one per piece).
struct GatheredSample {
  ManagedBuffer rows, extras;
  RowSource source;
};

// `from`: the corpus (call.x, call.dim) or, for the bound's minima, its scaled copies (operands.fx,
// operands.fdim).
Result<GatheredSample> gather_sample(const KnnCall& call, const cuda_kernels::FilterSample& sample,
                                     const KnnOperands& operands, const kernels::Matrix& from,
                                     std::size_t dim) {
  std::size_t rows = cuda_kernels::kFilterPieces * sample.length;
  std::size_t row_bytes = dim * cuda_kernels::element_bytes(from.element);
  GatheredSample g;
  for (auto [into, elements, precision] :
       {std::tuple{&g.rows, rows * row_bytes, Precision::Bytes},
        std::tuple{&g.extras, 2 * rows, Precision::Fp32}}) {
    auto b = knn_temporary(call.pool, call.device, elements, precision, call.stream,
                           "the kNN filter's sample");
    if (!b) return std::unexpected(b.error());
    *into = std::move(*b);
  }
  auto* norms = static_cast<float*>(g.extras.raw_data());
  float* scales = norms + rows;
  auto gather = [&](const void* from, std::size_t bytes, void* to) {
    return call.ok(cuda_kernels::gather_pieces(from, bytes, cuda_kernels::kFilterPieces,
                                               sample.period, sample.length, to, call.native));
  };
  if (auto r = gather(from.data, row_bytes, g.rows.raw_data()); !r)
    return std::unexpected(r.error());
  if (operands.x_norms)
    if (auto r = gather(operands.x_norms, sizeof(float), norms); !r)
      return std::unexpected(r.error());
  if (from.scales)
    if (auto r = gather(from.scales, sizeof(float), scales); !r) return std::unexpected(r.error());
  // The fp32 rows for the tiled path's L2 re-compute (not the scaled copies the minima read).
  const bool fp32_rows = operands.refine && from.element == kernels::Element::Fp32;
  g.source = {
      kernels::Matrix{g.rows.raw_data(), from.element, from.scales ? scales : nullptr, rows},
      operands.x_norms ? norms : nullptr,
      fp32_rows ? static_cast<const float*>(g.rows.raw_data()) : nullptr, sample};
  return g;
}

// The sample folded into the running lists through the tiled path: the filter's thresholds are
// their k-th entries, and it skips the sample's rows.
Result<void> fold_sample(const KnnCall& call, const knn_plan::FilterPlan& filter,
                         const KnnScratch& scratch, const KnnOperands& operands) {
  auto sample = gather_sample(call, filter.sample, operands, call.x, call.dim);
  if (!sample) return std::unexpected(sample.error());
  return run_tiled(call, scratch, operands, sample->source, 0, sample->source.x.rows);
}

// FilterArgs::lower_bound: fp32-accurate's error bound on the scaled copies' distances, else 0.
// Its slack grows with dim for the fp32 sums (MMA, norms, re-rank): dim · 2^-23.
float filter_lower_bound(const knn_plan::FilterPlan& filter, std::size_t dim) {
  return filter.lower_bound ? cuda_kernels::kScaledFp16ProductError + dim * 0x1p-23f : 0.0f;
}

// Each query's threshold from the sample's group minima (cuda_kernels::sample_minima): Q floats of
// `minima` (the minima's scratch, which the caller keeps until the filter has read them).
Result<float*> sample_minima(const KnnCall& call, const knn_plan::FilterPlan& filter,
                             const KnnOperands& operands, ManagedBuffer& minima) {
  auto sample = gather_sample(call, filter.sample, operands, operands.fx, operands.fdim);
  if (!sample) return std::unexpected(sample.error());
  std::size_t groups = sample->source.x.rows / cuda_kernels::kMinimaGroupRows;
  auto taken = knn_temporary(call.pool, call.device, call.q.rows * (groups + 1), Precision::Fp32,
                             call.stream, "the kNN filter's sample minima");
  if (!taken) return std::unexpected(taken.error());
  minima = std::move(*taken);
  float* thresholds = static_cast<float*>(minima.raw_data()) + call.q.rows * groups;
  cuda_kernels::MinimaArgs a{.q = operands.fq, .x = sample->source.x, .dim = operands.fdim,
                             .metric = call.metric,
                             .q_norms = operands.q_norms, .x_norms = sample->source.norms,
                             .k = call.k, .lower_bound = filter_lower_bound(filter, call.dim),
                             .minima = static_cast<float*>(minima.raw_data()),
                             .thresholds = thresholds};
  if (auto r = call.ok(cuda_kernels::sample_minima(a, call.native)); !r)
    return std::unexpected(r.error());
  return thresholds;
}

// Every row outside the sample (every row, with `thresholds` from the minima) through
// cuda_kernels::knn_filter into candidate lists, re-ranked exactly in fp32-accurate mode, then
// merged into the running lists. overflowed: a list was too short (the call must redo the work
// tiled).
Result<void> filter_rows(const KnnCall& call, const knn_plan::FilterPlan& filter,
                         const KnnOperands& operands, const float* thresholds, bool& overflowed) {
  const std::size_t rows = call.q.rows, capacity = filter.capacity;
  auto lists = filter_lists(call.pool, call.device, call.stream, rows, capacity);
  if (!lists) return std::unexpected(lists.error());
  auto* cand_d = static_cast<float*>(lists->distances.raw_data());
  auto* cand_i = static_cast<std::int32_t*>(lists->indices.raw_data());
  auto* counts = static_cast<std::uint32_t*>(lists->counts.raw_data());
  if (auto r = call.device.fill(lists->counts.raw_data(), 0, rows * 4, call.stream); !r) return r;
  cuda_kernels::FilterArgs f{.q = operands.fq, .x = operands.fx, .dim = operands.fdim,
                             .metric = call.metric, .q_norms = operands.q_norms,
                             .x_norms = operands.x_norms,
                             .run_d = call.out_d, .run_i = call.out_i, .k = call.k,
                             .sample = filter.minima ? cuda_kernels::FilterSample{} : filter.sample,
                             .thresholds = thresholds, .bounds = call.bounds, .cand_d = cand_d,
                             .cand_i = cand_i, .counts = counts, .capacity = capacity};
  f.lower_bound = filter_lower_bound(filter, call.dim);
  if (auto r = call.ok(cuda_kernels::knn_filter(f, call.native)); !r) return r;
  if (filter.lower_bound)
    if (auto r = call.ok(cuda_kernels::rerank_distances(
            static_cast<const float*>(call.q.data), static_cast<const float*>(call.x.data), rows,
            call.dim, call.metric, cand_i, capacity, cand_d, call.native, counts));
        !r)
      return r;
  if (auto r =
          call.ok(cuda_kernels::topk_update(cand_d, cand_i, rows, capacity, capacity, 0, call.k,
                                            call.out_d, call.out_i, call.native, nullptr, counts));
      !r)
    return r;
  return call.ok(cuda_kernels::filter_overflowed(counts, rows, capacity, call.native, overflowed));
}

// The filtered path (large corpora, k <= 256, see knn_plan::filter_plan): a sample of the corpus
// gives each query a threshold (its k-th best, through the tiled path, or the k-th best of its
// group minima, cuda_kernels::sample_minima), then cuda_kernels::knn_filter compares every row's
// distance with it in the GEMM's registers and keeps only those that beat it, which one top-k
// pass (after an exact re-rank in fp32-accurate mode) merges in. Where a list overflows, the whole
// corpus goes through run_tiled instead. path: Filtered or FilterFellBack.
Result<void> run_filtered(const KnnCall& call, const knn_plan::FilterPlan& filter,
                          const KnnScratch& scratch, const KnnOperands& operands, KnnPath& path) {
  ManagedBuffer minima;  // the sample's group minima, then the thresholds
  const float* thresholds = nullptr;
  if (filter.minima) {
    auto t = sample_minima(call, filter, operands, minima);
    if (!t) return std::unexpected(t.error());
    thresholds = *t;
  } else if (auto ok = fold_sample(call, filter, scratch, operands); !ok) {
    return ok;
  }
  bool overflowed = false;
  if (auto ok = filter_rows(call, filter, operands, thresholds, overflowed); !ok) return ok;
  // The bound's minima are of upper bounds, so its thresholds lie up to the error bound above
  // the sample's k-th exact distance, and the filter keeps rows up to the bound below them: rows
  // crowded within that window (closer than about 2^-9 of their distance) can overflow the lists
  // where the sample's exact k-th would not. Before the whole call goes tiled, the filter runs
  // once more with that k-th (the sample through the tiled path), as without the minima.
  if (overflowed && filter.minima && filter.lower_bound) {
    knn_plan::FilterPlan exact_sample = filter;
    exact_sample.minima = false;  // the filter takes the running lists' k-th
    if (auto ok = init_lists(call); !ok) return ok;
    if (auto ok = fold_sample(call, exact_sample, scratch, operands); !ok) return ok;
    if (auto ok = filter_rows(call, exact_sample, operands, nullptr, overflowed); !ok) return ok;
  }
  path = overflowed ? KnnPath::FilterFellBack : KnnPath::Filtered;
  if (!overflowed) return {};
  // Rows in an order that defeats the sample (a list overflowed): everything again, tiled.
  if (auto ok = init_lists(call); !ok) return ok;
  return run_tiled(call, scratch, operands, whole_corpus(call, operands), 0, call.x.rows);
}

// Few queries (cuda_kernels::few_queries_takes): one pass over the corpus, which is then the
// whole cost (docs/kernels.md, "Few queries"), and no tiles. False where it does not apply or its
// partial lists do not fit the pool: the caller tiles instead. GPUPOOL_FEW_QUERIES=0 switches it
// off, for comparisons.
Result<bool> knn_few_queries(GpuMemoryPool& pool, const Device& device, const Stream& stream,
                             const DistanceProblem& problem, std::size_t k, TopkLists out) {
  const char* off = std::getenv("GPUPOOL_FEW_QUERIES");
  const kernels::Matrix &q = problem.queries, &x = problem.corpus;
  if ((off && std::string_view(off) == "0") ||
      !cuda_kernels::few_queries_takes(q, x, problem.dim, k))
    return false;
  if (auto ok = use_device(device, "knn"); !ok) return std::unexpected(ok.error());
  const cuda_kernels::FewQueriesArgs a{
      .q = q, .x = x, .dim = problem.dim, .metric = problem.metric,
      .exact_l2 = problem.metric == kernels::Metric::L2 && x.element == kernels::Element::Fp32 &&
                  !problem.tf32,
      .k = k, .out_d = out.distances, .out_i = out.indices};
  const std::size_t blocks = cuda_kernels::few_queries_blocks(a);
  if (blocks == 0) return false;
  const std::size_t entries = q.rows * blocks * k;
  auto part_d = pool.get_managed_buffer(device, entries, Precision::Fp32, stream);
  auto part_i = pool.get_managed_buffer(device, entries * 4, Precision::Bytes, stream);
  for (auto* b : {&part_d, &part_i})
    if (!*b && !b->error().is_out_of_memory())
      return std::unexpected(b->error().with_context("knn: allocating the partial lists"));
  if (!part_d || !part_i) return false;
  if (auto ok = check(cuda_kernels::few_queries_knn(
                          a, blocks, static_cast<float*>(part_d->raw_data()),
                          static_cast<std::int32_t*>(part_i->raw_data()), stream.native()),
                      "knn", device);
      !ok)
    return std::unexpected(ok.error());
  return true;
}

// One chunk of queries against the whole corpus: the plan and its scratch, the operands, then the
// tiled or the filtered run, which share nothing that changes while they run.
Result<void> knn_chunk(GpuMemoryPool& pool, const Device& device, const Stream& stream,
                       const DistanceProblem& problem, const kernels::Matrix& queries,
                       std::size_t k, std::size_t tile_cols, TopkLists out, KnnPath& path,
                       const float* upper_bounds) {
  path = KnnPath::Tiled;
  const KnnCall call{.pool = pool, .device = device, .stream = stream, .native = stream.native(),
                     .q = queries, .x = problem.corpus, .metric = problem.metric,
                     .tf32 = problem.tf32, .k = k, .dim = problem.dim, .out_d = out.distances,
                     .out_i = out.indices, .bounds = upper_bounds};
  if (auto ok = use_device(device, "knn"); !ok) return ok;
  auto planned = plan_call(call, tile_cols);
  if (!planned) return std::unexpected(planned.error());
  const auto& [plan, scratch] = *planned;
  auto operands = prepare_operands(call, plan, scratch);
  if (!operands) return std::unexpected(operands.error());
  if (auto ok = init_lists(call); !ok) return ok;
  // The scratch goes back to the pool ordered on the stream.
  if (!plan.filter.on) return run_tiled(call, scratch, *operands, whole_corpus(call, *operands), 0,
                                        call.x.rows);
  return run_filtered(call, plan.filter, scratch, *operands, path);
}

// Rows [first, first + rows) of the queries.
kernels::Matrix query_rows(const kernels::Matrix& queries, std::size_t dim, std::size_t first,
                           std::size_t rows) {
  const std::size_t row_bytes = dim * kernels::element_bytes(queries.element);
  return {static_cast<const std::byte*>(queries.data) + first * row_bytes, queries.element,
          queries.scales ? queries.scales + first : nullptr, rows};
}

// Sorted lists from candidates: the running lists emptied, then the top-k kernel's update folds
// `count` candidates per row (with their own indices) into them.
Result<void> select_from(const Device& device, const Stream& stream, std::string_view op,
                         const float* distances, const std::int32_t* indices, std::size_t rows,
                         std::size_t count, std::size_t k, TopkLists out) {
  void* native = stream.native();
  if (auto ok =
          check(cuda_kernels::topk_init(out.distances, out.indices, rows * k, native), op, device);
      !ok)
    return ok;
  return check(cuda_kernels::topk_update(distances, indices, rows, count, count, 0, k,
                                         out.distances, out.indices, native),
               op, device);
}

class CudaKernelBackend final : public KernelBackend {
 public:
  Result<void> distances(const Device& device, const Stream& stream,
                         const DistanceProblem& problem, const ManagedBuffer& out) const override {
    return pairwise_distance(device, stream, problem, out);
  }

  // Few queries in one pass where that kernel takes them; otherwise query chunks of the tile's
  // rows, each tiling over (or filtering) the whole corpus.
  Result<void> select(GpuMemoryPool& pool, const Device& device, const Stream& stream,
                      const DistanceProblem& problem, std::size_t k, TopkLists out, KnnPath& path,
                      const float* bounds) const override {
    auto few = knn_few_queries(pool, device, stream, problem, k, out);
    if (!few) return std::unexpected(few.error());
    if (*few) return {};  // its path reads as tiled
    const std::size_t q_rows = problem.queries.rows;
    const knn_plan::TileShape tile =
        knn_plan::choose_tile(pool_headroom(pool, device), q_rows, problem.corpus.rows, true);
    for (std::size_t q0 = 0; q0 < q_rows; q0 += tile.rows) {
      const std::size_t nq = std::min(tile.rows, q_rows - q0);
      KnnPath taken = KnnPath::Tiled;
      if (auto ok = knn_chunk(pool, device, stream, problem,
                              query_rows(problem.queries, problem.dim, q0, nq), k, tile.cols,
                              {out.distances + q0 * k, out.indices + q0 * k}, taken,
                              bounds ? bounds + q0 : nullptr);
          !ok)
        return ok;
      path = std::max(path, taken);  // the enumerators go from fast to slow
    }
    return {};
  }

  // The exact distances of every candidate over the candidates' distances (the kernel reads only
  // their indices), then the k best of them; both lists go back to the pool ordered on the stream.
  Result<void> rerank(const Device& device, const Stream& stream, const RerankProblem& p,
                      CandidateLists lists, TopkLists out) const override {
    constexpr std::string_view op = "knn (re-rank)";
    if (auto ok = use_device(device, op); !ok) return ok;
    auto* cand_d = static_cast<float*>(lists.distances.raw_data());
    auto* cand_i = static_cast<const std::int32_t*>(lists.indices.raw_data());
    if (auto ok =
            check(cuda_kernels::rerank_distances(p.queries, p.corpus, p.rows, p.dim, p.metric,
                                                 cand_i, p.candidates, cand_d, stream.native()),
                  op, device);
        !ok)
      return ok;
    return select_from(device, stream, op, cand_d, cand_i, p.rows, p.candidates, p.k, out);
  }

  // The filter reads the bounds on the device: one upload, a temporary of the call.
  Result<UpperBounds> stage_upper_bounds(GpuMemoryPool& pool, const Device& device,
                                         const Stream& stream,
                                         std::span<const float> bounds) const override {
    auto b = knn_temporary(pool, device, bounds.size(), Precision::Fp32, stream,
                           "the upper bounds");
    if (!b) return std::unexpected(b.error());
    if (auto ok = b->upload(bounds); !ok) return std::unexpected(ok.error());
    return UpperBounds{bounds, std::move(*b)};
  }

  Result<void> apply_upper_bounds(const Device& device, const Stream& stream,
                                  const UpperBounds& bounds, std::size_t k,
                                  TopkLists lists) const override {
    if (auto ok = use_device(device, "knn"); !ok) return ok;
    return check(cuda_kernels::apply_upper_bounds(bounds.device_values(), bounds.values.size(), k,
                                                  lists.distances, lists.indices, stream.native()),
                 "knn", device);
  }

  Result<void> row_norms(const Device& device, const Stream& stream,
                         const kernels::Matrix& vectors, std::size_t dim,
                         float* out) const override {
    if (auto ok = use_device(device, "row_norms"); !ok) return ok;
    return check(cuda_kernels::row_norms(vectors, dim, out, stream.native()), "row_norms", device);
  }

  Result<void> convert(const Device& device, const Stream& stream, const kernels::Matrix& in,
                       std::size_t dim, kernels::Element to, void* out,
                       float* out_scales) const override {
    if (auto ok = use_device(device, "convert"); !ok) return ok;
    return check(cuda_kernels::convert(in, dim, to, out, out_scales, stream.native()), "convert",
                 device);
  }

  Result<void> convert_stored(const Device& device, const Stream& stream, const void* in,
                              std::size_t count, const StoredConvertOptions& options,
                              kernels::Element to, void* out) const override {
    if (auto ok = use_device(device, "convert_stored"); !ok) return ok;
    return check(cuda_kernels::convert_stored(in, static_cast<int>(options.element), count,
                                              static_cast<float>(options.offset), options.exponent,
                                              to, out, stream.native()),
                 "convert_stored", device);
  }

  Result<void> merge_topk(const Device& device, const Stream& stream, const float* distances,
                          const std::int32_t* indices, const MergeTopkOptions& options,
                          TopkLists out) const override {
    constexpr std::string_view op = "merge_topk";
    if (auto ok = use_device(device, op); !ok) return ok;
    return select_from(device, stream, op, distances, indices, options.queries,
                       options.lists * options.list_length, options.k, out);
  }

  // The top-k kernel's own update: the running lists are what it folds candidates into.
  Result<void> fold_topk(const Device& device, const Stream& stream, const float* distances,
                         const std::int32_t* indices, const FoldTopkOptions& options,
                         TopkLists running) const override {
    constexpr std::string_view op = "fold_topk";
    if (auto ok = use_device(device, op); !ok) return ok;
    return check(cuda_kernels::topk_update(distances, indices, options.queries, options.candidates,
                                           options.candidates, options.index_offset, options.k,
                                           running.distances, running.indices, stream.native()),
                 op, device);
  }
};

}  // namespace

const KernelBackend& cuda_kernel_backend() {
  static const CudaKernelBackend backend;
  return backend;
}

}  // namespace gpupool
