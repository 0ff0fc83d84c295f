// The host cores this process may run on, for sizing its worker threads.
#pragma once

#include <algorithm>
#include <cstddef>
#include <thread>
#if defined(__linux__)
#include <sched.h>
#endif

namespace gpupool {

// The process's affinity mask where the system has one (an MPI launcher binds each process of a
// small job to one core; a container may allow a few of the host's), else the hardware threads;
// at least 1. std::thread::hardware_concurrency counts the host's, whatever the mask allows.
inline std::size_t usable_host_cores() noexcept {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0)
    return static_cast<std::size_t>(std::max(CPU_COUNT(&set), 1));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace gpupool
