// gpupool:buffer — owned, typed views of pooled device memory.
//
// ManagedBuffer is move-only and returns its memory to the pool when it goes (or at release()).
// It keeps the pool's per-device state alive (through the thread cache it came from), so a
// buffer that outlives every GpuMemoryPool handle is still returned safely (then straight to the
// device). It is never dereferenceable on
// the host: data<T>() gives a device pointer, upload()/download() move bytes.
module;
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <memory>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>
export module gpupool:buffer;
import :error;
import :precision;
import :device;

namespace gpupool {
class DevicePool;     // pool/device_pool.cppm
class ThreadCache;    // pool/thread_cache.cppm
struct BufferAccess;  // pool/pool_access.cppm

template <class>
inline constexpr bool is_span = false;
template <class T, std::size_t N>
inline constexpr bool is_span<std::span<T, N>> = true;
}

export namespace gpupool {

// A contiguous host range (std::vector, std::array, a C array; not a std::span, which has
// overloads of its own) of an element type a buffer can hold.
template <class R>
concept HostRange = std::ranges::contiguous_range<R> && std::ranges::sized_range<R> &&
                    !is_span<std::remove_cvref_t<R>> &&
                    requires { precision_of<std::ranges::range_value_t<R>>::value; };

class alignas(16) ManagedBuffer {
 public:
  ManagedBuffer() = default;  // empty: holds nothing
  inline ManagedBuffer(ManagedBuffer&& other) noexcept
      : cache_(std::exchange(other.cache_, nullptr)),
        ptr_(std::exchange(other.ptr_, nullptr)),
        requested_bytes_(std::exchange(other.requested_bytes_, 0)),
        block_bytes_(std::exchange(other.block_bytes_, 0)),
        size_class_(other.size_class_),
        arena_(std::exchange(other.arena_, nullptr)),
        span_(other.span_),
        precision_(other.precision_),
        used_on_(std::move(other.used_on_)),
        stream_(std::move(other.stream_)) {}
  inline ManagedBuffer& operator=(ManagedBuffer&& other) noexcept {
    if (this != &other) {
      if (ptr_) return_to_pool();
      cache_ = std::exchange(other.cache_, nullptr);
      ptr_ = std::exchange(other.ptr_, nullptr);
      requested_bytes_ = std::exchange(other.requested_bytes_, 0);
      block_bytes_ = std::exchange(other.block_bytes_, 0);
      size_class_ = other.size_class_;
      arena_ = std::exchange(other.arena_, nullptr);
      span_ = other.span_;
      precision_ = other.precision_;
      stream_ = std::move(other.stream_);
      used_on_ = std::move(other.used_on_);
    }
    return *this;
  }
  ManagedBuffer(const ManagedBuffer&) = delete;
  ManagedBuffer& operator=(const ManagedBuffer&) = delete;
  inline ~ManagedBuffer() {
    if (ptr_) return_to_pool();
  }

  inline bool valid() const noexcept { return ptr_ != nullptr; }
  inline explicit operator bool() const noexcept { return valid(); }

  int device_id() const noexcept;
  Device device() const;
  inline std::size_t size_bytes() const noexcept { return requested_bytes_; }  // what was asked for
  inline std::size_t capacity_bytes() const noexcept { return block_bytes_; }  // its block
  std::size_t element_count() const noexcept { return requested_bytes_ / element_size(precision_); }
  inline Precision precision() const noexcept { return precision_; }
  const Stream& stream() const noexcept;
  // The backend's handle of that stream (cudaStream_t on CUDA), nullptr for the device's default.
  inline void* stream_handle() const noexcept { return stream_.native(); }

  // The device pointer as T*, if T matches the buffer's precision (any T for Precision::Bytes is
  // refused: ask for std::byte). InvalidState on an empty buffer.
  template <class T>
  Result<T*> data() const {
    if (auto ok = check_access(precision_of<std::remove_const_t<T>>::value); !ok)
      return std::unexpected(ok.error());
    return static_cast<T*>(ptr_);
  }
  inline void* raw_data() const noexcept { return ptr_; }

  // Copies host data in (at `offset` bytes) or out, ordered on the buffer's stream; both wait
  // for the copy to finish before returning, so the host memory may be reused at once.
  Result<void> upload(std::span<const std::byte> host, std::size_t offset = 0);
  Result<void> download(std::span<std::byte> host, std::size_t offset = 0) const;
  // Typed: T must be the buffer's element type, and `first` counts elements of it.
  template <class T>
  Result<void> upload(std::span<const T> host, std::size_t first = 0) {
    if (auto ok = check_access(precision_of<T>::value); !ok) return ok;
    return upload(std::as_bytes(host), element_offset<T>(first));
  }
  template <class T>
  Result<void> download(std::span<T> host, std::size_t first = 0) const {
    if (auto ok = check_access(precision_of<T>::value); !ok) return ok;
    return download(std::as_writable_bytes(host), element_offset<T>(first));
  }
  // Any contiguous range of the element type: a std::vector, std::array, a C array.
  template <HostRange R>
  Result<void> upload(const R& host, std::size_t first = 0) {
    using T = std::ranges::range_value_t<R>;
    return upload(std::span<const T>(std::ranges::data(host), std::ranges::size(host)), first);
  }
  template <HostRange R>
    requires(!std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<R>>>)
  Result<void> download(R&& host, std::size_t first = 0) const {
    using T = std::ranges::range_value_t<R>;
    return download(std::span<T>(std::ranges::data(host), std::ranges::size(host)), first);
  }
  template <class T>
  Result<std::vector<T>> to_host() const {
    std::vector<T> host(requested_bytes_ / sizeof(T));
    if (auto ok = download(std::span<T>(host)); !ok) return std::unexpected(ok.error());
    return host;
  }
  Result<void> fill_zero();  // reused memory is not zeroed unless asked (this, or zero_memory)

  // Declares use on another stream: the memory is reused only after that stream's work queued
  // before the buffer's release has finished.
  Result<void> record_stream(const Stream& stream);
  // Hands the memory back now; the buffer becomes empty. InvalidState if already empty.
  Result<void> release();

 private:
  friend class GpuMemoryPool;
  friend class DevicePool;
  friend struct BufferAccess;
  Result<void> check_access(Precision wanted) const;
  void return_to_pool() noexcept;

  DevicePool& pool() const noexcept;
  // Elements of T as bytes; past any buffer (refused by the copy's check) where that overflows.
  template <class T>
  static std::size_t element_offset(std::size_t first) noexcept {
    return first > SIZE_MAX / sizeof(T) ? SIZE_MAX : first * sizeof(T);
  }

  ThreadCache* cache_ = nullptr;  // holds one reference to it (pool/thread_cache.cppm)
  void* ptr_ = nullptr;
  std::size_t requested_bytes_ = 0;
  std::size_t block_bytes_ = 0;
  std::uint32_t size_class_ = 0;
  void* arena_ = nullptr;  // the arena shard a large block was carved from (pool/device_pool.cppm)
  std::uint32_t span_ = 0;  // and its span there
  Precision precision_ = Precision::Bytes;
  // Streams declared with record_stream; null while there are none, so that moving and ending
  // the common buffer (used on its own stream only) touches one pointer here.
  std::unique_ptr<std::vector<Stream>> used_on_;
  // Empty for the device's default stream (the pool holds that one). A move copies its 16-byte
  // handle in one piece, and the load that follows a store of it waits for the store to reach
  // the cache when the piece straddles two cache lines: at offset 64 of a 16-byte-aligned buffer
  // it never does, wherever the caller's stack or heap puts the buffer.
  Stream stream_;
};

}  // namespace gpupool
