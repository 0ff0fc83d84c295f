// gpupool:kernels — validation and stream ordering.
//
// Each public function checks everything first (so a kernel never sees a bad argument), orders
// its work after inputs living on other streams, then hands the problem, in the kernels'
// vocabulary, to the device's kernel backend (gpu/kernel_backend.cppm: the CPU kernels on a
// simulated device, the CUDA kernels on a CUDA device).
module;
#include "cpu_kernels.hpp"  // the scalar conversions
#include "kernel_vocabulary.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <expected>
#include <fmt/format.h>
#include <initializer_list>
#include <limits>
#include <optional>
#include <span>
#include <utility>
#include <string>
#include <string_view>
#include <vector>
module gpupool;
import :kernel_backend;

namespace gpupool {

namespace {

std::unexpected<GpuError> invalid(std::string message, int device = -1) {
  return make_error(ErrorKind::InvalidInput, std::move(message),
                    device >= 0 ? std::optional<int>(device) : std::nullopt);
}

// Runs `body`, turning any escaping exception (std::bad_alloc, std::system_error) into an error.
template <class Body>
auto guarded(std::string_view operation, Body&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return make_error(ErrorKind::OutOfMemory, fmt::format("{}: host memory exhausted", operation));
  } catch (const std::exception& e) {
    return make_error(ErrorKind::Internal, fmt::format("{}: {}", operation, e.what()));
  }
}

std::string describe(const ManagedBuffer& b) {
  return fmt::format("{} {} elements on device {}", b.element_count(), to_string(b.precision()),
                     b.device_id());
}

Result<void> check_valid(const ManagedBuffer& b, std::string_view name, std::string_view op) {
  if (!b.valid())
    return invalid(fmt::format("{}: {} is an empty buffer; expected one from "
                               "GpuMemoryPool::get_managed_buffer", op, name));
  return {};
}

Result<void> check_same_device(const ManagedBuffer& a, std::string_view a_name,
                               const ManagedBuffer& b, std::string_view b_name,
                               std::string_view op) {
  if (a.device_id() != b.device_id())
    return invalid(fmt::format("{}: {} is on device {} but {} is on device {}; expected both on "
                               "one device", op, b_name, b.device_id(), a_name, a.device_id()),
                   a.device_id());
  return {};
}

Result<void> check_dim(std::size_t dim, std::string_view op) {
  if (dim == 0) return invalid(fmt::format("{}: dim 0; expected at least 1 element per vector", op));
  return {};
}

// Rows of a row-major matrix buffer: its element count must be a non-zero multiple of dim.
Result<std::size_t> rows_of(const ManagedBuffer& b, std::string_view name, std::size_t dim,
                            std::string_view op) {
  std::size_t n = b.element_count();
  if (n % dim != 0 || n == 0)
    return invalid(fmt::format("{}: {} holds {} elements ({}), not a multiple of dim {}; expected "
                               "rows × dim elements", op, name, n, describe(b), dim), b.device_id());
  return n / dim;
}

Result<void> check_precision(const ManagedBuffer& b, std::string_view name, Precision wanted,
                             std::string_view op) {
  if (b.precision() != wanted)
    return invalid(fmt::format("{}: {} is {}; expected {}", op, name, to_string(b.precision()),
                               to_string(wanted)), b.device_id());
  return {};
}

Result<void> check_capacity(const ManagedBuffer& b, std::string_view name, std::size_t needed,
                            std::string_view what, std::string_view op) {
  if (b.element_count() < needed)
    return invalid(fmt::format("{}: {} is too small: it holds {} elements ({}); expected at least "
                               "{} ({})", op, name, b.element_count(), describe(b), needed, what),
                   b.device_id());
  return {};
}

// A pair of buffers holding `count` top-k entries (merge_topk's and fold_topk's inputs and
// outputs): fp32 distances and int32 indices as Bytes, each large enough; `what` names the count.
Result<void> check_topk_entries(const ManagedBuffer& distances, std::string_view distances_name,
                                const ManagedBuffer& indices, std::string_view indices_name,
                                std::size_t count, std::string_view what, std::string_view op) {
  if (auto ok = check_precision(distances, distances_name, Precision::Fp32, op); !ok) return ok;
  if (auto ok = check_precision(indices, indices_name, Precision::Bytes, op); !ok) return ok;
  if (auto ok = check_capacity(distances, distances_name, count, what, op); !ok) return ok;
  return check_capacity(indices, indices_name, count * sizeof(std::int32_t),
                        fmt::format("{} × 4 bytes", what), op);
}

bool is_vector_precision(Precision p) {
  return p == Precision::Fp32 || p == Precision::Fp16 || p == Precision::Bf16 || p == Precision::Int8;
}

// The public types in the kernels' vocabulary (a vector precision: checked before).
kernels::Element kernel_element(Precision p) {
  switch (p) {
    case Precision::Fp16: return kernels::Element::Fp16;
    case Precision::Bf16: return kernels::Element::Bf16;
    case Precision::Int8: return kernels::Element::Int8;
    default: return kernels::Element::Fp32;
  }
}

kernels::Metric kernel_metric(Metric m) {
  switch (m) {
    case Metric::InnerProduct: return kernels::Metric::InnerProduct;
    case Metric::Cosine: return kernels::Metric::Cosine;
    default: return kernels::Metric::L2;
  }
}

kernels::Matrix kernel_matrix(const ManagedBuffer& b, const float* scales, std::size_t rows,
                              const float* norms = nullptr) {
  return kernels::Matrix{b.raw_data(), kernel_element(b.precision()), scales, rows, norms};
}

// Int8 scales: required for Int8 (fp32, same device, one per row), refused otherwise.
Result<const float*> check_scales(const ManagedBuffer& data, std::string_view data_name,
                                  const ManagedBuffer* scales, std::string_view scales_name,
                                  std::size_t rows, std::string_view op) {
  if (data.precision() != Precision::Int8) {
    if (scales)
      return invalid(fmt::format("{}: {} given for {} {} input; expected scales only for int8",
                                 op, scales_name, to_string(data.precision()), data_name),
                     data.device_id());
    return static_cast<const float*>(nullptr);
  }
  if (!scales)
    return invalid(fmt::format("{}: {} is int8 but {} is missing; expected an fp32 buffer of {} "
                               "per-row scales (value = scale * q)", op, data_name, scales_name,
                               rows), data.device_id());
  if (auto ok = check_valid(*scales, scales_name, op); !ok) return std::unexpected(ok.error());
  if (auto ok = check_same_device(data, data_name, *scales, scales_name, op); !ok)
    return std::unexpected(ok.error());
  if (auto ok = check_precision(*scales, scales_name, Precision::Fp32, op); !ok)
    return std::unexpected(ok.error());
  if (auto ok = check_capacity(*scales, scales_name, rows, "one scale per row", op); !ok)
    return std::unexpected(ok.error());
  return static_cast<const float*>(scales->raw_data());
}

// Makes work on `work` wait for everything already queued on the inputs' own streams.
Result<void> order_after_inputs(const Device& device, const Stream& work,
                                std::initializer_list<const ManagedBuffer*> inputs) {
  for (const ManagedBuffer* b : inputs) {
    if (!b || !b->valid() || b->stream() == work) continue;
    auto event = device.create_event();
    if (!event) return std::unexpected(event.error());
    if (auto ok = event->record(b->stream()); !ok) return ok;
    if (auto ok = event->make_wait(work); !ok) return ok;
  }
  return {};
}

// What validation of a distance call found out.
struct DistanceShape {
  std::size_t q_rows = 0, n_rows = 0;
  const float* q_scales = nullptr;
  const float* x_scales = nullptr;
  const float* x_norms = nullptr;  // knn's corpus_norms, or null
};

Result<DistanceShape> check_distance_inputs(const ManagedBuffer& queries,
                                            const ManagedBuffer& corpus,
                                            const DistanceOptions& options, std::string_view op) {
  if (auto ok = check_valid(queries, "queries", op); !ok) return std::unexpected(ok.error());
  if (auto ok = check_valid(corpus, "corpus", op); !ok) return std::unexpected(ok.error());
  if (auto ok = check_same_device(queries, "queries", corpus, "corpus", op); !ok)
    return std::unexpected(ok.error());
  if (auto ok = check_dim(options.dim, op); !ok) return std::unexpected(ok.error());
  if (!is_vector_precision(queries.precision()))
    return invalid(fmt::format("{}: queries are {}; expected fp32, fp16, bf16 or int8", op,
                               to_string(queries.precision())), queries.device_id());
  if (corpus.precision() != queries.precision())
    return invalid(fmt::format("{}: corpus is {} but queries are {}; expected one precision for "
                               "both", op, to_string(corpus.precision()),
                               to_string(queries.precision())), queries.device_id());
  if (options.metric != Metric::L2 && options.metric != Metric::InnerProduct &&
      options.metric != Metric::Cosine)
    return invalid(fmt::format("{}: metric {}; expected L2, InnerProduct or Cosine", op,
                               static_cast<int>(options.metric)));
  if (options.mode != ComputeMode::Fp32Accurate && options.mode != ComputeMode::Tf32)
    return invalid(fmt::format("{}: compute mode {}; expected Fp32Accurate or Tf32", op,
                               static_cast<int>(options.mode)));
  DistanceShape shape;
  auto q = rows_of(queries, "queries", options.dim, op);
  if (!q) return std::unexpected(q.error());
  auto n = rows_of(corpus, "corpus", options.dim, op);
  if (!n) return std::unexpected(n.error());
  shape.q_rows = *q;
  shape.n_rows = *n;
  if (shape.n_rows > static_cast<std::size_t>(INT32_MAX))
    return invalid(fmt::format("{}: corpus has {} rows; expected at most {} (int32 indices)", op,
                               shape.n_rows, INT32_MAX), corpus.device_id());
  auto qs = check_scales(queries, "queries", options.query_scales, "query_scales", shape.q_rows, op);
  if (!qs) return std::unexpected(qs.error());
  auto xs = check_scales(corpus, "corpus", options.corpus_scales, "corpus_scales", shape.n_rows, op);
  if (!xs) return std::unexpected(xs.error());
  shape.q_scales = *qs;
  shape.x_scales = *xs;
  return shape;
}

// The validated inputs of a distance or kNN call as the kernels take them.
DistanceProblem distance_problem(const ManagedBuffer& queries, const ManagedBuffer& corpus,
                                 const DistanceShape& shape, const DistanceOptions& options) {
  return {.queries = kernel_matrix(queries, shape.q_scales, shape.q_rows),
          .corpus = kernel_matrix(corpus, shape.x_scales, shape.n_rows, shape.x_norms),
          .dim = options.dim,
          .metric = kernel_metric(options.metric),
          .tf32 = options.mode == ComputeMode::Tf32};
}

// The first re-rank field that is set, for messages ("" when none is).
std::string set_rerank_field(const RerankOptions& r) {
  if (r.queries) return "rerank.queries";
  if (r.corpus) return "rerank.corpus";
  if (r.candidates != 0) return fmt::format("rerank.candidates = {}", r.candidates);
  return "";
}

// Refuses knn's own options (re-rank, upper bounds, corpus norms) elsewhere: they would be
// silently ignored.
Result<void> check_no_knn_options(const DistanceOptions& options, std::string_view op) {
  std::string field = set_rerank_field(options.rerank);
  if (!field.empty())
    return invalid(fmt::format("{}: {} given; expected re-rank options only for knn", op, field));
  if (!options.upper_bounds.empty())
    return invalid(fmt::format("{}: upper_bounds given ({} values); expected them only for knn",
                               op, options.upper_bounds.size()));
  if (options.corpus_norms)
    return invalid(fmt::format("{}: corpus_norms given; expected them only for knn ({} sums the "
                               "norms within its own tiles)", op, op));
  return {};
}

// knn's corpus_norms: none, or fp32 beside the corpus with one value per row.
Result<const float*> check_corpus_norms(const ManagedBuffer& corpus, const ManagedBuffer* norms,
                                        std::size_t rows) {
  constexpr std::string_view op = "knn";
  if (!norms) return nullptr;
  if (auto ok = check_valid(*norms, "corpus_norms", op); !ok) return std::unexpected(ok.error());
  if (auto ok = check_same_device(corpus, "corpus", *norms, "corpus_norms", op); !ok)
    return std::unexpected(ok.error());
  if (auto ok = check_precision(*norms, "corpus_norms", Precision::Fp32, op); !ok)
    return std::unexpected(ok.error());
  if (auto ok = check_capacity(*norms, "corpus_norms", rows, "one squared norm per corpus row", op);
      !ok)
    return std::unexpected(ok.error());
  return static_cast<const float*>(norms->raw_data());
}

// knn's upper bounds: none, or one per query and none NaN.
Result<void> check_upper_bounds(std::span<const float> bounds, std::size_t queries, int device) {
  if (bounds.empty()) return {};
  if (bounds.size() != queries)
    return invalid(fmt::format("knn: upper_bounds holds {} values; expected one per query, {}",
                               bounds.size(), queries), device);
  auto nan = std::find_if(bounds.begin(), bounds.end(), [](float b) { return std::isnan(b); });
  if (nan != bounds.end())
    return invalid(fmt::format("knn: upper_bounds[{}] is NaN; expected a distance or +inf",
                               nan - bounds.begin()), device);
  return {};
}

// What validation of knn's re-rank options found out; candidates == 0 means no re-rank.
struct RerankPlan {
  std::size_t candidates = 0;  // C per query, k..min(kMaxK, N)
  const ManagedBuffer* queries = nullptr;  // the fp32 originals
  const ManagedBuffer* corpus = nullptr;
  bool on() const { return candidates != 0; }
};

// One fp32 original: valid, beside the low-precision input, fp32, and the same rows × dim.
Result<void> check_original(const ManagedBuffer& input, std::string_view input_name,
                            const ManagedBuffer& original, std::string_view name, std::size_t rows,
                            std::size_t dim) {
  constexpr std::string_view op = "knn";
  if (auto ok = check_valid(original, name, op); !ok) return ok;
  if (auto ok = check_same_device(input, input_name, original, name, op); !ok) return ok;
  if (auto ok = check_precision(original, name, Precision::Fp32, op); !ok) return ok;
  if (original.element_count() != rows * dim)
    return invalid(fmt::format("knn: {} holds {} elements ({}); expected {} = {} rows × dim {}, "
                               "the shape of {}", name, original.element_count(),
                               describe(original), rows * dim, rows, dim, input_name),
                   original.device_id());
  return {};
}

Result<RerankPlan> check_rerank(const ManagedBuffer& queries, const ManagedBuffer& corpus,
                                const DistanceShape& shape, std::size_t k,
                                const DistanceOptions& options) {
  const RerankOptions& r = options.rerank;
  std::string field = set_rerank_field(r);
  if (field.empty()) return RerankPlan{};
  int device = queries.device_id();
  if (queries.precision() == Precision::Fp32)
    return invalid(fmt::format("knn: {} given for fp32 inputs; expected re-rank options only with "
                               "fp16, bf16 or int8 inputs (fp32 knn is already exact)", field),
                   device);
  if (!r.queries && !r.corpus)
    return invalid(fmt::format("knn: {} but rerank.queries and rerank.corpus are missing; "
                               "expected the fp32 originals of queries and corpus with it", field),
                   device);
  if (!r.queries || !r.corpus)
    return invalid(fmt::format("knn: {} is missing ({} is given); expected the fp32 originals of "
                               "both queries and corpus", r.queries ? "rerank.corpus" : "rerank.queries",
                               r.queries ? "rerank.queries" : "rerank.corpus"), device);
  if (auto ok = check_original(queries, "queries", *r.queries, "rerank.queries", shape.q_rows,
                               options.dim); !ok)
    return std::unexpected(ok.error());
  if (auto ok = check_original(corpus, "corpus", *r.corpus, "rerank.corpus", shape.n_rows,
                               options.dim); !ok)
    return std::unexpected(ok.error());
  if (r.candidates != 0 && (r.candidates < k || r.candidates > kMaxK))
    return invalid(fmt::format("knn: rerank.candidates = {}; expected k = {} .. {} (or 0 for the "
                               "default)", r.candidates, k, kMaxK), device);
  std::size_t c = r.candidates != 0 ? std::min(r.candidates, shape.n_rows)
                                    : default_rerank_candidates(k, shape.n_rows);
  return RerankPlan{c, r.queries, r.corpus};
}

// Distances into `out` (validated), on `work`; a CUDA device's temporaries come from out's pool.
Result<void> run_distance(const ManagedBuffer& queries, const ManagedBuffer& corpus,
                          const ManagedBuffer& out, const DistanceShape& shape,
                          const DistanceOptions& options, const Device& device,
                          const Stream& work) {
  if (auto ok = order_after_inputs(device, work,
                                   {&queries, &corpus, options.query_scales, options.corpus_scales});
      !ok)
    return ok;
  return kernel_backend(device).distances(device, work,
                                          distance_problem(queries, corpus, shape, options), out);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

Half to_half(float value) noexcept { return Half{cpu_kernels::float_to_half(value)}; }
BFloat16 to_bfloat16(float value) noexcept {
  return BFloat16{cpu_kernels::float_to_bfloat16(value)};
}
float to_float(Half value) noexcept { return cpu_kernels::half_to_float(value.bits); }
float to_float(BFloat16 value) noexcept { return cpu_kernels::bfloat16_to_float(value.bits); }

Result<void> l2_distance(const ManagedBuffer& queries, const ManagedBuffer& corpus,
                         ManagedBuffer& out, const DistanceOptions& options) {
  constexpr std::string_view op = "l2_distance";
  return guarded(op, [&]() -> Result<void> {
    auto shape = check_distance_inputs(queries, corpus, options, op);
    if (!shape) return std::unexpected(shape.error());
    if (auto ok = check_no_knn_options(options, op); !ok) return ok;
    if (auto ok = check_valid(out, "out", op); !ok) return ok;
    if (auto ok = check_same_device(queries, "queries", out, "out", op); !ok) return ok;
    if (auto ok = check_precision(out, "out", Precision::Fp32, op); !ok) return ok;
    if (auto ok = check_capacity(out, "out", shape->q_rows * shape->n_rows,
                                 fmt::format("{} queries × {} corpus rows", shape->q_rows,
                                             shape->n_rows), op);
        !ok)
      return ok;
    return run_distance(queries, corpus, out, *shape, options, out.device(), out.stream());
  });
}

Result<ManagedBuffer> l2_distance(GpuMemoryPool& pool, const ManagedBuffer& queries,
                                  const ManagedBuffer& corpus, const DistanceOptions& options) {
  constexpr std::string_view op = "l2_distance";
  return guarded(op, [&]() -> Result<ManagedBuffer> {
    auto shape = check_distance_inputs(queries, corpus, options, op);
    if (!shape) return std::unexpected(shape.error());
    if (auto ok = check_no_knn_options(options, op); !ok) return std::unexpected(ok.error());
    Device device = queries.device();
    auto out = pool.get_managed_buffer(device, shape->q_rows * shape->n_rows, Precision::Fp32,
                                       queries.stream());
    if (!out) return std::unexpected(out.error().with_context("l2_distance: allocating out"));
    if (auto ok = run_distance(queries, corpus, *out, *shape, options, device, queries.stream());
        !ok)
      return std::unexpected(ok.error());
    return std::move(*out);
  });
}

namespace {

// The approximate top-C in the low precision into pooled candidate lists, then the exact fp32
// distances of those candidates and their k best into `out`, all on `work`.
Result<void> knn_reranked(GpuMemoryPool& pool, const KernelBackend& backend, const Device& device,
                          const Stream& work, const DistanceProblem& problem, std::size_t k,
                          const RerankPlan& plan, TopkLists out, KnnPath& path) {
  std::size_t count = problem.queries.rows * plan.candidates;
  auto cand_d = knn_temporary(pool, device, count, Precision::Fp32, work, "re-rank candidates");
  if (!cand_d) return std::unexpected(cand_d.error());
  auto cand_i = knn_temporary(pool, device, count * sizeof(std::int32_t), Precision::Bytes, work,
                              "re-rank candidates");
  if (!cand_i) return std::unexpected(cand_i.error());
  TopkLists candidates{static_cast<float*>(cand_d->raw_data()),
                       static_cast<std::int32_t*>(cand_i->raw_data())};
  if (auto ok = backend.select(pool, device, work, problem, plan.candidates, candidates, path,
                               nullptr);
      !ok)
    return ok;
  const RerankProblem rerank{.queries = static_cast<const float*>(plan.queries->raw_data()),
                             .corpus = static_cast<const float*>(plan.corpus->raw_data()),
                             .rows = problem.queries.rows, .dim = problem.dim,
                             .metric = problem.metric, .candidates = plan.candidates, .k = k};
  return backend.rerank(device, work, rerank, {std::move(*cand_d), std::move(*cand_i)}, out);
}

}  // namespace

Result<KnnResult> knn(GpuMemoryPool& pool, const ManagedBuffer& queries,
                      const ManagedBuffer& corpus, std::size_t k, const DistanceOptions& options) {
  constexpr std::string_view op = "knn";
  return guarded(op, [&]() -> Result<KnnResult> {
    auto shape = check_distance_inputs(queries, corpus, options, op);
    if (!shape) return std::unexpected(shape.error());
    if (k == 0 || k > kMaxK)
      return invalid(fmt::format("knn: k = {}; expected 1..{}", k, kMaxK), queries.device_id());
    if (k > shape->n_rows)
      return invalid(fmt::format("knn: k = {} is larger than the corpus, which has N = {} rows; "
                                 "expected k <= N", k, shape->n_rows), queries.device_id());
    auto plan = check_rerank(queries, corpus, *shape, k, options);
    if (!plan) return std::unexpected(plan.error());
    if (auto ok = check_upper_bounds(options.upper_bounds, shape->q_rows, queries.device_id()); !ok)
      return std::unexpected(ok.error());
    auto norms = check_corpus_norms(corpus, options.corpus_norms, shape->n_rows);
    if (!norms) return std::unexpected(norms.error());
    shape->x_norms = *norms;
    Device device = queries.device();
    const Stream& work = queries.stream();

    KnnResult result;
    result.queries = shape->q_rows;
    result.k = k;
    auto distances = knn_temporary(pool, device, shape->q_rows * k, Precision::Fp32, work, "distances");
    if (!distances) return std::unexpected(distances.error());
    auto indices = knn_temporary(pool, device, shape->q_rows * k * sizeof(std::int32_t),
                              Precision::Bytes, work, "indices");
    if (!indices) return std::unexpected(indices.error());
    result.distances = std::move(*distances);
    result.indices = std::move(*indices);
    if (auto ok = order_after_inputs(device, work, {&queries, &corpus, options.query_scales,
                                                    options.corpus_scales, options.corpus_norms,
                                                    plan->queries, plan->corpus});
        !ok)
      return std::unexpected(ok.error());
    const TopkLists out{static_cast<float*>(result.distances.raw_data()),
                        static_cast<std::int32_t*>(result.indices.raw_data())};
    const KernelBackend& backend = kernel_backend(device);
    UpperBounds bounds;
    if (!options.upper_bounds.empty()) {
      auto staged = backend.stage_upper_bounds(pool, device, work, options.upper_bounds);
      if (!staged) return std::unexpected(staged.error());
      bounds = std::move(*staged);
    }
    const DistanceProblem problem = distance_problem(queries, corpus, *shape, options);
    // The re-rank's candidates are approximate: its bounds apply to the exact result only.
    auto ok = plan->on() ? knn_reranked(pool, backend, device, work, problem, k, *plan, out,
                                        result.path)
                         : backend.select(pool, device, work, problem, k, out, result.path,
                                          bounds.device_values());
    if (!ok) return std::unexpected(ok.error());
    if (!bounds.values.empty())
      if (auto applied = backend.apply_upper_bounds(device, work, bounds, k, out); !applied)
        return std::unexpected(applied.error());
    return result;
  });
}

Result<void> row_norms(const ManagedBuffer& vectors, ManagedBuffer& out, std::size_t dim,
                       const ManagedBuffer* scales) {
  constexpr std::string_view op = "row_norms";
  return guarded(op, [&]() -> Result<void> {
    if (auto ok = check_valid(vectors, "vectors", op); !ok) return ok;
    if (auto ok = check_valid(out, "out", op); !ok) return ok;
    if (auto ok = check_same_device(vectors, "vectors", out, "out", op); !ok) return ok;
    if (auto ok = check_dim(dim, op); !ok) return ok;
    if (!is_vector_precision(vectors.precision()))
      return invalid(fmt::format("row_norms: vectors are {}; expected fp32, fp16, bf16 or int8",
                                 to_string(vectors.precision())), vectors.device_id());
    auto rows = rows_of(vectors, "vectors", dim, op);
    if (!rows) return std::unexpected(rows.error());
    auto s = check_scales(vectors, "vectors", scales, "scales", *rows, op);
    if (!s) return std::unexpected(s.error());
    if (auto ok = check_precision(out, "out", Precision::Fp32, op); !ok) return ok;
    if (auto ok = check_capacity(out, "out", *rows, "one norm per row", op); !ok) return ok;
    Device device = out.device();
    if (auto ok = order_after_inputs(device, out.stream(), {&vectors, scales}); !ok) return ok;
    return kernel_backend(device).row_norms(device, out.stream(),
                                            kernel_matrix(vectors, *s, *rows), dim,
                                            static_cast<float*>(out.raw_data()));
  });
}

Result<void> convert(const ManagedBuffer& in, ManagedBuffer& out, const ConvertOptions& options) {
  constexpr std::string_view op = "convert";
  return guarded(op, [&]() -> Result<void> {
    if (auto ok = check_valid(in, "in", op); !ok) return ok;
    if (auto ok = check_valid(out, "out", op); !ok) return ok;
    if (auto ok = check_same_device(in, "in", out, "out", op); !ok) return ok;
    if (auto ok = check_dim(options.dim, op); !ok) return ok;
    Precision from = in.precision(), to = out.precision();
    bool down = from == Precision::Fp32 &&
                (to == Precision::Fp16 || to == Precision::Bf16 || to == Precision::Int8);
    bool up = to == Precision::Fp32 &&
              (from == Precision::Fp16 || from == Precision::Bf16 || from == Precision::Int8);
    if (!down && !up)
      return invalid(fmt::format("convert: {} → {}; expected fp32 → fp16/bf16/int8 or "
                                 "fp16/bf16/int8 → fp32", to_string(from), to_string(to)),
                     in.device_id());
    auto rows = rows_of(in, "in", options.dim, op);
    if (!rows) return std::unexpected(rows.error());
    if (auto ok = check_capacity(out, "out", in.element_count(), "as many elements as in", op); !ok)
      return ok;
    float* out_scales = nullptr;
    const float* in_scales = nullptr;
    if (to == Precision::Int8 || from == Precision::Int8) {
      const ManagedBuffer& int8 = to == Precision::Int8 ? static_cast<const ManagedBuffer&>(out) : in;
      auto s = check_scales(int8, to == Precision::Int8 ? "out" : "in", options.scales, "scales",
                            *rows, op);
      if (!s) return std::unexpected(s.error());
      if (to == Precision::Int8) out_scales = const_cast<float*>(*s);
      else in_scales = *s;
    } else if (options.scales) {
      return invalid(fmt::format("convert: scales given for {} → {}; expected scales only for "
                                 "int8", to_string(from), to_string(to)), in.device_id());
    }
    Device device = out.device();
    if (auto ok = order_after_inputs(device, out.stream(), {&in, options.scales}); !ok) return ok;
    return kernel_backend(device).convert(device, out.stream(), kernel_matrix(in, in_scales, *rows),
                                          options.dim, kernel_element(to), out.raw_data(),
                                          out_scales);
  });
}

Result<void> convert_stored(const ManagedBuffer& in, ManagedBuffer& out,
                            const StoredConvertOptions& options) {
  constexpr std::string_view op = "convert_stored";
  return guarded(op, [&]() -> Result<void> {
    if (auto ok = check_valid(in, "in", op); !ok) return ok;
    if (auto ok = check_valid(out, "out", op); !ok) return ok;
    if (auto ok = check_same_device(in, "in", out, "out", op); !ok) return ok;
    const auto element = static_cast<unsigned>(options.element);
    if (element > static_cast<unsigned>(StoredElement::Fp32))
      return invalid(fmt::format("convert_stored: element {}; expected uint8, int8, fp16 or fp32",
                                 element), in.device_id());
    if (!is_vector_precision(out.precision()))
      return invalid(fmt::format("convert_stored: out is {}; expected fp32, fp16, bf16 or int8",
                                 to_string(out.precision())), out.device_id());
    constexpr std::int32_t kMaxOffset = 1 << 24;
    if (options.offset > kMaxOffset || options.offset < -kMaxOffset)
      return invalid(fmt::format("convert_stored: offset {}; expected -2^24..2^24", options.offset),
                     in.device_id());
    constexpr std::int32_t kMaxExponent = 512;
    if (options.exponent > kMaxExponent || options.exponent < -kMaxExponent)
      return invalid(fmt::format("convert_stored: exponent {}; expected -512..512", options.exponent),
                     in.device_id());
    const std::size_t size = stored_size(options.element);
    if (in.size_bytes() % size != 0)
      return invalid(fmt::format("convert_stored: in holds {} bytes, not a whole number of {} "
                                 "values", in.size_bytes(), to_string(options.element)),
                     in.device_id());
    const std::size_t count = in.size_bytes() / size;
    if (auto ok = check_capacity(out, "out", count, "one element per stored value", op); !ok) return ok;
    Device device = out.device();
    if (auto ok = order_after_inputs(device, out.stream(), {&in}); !ok) return ok;
    if (count == 0) return {};
    return kernel_backend(device).convert_stored(device, out.stream(), in.raw_data(), count,
                                                 options, kernel_element(out.precision()),
                                                 out.raw_data());
  });
}

Result<void> merge_topk(const ManagedBuffer& distances, const ManagedBuffer& indices,
                        ManagedBuffer& out_distances, ManagedBuffer& out_indices,
                        const MergeTopkOptions& options) {
  constexpr std::string_view op = "merge_topk";
  return guarded(op, [&]() -> Result<void> {
    for (auto [b, name] : {std::pair{&distances, "distances"}, std::pair{&indices, "indices"},
                           std::pair<const ManagedBuffer*, const char*>{&out_distances, "out_distances"},
                           std::pair<const ManagedBuffer*, const char*>{&out_indices, "out_indices"}}) {
      if (auto ok = check_valid(*b, name, op); !ok) return ok;
      if (auto ok = check_same_device(distances, "distances", *b, name, op); !ok) return ok;
    }
    if (options.queries == 0)
      return invalid("merge_topk: queries 0; expected at least 1", distances.device_id());
    if (options.lists == 0)
      return invalid("merge_topk: lists 0; expected at least 1 partial list per query",
                     distances.device_id());
    if (options.list_length == 0)
      return invalid("merge_topk: list_length 0; expected at least 1 entry per list",
                     distances.device_id());
    std::size_t candidates = options.lists * options.list_length;
    if (options.k == 0 || options.k > kMaxK || options.k > candidates)
      return invalid(fmt::format("merge_topk: k = {}; expected 1..{} and at most lists × "
                                 "list_length = {}", options.k, kMaxK, candidates),
                     distances.device_id());
    if (auto ok = check_topk_entries(distances, "distances", indices, "indices",
                                     options.queries * candidates, "queries × lists × list_length",
                                     op);
        !ok)
      return ok;
    if (auto ok = check_topk_entries(out_distances, "out_distances", out_indices, "out_indices",
                                     options.queries * options.k, "queries × k", op);
        !ok)
      return ok;
    Device device = out_distances.device();
    const Stream& work = out_distances.stream();
    if (auto ok = order_after_inputs(device, work, {&distances, &indices}); !ok) return ok;
    // out_indices may live on another stream: its earlier work must be done before we write it.
    if (auto ok = order_after_inputs(device, work, {&out_indices}); !ok) return ok;
    auto* d = static_cast<const float*>(distances.raw_data());
    auto* i = static_cast<const std::int32_t*>(indices.raw_data());
    const TopkLists out{static_cast<float*>(out_distances.raw_data()),
                        static_cast<std::int32_t*>(out_indices.raw_data())};
    return kernel_backend(device).merge_topk(device, work, d, i, options, out);
  });
}

Result<void> fold_topk(const ManagedBuffer& candidate_distances,
                       const ManagedBuffer& candidate_indices, ManagedBuffer& running_distances,
                       ManagedBuffer& running_indices, const FoldTopkOptions& options) {
  constexpr std::string_view op = "fold_topk";
  return guarded(op, [&]() -> Result<void> {
    const int device_id = running_distances.device_id();
    for (auto [b, name] :
         {std::pair<const ManagedBuffer*, const char*>{&candidate_distances, "candidate_distances"},
          std::pair<const ManagedBuffer*, const char*>{&candidate_indices, "candidate_indices"},
          std::pair<const ManagedBuffer*, const char*>{&running_distances, "running_distances"},
          std::pair<const ManagedBuffer*, const char*>{&running_indices, "running_indices"}}) {
      if (auto ok = check_valid(*b, name, op); !ok) return ok;
      if (auto ok = check_same_device(running_distances, "running_distances", *b, name, op); !ok)
        return ok;
    }
    if (options.queries == 0) return invalid("fold_topk: queries 0; expected at least 1", device_id);
    if (options.candidates == 0)
      return invalid("fold_topk: candidates 0; expected at least 1 candidate per query", device_id);
    if (options.k == 0 || options.k > kMaxK)
      return invalid(fmt::format("fold_topk: k = {}; expected 1..{}", options.k, kMaxK), device_id);
    if (options.index_offset < 0 || options.index_offset > std::numeric_limits<std::int32_t>::max())
      return invalid(fmt::format("fold_topk: index_offset = {}; expected 0..{} (indices are int32)",
                                 options.index_offset, std::numeric_limits<std::int32_t>::max()),
                     device_id);
    if (auto ok = check_topk_entries(candidate_distances, "candidate_distances", candidate_indices,
                                     "candidate_indices", options.queries * options.candidates,
                                     "queries × candidates", op);
        !ok)
      return ok;
    if (auto ok = check_topk_entries(running_distances, "running_distances", running_indices,
                                     "running_indices", options.queries * options.k, "queries × k",
                                     op);
        !ok)
      return ok;
    Device device = running_distances.device();
    const Stream& work = running_distances.stream();
    if (auto ok = order_after_inputs(device, work,
                                     {&candidate_distances, &candidate_indices, &running_indices});
        !ok)
      return ok;
    auto* d = static_cast<const float*>(candidate_distances.raw_data());
    auto* i = static_cast<const std::int32_t*>(candidate_indices.raw_data());
    const TopkLists running{static_cast<float*>(running_distances.raw_data()),
                            static_cast<std::int32_t*>(running_indices.raw_data())};
    return kernel_backend(device).fold_topk(device, work, d, i, options, running);
  });
}

Result<std::vector<std::int32_t>> indices_to_host(const ManagedBuffer& indices) {
  return guarded("indices_to_host", [&]() -> Result<std::vector<std::int32_t>> {
    if (auto ok = check_valid(indices, "indices", "indices_to_host"); !ok)
      return std::unexpected(ok.error());
    if (auto ok = check_precision(indices, "indices", Precision::Bytes, "indices_to_host"); !ok)
      return std::unexpected(ok.error());
    if (indices.size_bytes() % sizeof(std::int32_t) != 0)
      return invalid(fmt::format("indices_to_host: indices hold {} bytes, not a multiple of 4",
                                 indices.size_bytes()), indices.device_id());
    std::vector<std::int32_t> host(indices.size_bytes() / sizeof(std::int32_t));
    if (auto ok = indices.download(std::as_writable_bytes(std::span(host))); !ok)
      return std::unexpected(ok.error());
    return host;
  });
}

}  // namespace gpupool
