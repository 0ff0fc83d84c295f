// The kernel backend of a simulated device: the CPU kernels (gpu/cpu_kernels.hpp), queued on the
// stream through Device::enqueue_host_work so that they run in stream order, spread over as many
// threads as the device has multiprocessors. What a queued kernel reads (a tile, candidate lists,
// the upper bounds) is held by the queued work itself until it has run.
module;
#include "cpu_kernels.hpp"
#include "knn_plan.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <memory>
#include <span>
#include <utility>
#include <vector>
module gpupool;
import :kernel_backend;

namespace gpupool {

namespace {

// Queues kernel(threads) on the stream, spread over the device's threads.
template <class Kernel>
Result<void> queue(const Device& device, const Stream& stream, Kernel kernel) {
  const int threads = std::max(1, device.properties().multiprocessor_count);
  return device.enqueue_host_work(stream, [=] { kernel(threads); });
}

// The tile the CPU knn computes the distances of, halved while the pool has no room for it.
Result<std::shared_ptr<ManagedBuffer>> knn_tile(GpuMemoryPool& pool, const Device& device,
                                                const Stream& stream, knn_plan::TileShape& tile) {
  auto scratch = pool.get_managed_buffer(device, tile.rows * tile.cols, Precision::Fp32, stream);
  while (!scratch && scratch.error().is_out_of_memory() && (tile.cols > 1 || tile.rows > 1)) {
    if (tile.rows > 1) tile.rows = (tile.rows + 1) / 2;
    else tile.cols = (tile.cols + 1) / 2;
    scratch = pool.get_managed_buffer(device, tile.rows * tile.cols, Precision::Fp32, stream);
  }
  if (!scratch) return std::unexpected(scratch.error().with_context("knn: allocating the tile"));
  return std::make_shared<ManagedBuffer>(std::move(*scratch));
}

class CpuKernelBackend final : public KernelBackend {
 public:
  Result<void> distances(const Device& device, const Stream& stream, const DistanceProblem& p,
                         const ManagedBuffer& out) const override {
    auto* o = static_cast<float*>(out.raw_data());
    return queue(device, stream, [=](int threads) {
      cpu_kernels::pairwise_distance(p.queries, p.corpus, p.dim, p.metric, o, threads);
    });
  }

  // One pooled tile, halved while the pool has no room for it; the simulated device always tiles.
  Result<void> select(GpuMemoryPool& pool, const Device& device, const Stream& stream,
                      const DistanceProblem& p, std::size_t k, TopkLists out, KnnPath&,
                      const float*) const override {
    knn_plan::TileShape tile =
        knn_plan::choose_tile(pool_headroom(pool, device), p.queries.rows, p.corpus.rows, false);
    auto scratch = knn_tile(pool, device, stream, tile);
    if (!scratch) return std::unexpected(scratch.error());
    return queue(device, stream, [=, held = *scratch](int threads) {
      cpu_kernels::knn(p.queries, p.corpus, p.dim, p.metric, k,
                       static_cast<float*>(held->raw_data()), tile.rows, tile.cols, out.distances,
                       out.indices, threads);
    });
  }

  Result<void> rerank(const Device& device, const Stream& stream, const RerankProblem& p,
                      CandidateLists lists, TopkLists out) const override {
    auto held = std::make_shared<CandidateLists>(std::move(lists));
    return queue(device, stream, [=](int threads) {
      cpu_kernels::rerank(p.queries, p.corpus, p.rows, p.dim, p.metric,
                          static_cast<const std::int32_t*>(held->indices.raw_data()), p.candidates,
                          p.k, out.distances, out.indices, threads);
    });
  }

  Result<UpperBounds> stage_upper_bounds(GpuMemoryPool&, const Device&, const Stream&,
                                         std::span<const float> bounds) const override {
    return UpperBounds{bounds, {}};
  }

  // The bounds are copied: the caller's values need only live through the call.
  Result<void> apply_upper_bounds(const Device& device, const Stream& stream,
                                  const UpperBounds& bounds, std::size_t k,
                                  TopkLists lists) const override {
    auto copy = std::make_shared<std::vector<float>>(bounds.values.begin(), bounds.values.end());
    return queue(device, stream, [=](int) {
      cpu_kernels::apply_upper_bounds(copy->data(), copy->size(), k, lists.distances,
                                      lists.indices);
    });
  }

  Result<void> row_norms(const Device& device, const Stream& stream,
                         const kernels::Matrix& vectors, std::size_t dim,
                         float* out) const override {
    return queue(device, stream, [=](int threads) {
      cpu_kernels::row_norms(vectors, dim, out, threads);
    });
  }

  Result<void> convert(const Device& device, const Stream& stream, const kernels::Matrix& in,
                       std::size_t dim, kernels::Element to, void* out,
                       float* out_scales) const override {
    return queue(device, stream, [=](int threads) {
      cpu_kernels::convert(in, dim, to, out, out_scales, threads);
    });
  }

  Result<void> convert_stored(const Device& device, const Stream& stream, const void* in,
                              std::size_t count, const StoredConvertOptions& options,
                              kernels::Element to, void* out) const override {
    const int element = static_cast<int>(options.element);
    const float offset = static_cast<float>(options.offset);
    const int exponent = options.exponent;
    return queue(device, stream, [=](int threads) {
      cpu_kernels::convert_stored(in, element, count, offset, exponent, to, out, threads);
    });
  }

  Result<void> merge_topk(const Device& device, const Stream& stream, const float* distances,
                          const std::int32_t* indices, const MergeTopkOptions& options,
                          TopkLists out) const override {
    const MergeTopkOptions o = options;
    return queue(device, stream, [=](int threads) {
      cpu_kernels::merge_topk(distances, indices, o.queries, o.lists, o.list_length, o.k,
                              out.distances, out.indices, threads);
    });
  }

  Result<void> fold_topk(const Device& device, const Stream& stream, const float* distances,
                         const std::int32_t* indices, const FoldTopkOptions& options,
                         TopkLists running) const override {
    const FoldTopkOptions o = options;
    return queue(device, stream, [=](int threads) {
      cpu_kernels::fold_topk(distances, indices, o.queries, o.candidates, o.k, o.index_offset,
                             running.distances, running.indices, threads);
    });
  }
};

}  // namespace

const KernelBackend& cpu_kernel_backend() {
  static const CpuKernelBackend backend;
  return backend;
}

}  // namespace gpupool
