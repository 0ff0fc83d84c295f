// gpupool::exact — exact k-nearest neighbours of an in-memory query set over a base set streamed
// from a vector file, with the base and the queries larger than the device if need be: the job
// behind `gpupool knn`.
//
// Two layers, one inside the other:
//   * query blocks (gpupool:batching): the queries go to the device a block at a time (all of
//     them when they fit in half the pool's headroom); each block makes one pass over the base.
//     A block whose pass runs out of memory even with chunks of one row is bisected and redone.
//   * base blocks and chunks: a pass reads the file in blocks of rows as stored (base_stream.hpp,
//     one block ahead, in parallel pieces), and each block goes to the device in chunks
//     (gpupool:batching over the block's rows: an out-of-memory chunk is bisected and retried);
//     block_search.hpp finds every chunk's candidates on the device and folds them into the
//     block's running lists on the host.
//
// The exact mode (the default) returns what an fp64 computation over the whole base returns:
// ids ranked by the fp64 distance, ties by the smaller row, each distance that fp64 value
// (rounded to fp32 in the fvecs / fp32 outputs) — on every device, for every chunking and
// memory limit. Integer data runs on exact integer arithmetic; other data in fp32, with the
// candidates re-ranked in fp64 and every chunk proven complete from an error bound
// (arithmetic.hpp, running_lists.hpp). NaN or ±inf anywhere is refused. The fast mode returns
// the device's distances in the job's precision, as gpupool::knn computes them.
//
// This header imports gpupool: include it after your other headers.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>
#include "running_lists.hpp"
#include "shared_bounds.hpp"
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
  bool fast = false;  // the device's distances as they are, in `precision` and `mode`
  Precision precision = Precision::Fp32;  // fast mode: fp32, fp16, bf16, int8 (quantised)
  ComputeMode mode = ComputeMode::Fp32Accurate;  // fast mode
  // Fast mode only: rank NaN and infinite values by docs/kernels.md's rule instead of refusing
  // them (the exact mode always refuses them, naming the row).
  bool allow_non_finite = false;
  std::size_t max_chunk_rows = std::size_t{1} << 20;  // also bounds the host staging memory
  std::function<void(const Progress&)> on_progress;   // after every chunk
  // A share of the base (sharded_knn.hpp): at most this many rows from the reader's place
  // (default: every remaining row). Neighbour ids count from the reader's place.
  std::optional<std::size_t> base_rows;
  // Rows per base block (the unit the fast mode's scaling is chosen for); 0: chunk_cap over the
  // job's own rows. A share of a larger base passes the whole base's, so that its blocks are the
  // one-device job's blocks.
  std::size_t block_rows = 0;
  // Set by another thread to end the job at its next chunk (InvalidState): another device of the
  // same job failed, and this one's work would be thrown away.
  const std::atomic<bool>* stop = nullptr;
  // Exact mode: every query's smallest k-th distance so far over the devices of the same job
  // (shared_bounds.hpp), read as a bound and lowered after each chunk; indexed by query.
  SharedBounds* shared_bounds = nullptr;
  // Each chunk's rows go up while the chunk before is searched, where memory allows and the rows
  // are read in time (block_search.hpp). false: each chunk uploads in its turn, so that the job
  // asks the pool for the same buffers in the same order on every run (fault-injection tests).
  bool upload_ahead = true;
};

// k best base rows per query: distances ascending, row-major queries × k.
struct Neighbours {
  std::size_t queries = 0;
  std::size_t k = 0;
  std::vector<float> distances;
  std::vector<double> distances_fp64;  // the exact mode's fp64 distances (empty in the fast mode)
  std::vector<std::int32_t> indices;
  bool integer_distances = false;  // exact mode on whole numbers, l2 or ip: the fp64 values are integers
  // The first entry (query × k + rank) whose distance lies beyond fp32's range, and that distance:
  // write_neighbours refuses to write it as fp32.
  std::optional<std::size_t> beyond_fp32;
  double beyond_fp32_distance = 0;
  // The fast mode's ranking values: each device distance times its block's unit, in fp64 (exact),
  // which distances (rounded to fp32) may not tell apart at fp32's limits; lists of several shares
  // merge by them (merge_neighbours). Empty in the exact mode, which ranks by distances_fp64.
  std::vector<double> ranked_distances;
};

