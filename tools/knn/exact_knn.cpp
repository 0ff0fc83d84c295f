// The exact-kNN job (see exact_knn.hpp): validation, the two batching layers (query blocks over
// the queries, chunks over a pass of the base) and the output files.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <fmt/format.h>
#include <limits>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <variant>
#include <vector>
#include "base_stream.hpp"
#include "block_search.hpp"
#include "exact_knn.hpp"
#include "job_sizing.hpp"

namespace gpupool::exact {

namespace {

Result<void> check_inputs(const VectorSet& queries, const io::VectorReader& base,
                          const JobOptions& options) {
  std::string file = base.path().string();
  std::size_t base_rows = base.rows() - base.rows_read();
  if (queries.rows == 0 || queries.dim == 0 || queries.values.size() != queries.rows * queries.dim)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("the query set holds {} rows of dimension {} in {} values; expected "
                                  "at least one row and rows × dim values",
                                  queries.rows, queries.dim, queries.values.size()));
  if (base.dim() != queries.dim)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("base file {} has dimension {} but the queries have {}; expected "
                                  "the same dimension", file, base.dim(), queries.dim));
  if (options.k == 0 || options.k > kMaxK)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("k = {}; expected 1..{}", options.k, kMaxK));
  if (options.k > base_rows)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("k = {} is larger than the base set ({} holds {} rows); expected "
                                  "k <= {}", options.k, file, base_rows, base_rows));
  if (base.rows() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("base file {} holds {} rows; expected at most 2^31 - 1 (neighbour "
                                  "ids are int32)", file, base.rows()));
  if (options.precision == Precision::Bytes)
    return make_error(ErrorKind::InvalidInput,
                      "precision = bytes; expected fp32, fp16, bf16 or int8");
  if (options.max_chunk_rows == 0)
    return make_error(ErrorKind::InvalidInput, "max_chunk_rows = 0; expected at least 1");
  return {};
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The job's peak memory. The batching library resets the device's peak statistics before every
// batch (to measure what each one uses), so the job samples them at the end of every batch and
// keeps the largest.
class PeakTracker {
 public:
  PeakTracker(GpuMemoryPool& pool, const Device& device) : pool_(pool), device_(device) { sample(); }
  void sample() {
    PoolStats now = pool_.stats(device_);
    peaks_.peak_in_use_bytes = std::max(peaks_.peak_in_use_bytes, now.peak_in_use_bytes);
    peaks_.peak_requested_bytes = std::max(peaks_.peak_requested_bytes, now.peak_requested_bytes);
    peaks_.peak_cached_bytes = std::max(peaks_.peak_cached_bytes, now.peak_cached_bytes);
    peaks_.peak_reserved_bytes = std::max(peaks_.peak_reserved_bytes, now.peak_reserved_bytes);
  }
  // The pool's figures now, with the peaks of the whole job.
  PoolStats stats() {
    sample();
    PoolStats out = pool_.stats(device_);
    out.peak_in_use_bytes = peaks_.peak_in_use_bytes;
    out.peak_requested_bytes = peaks_.peak_requested_bytes;
    out.peak_cached_bytes = peaks_.peak_cached_bytes;
    out.peak_reserved_bytes = peaks_.peak_reserved_bytes;
    return out;
  }

 private:
  GpuMemoryPool& pool_;
  const Device& device_;
  PoolStats peaks_;
};

// Everything the two batching layers share.
class Job {
 public:
  Job(GpuMemoryPool& pool, const Device& device, const VectorSet& queries, io::VectorReader& base,
      const JobOptions& options)
      : pool_(pool), device_(device), queries_(queries), passes_(base), options_(options),
        costs_(job_costs(queries.dim, options.k, options.precision)),
        cap_(chunk_cap(passes_.rows(), options.max_chunk_rows)),
        start_(std::chrono::steady_clock::now()), peaks_(pool, device),
        result_{queries.rows, options.k, std::vector<float>(queries.rows * options.k),
                std::vector<std::int32_t>(queries.rows * options.k)} {}

