// The exact-kNN job (see exact_knn.hpp): validation, the two layers (query blocks over the
// queries, blocks and chunks over a pass of the base), the output files and the fp64 check.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <random>
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
#include "parallel.hpp"

namespace gpupool::exact {

namespace {

Result<void> check_inputs(const VectorSet& queries, const io::VectorReader& base,
                          const JobOptions& options) {
  std::string file = base.path().string();
  std::size_t base_rows = std::min(options.base_rows.value_or(base.rows() - base.rows_read()),
                                   base.rows() - base.rows_read());
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
  if (options.fast && options.precision == Precision::Bytes)
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
      : pool_(pool), device_(device), queries_(queries), passes_(base, options.base_rows),
        options_(options),
        costs_(job_costs(queries.dim, options.fast ? options.k : std::min(kMaxK, options.k + 32),
                         stored_element(base.element_type()))),
        cap_(options.block_rows != 0 ? options.block_rows
                                     : chunk_cap(passes_.rows(), options.max_chunk_rows)),
        element_(stored_element(base.element_type())),
        row_bytes_(queries.dim * stored_size(element_)),
        start_(std::chrono::steady_clock::now()), peaks_(pool, device),
        result_(Neighbours{.queries = queries.rows, .k = options.k, .distances = {},
                           .distances_fp64 = {}, .indices = {}, .integer_distances = false,
                           .beyond_fp32 = {}, .beyond_fp32_distance = 0, .ranked_distances = {}}) {}

  // The first pass's reading starts here, so that it overlaps what comes before the first chunk
  // (the host's query copies, planning, the queries' upload).
  Result<void> start_reading() {
    auto blocks = open_pass();
    if (!blocks) return std::unexpected(blocks.error());
    first_pass_ = std::move(*blocks);
    return {};
  }

  // The queries' host copies and scan (while the first pass reads); non-finite ones are refused
  // here unless the fast mode allows them.
  Result<void> prepare_queries() {
    const auto start = std::chrono::steady_clock::now();
    host_ = host_queries(queries_.values, queries_.rows, queries_.dim);
    summary_.times.preparing_queries += seconds_since(start);
    if (!host_.stats.finite && !non_finite_allowed())
      return make_error(ErrorKind::InvalidInput,
                        fmt::format("query row {} holds NaN or an infinity; {}",
                                    host_.stats.first_nonfinite_row, finite_only()));
    return {};
  }

  // The outer layer: blocks of queries, each one pass over the base.
  Result<void> run() {
    const auto start = std::chrono::steady_clock::now();
    if (auto info = device_.memory_info(); !info) return std::unexpected(info.error());
    summary_.times.starting_device += seconds_since(start);
    auto headroom = memory_headroom(pool_, device_);
    if (!headroom) return std::unexpected(headroom.error());
    std::size_t block =
        even_batch_size(pick_query_block(headroom->bytes, queries_.rows, costs_), queries_.rows);
    BatchingOptions batching;
    batching.batch_size = block;
    batching.planner.max_batch_size = block;  // more queries would not leave the chunks their half
    batching.on_progress = [this](const BatchProgress& p) { block_retries_seen_ = p.retries; };
    batching.item_name = "query";
    batching.items_name = "queries";
    auto search = [this](const auto& block) { return search_block(block.first, block.size()); };
    auto store = [](std::size_t, std::vector<std::monostate>&&) -> Result<void> { return {}; };
    auto queries = std::views::iota(std::size_t{0}, queries_.rows);
    auto report = process_in_batches_into(pool_, device_, search, queries, store, batching);
    if (!report)
      return std::unexpected(
          report.error().is_out_of_memory()
              ? report.error().with_context(fmt::format(
                    "out of device memory for the query blocks (a block of one query with a chunk "
                    "of one base row is the least the job needs: lower --k or use a smaller "
                    "--precision{})",
                    pool_.max_pool_size(device_) ? ", or raise --memory-limit"
                                                 : "; no pool limit is set: the device is full"))
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
    summary_.fast = options_.fast;
    counts_.non_finite_distances = static_cast<std::uint64_t>(std::ranges::count_if(
        result_.distances, [](float d) { return !std::isfinite(d); }));
    summary_.counts = counts_;
    summary_.seconds = seconds_since(start_);
    result_.integer_distances = !options_.fast && counts_.float_chunks == 0 &&
                                options_.metric != Metric::Cosine;
    summary_.pool = peaks_.stats();
    return JobResult{std::move(result_), summary_};
  }

 private:
  // One call of the outer layer: queries [first, first + count) against the whole base; their
  // lists go into the result once the whole pass has succeeded.
  Result<std::vector<std::monostate>> search_block(std::size_t first, std::size_t count) {
    // The block's running lists are the merge's state: making them counts as merging.
    const auto making_lists = std::chrono::steady_clock::now();
    BlockSearch search(pool_, device_, host_, first, count, options_, summary_.times, counts_);
    summary_.times.merging += seconds_since(making_lists);
    auto report = stream_base(search, first, count);
    peaks_.sample();
    if (!report) return std::unexpected(report.error());
    summary_.chunks += report->batches;
    chunk_retries_ += report->retries;
    summary_.largest_chunk_rows = std::max(summary_.largest_chunk_rows, report->largest_batch);
    queries_done_ += count;
    const auto storing = std::chrono::steady_clock::now();
    store_lists(first, search.lists());
    summary_.times.merging += seconds_since(storing);
    return std::vector<std::monostate>(count);
  }

  // A pass over the base, its first block being read.
  Result<std::unique_ptr<BaseBlocks>> open_pass() {
    auto reader = passes_.open_next();
    if (!reader) return std::unexpected(reader.error());
    return std::make_unique<BaseBlocks>(
        **reader, passes_.rows(), cap_, blocks_,
        reading_parts(cap_ * row_bytes_, static_cast<unsigned>(usable_cores())));
  }

  // The inner layer: one pass over the base, block by block, each in chunks.
  Result<BatchingReport> stream_base(BlockSearch& search, std::size_t first, std::size_t count) {
    std::unique_ptr<BaseBlocks> opened = std::move(first_pass_);
    if (!opened) {
      auto next = open_pass();
      if (!next) return std::unexpected(next.error());
      opened = std::move(*next);
    }
    BaseBlocks& blocks = *opened;
    // Integer files' arithmetic is known before their rows: the queries go up while they read.
    if (stats_known_by_type(element_))
      if (auto ok = search.prepare(known_stats(element_, 0, queries_.dim)); !ok)
        return std::unexpected(ok.error());
    BatchingReport pass;
    Result<void> done = {};
    auto block = blocks.next();
    if (!block) done = std::unexpected(block.error());
    while (done && *block) {
      BlockAhead after(blocks);
      done = search_base_block(search, **block, after, first, count, pass);
      if (!done) break;
      block = after.take();
      if (!block) done = std::unexpected(block.error());
    }
    summary_.times.waiting_for_base += blocks.seconds_waiting();
    summary_.times.reading += blocks.seconds_reading();
    counts_.bytes_read += blocks.bytes_read();
    if (!done) return std::unexpected(done.error());
    if (pass.items != passes_.rows())
      return make_error(ErrorKind::InvalidState,
                        fmt::format("the pass over {} for queries {}..{} covered {} base rows; "
                                    "expected {}", passes_.path().string(), first,
                                    first + count - 1, pass.items, passes_.rows()));
    return pass;
  }

  // The block after the one being searched: taken from the reader early, and only once it is
  // read, so that the block's last search carries its first upload (BlockSearch::process)
  // without ever waiting for the reading.
  class BlockAhead {
   public:
    explicit BlockAhead(BaseBlocks& blocks) : blocks_(blocks) {}
    // The next block if it is read by now (taken from the reader then), else null.
    const BaseBlock* if_read() {
      if (!taken_ && blocks_.next_ready()) {
        next_ = blocks_.next();
        taken_ = true;
      }
      return taken_ && next_ && *next_ ? &**next_ : nullptr;
    }
    // The next block (or the reader's error, or nullopt after the last), waited for if need be.
    Result<std::optional<BaseBlock>> take() { return taken_ ? std::move(next_) : blocks_.next(); }

   private:
    BaseBlocks& blocks_;
    bool taken_ = false;
    Result<std::optional<BaseBlock>> next_ = std::optional<BaseBlock>{};
  };

  // The first chunk of a block of `block_rows` rows when chunks of `size` rows are wanted: evened
  // out over the block (even_batch_size), so that its chunks ask the pool for one size.
  static std::size_t opening_chunk_rows(std::size_t size, std::size_t block_rows) {
    return even_batch_size(std::min(size, block_rows), block_rows);
  }

  // The chunk the batching most likely asks for after rows [.., end) of `block`: as many rows
  // again in the same block, else the next block's first chunk, if that block is read by now.
  // A guess: a chunk of other rows uploads in its turn.
  std::optional<NextChunk> next_chunk(const BaseBlock& block, BlockAhead& after,
                                      std::size_t end, std::size_t size) const {
    const std::size_t rows = block.rows.rows;
    if (end < rows) return NextChunk{block.rows.slice(end, std::min(size, rows - end)), block.memory};
    const BaseBlock* next = after.if_read();
    if (!next || next->rows.rows == 0) return std::nullopt;
    const std::size_t first_rows =
        opening_chunk_rows(std::max(settled_chunk_rows_, size), next->rows.rows);
    return NextChunk{next->rows.slice(0, first_rows), next->memory};
  }

  // One block of the base in chunks (gpupool:batching over its rows), added to `pass`; `after`
  // holds the block that comes next.
  Result<void> search_base_block(BlockSearch& search, const BaseBlock& block, BlockAhead& after,
                                 std::size_t first, std::size_t count, BatchingReport& pass) {
    if (!block.stats.finite && !non_finite_allowed())
      return make_error(ErrorKind::InvalidInput,
                        fmt::format("{}: base row {} holds NaN or an infinity; {}",
                                    passes_.path().string(),
                                    passes_.first_row() + block.first_row +
                                        block.stats.first_nonfinite_row,
                                    finite_only()));
    auto headroom = memory_headroom(pool_, device_);
    if (!headroom) return std::unexpected(headroom.error());
    // The first chunk starts from the headroom and the batching grows it; later blocks take the
    // largest chunk that worked and keep it (a size that changes asks the pool for new blocks,
    // which tight memory gives only by trimming).
    const std::size_t rows = block.rows.rows;
    BatchingOptions batching;
    batching.item_name = "row of the block";
    batching.items_name = "rows of the block";
    const std::size_t first_size = settled_chunk_rows_ != 0
                                       ? settled_chunk_rows_
                                       : pick_chunk_rows(headroom->bytes, count, costs_, cap_);
    batching.batch_size = opening_chunk_rows(first_size, rows);
    batching.planner.max_batch_size =
        settled_chunk_rows_ != 0 ? *batching.batch_size : rows;
    const std::size_t items_before = pass.items;
    batching.on_progress = [&](const BatchProgress& p) {
      BatchProgress in_pass = p;
      in_pass.items_done += items_before;
      in_pass.batches_done += pass.batches;
      in_pass.retries += pass.retries;
      report_progress(in_pass, count);
    };
    auto chunk = [&](const auto& batch) -> Result<std::vector<std::monostate>> {
      if (options_.stop && options_.stop->load(std::memory_order_relaxed))
        return make_error(ErrorKind::InvalidState, "stopped: another part of the job failed");
      const std::optional<NextChunk> next =
          next_chunk(block, after, batch.first + batch.size(), batch.size());
      auto done = search.process(block.rows.slice(batch.first, batch.size()), block.stats,
                                 block.first_row + batch.first, next ? &*next : nullptr);
      peaks_.sample();
      if (!done) return std::unexpected(done.error());
      return std::vector<std::monostate>(batch.size());
    };
    auto ignore = [](std::size_t, std::vector<std::monostate>&&) -> Result<void> { return {}; };
    auto report = process_in_batches_into(pool_, device_, chunk,
                                          std::views::iota(std::size_t{0}, rows), ignore, batching);
    if (!report)
      return std::unexpected(report.error().with_context(fmt::format(
          "queries {}..{} against base rows {}..{} of {}", first, first + count - 1,
          passes_.first_row() + block.first_row, passes_.first_row() + block.first_row + rows - 1,
          passes_.path().string())));
    settled_chunk_rows_ = std::max(settled_chunk_rows_, report->largest_batch);
    pass.items += report->items;
    pass.batches += report->batches;
    pass.retries += report->retries;
    pass.largest_batch = std::max(pass.largest_batch, report->largest_batch);
    return {};
  }

  // The block's lists into the result, which is allocated with the first block's.
  bool non_finite_allowed() const noexcept { return options_.fast && options_.allow_non_finite; }
  std::string finite_only() const {
    return options_.fast ? "finite values only, unless non-finite ones are allowed "
                           "(--allow-non-finite ranks them as docs/kernels.md describes)"
                         : "the exact mode takes finite values only";
  }

  void store_lists(std::size_t first, const RunningLists& lists) {
    const std::size_t k = options_.k, at = first * k, entries = queries_.rows * k;
    if (result_.indices.empty()) {
      result_.indices.resize(entries);
      result_.distances.resize(entries);
      (options_.fast ? result_.ranked_distances : result_.distances_fp64).resize(entries);
    }
    auto rows = lists.rows();
    std::copy(rows.begin(), rows.end(), result_.indices.begin() + static_cast<std::ptrdiff_t>(at));
    auto fp32 = lists.distances_fp32();
    std::copy(fp32.begin(), fp32.end(), result_.distances.begin() + static_cast<std::ptrdiff_t>(at));
    auto fp64 = lists.distances_fp64();
    for (std::size_t i = 0; i < fp64.size() && !result_.beyond_fp32; ++i)
      if (std::isfinite(fp64[i]) && !std::isfinite(fp32[i])) {
        result_.beyond_fp32 = at + i;
        result_.beyond_fp32_distance = fp64[i];
      }
    std::copy(fp64.begin(), fp64.end(),
              (options_.fast ? result_.ranked_distances : result_.distances_fp64).begin() +
                  static_cast<std::ptrdiff_t>(at));
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
  HostQueries host_;  // filled by prepare_queries()
  BasePasses passes_;
  const JobOptions& options_;
  JobCosts costs_;
  std::size_t cap_;
  StoredElement element_;  // how the base's rows are stored (and uploaded)
  std::size_t row_bytes_;  // a base row as stored
  std::chrono::steady_clock::time_point start_;
  PeakTracker peaks_;
  Neighbours result_;
  JobSummary summary_;
  JobCounts counts_;
  std::size_t queries_done_ = 0;
  std::size_t chunk_retries_ = 0;       // of the passes that finished
  std::size_t block_retries_seen_ = 0;  // query-block retries, as of the last block that finished
  std::size_t settled_chunk_rows_ = 0;  // the largest chunk that worked so far (0: none yet)
  // The base's blocks, pinned by the device (uploads at bus speed) and kept across passes.
  std::shared_ptr<BlockRecycler> blocks_ = std::make_shared<BlockRecycler>(device_);
  std::unique_ptr<BaseBlocks> first_pass_;  // started by start_reading(), taken by the first pass
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
  if (auto ok = job.start_reading(); !ok) return std::unexpected(ok.error());
  if (auto ok = job.prepare_queries(); !ok) return std::unexpected(ok.error());
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
                                     OutputFormat format, DistanceType type) {
  OutputFiles files = output_files(prefix, format);
  const std::size_t rows = neighbours.queries, dim = neighbours.k;
  if (type != DistanceType::Fp32 && (format != OutputFormat::Npy || neighbours.distances_fp64.empty()))
    return make_error(ErrorKind::InvalidInput,
                      "fp64 and int64 distances are written by the exact mode as .npy only");
  if (type == DistanceType::Int64 && !neighbours.integer_distances)
    return make_error(ErrorKind::InvalidInput,
                      "int64 distances need integer data under l2 or ip (these distances are not "
                      "all whole numbers); write fp64 instead");
  if (type == DistanceType::Fp32 && neighbours.beyond_fp32) {
    const std::size_t at = *neighbours.beyond_fp32;
    return make_error(
        ErrorKind::InvalidInput,
        fmt::format("query {}'s neighbour {} (base row {}) is at distance {:.6g}, beyond fp32's "
                    "range (±3.4e38): the distances cannot be written as fp32; {}",
                    at / dim, at % dim, neighbours.indices[at], neighbours.beyond_fp32_distance,
                    neighbours.distances_fp64.empty()
                        ? "the exact mode writes them as fp64 (leave out --fast; --out-format npy "
                          "--distance-type fp64)"
                        : "write them as fp64 (--out-format npy --distance-type fp64)"));
  }
  io::FileGroup pair;
  auto first = format == OutputFormat::Npy
                   ? io::write_npy(files.neighbours, rows, dim, std::span(neighbours.indices), &pair)
                   : io::write_ivecs(files.neighbours, rows, dim, std::span(neighbours.indices), &pair);
  if (!first) return std::unexpected(first.error());
  Result<void> second = [&]() -> Result<void> {
    switch (type) {
      case DistanceType::Fp64:
        return io::write_npy(files.distances, rows, dim, std::span(neighbours.distances_fp64),
                             &pair);
      case DistanceType::Int64: {
        std::vector<std::int64_t> whole(neighbours.distances_fp64.size());
        std::transform(neighbours.distances_fp64.begin(), neighbours.distances_fp64.end(),
                       whole.begin(), [](double d) { return static_cast<std::int64_t>(d); });
        return io::write_npy(files.distances, rows, dim, std::span<const std::int64_t>(whole),
                             &pair);
      }
      case DistanceType::Fp32: break;
    }
    return format == OutputFormat::Npy
               ? io::write_npy(files.distances, rows, dim, std::span(neighbours.distances), &pair)
               : io::write_fvecs(files.distances, rows, dim, std::span(neighbours.distances), &pair);
  }();
  if (!second) return std::unexpected(second.error());  // the pair's temporaries go with it
  if (auto renamed = pair.commit(); !renamed) return std::unexpected(renamed.error());
  return files;
}

Result<VerifyReport> verify_neighbours(const Neighbours& neighbours, const VectorSet& queries,
                                       const std::filesystem::path& base, Metric metric,
                                       std::size_t count, std::uint64_t seed) {
  const auto start = std::chrono::steady_clock::now();
  count = std::min(count, neighbours.queries);
  // Which queries: a fixed-seed sample, so that a failure can be rerun.
  std::vector<std::size_t> picked(neighbours.queries);
  std::iota(picked.begin(), picked.end(), std::size_t{0});
  std::mt19937_64 random(seed);
  std::shuffle(picked.begin(), picked.end(), random);
  picked.resize(count);
  std::sort(picked.begin(), picked.end());
  HostQueries all = host_queries(queries.values, queries.rows, queries.dim);
  auto reader = io::VectorReader::open(base);
  if (!reader) return std::unexpected(reader.error());
  RunningLists lists(count, neighbours.k);
  // Every query a list of its own: list i is query picked[i].
  HostQueries chosen{count, queries.dim, {}, {}, all.stats, {}};
  for (std::size_t q : picked) {
    chosen.values.insert(chosen.values.end(), all.row(q), all.row(q) + queries.dim);
    chosen.norm2.push_back(all.norm2[q]);
    if (!all.integers.empty())
      chosen.integers.insert(chosen.integers.end(), all.integers.begin() + q * queries.dim,
                             all.integers.begin() + (q + 1) * queries.dim);
  }
  auto recycler = std::make_shared<BlockRecycler>();
  const std::size_t block_rows = std::max<std::size_t>(
      1, (std::size_t{64} << 20) / std::max<std::size_t>(reader->dim() * sizeof(float), 1));
  BaseBlocks blocks(*reader, reader->rows(), block_rows, recycler,
                    reading_parts(std::size_t{64} << 20, static_cast<unsigned>(usable_cores())));
  FoldCounts counts;
  for (;;) {
    auto block = blocks.next();
    if (!block) return std::unexpected(block.error().with_context("verifying"));
    if (!*block) break;
    lists.fold_every_row(chosen, (*block)->rows, (*block)->first_row, metric, counts);
  }
  const auto rows = lists.rows();
  const auto exact = lists.distances_fp64();
  const std::size_t k = neighbours.k;
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t q = picked[i];
    for (std::size_t j = 0; j < k; ++j) {
      const std::int32_t got = neighbours.indices[q * k + j], want = rows[i * k + j];
      const float got_d = neighbours.distances[q * k + j];
      const float want_d = static_cast<float>(exact[i * k + j]);
      if (got != want || !(got_d == want_d || (std::isnan(got_d) && std::isnan(want_d))))
        return make_error(ErrorKind::InvalidState,
                          fmt::format("--verify: query {} differs from an fp64 recomputation at "
                                      "rank {}: the job gave row {} at distance {}, fp64 gives "
                                      "row {} at distance {} (fp32 {})",
                                      q, j, got, got_d, want, exact[i * k + j], want_d));
    }
  }
  return VerifyReport{count, seconds_since(start)};
}

}  // namespace gpupool::exact
