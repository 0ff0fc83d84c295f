// The CUDA backend: a real GPU through the CUDA runtime (linked statically, so a machine without a
// driver still runs the program and simply has no CUDA devices).
//
// Every method first makes the backend's device current (cudaSetDevice): callers may be on any
// thread, and the current device is per thread. Streams are non-blocking streams, events are made
// without timing, and every failure is a GpuError made by cuda_status_error, which recognises
// out-of-memory by its status code and keeps the status next to the mapped kind.
//
// Virtual memory (reserved address ranges, physical pages mapped into them) is the driver's
// (cuMemCreate, cuMemMap, ...): its functions are fetched from the driver the runtime loaded
// (cudaGetDriverEntryPointByVersion), so the library still does not link libcuda; <cuda.h> gives
// their types only. Their failures are GpuErrors made by driver_status_error.
module;
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <expected>
#include <fmt/format.h>
#include <functional>
#include <memory>
#include <mutex>
#include <iterator>
#include <map>
#include <set>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <string_view>
#include <utility>
module gpupool;

namespace gpupool {

GpuError cuda_status_error(int status, std::string_view what, int device) {
  auto code = static_cast<cudaError_t>(status);
  ErrorKind kind = ErrorKind::Cuda;
  switch (code) {
    case cudaErrorMemoryAllocation: kind = ErrorKind::OutOfMemory; break;
    case cudaErrorInvalidDevice:
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver: kind = ErrorKind::DeviceUnavailable; break;
    case cudaErrorInvalidValue: kind = ErrorKind::InvalidInput; break;
    default: break;
  }
  const char* name = cudaGetErrorName(code);
  const char* description = cudaGetErrorString(code);
  return GpuError(kind,
                  fmt::format("{}: {} ({})", what, name ? name : "unknown CUDA status",
                              description ? description : "no description"),
                  device, NativeStatus{StatusSource::Cuda, status});
}

namespace {

const char* copy_kind_name(CopyKind kind) {
  switch (kind) {
    case CopyKind::HostToDevice: return "host-to-device";
    case CopyKind::DeviceToHost: return "device-to-host";
    case CopyKind::DeviceToDevice: return "device-to-device";
  }
  return "unknown";
}

// Large pinned blocks are mapped here, backed by transparent huge pages where the kernel gives
// them, touched, and only then registered with CUDA. cudaMallocHost faults and pins 4 KiB pages
// under the driver's lock: about 0.25 s for 512 MiB on an H200 host, during which every CUDA call
// of the process's other threads waits. Touching 2 MiB pages first costs a third of that, outside
// the lock, and the registration a twentieth. Smaller blocks keep cudaMallocHost.
class RegisteredHostBlocks {
 public:
  static constexpr std::size_t kHugePage = std::size_t{2} << 20;
  static constexpr std::size_t kMinBytes = kHugePage;

  // A registered block of `bytes`, or nullptr where mapping or registering failed (the caller
  // falls back to cudaMallocHost).
  void* allocate(std::size_t bytes) {
    const std::size_t length = (bytes + kHugePage - 1) / kHugePage * kHugePage + kHugePage;
    void* mapped = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) return nullptr;
    const auto address = reinterpret_cast<std::uintptr_t>(mapped);
    auto* block = reinterpret_cast<std::byte*>((address + kHugePage - 1) / kHugePage * kHugePage);
    (void)madvise(block, bytes, MADV_HUGEPAGE);  // a hint: plain pages where it is refused
    for (std::size_t at = 0; at < bytes; at += 4096) static_cast<volatile std::byte*>(block)[at] = {};
    if (cudaHostRegister(block, bytes, cudaHostRegisterPortable) != cudaSuccess) {
      cudaGetLastError();
      munmap(mapped, length);
      return nullptr;
    }
    std::lock_guard lock(mutex_);
    mappings_[block] = Mapping{mapped, length};
    return block;
  }

  // Whether `ptr` is one of these blocks; if so, unregistered and unmapped (`status`: CUDA's).
  bool release(void* ptr, cudaError_t& status) {
    Mapping mapping;
    {
      std::lock_guard lock(mutex_);
      auto found = mappings_.find(ptr);
      if (found == mappings_.end()) return false;
      mapping = found->second;
      mappings_.erase(found);
    }
    status = cudaHostUnregister(ptr);
    // Memory CUDA still holds is never unmapped under it: a failed unregistration leaks it.
    if (status == cudaSuccess) munmap(mapping.start, mapping.length);
    return true;
  }

