// AllocationTable: the live allocations of a C ABI pool, by address. A raw pointer is all a C
// caller (PyTorch, CuPy, a cuda::mr resource) gives back, so each pointer's ManagedBuffer waits
// here until it is freed. Sharded by address so that threads freeing different pointers rarely
// meet on a lock. Include after `import gpupool;`.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>

namespace gpupool::interop {

class AllocationTable {
 public:
  void insert(ManagedBuffer buffer) {
    void* ptr = buffer.raw_data();
    Shard& shard = shard_of(ptr);
    std::lock_guard lock(shard.mutex);
    shard.buffers.emplace(ptr, std::move(buffer));
  }

  // The buffer at `ptr`, out of the table; nullopt if it holds none.
  std::optional<ManagedBuffer> remove(const void* ptr) {
    Shard& shard = shard_of(ptr);
    std::lock_guard lock(shard.mutex);
    auto it = shard.buffers.find(ptr);
    if (it == shard.buffers.end()) return std::nullopt;
    ManagedBuffer buffer = std::move(it->second);
    shard.buffers.erase(it);
    return buffer;
  }

  // Runs `visit` on the buffer at `ptr` under its shard's lock; false if there is none.
  bool with(const void* ptr, const std::function<void(ManagedBuffer&)>& visit) {
    Shard& shard = shard_of(ptr);
    std::lock_guard lock(shard.mutex);
    auto it = shard.buffers.find(ptr);
    if (it == shard.buffers.end()) return false;
    visit(it->second);
    return true;
  }

 private:
  static constexpr std::size_t kShards = 64;
  struct Shard {
    std::mutex mutex;
    std::unordered_map<const void*, ManagedBuffer> buffers;
  };
  // Blocks are 256-byte aligned: the bits above those pick the shard.
  Shard& shard_of(const void* ptr) {
    auto address = reinterpret_cast<std::uintptr_t>(ptr);
    return shards_[((address >> 8) ^ (address >> 20)) % kShards];
  }
  std::array<Shard, kShards> shards_;
};

}  // namespace gpupool::interop
