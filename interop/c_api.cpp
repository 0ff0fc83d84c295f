// The C ABI of include/gpupool/gpupool.h over GpuMemoryPool. Each entry point checks its
// arguments, runs inside `guarded` (no exception crosses into C) and leaves its error message in
// this thread's last_error.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <expected>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <utility>

#include "gpupool/gpupool.h"
import gpupool;
#include "device_registry.hpp"

using namespace gpupool;
using gpupool::interop::DeviceRegistry;

struct gpupool_pool {
  explicit gpupool_pool(PoolConfig config) : pool(std::move(config)) {}
  std::atomic<std::size_t> references{1};
  GpuMemoryPool pool;  // keeps each allocation's buffer until it is freed (allocate_pointer)
};

namespace {

// This thread's last error. The flag is trivial, so a call that succeeds after a success reads it
// with no TLS wrapper; the string (which has a destructor) is touched only around failures.
thread_local std::string last_error;
constinit thread_local bool has_last_error = false;

void set_last_error(std::string message) {
  last_error = std::move(message);
  has_last_error = true;
}

gpupool_status status_of(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::InvalidInput: return GPUPOOL_INVALID_INPUT;
    case ErrorKind::OutOfMemory: return GPUPOOL_OUT_OF_MEMORY;
    case ErrorKind::PoolLimitExceeded: return GPUPOOL_POOL_LIMIT_EXCEEDED;
    case ErrorKind::DeviceUnavailable: return GPUPOOL_DEVICE_UNAVAILABLE;
    case ErrorKind::Cuda:
    case ErrorKind::Cublas: return GPUPOOL_CUDA_ERROR;
    case ErrorKind::Unsupported: return GPUPOOL_UNSUPPORTED;
    case ErrorKind::InvalidState: return GPUPOOL_INVALID_STATE;
    case ErrorKind::Io:
    case ErrorKind::Internal: return GPUPOOL_INTERNAL_ERROR;
  }
  return GPUPOOL_INTERNAL_ERROR;
}

gpupool_status fail(const GpuError& error) {
  set_last_error(error.message());
  return status_of(error.kind());
}
gpupool_status fail(gpupool_status status, std::string message) {
  set_last_error(std::move(message));
  return status;
}
gpupool_status invalid(std::string message) { return fail(GPUPOOL_INVALID_INPUT, std::move(message)); }

[[gnu::cold, gnu::noinline]] void clear_last_error() noexcept {
  last_error.clear();
  has_last_error = false;
}

// Runs `body` (which returns a gpupool_status), clearing the last error first and turning any
// exception into a status: C callers cannot catch them.
template <class Body>
gpupool_status guarded(Body&& body) noexcept {
  try {
    if (has_last_error) [[unlikely]] clear_last_error();
    return body();
  } catch (const std::bad_alloc&) {
    return fail(GPUPOOL_OUT_OF_MEMORY, "the host ran out of memory inside gpupool");
  } catch (const std::exception& e) {
    return fail(GPUPOOL_INTERNAL_ERROR, fmt::format("gpupool: unexpected exception: {}", e.what()));
  } catch (...) {
    return fail(GPUPOOL_INTERNAL_ERROR, "gpupool: unexpected exception");
  }
}

#define GPUPOOL_REQUIRE(condition, message) \
  if (!(condition)) return invalid(message)

template <class Struct>
bool struct_size_ok(const Struct* s) {
  return s && s->struct_size >= sizeof(std::size_t);
}

// Copies `filled` into the caller's struct as far as both versions have fields.
template <class Struct>
void copy_out(Struct* out, const Struct& filled) {
  std::size_t size = std::min(out->struct_size, sizeof(Struct));
  std::memcpy(static_cast<void*>(out), &filled, size);
  out->struct_size = size;
}

Result<Device> device_of(int id) { return DeviceRegistry::instance().find(id); }

gpupool_stats to_c(const PoolStats& s) {
  gpupool_stats out{};
  out.struct_size = sizeof out;
  out.in_use_bytes = s.in_use_bytes;
  out.requested_bytes = s.requested_bytes;
  out.cached_bytes = s.cached_bytes;
  out.reserved_bytes = s.reserved_bytes;
  out.peak_in_use_bytes = s.peak_in_use_bytes;
  out.peak_reserved_bytes = s.peak_reserved_bytes;
  out.stranded_bytes = s.fragmentation.stranded_bytes;
  out.allocations = s.allocations;
  out.frees = s.frees;
  out.cache_hits = s.cache_hits;
  out.device_allocations = s.device_allocations;
  out.device_frees = s.device_frees;
  out.out_of_memory_errors = s.out_of_memory_errors;
  out.live_allocations = s.live_buffers;
  return out;
}

