// gpupool::memory_resource (include/gpupool/cuda_mr.hpp) through CCCL's own type-erased
// references, on a simulated device: compiled host-only against the CUDA toolkit's CCCL headers
// when they are present (the concept checks are static_asserts in the header itself).
#define LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#include "gpupool/cuda_mr.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <string>

namespace {

int open_device() {
  int device = -1;
  REQUIRE(gpupool_device_open("sim:64MiB", &device) == GPUPOOL_OK);
  return device;
}

gpupool_pool* make_pool() {
  gpupool_pool* pool = nullptr;
  REQUIRE(gpupool_pool_create(nullptr, &pool) == GPUPOOL_OK);
  return pool;
}

gpupool_stats stats_of(const gpupool::memory_resource& mr) {
  gpupool_stats stats{};
  stats.struct_size = sizeof stats;
  REQUIRE(gpupool_get_stats(mr.pool(), mr.device(), &stats) == GPUPOOL_OK);
  return stats;
}

}  // namespace

TEST_CASE("cuda::mr: gpupool's resource through async_resource_ref", "[interop][cuda-mr]") {
  const int device = open_device();
  gpupool_pool* pool = make_pool();
  gpupool::memory_resource mr(pool, device);
  gpupool_pool_release(pool);  // the resource holds its own reference

  void* native = nullptr;
  REQUIRE(gpupool_stream_create(device, &native) == GPUPOOL_OK);
  ::cuda::stream_ref stream{static_cast<cudaStream_t>(native)};
  ::cuda::mr::async_resource_ref<::cuda::mr::device_accessible> ref{mr};

  void* a = ref.allocate_async(1000, 256, stream);
  void* b = ref.allocate(3 << 20, 64);
  REQUIRE(a);
  REQUIRE(b);
  CHECK(reinterpret_cast<std::uintptr_t>(a) % 256 == 0);
  std::memset(a, 0x11, 1000);  // simulated device memory is host memory
  gpupool_stats s = stats_of(mr);
  CHECK(s.live_allocations == 2);
  CHECK(s.requested_bytes == 1000 + (3 << 20));

  ref.deallocate_async(a, 1000, 256, stream);
  ref.deallocate(b, 3 << 20, 64);
  s = stats_of(mr);
  CHECK(s.live_allocations == 0);
  CHECK(s.frees == 2);

  // The CCCL >= 3.2 spellings serve too.
  void* c = mr.allocate(stream, 4096);
  mr.deallocate(stream, c, 4096);
  void* d = mr.allocate_sync(4096);
  mr.deallocate_sync(d, 4096);
  CHECK(stats_of(mr).allocations == 4);
  REQUIRE(gpupool_stream_destroy(device, native) == GPUPOOL_OK);
}

TEST_CASE("cuda::mr: copies share the pool, equality is pool and device", "[interop][cuda-mr]") {
  const int device = open_device();
  const int other_device = open_device();
  gpupool_pool* pool = make_pool();
  gpupool::memory_resource mr(pool, device);
  gpupool::memory_resource copy = mr;
  gpupool::memory_resource elsewhere(pool, other_device);
  gpupool_pool* second = make_pool();
  gpupool::memory_resource other_pool(second, device);
  gpupool_pool_release(pool);
  gpupool_pool_release(second);
  CHECK(copy == mr);
  CHECK(elsewhere != mr);
  CHECK(other_pool != mr);

  void* ptr = copy.allocate(1 << 20);
  CHECK(stats_of(mr).live_allocations == 1);  // one pool behind both
  mr.deallocate(ptr, 1 << 20);
  CHECK(stats_of(copy).frees == 1);

  gpupool::memory_resource moved = std::move(copy);
  CHECK(moved == mr);
  copy = elsewhere;  // assignment into a moved-from resource
  CHECK(copy == elsewhere);
}

TEST_CASE("cuda::mr: refusals throw allocation_error, frees never throw", "[interop][cuda-mr]") {
  const int device = open_device();
  gpupool_pool* pool = make_pool();
  gpupool::memory_resource mr(pool, device);
  gpupool_pool_release(pool);

  CHECK(mr.allocate(0) == nullptr);
  mr.deallocate(nullptr, 0);
  try {
    (void)mr.allocate(64, 4096);
    FAIL("an alignment of 4096 was accepted");
  } catch (const gpupool::allocation_error& e) {
    CHECK(e.status() == GPUPOOL_UNSUPPORTED);
    CHECK_THAT(std::string(e.what()), Catch::Contains("alignment 4096 is above"));
  }
  try {
    (void)mr.allocate(std::size_t{1} << 30);
    FAIL("1 GiB was given on a 64 MiB device");
  } catch (const std::bad_alloc& e) {  // as rmm::out_of_memory: a std::bad_alloc
    CHECK_THAT(std::string(e.what()), Catch::Contains("requested 1.00 GiB"));
  }
  int on_the_host = 0;
  mr.deallocate(&on_the_host, sizeof on_the_host);  // refused inside, not thrown
  CHECK_THAT(std::string(gpupool_last_error()), Catch::Contains("not a live allocation"));
  CHECK(stats_of(mr).live_allocations == 0);
  CHECK_THROWS_AS(gpupool::memory_resource(nullptr, device), gpupool::allocation_error);
}
