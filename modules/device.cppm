// gpupool:device — one device interface, two real backends.
//
//   Device::cuda(n)            a CUDA GPU (only when the library was built with the CUDA toolkit)
//   Device::simulated(config)  host memory under a set capacity, with in-order streams, events and
//                              fault injection: how CI and machines without a GPU run the library,
//                              and how tests provoke out-of-memory deterministically
//   Device::from_string(spec)  "cuda:0", "sim", "sim:2GiB"; Device::from_environment() reads
//                              GPUPOOL_DEVICE the same way (tools use it)
//
// A Device is a cheap handle: copies refer to the same device. Memory is raw and untyped here;
// gpupool:pool caches it and gpupool:buffer hands it out as typed, owned buffers.
module;
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
export module gpupool:device;
import :error;

export namespace gpupool {

enum class DeviceKind : std::uint8_t { Cuda, Simulated };

struct MemoryInfo {
  std::size_t free = 0;   // bytes the device can still hand out (not counting gpupool's cache)
  std::size_t total = 0;  // the device's capacity
};

struct DeviceProperties {
  std::string name;
  DeviceKind kind = DeviceKind::Simulated;
  int ordinal = 0;                 // CUDA ordinal; for simulated devices their creation number
  std::size_t total_memory = 0;
  int multiprocessor_count = 0;    // simulated: the host threads its kernels may use
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
};

struct SimulatedDeviceConfig {
  std::size_t capacity = std::size_t{1} << 30;  // bytes of "device" memory
  std::string name = "gpupool simulated device";
  // false: work put on a stream runs at once, in order (the simple default).
  // true: work waits on its stream until something synchronizes with it (stream or event
  //       synchronize, an event query does not), so tests can see work that is still pending.
  bool deferred_streams = false;
  int worker_threads = 0;  // threads the CPU kernels use; 0 = the cores the process may run on
  // false: each allocation is a block of the host's heap, so sanitizers see any access past its
  //        end (the default: tests of kernels want that).
  // true: allocations are carved from one host range reserved when the device is made, which
  //       costs no system call and no sanitizer bookkeeping — for work that never touches the
  //       bytes past their end, such as fuzzing the pool. Same capacity, accounting and checks.
  bool reserved_memory = false;
  // The page of virtual memory (Device::page_bytes): what a virtual segment maps and unmaps at a
  // time. A multiple of 4 KiB; 2 MiB, as on current NVIDIA GPUs.
  std::size_t page_bytes = std::size_t{2} << 20;
};

// Faults a simulated device injects into its own allocations, from inject_faults() until the
// next call replaces them.
struct FaultInjection {
  // One allocation fails, counted from the call (1 = the next, 2 = the one after); the ones after
  // it succeed again.
  std::optional<std::uint64_t> fail_nth_allocation;
  std::optional<std::size_t> fail_above_bytes;  // every allocation larger than this fails
};

enum class CopyKind : std::uint8_t { HostToDevice, DeviceToHost, DeviceToDevice };

// A page of physical device memory, made by Device::create_page (a CUmemGenericAllocationHandle
// on CUDA): mapped at an address reserved by Device::reserve_addresses, it is device memory.
struct PhysicalPage {
  std::uint64_t handle = 0;
};

}  // namespace gpupool

