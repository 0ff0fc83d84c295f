// Internal: what every kernel launcher of gpu/cuda/ shares — a CUDA status in the kernels'
// vocabulary (kernels::Status), the status of the launch just made, and a grid's size.
#pragma once

#include "kernels.cuh"

#include <cuda_runtime.h>

#include <cstddef>

namespace gpupool::cuda_kernels {

inline Status cuda_status(cudaError_t e, const char* what) {
  Status s;
  if (e != cudaSuccess) {
    s.cuda = static_cast<int>(e);
    s.what = what;
  }
  return s;
}

// A launch's configuration errors surface here; errors while the kernel runs surface later, on
// the stream.
inline Status launch_status(const char* what) { return cuda_status(cudaGetLastError(), what); }

// Blocks of `threads` for n items, one each.
inline unsigned blocks_for(std::size_t n, unsigned threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

}  // namespace gpupool::cuda_kernels
