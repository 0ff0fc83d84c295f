// ManagedBuffer: ownership, typed access and transfers of one pooled block.
module;
#include <cstddef>
#include <expected>
#include <fmt/format.h>
#include <memory>
#include <new>
#include <span>
#include <utility>
#include <unordered_map>
#include <vector>
module gpupool;
import :device_pool;
import :thread_cache;

namespace gpupool {

// return_to_pool(): pool/allocation_path.cpp, beside the free it runs.

DevicePool& ManagedBuffer::pool() const noexcept { return cache_->pool(); }

const Stream& ManagedBuffer::stream() const noexcept {
  if (!cache_ || !stream_.is_default()) return stream_;
  return pool().default_stream();
}

Result<void> ManagedBuffer::release() {
  if (!ptr_)
    return make_error(ErrorKind::InvalidState,
                      "release() on an empty buffer: it was already released or moved from");
  return_to_pool();
  return {};
}

int ManagedBuffer::device_id() const noexcept { return cache_ ? pool().device().id() : -1; }

Device ManagedBuffer::device() const { return pool().device(); }

Result<void> ManagedBuffer::check_access(Precision wanted) const {
  if (!ptr_)
    return make_error(ErrorKind::InvalidState,
                      "the buffer is empty (released or moved from): it has no device memory");
  if (wanted != precision_)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("the buffer holds {} elements but was accessed as {}",
                                  to_string(precision_), to_string(wanted)),
                      device_id());
  return {};
}

namespace {
Result<void> check_span(std::size_t offset, std::size_t bytes, std::size_t size, const char* what,
                        int device) {
  if (offset > size || bytes > size - offset)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{} of {} bytes at offset {} runs past the buffer's {} bytes",
                                  what, bytes, offset, size), device);
  return {};
}
}  // namespace

Result<void> ManagedBuffer::upload(std::span<const std::byte> host, std::size_t offset) {
  if (!ptr_) return check_access(precision_);
  if (auto ok = check_span(offset, host.size(), requested_bytes_, "upload", device_id()); !ok) return ok;
  Device dev = device();
  auto copied = dev.copy(static_cast<std::byte*>(ptr_) + offset, host.data(), host.size(),
                         CopyKind::HostToDevice, stream());
  if (!copied) return copied;
  return stream().synchronize();
}

Result<void> ManagedBuffer::download(std::span<std::byte> host, std::size_t offset) const {
  if (!ptr_) return check_access(precision_);
  if (auto ok = check_span(offset, host.size(), requested_bytes_, "download", device_id()); !ok) return ok;
  Device dev = device();
  auto copied = dev.copy(host.data(), static_cast<const std::byte*>(ptr_) + offset, host.size(),
                         CopyKind::DeviceToHost, stream());
  if (!copied) return copied;
  return stream().synchronize();
}

Result<void> ManagedBuffer::fill_zero() {
  if (!ptr_) return check_access(precision_);
  return device().fill(ptr_, 0, requested_bytes_, stream());
}

Result<void> ManagedBuffer::record_stream(const Stream& stream) {
  if (!ptr_) return check_access(precision_);
  if (stream.device_id() != device_id())
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("record_stream: the stream is on device {}, the buffer on {}",
                                  stream.device_id(), device_id()), device_id());
  if (stream == this->stream()) return {};
  if (used_on_)
    for (const Stream& s : *used_on_)
      if (s == stream) return {};
  try {
    if (!used_on_) used_on_ = std::make_unique<std::vector<Stream>>();
    used_on_->push_back(stream);
  } catch (const std::bad_alloc&) {
    return make_error(ErrorKind::OutOfMemory,
                      "record_stream: the host ran out of memory for the buffer's list of streams",
                      device_id());
  }
  return {};
}

}  // namespace gpupool
