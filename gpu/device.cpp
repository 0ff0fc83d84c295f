// Device, Stream and Event: the handles over a DeviceBackend, and choosing a device by name.
module;
#include <array>
#include <atomic>
#include <charconv>
#include <cstdlib>
#include <expected>
#include <fmt/format.h>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
module gpupool;

namespace gpupool {

namespace {
constexpr int kMaxCudaDevices = 64;
constexpr int kFirstSimulatedId = 100;
std::atomic<int> next_simulated_id{kFirstSimulatedId};

Result<void> require_handle(const void* handle, std::string_view what) {
  if (handle) return {};
  return make_error(ErrorKind::InvalidState,
                    fmt::format("{} is empty: create it with Device::create_{}() first", what,
                                what == "stream" ? "stream" : "event"));
}
}  // namespace

Result<void> Stream::synchronize() const {
  if (auto ok = require_handle(handle_.get(), "stream"); !ok) return ok;
  return handle_->backend->synchronize_stream(handle_->native);
}

Result<void> Event::record(const Stream& stream) {
  if (auto ok = require_handle(handle_.get(), "event"); !ok) return ok;
  if (stream.device_id() != device_id_)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("cannot record an event of device {} on a stream of device {}",
                                  device_id_, stream.device_id()), device_id_);
  return handle_->backend->record_event(handle_->native, stream.native());
}

Result<bool> Event::completed() const {
  if (auto ok = require_handle(handle_.get(), "event"); !ok) return std::unexpected(ok.error());
  return handle_->backend->event_completed(handle_->native);
}

Result<void> Event::synchronize() const {
  if (auto ok = require_handle(handle_.get(), "event"); !ok) return ok;
  return handle_->backend->synchronize_event(handle_->native);
}

Result<void> Event::make_wait(const Stream& stream) const {
  if (auto ok = require_handle(handle_.get(), "event"); !ok) return ok;
  if (stream.device_id() != device_id_)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("a stream of device {} cannot wait for an event of device {}",
                                  stream.device_id(), device_id_), device_id_);
  return handle_->backend->stream_wait_event(stream.native(), handle_->native);
}

Result<Device> Device::cuda(int ordinal) {
  if (ordinal < 0 || ordinal >= kMaxCudaDevices)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("CUDA ordinal {} is out of range: expected 0..{}", ordinal,
                                  kMaxCudaDevices - 1));
  // One backend per ordinal for the whole process, so the same GPU is always the same Device.
  static std::mutex mutex;
  static std::array<std::shared_ptr<DeviceBackend>, kMaxCudaDevices> backends;
  std::lock_guard lock(mutex);
  if (!backends[ordinal]) {
    auto backend = make_cuda_backend(ordinal);
    if (!backend) return std::unexpected(backend.error());
    backends[ordinal] = std::move(*backend);
  }
  return Device(backends[ordinal], ordinal);
}

int Device::cuda_device_count() noexcept { return cuda_backend_device_count(); }

Result<Device> Device::simulated(SimulatedDeviceConfig config) {
  if (config.capacity == 0)
    return make_error(ErrorKind::InvalidInput,
                      "simulated device capacity is 0 bytes: expected at least 1 byte, e.g. 1 GiB");
  if (config.worker_threads < 0)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("simulated device worker_threads is {}: expected 0 (all cores) "
                                  "or a positive count", config.worker_threads));
  if (config.page_bytes == 0 || config.page_bytes % 4096 != 0)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("simulated device page_bytes is {}: expected a positive multiple "
                                  "of 4 KiB, e.g. 2 MiB", config.page_bytes));
  int id = next_simulated_id.fetch_add(1);
  return Device(make_simulated_backend(std::move(config), id), id);
}

