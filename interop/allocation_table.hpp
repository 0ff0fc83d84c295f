// AllocationTable: the live allocations of a C ABI pool, by address. A raw pointer is all a C
// caller (PyTorch, CuPy, a cuda::mr resource) gives back, so each pointer's ManagedBuffer waits
// here until it is freed.
//
// An allocate + free pair must cost little beside the pool's own, and frees may come from any
// thread, so the table takes no lock: open addressing over an array of atomic keys, one
// compare-and-swap to claim a slot and one to give it up. A key is a block's address (256-byte
// aligned), 0 for an empty slot, and the address with its low bit set while one thread owns the
// slot's buffer (writing, taking or visiting it). An address lives within kWindow slots of its
// hash, so a search never looks further and an emptied slot needs no tombstone. When an insert
// finds its window full it moves on to the next table, twice the size; older tables keep their
// entries until those are freed (searches look at the newest first) and go with the table.
// Include after `import gpupool;`.
#pragma once
#include <array>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <thread>
#include <utility>

namespace gpupool::interop {

class AllocationTable {
 public:
  AllocationTable() { tables_[0].store(new Table(kFirstCapacity), std::memory_order_relaxed); }
  ~AllocationTable() {
    for (auto& table : tables_) delete table.load(std::memory_order_acquire);
  }
  AllocationTable(const AllocationTable&) = delete;
  AllocationTable& operator=(const AllocationTable&) = delete;

  // Keeps `buffer` under its address. Throws std::bad_alloc only when a new table cannot be
  // made (`buffer` then returns to its pool).
  void insert(ManagedBuffer buffer) {
    const auto key = reinterpret_cast<std::uintptr_t>(buffer.raw_data());
    for (int level = newest_.load(std::memory_order_acquire);; ++level) {
      Table& table = table_at(level);
      if (table.try_insert(key, buffer)) return;
    }
  }

  // Frees the buffer at `ptr` in place if `may_free(buffer)` says so (its memory goes back to
  // the pool; an address the pool hands out again meanwhile takes another slot), else leaves it.
  enum class Removal { absent, freed, kept };
  template <class MayFree>
  Removal remove_if(const void* ptr, MayFree&& may_free) {
    Removal removal = Removal::absent;
    find_and_own(ptr, [&](Table& table, std::size_t slot) {
      std::uintptr_t left = reinterpret_cast<std::uintptr_t>(ptr);
      removal = Removal::kept;
      if (may_free(table.buffer(slot))) {
        table.buffer(slot).~ManagedBuffer();
        left = 0;
        removal = Removal::freed;
      }
      table.keys[slot].store(left, std::memory_order_release);
    });
    return removal;
  }

  // Runs `visit` on the buffer at `ptr` while no other thread can take it; false if there is
  // none.
  template <class Visit>
  bool with(const void* ptr, Visit&& visit) {
    return find_and_own(ptr, [&](Table& table, std::size_t slot) {
      struct Restore {  // the key goes back even if `visit` throws
        std::atomic<std::uintptr_t>& key;
        const void* ptr;
        ~Restore() { key.store(reinterpret_cast<std::uintptr_t>(ptr), std::memory_order_release); }
      } restore{table.keys[slot], ptr};
      visit(table.buffer(slot));
    });
  }

 private:
  static constexpr std::size_t kFirstCapacity = 1024;
  static constexpr std::size_t kWindow = 16;
  static constexpr int kMaxTables = 40;  // capacities double: 2^49 slots at the last
  static constexpr std::uintptr_t kOwned = 1;

  struct Table {
    explicit Table(std::size_t capacity)
        : shift(64 - std::countr_zero(capacity)),
          mask(capacity - 1),
          keys(new std::atomic<std::uintptr_t>[capacity]()),
          slots(new Slot[capacity]) {}
    ~Table() {
      for (std::size_t i = 0; i <= mask; ++i)
        if (keys[i].load(std::memory_order_acquire) != 0) buffer(i).~ManagedBuffer();
    }

