// AllocationTable: the live allocations of a C ABI pool, by address. A raw pointer is all a C
// caller (PyTorch, CuPy, a cuda::mr resource) gives back, so each pointer's ManagedBuffer waits
// here until it is freed.
//
// An allocate + free pair must cost little beside the pool's own, and most frees come from the
// thread that allocated. So each thread keeps the allocations it makes in tables of its own: it
// inserts with plain stores (no other thread writes an empty slot of them) and frees its own with
// plain loads and stores, on cache lines no other thread writes. A free from another thread finds
// the address in the allocating thread's tables and claims its slot with a compare-and-swap
// first; the slot stays claimed while that thread frees or visits the buffer.
//
// A table is open addressing over atomic keys: a block's address (256-byte aligned), 0 for an
// empty slot, the address with its low bit set while another thread holds the slot. An address
// lives within kWindow slots of its hash, so a search never looks further and an emptied slot
// needs no tombstone. When an insert finds its window full it moves on to the next table, twice
// the size; older tables keep their entries until those are freed (searches look at the newest
// first).
//
// Like free(), a free must not race with another call about the same pointer (a second free, or
// record_stream on it from another thread): those calls are the caller's to order. A double free
// that comes after the first finds nothing and is refused.
// Include after `import gpupool;`.
#pragma once
#include <array>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <utility>

namespace gpupool::interop {

class AllocationTable {
 public:
  AllocationTable() : id_(next_table_id()) {}
  ~AllocationTable() {
    for (ThreadTables* tables = head_.load(std::memory_order_acquire); tables;) {
      ThreadTables* next = tables->next;
      delete tables;
      tables = next;
    }
  }
  AllocationTable(const AllocationTable&) = delete;
  AllocationTable& operator=(const AllocationTable&) = delete;

  // Keeps `buffer` under its address, in the calling thread's tables. Throws std::bad_alloc only
  // when a table cannot be made (`buffer` then returns to its pool).
  void insert(ManagedBuffer buffer) {
    const auto key = reinterpret_cast<std::uintptr_t>(buffer.raw_data());
    ThreadTables& mine = own_tables();
    for (int level = mine.newest.load(std::memory_order_relaxed);; ++level)
      if (mine.table_at(level).owner_insert(key, buffer)) return;
  }

  // Frees the buffer at `ptr` in place if `may_free(buffer)` says so (its memory goes back to
  // the pool; an address the pool hands out again meanwhile takes another slot), else leaves it.
  enum class Removal { absent, freed, kept };
  template <class MayFree>
  Removal remove_if(const void* ptr, MayFree&& may_free) {
    Removal removal = Removal::absent;
    find(ptr, [&](Table& table, std::size_t slot, std::uintptr_t key) {
      removal = Removal::kept;
      if (may_free(table.buffer(slot))) {
        table.buffer(slot).~ManagedBuffer();
        key = 0;
        removal = Removal::freed;
      }
      table.keys[slot].store(key, std::memory_order_release);
    });
    return removal;
  }

  // Runs `visit` on the buffer at `ptr` while no other thread can take it; false if there is
  // none.
  template <class Visit>
  bool with(const void* ptr, Visit&& visit) {
    return find(ptr, [&](Table& table, std::size_t slot, std::uintptr_t key) {
      struct Restore {  // the key goes back even if `visit` throws
        std::atomic<std::uintptr_t>& slot_key;
        std::uintptr_t key;
        ~Restore() { slot_key.store(key, std::memory_order_release); }
      } restore{table.keys[slot], key};
      visit(table.buffer(slot));
    });
  }

