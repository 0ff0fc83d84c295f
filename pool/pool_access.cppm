// PoolAccess: how the diagnostics (profiler, report, tracing) reach a GpuMemoryPool's state
// without widening the pool's public API. GpuMemoryPool names it its friend.
module;
#include <memory>
module gpupool:pool_access;
import :device;
import :pool;
import :device_pool;
import :pool_state;

namespace gpupool {

struct PoolAccess {
  static PoolState& state(const GpuMemoryPool& pool) noexcept { return *pool.state_; }
  static PoolPolicies& policies(const GpuMemoryPool& pool) noexcept { return *pool.state_->policies; }
  // The device's sub-pool, or nullptr when the pool never used the device.
  static DevicePool* find(const GpuMemoryPool& pool, const Device& device) noexcept {
    return pool.state_->find(device);
  }
};

}  // namespace gpupool
