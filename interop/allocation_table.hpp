// AllocationTable: the live allocations of a C ABI pool, by address. A raw pointer is all a C
// caller (PyTorch, CuPy, a cuda::mr resource) gives back, so each pointer's ManagedBuffer waits
// here until it is freed. Sharded by address so that threads freeing different pointers rarely
// meet on a lock; the map's nodes are recycled per thread. Include after `import gpupool;`.
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
  using Map = std::unordered_map<const void*, ManagedBuffer>;

 public:
  // A buffer taken out of the table: still the caller's until it goes (its memory returns to
  // the pool when it does), in the table's own node, which goes back to serve a later insert.
  class Taken {
   public:
    explicit Taken(Map::node_type node) : node_(std::move(node)) {}
    Taken(Taken&&) = default;
    Taken& operator=(Taken&&) = delete;
    ~Taken() {
      if (node_.empty()) return;
      node_.mapped() = ManagedBuffer{};  // the buffer returns to its pool here
      keep_spare(std::move(node_));
    }
    ManagedBuffer& buffer() { return node_.mapped(); }

   private:
    Map::node_type node_;
  };

  void insert(ManagedBuffer buffer) {
    void* ptr = buffer.raw_data();
    Map::node_type node = take_spare();
    Shard& shard = shard_of(ptr);
    if (node.empty()) {
      std::lock_guard lock(shard.mutex);
      shard.buffers.emplace(ptr, std::move(buffer));
      return;
    }
    node.key() = ptr;
    node.mapped() = std::move(buffer);
    std::lock_guard lock(shard.mutex);
    shard.buffers.insert(std::move(node));
  }

  // The buffer at `ptr`, out of the table; nullopt if it holds none.
  std::optional<Taken> remove(const void* ptr) {
    Shard& shard = shard_of(ptr);
    std::lock_guard lock(shard.mutex);
    auto it = shard.buffers.find(ptr);
    if (it == shard.buffers.end()) return std::nullopt;
    return Taken(shard.buffers.extract(it));
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
  static constexpr std::size_t kSpareNodesPerThread = 64;
  struct Shard {
    std::mutex mutex;
    Map buffers;
  };

  // Emptied nodes, per thread (nodes of one map type fit every table): an allocate + free pair
  // costs no heap allocation and no extra lock.
  static std::vector<Map::node_type>& spare_nodes() {
    thread_local std::vector<Map::node_type> spare;
    return spare;
  }
  static Map::node_type take_spare() {
    auto& spare = spare_nodes();
    if (spare.empty()) return {};
    Map::node_type node = std::move(spare.back());
    spare.pop_back();
    return node;
  }
  static void keep_spare(Map::node_type node) {
    auto& spare = spare_nodes();
    if (spare.size() < kSpareNodesPerThread) spare.push_back(std::move(node));
  }

  // Blocks are 256-byte aligned: the bits above those pick the shard.
  Shard& shard_of(const void* ptr) {
    auto address = reinterpret_cast<std::uintptr_t>(ptr);
    return shards_[((address >> 8) ^ (address >> 20)) % kShards];
  }
  std::array<Shard, kShards> shards_;
};

}  // namespace gpupool::interop
