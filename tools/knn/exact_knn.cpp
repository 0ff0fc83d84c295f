// The exact-kNN job (see exact_knn.hpp): validation, device copies of the query set and of each
// base chunk, and the chunk loop with its running top-k.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <fmt/format.h>
#include <future>
#include <limits>
#include <new>
#include <system_error>
#include <span>
#include <string>
#include <vector>
#include "chunk_plan.hpp"
#include "exact_knn.hpp"

namespace gpupool::exact {

namespace {

// A matrix on the device in the job's precision; `scales` is set for Int8 only.
struct DeviceMatrix {
  ManagedBuffer values;
  ManagedBuffer scales;
  const ManagedBuffer* scales_or_null() const { return scales.valid() ? &scales : nullptr; }
};

// Uploads fp32 rows and, for another precision, converts them on the device (the fp32 copy is
// given back to the pool as soon as the conversion has been queued after it).
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

// Everything the chunk loop carries from one chunk to the next.
class Job {
 public:
  Job(GpuMemoryPool& pool, const Device& device, const VectorSet& queries, const JobOptions& options)
      : pool_(pool), device_(device), queries_(queries), options_(options),
        distances_(queries.rows * options.k, std::numeric_limits<float>::infinity()),
        indices_(queries.rows * options.k, -1) {}

  Result<void> upload_queries() {
    auto matrix = to_device(pool_, device_, queries_.values, queries_.dim, options_.precision);
    if (!matrix) return std::unexpected(matrix.error().with_context("uploading the queries"));
    queries_on_device_ = std::move(*matrix);
    return {};
  }

  // Finds the chunk's k best per query and merges them into the running top-k. The running
  // lists change only when everything succeeded, so a failed chunk can be retried.
  Result<void> process(std::span<const float> rows, std::size_t first_row) {
    std::size_t count = rows.size() / queries_.dim;
    auto chunk = to_device(pool_, device_, rows, queries_.dim, options_.precision);
    if (!chunk) return std::unexpected(chunk.error());
    DistanceOptions distance_options{.dim = queries_.dim, .metric = options_.metric,
                                     .mode = options_.mode,
                                     .query_scales = queries_on_device_.scales_or_null(),
                                     .corpus_scales = chunk->scales_or_null()};
    auto found = gpupool::knn(pool_, queries_on_device_.values, chunk->values,
                              std::min(options_.k, count), distance_options);
    if (!found) return std::unexpected(found.error());
    *chunk = DeviceMatrix{};  // the chunk's memory is free for the merge
    return merge(*found, first_row);
  }

  Neighbours take_result() {
    return Neighbours{queries_.rows, options_.k, std::move(distances_), std::move(indices_)};
  }