namespace gpupool {

// The backend interface both kinds of device implement (gpu/cuda_device.cpp,
// gpu/simulated_device.cpp). Streams and events are opaque handles owned by the backend;
// nullptr is the default stream.
class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  virtual const DeviceProperties& properties() const = 0;
  virtual Result<MemoryInfo> memory_info() = 0;
  virtual Result<void*> allocate(std::size_t bytes) = 0;
  virtual Result<void> deallocate(void* ptr) = 0;
  virtual Result<void*> allocate_pinned(std::size_t bytes) = 0;
  virtual Result<void> deallocate_pinned(void* ptr) = 0;
  virtual Result<void*> create_stream() = 0;
  virtual void destroy_stream(void* stream) noexcept = 0;
  // A stream made elsewhere (by the application or a framework) that the caller wants used as is:
  // InvalidInput unless it is a live stream of this device.
  virtual Result<void> check_foreign_stream(void* stream) = 0;
  virtual Result<void> synchronize_stream(void* stream) = 0;
  virtual Result<void> synchronize() = 0;
  virtual Result<void*> create_event() = 0;
  virtual void destroy_event(void* event) noexcept = 0;
  virtual Result<void> record_event(void* event, void* stream) = 0;
  virtual Result<bool> event_completed(void* event) = 0;
  virtual Result<void> synchronize_event(void* event) = 0;
  virtual Result<void> stream_wait_event(void* stream, void* event) = 0;
  virtual Result<void> copy(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                            void* stream) = 0;
  virtual Result<void> fill(void* dst, std::uint8_t value, std::size_t bytes, void* stream) = 0;
  // Runs host code in stream order (the simulated device's kernels run this way).
  virtual Result<void> enqueue_host_work(void* stream, std::function<void()> work) = 0;
  // Virtual memory: an address range reserved without memory behind it, physical pages made on
  // their own and mapped into it (and unmapped and released) one page at a time. page_bytes() is
  // the page; every address and size below is a multiple of it.
  virtual std::size_t page_bytes() const noexcept = 0;
  virtual Result<void*> reserve_addresses(std::size_t bytes) = 0;
  virtual void release_addresses(void* base, std::size_t bytes) noexcept = 0;
  virtual Result<PhysicalPage> create_page() = 0;  // counts against the device's memory
  virtual void release_page(PhysicalPage page) noexcept = 0;
  // Maps pages.size() pages at `address`, the first at `address`, the next one page on, and makes
  // them readable and writable by the device; all or none.
  virtual Result<void> map_pages(void* address, std::span<const PhysicalPage> pages) = 0;
  // Unmaps `count` pages from `address`; the work that used them must be complete.
  virtual Result<void> unmap_pages(void* address, std::size_t count) = 0;
  // Peer access between devices of one kind (CUDA GPUs; simulated devices). A device always
  // reaches its own memory. enable_peer_access lets this device's work read and write `peer`'s
  // ordinary allocations; pages mapped into reserved ranges are reached only by the devices
  // granted them (grant_access), as with CUDA's virtual memory.
  virtual bool can_access_peer(const DeviceBackend& peer) const = 0;
  virtual Result<void> enable_peer_access(const DeviceBackend& peer) = 0;
  virtual bool peer_access_enabled(const DeviceBackend& peer) const = 0;
  // Lets `accessor` read and write this device's mapped pages [address, address + bytes).
  virtual Result<void> grant_access(void* address, std::size_t bytes,
                                    const DeviceBackend& accessor) = 0;
  // Whether `accessor`'s work may read and write `address`, memory of this device; InvalidInput
  // when the address is not.
  virtual Result<bool> accessible_from(const void* address, const DeviceBackend& accessor) = 0;
  // Simulated devices only; others answer Unsupported.
  virtual Result<void> set_capacity(std::size_t bytes) = 0;
  virtual Result<void> set_faults(FaultInjection faults) = 0;
};

// Backend factories (gpu/simulated_device.cpp; gpu/cuda_device.cpp or, in a build without the CUDA
// toolkit, gpu/cuda_absent.cpp).
std::shared_ptr<DeviceBackend> make_simulated_backend(SimulatedDeviceConfig config, int id);
Result<std::shared_ptr<DeviceBackend>> make_cuda_backend(int ordinal);
int cuda_backend_device_count() noexcept;
// CUDA builds only (gpu/cuda_device.cpp): the one mapping of a cudaError_t to a GpuError.
// Out-of-memory by status code, device problems as DeviceUnavailable, invalid values as
// InvalidInput, the rest as Cuda; the status is kept as NativeStatus{Cuda, status} and its name
// ends the message ("<what>: cudaErrorMemoryAllocation (out of memory)").
GpuError cuda_status_error(int status, std::string_view what, int device);

}  // namespace gpupool

