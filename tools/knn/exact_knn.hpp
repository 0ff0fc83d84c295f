// gpupool::exact — exact k-nearest neighbours of an in-memory query set over a base set streamed
// from a vector file, with the base and the queries larger than the device if need be: the job
// behind `gpupool knn`.
//
// Two layers of gpupool:batching (process_in_batches_into), one inside the other:
//   * query blocks: the queries go to the device a block at a time (job_sizing.hpp: all of them
//     when they fit in half the pool's headroom); each block makes one pass over the base;
//   * base chunks: within a pass the base file is an input range of rows (base_stream.hpp), read
//     one block ahead on another thread; each chunk goes to the device, gpupool::knn finds its k
//     best rows per query of the block, and merge_topk folds them into the block's running top-k.
// An OutOfMemory or PoolLimitExceeded error in a chunk is the library's to recover from: it trims
// the pool's cache and bisects the chunk size (and grows it back later). A chunk changes the
// running top-k only when it succeeded, and the library gives every row to exactly one successful
// chunk, so no base row is skipped or counted twice. A pass that fails even with chunks of one
// row is an out-of-memory error of its query block, and the outer layer bisects the block the
// same way (the block's pass starts again; other blocks are untouched). Results are ordered as
// gpupool::knn orders them (distance ascending, ties by smaller base row), so they equal one
// knn() call over the whole base.
//
// This header imports gpupool: include it after your other headers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <expected>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>
#include "vector_io.hpp"
import gpupool;

namespace gpupool::exact {

// Row-major float32 vectors held on the host.
struct VectorSet {
  std::size_t rows = 0;
  std::size_t dim = 0;
  std::vector<float> values;
};

// Reads every remaining row of `reader` (the query file).
Result<VectorSet> read_all(io::VectorReader& reader);

// After every chunk.
struct Progress {
  std::size_t base_rows_done = 0;  // in the current query block's pass over the base
  std::size_t base_rows = 0;
  std::size_t queries_done = 0;    // queries of the blocks finished before this one
  std::size_t block_queries = 0;   // queries in the current block
  std::size_t queries = 0;         // all of them
  std::size_t chunks = 0;          // successful chunks so far, over every block
  std::size_t retries = 0;         // out-of-memory retries so far: chunks, and query blocks
                                   // (those counted once the next block has finished)
  double seconds = 0;
  // The share of all query × base-row pairs done.
  double fraction() const noexcept {
    double all = static_cast<double>(queries) * static_cast<double>(base_rows);
    double done = static_cast<double>(queries_done) * static_cast<double>(base_rows) +
                  static_cast<double>(block_queries) * static_cast<double>(base_rows_done);
    return all > 0 ? done / all : 0;
  }
};

struct JobOptions {
  std::size_t k = 100;
  Metric metric = Metric::L2;
  Precision precision = Precision::Fp32;  // what the device computes on: fp32, fp16, bf16, int8
  ComputeMode mode = ComputeMode::Fp32Accurate;
  std::size_t max_chunk_rows = std::size_t{1} << 20;  // also bounds the host staging memory
  std::function<void(const Progress&)> on_progress;   // after every chunk
};

// k best base rows per query: distances ascending, row-major queries × k.
struct Neighbours {
  std::size_t queries = 0;
  std::size_t k = 0;
  std::vector<float> distances;
  std::vector<std::int32_t> indices;
};

// Where a job's time went, in seconds over every query block. Each device step ends in a
// synchronisation, so the four are wall time the job spent on them; what is left of
// JobSummary::seconds went to the queries, the batching library and reopening the base.
struct JobTimes {
  double waiting_for_base = 0;  // blocked on the thread that reads the base (the disk was slower)
  double uploading = 0;         // base chunks to the device, converted to the job's precision
  double searching = 0;         // gpupool::knn over the chunks
  double merging = 0;           // the chunks' lists into the running top-k (merge_topk)
};

struct JobSummary {
  std::string device;
  std::size_t queries = 0;
  std::size_t base_rows = 0;
  std::size_t dim = 0;
  std::size_t k = 0;
  Metric metric = Metric::L2;
  Precision precision = Precision::Fp32;
  std::size_t chunks = 0;              // successful chunks (gpupool:batching's batches), all blocks
  std::size_t retries = 0;             // out-of-memory failures the batching library recovered
                                       // from: chunk retries plus query_block_retries
  std::size_t largest_chunk_rows = 0;
  std::size_t query_blocks = 0;        // blocks of queries, each one pass over the base
  std::size_t largest_query_block = 0;
  std::size_t query_block_retries = 0; // blocks redone smaller after their pass ran out of memory
  double seconds = 0;
  JobTimes times;
  PoolStats pool;  // the pool's figures for the device, peaks since the job began
  double distances_per_second() const noexcept {
    return seconds > 0 ? static_cast<double>(queries) * static_cast<double>(base_rows) / seconds : 0;
  }
};

struct JobResult {
  Neighbours neighbours;
  JobSummary summary;
};

// Runs the job over every remaining row of `base` (reopening its file for every query block after
// the first). InvalidInput (naming the file) for a k outside 1..min(kMaxK, base rows), a dimension
// mismatch, a base of more than 2^31 - 1 rows or a precision the kernels do not take; the base
// file's own errors name its record; OutOfMemory when one query and one base row do not fit.
Result<JobResult> run_exact_knn(GpuMemoryPool& pool, const Device& device, const VectorSet& queries,
                                io::VectorReader& base, const JobOptions& options);

enum class OutputFormat : std::uint8_t { Texmex, Npy };

struct OutputFiles {
  std::filesystem::path neighbours;  // PREFIX.neighbors.ivecs | .npy
  std::filesystem::path distances;   // PREFIX.distances.fvecs | .npy
};
OutputFiles output_files(const std::filesystem::path& prefix, OutputFormat format);
// Writes both files atomically; if the second fails the first is removed again.
Result<OutputFiles> write_neighbours(const Neighbours& neighbours, const std::filesystem::path& prefix,
                                     OutputFormat format);

}  // namespace gpupool::exact
