// gpupool::exact — fn(begin, end) over [0, count) split across the cores this process may use:
// the host work of the exact job (folds, fp64 re-ranks, the queries' scan) per range of rows or
// lists.
#pragma once
#include <algorithm>
#include <cstddef>
#include <thread>
#include <vector>
#if defined(__linux__)
#include <sched.h>
#endif

namespace gpupool::exact {

// The cores this process may run on: its affinity mask where the system has one (an MPI launcher
// binds each process of a small job to one core), else the hardware threads; at least 1.
inline std::size_t usable_cores() noexcept {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(CPU_COUNT(&set), 1);
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

// At least `min_per_thread` items a thread; inline where one thread does or none can start.
template <class Fn>
void parallel_ranges(std::size_t count, std::size_t min_per_thread, Fn&& fn) {
  const std::size_t workers = std::clamp<std::size_t>(
      count / std::max<std::size_t>(min_per_thread, 1), 1, usable_cores());
  if (workers <= 1) return fn(std::size_t{0}, count);
  std::vector<std::thread> threads;
  const std::size_t step = (count + workers - 1) / workers;
  std::size_t begin = 0;
  for (; begin < count; begin += step) {
    const std::size_t end = std::min(count, begin + step);
    try {
      threads.emplace_back([&fn, begin, end] { fn(begin, end); });
    } catch (...) {  // no thread to be had: the rest on this one
      fn(begin, count);
      break;
    }
  }
  for (auto& t : threads) t.join();
}

}  // namespace gpupool::exact
