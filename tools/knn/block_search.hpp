// gpupool::exact — one block of queries and its running top-k lists, both on the device.
//
// upload() puts the block's queries on the device (in the job's precision) beside empty running
// lists; process() takes one chunk of base rows: uploads it, lets gpupool::knn find its k best
// rows per query, and folds them into the running lists with fold_topk, on the device (a round
// trip through the host for every chunk took as long as the searches: docs/benchmarks.md). The
// running lists change only when the whole chunk succeeded, so a chunk that failed (out of memory,
// say) can be retried at any size and no row is counted twice. take_lists() reads them back once.
//
// This header imports gpupool: include it after your other headers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <expected>
#include <span>
#include <vector>
import gpupool;

namespace gpupool::exact {

struct JobOptions;
struct JobTimes;

// A matrix on the device in the job's precision; `scales` is set for Int8 only.
struct DeviceMatrix {
  ManagedBuffer values;
  ManagedBuffer scales;
  const ManagedBuffer* scales_or_null() const { return scales.valid() ? &scales : nullptr; }
};

// Uploads fp32 rows and, for another precision, converts them on the device (the fp32 copy is
// given back to the pool as soon as the conversion has been queued after it).
Result<DeviceMatrix> to_device(GpuMemoryPool& pool, const Device& device, std::span<const float> host,
                               std::size_t dim, Precision precision);

// The k best base rows of one query so far (knn's order).
struct QueryNeighbours {
  std::vector<float> distances;
  std::vector<std::int32_t> indices;
};

class BlockSearch {
 public:
  // `queries` rows of `dim` values; k, metric, precision and mode from `options`. process() adds
  // the time of its steps (upload, search, merge) to `times`.
  BlockSearch(GpuMemoryPool& pool, const Device& device, std::size_t queries, std::size_t dim,
              const JobOptions& options, JobTimes& times);

  Result<void> upload(std::span<const float> query_rows);
  // `rows` (row-major, dim values each) are base rows first_row, first_row + 1, ...
  Result<void> process(std::span<const float> rows, std::size_t first_row);
  // The running lists, one per query of the block, read back from the device.
  Result<std::vector<QueryNeighbours>> take_lists() const;

 private:
  GpuMemoryPool& pool_;
  Device device_;
  std::size_t queries_, dim_;
  const JobOptions& options_;
  JobTimes& times_;
  DeviceMatrix queries_on_device_;
  ManagedBuffer distances_;  // queries × k fp32, +inf where nothing was found yet
  ManagedBuffer indices_;    // queries × k int32 (Bytes), -1 where nothing was found yet
};

}  // namespace gpupool::exact
