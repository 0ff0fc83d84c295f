// Internal: a launch helper's value worked out once for each device: a kernel's shared-memory
// attribute (cudaFuncSetAttribute) and its occupancy apply to the current device only, so a value
// kept once per process holds for the first device a process uses, and a second device would
// launch the kernel without its attribute (a failed launch) or with another GPU's figures.
// Host code only: include it from .cu files.
#pragma once

#include <cuda_runtime.h>

#include <mutex>

namespace gpupool::cuda_kernels {

// Devices the launch helpers keep values for (ordinals 0 .. kMaxDevices - 1).
inline constexpr int kMaxDevices = 64;

template <class T>
class PerDevice {
 public:
  // The value for the current device: make() the first time that device asks, then the same.
  // Past kMaxDevices devices (or where the current device cannot be read) make() runs every time.
  template <class Make>
  T get(Make&& make) {
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices)
      return make();
    std::call_once(once_[device], [&] { value_[device] = make(); });
    return value_[device];
  }

 private:
  std::once_flag once_[kMaxDevices];
  T value_[kMaxDevices]{};
};

}  // namespace gpupool::cuda_kernels