 private:
  struct Mapping {
    void* start = nullptr;
    std::size_t length = 0;
  };
  std::mutex mutex_;
  std::unordered_map<void*, Mapping> mappings_;
};

// One for the process: a block may be freed through any device's handle.
RegisteredHostBlocks& registered_host_blocks() {
  static RegisteredHostBlocks blocks;
  return blocks;
}

cudaMemcpyKind to_cuda(CopyKind kind) {
  switch (kind) {
    case CopyKind::HostToDevice: return cudaMemcpyHostToDevice;
    case CopyKind::DeviceToHost: return cudaMemcpyDeviceToHost;
    case CopyKind::DeviceToDevice: return cudaMemcpyDeviceToDevice;
  }
  return cudaMemcpyDefault;
}

// cudaLaunchHostFunc's callback: runs the work and frees it. Host work must not throw (it runs on
// a CUDA thread with nobody to hand an exception to): noexcept turns a throw into terminate.
void CUDART_CB run_host_work(void* data) noexcept {
  std::unique_ptr<std::function<void()>> work(static_cast<std::function<void()>*>(data));
  (*work)();
}

// The CUDA driver's functions the backend uses, fetched once for the process; a member is null
// where the driver lacks the function (or there is no driver at all).
struct DriverApi {
  decltype(&::cuGetErrorName) get_error_name = nullptr;
  decltype(&::cuGetErrorString) get_error_string = nullptr;
  decltype(&::cuDeviceGet) device_get = nullptr;
  decltype(&::cuDeviceGetAttribute) device_get_attribute = nullptr;
  decltype(&::cuMemGetAllocationGranularity) mem_get_allocation_granularity = nullptr;
  decltype(&::cuMemAddressReserve) mem_address_reserve = nullptr;
  decltype(&::cuMemAddressFree) mem_address_free = nullptr;
  decltype(&::cuMemCreate) mem_create = nullptr;
  decltype(&::cuMemRelease) mem_release = nullptr;
  decltype(&::cuMemMap) mem_map = nullptr;
  decltype(&::cuMemSetAccess) mem_set_access = nullptr;
  decltype(&::cuMemUnmap) mem_unmap = nullptr;
  decltype(&::cuMemGetAccess) mem_get_access = nullptr;

  // The first virtual-memory function the driver lacks, or nullptr when it has them all.
  const char* missing_virtual_memory_function() const {
    if (!device_get) return "cuDeviceGet";
    if (!device_get_attribute) return "cuDeviceGetAttribute";
    if (!mem_get_allocation_granularity) return "cuMemGetAllocationGranularity";
    if (!mem_address_reserve) return "cuMemAddressReserve";
    if (!mem_address_free) return "cuMemAddressFree";
    if (!mem_create) return "cuMemCreate";
    if (!mem_release) return "cuMemRelease";
    if (!mem_map) return "cuMemMap";
    if (!mem_set_access) return "cuMemSetAccess";
    if (!mem_unmap) return "cuMemUnmap";
    return nullptr;
  }
};

// The ABI of each function as of CUDA 12.0, the oldest driver the library supports.
template <class Function>
void fetch_driver_function(Function& function, const char* symbol) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(symbol, &address, 12000, cudaEnableDefault, &found) ==
          cudaSuccess &&
      found == cudaDriverEntryPointSuccess && address)
    function = reinterpret_cast<Function>(address);
  else
    cudaGetLastError();
}

const DriverApi& driver_api() {
  static const DriverApi api = [] {
    DriverApi fetched;
    fetch_driver_function(fetched.get_error_name, "cuGetErrorName");
    fetch_driver_function(fetched.get_error_string, "cuGetErrorString");
    fetch_driver_function(fetched.device_get, "cuDeviceGet");
    fetch_driver_function(fetched.device_get_attribute, "cuDeviceGetAttribute");
    fetch_driver_function(fetched.mem_get_allocation_granularity, "cuMemGetAllocationGranularity");
    fetch_driver_function(fetched.mem_address_reserve, "cuMemAddressReserve");
    fetch_driver_function(fetched.mem_address_free, "cuMemAddressFree");
    fetch_driver_function(fetched.mem_create, "cuMemCreate");
    fetch_driver_function(fetched.mem_release, "cuMemRelease");
    fetch_driver_function(fetched.mem_map, "cuMemMap");
    fetch_driver_function(fetched.mem_set_access, "cuMemSetAccess");
    fetch_driver_function(fetched.mem_unmap, "cuMemUnmap");
    fetch_driver_function(fetched.mem_get_access, "cuMemGetAccess");
    return fetched;
  }();
  return api;
}

// cuda_status_error for the driver: out-of-memory by its status code (the pool's out-of-memory
// ladder relies on it), device problems as DeviceUnavailable, invalid values as InvalidInput, the
// rest as Cuda; the CUresult is kept as NativeStatus{CudaDriver, status} and its name ends the
// message ("<what>: CUDA_ERROR_OUT_OF_MEMORY (out of memory)").
GpuError driver_status_error(CUresult status, std::string_view what, int device) {
  ErrorKind kind = ErrorKind::Cuda;
  switch (status) {
    case CUDA_ERROR_OUT_OF_MEMORY: kind = ErrorKind::OutOfMemory; break;
    case CUDA_ERROR_INVALID_DEVICE:
    case CUDA_ERROR_NO_DEVICE: kind = ErrorKind::DeviceUnavailable; break;
    case CUDA_ERROR_INVALID_VALUE: kind = ErrorKind::InvalidInput; break;
    default: break;
  }
  const DriverApi& driver = driver_api();
  const char* name = nullptr;
  const char* description = nullptr;
  if (driver.get_error_name && driver.get_error_name(status, &name) != CUDA_SUCCESS) name = nullptr;
  if (driver.get_error_string && driver.get_error_string(status, &description) != CUDA_SUCCESS)
    description = nullptr;
  return GpuError(kind,
                  fmt::format("{}: {} ({})", what,
                              name ? std::string(name)
                                   : fmt::format("unknown CUDA driver status {}", static_cast<int>(status)),
                              description ? description : "no description"),
                  device, NativeStatus{StatusSource::CudaDriver, static_cast<int>(status)});
}

