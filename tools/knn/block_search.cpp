// One query block's device copy and running top-k (see block_search.hpp).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <limits>
#include <span>
#include <utility>
#include <vector>
#include "block_search.hpp"
#include "exact_knn.hpp"

namespace gpupool::exact {

Result<DeviceMatrix> to_device(GpuMemoryPool& pool, const Device& device, std::span<const float> host,
                               std::size_t dim, Precision precision) {
  auto fp32 = pool.get_managed_buffer(device, host.size(), Precision::Fp32);
  if (!fp32) return std::unexpected(fp32.error());
  if (auto ok = fp32->upload(host); !ok) return std::unexpected(ok.error());
  if (precision == Precision::Fp32) return DeviceMatrix{std::move(*fp32), {}};
  auto converted = pool.get_managed_buffer(device, host.size(), precision);
  if (!converted) return std::unexpected(converted.error());
  DeviceMatrix out{std::move(*converted), {}};
  if (precision == Precision::Int8) {
    auto scales = pool.get_managed_buffer(device, host.size() / dim, Precision::Fp32);
    if (!scales) return std::unexpected(scales.error());
    out.scales = std::move(*scales);
  }
  ConvertOptions convert_options{.dim = dim, .scales = out.scales.valid() ? &out.scales : nullptr};
  if (auto ok = convert(*fp32, out.values, convert_options); !ok) return std::unexpected(ok.error());
  return out;
}

namespace {

// The wall time of consecutive device steps: lap() waits for the device, then adds the time since
// the last lap to a figure.
class StepClock {
 public:
  explicit StepClock(const Device& device) : device_(device), last_(Clock::now()) {}
  Result<void> lap(double& seconds) {
    if (auto ok = device_.synchronize(); !ok) return ok;
    const Clock::time_point now = Clock::now();
    seconds += std::chrono::duration<double>(now - last_).count();
    last_ = now;
    return {};
  }

 private:
  using Clock = std::chrono::steady_clock;
  const Device& device_;
  Clock::time_point last_;
};

}  // namespace

BlockSearch::BlockSearch(GpuMemoryPool& pool, const Device& device, std::size_t queries,
                         std::size_t dim, const JobOptions& options, JobTimes& times)
    : pool_(pool), device_(device), queries_(queries), dim_(dim), options_(options), times_(times),
      distances_(queries * options.k, std::numeric_limits<float>::infinity()),
      indices_(queries * options.k, -1) {}

Result<void> BlockSearch::upload(std::span<const float> query_rows) {
  auto matrix = to_device(pool_, device_, query_rows, dim_, options_.precision);
  if (!matrix) return std::unexpected(matrix.error());
  queries_on_device_ = std::move(*matrix);
  return {};
}

Result<void> BlockSearch::process(std::span<const float> rows, std::size_t first_row) {
  std::size_t count = rows.size() / dim_;
  StepClock clock(device_);
  auto chunk = to_device(pool_, device_, rows, dim_, options_.precision);
  if (!chunk) return std::unexpected(chunk.error());
  if (auto ok = clock.lap(times_.uploading); !ok) return ok;
  DistanceOptions distance_options{.dim = dim_, .metric = options_.metric, .mode = options_.mode,
                                   .query_scales = queries_on_device_.scales_or_null(),
                                   .corpus_scales = chunk->scales_or_null()};
  auto found = gpupool::knn(pool_, queries_on_device_.values, chunk->values,
                            std::min(options_.k, count), distance_options);
  if (!found) return std::unexpected(found.error());
  if (auto ok = clock.lap(times_.searching); !ok) return ok;
  *chunk = DeviceMatrix{};  // the chunk's memory is free for the merge
  auto merged = merge(*found, first_row);
  if (!merged) return merged;
  return clock.lap(times_.merging);
}

std::vector<QueryNeighbours> BlockSearch::take_lists() const {
  std::size_t k = options_.k;
  std::vector<QueryNeighbours> lists(queries_);
  for (std::size_t q = 0; q < queries_; ++q) {
    auto at = static_cast<std::ptrdiff_t>(q * k), to = static_cast<std::ptrdiff_t>((q + 1) * k);
    lists[q].distances.assign(distances_.begin() + at, distances_.begin() + to);
    lists[q].indices.assign(indices_.begin() + at, indices_.begin() + to);
  }
  return lists;
}

// Lays out [query][list 0 = running, list 1 = chunk][k], chunk ids offset to base rows, and lets
// merge_topk keep the k best.
Result<void> BlockSearch::merge(const KnnResult& found, std::size_t first_row) {
  std::size_t q = queries_, k = options_.k, kc = found.k;
  auto chunk_distances = found.distances.to_host<float>();
  if (!chunk_distances) return std::unexpected(chunk_distances.error());
  auto chunk_indices = indices_to_host(found.indices);
  if (!chunk_indices) return std::unexpected(chunk_indices.error());
  std::vector<float> candidate_distances(q * 2 * k, std::numeric_limits<float>::infinity());
  std::vector<std::int32_t> candidate_indices(q * 2 * k, -1);
  for (std::size_t row = 0; row < q; ++row) {
    std::copy_n(distances_.begin() + row * k, k, candidate_distances.begin() + row * 2 * k);
    std::copy_n(indices_.begin() + row * k, k, candidate_indices.begin() + row * 2 * k);
    for (std::size_t j = 0; j < kc; ++j) {
      candidate_distances[row * 2 * k + k + j] = (*chunk_distances)[row * kc + j];
      candidate_indices[row * 2 * k + k + j] =
          static_cast<std::int32_t>(first_row) + (*chunk_indices)[row * kc + j];
    }
  }
  auto merged = merge_on_device(candidate_distances, candidate_indices);
  if (!merged) return std::unexpected(merged.error().with_context("merging the top-k lists"));
  return {};
}

Result<void> BlockSearch::merge_on_device(std::span<const float> candidate_distances,
                                          std::span<const std::int32_t> candidate_indices) {
  std::size_t q = queries_, k = options_.k;
  auto in_d = pool_.get_managed_buffer(device_, candidate_distances.size(), Precision::Fp32);
  if (!in_d) return std::unexpected(in_d.error());
  auto in_i = pool_.get_managed_buffer(device_, candidate_indices.size_bytes(), Precision::Bytes);
  if (!in_i) return std::unexpected(in_i.error());
  auto out_d = pool_.get_managed_buffer(device_, q * k, Precision::Fp32);
  if (!out_d) return std::unexpected(out_d.error());
  auto out_i = pool_.get_managed_buffer(device_, q * k * sizeof(std::int32_t), Precision::Bytes);
  if (!out_i) return std::unexpected(out_i.error());
  if (auto ok = in_d->upload(candidate_distances); !ok) return ok;
  if (auto ok = in_i->upload(std::as_bytes(candidate_indices)); !ok) return ok;
  MergeTopkOptions merge_options{.queries = q, .lists = 2, .list_length = k, .k = k};
  if (auto ok = merge_topk(*in_d, *in_i, *out_d, *out_i, merge_options); !ok) return ok;
  auto distances = out_d->to_host<float>();
  if (!distances) return std::unexpected(distances.error());
  auto indices = indices_to_host(*out_i);
  if (!indices) return std::unexpected(indices.error());
  distances_ = std::move(*distances);
  indices_ = std::move(*indices);
  return {};
}

}  // namespace gpupool::exact
