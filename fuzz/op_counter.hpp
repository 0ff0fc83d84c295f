// Counts a fuzz target's operations (or inputs) and prints the total and the rate when the process exits
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
  // The counter of target `name` counting `what`, started at the first call and printed at exit.
  static OpCounter& of(const char* name, const char* what = "pool operations") {
    static OpCounter counter(name, what);
    return counter;
  }
  void add(std::uint64_t ops) noexcept { ops_.fetch_add(ops, std::memory_order_relaxed); }

 private:
  OpCounter(const char* name, const char* what) : name_(name), what_(what), start_(Clock::now()) {
    std::atexit([] { of(nullptr).print(); });
  }
  void print() const {
    const double seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    const auto ops = ops_.load();
    std::fprintf(stderr, "%s: %llu %s in %.1f s (%.0f per second)\n", name_,
                 static_cast<unsigned long long>(ops), what_, seconds,
                 seconds > 0 ? static_cast<double>(ops) / seconds : 0.0);
  }

  using Clock = std::chrono::steady_clock;
  const char* name_;
  const char* what_;
  Clock::time_point start_;
  std::atomic<std::uint64_t> ops_{0};
};

}  // namespace gpupool::fuzzing