gpupool_status check_config(const gpupool_config& c) {
  GPUPOOL_REQUIRE(c.max_pool_size > 0, "max_pool_size is 0: expected a number of bytes, or "
                                       "GPUPOOL_NO_LIMIT for the device's memory");
  GPUPOOL_REQUIRE(std::isfinite(c.critical_pressure) && c.critical_pressure > 0 &&
                      c.critical_pressure <= 1,
                  fmt::format("critical_pressure is {}: expected a fraction in (0, 1]",
                              c.critical_pressure));
  GPUPOOL_REQUIRE(c.caching == 0 || c.caching == 1,
                  fmt::format("caching is {}: expected 0 or 1", c.caching));
  GPUPOOL_REQUIRE(c.segments >= GPUPOOL_SEGMENTS_DEVICE && c.segments <= GPUPOOL_SEGMENTS_NONE,
                  fmt::format("segments is {}: expected GPUPOOL_SEGMENTS_DEVICE, _VIRTUAL or "
                              "_NONE", c.segments));
  return GPUPOOL_OK;
}

PoolConfig to_pool_config(const gpupool_config& c) {
  PoolConfig config;
  if (c.max_pool_size != GPUPOOL_NO_LIMIT) config.max_pool_size = c.max_pool_size;
  if (c.max_cached_bytes != GPUPOOL_NO_LIMIT) config.max_cached_bytes = c.max_cached_bytes;
  config.initial_reservation = c.initial_reservation;
  config.caching = c.caching != 0;
  config.critical_pressure = c.critical_pressure;
  config.segments = c.segments != GPUPOOL_SEGMENTS_NONE;
  config.virtual_segments = c.segments == GPUPOOL_SEGMENTS_VIRTUAL;
  return config;
}

// Why allocate() refuses its arguments (out of line: the allocation path stays short).
[[gnu::cold, gnu::noinline]] gpupool_status refuse_allocation(gpupool_pool* pool, void** ptr) {
  GPUPOOL_REQUIRE(pool, "pool is NULL: expected a pool from gpupool_pool_create");
  GPUPOOL_REQUIRE(ptr, "ptr is NULL: expected where to store the allocation");
  *ptr = nullptr;
  return invalid("bytes is 0: expected at least 1");
}

// An allocation on a stream the caller made: borrowed as a gpupool Stream first.
[[gnu::noinline]] Result<void*> allocate_on(gpupool_pool* pool, const Device& device,
                                            std::size_t bytes, void* stream) {
  auto on = DeviceRegistry::instance().stream(device, stream);
  if (!on) return std::unexpected(on.error());
  return pool->pool.allocate_pointer(device, bytes, &*on);
}

[[gnu::always_inline]] inline gpupool_status allocate(gpupool_pool* pool, int device_id, std::size_t bytes, void* stream,
                        void** ptr) {
  if (!pool || !ptr || bytes == 0) [[unlikely]] return refuse_allocation(pool, ptr);
  *ptr = nullptr;
  const Device* device = DeviceRegistry::instance().last_found(device_id);
  if (!device) [[unlikely]] {
    auto found = DeviceRegistry::instance().find_cached(device_id);
    if (!found) return fail(found.error());
    device = *found;
  }
  // No stream: the device's default stream, the pool's own (no Stream handle to make).
  Result<void*> allocated = stream ? allocate_on(pool, *device, bytes, stream)
                                   : pool->pool.allocate_pointer(*device, bytes);
  if (!allocated) [[unlikely]] return fail(allocated.error());
  *ptr = *allocated;
  return GPUPOOL_OK;
}

// Declares `stream` (a handle of the allocation's device) a user of the live allocation `ptr`.
Result<void> record_use(gpupool_pool* pool, void* ptr, void* stream) {
  int device_id = -1;
  if (!pool->pool.with_pointer(ptr, [&](ManagedBuffer& buffer) { device_id = buffer.device_id(); }))
    return make_error(ErrorKind::InvalidState,
                      fmt::format("{} is not a live allocation of this pool", ptr));
  auto device = device_of(device_id);
  if (!device) return std::unexpected(device.error());
  auto on = DeviceRegistry::instance().stream(*device, stream);
  if (!on) return std::unexpected(on.error());
  Result<void> recorded;
  if (!pool->pool.with_pointer(ptr, [&](ManagedBuffer& buffer) { recorded = buffer.record_stream(*on); }))
    return make_error(ErrorKind::InvalidState,
                      fmt::format("{} was freed while its stream was being recorded", ptr));
  return recorded;
}

