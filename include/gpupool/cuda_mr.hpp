// gpupool as a CCCL memory resource (cuda::mr), for code that takes its memory from one: RMM and
// through it cuVS, RAFT and FAISS built with cuVS. Header-only over the C ABI (gpupool.h,
// libgpupool_c), so it compiles in .cu files, which cannot import C++ modules.
//
//   #define LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE   // CCCL 3.0 (CUDA 13.0) needs it
//   #include <gpupool/cuda_mr.hpp>
//   gpupool::memory_resource mr = gpupool::memory_resource::process(/*device=*/0);
//   cuda::mr::async_resource_ref<cuda::mr::device_accessible> ref{mr};
//
// With RMM >= 26.06: rmm::mr::set_per_device_resource(rmm::cuda_device_id{0}, mr) (a copy is
// kept: copies share the pool). docs/interop.md has the rest.
//
// Guarantees:
//   - Copyable and equality-comparable: copies share one pool (reference-counted); two resources
//     are equal when they draw from the same pool on the same device.
//   - Blocks are aligned to GPUPOOL_ALIGNMENT (256 bytes). A larger alignment, or one that is not
//     a power of two, throws gpupool::allocation_error and allocates nothing.
//   - Stream-ordered: allocate_async on stream s gives memory usable by work on s; a block freed
//     with deallocate_async on s is reused at once only by work ordered after the free, and by
//     any other stream only after s's work queued before the free has finished.
//   - The synchronous forms order on the default stream, and allocate synchronizes it before
//     returning, so the memory is usable by any stream at once (as RMM's allocate_sync).
//   - Checked by static_assert below against the concepts of the CCCL it is compiled with:
//     resource, async_resource and async_resource_with<device_accessible> in CCCL 3.0 (CUDA
//     13.0, tested), synchronous_resource and resource_with<device_accessible> from CCCL 3.2.
//   - Failures throw gpupool::allocation_error (a std::bad_alloc, as rmm::out_of_memory is) with
//     gpupool's message; deallocation never throws. allocate(0) gives nullptr, deallocating
//     nullptr does nothing (as cudaMallocAsync).
#pragma once

#include <cuda/memory_resource>
#include <cuda/stream_ref>

#include <cstddef>
#include <new>
#include <string>
#include <utility>

#include "gpupool/gpupool.h"

namespace gpupool {

class allocation_error : public std::bad_alloc {
 public:
  allocation_error(gpupool_status status, std::string message)
      : status_(status), message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }
  gpupool_status status() const noexcept { return status_; }

 private:
  gpupool_status status_;
  std::string message_;
};

class memory_resource {
 public:
  // A resource over `pool` (which it retains) for `device`.
  memory_resource(gpupool_pool* pool, int device) : pool_(gpupool_pool_retain(pool)), device_(device) {
    if (!pool_) throw allocation_error(GPUPOOL_INVALID_INPUT, "gpupool::memory_resource: pool is NULL");
  }
  // The process pool (made from the environment at first use) on `device`.
  static memory_resource process(int device) {
    gpupool_pool* pool = nullptr;
    check(gpupool_process_pool(&pool));
    return memory_resource(pool, device);
  }

  memory_resource(const memory_resource& other) noexcept
      : pool_(gpupool_pool_retain(other.pool_)), device_(other.device_) {}
  memory_resource(memory_resource&& other) noexcept
      : pool_(std::exchange(other.pool_, nullptr)), device_(other.device_) {}
  memory_resource& operator=(memory_resource other) noexcept {
    std::swap(pool_, other.pool_);
    std::swap(device_, other.device_);
    return *this;
  }
  ~memory_resource() { gpupool_pool_release(pool_); }

  // ---- stream-ordered (CCCL 3.0 names) ----
  void* allocate_async(std::size_t bytes, std::size_t alignment, ::cuda::stream_ref stream) {
    return allocate_on(bytes, alignment, stream.get());
  }
  void deallocate_async(void* ptr, std::size_t, std::size_t, ::cuda::stream_ref stream) noexcept {
    gpupool_deallocate(pool_, ptr, stream.get());
  }

  // ---- synchronous (CCCL 3.0 names) ----
  void* allocate(std::size_t bytes, std::size_t alignment = GPUPOOL_ALIGNMENT) {
    void* ptr = allocate_on(bytes, alignment, nullptr);
    // Work still queued on the default stream may have used a reused block: a synchronous
    // allocation must be usable from any stream at once.
    if (ptr) synchronize_default_stream(ptr);
    return ptr;
  }
  void deallocate(void* ptr, std::size_t, std::size_t = GPUPOOL_ALIGNMENT) noexcept {
    gpupool_deallocate(pool_, ptr, nullptr);
  }

  // ---- CCCL >= 3.2 names (RMM >= 26.06): stream first, and the _sync pair ----
  void* allocate(::cuda::stream_ref stream, std::size_t bytes, std::size_t alignment = GPUPOOL_ALIGNMENT) {
    return allocate_on(bytes, alignment, stream.get());
  }
  void deallocate(::cuda::stream_ref stream, void* ptr, std::size_t bytes,
                  std::size_t alignment = GPUPOOL_ALIGNMENT) noexcept {
    deallocate_async(ptr, bytes, alignment, stream);
  }
  void* allocate_sync(std::size_t bytes, std::size_t alignment = GPUPOOL_ALIGNMENT) {
    return allocate(bytes, alignment);
  }
  void deallocate_sync(void* ptr, std::size_t bytes, std::size_t alignment = GPUPOOL_ALIGNMENT) noexcept {
    deallocate(ptr, bytes, alignment);
  }

  friend bool operator==(const memory_resource& a, const memory_resource& b) noexcept {
    return a.pool_ == b.pool_ && a.device_ == b.device_;
  }
  friend bool operator!=(const memory_resource& a, const memory_resource& b) noexcept { return !(a == b); }
  friend void get_property(const memory_resource&, ::cuda::mr::device_accessible) noexcept {}

  gpupool_pool* pool() const noexcept { return pool_; }
  int device() const noexcept { return device_; }

 private:
  static void check(gpupool_status status) {
    if (status != GPUPOOL_OK) throw allocation_error(status, gpupool_last_error());
  }
  void* allocate_on(std::size_t bytes, std::size_t alignment, void* stream) {
    if (bytes == 0) return nullptr;
    void* ptr = nullptr;
    check(gpupool_allocate_aligned(pool_, device_, bytes, alignment, stream, &ptr));
    return ptr;
  }
  void synchronize_default_stream(void* ptr) {
    if (gpupool_status s = gpupool_stream_synchronize(device_, nullptr); s != GPUPOOL_OK) {
      allocation_error error(s, gpupool_last_error());
      gpupool_deallocate(pool_, ptr, nullptr);
      throw error;
    }
  }

  gpupool_pool* pool_;
  int device_;
};

#if CCCL_MAJOR_VERSION == 3 && CCCL_MINOR_VERSION < 2
static_assert(::cuda::mr::resource<memory_resource>);
static_assert(::cuda::mr::async_resource<memory_resource>);
static_assert(::cuda::mr::async_resource_with<memory_resource, ::cuda::mr::device_accessible>);
#else
static_assert(::cuda::mr::synchronous_resource<memory_resource>);
static_assert(::cuda::mr::resource_with<memory_resource, ::cuda::mr::device_accessible>);
#endif

}  // namespace gpupool
