// gpupool:kernels on a CUDA device (CUDA builds only): wraps gpu/cuda/kernels.cu, maps CUDA and
// cuBLAS statuses to GpuError, and takes every kNN temporary from the pool. Arguments arrive
// validated from gpu/kernels.cpp.
module;
#include "cuda/kernels.cuh"

#include <cublas_v2.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <expected>
#include <fmt/format.h>
#include <string>
#include <string_view>
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

Result<void> cuda_knn(GpuMemoryPool& pool, const Device& device, const Stream& stream,
                      const CudaMatrix& queries, const CudaMatrix& corpus,
                      const DistanceOptions& options, std::size_t k, std::size_t tile_cols,
                      float* out_distances, std::int32_t* out_indices) {
  constexpr std::string_view op = "knn";
  if (auto ok = use_device(device, op); !ok) return ok;
  void* native = stream.native();
  int ordinal = device.properties().ordinal;
  cudak::Matrix q = matrix(queries), x = matrix(corpus);
  cudak::Metric metric = metric_of(options.metric);
  bool need_norms = options.metric != Metric::InnerProduct && corpus.precision != Precision::Int8;

  // Temporaries, all from the pool on the work stream: norms, then the Q × tile distance tile.
  ManagedBuffer norms;
  if (need_norms) {
    auto n = pool.get_managed_buffer(device, queries.rows + corpus.rows, Precision::Fp32, stream);
    if (!n) return std::unexpected(n.error().with_context("knn: allocating row norms"));
    norms = std::move(*n);
  }
  tile_cols = capped_tile_cols(tile_cols, queries.rows, corpus.rows);
  auto tile = pool.get_managed_buffer(device, queries.rows * tile_cols, Precision::Fp32, stream);
  while (!tile && tile.error().is_out_of_memory() && tile_cols > std::min<std::size_t>(corpus.rows, 64)) {
    tile_cols = (tile_cols + 1) / 2;
    tile = pool.get_managed_buffer(device, queries.rows * tile_cols, Precision::Fp32, stream);
  }
  if (!tile) return std::unexpected(tile.error().with_context("knn: allocating the distance tile"));
  auto* qn = static_cast<float*>(norms.raw_data());
  auto* xn = qn ? qn + queries.rows : nullptr;
  auto* t = static_cast<float*>(tile->raw_data());

  if (need_norms) {
    if (auto ok = check(cudak::row_norms(q, options.dim, qn, native), op, device); !ok) return ok;
    if (auto ok = check(cudak::row_norms(x, options.dim, xn, native), op, device); !ok) return ok;
  }
  if (auto ok = check(cudak::topk_init(out_distances, out_indices, queries.rows * k, native), op,
                      device);
      !ok)
    return ok;
  // fp32 / fp16 / bf16: the GEMM writes dot products and the top-k pass turns them into distances
  // as it reads them (one pass over the tile); int8's direct kernel writes distances.
  bool raw = corpus.precision != Precision::Int8;
  bool refine = options.metric == Metric::L2 && corpus.precision == Precision::Fp32 &&
                options.mode == ComputeMode::Fp32Accurate;
  bool tf32 = options.mode == ComputeMode::Tf32;
  for (std::size_t x0 = 0; x0 < corpus.rows; x0 += tile_cols) {
    std::size_t nx = std::min(tile_cols, corpus.rows - x0);
    cudak::Status st =
        raw ? cudak::dot_products(ordinal, q, x, x0, nx, options.dim, tf32, t, tile_cols, native)
            : cudak::distances(ordinal, q, x, x0, nx, options.dim, metric, tf32, qn,
                               xn ? xn + x0 : nullptr, t, tile_cols, native);
    if (auto ok = check(st, op, device); !ok) return ok;
    cudak::Epilogue epilogue{
        .metric = metric,
        .q_norms = qn,
        .x_norms = xn ? xn + x0 : nullptr,
        .q32 = refine ? static_cast<const float*>(queries.data) : nullptr,
        .x32 = refine ? static_cast<const float*>(corpus.data) + x0 * options.dim : nullptr,
        .dim = options.dim};
    if (auto ok = check(cudak::topk_update(t, nullptr, queries.rows, nx, tile_cols,
                                           static_cast<std::int64_t>(x0), k, out_distances,
                                           out_indices, native, raw ? &epilogue : nullptr),
                        op, device);
        !ok)
      return ok;
  }
  return {};  // norms and tile go back to the pool ordered on `stream`
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
