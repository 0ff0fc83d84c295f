// gpupool::exact — the host blocks the base file is read into: pinned where the device can pin
// them, reused once their rows are gone.
//
// Why: on a 10M-row base the reading thread spent most of its time on fresh 256 MiB blocks (their
// zero fill and a page fault every 4 KiB), and the chunks went to the GPU from pageable memory,
// through the driver's bounce buffer. A block is pinned once (Device::allocate_pinned costs about
// as much as cudaMalloc) and read into again and again.
//
// This header imports gpupool: include it after your other headers.
#pragma once
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>
import gpupool;

namespace gpupool::exact {

// Bytes of rows as the file stores them, in host memory: pinned by `device` where it could, else
// ordinary memory. Holds up to capacity() bytes, size() of them in use (left as they were when it
// shrank or grew).
// Move-only.
class HostBlock {
 public:
  HostBlock() = default;
  // A block of `capacity` bytes (> 0): pinned by `device` if given and it can, else ordinary;
  // OutOfMemory if neither can be had.
  static Result<HostBlock> allocate(const std::optional<Device>& device, std::size_t capacity);
  HostBlock(HostBlock&& other) noexcept;
  HostBlock& operator=(HostBlock&& other) noexcept;
  HostBlock(const HostBlock&) = delete;
  HostBlock& operator=(const HostBlock&) = delete;
  ~HostBlock();

  std::byte* data() noexcept { return data_; }
  const std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t capacity() const noexcept { return capacity_; }
  bool pinned() const noexcept { return pinned_by_.has_value(); }
  void resize(std::size_t bytes) noexcept { size_ = bytes <= capacity_ ? bytes : capacity_; }

 private:
  void release() noexcept;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0, capacity_ = 0;
  std::optional<Device> pinned_by_;  // the device that pinned it (it frees it)
};

// Blocks whose rows are all gone, kept for the next ones (at most four: the two blocks a job may
// use at once and the two being read, base_stream.hpp). Shared by the reading threads and the
// rows' handles; thread-safe.
class BlockRecycler {
 public:
  // Blocks pinned by `device` when it is given (the job's), else ordinary memory (tests).
  explicit BlockRecycler(std::optional<Device> device = std::nullopt);
  // A kept block that holds `bytes` (resized to them), or a new one.
  Result<HostBlock> take(std::size_t bytes);
  // Keeps `block` if fewer than four are kept; frees it otherwise.
  void give(HostBlock&& block) noexcept;
  // The block as its rows' handles hold it: given back here when the last handle goes.
  static std::shared_ptr<const HostBlock> share(std::shared_ptr<BlockRecycler> recycler,
                                                HostBlock&& block);

 private:
  static constexpr std::size_t kKept = 4;
  std::optional<Device> device_;
  std::mutex mutex_;
  std::vector<HostBlock> kept_;  // capacity kKept from the start: give() never allocates
};

}  // namespace gpupool::exact
