// Counts a fuzz target's operations and prints the total and the rate when the process exits
// (libFuzzer exits through exit() when -max_total_time or -runs is reached), so that CI's log
// shows how deep a run went.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace gpupool::fuzzing {

class OpCounter {
 public:
  // The counter of target `name`, started at the first call and printed at exit.
  static OpCounter& of(const char* name) {
    static OpCounter counter(name);
    return counter;
  }
  void add(std::uint64_t ops) noexcept { ops_.fetch_add(ops, std::memory_order_relaxed); }

 private:
  explicit OpCounter(const char* name) : name_(name), start_(Clock::now()) {
    std::atexit([] { of(nullptr).print(); });
  }
  void print() const {
    const double seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    const auto ops = ops_.load();
    std::fprintf(stderr, "%s: %llu pool operations in %.1f s (%.0f per second)\n", name_,
                 static_cast<unsigned long long>(ops), seconds,
                 seconds > 0 ? static_cast<double>(ops) / seconds : 0.0);
  }

  using Clock = std::chrono::steady_clock;
  const char* name_;
  Clock::time_point start_;
  std::atomic<std::uint64_t> ops_{0};
};

}  // namespace gpupool::fuzzing