    std::size_t home(std::uintptr_t key) const {
      return static_cast<std::size_t>(((key >> 8) * 0x9E3779B97F4A7C15ull) >> shift);
    }
    ManagedBuffer& buffer(std::size_t slot) {
      return *std::launder(reinterpret_cast<ManagedBuffer*>(slots[slot].bytes));
    }
    bool try_insert(std::uintptr_t key, ManagedBuffer& from) {
      const std::size_t start = home(key);
      for (std::size_t i = 0; i < kWindow; ++i) {
        const std::size_t slot = (start + i) & mask;
        std::uintptr_t empty = 0;
        if (keys[slot].load(std::memory_order_relaxed) != 0 ||
            !keys[slot].compare_exchange_strong(empty, key | kOwned, std::memory_order_acquire))
          continue;
        ::new (slots[slot].bytes) ManagedBuffer(std::move(from));
        keys[slot].store(key, std::memory_order_release);
        return true;
      }
      return false;
    }

    struct Slot {
      alignas(ManagedBuffer) std::byte bytes[sizeof(ManagedBuffer)];
    };
    const int shift;
    const std::size_t mask;
    std::unique_ptr<std::atomic<std::uintptr_t>[]> keys;
    std::unique_ptr<Slot[]> slots;
  };

  // The table at `level`, made if no thread has made it yet.
  Table& table_at(int level) {
    if (level < kMaxTables) [[likely]]
      if (Table* table = tables_[level].load(std::memory_order_acquire)) [[likely]] return *table;
    return make_table(level);
  }
  [[gnu::noinline]] Table& make_table(int level) {
    if (level >= kMaxTables) throw std::bad_alloc();
    Table* table = tables_[level].load(std::memory_order_acquire);
    if (table) return *table;
    auto made = std::make_unique<Table>(kFirstCapacity << level);
    if (tables_[level].compare_exchange_strong(table, made.get(), std::memory_order_acq_rel))
      table = made.release();
    int newest = newest_.load(std::memory_order_relaxed);
    while (newest < level &&
           !newest_.compare_exchange_weak(newest, level, std::memory_order_release)) {
    }
    return *table;
  }

  // Finds `ptr`'s slot, newest table first, and runs `own(table, slot)` once this thread holds
  // it (its key marked owned; `own` sets the key it leaves). False if no table holds `ptr`.
  template <class Own>
  bool find_and_own(const void* ptr, Own&& own) {
    const auto key = reinterpret_cast<std::uintptr_t>(ptr);
    if (key == 0 || (key & kOwned) != 0) return false;
    for (int level = newest_.load(std::memory_order_acquire); level >= 0; --level) {
      Table& table = *tables_[level].load(std::memory_order_acquire);
      const std::size_t start = table.home(key);
      for (std::size_t i = 0; i < kWindow; ++i) {
        const std::size_t slot = (start + i) & table.mask;
        if (claim(table.keys[slot], key)) {
          own(table, slot);
          return true;
        }
      }
    }
    return false;
  }

  // Marks `slot_key` owned if it holds `key`, waiting while another thread owns it for a moment.
  static bool claim(std::atomic<std::uintptr_t>& slot_key, std::uintptr_t key) {
    std::uintptr_t seen = slot_key.load(std::memory_order_relaxed);
    for (;;) {
      if (seen == (key | kOwned)) {
        std::this_thread::yield();
        seen = slot_key.load(std::memory_order_relaxed);
      } else if (seen != key) {
        return false;
      } else if (slot_key.compare_exchange_weak(seen, key | kOwned, std::memory_order_acquire)) {
        return true;
      }
    }
  }

  std::array<std::atomic<Table*>, kMaxTables> tables_{};
  std::atomic<int> newest_{0};
};

}  // namespace gpupool::interop
