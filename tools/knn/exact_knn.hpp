// gpupool::exact — exact k-nearest neighbours of an in-memory query set over a base set streamed
// from a vector file, with the base larger than the device if need be: the job behind
// `gpupool knn`.
//
// The base is read in chunks sized through the pool (chunk_plan.hpp); every chunk goes to the
// device, gpupool::knn finds its k best rows per query, and merge_topk folds them into a running
// top-k per query; meanwhile the next block of the base is read on another thread. A chunk that
// runs out of device memory is retried in halves; finished chunks are never redone. Results are
// ordered as gpupool::knn orders them (distance ascending, ties by smaller base row), so they
// equal one knn() call over the whole base.
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

struct Progress {
  std::size_t base_rows_done = 0;
  std::size_t base_rows = 0;
  std::size_t chunks = 0;
  std::size_t retries = 0;
  double seconds = 0;
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

struct JobSummary {
  std::string device;
  std::size_t queries = 0;
  std::size_t base_rows = 0;
  std::size_t dim = 0;
  std::size_t k = 0;
  Metric metric = Metric::L2;
  Precision precision = Precision::Fp32;
  std::size_t chunks = 0;
  std::size_t retries = 0;         // chunks halved after running out of device memory
  std::size_t largest_chunk_rows = 0;
  double seconds = 0;
  PoolStats pool;                  // the pool's figures for the device, peaks since the job began
  double distances_per_second() const noexcept {
    return seconds > 0 ? static_cast<double>(queries) * static_cast<double>(base_rows) / seconds : 0;
  }
};

struct JobResult {
  Neighbours neighbours;
  JobSummary summary;
};

// Runs the job over every remaining row of `base`. InvalidInput (naming the file) for a k outside
// 1..min(kMaxK, base rows), a dimension mismatch, a base of more than 2^31 - 1 rows or a
// precision the kernels do not take; the base file's own errors name its record.
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
