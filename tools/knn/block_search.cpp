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
    : pool_(pool), device_(device), queries_(queries), dim_(dim), options_(options), times_(times) {}

Result<void> BlockSearch::upload(std::span<const float> query_rows) {
  auto matrix = to_device(pool_, device_, query_rows, dim_, options_.precision);
  if (!matrix) return std::unexpected(matrix.error());
  queries_on_device_ = std::move(*matrix);
  const std::size_t entries = queries_ * options_.k;
  auto distances = pool_.get_managed_buffer(device_, entries, Precision::Fp32);
  if (!distances) return std::unexpected(distances.error());
  auto indices = pool_.get_managed_buffer(device_, entries * sizeof(std::int32_t), Precision::Bytes);
  if (!indices) return std::unexpected(indices.error());
  const std::vector<float> nothing_yet(entries, std::numeric_limits<float>::infinity());
  const std::vector<std::int32_t> no_row(entries, -1);
  if (auto ok = distances->upload(std::span<const float>(nothing_yet)); !ok) return ok;
  if (auto ok = indices->upload(std::as_bytes(std::span(no_row))); !ok) return ok;
  distances_ = std::move(*distances);
  indices_ = std::move(*indices);
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
  *chunk = DeviceMatrix{};  // the chunk's memory is free
  const FoldTopkOptions fold{.queries = queries_, .candidates = found->k, .k = options_.k,
                             .index_offset = static_cast<std::int64_t>(first_row)};
  if (auto ok = fold_topk(found->distances, found->indices, distances_, indices_, fold); !ok)
    return std::unexpected(ok.error().with_context("merging the top-k lists"));
  return clock.lap(times_.merging);
}

Result<std::vector<QueryNeighbours>> BlockSearch::take_lists() const {
  auto distances = distances_.to_host<float>();
  if (!distances) return std::unexpected(distances.error());
  auto indices = indices_to_host(indices_);
  if (!indices) return std::unexpected(indices.error());
  std::size_t k = options_.k;
  std::vector<QueryNeighbours> lists(queries_);
  for (std::size_t q = 0; q < queries_; ++q) {
    auto at = static_cast<std::ptrdiff_t>(q * k), to = static_cast<std::ptrdiff_t>((q + 1) * k);
    lists[q].distances.assign(distances->begin() + at, distances->begin() + to);
    lists[q].indices.assign(indices->begin() + at, indices->begin() + to);
  }
  return lists;
}

}  // namespace gpupool::exact
