// gpupool:staging — pinned host memory for uploads and downloads, pooled.
//
// A copy between pageable host memory and the GPU goes through a driver bounce buffer at a
// fraction of the bus speed; from page-locked ("pinned") memory it runs at full speed and can be
// asynchronous. Pinning is slow (cudaHostAlloc costs about as much as cudaMalloc), so staging
// memory is pooled: PinnedStagingPool is Boost.Pool (boost::pool, contiguous runs of fixed-size
// chunks) over a UserAllocator that asks the device for pinned memory — ordinary host memory on
// the simulated device. upload_staged / download_staged move any amount through a bounded
// staging buffer, chunk by chunk, ordered on the device buffer's stream.
module;
#include <cstddef>
#include <memory>
#include <mutex>
#include <span>
export module gpupool:staging;
import :error;
import :device;
import :buffer;

namespace gpupool {
struct StagingState;  // pool/pinned_staging_pool.cpp
}

export namespace gpupool {

class PinnedStagingPool;

// A run of pinned chunks, returned to its pool when it goes. Move-only.
class StagingBuffer {
 public:
  StagingBuffer() = default;
  StagingBuffer(StagingBuffer&& other) noexcept;
  StagingBuffer& operator=(StagingBuffer&& other) noexcept;
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;
  ~StagingBuffer();

  std::span<std::byte> bytes() const noexcept { return {data_, size_}; }
  bool valid() const noexcept { return data_ != nullptr; }

 private:
  friend class PinnedStagingPool;
  void give_back() noexcept;
  std::shared_ptr<StagingState> state_;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t chunks_ = 0;
};

class PinnedStagingPool {
 public:
  // Staging memory of `device`, handed out in multiples of chunk_bytes (at least 4 KiB).
  static Result<PinnedStagingPool> create(Device device, std::size_t chunk_bytes = std::size_t{1} << 20);

  // `bytes` (> 0) of pinned host memory, from the pool when it has a free run that long.
  Result<StagingBuffer> acquire(std::size_t bytes);
  // Pinned bytes the pool holds from the device (handed out or free).
  std::size_t reserved_bytes() const;
  // Gives blocks with no chunk in use back to the device; returns true if any went.
  bool release_unused();
  std::size_t chunk_bytes() const noexcept;

 private:
  explicit PinnedStagingPool(std::shared_ptr<StagingState> state) : state_(std::move(state)) {}
  std::shared_ptr<StagingState> state_;
};

// host → buffer (at byte `offset`) and buffer → host through staging runs of at most
// `staging_bytes`, each copy ordered on the buffer's stream and waited for before the run is
// reused. InvalidInput if the span does not fit the buffer at that offset.
Result<void> upload_staged(PinnedStagingPool& staging, ManagedBuffer& buffer,
                           std::span<const std::byte> host, std::size_t offset = 0,
                           std::size_t staging_bytes = std::size_t{8} << 20);
Result<void> download_staged(PinnedStagingPool& staging, const ManagedBuffer& buffer,
                             std::span<std::byte> host, std::size_t offset = 0,
                             std::size_t staging_bytes = std::size_t{8} << 20);

}  // namespace gpupool
