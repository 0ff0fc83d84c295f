// PoolState: what GpuMemoryPool handles share — the policies, the device sub-pools (made on first
// use) and the outstanding buffers of the deprecated get_buffer API.
module;
#include <array>
#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>
module gpupool:pool_state;
import :error;
import :device;
import :buffer;
import :pool;
import :device_pool;
import :pool_policies;

namespace gpupool {

class PoolState {
 public:
  static constexpr std::size_t kMaxDevices = 64;

  explicit PoolState(PoolConfig config);
  ~PoolState();  // orphans every sub-pool: their caches go back; live buffers return later

  // The device's sub-pool, made on first use. Lock-free once made.
  Result<DevicePool*> device_pool(const Device& device);
  // The sub-pool if the device was used, else nullptr.
  inline DevicePool* find(const Device& device) const noexcept {
    const std::size_t n = count_.load(std::memory_order_acquire);
    for (std::size_t i = 0; i < n; ++i)
      if (slots_[i].device_id.load(std::memory_order_relaxed) == device.id())
        return slots_[i].pool.load(std::memory_order_acquire);
    return nullptr;
  }
  // The first sub-pool `f` says true of, or null.
  template <class F>
  DevicePool* find_if(F&& f) const {
    std::size_t n = count_.load(std::memory_order_acquire);
    for (std::size_t i = 0; i < n; ++i)
      if (DevicePool* pool = slots_[i].pool.load(std::memory_order_acquire); f(*pool)) return pool;
    return nullptr;
  }
  template <class F>
  void for_each(F&& f) const {
    std::size_t n = count_.load(std::memory_order_acquire);
    for (std::size_t i = 0; i < n; ++i) f(*slots_[i].pool.load(std::memory_order_acquire));
  }

  std::shared_ptr<PoolPolicies> policies;
  std::mutex legacy_mutex;
  std::unordered_map<void*, ManagedBuffer> legacy_buffers;  // get_buffer's, by pointer

 private:
  struct Slot {
    std::atomic<int> device_id{-1};
    std::atomic<DevicePool*> pool{nullptr};
  };
  std::array<Slot, kMaxDevices> slots_;
  std::atomic<std::size_t> count_{0};
  std::mutex create_mutex_;
  std::vector<std::shared_ptr<DevicePool>> owned_;
};

}  // namespace gpupool