export namespace gpupool {

class Device;

// An in-order queue of work on one device. Copies share it; the last copy destroys the queue.
class Stream {
 public:
  Stream() = default;  // the default stream of no device; Device::default_stream() gives a real one
  inline int device_id() const noexcept { return device_id_; }
  inline bool is_default() const noexcept { return handle_ == nullptr || handle_->native == nullptr; }
  // Blocks until all work put on this stream so far has finished.
  Result<void> synchronize() const;
  // The backend's handle (cudaStream_t on CUDA); nullptr for the default stream.
  inline void* native() const noexcept { return handle_ ? handle_->native : nullptr; }
  friend bool operator==(const Stream& a, const Stream& b) noexcept {
    return a.device_id_ == b.device_id_ && a.native() == b.native();
  }

 private:
  friend class Device;
  friend class Event;
  struct Handle {  // owns the backend stream: never copied, so it is destroyed exactly once
    Handle(std::shared_ptr<DeviceBackend> b, void* n, bool o = true)
        : backend(std::move(b)), native(n), owned(o) {}
    Handle(const Handle&) = delete;
    Handle& operator=(const Handle&) = delete;
    ~Handle() { if (native && owned) backend->destroy_stream(native); }
    std::shared_ptr<DeviceBackend> backend;
    void* native = nullptr;
    bool owned = true;  // false: a borrowed stream, which its maker destroys
  };
  std::shared_ptr<Handle> handle_;
  int device_id_ = -1;
};

// A point in a stream's work: recorded on a stream, done when everything before it is done.
class Event {
 public:
  Result<void> record(const Stream& stream);
  Result<bool> completed() const;   // never blocks
  Result<void> synchronize() const;  // blocks until completed
  // Makes future work on `stream` wait for this event (without blocking the host).
  Result<void> make_wait(const Stream& stream) const;
  int device_id() const noexcept { return device_id_; }

 private:
  friend class Device;
  struct Handle {  // owns the backend event: never copied, so it is destroyed exactly once
    Handle(std::shared_ptr<DeviceBackend> b, void* n) : backend(std::move(b)), native(n) {}
    Handle(const Handle&) = delete;
    Handle& operator=(const Handle&) = delete;
    ~Handle() { if (native) backend->destroy_event(native); }
    std::shared_ptr<DeviceBackend> backend;
    void* native = nullptr;
  };
  std::shared_ptr<Handle> handle_;
  int device_id_ = -1;
};

class Device {
 public:
  // The CUDA GPU with this ordinal. DeviceUnavailable if there is none or the library was built
  // without CUDA. Every call with the same ordinal gives the same device.
  static Result<Device> cuda(int ordinal);
  // How many CUDA GPUs there are (0 in a build without CUDA or on a machine without a GPU).
  static int cuda_device_count() noexcept;
  // A new simulated device; InvalidInput for a zero capacity.
  static Result<Device> simulated(SimulatedDeviceConfig config = {});
  // "cuda:N", "cuda" (= cuda:0), "sim", "sim:SIZE" (e.g. sim:2GiB). "auto" = cuda:0 when there is a
  // GPU, else a simulated device.
  static Result<Device> from_string(std::string_view spec);
  // GPUPOOL_DEVICE, or `fallback` when it is unset.
  static Result<Device> from_environment(std::string_view fallback = "auto");

  // Process-unique: CUDA ordinals are their own ids; simulated devices count from 100.
  inline int id() const noexcept { return id_; }
  DeviceKind kind() const noexcept { return backend_->properties().kind; }
  const DeviceProperties& properties() const noexcept { return backend_->properties(); }
  std::string describe() const;
  Result<MemoryInfo> memory_info() const { return backend_->memory_info(); }