 private:
  static constexpr std::size_t kFirstCapacity = 256;
  static constexpr std::size_t kWindow = 16;
  static constexpr int kMaxTables = 40;  // capacities double: 2^47 slots at the last
  static constexpr std::uintptr_t kClaimed = 1;

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
    // By the owning thread only: no other thread writes an empty slot, so a plain store claims it.
    bool owner_insert(std::uintptr_t key, ManagedBuffer& from) {
      const std::size_t start = home(key);
      for (std::size_t i = 0; i < kWindow; ++i) {
        const std::size_t slot = (start + i) & mask;
        if (keys[slot].load(std::memory_order_acquire) != 0) continue;
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

  // The tables of the allocations one thread made. Only the owning thread inserts and makes
  // tables; any thread searches them.
  struct ThreadTables {
    explicit ThreadTables(std::thread::id owner) : owner(owner) {
      levels[0].store(new Table(kFirstCapacity), std::memory_order_relaxed);
    }
    ~ThreadTables() {
      for (auto& level : levels) delete level.load(std::memory_order_acquire);
    }
    // The owner's table at `level`, made if it is not there yet.
    Table& table_at(int level) {
      if (level >= kMaxTables) [[unlikely]] throw std::bad_alloc();
      if (Table* table = levels[level].load(std::memory_order_relaxed)) [[likely]] return *table;
      auto* made = new Table(kFirstCapacity << level);
      levels[level].store(made, std::memory_order_release);
      newest.store(level, std::memory_order_release);
      return *made;
    }
    const std::thread::id owner;  // a thread that reuses the id of one that ended takes over
    std::array<std::atomic<Table*>, kMaxTables> levels{};
    std::atomic<int> newest{0};
    ThreadTables* next = nullptr;  // the table's list, newest thread first; set before publishing
  };

  static std::uint64_t next_table_id() {
    static std::atomic<std::uint64_t> next{1};
    return next.fetch_add(1, std::memory_order_relaxed);
  }

  // The calling thread's tables in this AllocationTable, remembered in a thread_local (tables are
  // told apart by an id that is never reused, so a stale entry of a table that is gone never
  // matches); null when asked not to make them.
  struct LastTables {
    std::uint64_t table_id = 0;
    ThreadTables* tables = nullptr;
  };
  static LastTables& last_tables() noexcept {
    thread_local LastTables last;
    return last;
  }
  ThreadTables& own_tables() {
    LastTables& last = last_tables();
    if (last.table_id == id_) [[likely]] return *last.tables;
    return register_thread();
  }
  [[gnu::noinline]] ThreadTables& register_thread() {
    const std::thread::id me = std::this_thread::get_id();
    std::lock_guard lock(register_mutex_);
    ThreadTables* found = head_.load(std::memory_order_relaxed);
    while (found && found->owner != me) found = found->next;
    if (!found) {
      found = new ThreadTables(me);
      found->next = head_.load(std::memory_order_relaxed);
      head_.store(found, std::memory_order_release);
    }
    last_tables() = {id_, found};
    return *found;
  }

  // Finds `ptr`'s slot and runs `own(table, slot, key)` while this thread holds it; `own` leaves
  // the slot's key (the address, or 0 once freed). The calling thread's own tables first, with
  // plain loads; then every other thread's, newest table first, claiming the slot. False if no
  // table holds `ptr`.
  template <class Own>
  bool find(const void* ptr, Own&& own) {
    const auto key = reinterpret_cast<std::uintptr_t>(ptr);
    if (key == 0 || (key & kClaimed) != 0) return false;
    ThreadTables* mine = nullptr;
    if (LastTables& last = last_tables(); last.table_id == id_) [[likely]] {
      mine = last.tables;
      for (int level = mine->newest.load(std::memory_order_relaxed); level >= 0; --level) {
        Table& table = *mine->levels[level].load(std::memory_order_relaxed);
        const std::size_t start = table.home(key);
        for (std::size_t i = 0; i < kWindow; ++i) {
          const std::size_t slot = (start + i) & table.mask;
          if (table.keys[slot].load(std::memory_order_acquire) == key) {
            own(table, slot, key);
            return true;
          }
        }
      }
    }
    for (ThreadTables* tables = head_.load(std::memory_order_acquire); tables;
         tables = tables->next) {
      if (tables == mine) continue;
      for (int level = tables->newest.load(std::memory_order_acquire); level >= 0; --level) {
        Table& table = *tables->levels[level].load(std::memory_order_acquire);
        const std::size_t start = table.home(key);
        for (std::size_t i = 0; i < kWindow; ++i) {
          const std::size_t slot = (start + i) & table.mask;
          if (claim(table.keys[slot], key)) {
            own(table, slot, key);
            return true;
          }
        }
      }
    }
    return false;
  }

  // Marks `slot_key` claimed if it holds `key`, waiting while another thread holds it for a moment.
  static bool claim(std::atomic<std::uintptr_t>& slot_key, std::uintptr_t key) {
    std::uintptr_t seen = slot_key.load(std::memory_order_relaxed);
    for (;;) {
      if (seen == (key | kClaimed)) {
        std::this_thread::yield();
        seen = slot_key.load(std::memory_order_relaxed);
      } else if (seen != key) {
        return false;
      } else if (slot_key.compare_exchange_weak(seen, key | kClaimed, std::memory_order_acquire)) {
        return true;
      }
    }
  }

  std::atomic<ThreadTables*> head_{nullptr};
  std::mutex register_mutex_;
  const std::uint64_t id_;
};

}  // namespace gpupool::interop