  // The outer layer: blocks of queries, each one pass over the base.
  Result<void> run() {
    auto headroom = memory_headroom(pool_, device_);
    if (!headroom) return std::unexpected(headroom.error());
    std::size_t block =
        even_batch_size(pick_query_block(headroom->bytes, queries_.rows, costs_), queries_.rows);
    BatchingOptions batching;
    batching.batch_size = block;
    batching.planner.max_batch_size = block;  // more queries would not leave the chunks their half
    batching.on_progress = [this](const BatchProgress& p) { block_retries_seen_ = p.retries; };
    auto search = [this](const auto& block) { return search_block(block.first, block.size()); };
    auto store = [this](std::size_t first, std::vector<QueryNeighbours>&& lists) {
      return store_lists(first, lists);
    };
    auto queries = std::views::iota(std::size_t{0}, queries_.rows);
    auto report = process_in_batches_into(pool_, device_, search, queries, store, batching);
    if (!report)
      return std::unexpected(report.error().is_out_of_memory()
                                 ? report.error().with_context(
                                       "out of device memory for the query blocks (a block of one "
                                       "query with a chunk of one base row is the least the job "
                                       "needs: lower --k, use a smaller --precision, or raise "
                                       "--memory-limit)")
                                 : report.error());
    summary_.query_blocks = report->batches;
    summary_.largest_query_block = report->largest_batch;
    summary_.query_block_retries = report->retries;
    summary_.retries = chunk_retries_ + report->retries;
    return {};
  }

  JobResult finish() {
    summary_.device = device_.describe();
    summary_.queries = queries_.rows;
    summary_.base_rows = passes_.rows();
    summary_.dim = queries_.dim;
    summary_.k = options_.k;
    summary_.metric = options_.metric;
    summary_.precision = options_.precision;
    summary_.seconds = seconds_since(start_);
    summary_.pool = peaks_.stats();
    return JobResult{std::move(result_), summary_};
  }

 private:
  // One call of the outer layer: queries [first, first + count) against the whole base.
  Result<std::vector<QueryNeighbours>> search_block(std::size_t first, std::size_t count) {
    BlockSearch search(pool_, device_, count, queries_.dim, options_, summary_.times);
    auto rows = std::span<const float>(queries_.values).subspan(first * queries_.dim, count * queries_.dim);
    auto uploaded = search.upload(rows);
    peaks_.sample();
    if (!uploaded)
      return std::unexpected(uploaded.error().with_context(
          fmt::format("uploading queries {}..{}", first, first + count - 1)));
    auto report = stream_base(search, first, count);
    peaks_.sample();
    if (!report) return std::unexpected(report.error());
    summary_.chunks += report->batches;
    chunk_retries_ += report->retries;
    summary_.largest_chunk_rows = std::max(summary_.largest_chunk_rows, report->largest_batch);
    queries_done_ += count;
    auto lists = search.take_lists();
    if (!lists)
      return std::unexpected(lists.error().with_context(
          fmt::format("reading the lists of queries {}..{}", first, first + count - 1)));
    return lists;
  }

  // The inner layer: one pass over the base in chunks, for the block in `search`.
  Result<BatchingReport> stream_base(BlockSearch& search, std::size_t first, std::size_t count) {
    auto reader = passes_.open_next();
    if (!reader) return std::unexpected(reader.error());
    BaseRows rows(**reader, passes_.rows(), cap_, blocks_,
                  reading_parts(cap_ * queries_.dim * sizeof(float),
                                std::thread::hardware_concurrency()));
    auto headroom = memory_headroom(pool_, device_);
    if (!headroom) return std::unexpected(headroom.error());
    // The first pass starts from the headroom and lets the batching grow its chunks; later
    // passes take the largest chunk that worked, evened out, and keep it (a size that changes
    // within a pass asks the pool for new blocks, which tight memory gives only by trimming).
    BatchingOptions batching;
    const std::size_t first_size = settled_chunk_rows_ != 0
                                       ? settled_chunk_rows_
                                       : pick_chunk_rows(headroom->bytes, count, costs_, cap_);
    batching.batch_size = even_batch_size(first_size, passes_.rows());
    batching.planner.max_batch_size = settled_chunk_rows_ != 0
                                          ? *batching.batch_size
                                          : even_batch_size(cap_, passes_.rows());
    batching.on_progress = [&](const BatchProgress& p) { report_progress(p, count); };
    auto chunk = [&](const auto& batch) -> Result<std::vector<std::monostate>> {
      // Only the last row read can be missing (its read failed and ended the rows).
      if (!batch.items.back().block)
        return make_error(ErrorKind::InvalidState,
                          fmt::format("base row {} of {} could not be read", batch.end_index() - 1,
                                      passes_.path().string()));
      auto done = search.process(contiguous_rows(batch.items, queries_.dim, staging_), batch.first);
      peaks_.sample();
      if (!done) return std::unexpected(done.error());
      return std::vector<std::monostate>(batch.size());
    };
    auto ignore = [](std::size_t, std::vector<std::monostate>&&) -> Result<void> { return {}; };
    auto report = process_in_batches_into(pool_, device_, chunk, rows, ignore, batching);
    summary_.times.waiting_for_base += rows.seconds_waiting();
    // A read error ended the rows early: it is the cause of whatever the batching saw.
    if (rows.error()) return std::unexpected(*rows.error());
    if (!report)
      return std::unexpected(report.error().with_context(fmt::format(
          "queries {}..{} against the base rows of {}", first, first + count - 1,
          passes_.path().string())));
    settled_chunk_rows_ = report->largest_batch;
    if (report->items != passes_.rows())
      return make_error(ErrorKind::InvalidState,
                        fmt::format("the pass over {} for queries {}..{} covered {} base rows; "
                                    "expected {}", passes_.path().string(), first,
                                    first + count - 1, report->items, passes_.rows()));
    return report;
  }