Result<Device> Device::from_string(std::string_view spec) {
  auto invalid = [&] {
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("device '{}' is not understood: expected cuda, cuda:N, sim, "
                                  "sim:SIZE (e.g. sim:2GiB) or auto", spec));
  };
  if (spec == "auto") return cuda_device_count() > 0 ? cuda(0) : simulated();
  if (spec == "sim" || spec == "simulated") return simulated();
  if (spec == "cuda") return cuda(0);
  if (spec.starts_with("cuda:")) {
    std::string_view digits = spec.substr(5);
    int ordinal = 0;
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), ordinal);
    if (ec != std::errc{} || end != digits.data() + digits.size()) return invalid();
    return cuda(ordinal);
  }
  if (spec.starts_with("sim:")) {
    auto size = parse_byte_size(spec.substr(4));
    if (!size || !size->bytes) return invalid();
    return simulated({.capacity = *size->bytes});
  }
  return invalid();
}

Result<Device> Device::from_environment(std::string_view fallback) {
  const char* spec = std::getenv("GPUPOOL_DEVICE");
  auto device = from_string(spec && *spec ? std::string_view(spec) : fallback);
  if (!device && spec) return std::unexpected(device.error().with_context("GPUPOOL_DEVICE"));
  return device;
}

std::string Device::describe() const {
  const DeviceProperties& p = properties();
  if (p.kind == DeviceKind::Simulated)
    return fmt::format("sim #{} '{}': {} of simulated memory", id_, p.name,
                       format_bytes(p.total_memory));
  return fmt::format("cuda:{} '{}': {}, {} SMs, compute capability {}.{}", p.ordinal, p.name,
                     format_bytes(p.total_memory), p.multiprocessor_count,
                     p.compute_capability_major, p.compute_capability_minor);
}

Stream Device::default_stream() const {
  Stream stream;
  stream.handle_ = std::make_shared<Stream::Handle>(backend_, nullptr);
  stream.device_id_ = id_;
  return stream;
}

Result<Stream> Device::create_stream() const {
  auto native = backend_->create_stream();
  if (!native) return std::unexpected(native.error());
  Stream stream;
  stream.handle_ = std::make_shared<Stream::Handle>(backend_, *native);
  stream.device_id_ = id_;
  return stream;
}

Result<Stream> Device::borrow_stream(void* native) const {
  if (!native) return default_stream();
  if (auto ok = backend_->check_foreign_stream(native); !ok) return std::unexpected(ok.error());
  Stream stream;
  stream.handle_ = std::make_shared<Stream::Handle>(backend_, native, /*owned=*/false);
  stream.device_id_ = id_;
  return stream;
}

Result<Event> Device::create_event() const {
  auto native = backend_->create_event();
  if (!native) return std::unexpected(native.error());
  Event event;
  event.handle_ = std::make_shared<Event::Handle>(backend_, *native);
  event.device_id_ = id_;
  return event;
}

Result<void> Device::check_stream(const Stream& stream, std::string_view operation) const {
  if (stream.device_id() == id_ || stream.device_id() == -1) return {};
  return make_error(ErrorKind::InvalidInput,
                    fmt::format("{} on device {} was given a stream of device {}: expected a "
                                "stream of the same device", operation, id_, stream.device_id()),
                    id_);
}

Result<void> Device::copy(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                          const Stream& stream) const {
  if (auto ok = check_stream(stream, "copy"); !ok) return ok;
  if (bytes == 0) return {};
  if (!dst || !src)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("copy of {} was given a null {} pointer", format_bytes(bytes),
                                  dst ? "source" : "destination"), id_);
  return backend_->copy(dst, src, bytes, kind, stream.native());
}

Result<void> Device::fill(void* dst, std::uint8_t value, std::size_t bytes,
                          const Stream& stream) const {
  if (auto ok = check_stream(stream, "fill"); !ok) return ok;
  if (bytes == 0) return {};
  if (!dst) return make_error(ErrorKind::InvalidInput, "fill was given a null pointer", id_);
  return backend_->fill(dst, value, bytes, stream.native());
}

Result<bool> Device::can_access(const void* address, const Device& owner) const {
  return owner.backend_->accessible_from(address, *backend_);
}

Result<void> Device::enqueue_host_work(const Stream& stream, std::function<void()> work) const {
  if (auto ok = check_stream(stream, "enqueue_host_work"); !ok) return ok;
  return backend_->enqueue_host_work(stream.native(), std::move(work));
}

}  // namespace gpupool
