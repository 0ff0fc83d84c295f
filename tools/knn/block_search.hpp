// gpupool::exact — one block of queries against the base, chunk by chunk: the device finds each
// chunk's candidates, the host keeps every query's running list.
//
// process() takes one chunk of base rows as stored, still in host memory: uploads its bytes,
// converts them on the device to the chunk's arithmetic (arithmetic.hpp), lets gpupool::knn
// find the best `candidates` rows per query within each query's upper bound (its k-th distance
// so far plus the error bound: no row beyond it can enter the list, so after the first chunks
// the device keeps almost nothing) and reads those back. In the exact mode the host
// folds them by their fp64 distances from the chunk's own rows and proves the chunk complete
// for each query from the error bound; a query it cannot prove is searched again with four
// times the candidates (up to knn's limit), and past that every row of the chunk is computed in
// fp64 for it — the job never guesses. In the fast mode the device's distances are the result.
// The lists change only through a chunk that succeeded, so a chunk that failed (out of memory)
// can be retried at any size and no row is counted twice. The next chunk's bytes go up on a
// stream of their own while this chunk is searched (RowsUpload), where memory allows.
//
// This header imports gpupool: include it after your other headers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <expected>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <tuple>
#include <utility>
#include <vector>
#include "arithmetic.hpp"
#include "running_lists.hpp"
#include "stored_rows.hpp"
import gpupool;

namespace gpupool::exact {

struct JobOptions;
struct JobTimes;
struct JobCounts;

// A matrix on the device in the form knn takes; for int8, its own `scales` (the fast mode's
// quantisation) or `unit_scales`, scales of 1 that the exact forms share (BlockSearch keeps them).
// Rows copied to the device on a stream of their own (the upload stream) while the pool's stream
// computes. The buffer belongs to the pool's stream, which waits for the copy before it uses the
// rows or frees the buffer: the copy never races the work that reads the memory, nor the work
// the pool gives the memory to next.
class RowsUpload {
 public:
  // Starts copying `rows` into a new buffer of `precision` on `upload`; `memory` holds the rows.
  static Result<RowsUpload> start(GpuMemoryPool& pool, const Device& device, const Stream& upload,
                                  const StoredRows& rows, Precision precision,
                                  std::shared_ptr<const void> memory);
  RowsUpload(RowsUpload&&) noexcept = default;
  RowsUpload& operator=(RowsUpload&&) = delete;
  ~RowsUpload();
  bool holds(const StoredRows& rows) const noexcept;
  // The buffer, its copy ordered before the pool stream's later work.
  Result<ManagedBuffer> take();

 private:
  RowsUpload(StoredRows rows, std::shared_ptr<const void> memory, ManagedBuffer buffer, Event copied)
      : rows_(rows), memory_(std::move(memory)), buffer_(std::move(buffer)), copied_(std::move(copied)) {}
  StoredRows rows_;
  std::shared_ptr<const void> memory_;
  ManagedBuffer buffer_;
  Event copied_;  // recorded on the upload stream after the copy
};

struct DeviceMatrix {
  ManagedBuffer values;
  ManagedBuffer scales;
  const ManagedBuffer* unit_scales = nullptr;
  const ManagedBuffer* scales_or_null() const { return scales.valid() ? &scales : unit_scales; }
};

// The chunk that most likely comes after the one being processed: its rows, and the host memory
// that holds them (kept until their upload is done with).
struct NextChunk {
  StoredRows rows;
  std::shared_ptr<const void> memory;
};

class BlockSearch {
 public:
  // Queries [first, first + count) of `queries`; k, metric, mode from `options`. process() adds
  // the time of its steps to `times` and what it did to `counts`.
  BlockSearch(GpuMemoryPool& pool, const Device& device, const HostQueries& queries,
              std::size_t first, std::size_t count, const JobOptions& options, JobTimes& times,
              JobCounts& counts);

