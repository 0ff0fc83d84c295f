// Internal: a launch helper's value worked out once for each device: a kernel's shared-memory
// attribute (cudaFuncSetAttribute) and its occupancy apply to the current device only, so a value
// kept once per process holds for the first device a process uses, and a second device would
// launch the kernel without its attribute (a failed launch) or with another GPU's figures.
// Host code only: include it from .cu files.
#pragma once

#include <cuda_runtime.h>

#include <mutex>

namespace gpupool::cudak {

template <class T>
class PerDevice {
 public:
  static constexpr int kDevices = 64;

  // The value for the current device: make() the first time that device asks, then the same.
  // Past kDevices devices (or where the current device cannot be read) make() runs every time.
  template <class Make>
  T get(Make&& make) {
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kDevices) return make();
    std::call_once(once_[device], [&] { value_[device] = make(); });
    return value_[device];
  }

 private:
  std::once_flag once_[kDevices];
  T value_[kDevices]{};
};

}  // namespace gpupool::cudak
