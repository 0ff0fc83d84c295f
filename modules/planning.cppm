// gpupool:planning — decide before allocating: will it fit, and how to split work so it does.
//
//   predict_oom / will_oom   whether an allocation through the pool would fail now: it needs its
//                            size class within the hard limit, and the device's free memory plus
//                            what the pool can give back from its cache (the OOM ladder trims it)
//   auto_chunk               items per chunk so a chunk takes at most `fraction` of the memory
//   recommend_batch_size     a simple recommendation: usable = free × fraction, worst-case
//                            bytes per item, at least 1, at most the item count (and a cap)
// On CUDA, free memory is not one contiguous range and other processes allocate too: a "fits"
// is a forecast, not a promise (see gpupool:report).
module;
#include <cstddef>
#include <optional>
#include <string>
export module gpupool:planning;
import :error;
import :device;
import :pool;

export namespace gpupool {

struct OomForecast {
  std::size_t requested_bytes = 0;
  std::size_t block_bytes = 0;        // the size class the pool would take
  std::size_t device_free_bytes = 0;
  std::size_t reclaimable_bytes = 0;  // the pool's cached bytes on the device
  std::optional<std::size_t> limit;   // the pool's hard limit on the device
  std::size_t in_use_bytes = 0;
  bool will_oom = false;
  std::string reason;                 // why it will fail, or how it fits
};

// InvalidInput for 0 bytes or more than the pool ever hands out; DeviceUnavailable when the
// device cannot report its memory.
Result<OomForecast> predict_oom(std::size_t bytes, const Device& device, const GpuMemoryPool& pool);
Result<bool> will_oom(std::size_t bytes, const Device& device, const GpuMemoryPool& pool);
// Without a pool: the bytes against the device's free memory alone.
Result<bool> will_oom(std::size_t bytes, const Device& device);

struct ChunkConfig {
  std::size_t num_chunks = 0;
  std::size_t chunk_size = 0;       // items in every chunk but the last
  std::size_t last_chunk_size = 0;  // items in the last chunk (1 .. chunk_size)
  std::size_t bytes_per_chunk = 0;  // chunk_size × bytes per item
  std::string to_string() const;    // "Chunking: 4 chunks of 16 items (last 16)\nMemory per chunk: …"
};

// Chunks of `total_items` so that one chunk (rounded to its size class) takes at most
// fraction × available_bytes. InvalidInput for 0 items, 0 bytes per item, a fraction outside
// (0, 1] or an overflowing total; OutOfMemory when not even one item fits.
Result<ChunkConfig> auto_chunk(std::size_t total_items, std::size_t bytes_per_item,
                               std::size_t available_bytes, double fraction = 0.7);
// The same with the memory a pool can have on `device` now: the device's free memory plus the
// pool's cache, within the pool's hard limit.
Result<ChunkConfig> auto_chunk(std::size_t total_items, std::size_t bytes_per_item,
                               const Device& device, const GpuMemoryPool& pool,
                               double fraction = 0.7);
// What the pool can still hand out on `device` (the base of auto_chunk).
Result<std::size_t> available_bytes(const Device& device, const GpuMemoryPool& pool);

struct BatchRecommendation {
  std::size_t available_bytes = 0;
  std::size_t usable_bytes = 0;     // available × fraction
  std::size_t bytes_per_item = 0;   // the worst case
  std::size_t max_items = 0;        // usable / bytes per item, at least 1
  std::size_t batch_size = 0;       // min(max_items, item_count, cap)
  std::string to_string() const;    // "Batch size recommendation:" lines
};

// InvalidInput for 0 items, 0 bytes per item, a fraction outside (0, 1] or a cap of 0.
Result<BatchRecommendation> recommend_batch_size(std::size_t item_count,
                                                 std::size_t worst_case_bytes_per_item,
                                                 std::size_t available_bytes, double fraction = 0.7,
                                                 std::optional<std::size_t> cap = std::nullopt);
Result<BatchRecommendation> recommend_batch_size(std::size_t item_count,
                                                 std::size_t worst_case_bytes_per_item,
                                                 const Device& device, const GpuMemoryPool& pool,
                                                 double fraction = 0.7,
                                                 std::optional<std::size_t> cap = std::nullopt);

}  // namespace gpupool
