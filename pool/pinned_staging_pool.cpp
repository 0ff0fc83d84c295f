// PinnedStagingPool: Boost.Pool over pinned host memory of one device.
//
// boost::pool's UserAllocator is a type with static malloc/free, so the device to pin memory on
// cannot be a member: the pool's state is passed through a thread-local slot that is set, under
// the pool's mutex, around every boost::pool call that may allocate or free.
module;
#include <algorithm>
#include <boost/pool/pool.hpp>
#include <cstddef>
#include <cstring>
#include <expected>
#include <fmt/format.h>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <utility>
module gpupool;

namespace gpupool {

struct StagingState;

namespace {

// The state whose device boost::pool is allocating for: set by StagingState::enter().
thread_local StagingState* current_state = nullptr;

struct PinnedUserAllocator {
  using size_type = std::size_t;
  using difference_type = std::ptrdiff_t;
  static char* malloc(size_type bytes);
  static void free(char* block);
};

}  // namespace

struct StagingState {
  // Grow one chunk at a time at first (pinning is costly and staging needs are small), doubling
  // up to 64 chunks per device allocation.
  StagingState(Device d, std::size_t chunk)
      : device(std::move(d)), chunk_bytes(chunk), chunks(chunk, /*next_size=*/1, /*max_size=*/64) {}
  ~StagingState() {
    auto scope = enter();
    chunks.purge_memory();
  }
  // Points the allocator at this state for the duration of a boost::pool call (under `mutex`).
  struct Scope {
    ~Scope() { current_state = nullptr; }
  };
  [[nodiscard]] Scope enter() {
    current_state = this;
    return {};
  }

  Device device;
  std::size_t chunk_bytes;
  std::mutex mutex;
  std::unordered_map<char*, std::size_t> blocks;  // pinned blocks boost::pool holds, with sizes
  std::size_t reserved = 0;
  std::size_t chunks_in_use = 0;
  boost::pool<PinnedUserAllocator> chunks;
};

namespace {

char* PinnedUserAllocator::malloc(size_type bytes) {
  auto ptr = current_state->device.allocate_pinned(bytes);
  if (!ptr) return nullptr;
  auto* block = static_cast<char*>(*ptr);
  current_state->blocks.emplace(block, bytes);
  current_state->reserved += bytes;
  return block;
}

void PinnedUserAllocator::free(char* block) {
  auto it = current_state->blocks.find(block);
  if (it != current_state->blocks.end()) {
    current_state->reserved -= it->second;
    current_state->blocks.erase(it);
  }
  (void)current_state->device.deallocate_pinned(block);
}

}  // namespace

StagingBuffer::StagingBuffer(StagingBuffer&& other) noexcept
    : state_(std::move(other.state_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      chunks_(std::exchange(other.chunks_, 0)) {}

StagingBuffer& StagingBuffer::operator=(StagingBuffer&& other) noexcept {
  if (this != &other) {
    give_back();
    state_ = std::move(other.state_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    chunks_ = std::exchange(other.chunks_, 0);
  }
  return *this;
}

StagingBuffer::~StagingBuffer() { give_back(); }

void StagingBuffer::give_back() noexcept {
  if (!data_) return;
  {
    std::lock_guard lock(state_->mutex);
    auto scope = state_->enter();
    state_->chunks.ordered_free(data_, chunks_);
    state_->chunks_in_use -= chunks_;
  }
  data_ = nullptr;
  state_.reset();
}

Result<PinnedStagingPool> PinnedStagingPool::create(Device device, std::size_t chunk_bytes) {
  if (chunk_bytes < 4096)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("staging chunk of {} bytes: expected at least 4096", chunk_bytes),
                      device.id());
  return PinnedStagingPool(std::make_shared<StagingState>(std::move(device), chunk_bytes));
}

Result<StagingBuffer> PinnedStagingPool::acquire(std::size_t bytes) {
  if (bytes == 0)
    return make_error(ErrorKind::InvalidInput, "a staging buffer of 0 bytes: expected at least 1",
                      state_->device.id());
  const std::size_t chunks = (bytes + state_->chunk_bytes - 1) / state_->chunk_bytes;
  std::lock_guard lock(state_->mutex);
  auto scope = state_->enter();
  void* run = state_->chunks.ordered_malloc(chunks);
  if (!run)
    return make_error(ErrorKind::OutOfMemory,
                      fmt::format("could not pin {} of host memory for staging ({} held)",
                                  format_bytes(chunks * state_->chunk_bytes),
                                  format_bytes(state_->reserved)),
                      state_->device.id());
  state_->chunks_in_use += chunks;
  StagingBuffer buffer;
  buffer.state_ = state_;
  buffer.data_ = static_cast<std::byte*>(run);
  buffer.size_ = bytes;
  buffer.chunks_ = chunks;
  return buffer;
}

std::size_t PinnedStagingPool::reserved_bytes() const {
  std::lock_guard lock(state_->mutex);
  return state_->reserved;
}

bool PinnedStagingPool::release_unused() {
  std::lock_guard lock(state_->mutex);
  auto scope = state_->enter();
  if (state_->chunks_in_use == 0) return state_->chunks.purge_memory();
  return state_->chunks.release_memory();
}

std::size_t PinnedStagingPool::chunk_bytes() const noexcept { return state_->chunk_bytes; }

namespace {

Result<void> check_transfer(const ManagedBuffer& buffer, std::size_t offset, std::size_t bytes,
                            std::size_t staging_bytes, const char* what) {
  if (!buffer.valid())
    return make_error(ErrorKind::InvalidInput, fmt::format("{} with an empty buffer", what));
  if (staging_bytes == 0)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{} with staging_bytes 0: expected at least 1", what),
                      buffer.device_id());
  if (offset > buffer.size_bytes() || bytes > buffer.size_bytes() - offset)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{} of {} at offset {} into a buffer of {}: expected offset + "
                                  "size <= buffer size", what, format_bytes(bytes), offset,
                                  format_bytes(buffer.size_bytes())),
                      buffer.device_id());
  return {};
}

}  // namespace