// A free that did not go through at once: on another stream, or of a pointer this pool does not
// hold.
[[gnu::noinline]] gpupool_status refuse_free(gpupool_pool* pool, void* ptr, void* stream,
                                             PointerFree outcome) {
  if (outcome == PointerFree::other_stream) {
    // Freed on another stream than its own: that stream's work queued so far must finish before
    // the block is reused. Not freed on an error: still the caller's, to free or keep.
    if (auto recorded = record_use(pool, ptr, stream); !recorded) return fail(recorded.error());
    outcome = pool->pool.free_pointer(ptr, stream);
  }
  if (outcome == PointerFree::not_found)
    return fail(GPUPOOL_INVALID_STATE,
                fmt::format("cannot free {}: it is not a live allocation of this pool (foreign, "
                            "or already freed)", ptr));
  return GPUPOOL_OK;
}

[[gnu::always_inline]] inline gpupool_status deallocate(gpupool_pool* pool, void* ptr, void* stream) {
  if (!pool) [[unlikely]] return invalid("pool is NULL: expected a pool from gpupool_pool_create");
  if (!ptr) return GPUPOOL_OK;
  PointerFree outcome = pool->pool.free_pointer(ptr, stream);
  if (outcome == PointerFree::freed) [[likely]] return GPUPOOL_OK;
  return refuse_free(pool, ptr, stream, outcome);
}

// The device a figures call is about; nullopt for GPUPOOL_ALL_DEVICES.
Result<std::optional<Device>> figures_device(int id) {
  if (id == GPUPOOL_ALL_DEVICES) return std::optional<Device>{};
  auto device = device_of(id);
  if (!device) return std::unexpected(device.error());
  return std::optional<Device>{*device};
}

// What gpupool_torch_malloc throws: a std::bad_alloc (as PyTorch's own out-of-memory error
// is one) carrying gpupool's message.
class TorchAllocationError : public std::bad_alloc {
 public:
  explicit TorchAllocationError(std::string message) : message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

// A call about one open device of `pool`: the checks every such entry point shares, then `body`
// with the device.
template <class Body>
gpupool_status on_device(gpupool_pool* pool, int id, Body&& body) {
  GPUPOOL_REQUIRE(pool, "pool is NULL: expected a pool from gpupool_pool_create");
  auto device = device_of(id);
  if (!device) return fail(device.error());
  return body(*device);
}

std::once_flag process_pool_once;
gpupool_pool* process_pool_handle = nullptr;
std::string process_pool_error;

}  // namespace

