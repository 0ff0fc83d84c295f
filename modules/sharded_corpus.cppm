// gpupool:sharded_corpus — one corpus over several devices, searched as one.
//
// The rows are cut into contiguous shares, one per device (a device may be named twice: two
// shards on one device), each resident in the pool on its device. A search sends the queries to
// every shard at once — one host thread per shard, so the devices work side by side — lets each
// find its k nearest rows with knn, and merges the shards' lists by (distance, row) in knn's
// order. The merged lists are knn's over the whole corpus on one device wherever a row's distance
// does not depend on which rows share its call (always on the simulated device; on CUDA a shard
// of another size may take another kernel, docs/kernels.md says which). The pattern of FAISS's
// IndexShards.
module;
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>
export module gpupool:sharded_corpus;
import :error;
import :precision;
import :device;
import :buffer;
import :pool;
import :kernels;

export namespace gpupool {

struct ShardedKnnResult {
  std::size_t queries = 0;
  std::size_t k = 0;
  std::vector<float> distances;       // Q×k, each row in knn's order
  std::vector<std::int64_t> indices;  // Q×k corpus rows (counted over the whole corpus)
  std::vector<double> shard_seconds;  // per shard: its upload, search and download
};

struct ShardedSearchOptions {
  Metric metric = Metric::L2;
  ComputeMode mode = ComputeMode::Fp32Accurate;
  // Int8 corpora only (required then): one fp32 scale per query, as DistanceOptions takes.
  std::span<const float> query_scales = {};
};

class ShardedCorpus {
 public:
  // Cuts `rows` (row-major, `dim` values of `precision` each: Fp32, Fp16, Bf16 or Int8; Int8 with
  // one fp32 scale per row in `int8_scales`) into contiguous shares as equal as they come, one per
  // device in `devices` (fewer when there are fewer rows than devices), and uploads each into
  // `pool` on its device, with its rows' squared norms (4 bytes a row), computed once here for
  // every search (DistanceOptions::corpus_norms). InvalidInput for no devices, no rows, a size
  // that is not whole rows, a precision knn does not take, or scales that do not match; a
  // device's error names its shard.
  static Result<ShardedCorpus> create(GpuMemoryPool& pool, std::span<const Device> devices,
                                      std::span<const std::byte> rows, std::size_t dim,
                                      Precision precision, std::span<const float> int8_scales = {});

  std::size_t shard_count() const noexcept { return shards_.size(); }
  std::size_t rows() const noexcept { return rows_; }
  std::size_t dim() const noexcept { return dim_; }
  Precision precision() const noexcept { return precision_; }
  const Device& shard_device(std::size_t shard) const { return shards_.at(shard).device; }
  std::size_t shard_first_row(std::size_t shard) const { return shards_.at(shard).first_row; }
  std::size_t shard_rows(std::size_t shard) const { return shards_.at(shard).rows; }

  // The k nearest corpus rows of every query (`queries`: Q rows of dim values in the corpus's
  // precision), smallest distance first, ties by the smaller row, NaN after every number. k in
  // 1..kMaxK and at most rows(). Every shard searches at once; the first shard (in order) that
  // fails gives the error, naming its device.
  Result<ShardedKnnResult> knn(std::span<const std::byte> queries, std::size_t k,
                               const ShardedSearchOptions& options = {}) const;

 private:
  struct Shard {
    Device device;
    std::size_t first_row = 0;
    std::size_t rows = 0;
    ManagedBuffer values;
    ManagedBuffer scales;  // Int8 only
    ManagedBuffer norms;   // the rows' squared norms (row_norms), which every search reads
  };
  ShardedCorpus(GpuMemoryPool pool, std::size_t rows, std::size_t dim, Precision precision)
      : pool_(std::move(pool)), rows_(rows), dim_(dim), precision_(precision) {}

  mutable GpuMemoryPool pool_;  // a handle: copies share the pool
  std::vector<Shard> shards_;
  std::size_t rows_ = 0;
  std::size_t dim_ = 0;
  Precision precision_ = Precision::Fp32;
};

}  // namespace gpupool
