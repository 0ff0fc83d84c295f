// The devices and borrowed streams of the C ABI, by the ints and void* C callers hold.
// A CUDA device is its ordinal, opened at first use; simulated devices are opened explicitly
// (gpupool_device_open) and keep their ids. Streams a framework made are borrowed once per
// (device, handle) and thread: checking a foreign stream costs a driver call, an allocation
// must not pay it every time. Include after `import gpupool;`.
#pragma once
#include <fmt/format.h>

#include <cstddef>
#include <expected>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <utility>
#include <vector>

namespace gpupool::interop {

// The device the calling thread found last (DeviceRegistry::find_cached): one thread_local, one
// TLS lookup per call.
struct LastFoundDevice {
  int id = -1;
  const Device* device = nullptr;
};
inline constinit thread_local LastFoundDevice last_found_device;

class DeviceRegistry {
 public:
  static DeviceRegistry& instance() {
    static DeviceRegistry registry;  // never destroyed before the last C call: leaked on purpose
    return registry;
  }

  Result<Device> open(std::string_view spec) {
    auto device = spec.empty() ? Device::from_environment() : Device::from_string(spec);
    if (!device) return device;
    std::unique_lock lock(mutex_);
    devices_.emplace(device->id(), *device);
    return device;
  }

  // The device `id`, as a pointer into the registry (entries are never removed, so it stays
  // valid): the allocation path's lookup, one comparison when a thread keeps using one device.
  // The device `id` if it is the one this thread found last, else null: find_cached's test alone.
  [[gnu::always_inline]] static const Device* last_found(int id) noexcept {
    return last_found_device.device && id == last_found_device.id ? last_found_device.device
                                                                  : nullptr;
  }
  [[gnu::always_inline]] Result<const Device*> find_cached(int id) {
    if (const Device* device = last_found(id)) [[likely]] return device;
    return find_and_remember(id);
  }

  Result<Device> find(int id) {
    {
      std::shared_lock lock(mutex_);
      if (auto it = devices_.find(id); it != devices_.end()) return it->second;
    }
    if (id < 0 || id >= kFirstSimulatedId)
      return make_error(ErrorKind::InvalidInput,
                        fmt::format("device {} is not open: expected a CUDA ordinal, or an id "
                                    "gpupool_device_open returned", id));
    auto device = Device::cuda(id);
    if (!device) return device;
    std::unique_lock lock(mutex_);
    devices_.emplace(id, *device);
    return device;
  }

  // The stream `native` of `device` (nullptr: its default stream) as a gpupool Stream.
  Result<Stream> stream(const Device& device, void* native) {
    if (!native) return device.default_stream();
    thread_local std::vector<std::pair<std::pair<int, void*>, Stream>> borrowed;
    const std::pair key{device.id(), native};
    for (auto& [known, stream] : borrowed)
      if (known == key) return stream;
    {
      std::shared_lock lock(mutex_);
      if (auto it = owned_streams_.find(key); it != owned_streams_.end()) return it->second;
    }
    auto stream = device.borrow_stream(native);
    if (!stream) return stream;
    // A thread meets few streams; forget the oldest past a few dozen (a framework's stream
    // pool cycles through 32 per device).
    if (borrowed.size() == kBorrowedPerThread) borrowed.erase(borrowed.begin());
    borrowed.emplace_back(key, *stream);
    return stream;
  }

  // Streams gpupool makes for C callers: kept here until destroyed.
  Result<void*> create_stream(const Device& device) {
    auto stream = device.create_stream();
    if (!stream) return std::unexpected(stream.error());
    std::unique_lock lock(mutex_);
    owned_streams_.emplace(std::pair{device.id(), stream->native()}, *stream);
    return stream->native();
  }
  Result<void> destroy_stream(const Device& device, void* native) {
    std::unique_lock lock(mutex_);
    if (owned_streams_.erase({device.id(), native}) == 0)
      return make_error(ErrorKind::InvalidInput,
                        fmt::format("stream {} was not made by gpupool_stream_create for device {}",
                                    native, device.id()));
    return {};
  }

 private:
  [[gnu::noinline]] Result<const Device*> find_and_remember(int id) {
    auto device = find(id);
    if (!device) return std::unexpected(device.error());
    std::shared_lock lock(mutex_);
    last_found_device.device = &devices_.at(id);
    last_found_device.id = id;
    return last_found_device.device;
  }

  static constexpr int kFirstSimulatedId = 100;  // Device::id(): CUDA ordinals below
  static constexpr std::size_t kBorrowedPerThread = 64;
  std::shared_mutex mutex_;
  std::map<int, Device> devices_;
  std::map<std::pair<int, void*>, Stream> owned_streams_;
};

}  // namespace gpupool::interop