  // `chunk` holds base rows first_row, first_row + 1, ... (numbered as the output numbers
  // them); `stats` bound its values. `next` (if given) starts on its way to the device while
  // this chunk is searched: the next call finds its rows there if they are the same rows.
  Result<void> process(const StoredRows& chunk, const ValueStats& stats, std::size_t first_row,
                       const NextChunk* next = nullptr);
  // Puts the queries on the device in the form chunks of `stats` take (process() does it for the
  // first such chunk otherwise), timed as uploading.
  Result<void> prepare(const ValueStats& stats);
  const RunningLists& lists() const noexcept { return lists_; }

 private:
  Result<void> search_chunk(const StoredRows& chunk, const ValueStats& stats,
                            std::size_t first_row, const NextChunk* next);
  Arithmetic arithmetic_for(const ValueStats& stats) const noexcept;
  // The fast mode's fp16 refuses rows too small beside the largest value to keep any precision,
  // naming the smallest (a query, or a row of `chunk`, base rows first_row...).
  Result<void> check_fp16_span(const StoredRows& chunk, const ValueStats& stats,
                               std::size_t first_row) const;
  // The block's queries (or `subset` of them) on the device in `arithmetic`'s form.
  Result<DeviceMatrix> queries_on_device(const Arithmetic& arithmetic,
                                         std::span<const std::size_t> subset);
  Result<const DeviceMatrix*> block_queries(const Arithmetic& arithmetic);
  Result<DeviceMatrix> chunk_on_device(const StoredRows& chunk, const Arithmetic& arithmetic);
  // The rows of `chunk` on the device as stored: the upload started during the chunk before,
  // if it was of these rows, else an upload now.
  Result<ManagedBuffer> stored_on_device(const StoredRows& chunk);
  // Starts `next`'s upload on the upload stream, beside the search that follows; skipped (the
  // next chunk then uploads in its turn) where memory is short or anything fails.
  void upload_ahead(const NextChunk& next);
  // Scales of 1 for at least `rows` rows (int8 exact forms): one buffer on the device, uploaded
  // again only when a larger chunk comes.
  Result<const ManagedBuffer*> unit_scales(std::size_t rows);
  // `subset` and `row_bounds` as upper_bounds takes them; `unit` is the arithmetic's distance_unit.
  Result<ChunkCandidates> candidates(const DeviceMatrix& queries, const DeviceMatrix& chunk,
                                     std::size_t capacity, std::span<const std::size_t> subset,
                                     std::span<const double> row_bounds, double unit);
  // knn's upper bound for each of `subset`'s queries (all of the block's when empty): its k-th
  // distance so far plus its error bound (row_bounds; empty: 0), in the device's units (divided by
  // `unit`), rounded up to fp32, so that every row that could still enter its list is within it.
  std::vector<float> upper_bounds(std::span<const std::size_t> subset,
                                  std::span<const double> row_bounds, double unit) const;
  // Query q of the block's k-th distance so far: its list's, or a smaller one another device of
  // the job found (options_.shared_bounds).
  double kth_bound(std::size_t q) const noexcept;
  // The block's k-th distances offered to the job's other devices (options_.shared_bounds).
  void share_kth() const noexcept;
  // The error bound of each of `subset`'s queries (all of the block's when empty).
  std::vector<double> bounds(const Arithmetic& arithmetic, const ValueStats& stats,
                             std::span<const std::size_t> subset) const;

  GpuMemoryPool& pool_;
  Device device_;
  const HostQueries& queries_;
  std::size_t first_, count_;
  const JobOptions& options_;
  JobTimes& times_;
  JobCounts& counts_;
  RunningLists lists_;
  ManagedBuffer unit_scales_;  // unit_scales(): before query_forms_, which point at it
  std::optional<Stream> upload_stream_;  // made for the first upload_ahead
  std::optional<RowsUpload> ahead_;      // after upload_stream_: goes first
  // By (precision, offset, exponent).
  std::map<std::tuple<int, std::int32_t, std::int32_t>, DeviceMatrix> query_forms_;
};

}  // namespace gpupool::exact
