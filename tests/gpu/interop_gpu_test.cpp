// The interop layers on a real GPU: the C ABI with CUDA streams, and gpupool::memory_resource
// used from a .cu file. Tagged [gpu]: tools/gpu-check.sh runs them on the GPU machine.
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "gpupool/gpupool.h"

int gpupool_test_cuda_mr_kernel(int device, int n);
long long gpupool_test_cuda_mr_thrust_sum(int device, int n);

TEST_CASE("GPU interop: a cuda::mr resource serves a kernel from a .cu file", "[gpu][interop]") {
  CHECK(gpupool_test_cuda_mr_kernel(0, 1 << 20) == 0);
  gpupool_pool* process = nullptr;
  REQUIRE(gpupool_process_pool(&process) == GPUPOOL_OK);
  gpupool_stats stats{};
  stats.struct_size = sizeof stats;
  REQUIRE(gpupool_get_stats(process, 0, &stats) == GPUPOOL_OK);
  CHECK(stats.allocations >= 1);
  CHECK(stats.live_allocations == 0);
}

TEST_CASE("GPU interop: a Thrust container on gpupool's cuda::mr resource", "[gpu][interop]") {
  gpupool_pool* process = nullptr;
  REQUIRE(gpupool_process_pool(&process) == GPUPOOL_OK);
  gpupool_stats before{};
  before.struct_size = sizeof before;
  REQUIRE(gpupool_get_stats(process, 0, &before) == GPUPOOL_OK);
  const long long n = 1 << 22;
  CHECK(gpupool_test_cuda_mr_thrust_sum(0, static_cast<int>(n)) == n * (n - 1) / 2);
  gpupool_stats after{};
  after.struct_size = sizeof after;
  REQUIRE(gpupool_get_stats(process, 0, &after) == GPUPOOL_OK);
  CHECK(after.allocations > before.allocations);  // the vector's memory came from gpupool
  CHECK(after.live_allocations == before.live_allocations);
}

TEST_CASE("GPU interop: the C ABI on CUDA streams", "[gpu][interop]") {
  gpupool_pool* pool = nullptr;
  REQUIRE(gpupool_pool_create(nullptr, &pool) == GPUPOOL_OK);
  cudaStream_t first = nullptr, second = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&first, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&second, cudaStreamNonBlocking) == cudaSuccess);

  void* ptr = nullptr;
  REQUIRE(gpupool_allocate(pool, 0, 1 << 20, first, &ptr) == GPUPOOL_OK);
  std::vector<std::uint8_t> pattern(1 << 20, 0x3c), back(1 << 20, 0);
  REQUIRE(cudaMemcpyAsync(ptr, pattern.data(), pattern.size(), cudaMemcpyHostToDevice, first) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(back.data(), ptr, back.size(), cudaMemcpyDeviceToHost, first) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(first) == cudaSuccess);
  CHECK(back == pattern);

  // Freed on the second stream: the block returns only after that stream's queued work.
  REQUIRE(gpupool_deallocate(pool, ptr, second) == GPUPOOL_OK);
  void* next = nullptr;
  REQUIRE(gpupool_allocate(pool, 0, 1 << 20, first, &next) == GPUPOOL_OK);
  REQUIRE(gpupool_deallocate(pool, next, first) == GPUPOOL_OK);

  REQUIRE(cudaStreamSynchronize(second) == cudaSuccess);
  size_t released = 0;
  REQUIRE(gpupool_cleanup(pool, 0, &released) == GPUPOOL_OK);
  CHECK(released >= 1 << 20);
  cudaStreamDestroy(first);
  cudaStreamDestroy(second);
  gpupool_pool_release(pool);
}