Result<void> upload_staged(PinnedStagingPool& staging, ManagedBuffer& buffer,
                           std::span<const std::byte> host, std::size_t offset,
                           std::size_t staging_bytes) {
  if (auto ok = check_transfer(buffer, offset, host.size(), staging_bytes, "upload_staged"); !ok) return ok;
  if (host.empty()) return {};
  auto run = staging.acquire(std::min(staging_bytes, host.size()));
  if (!run) return std::unexpected(run.error());
  std::span<std::byte> pinned = run->bytes();
  for (std::size_t done = 0; done < host.size(); done += pinned.size()) {
    std::size_t n = std::min(pinned.size(), host.size() - done);
    std::memcpy(pinned.data(), host.data() + done, n);
    if (auto ok = buffer.upload(pinned.first(n), offset + done); !ok) return ok;  // waits for the copy
  }
  return {};
}

Result<void> download_staged(PinnedStagingPool& staging, const ManagedBuffer& buffer,
                             std::span<std::byte> host, std::size_t offset,
                             std::size_t staging_bytes) {
  if (auto ok = check_transfer(buffer, offset, host.size(), staging_bytes, "download_staged"); !ok) return ok;
  if (host.empty()) return {};
  auto run = staging.acquire(std::min(staging_bytes, host.size()));
  if (!run) return std::unexpected(run.error());
  std::span<std::byte> pinned = run->bytes();
  for (std::size_t done = 0; done < host.size(); done += pinned.size()) {
    std::size_t n = std::min(pinned.size(), host.size() - done);
    if (auto ok = buffer.download(pinned.first(n), offset + done); !ok) return ok;
    std::memcpy(host.data() + done, pinned.data(), n);
  }
  return {};
}

}  // namespace gpupool
