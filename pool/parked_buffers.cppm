// ParkedBuffers: the live pointer-only allocations (GpuMemoryPool::allocate_pointer), by address,
// kept in the thread cache they came from.
//
// Why in the thread cache: a caller that keeps only the pointer (a C program, PyTorch's or CuPy's
// allocator hooks, a cuda::mr resource) needs the pool to remember each block. Kept next to the
// cache's free blocks and under the same lock, one lock hold takes a block and parks its record,
// and one finds a record and puts its block back: a pointer pair costs about what a ManagedBuffer
// pair costs. A free from another thread searches the other caches (the slow path).
//
// A record is what a ManagedBuffer of the block would hold, in one cache line and a half; the
// slow paths (other streams, tracing, visits) turn it into a real ManagedBuffer and back
// (DevicePool::buffer_of / park, pool/parked_pointers.cpp).
//
// Open addressing with linear probing and backward-shift deletion (no tombstones), at most half
// full. Block addresses are 256-byte aligned, so the hash drops the low bits. Every record holds a
// reference to its cache (as a buffer does), so a cache never ends with records in it.
module;
#include <bit>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <utility>
#include <vector>
module gpupool:parked_buffers;
import :device;

namespace gpupool {

// A parked allocation: its block, what was asked for, its stream and the streams recorded for it.
struct ParkedBlock {
  void* ptr = nullptr;  // the key; null in an empty slot
  void* arena = nullptr;  // as ManagedBuffer's
  std::size_t requested_bytes = 0;
  std::size_t block_bytes = 0;
  std::uint32_t size_class = 0;
  std::uint32_t span = 0;
  Stream stream;  // empty for the device's default stream
  std::unique_ptr<std::vector<Stream>> used_on;  // record_stream's streams; null while none
};

class ParkedBuffers {
 public:
  ParkedBuffers() = default;
  ParkedBuffers(const ParkedBuffers&) = delete;
  ParkedBuffers& operator=(const ParkedBuffers&) = delete;
  ~ParkedBuffers() { assert(count_ == 0 && "a cache ends only once its parked blocks are freed"); }

  inline std::size_t size() const noexcept { return count_; }

  // Makes sure one more record fits, growing the table if needed; false when host memory runs
  // out (nothing changed then).
  [[gnu::always_inline]] inline bool make_room() noexcept {
    if ((count_ + 1) * 2 <= capacity()) [[likely]] return true;
    return grow();
  }

  // The slot for `ptr`'s record, its key set and the rest empty; make_room() first.
  [[gnu::always_inline]] inline ParkedBlock& emplace(void* ptr) noexcept {
    std::size_t i = home(ptr);
    while (slots_[i].ptr) i = (i + 1) & mask_;
    ++count_;
    slots_[i].ptr = ptr;
    return slots_[i];
  }

  // The record of `ptr`, or null.
  [[gnu::always_inline]] inline ParkedBlock* find(const void* ptr) noexcept {
    if (count_ == 0 || ptr == nullptr) return nullptr;
    for (std::size_t i = home(ptr);; i = (i + 1) & mask_) {
      if (slots_[i].ptr == ptr) return &slots_[i];
      if (!slots_[i].ptr) return nullptr;
    }
  }

  // Frees the slot of a record found by find(), leaving it empty.
  [[gnu::always_inline]] inline void erase(ParkedBlock& record) noexcept {
    if (record.stream.device_id() >= 0) [[unlikely]] record.stream = Stream();
    record.used_on.reset();
    record.ptr = nullptr;
    --count_;
    const std::size_t hole = static_cast<std::size_t>(&record - slots_.get());
    if (slots_[(hole + 1) & mask_].ptr) [[unlikely]] close_gap(hole);
  }

  // f(ParkedBlock&&) for every record, each of which then leaves the table.
  template <class F>
  void drain(F&& f) {
    for (std::size_t i = 0; i < capacity(); ++i) {
      if (!slots_[i].ptr) continue;
      f(std::move(slots_[i]));
      slots_[i] = ParkedBlock();
      --count_;
    }
  }

 private:
  static constexpr std::size_t kFirstCapacity = 64;

  inline std::size_t capacity() const noexcept { return slots_ ? mask_ + 1 : 0; }
  inline std::size_t home(const void* ptr) const noexcept {
    const auto address = reinterpret_cast<std::uintptr_t>(ptr);
    return static_cast<std::size_t>(((address >> 8) * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  // Backward-shift deletion: moves later records of the probe run into the hole at `hole`, so
  // that every record stays reachable from its home without tombstones.
  [[gnu::noinline]] void close_gap(std::size_t hole) noexcept {
    for (std::size_t i = (hole + 1) & mask_; slots_[i].ptr; i = (i + 1) & mask_) {
      const std::size_t wanted = home(slots_[i].ptr);
      // The record at i may move to the hole if the hole lies on its probe path (home .. i).
      const bool on_path = ((i - wanted) & mask_) >= ((i - hole) & mask_);
      if (!on_path) continue;
      slots_[hole] = std::move(slots_[i]);
      slots_[i] = ParkedBlock();
      hole = i;
    }
  }

  [[gnu::noinline]] bool grow() noexcept {
    const std::size_t capacity = slots_ ? 2 * (mask_ + 1) : kFirstCapacity;
    std::unique_ptr<ParkedBlock[]> old(new (std::nothrow) ParkedBlock[capacity]);
    if (!old) return false;
    std::swap(old, slots_);
    const std::size_t old_capacity = old ? mask_ + 1 : 0;
    mask_ = capacity - 1;
    shift_ = 64 - std::countr_zero(capacity);
    for (std::size_t i = 0; i < old_capacity; ++i) {
      if (!old[i].ptr) continue;
      std::size_t j = home(old[i].ptr);
      while (slots_[j].ptr) j = (j + 1) & mask_;
      slots_[j] = std::move(old[i]);
    }
    return true;
  }

  std::unique_ptr<ParkedBlock[]> slots_;
  std::size_t mask_ = 0;
  int shift_ = 64;
  std::size_t count_ = 0;
};

}  // namespace gpupool