  // Raw device memory: what gpupool:pool caches. Users want GpuMemoryPool instead.
  Result<void*> allocate(std::size_t bytes) const { return backend_->allocate(bytes); }
  Result<void> deallocate(void* ptr) const { return backend_->deallocate(ptr); }
  // Virtual memory, for the pool's virtual segments (DeviceBackend has the contract).
  std::size_t page_bytes() const noexcept { return backend_->page_bytes(); }
  Result<void*> reserve_addresses(std::size_t bytes) const { return backend_->reserve_addresses(bytes); }
  void release_addresses(void* base, std::size_t bytes) const noexcept {
    backend_->release_addresses(base, bytes);
  }
  Result<PhysicalPage> create_page() const { return backend_->create_page(); }
  void release_page(PhysicalPage page) const noexcept { backend_->release_page(page); }
  Result<void> map_pages(void* address, std::span<const PhysicalPage> pages) const {
    return backend_->map_pages(address, pages);
  }
  Result<void> unmap_pages(void* address, std::size_t count) const {
    return backend_->unmap_pages(address, count);
  }
  // Raw, for the pool's virtual segments: lets `accessor` read and write the mapped pages
  // [address, address + bytes) of this device (GpuMemoryPool::enable_peer_access does it for
  // every page the pool maps).
  Result<void> grant_access(void* address, std::size_t bytes, const Device& accessor) const {
    return backend_->grant_access(address, bytes, *accessor.backend_);
  }

  // Several devices. Whether this device's work can read and write `peer`'s memory directly —
  // CUDA: a peer-to-peer link between the two GPUs (cudaDeviceCanAccessPeer); simulated devices:
  // any other simulated device; never between a GPU and a simulated device. A device always
  // reaches its own memory.
  bool can_access_peer(const Device& peer) const { return backend_->can_access_peer(*peer.backend_); }
  // Lets this device's work read and write `peer`'s memory (cudaDeviceEnablePeerAccess): at once
  // for ordinary allocations; for a pool's virtual segments GpuMemoryPool::enable_peer_access
  // also grants the pages. Enabling again is fine. InvalidInput where can_access_peer is false.
  Result<void> enable_peer_access(const Device& peer) const {
    return backend_->enable_peer_access(*peer.backend_);
  }
  bool peer_access_enabled(const Device& peer) const {
    return backend_->peer_access_enabled(*peer.backend_);
  }
  // Whether this device's work may read and write `address`, which is memory of `owner`;
  // InvalidInput when it is not.
  Result<bool> can_access(const void* address, const Device& owner) const;

  // Page-locked host memory for fast transfers (ordinary host memory on a simulated device).
  Result<void*> allocate_pinned(std::size_t bytes) const { return backend_->allocate_pinned(bytes); }
  Result<void> deallocate_pinned(void* ptr) const { return backend_->deallocate_pinned(ptr); }

  Stream default_stream() const;
  Result<Stream> create_stream() const;
  // A stream someone else made (a cudaStream_t of PyTorch, CuPy or the application; on a
  // simulated device, the native() of one of its streams), used as is and never destroyed here:
  // its maker keeps it alive while gpupool may still order work or frees on it. nullptr is the
  // default stream. InvalidInput when it is not a live stream of this device.
  Result<Stream> borrow_stream(void* native) const;
  Result<Event> create_event() const;
  Result<void> synchronize() const { return backend_->synchronize(); }

  // Asynchronous on `stream`: host memory must stay valid until the stream reaches the copy.
  Result<void> copy(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                    const Stream& stream) const;
  Result<void> fill(void* dst, std::uint8_t value, std::size_t bytes, const Stream& stream) const;
  Result<void> enqueue_host_work(const Stream& stream, std::function<void()> work) const;

  // Simulated devices: change the capacity at run time (below what is in use is allowed: further
  // allocations fail until enough is freed) and inject faults. Unsupported on CUDA devices.
  Result<void> set_simulated_capacity(std::size_t bytes) const { return backend_->set_capacity(bytes); }
  Result<void> inject_faults(FaultInjection faults) const { return backend_->set_faults(faults); }

  friend bool operator==(const Device& a, const Device& b) noexcept { return a.id_ == b.id_; }

 private:
  Device(std::shared_ptr<DeviceBackend> backend, int id) : backend_(std::move(backend)), id_(id) {}
  Result<void> check_stream(const Stream& stream, std::string_view operation) const;
  std::shared_ptr<DeviceBackend> backend_;
  int id_ = -1;
};

}  // namespace gpupool
