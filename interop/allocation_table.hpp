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
#include <vector>

namespace gpupool::interop {

class AllocationTable {
 public:
  void insert(ManagedBuffer buffer) {
    void* ptr = buffer.raw_data();
    Shard& shard = shard_of(ptr);
    std::lock_guard lock(shard.mutex);
    if (shard.spare_nodes.empty()) {
      shard.buffers.emplace(ptr, std::move(buffer));
      return;
    }
    Map::node_type node = std::move(shard.spare_nodes.back());
    shard.spare_nodes.pop_back();
    node.key() = ptr;
    node.mapped() = std::move(buffer);
    shard.buffers.insert(std::move(node));
  }

  // The buffer at `ptr`, out of the table; nullopt if it holds none.
  std::optional<ManagedBuffer> remove(const void* ptr) {
    Shard& shard = shard_of(ptr);
    std::lock_guard lock(shard.mutex);
    auto it = shard.buffers.find(ptr);
    if (it == shard.buffers.end()) return std::nullopt;
    Map::node_type node = shard.buffers.extract(it);
    ManagedBuffer buffer = std::move(node.mapped());
    // The node's memory serves a later insert: a pair costs no heap allocation.
    if (shard.spare_nodes.size() < kSpareNodesPerShard) shard.spare_nodes.push_back(std::move(node));
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
  static constexpr std::size_t kSpareNodesPerShard = 64;
  using Map = std::unordered_map<const void*, ManagedBuffer>;
  struct Shard {
    std::mutex mutex;
    Map buffers;
    std::vector<Map::node_type> spare_nodes;  // emptied nodes (their buffers moved out)
  };
  // Blocks are 256-byte aligned: the bits above those pick the shard.
  Shard& shard_of(const void* ptr) {
    auto address = reinterpret_cast<std::uintptr_t>(ptr);
    return shards_[((address >> 8) ^ (address >> 20)) % kShards];
  }
  std::array<Shard, kShards> shards_;
};

}  // namespace gpupool::interop