  Result<void> store_lists(std::size_t first, const std::vector<QueryNeighbours>& lists) {
    std::size_t k = options_.k;
    for (std::size_t q = 0; q < lists.size(); ++q) {
      std::copy_n(lists[q].distances.begin(), k, result_.distances.begin() + (first + q) * k);
      std::copy_n(lists[q].indices.begin(), k, result_.indices.begin() + (first + q) * k);
    }
    return {};
  }

  void report_progress(const BatchProgress& p, std::size_t block_queries) {
    if (!options_.on_progress) return;
    options_.on_progress(Progress{.base_rows_done = p.items_done, .base_rows = passes_.rows(),
                                  .queries_done = queries_done_, .block_queries = block_queries,
                                  .queries = queries_.rows, .chunks = summary_.chunks + p.batches_done,
                                  .retries = chunk_retries_ + p.retries + block_retries_seen_,
                                  .seconds = seconds_since(start_)});
  }

  GpuMemoryPool& pool_;
  Device device_;
  const VectorSet& queries_;
  BasePasses passes_;
  const JobOptions& options_;
  JobCosts costs_;
  std::size_t cap_;
  std::chrono::steady_clock::time_point start_;
  PeakTracker peaks_;
  Neighbours result_;
  JobSummary summary_;
  std::size_t queries_done_ = 0;
  std::size_t chunk_retries_ = 0;       // of the passes that finished
  std::size_t block_retries_seen_ = 0;  // query-block retries, as of the last block that finished
  std::size_t settled_chunk_rows_ = 0;  // the largest chunk of the last pass (0: none yet)
  std::vector<float> staging_;  // a chunk that spans two blocks of the base, side by side
  // The base's blocks, pinned by the device (uploads at bus speed) and kept across passes.
  std::shared_ptr<BlockRecycler> blocks_ = std::make_shared<BlockRecycler>(device_);
};

}  // namespace

Result<VectorSet> read_all(io::VectorReader& reader) {
  VectorSet set{reader.rows() - reader.rows_read(), reader.dim(), {}};
  set.values.resize(set.rows * set.dim);
  if (set.rows == 0) return set;
  auto got = reader.read(set.values, set.rows);
  if (!got) return std::unexpected(got.error());
  if (*got != set.rows)
    return make_error(ErrorKind::Io, fmt::format("{}: read {} rows; expected {}",
                                                 reader.path().string(), *got, set.rows));
  return set;
}

Result<JobResult> run_exact_knn(GpuMemoryPool& pool, const Device& device, const VectorSet& queries,
                                io::VectorReader& base, const JobOptions& options) {
  if (auto ok = check_inputs(queries, base, options); !ok) return std::unexpected(ok.error());
  pool.begin_phase(device);
  Job job(pool, device, queries, base, options);
  if (auto ok = job.run(); !ok) return std::unexpected(ok.error());
  return job.finish();
}

OutputFiles output_files(const std::filesystem::path& prefix, OutputFormat format) {
  bool npy = format == OutputFormat::Npy;
  std::string base = prefix.string();
  return {base + (npy ? ".neighbors.npy" : ".neighbors.ivecs"),
          base + (npy ? ".distances.npy" : ".distances.fvecs")};
}

Result<OutputFiles> write_neighbours(const Neighbours& neighbours, const std::filesystem::path& prefix,
                                     OutputFormat format) {
  OutputFiles files = output_files(prefix, format);
  std::size_t rows = neighbours.queries, dim = neighbours.k;
  auto first = format == OutputFormat::Npy
                   ? io::write_npy(files.neighbours, rows, dim, std::span(neighbours.indices))
                   : io::write_ivecs(files.neighbours, rows, dim, std::span(neighbours.indices));
  if (!first) return std::unexpected(first.error());
  auto second = format == OutputFormat::Npy
                    ? io::write_npy(files.distances, rows, dim, std::span(neighbours.distances))
                    : io::write_fvecs(files.distances, rows, dim, std::span(neighbours.distances));
  if (!second) {
    std::error_code ignored;
    std::filesystem::remove(files.neighbours, ignored);
    return std::unexpected(second.error());
  }
  return files;
}

}  // namespace gpupool::exact
