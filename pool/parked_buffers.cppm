// ParkedBuffers: the buffers of pointer-only allocations (GpuMemoryPool::allocate_pointer), by
// address, kept in the thread cache they came from.
//
// Why in the thread cache: a caller that keeps only the pointer (a C program, PyTorch's or CuPy's
// allocator hooks, a cuda::mr resource) needs the pool to remember each block's buffer. Kept next
// to the cache's free blocks and under the same lock, one lock hold takes a block and parks its
// buffer, and one finds a buffer and puts its block back: a pointer pair costs about what a
// ManagedBuffer pair costs. A free from another thread searches the other caches (the slow path).
//
// Open addressing with linear probing and backward-shift deletion (no tombstones), at most half
// full. Block addresses are 256-byte aligned, so the hash drops the low bits. Every parked buffer
// holds a reference to its cache, so a cache never ends with buffers parked in it.
module;
#include <bit>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <utility>
module gpupool:parked_buffers;
import :buffer;

namespace gpupool {

class ParkedBuffers {
 public:
  ParkedBuffers() = default;
  ParkedBuffers(const ParkedBuffers&) = delete;
  ParkedBuffers& operator=(const ParkedBuffers&) = delete;
  ~ParkedBuffers() {
    assert(count_ == 0 && "a cache ends only once its parked buffers are freed");
    for (std::size_t i = 0; i < capacity(); ++i)
      if (slots_[i].key) slots_[i].buffer().~ManagedBuffer();
  }

  inline std::size_t size() const noexcept { return count_; }

  // Makes sure one more buffer fits, growing the table if needed; false when host memory runs
  // out (nothing changed then).
  [[gnu::always_inline]] inline bool make_room() noexcept {
    if ((count_ + 1) * 2 <= capacity()) [[likely]] return true;
    return grow();
  }

  // An empty buffer in a new slot for `ptr`, to be filled by the caller; make_room() first.
  [[gnu::always_inline]] inline ManagedBuffer& emplace(void* ptr) noexcept {
    std::size_t i = home(ptr);
    while (slots_[i].key) i = (i + 1) & mask_;
    slots_[i].key = ptr;
    ++count_;
    return *::new (slots_[i].storage) ManagedBuffer();
  }

  // The buffer parked under `ptr`, or null.
  [[gnu::always_inline]] inline ManagedBuffer* find(const void* ptr) noexcept {
    if (count_ == 0 || ptr == nullptr) return nullptr;
    for (std::size_t i = home(ptr);; i = (i + 1) & mask_) {
      if (slots_[i].key == ptr) return &slots_[i].buffer();
      if (!slots_[i].key) return nullptr;
    }
  }

  // Frees the slot of the buffer found by find() without running its destructor: the caller has
  // given its block back and released what it holds (DevicePool::free_parked), so nothing is
  // left for the destructor to do.
  [[gnu::always_inline]] inline void forget(ManagedBuffer& buffer) noexcept {
    Slot& slot = slot_of(buffer);
    slot.key = nullptr;
    --count_;
    const std::size_t hole = static_cast<std::size_t>(&slot - slots_.get());
    if (slots_[(hole + 1) & mask_].key) [[unlikely]] close_gap(hole);
  }

  // Moves the buffer found by find() out and frees its slot.
  inline ManagedBuffer take(ManagedBuffer& buffer) noexcept {
    ManagedBuffer out(std::move(buffer));
    buffer.~ManagedBuffer();  // moved from: holds nothing
    forget(buffer);
    return out;
  }

  // f(ManagedBuffer&&) for every parked buffer, which leaves the table.
  template <class F>
  void drain(F&& f) {
    for (std::size_t i = 0; i < capacity(); ++i) {
      if (!slots_[i].key) continue;
      f(std::move(slots_[i].buffer()));
      slots_[i].buffer().~ManagedBuffer();
      slots_[i].key = nullptr;
      --count_;
    }
  }

 private:
  static constexpr std::size_t kFirstCapacity = 64;

  struct Slot {
    const void* key = nullptr;
    alignas(ManagedBuffer) std::byte storage[sizeof(ManagedBuffer)];
    inline ManagedBuffer& buffer() noexcept {
      return *std::launder(reinterpret_cast<ManagedBuffer*>(storage));
    }
  };

  inline std::size_t capacity() const noexcept { return slots_ ? mask_ + 1 : 0; }
  inline std::size_t home(const void* ptr) const noexcept {
    const auto address = reinterpret_cast<std::uintptr_t>(ptr);
    return static_cast<std::size_t>(((address >> 8) * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  inline Slot& slot_of(ManagedBuffer& buffer) noexcept {
    return *reinterpret_cast<Slot*>(reinterpret_cast<std::byte*>(&buffer) - offsetof(Slot, storage));
  }

  // Backward-shift deletion: moves later entries of the probe run into the hole at `hole`, so
  // that every entry stays reachable from its home without tombstones.
  [[gnu::noinline]] void close_gap(std::size_t hole) noexcept {
    for (std::size_t i = (hole + 1) & mask_; slots_[i].key; i = (i + 1) & mask_) {
      const std::size_t wanted = home(slots_[i].key);
      // The entry at i may move to the hole if the hole lies on its probe path (home .. i).
      const bool on_path = ((i - wanted) & mask_) >= ((i - hole) & mask_);
      if (!on_path) continue;
      slots_[hole].key = slots_[i].key;
      ::new (slots_[hole].storage) ManagedBuffer(std::move(slots_[i].buffer()));
      slots_[i].buffer().~ManagedBuffer();
      slots_[i].key = nullptr;
      hole = i;
    }
  }

  [[gnu::noinline]] bool grow() noexcept {
    const std::size_t capacity = slots_ ? 2 * (mask_ + 1) : kFirstCapacity;
    std::unique_ptr<Slot[]> old(new (std::nothrow) Slot[capacity]);
    if (!old) return false;
    std::swap(old, slots_);
    const std::size_t old_capacity = old ? mask_ + 1 : 0;
    mask_ = capacity - 1;
    shift_ = 64 - std::countr_zero(capacity);
    for (std::size_t i = 0; i < old_capacity; ++i) {
      if (!old[i].key) continue;
      std::size_t j = home(old[i].key);
      while (slots_[j].key) j = (j + 1) & mask_;
      slots_[j].key = old[i].key;
      ::new (slots_[j].storage) ManagedBuffer(std::move(old[i].buffer()));
      old[i].buffer().~ManagedBuffer();
    }
    return true;
  }

  std::unique_ptr<Slot[]> slots_;
  std::size_t mask_ = 0;
  int shift_ = 64;
  std::size_t count_ = 0;
};

}  // namespace gpupool