CUdeviceptr device_address(const void* address) {
  return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(address));
}

class CudaBackend final : public DeviceBackend {
 public:
  CudaBackend(int ordinal, DeviceProperties properties)
      : ordinal_(ordinal), properties_(std::move(properties)) {}

  const DeviceProperties& properties() const override { return properties_; }

  Result<MemoryInfo> memory_info() override {
    if (auto ok = make_current(); !ok) return std::unexpected(ok.error());
    std::size_t free = 0, total = 0;
    if (cudaError_t status = cudaMemGetInfo(&free, &total); status != cudaSuccess)
      return failure(status, "cudaMemGetInfo failed");
    return MemoryInfo{free, total};
  }

  Result<void*> allocate(std::size_t bytes) override {
    if (bytes == 0)
      return invalid("cannot allocate 0 bytes of device memory: expected a size of at least 1");
    if (auto ok = make_current(); !ok) return std::unexpected(ok.error());
    void* ptr = nullptr;
    cudaError_t status = cudaMalloc(&ptr, bytes);
    if (status == cudaSuccess) return ptr;
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // out-of-memory is not sticky: clear it before asking for the numbers
      std::size_t free = 0, total = 0;
      std::string numbers =
          cudaMemGetInfo(&free, &total) == cudaSuccess
              ? fmt::format("free {} of {}", format_bytes(free), format_bytes(total))
              : fmt::format("free unknown of {}", format_bytes(properties_.total_memory));
      cudaGetLastError();
      return failure(status, fmt::format("cudaMalloc could not provide the memory: requested {}, {}",
                                         format_bytes(bytes), numbers));
    }
    return failure(status, fmt::format("cudaMalloc of {} failed", format_bytes(bytes)));
  }

  Result<void> deallocate(void* ptr) override {
    if (!ptr)
      return invalid(fmt::format("cannot free a null pointer on cuda:{}: expected a pointer that "
                                 "allocate() returned", ordinal_));
    if (auto ok = make_current(); !ok) return ok;
    if (cudaError_t status = cudaFree(ptr); status != cudaSuccess)
      return failure(status, fmt::format("cudaFree({}) failed: expected a live allocation of "
                                         "cuda:{} (foreign or already freed?)", ptr, ordinal_));
    return {};
  }

  Result<void*> allocate_pinned(std::size_t bytes) override {
    if (bytes == 0)
      return invalid("cannot allocate 0 bytes of pinned host memory: expected a size of at least 1");
    if (auto ok = make_current(); !ok) return std::unexpected(ok.error());
    if (bytes >= RegisteredHostBlocks::kMinBytes)
      if (void* registered = registered_host_blocks().allocate(bytes)) return registered;
    void* ptr = nullptr;
    if (cudaError_t status = cudaMallocHost(&ptr, bytes); status != cudaSuccess)
      return failure(status, fmt::format("cudaMallocHost could not provide {} of pinned host memory",
                                         format_bytes(bytes)));
    return ptr;
  }

  Result<void> deallocate_pinned(void* ptr) override {
    if (!ptr)
      return invalid("cannot free a null pinned pointer: expected a pointer that "
                     "allocate_pinned() returned");
    if (auto ok = make_current(); !ok) return ok;
    cudaError_t status = cudaSuccess;
    if (!registered_host_blocks().release(ptr, status)) status = cudaFreeHost(ptr);
    if (status != cudaSuccess)
      return failure(status, fmt::format("freeing pinned host memory {} failed: expected a live "
                                         "pinned allocation (foreign or already freed?)", ptr));
    return {};
  }

  Result<void*> create_stream() override {
    if (auto ok = make_current(); !ok) return std::unexpected(ok.error());
    cudaStream_t stream = nullptr;
    if (cudaError_t status = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        status != cudaSuccess)
      return failure(status, "cudaStreamCreateWithFlags(cudaStreamNonBlocking) failed");
    return static_cast<void*>(stream);
  }

  void destroy_stream(void* stream) noexcept override {
    // Like the simulated device: work already queued still runs (cudaStreamDestroy defers).
    if (make_current()) cudaStreamDestroy(native_stream(stream));
    cudaGetLastError();
  }

  Result<void> check_foreign_stream(void* stream) override {
    int device = -1;
    if (cudaError_t status = cudaStreamGetDevice(native_stream(stream), &device); status != cudaSuccess) {
      cudaGetLastError();
      return invalid(fmt::format("stream {} is not a live CUDA stream ({}): expected a "
                                 "cudaStream_t of cuda:{}", stream, cudaGetErrorString(status), ordinal_));
    }
    if (device != ordinal_)
      return invalid(fmt::format("stream {} belongs to cuda:{}, not cuda:{}: expected a stream of "
                                 "the device it allocates on", stream, device, ordinal_));
    return {};
  }

  Result<void> synchronize_stream(void* stream) override {
    if (auto ok = make_current(); !ok) return ok;
    if (cudaError_t status = cudaStreamSynchronize(native_stream(stream)); status != cudaSuccess)
      return failure(status, fmt::format("cudaStreamSynchronize({}) failed", stream));
    return {};
  }

  Result<void> synchronize() override {
    if (auto ok = make_current(); !ok) return ok;
    if (cudaError_t status = cudaDeviceSynchronize(); status != cudaSuccess)
      return failure(status, "cudaDeviceSynchronize failed");
    return {};
  }

  Result<void*> create_event() override {
    if (auto ok = make_current(); !ok) return std::unexpected(ok.error());
    cudaEvent_t event = nullptr;
    if (cudaError_t status = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
        status != cudaSuccess)
      return failure(status, "cudaEventCreateWithFlags(cudaEventDisableTiming) failed");
    return static_cast<void*>(event);
  }

  void destroy_event(void* event) noexcept override {
    if (make_current()) cudaEventDestroy(native_event(event));
    cudaGetLastError();
  }

  Result<void> record_event(void* event, void* stream) override {
    if (auto ok = make_current(); !ok) return ok;
    if (cudaError_t status = cudaEventRecord(native_event(event), native_stream(stream));
        status != cudaSuccess)
      return failure(status, fmt::format("cudaEventRecord(event {}, stream {}) failed", event,
                                         stream));
    return {};
  }

  Result<bool> event_completed(void* event) override {
    if (auto ok = make_current(); !ok) return std::unexpected(ok.error());
    cudaError_t status = cudaEventQuery(native_event(event));
    if (status == cudaSuccess) return true;
    if (status == cudaErrorNotReady) {
      // "Not yet" is an answer, not an error: leave no trace of it in the thread's last error.
      if (cudaPeekAtLastError() == cudaErrorNotReady) cudaGetLastError();
      return false;
    }
    return failure(status, fmt::format("cudaEventQuery({}) failed", event));
  }

  Result<void> synchronize_event(void* event) override {
    if (auto ok = make_current(); !ok) return ok;
    if (cudaError_t status = cudaEventSynchronize(native_event(event)); status != cudaSuccess)
      return failure(status, fmt::format("cudaEventSynchronize({}) failed", event));
    return {};
  }

  Result<void> stream_wait_event(void* stream, void* event) override {
    if (auto ok = make_current(); !ok) return ok;
    if (cudaError_t status = cudaStreamWaitEvent(native_stream(stream), native_event(event), 0);
        status != cudaSuccess)
      return failure(status, fmt::format("cudaStreamWaitEvent(stream {}, event {}) failed", stream,
                                         event));
    return {};
  }

  Result<void> copy(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                    void* stream) override {
    if (auto ok = make_current(); !ok) return ok;
    if (cudaError_t status =
            cudaMemcpyAsync(dst, src, bytes, to_cuda(kind), native_stream(stream));
        status != cudaSuccess)
      return failure(status, fmt::format("cudaMemcpyAsync {} of {} from {} to {} on stream {} "
                                         "failed: expected {} pointers with that many bytes",
                                         copy_kind_name(kind), format_bytes(bytes), src, dst,
                                         stream, copy_kind_name(kind)));
    return {};
  }

  Result<void> fill(void* dst, std::uint8_t value, std::size_t bytes, void* stream) override {
    if (auto ok = make_current(); !ok) return ok;
    if (cudaError_t status = cudaMemsetAsync(dst, value, bytes, native_stream(stream));
        status != cudaSuccess)
      return failure(status, fmt::format("cudaMemsetAsync of {} at {} to {:#04x} on stream {} "
                                         "failed: expected device memory with that many bytes",
                                         format_bytes(bytes), dst, value, stream));
    return {};
  }

  Result<void> enqueue_host_work(void* stream, std::function<void()> work) override {
    if (!work)
      return invalid("enqueue_host_work was given an empty function: expected work to run");
    if (auto ok = make_current(); !ok) return ok;
    auto owned = std::make_unique<std::function<void()>>(std::move(work));
    if (cudaError_t status = cudaLaunchHostFunc(native_stream(stream), run_host_work, owned.get());
        status != cudaSuccess)
      return failure(status, fmt::format("cudaLaunchHostFunc on stream {} failed", stream));
    owned.release();  // run_host_work frees it once it has run
    return {};
  }

  // ---- virtual memory: the driver's reserved ranges and physical pages. The page is the minimum
  // granularity of a pinned allocation on this device, found on first use (after make_current,
  // like every call here); 0 where the device or driver has no virtual memory management.

  std::size_t page_bytes() const noexcept override { return virtual_memory().page_bytes; }

  Result<void*> reserve_addresses(std::size_t bytes) override {
    if (auto ok = make_current(); !ok) return std::unexpected(ok.error());
    if (auto ok = require_virtual_memory("reserve_addresses"); !ok) return std::unexpected(ok.error());
    const std::size_t page = virtual_memory().page_bytes;
    if (bytes == 0 || bytes % page != 0)
      return invalid(fmt::format("cannot reserve {} ({} bytes) of addresses on cuda:{}: expected a "
                                 "positive multiple of the page, {}",
                                 format_bytes(bytes), bytes, ordinal_, format_bytes(page)));
    CUdeviceptr base = 0;
    if (CUresult status = driver_api().mem_address_reserve(&base, bytes, page, 0, 0);
        status != CUDA_SUCCESS)
      return driver_failure(status, fmt::format("cuMemAddressReserve of {} on cuda:{} failed",
                                                format_bytes(bytes), ordinal_));
    {
      std::lock_guard lock(reserved_mutex_);
      reserved_.emplace(static_cast<std::uintptr_t>(base), bytes);
    }
    return reinterpret_cast<void*>(static_cast<std::uintptr_t>(base));
  }

  void release_addresses(void* base, std::size_t bytes) noexcept override {
    if (!base || !make_current() || virtual_memory().page_bytes == 0) return;
    {
      std::lock_guard lock(reserved_mutex_);
      reserved_.erase(reinterpret_cast<std::uintptr_t>(base));
    }
    (void)driver_api().mem_address_free(device_address(base), bytes);
  }

  Result<PhysicalPage> create_page() override {
    if (auto ok = make_current(); !ok) return std::unexpected(ok.error());
    if (auto ok = require_virtual_memory("create_page"); !ok) return std::unexpected(ok.error());
    const std::size_t page = virtual_memory().page_bytes;
    CUmemAllocationProp prop = device_allocation();
    CUmemGenericAllocationHandle handle = 0;
    CUresult status = driver_api().mem_create(&handle, page, &prop, 0);
    if (status == CUDA_SUCCESS) return PhysicalPage{static_cast<std::uint64_t>(handle)};
    if (status == CUDA_ERROR_OUT_OF_MEMORY) {
      std::size_t free = 0, total = 0;
      std::string numbers =
          cudaMemGetInfo(&free, &total) == cudaSuccess
              ? fmt::format("free {} of {}", format_bytes(free), format_bytes(total))
              : fmt::format("free unknown of {}", format_bytes(properties_.total_memory));
      cudaGetLastError();
      return driver_failure(status, fmt::format("cuMemCreate could not provide a page: requested "
                                                "{}, {}", format_bytes(page), numbers));
    }
    return driver_failure(status, fmt::format("cuMemCreate of a {} page on cuda:{} failed",
                                              format_bytes(page), ordinal_));
  }

  void release_page(PhysicalPage page) noexcept override {
    if (!make_current() || virtual_memory().page_bytes == 0) return;
    (void)driver_api().mem_release(static_cast<CUmemGenericAllocationHandle>(page.handle));
  }

  Result<void> map_pages(void* address, std::span<const PhysicalPage> pages) override {
    if (auto ok = make_current(); !ok) return ok;
    if (auto ok = require_virtual_memory("map_pages"); !ok) return ok;
    if (auto ok = check_pages(address, pages.size(), "map"); !ok) return ok;
    const DriverApi& driver = driver_api();
    const std::size_t page = virtual_memory().page_bytes;
    const CUdeviceptr base = device_address(address);
    // Each page its own mapping; a failure unmaps the ones before it (all or none).
    for (std::size_t i = 0; i < pages.size(); ++i) {
      const auto handle = static_cast<CUmemGenericAllocationHandle>(pages[i].handle);
      if (CUresult status = driver.mem_map(base + i * page, page, 0, handle, 0);
          status != CUDA_SUCCESS) {
        unmap_quietly(base, i);
        return driver_failure(
            status, fmt::format("cuMemMap of page {} of {} (physical page {:#x}) at {} on cuda:{} "
                                "failed (none of them is mapped): expected a live page of this "
                                "device and a reserved, unmapped range",
                                i, pages.size(), pages[i].handle,
                                static_cast<const void*>(static_cast<std::byte*>(address) + i * page),
                                ordinal_));
      }
    }
    // One access change for the whole range: this device reads and writes it.
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = ordinal_;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (CUresult status = driver.mem_set_access(base, pages.size() * page, &access, 1);
        status != CUDA_SUCCESS) {
      unmap_quietly(base, pages.size());
      return driver_failure(status,
                            fmt::format("cuMemSetAccess (read/write for cuda:{}) of {} pages at {} "
                                        "failed (they are unmapped again)",
                                        ordinal_, pages.size(), address));
    }
    return {};
  }

  Result<void> unmap_pages(void* address, std::size_t count) override {
    if (auto ok = make_current(); !ok) return ok;
    if (auto ok = require_virtual_memory("unmap_pages"); !ok) return ok;
    if (auto ok = check_pages(address, count, "unmap"); !ok) return ok;
    const DriverApi& driver = driver_api();
    const std::size_t page = virtual_memory().page_bytes;
    const CUdeviceptr base = device_address(address);
    // One cuMemUnmap per page (each page is its own mapping). A page that will not unmap does not
    // keep the others mapped: the first failure is reported once all were tried.
    std::optional<std::pair<std::size_t, CUresult>> first_failure;
    std::size_t failures = 0;
    for (std::size_t i = 0; i < count; ++i)
      if (CUresult status = driver.mem_unmap(base + i * page, page); status != CUDA_SUCCESS) {
        if (!first_failure) first_failure = std::pair{i, status};
        ++failures;
      }
    if (first_failure)
      return driver_failure(
          first_failure->second,
          fmt::format("cuMemUnmap of page {} of {} at {} on cuda:{} failed ({} of the {} pages "
                      "failed, the others are unmapped): expected pages mapped by map_pages",
                      first_failure->first, count,
                      static_cast<const void*>(static_cast<std::byte*>(address) +
                                               first_failure->first * page),
                      ordinal_, failures, count));
    return {};
  }

  // ---- peers

  bool can_access_peer(const DeviceBackend& peer) const override {
    if (peer.properties().kind != DeviceKind::Cuda) return false;
    const int other = peer.properties().ordinal;
    if (other == ordinal_) return true;
    int can = 0;
    if (cudaDeviceCanAccessPeer(&can, ordinal_, other) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return can != 0;
  }

  Result<void> enable_peer_access(const DeviceBackend& peer) override {
    if (!can_access_peer(peer))
      return invalid(fmt::format("cuda:{} cannot reach the memory of '{}': {}", ordinal_,
                                 peer.properties().name,
                                 peer.properties().kind == DeviceKind::Cuda
                                     ? "the two GPUs have no peer-to-peer link"
                                     : "peer access is between CUDA GPUs only"));
    const int other = peer.properties().ordinal;
    if (other == ordinal_) return {};
    if (auto ok = make_current(); !ok) return ok;
    if (auto ok = enable_in_process(other); !ok) return ok;
    std::lock_guard lock(peers_mutex_);
    enabled_peers_.insert(other);
    return {};
  }

  bool peer_access_enabled(const DeviceBackend& peer) const override {
    if (peer.properties().kind != DeviceKind::Cuda) return false;
    if (peer.properties().ordinal == ordinal_) return true;
    std::lock_guard lock(peers_mutex_);
    return enabled_peers_.contains(peer.properties().ordinal);
  }

  Result<void> grant_access(void* address, std::size_t bytes,
                            const DeviceBackend& accessor) override {
    if (!can_access_peer(accessor))
      return invalid(fmt::format("cannot let '{}' reach pages of cuda:{}: it is not a GPU with a "
                                 "peer-to-peer link to it", accessor.properties().name, ordinal_));
    if (auto ok = make_current(); !ok) return ok;
    if (auto ok = require_virtual_memory("grant_access"); !ok) return ok;
    const std::size_t page = virtual_memory().page_bytes;
    if (bytes == 0 || bytes % page != 0)
      return invalid(fmt::format("cannot grant access to {} at {} on cuda:{}: expected a positive "
                                 "multiple of the page, {}", format_bytes(bytes), address,
                                 ordinal_, format_bytes(page)));
    if (auto ok = check_pages(address, bytes / page, "grant access to"); !ok) return ok;
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = accessor.properties().ordinal;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (CUresult status = driver_api().mem_set_access(device_address(address), bytes, &access, 1);
        status != CUDA_SUCCESS)
      return driver_failure(status, fmt::format("cuMemSetAccess (read/write for cuda:{}) of {} "
                                                "at {} on cuda:{} failed", access.location.id,
                                                format_bytes(bytes), address, ordinal_));
    return {};
  }

  Result<bool> accessible_from(const void* address, const DeviceBackend& accessor) override {
    if (auto ok = make_current(); !ok) return std::unexpected(ok.error());
    cudaPointerAttributes attributes{};
    if (cudaError_t status = cudaPointerGetAttributes(&attributes, address);
        status != cudaSuccess || attributes.type != cudaMemoryTypeDevice ||
        attributes.device != ordinal_) {
      cudaGetLastError();
      return invalid(fmt::format("{} is not memory of cuda:{}", address, ordinal_));
    }
    if (accessor.properties().kind != DeviceKind::Cuda) return false;
    const int who = accessor.properties().ordinal;
    if (who == ordinal_) return true;  // map_pages gives this device access to every mapping
    // Pages mapped into a range this device reserved answer for themselves (cuMemGetAccess); an
    // ordinary allocation follows the devices' peer access.
    const DriverApi& driver = driver_api();
    if (driver.mem_get_access && in_reserved_range(address)) {
      unsigned long long flags = 0;
      CUmemLocation location{};
      location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      location.id = who;
      if (CUresult status = driver.mem_get_access(&flags, &location, device_address(address));
          status != CUDA_SUCCESS)
        return driver_failure(status, fmt::format("cuMemGetAccess of {} for cuda:{} failed",
                                                  address, who));
      return flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    }
    return accessor.peer_access_enabled(*this);
  }

  Result<void> set_capacity(std::size_t bytes) override {
    return unsupported(fmt::format("set_simulated_capacity({})", format_bytes(bytes)));
  }

  Result<void> set_faults(FaultInjection) override { return unsupported("inject_faults"); }

 private:
  Result<void> make_current() const {
    if (cudaError_t status = cudaSetDevice(ordinal_); status != cudaSuccess)
      return failure(status, fmt::format("cudaSetDevice({}) failed", ordinal_));
    return {};
  }

  // Clears the thread's last error (non-sticky ones: out-of-memory, invalid values) so later
  // checks such as a kernel launch's cudaGetLastError() see only their own failures.
  std::unexpected<GpuError> failure(cudaError_t status, std::string_view what) const {
    cudaGetLastError();
    return std::unexpected(cuda_status_error(status, what, ordinal_));
  }

  std::unexpected<GpuError> invalid(std::string message) const {
    return std::unexpected(GpuError(ErrorKind::InvalidInput, std::move(message), ordinal_));
  }

  std::unexpected<GpuError> unsupported(std::string_view operation) const {
    return std::unexpected(GpuError(
        ErrorKind::Unsupported,
        fmt::format("{} exists only on simulated devices: cuda:{} ('{}') is a real GPU (use "
                    "Device::simulated() or GPUPOOL_DEVICE=sim:SIZE to test with it)",
                    operation, ordinal_, properties_.name),
        ordinal_));
  }

  // What the device offers for virtual memory: the page, or 0 and why there is none.
  struct VirtualMemory {
    std::size_t page_bytes = 0;
    std::string unsupported_reason;
  };

  // Found once, on first use (by whichever thread comes first, after making the device current).
  const VirtualMemory& virtual_memory() const {
    std::call_once(virtual_memory_once_, [this] { virtual_memory_ = probe_virtual_memory(); });
    return virtual_memory_;
  }

  VirtualMemory probe_virtual_memory() const {
    if (auto ok = make_current(); !ok) return {0, ok.error().message()};
    const DriverApi& driver = driver_api();
    if (const char* missing = driver.missing_virtual_memory_function())
      return {0, fmt::format("the CUDA driver has no {}", missing)};
    CUdevice device = 0;
    if (CUresult status = driver.device_get(&device, ordinal_); status != CUDA_SUCCESS)
      return {0, driver_status_error(status, fmt::format("cuDeviceGet({}) failed", ordinal_),
                                     ordinal_).message()};
    int supported = 0;
    if (CUresult status = driver.device_get_attribute(
            &supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device);
        status != CUDA_SUCCESS)
      return {0, driver_status_error(status, "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_"
                                             "SUPPORTED) failed", ordinal_).message()};
    if (!supported) return {0, "the device does not support virtual memory management"};
    CUmemAllocationProp prop = device_allocation();
    std::size_t granularity = 0;
    if (CUresult status = driver.mem_get_allocation_granularity(&granularity, &prop,
                                                                CU_MEM_ALLOC_GRANULARITY_MINIMUM);
        status != CUDA_SUCCESS)
      return {0, driver_status_error(status, "cuMemGetAllocationGranularity failed", ordinal_)
                     .message()};
    if (granularity == 0) return {0, "cuMemGetAllocationGranularity gave a page of 0 bytes"};
    return {granularity, {}};
  }

  Result<void> require_virtual_memory(std::string_view operation) const {
    const VirtualMemory& vm = virtual_memory();
    if (vm.page_bytes != 0) return {};
    return std::unexpected(GpuError(
        ErrorKind::Unsupported,
        fmt::format("{}: cuda:{} ('{}') has no virtual memory here ({}), so page_bytes() is 0",
                    operation, ordinal_, properties_.name, vm.unsupported_reason),
        ordinal_));
  }

  // A pinned allocation in this device's memory: what a page is.
  CUmemAllocationProp device_allocation() const {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal_;
    return prop;
  }

  // Peer access is the process's (its primary contexts'), whichever Device object asked: a pair
  // enabled once is not asked again, so that no call fails with "already enabled" (which
  // compute-sanitizer reports as an error). Enabled by something outside gpupool, it still is.
  Result<void> enable_in_process(int other) const {
    static std::mutex mutex;
    static std::set<std::pair<int, int>> enabled;
    std::lock_guard lock(mutex);
    if (enabled.contains({ordinal_, other})) return {};
    if (cudaError_t status = cudaDeviceEnablePeerAccess(other, 0);
        status != cudaSuccess && status != cudaErrorPeerAccessAlreadyEnabled)
      return failure(status, fmt::format("cudaDeviceEnablePeerAccess(cuda:{} → cuda:{}) failed",
                                         ordinal_, other));
    cudaGetLastError();  // "already enabled" is success here
    enabled.insert({ordinal_, other});
    return {};
  }

  // Whether `address` lies in a range reserve_addresses() gave (and release_addresses has not
  // taken back).
  bool in_reserved_range(const void* address) const {
    const auto at = reinterpret_cast<std::uintptr_t>(address);
    std::lock_guard lock(reserved_mutex_);
    auto next = reserved_.upper_bound(at);
    if (next == reserved_.begin()) return false;
    const auto& [base, bytes] = *std::prev(next);
    return at - base < bytes;
  }

  // `count` pages from `address`: at least one, at a page boundary, not past the address space.
  Result<void> check_pages(void* address, std::size_t count, std::string_view what) const {
    const std::size_t page = virtual_memory().page_bytes;
    const auto at = reinterpret_cast<std::uintptr_t>(address);
    if (!address || at % page != 0)
      return invalid(fmt::format("cannot {} pages at {} on cuda:{}: expected an address at a page "
                                 "boundary ({}) of a range reserve_addresses() gave",
                                 what, address, ordinal_, format_bytes(page)));
    if (count == 0)
      return invalid(fmt::format("cannot {} 0 pages at {} on cuda:{}: expected at least one page",
                                 what, address, ordinal_));
    if (count > (UINTPTR_MAX - at) / page)
      return invalid(fmt::format("cannot {} {} pages at {} on cuda:{}: they run past the end of "
                                 "the address space", what, count, address, ordinal_));
    return {};
  }

  // Undoes the first `count` mappings from `base` after a failure (their own failures ignored).
  void unmap_quietly(CUdeviceptr base, std::size_t count) const {
    const std::size_t page = virtual_memory().page_bytes;
    for (std::size_t i = 0; i < count; ++i) (void)driver_api().mem_unmap(base + i * page, page);
  }

  // Driver calls leave the runtime's last error alone: nothing to clear here.
  std::unexpected<GpuError> driver_failure(CUresult status, std::string_view what) const {
    return std::unexpected(driver_status_error(status, what, ordinal_));
  }

  static cudaStream_t native_stream(void* stream) { return static_cast<cudaStream_t>(stream); }
  static cudaEvent_t native_event(void* event) { return static_cast<cudaEvent_t>(event); }

  int ordinal_;
  DeviceProperties properties_;
  mutable std::mutex peers_mutex_;
  std::set<int> enabled_peers_;  // the GPUs (ordinals) this one was let reach
  mutable std::mutex reserved_mutex_;
  std::map<std::uintptr_t, std::size_t> reserved_;  // reserve_addresses' ranges: base → bytes
  mutable std::once_flag virtual_memory_once_;
  mutable VirtualMemory virtual_memory_;
};

}  // namespace