// Where a job's time went, in seconds over every query block. Each device step ends in a
// synchronisation, so every stage but reading is wall time of the job's own thread; what is left
// of JobSummary::seconds (other) went to planning, the batching library and reopening the base.
// Reading runs on other threads, beside them.
struct JobTimes {
  double reading = 0;            // the reading threads' wall time over the blocks (overlapped; a
                                 // gzip file inflates ahead from its opening, outside this)
  double preparing_queries = 0;  // the queries' fp64 copies, norms and value scan on the host
  double starting_device = 0;    // the job's first device call: on a device the process has not
                                 // used yet, its start (CUDA creates its context)
  double waiting_for_base = 0;   // blocked on the thread that reads the base (the disk was slower)
  double uploading = 0;          // base chunks to the device as stored, converted there
  double searching = 0;          // gpupool::knn over the chunks, candidates read back
  double merging = 0;            // the running lists made, candidates folded into them, fp64
                                 // re-ranks, the lists copied into the result
  // The job thread's stages together (all but reading).
  double staged() const noexcept {
    return preparing_queries + starting_device + waiting_for_base + uploading + searching + merging;
  }
};

// What the job moved and computed.
struct JobCounts {
  std::uint64_t bytes_read = 0;       // base rows as stored, every pass
  std::uint64_t bytes_uploaded = 0;   // to the device
  std::uint64_t bytes_uploaded_ahead = 0;  // of them, copied while the chunk before was searched
  std::uint64_t integer_chunks = 0;   // exact mode: chunks on exact integer arithmetic
  std::uint64_t float_chunks = 0;     // exact mode: chunks in fp32 with the error bound
  FoldCounts fold;                    // candidates looked at, fp64 distances computed
  std::uint64_t widened_queries = 0;  // searched again with more candidates (per chunk)
  std::uint64_t exhaustive_queries = 0;  // every row of a chunk computed in fp64 (per chunk)
  std::uint64_t non_finite_distances = 0;  // NaN or infinite distances in the result
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
  bool fast = false;
  JobTimes times;
  JobCounts counts;
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
// mismatch, a base of more than 2^31 - 1 rows or a precision the kernels do not take, and in the
// exact mode for a NaN or ±inf in a query (its row named) or a base row (the file and row named);
// the base file's own errors name its record; OutOfMemory when one query and one base row do not
// fit.
Result<JobResult> run_exact_knn(GpuMemoryPool& pool, const Device& device, const VectorSet& queries,
                                io::VectorReader& base, const JobOptions& options);

enum class OutputFormat : std::uint8_t { Texmex, Npy };
// The distances file's type: fp32 (fvecs or npy <f4), fp64 (npy <f8: the exact mode's values) or
// int64 (npy <i8: exact integer distances).
enum class DistanceType : std::uint8_t { Fp32, Fp64, Int64 };

struct OutputFiles {
  std::filesystem::path neighbours;  // PREFIX.neighbors.ivecs | .npy
  std::filesystem::path distances;   // PREFIX.distances.fvecs | .npy
};
OutputFiles output_files(const std::filesystem::path& prefix, OutputFormat format);
// Writes both files as a pair (io::FileGroup): both are replaced or neither, signals included.
// Fp64 and Int64 need the npy format and the exact mode's distances (Int64: integer ones).
Result<OutputFiles> write_neighbours(const Neighbours& neighbours, const std::filesystem::path& prefix,
                                     OutputFormat format, DistanceType type = DistanceType::Fp32);

// Recomputes `count` queries (picked at random from `seed`) against every row of `base` in fp64
// on the host and compares with `neighbours`: ids and distances (as written) must be equal.
// InvalidState naming the first query that differs, and how. Reads `base` from the start.
struct VerifyReport {
  std::size_t queries = 0;
  double seconds = 0;
};
Result<VerifyReport> verify_neighbours(const Neighbours& neighbours, const VectorSet& queries,
                                       const std::filesystem::path& base, Metric metric,
                                       std::size_t count, std::uint64_t seed = 1);

}  // namespace gpupool::exact
