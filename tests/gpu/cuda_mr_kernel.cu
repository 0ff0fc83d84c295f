// gpupool::memory_resource from a .cu file (which cannot import gpupool's modules): memory from
// the process pool through CCCL's async_resource_ref, written by a kernel on a stream of the
// caller's, read back, freed on that stream. Called by tests/gpu/interop_gpu_test.cpp.
#define LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#include "gpupool/cuda_mr.hpp"

#include <cuda_runtime.h>
#include <thrust/device_malloc_allocator.h>
#include <thrust/device_vector.h>
#include <thrust/execution_policy.h>
#include <thrust/reduce.h>
#include <thrust/sequence.h>

#include <cstdint>
#include <vector>

namespace {
__global__ void write_squares(int* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = i * i;
}

// A Thrust (CCCL) container's allocator over any synchronous cuda::mr resource.
template <class T>
struct resource_allocator : thrust::device_malloc_allocator<T> {
  using pointer = typename thrust::device_malloc_allocator<T>::pointer;
  using size_type = typename thrust::device_malloc_allocator<T>::size_type;
  template <class U>
  struct rebind {
    using other = resource_allocator<U>;
  };
  explicit resource_allocator(cuda::mr::resource_ref<cuda::mr::device_accessible> r) : resource(r) {}
  template <class U>
  resource_allocator(const resource_allocator<U>& other) : resource(other.resource) {}
  pointer allocate(size_type n) {
    return pointer(static_cast<T*>(resource.allocate(n * sizeof(T), alignof(T))));
  }
  void deallocate(pointer p, size_type n) noexcept {
    resource.deallocate(thrust::raw_pointer_cast(p), n * sizeof(T), alignof(T));
  }
  cuda::mr::resource_ref<cuda::mr::device_accessible> resource;
};
}  // namespace

// A thrust::device_vector of n ints on gpupool's resource (through cuda::mr::resource_ref): filled
// with 0..n-1 and summed on the GPU. Returns the sum, or -1 when a CUDA call failed.
long long gpupool_test_cuda_mr_thrust_sum(int device, int n) {
  if (cudaSetDevice(device) != cudaSuccess) return -1;
  gpupool::memory_resource mr = gpupool::memory_resource::process(device);
  resource_allocator<int> allocator{cuda::mr::resource_ref<cuda::mr::device_accessible>{mr}};
  thrust::device_vector<int, resource_allocator<int>> values(static_cast<std::size_t>(n), 0, allocator);
  thrust::sequence(values.begin(), values.end());
  return thrust::reduce(values.begin(), values.end(), 0LL);
}

// Returns the number of wrong values read back, or -1 when a CUDA call failed.
int gpupool_test_cuda_mr_kernel(int device, int n) {
  if (cudaSetDevice(device) != cudaSuccess) return -1;
  gpupool::memory_resource mr = gpupool::memory_resource::process(device);
  cuda::mr::async_resource_ref<cuda::mr::device_accessible> ref{mr};
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return -1;
  const std::size_t bytes = sizeof(int) * static_cast<std::size_t>(n);
  int* values = static_cast<int*>(ref.allocate_async(bytes, alignof(int), cuda::stream_ref{stream}));
  std::vector<int> host(static_cast<std::size_t>(n), -1);
  write_squares<<<(n + 255) / 256, 256, 0, stream>>>(values, n);
  bool ok = cudaGetLastError() == cudaSuccess &&
            cudaMemcpyAsync(host.data(), values, bytes, cudaMemcpyDeviceToHost, stream) == cudaSuccess;
  ref.deallocate_async(values, bytes, alignof(int), cuda::stream_ref{stream});
  ok = cudaStreamSynchronize(stream) == cudaSuccess && ok;
  cudaStreamDestroy(stream);
  if (!ok) return -1;
  int wrong = 0;
  for (int i = 0; i < n; ++i) wrong += host[static_cast<std::size_t>(i)] != i * i;
  return wrong;
}
