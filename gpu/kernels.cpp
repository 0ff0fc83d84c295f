// gpupool:kernels — validation, stream ordering, tiling and dispatch by device kind.
//
// Each public function checks everything first (so a kernel never sees a bad argument), orders
// its work after inputs living on other streams, then hands raw pointers to the CPU kernels
// (gpu/cpu_kernels.cpp, through Device::enqueue_host_work) or to the CUDA kernels
// (gpu/cuda_kernels.cpp; a build without CUDA has no CUDA devices and answers DeviceUnavailable).
module;
#include "cpu_kernels.hpp"
#include "knn_plan.hpp"

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
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <string>
#include <string_view>
#include <vector>
module gpupool;

namespace gpupool {

#if defined(GPUPOOL_WITH_CUDA)
// gpu/cuda_kernels.cpp: knn for a few queries in one pass over the corpus, where it applies
// (false: it does not, and cuda_knn takes the call).
Result<bool> cuda_knn_few_queries(GpuMemoryPool& pool, const Device& device, const Stream& stream,
                                  const CudaMatrix& queries, const CudaMatrix& corpus,
                                  const DistanceOptions& options, std::size_t k,
                                  float* out_distances, std::int32_t* out_indices);
#endif

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

cpu::Element element_of(Precision p) {
  switch (p) {
    case Precision::Fp16: return cpu::Element::Fp16;
    case Precision::Bf16: return cpu::Element::Bf16;
    case Precision::Int8: return cpu::Element::Int8;
    default: return cpu::Element::Fp32;
  }
}

cpu::Metric metric_of(Metric m) {
  switch (m) {
    case Metric::InnerProduct: return cpu::Metric::InnerProduct;
    case Metric::Cosine: return cpu::Metric::Cosine;
    default: return cpu::Metric::L2;
  }
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

int host_threads(const Device& device) {
  return std::max(1, device.properties().multiprocessor_count);
}

[[maybe_unused]] std::unexpected<GpuError> no_cuda(const Device& device, std::string_view op) {
  return make_error(ErrorKind::DeviceUnavailable,
                    fmt::format("{}: {} is a CUDA device but this gpupool was built without the "
                                "CUDA backend (configure with the 'cuda' preset)",
                                op, device.describe()), device.id());
}

// What validation of a distance call found out.
struct DistanceShape {
  std::size_t q_rows = 0, n_rows = 0;
  const float* q_scales = nullptr;
  const float* x_scales = nullptr;
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

cpu::MatrixRef cpu_matrix(const ManagedBuffer& b, const float* scales, std::size_t rows) {
  return cpu::MatrixRef{b.raw_data(), element_of(b.precision()), scales, rows};
}

[[maybe_unused]] CudaMatrix cuda_matrix(const ManagedBuffer& b, const float* scales,
                                        std::size_t rows) {
  return CudaMatrix{b.raw_data(), b.precision(), scales, rows};
}

// The first re-rank field that is set, for messages ("" when none is).
std::string set_rerank_field(const RerankOptions& r) {
  if (r.queries) return "rerank.queries";
  if (r.corpus) return "rerank.corpus";
  if (r.candidates != 0) return fmt::format("rerank.candidates = {}", r.candidates);
  return "";
}

// Refuses knn's own options (re-rank, upper bounds) elsewhere: they would be silently ignored.
Result<void> check_no_rerank(const DistanceOptions& options, std::string_view op) {
  std::string field = set_rerank_field(options.rerank);
  if (!field.empty())
    return invalid(fmt::format("{}: {} given; expected re-rank options only for knn", op, field));
  if (!options.upper_bounds.empty())
    return invalid(fmt::format("{}: upper_bounds given ({} values); expected them only for knn",
                               op, options.upper_bounds.size()));
  return {};
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
                          const DistanceOptions& options, const Device& device, const Stream& work,
                          [[maybe_unused]] std::string_view op) {
  if (auto ok = order_after_inputs(device, work,
                                   {&queries, &corpus, options.query_scales, options.corpus_scales});
      !ok)
    return ok;
  if (device.kind() == DeviceKind::Cuda) {
#if defined(GPUPOOL_WITH_CUDA)
    return cuda_pairwise_distance(device, work, cuda_matrix(queries, shape.q_scales, shape.q_rows),
                                  cuda_matrix(corpus, shape.x_scales, shape.n_rows), options, out);
#else
    return no_cuda(device, op);
#endif
  }
  auto q = cpu_matrix(queries, shape.q_scales, shape.q_rows);
  auto x = cpu_matrix(corpus, shape.x_scales, shape.n_rows);
  std::size_t dim = options.dim;
  cpu::Metric metric = metric_of(options.metric);
  int threads = host_threads(device);
  auto* distances = static_cast<float*>(out.raw_data());
  return device.enqueue_host_work(work, [=] {
    cpu::pairwise_distance(q, x, dim, metric, distances, threads);
  });
}

// Bytes the pool may still take on `device` for temporaries (memory_headroom, the one definition
// batching and planning share); none when the device cannot say.
std::size_t pool_headroom(const GpuMemoryPool& pool, const Device& device) {
  auto headroom = memory_headroom(pool, device);
  return headroom ? headroom->bytes : 0;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

Half to_half(float value) noexcept { return Half{cpu::float_to_half(value)}; }
BFloat16 to_bfloat16(float value) noexcept { return BFloat16{cpu::float_to_bfloat16(value)}; }
float to_float(Half value) noexcept { return cpu::half_to_float(value.bits); }
float to_float(BFloat16 value) noexcept { return cpu::bfloat16_to_float(value.bits); }

Result<void> l2_distance(const ManagedBuffer& queries, const ManagedBuffer& corpus,
                         ManagedBuffer& out, const DistanceOptions& options) {
  constexpr std::string_view op = "l2_distance";
  return guarded(op, [&]() -> Result<void> {
    auto shape = check_distance_inputs(queries, corpus, options, op);
    if (!shape) return std::unexpected(shape.error());
    if (auto ok = check_no_rerank(options, op); !ok) return ok;
    if (auto ok = check_valid(out, "out", op); !ok) return ok;
    if (auto ok = check_same_device(queries, "queries", out, "out", op); !ok) return ok;
    if (auto ok = check_precision(out, "out", Precision::Fp32, op); !ok) return ok;
    if (auto ok = check_capacity(out, "out", shape->q_rows * shape->n_rows,
                                 fmt::format("{} queries × {} corpus rows", shape->q_rows,
                                             shape->n_rows), op);
        !ok)
      return ok;
    return run_distance(queries, corpus, out, *shape, options,
                        out.device(), out.stream(), op);
  });
}

Result<ManagedBuffer> l2_distance(GpuMemoryPool& pool, const ManagedBuffer& queries,
                                  const ManagedBuffer& corpus, const DistanceOptions& options) {
  constexpr std::string_view op = "l2_distance";
  return guarded(op, [&]() -> Result<ManagedBuffer> {
    auto shape = check_distance_inputs(queries, corpus, options, op);
    if (!shape) return std::unexpected(shape.error());
    if (auto ok = check_no_rerank(options, op); !ok) return std::unexpected(ok.error());
    Device device = queries.device();
    auto out = pool.get_managed_buffer(device, shape->q_rows * shape->n_rows, Precision::Fp32,
                                       queries.stream());
    if (!out) return std::unexpected(out.error().with_context("l2_distance: allocating out"));
    if (auto ok = run_distance(queries, corpus, *out, *shape,
                               options, device, queries.stream(), op);
        !ok)
      return std::unexpected(ok.error());
    return std::move(*out);
  });
}

Result<ManagedBuffer> knn_temporary(GpuMemoryPool& pool, const Device& device,
                                    std::size_t elements, Precision precision,
                                    const Stream& stream, std::string_view what) {
  auto b = pool.get_managed_buffer(device, elements, precision, stream);
  if (!b) return std::unexpected(b.error().with_context(fmt::format("knn: allocating {}", what)));
  return std::move(*b);
}

namespace {

// The k nearest in the inputs' own precision into out_d / out_i (Q × k), on `work` (already
// ordered after the inputs): the corpus in tiles sized from the pool's headroom.
// `bounds` (CUDA, optional): the upper bounds on the device, which the filter may use to keep
// fewer rows (knn applies them to the result afterwards either way).
Result<void> knn_select(GpuMemoryPool& pool, const ManagedBuffer& queries,
                        const ManagedBuffer& corpus, const DistanceShape& shape, std::size_t k,
                        const DistanceOptions& options, float* out_d, std::int32_t* out_i,
                        [[maybe_unused]] KnnPath* path = nullptr,
                        [[maybe_unused]] const float* bounds = nullptr) {
  Device device = queries.device();
  const Stream& work = queries.stream();
  std::size_t q_rows = shape.q_rows;
  bool cuda = device.kind() == DeviceKind::Cuda;
#if defined(GPUPOOL_WITH_CUDA)
  if (cuda) {  // few queries: one pass over the corpus, no tiles (nor headroom to measure)
    auto few = cuda_knn_few_queries(pool, device, work,
                                    cuda_matrix(queries, shape.q_scales, q_rows),
                                    cuda_matrix(corpus, shape.x_scales, shape.n_rows), options, k,
                                    out_d, out_i);
    if (!few) return std::unexpected(few.error());
    if (*few) return {};  // its path reads as tiled
  }
#endif
  knn_plan::TileShape tile =
      knn_plan::choose_tile(pool_headroom(pool, device), q_rows, shape.n_rows, cuda);
  if (cuda) {
#if defined(GPUPOOL_WITH_CUDA)
    // Query chunks of tile.rows; each chunk tiles over the corpus inside cuda_knn.
    std::size_t row_bytes = options.dim * element_size(queries.precision());
    for (std::size_t q0 = 0; q0 < q_rows; q0 += tile.rows) {
      std::size_t nq = std::min(tile.rows, q_rows - q0);
      CudaMatrix qm{static_cast<const std::byte*>(queries.raw_data()) + q0 * row_bytes,
                    queries.precision(), shape.q_scales ? shape.q_scales + q0 : nullptr, nq};
      KnnPath taken = KnnPath::Tiled;
      if (auto ok = cuda_knn(pool, device, work, qm,
                             cuda_matrix(corpus, shape.x_scales, shape.n_rows), options, k,
                             tile.cols, out_d + q0 * k, out_i + q0 * k, taken,
                             bounds ? bounds + q0 : nullptr);
          !ok)
        return ok;
      if (path) *path = std::max(*path, taken);  // the enumerators go from fast to slow
    }
    return {};
#else
    return no_cuda(device, "knn");
#endif
  }

  // Simulated device: one pooled tile, kept alive by the queued work until it has run.
  auto scratch = pool.get_managed_buffer(device, tile.rows * tile.cols, Precision::Fp32, work);
  while (!scratch && scratch.error().is_out_of_memory() && (tile.cols > 1 || tile.rows > 1)) {
    if (tile.rows > 1) tile.rows = (tile.rows + 1) / 2;
    else tile.cols = (tile.cols + 1) / 2;
    scratch = pool.get_managed_buffer(device, tile.rows * tile.cols, Precision::Fp32, work);
  }
  if (!scratch) return std::unexpected(scratch.error().with_context("knn: allocating the tile"));
  auto held = std::make_shared<ManagedBuffer>(std::move(*scratch));
  auto q = cpu_matrix(queries, shape.q_scales, q_rows);
  auto x = cpu_matrix(corpus, shape.x_scales, shape.n_rows);
  std::size_t dim = options.dim;
  cpu::Metric metric = metric_of(options.metric);
  int threads = host_threads(device);
  return device.enqueue_host_work(work, [=] {
    cpu::knn(q, x, dim, metric, k, static_cast<float*>(held->raw_data()), tile.rows, tile.cols,
             out_d, out_i, threads);
  });
}

// The approximate top-C in the low precision into pooled candidate lists, then the exact fp32
// distances of those candidates and their k best into out_d / out_i, all on `work`.
Result<void> knn_reranked(GpuMemoryPool& pool, const ManagedBuffer& queries,
                          const ManagedBuffer& corpus, const DistanceShape& shape, std::size_t k,
                          const DistanceOptions& options, const RerankPlan& plan, float* out_d,
                          std::int32_t* out_i, KnnPath* path) {
  Device device = queries.device();
  const Stream& work = queries.stream();
  std::size_t count = shape.q_rows * plan.candidates;
  auto cand_d = knn_temporary(pool, device, count, Precision::Fp32, work, "re-rank candidates");
  if (!cand_d) return std::unexpected(cand_d.error());
  auto cand_i = knn_temporary(pool, device, count * sizeof(std::int32_t), Precision::Bytes, work,
                           "re-rank candidates");
  if (!cand_i) return std::unexpected(cand_i.error());
  auto* cd = static_cast<float*>(cand_d->raw_data());
  auto* ci = static_cast<std::int32_t*>(cand_i->raw_data());
  if (auto ok = knn_select(pool, queries, corpus, shape, plan.candidates, options, cd, ci, path);
      !ok)
    return ok;
  const auto* q32 = static_cast<const float*>(plan.queries->raw_data());
  const auto* x32 = static_cast<const float*>(plan.corpus->raw_data());
  if (device.kind() == DeviceKind::Cuda) {
#if defined(GPUPOOL_WITH_CUDA)
    // The candidate distances are overwritten with the exact ones (the kernel reads only the
    // indices); both lists go back to the pool ordered on `work`.
    CudaRerank r{q32, x32, shape.q_rows, options.dim, plan.candidates, k};
    return cuda_rerank(device, work, r, options.metric, cd, ci, out_d, out_i);
#else
    return no_cuda(device, "knn");
#endif
  }
  // Both candidate lists stay alive until the re-rank (queued after the selection) has run.
  auto lists = std::make_shared<std::pair<ManagedBuffer, ManagedBuffer>>(std::move(*cand_d),
                                                                         std::move(*cand_i));
  std::size_t rows = shape.q_rows, dim = options.dim, candidates = plan.candidates;
  cpu::Metric metric = metric_of(options.metric);
  int threads = host_threads(device);
  return device.enqueue_host_work(work, [=] {
    cpu::rerank(q32, x32, rows, dim, metric,
                static_cast<const std::int32_t*>(lists->second.raw_data()), candidates, k, out_d,
                out_i, threads);
  });
}

// The upper bounds on the device (a pooled temporary on `work`), for the CUDA filter.
Result<ManagedBuffer> bounds_on_device(GpuMemoryPool& pool, const Device& device,
                                       const Stream& work, std::span<const float> bounds) {
  auto b = knn_temporary(pool, device, bounds.size(), Precision::Fp32, work, "the upper bounds");
  if (!b) return b;
  if (auto ok = b->upload(bounds); !ok) return std::unexpected(ok.error());
  return b;
}

// Entries beyond their query's bound become empty slots (index -1, NaN), on `work`. The lists
// stay sorted: what a bound cuts is a list's tail.
Result<void> apply_upper_bounds(const Device& device, const Stream& work,
                                std::span<const float> bounds,
                                [[maybe_unused]] const ManagedBuffer& on_device, std::size_t k,
                                float* out_d, std::int32_t* out_i) {
  if (device.kind() == DeviceKind::Cuda) {
#if defined(GPUPOOL_WITH_CUDA)
    return cuda_apply_upper_bounds(device, work, static_cast<const float*>(on_device.raw_data()),
                                   bounds.size(), k, out_d, out_i);
#else
    return no_cuda(device, "knn");
#endif
  }
  auto copy = std::make_shared<std::vector<float>>(bounds.begin(), bounds.end());
  return device.enqueue_host_work(work, [=] {
    cpu::apply_upper_bounds(copy->data(), copy->size(), k, out_d, out_i);
  });
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
                                                    options.corpus_scales, plan->queries,
                                                    plan->corpus});
        !ok)
      return std::unexpected(ok.error());
    auto* out_d = static_cast<float*>(result.distances.raw_data());
    auto* out_i = static_cast<std::int32_t*>(result.indices.raw_data());
    const std::span<const float> bounds = options.upper_bounds;
    ManagedBuffer device_bounds;
    if (!bounds.empty() && device.kind() == DeviceKind::Cuda) {
      auto b = bounds_on_device(pool, device, work, bounds);
      if (!b) return std::unexpected(b.error());
      device_bounds = std::move(*b);
    }
    // The re-rank's candidates are approximate: its bounds apply to the exact result only.
    const auto* filter_bounds =
        plan->on() || !device_bounds.valid() ? nullptr
                                             : static_cast<const float*>(device_bounds.raw_data());
    auto ok = plan->on() ? knn_reranked(pool, queries, corpus, *shape, k, options, *plan, out_d,
                                        out_i, &result.path)
                         : knn_select(pool, queries, corpus, *shape, k, options, out_d, out_i,
                                      &result.path, filter_bounds);
    if (!ok) return std::unexpected(ok.error());
    if (!bounds.empty())
      if (auto applied = apply_upper_bounds(device, work, bounds, device_bounds, k, out_d, out_i);
          !applied)
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
    auto* o = static_cast<float*>(out.raw_data());
    if (device.kind() == DeviceKind::Cuda) {
#if defined(GPUPOOL_WITH_CUDA)
      return cuda_row_norms(device, out.stream(), cuda_matrix(vectors, *s, *rows), dim, o);
#else
      return no_cuda(device, op);
#endif
    }
    auto m = cpu_matrix(vectors, *s, *rows);
    int threads = host_threads(device);
    return device.enqueue_host_work(out.stream(), [=] { cpu::row_norms(m, dim, o, threads); });
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
    void* o = out.raw_data();
    if (device.kind() == DeviceKind::Cuda) {
#if defined(GPUPOOL_WITH_CUDA)
      return cuda_convert(device, out.stream(), cuda_matrix(in, in_scales, *rows), options.dim, to,
                          o, out_scales);
#else
      return no_cuda(device, op);
#endif
    }
    auto m = cpu_matrix(in, in_scales, *rows);
    cpu::Element target = element_of(to);
    std::size_t dim = options.dim;
    int threads = host_threads(device);
    return device.enqueue_host_work(out.stream(), [=] {
      cpu::convert(m, dim, target, o, out_scales, threads);
    });
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
    if (device.kind() == DeviceKind::Cuda) {
#if defined(GPUPOOL_WITH_CUDA)
      return cuda_convert_stored(device, out.stream(), in.raw_data(), count, options,
                                 out.precision(), out.raw_data());
#else
      return no_cuda(device, op);
#endif
    }
    const void* from = in.raw_data();
    void* to = out.raw_data();
    cpu::Element target = element_of(out.precision());
    const float offset = static_cast<float>(options.offset);
    const int exponent = options.exponent;
    int threads = host_threads(device);
    return device.enqueue_host_work(out.stream(), [=] {
      cpu::convert_stored(from, static_cast<int>(element), count, offset, exponent, target, to,
                          threads);
    });
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
    auto* od = static_cast<float*>(out_distances.raw_data());
    auto* oi = static_cast<std::int32_t*>(out_indices.raw_data());
    if (device.kind() == DeviceKind::Cuda) {
#if defined(GPUPOOL_WITH_CUDA)
      return cuda_merge_topk(device, work, d, i, options, od, oi);
#else
      return no_cuda(device, op);
#endif
    }
    MergeTopkOptions o = options;
    int threads = host_threads(device);
    return device.enqueue_host_work(work, [=] {
      cpu::merge_topk(d, i, o.queries, o.lists, o.list_length, o.k, od, oi, threads);
    });
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
    auto* rd = static_cast<float*>(running_distances.raw_data());
    auto* ri = static_cast<std::int32_t*>(running_indices.raw_data());
    if (device.kind() == DeviceKind::Cuda) {
#if defined(GPUPOOL_WITH_CUDA)
      return cuda_fold_topk(device, work, d, i, options, rd, ri);
#else
      return no_cuda(device, op);
#endif
    }
    FoldTopkOptions o = options;
    int threads = host_threads(device);
    return device.enqueue_host_work(work, [=] {
      cpu::fold_topk(d, i, o.queries, o.candidates, o.k, o.index_offset, rd, ri, threads);
    });
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
