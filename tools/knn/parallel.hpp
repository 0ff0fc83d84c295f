// gpupool::exact — fn(begin, end) over [0, count) split across the cores this process may use:
// the host work of the exact job (folds, fp64 re-ranks, the queries' scan) per range of rows or
// lists.
#pragma once
#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#include "../../gpu/host_cores.hpp"

namespace gpupool::exact {

// The cores this process may run on (gpu/host_cores.hpp).
inline std::size_t usable_cores() noexcept { return usable_host_cores(); }

// Threads kept for parallel_ranges, one fewer than the cores the process may use (the caller
// works too), started on first use. A job folds every chunk's candidates on all cores: starting
// threads for each fold cost more than the fold on hosts of many cores (64 threads × 96 chunks).
// Callers on several threads at once (the devices of one job) share them: each call's parts wait
// in one queue, and a caller runs queued parts, its own or another's, until its own are done.
class WorkerThreads {
 public:
  static WorkerThreads& instance() {
    static WorkerThreads workers;
    return workers;
  }
  WorkerThreads(const WorkerThreads&) = delete;
  WorkerThreads& operator=(const WorkerThreads&) = delete;
  ~WorkerThreads() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    work_.notify_all();
    for (std::thread& thread : threads_) thread.join();
  }

  // part(i) for every i in [0, parts), on the kept threads and on this one; returns when all ran.
  template <class Part>
  void run(std::size_t parts, Part& part) {
    if (parts == 0) return;
    Call call{parts};
    std::unique_lock lock(mutex_);
    for (std::size_t i = 1; i < parts; ++i) queue_.push_back(Task{&call, [&part, i] { part(i); }});
    lock.unlock();
    work_.notify_all();
    part(std::size_t{0});
    lock.lock();
    finished(call);
    while (call.left > 0) {
      if (queue_.empty()) {
        done_.wait(lock);
        continue;
      }
      run_first(lock);
    }
  }

 private:
  struct Call {
    std::size_t left;  // parts not finished
  };
  struct Task {
    Call* call;
    std::function<void()> part;
  };

  WorkerThreads() {
    const std::size_t count = usable_cores() - 1;
    for (std::size_t i = 0; i < count; ++i) {
      try {
        threads_.emplace_back([this] { serve(); });
      } catch (...) {  // no more threads to be had: the callers run the rest themselves
        break;
      }
    }
  }
  void serve() {
    std::unique_lock lock(mutex_);
    for (;;) {
      work_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      run_first(lock);
    }
  }
  // Runs the first queued part outside the lock (held on entry and on return).
  void run_first(std::unique_lock<std::mutex>& lock) {
    Task task = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    task.part();
    lock.lock();
    finished(*task.call);
  }
  void finished(Call& call) {
    if (--call.left == 0) done_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable work_, done_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// fn(begin, end) over [0, count) in ranges of at least `min_per_thread` items, one range per
// core at most; inline where one range does.
template <class Fn>
void parallel_ranges(std::size_t count, std::size_t min_per_thread, Fn&& fn) {
  const std::size_t workers = std::clamp<std::size_t>(
      count / std::max<std::size_t>(min_per_thread, 1), 1, usable_cores());
  if (workers <= 1) return fn(std::size_t{0}, count);
  const std::size_t step = (count + workers - 1) / workers;
  const std::size_t parts = (count + step - 1) / step;
  auto part = [&fn, step, count](std::size_t i) { fn(i * step, std::min(count, (i + 1) * step)); };
  WorkerThreads::instance().run(parts, part);
}

}  // namespace gpupool::exact
