// Host blocks for the base file's rows (see host_blocks.hpp).
#include <algorithm>
#include <cstddef>
#include <expected>
#include <fmt/format.h>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <utility>
#include <vector>
#include "host_blocks.hpp"

namespace gpupool::exact {

Result<HostBlock> HostBlock::allocate(const std::optional<Device>& device, std::size_t capacity) {
  HostBlock block;
  const std::size_t bytes = capacity;
  if (device) {
    auto pinned = device->allocate_pinned(bytes);
    if (pinned) {  // else ordinary memory: slower uploads, the same rows
      block.data_ = static_cast<std::byte*>(*pinned);
      block.pinned_by_ = *device;
    }
  }
  if (!block.data_) block.data_ = new (std::nothrow) std::byte[capacity];
  if (!block.data_)
    return make_error(ErrorKind::OutOfMemory,
                      fmt::format("no host memory for a block of {} bytes of base rows; expected "
                                  "it to fit (lower --max-chunk-rows)", bytes));
  block.size_ = block.capacity_ = capacity;
  return block;
}

HostBlock::HostBlock(HostBlock&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)),
      capacity_(std::exchange(other.capacity_, 0)), pinned_by_(std::move(other.pinned_by_)) {
  other.pinned_by_.reset();
}

HostBlock& HostBlock::operator=(HostBlock&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    capacity_ = std::exchange(other.capacity_, 0);
    pinned_by_ = std::move(other.pinned_by_);
    other.pinned_by_.reset();
  }
  return *this;
}

HostBlock::~HostBlock() { release(); }

void HostBlock::release() noexcept {
  if (!data_) return;
  if (pinned_by_) (void)pinned_by_->deallocate_pinned(data_);  // nothing to do if it fails
  else delete[] data_;
  data_ = nullptr;
  pinned_by_.reset();
}

BlockRecycler::BlockRecycler(std::optional<Device> device) : device_(std::move(device)) {
  kept_.reserve(kKept);
}

Result<HostBlock> BlockRecycler::take(std::size_t bytes) {
  {
    std::lock_guard lock(mutex_);
    auto fits = std::find_if(kept_.begin(), kept_.end(),
                             [bytes](const HostBlock& b) { return b.capacity() >= bytes; });
    if (fits != kept_.end()) {
      HostBlock block = std::move(*fits);
      kept_.erase(fits);
      block.resize(bytes);
      return block;
    }
  }
  return HostBlock::allocate(device_, std::max<std::size_t>(bytes, 1));
}

void BlockRecycler::give(HostBlock&& block) noexcept {
  std::lock_guard lock(mutex_);
  if (kept_.size() < kKept) kept_.push_back(std::move(block));
}

std::shared_ptr<const HostBlock> BlockRecycler::share(std::shared_ptr<BlockRecycler> recycler,
                                                      HostBlock&& block) {
  auto owned = std::make_unique<HostBlock>(std::move(block));
  return {owned.release(), [recycler = std::move(recycler)](const HostBlock* p) {
            std::unique_ptr<HostBlock> last(const_cast<HostBlock*>(p));
            recycler->give(std::move(*last));
          }};
}

}  // namespace gpupool::exact
