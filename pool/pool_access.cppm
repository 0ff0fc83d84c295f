// PoolAccess: how the diagnostics (profiler, report, tracing) reach a GpuMemoryPool's state
// without widening the pool's public API. GpuMemoryPool names it its friend.
// BufferAccess: how the kernels take a temporary from the pool a buffer came from (l2_distance's
// scratch from its output's pool). ManagedBuffer names it its friend.
module;
#include <cstddef>
#include <memory>
#include <source_location>
module gpupool:pool_access;
import :error;
import :precision;
import :device;
import :buffer;
import :pool;
import :device_pool;
import :pool_policies;
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

struct BufferAccess {
  // `bytes` from the pool of `buffer` (under its limits, counted in its stats) on `stream`.
  static Result<ManagedBuffer> temporary_beside(
      const ManagedBuffer& buffer, std::size_t bytes, const Stream& stream,
      const std::source_location& where = std::source_location::current()) {
    return buffer.pool().allocate(bytes, Precision::Bytes, stream, where);
  }
};

}  // namespace gpupool