extern "C" {

const char* gpupool_last_error(void) { return has_last_error ? last_error.c_str() : ""; }

const char* gpupool_status_name(gpupool_status status) {
  switch (status) {
    case GPUPOOL_OK: return "ok";
    case GPUPOOL_INVALID_INPUT: return "invalid input";
    case GPUPOOL_OUT_OF_MEMORY: return "out of memory";
    case GPUPOOL_POOL_LIMIT_EXCEEDED: return "pool limit exceeded";
    case GPUPOOL_DEVICE_UNAVAILABLE: return "device unavailable";
    case GPUPOOL_CUDA_ERROR: return "CUDA error";
    case GPUPOOL_UNSUPPORTED: return "unsupported";
    case GPUPOOL_INVALID_STATE: return "invalid state";
    case GPUPOOL_INTERNAL_ERROR: return "internal error";
  }
  return "unknown status";
}

gpupool_status gpupool_device_open(const char* spec, int* device) {
  return guarded([&] {
    GPUPOOL_REQUIRE(device, "device is NULL: expected where to store the device's id");
    auto opened = DeviceRegistry::instance().open(spec ? spec : "");
    if (!opened) return fail(opened.error());
    *device = opened->id();
    return GPUPOOL_OK;
  });
}

gpupool_status gpupool_device_memory(int device, size_t* free_bytes, size_t* total_bytes) {
  return guarded([&] {
    GPUPOOL_REQUIRE(free_bytes && total_bytes, "free_bytes and total_bytes must not be NULL");
    auto found = device_of(device);
    if (!found) return fail(found.error());
    auto memory = found->memory_info();
    if (!memory) return fail(memory.error());
    *free_bytes = memory->free;
    *total_bytes = memory->total;
    return GPUPOOL_OK;
  });
}

gpupool_status gpupool_stream_create(int device, void** stream) {
  return guarded([&] {
    GPUPOOL_REQUIRE(stream, "stream is NULL: expected where to store the new stream");
    auto found = device_of(device);
    if (!found) return fail(found.error());
    auto made = DeviceRegistry::instance().create_stream(*found);
    if (!made) return fail(made.error());
    *stream = *made;
    return GPUPOOL_OK;
  });
}

gpupool_status gpupool_stream_destroy(int device, void* stream) {
  return guarded([&] {
    auto found = device_of(device);
    if (!found) return fail(found.error());
    if (auto ok = DeviceRegistry::instance().destroy_stream(*found, stream); !ok) return fail(ok.error());
    return GPUPOOL_OK;
  });
}

gpupool_status gpupool_stream_synchronize(int device, void* stream) {
  return guarded([&] {
    auto found = device_of(device);
    if (!found) return fail(found.error());
    auto on = DeviceRegistry::instance().stream(*found, stream);
    if (!on) return fail(on.error());
    if (auto ok = on->synchronize(); !ok) return fail(ok.error());
    return GPUPOOL_OK;
  });
}

void gpupool_config_init(gpupool_config* config) {
  if (!config) return;
  PoolConfig defaults;
  *config = gpupool_config{};
  config->struct_size = sizeof *config;
  config->max_pool_size = GPUPOOL_NO_LIMIT;
  config->max_cached_bytes = GPUPOOL_NO_LIMIT;
  config->initial_reservation = defaults.initial_reservation;
  config->caching = defaults.caching ? 1 : 0;
  config->critical_pressure = defaults.critical_pressure;
  config->segments = !defaults.segments           ? GPUPOOL_SEGMENTS_NONE
                     : defaults.virtual_segments ? GPUPOOL_SEGMENTS_VIRTUAL
                                                 : GPUPOOL_SEGMENTS_DEVICE;
}

gpupool_status gpupool_pool_create(const gpupool_config* config, gpupool_pool** pool) {
  return guarded([&] {
    GPUPOOL_REQUIRE(pool, "pool is NULL: expected where to store the new pool");
    *pool = nullptr;
    gpupool_config c;
    gpupool_config_init(&c);
    if (config) {
      GPUPOOL_REQUIRE(struct_size_ok(config) && config->struct_size <= sizeof c,
                      fmt::format("config->struct_size is {}: expected sizeof(gpupool_config) "
                                  "({}); call gpupool_config_init first",
                                  config->struct_size, sizeof c));
      std::memcpy(static_cast<void*>(&c), config, config->struct_size);
    }
    if (gpupool_status s = check_config(c); s != GPUPOOL_OK) return s;
    *pool = new gpupool_pool(to_pool_config(c));
    return GPUPOOL_OK;
  });
}

gpupool_status gpupool_pool_create_from_environment(gpupool_pool** pool) {
  return guarded([&] {
    GPUPOOL_REQUIRE(pool, "pool is NULL: expected where to store the new pool");
    *pool = nullptr;
    auto config = PoolConfig::from_environment();
    if (!config) return fail(config.error());
    *pool = new gpupool_pool(std::move(*config));
    return GPUPOOL_OK;
  });
}

gpupool_pool* gpupool_pool_retain(gpupool_pool* pool) {
  if (pool) pool->references.fetch_add(1, std::memory_order_relaxed);
  return pool;
}

void gpupool_pool_release(gpupool_pool* pool) {
  if (pool && pool->references.fetch_sub(1, std::memory_order_acq_rel) == 1) delete pool;
}

gpupool_status gpupool_allocate(gpupool_pool* pool, int device, size_t bytes, void* stream,
                                void** ptr) {
  return guarded([&] { return allocate(pool, device, bytes, stream, ptr); });
}

gpupool_status gpupool_allocate_aligned(gpupool_pool* pool, int device, size_t bytes,
                                        size_t alignment, void* stream, void** ptr) {
  return guarded([&] {
    if (ptr) *ptr = nullptr;
    GPUPOOL_REQUIRE(alignment > 0 && (alignment & (alignment - 1)) == 0,
                    fmt::format("alignment {} is not a power of two", alignment));
    if (alignment > GPUPOOL_ALIGNMENT)
      return fail(GPUPOOL_UNSUPPORTED,
                  fmt::format("alignment {} is above what gpupool guarantees ({} bytes): "
                              "allocate {} more bytes and align inside the block", alignment,
                              GPUPOOL_ALIGNMENT, alignment - GPUPOOL_ALIGNMENT));
    return allocate(pool, device, bytes, stream, ptr);
  });
}

gpupool_status gpupool_deallocate(gpupool_pool* pool, void* ptr, void* stream) {
  return guarded([&] { return deallocate(pool, ptr, stream); });
}

gpupool_status gpupool_record_stream(gpupool_pool* pool, void* ptr, void* stream) {
  return guarded([&] {
    GPUPOOL_REQUIRE(pool, "pool is NULL: expected a pool from gpupool_pool_create");
    GPUPOOL_REQUIRE(ptr, "ptr is NULL: expected a live allocation of this pool");
    if (auto recorded = record_use(pool, ptr, stream); !recorded) return fail(recorded.error());
    return GPUPOOL_OK;
  });
}

gpupool_status gpupool_allocation_info(gpupool_pool* pool, const void* ptr, size_t* bytes,
                                       int* device) {
  return guarded([&] {
    GPUPOOL_REQUIRE(pool && ptr && bytes && device, "pool, ptr, bytes and device must not be NULL");
    bool found = pool->pool.with_pointer(ptr, [&](ManagedBuffer& buffer) {
      *bytes = buffer.size_bytes();
      *device = buffer.device_id();
    });
    if (!found)
      return fail(GPUPOOL_INVALID_STATE,
                  fmt::format("{} is not a live allocation of this pool", ptr));
    return GPUPOOL_OK;
  });
}

gpupool_status gpupool_get_stats(gpupool_pool* pool, int device, gpupool_stats* stats) {
  return guarded([&] {
    GPUPOOL_REQUIRE(pool, "pool is NULL: expected a pool from gpupool_pool_create");
    GPUPOOL_REQUIRE(struct_size_ok(stats),
                    "stats is NULL or its struct_size is unset: expected sizeof(gpupool_stats)");
    auto which = figures_device(device);
    if (!which) return fail(which.error());
    copy_out(stats, to_c(*which ? pool->pool.stats(**which) : pool->pool.total_stats()));
    return GPUPOOL_OK;
  });
}

gpupool_status gpupool_reset_peaks(gpupool_pool* pool, int device) {
  return guarded([&] {
    return on_device(pool, device, [&](const Device& found) {
      pool->pool.reset_peaks(found);
      return GPUPOOL_OK;
    });
  });
}

gpupool_status gpupool_report_json(gpupool_pool* pool, int device, char* buffer, size_t capacity,
                                   size_t* needed) {
  return guarded([&] {
    GPUPOOL_REQUIRE(needed, "needed is NULL: expected where to store the report's size");
    return on_device(pool, device, [&](const Device& found) {
      auto report = memory_report(pool->pool, found);
      if (!report) return fail(report.error());
      std::string json = to_json(*report);
      *needed = json.size() + 1;
      if (capacity == 0) return GPUPOOL_OK;
      GPUPOOL_REQUIRE(buffer && capacity >= *needed,
                      fmt::format("the report takes {} bytes, the buffer has {}", *needed, capacity));
      std::memcpy(buffer, json.c_str(), *needed);
      return GPUPOOL_OK;
    });
  });
}

gpupool_status gpupool_trim(gpupool_pool* pool, int device, size_t keep_bytes, size_t* released) {
  return guarded([&] {
    return on_device(pool, device, [&](const Device& found) {
      std::size_t bytes = pool->pool.trim(found, keep_bytes);
      if (released) *released = bytes;
      return GPUPOOL_OK;
    });
  });
}

gpupool_status gpupool_cleanup(gpupool_pool* pool, int device, size_t* released) {
  return guarded([&] {
    GPUPOOL_REQUIRE(pool, "pool is NULL: expected a pool from gpupool_pool_create");
    auto which = figures_device(device);
    if (!which) return fail(which.error());
    std::size_t bytes = *which ? pool->pool.emergency_cleanup(**which) : pool->pool.emergency_cleanup_all();
    if (released) *released = bytes;
    return GPUPOOL_OK;
  });
}

gpupool_status gpupool_set_limit(gpupool_pool* pool, int device, size_t bytes) {
  return guarded([&] {
    return on_device(pool, device, [&](const Device& found) {
      if (bytes == GPUPOOL_NO_LIMIT) bytes = found.properties().total_memory;
      if (auto ok = pool->pool.set_max_pool_size(found, bytes); !ok) return fail(ok.error());
      return GPUPOOL_OK;
    });
  });
}

gpupool_status gpupool_get_limit(gpupool_pool* pool, int device, size_t* bytes) {
  return guarded([&] {
    GPUPOOL_REQUIRE(bytes, "bytes is NULL: expected where to store the limit");
    return on_device(pool, device, [&](const Device& found) {
      *bytes = pool->pool.max_pool_size(found).value_or(GPUPOOL_NO_LIMIT);
      return GPUPOOL_OK;
    });
  });
}

gpupool_status gpupool_set_cache_limit(gpupool_pool* pool, int device, size_t bytes) {
  return guarded([&] {
    return on_device(pool, device, [&](const Device& found) {
      std::optional<std::size_t> cap;
      if (bytes != GPUPOOL_NO_LIMIT) cap = bytes;
      if (auto ok = pool->pool.set_max_cached_bytes(found, cap); !ok) return fail(ok.error());
      return GPUPOOL_OK;
    });
  });
}

gpupool_status gpupool_pressure(gpupool_pool* pool, int device, double* pressure) {
  return guarded([&] {
    GPUPOOL_REQUIRE(pressure, "pressure is NULL: expected where to store the pressure");
    return on_device(pool, device, [&](const Device& found) {
      *pressure = pool->pool.memory_pressure(found);
      return GPUPOOL_OK;
    });
  });
}

gpupool_status gpupool_add_pressure_observer(gpupool_pool* pool, double threshold,
                                             gpupool_pressure_callback callback, void* user_data,
                                             uint64_t* id) {
  return guarded([&] {
    GPUPOOL_REQUIRE(pool && callback && id, "pool, callback and id must not be NULL");
    GPUPOOL_REQUIRE(std::isfinite(threshold) && threshold > 0 && threshold <= 1,
                    fmt::format("threshold is {}: expected a fraction in (0, 1]", threshold));
    *id = pool->pool.add_pressure_observer(threshold, [callback, user_data](const PressureEvent& e) {
      callback(e.device_id, e.pressure, user_data);
    });
    return GPUPOOL_OK;
  });
}

gpupool_status gpupool_remove_pressure_observer(gpupool_pool* pool, uint64_t id) {
  return guarded([&] {
    GPUPOOL_REQUIRE(pool, "pool is NULL: expected a pool from gpupool_pool_create");
    pool->pool.remove_pressure_observer(id);
    return GPUPOOL_OK;
  });
}

gpupool_status gpupool_process_pool(gpupool_pool** pool) {
  return guarded([&] {
    GPUPOOL_REQUIRE(pool, "pool is NULL: expected where to store the process pool");
    std::call_once(process_pool_once, [] {
      gpupool_pool* made = nullptr;
      if (gpupool_pool_create_from_environment(&made) == GPUPOOL_OK)
        process_pool_handle = made;  // lives as long as the process
      else
        process_pool_error = gpupool_last_error();
    });
    *pool = process_pool_handle;
    if (!process_pool_handle)
      return fail(GPUPOOL_INVALID_INPUT, fmt::format("the process pool could not be made from the "
                                                     "environment: {}", process_pool_error));
    return GPUPOOL_OK;
  });
}

void* gpupool_torch_malloc(size_t bytes, int device, void* stream) {
  if (bytes == 0) return nullptr;  // PyTorch keeps empty tensors without memory
  gpupool_pool* pool = nullptr;
  void* ptr = nullptr;
  gpupool_status status = gpupool_process_pool(&pool);
  if (status == GPUPOOL_OK) status = gpupool_allocate(pool, device, bytes, stream, &ptr);
  // PyTorch does not check the pointer (a NULL becomes a tensor at address 0): only an exception
  // stops it, and it raises this one in Python with its message.
  if (status != GPUPOOL_OK)
    throw TorchAllocationError(fmt::format("gpupool: {}", gpupool_last_error()));
  return ptr;
}

void gpupool_torch_free(void* ptr, size_t /*bytes*/, int /*device*/, void* stream) {
  gpupool_pool* pool = nullptr;
  if (gpupool_process_pool(&pool) != GPUPOOL_OK) return;
  gpupool_deallocate(pool, ptr, stream);
}

}  // extern "C"