Result<std::shared_ptr<DeviceBackend>> make_cuda_backend(int ordinal) {
  int count = 0;
  constexpr std::string_view way_out =
      " (no GPU here? use a simulated device, e.g. GPUPOOL_DEVICE=sim:2GiB)";
  if (cudaError_t status = cudaGetDeviceCount(&count); status != cudaSuccess) {
    cudaGetLastError();
    // Whatever the status (no driver, no device, a driver too old or not ready), a device that
    // cannot even be counted is unavailable; the status itself is kept.
    GpuError mapped = cuda_status_error(
        status, fmt::format("cuda:{} is unavailable: cudaGetDeviceCount failed", ordinal), ordinal);
    return std::unexpected(GpuError(ErrorKind::DeviceUnavailable,
                                    mapped.message() + std::string(way_out), ordinal,
                                    mapped.native_status()));
  }
  if (ordinal < 0 || ordinal >= count)
    return make_error(ErrorKind::DeviceUnavailable,
                      count == 0 ? fmt::format("cuda:{} is unavailable: this machine has no CUDA "
                                               "device{}", ordinal, way_out)
                                 : fmt::format("cuda:{} is unavailable: this machine has {} CUDA "
                                               "device{}: expected an ordinal in 0..{}",
                                               ordinal, count, count == 1 ? "" : "s", count - 1),
                      ordinal);
  cudaDeviceProp prop{};
  if (cudaError_t status = cudaGetDeviceProperties(&prop, ordinal); status != cudaSuccess) {
    cudaGetLastError();
    return std::unexpected(cuda_status_error(
        status, fmt::format("cudaGetDeviceProperties(cuda:{}) failed", ordinal), ordinal));
  }
  DeviceProperties properties;
  properties.name = prop.name;
  properties.kind = DeviceKind::Cuda;
  properties.ordinal = ordinal;
  properties.total_memory = prop.totalGlobalMem;
  properties.multiprocessor_count = prop.multiProcessorCount;
  properties.compute_capability_major = prop.major;
  properties.compute_capability_minor = prop.minor;
  return std::make_shared<CudaBackend>(ordinal, std::move(properties));
}

int cuda_backend_device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no GPU: simply none
    return 0;
  }
  return count > 0 ? count : 0;
}

}  // namespace gpupool