 private:
  // Lays out [query][list 0 = running, list 1 = chunk][k], chunk ids offset to base rows, and
  // lets merge_topk keep the k best.
  Result<void> merge(const KnnResult& found, std::size_t first_row) {
    std::size_t q = queries_.rows, k = options_.k, kc = found.k;
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

  Result<void> merge_on_device(std::span<const float> candidate_distances,
                               std::span<const std::int32_t> candidate_indices) {
    std::size_t q = queries_.rows, k = options_.k;
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

  GpuMemoryPool& pool_;
  Device device_;
  const VectorSet& queries_;
  const JobOptions& options_;
  DeviceMatrix queries_on_device_;
  std::vector<float> distances_;
  std::vector<std::int32_t> indices_;
};

// Device bytes per base row (fp32 upload, converted copy, int8 scale) and per chunk (knn output,
// merge inputs and outputs, and a minimal kNN tile of 256 columns).
ChunkCost chunk_cost(const VectorSet& queries, const JobOptions& options) {
  std::size_t per_row = queries.dim * sizeof(float);
  if (options.precision != Precision::Fp32) per_row += queries.dim * element_size(options.precision);
  if (options.precision == Precision::Int8) per_row += sizeof(float);
  std::size_t top_k_bytes = queries.rows * options.k * (sizeof(float) + sizeof(std::int32_t));
  return {per_row, 4 * top_k_bytes + queries.rows * 256 * sizeof(float)};
}

// At least ~20 chunks, so that progress is visible, unless chunks would get tiny.
std::size_t chunk_cap(std::size_t base_rows, const JobOptions& options) {
  std::size_t for_progress = std::max<std::size_t>((base_rows + 19) / 20, 4096);
  return std::min(options.max_chunk_rows, for_progress);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Reads `rows` rows of the base, all of them or an error.
Result<std::vector<float>> read_block(io::VectorReader& base, std::size_t rows) {
  std::vector<float> block;
  try {
    block.resize(rows * base.dim());
  } catch (const std::bad_alloc&) {
    return make_error(ErrorKind::Io, fmt::format("{}: no host memory for a block of {} rows; "
                                                 "expected it to fit (lower --max-chunk-rows)",
                                                 base.path().string(), rows));
  }
  std::size_t before = base.rows_read();
  auto got = base.read(block, rows);
  if (!got) return std::unexpected(got.error());
  if (*got != rows)
    return make_error(ErrorKind::Io, fmt::format("{}: read {} rows at row {}; expected {}",
                                                 base.path().string(), *got, before, rows));
  return block;
}

// Reads the base one block ahead: the next block comes off the disk on another thread while the
// device works on the current one. The reader is only touched by that thread between request()
// and take().
class BlockPrefetcher {
 public:
  explicit BlockPrefetcher(io::VectorReader& base) : base_(base) {}
  BlockPrefetcher(const BlockPrefetcher&) = delete;
  BlockPrefetcher& operator=(const BlockPrefetcher&) = delete;
  ~BlockPrefetcher() {
    if (pending_.valid()) pending_.wait();
  }

  void request(std::size_t rows) {
    auto read = [this, rows] { return read_block(base_, rows); };
    try {
      pending_ = std::async(std::launch::async, read);
    } catch (const std::system_error&) {  // no thread to be had: read when taken
      pending_ = std::async(std::launch::deferred, read);
    }
  }
  Result<std::vector<float>> take() { return pending_.get(); }

 private:
  io::VectorReader& base_;
  std::future<Result<std::vector<float>>> pending_;
};

// The chunk loop over one block of base rows: pieces as large as the plan allows; a piece that
// runs out of device memory is retried in halves, finished pieces never again.
struct ChunkLoop {
  Job& job;
  ChunkPlan& plan;
  JobSummary& summary;
  const JobOptions& options;
  const std::filesystem::path& file;
  std::size_t first_row;  // the reader's position when the job began
  std::chrono::steady_clock::time_point start;

  Result<void> process_block(std::span<const float> block, std::size_t done) {
    std::size_t dim = summary.dim, rows = block.size() / dim;
    for (std::size_t offset = 0, piece = std::min(rows, plan.cap()); offset < rows;) {
      piece = std::min(piece, rows - offset);
      std::size_t row0 = done + offset;
      auto ok = job.process(block.subspan(offset * dim, piece * dim), row0);
      if (!ok) {
        auto smaller = plan.shrink_after(ok.error(), piece);
        if (!smaller)
          return std::unexpected(smaller.error().with_context(fmt::format(
              "base rows {}..{} of {}", first_row + row0, first_row + row0 + piece - 1, file.string())));
        piece = *smaller;
        continue;
      }
      offset += piece;
      ++summary.chunks;
      summary.largest_chunk_rows = std::max(summary.largest_chunk_rows, piece);
      if (options.on_progress)
        options.on_progress(Progress{done + offset, summary.base_rows, summary.chunks,
                                     plan.retries(), seconds_since(start)});
    }
    return {};
  }
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
  auto start = std::chrono::steady_clock::now();
  pool.begin_phase(device);
  Job job(pool, device, queries, options);
  if (auto ok = job.upload_queries(); !ok) return std::unexpected(ok.error());

  std::size_t first = base.rows_read(), total = base.rows() - first;
  ChunkPlan plan(pool, device, chunk_cost(queries, options), chunk_cap(total, options));
  JobSummary summary{.device = device.describe(), .queries = queries.rows, .base_rows = total,
                     .dim = queries.dim, .k = options.k, .metric = options.metric,
                     .precision = options.precision, .pool = {}};
  ChunkLoop loop{job, plan, summary, options, base.path(), first, start};
  BlockPrefetcher prefetcher(base);
  std::size_t rows = plan.next_rows(total);
  prefetcher.request(rows);
  for (std::size_t done = 0; done < total;) {
    auto block = prefetcher.take();
    if (!block) return std::unexpected(block.error());
    std::size_t next = done + rows;
    std::size_t next_rows = next < total ? plan.next_rows(total - next) : 0;
    if (next_rows) prefetcher.request(next_rows);
    if (auto ok = loop.process_block(*block, done); !ok) return std::unexpected(ok.error());
    done = next;
    rows = next_rows;
  }
  summary.retries = plan.retries();
  summary.seconds = seconds_since(start);
  summary.pool = pool.stats(device);
  return JobResult{job.take_result(), summary};
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
