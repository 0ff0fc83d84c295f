// WordLock: a mutex of one 32-bit word for the arena shards' locks (pool/device_pool.cppm).
//
// Why: a request or a free that misses the thread cache takes its arena shard's lock once, and
// on a trace of varying sizes that is almost every operation. std::mutex goes through
// pthread_mutex_trylock / pthread_mutex_unlock, two library calls of some 30-40 instructions each;
// this lock takes one atomic compare-and-swap and gives back with one atomic exchange, inline.
//
// How (the three-state futex mutex): 0 free, 1 held, 2 held and perhaps waited for. A thread that
// finds it held spins a little (holds are short: a few pointer updates of the arena), then marks
// it 2 and sleeps in std::atomic::wait; unlock wakes one sleeper only when the word was 2. Holds
// that call the device (a segment's allocation) can last milliseconds: the waiters sleep then.
#pragma once

#include <atomic>
#include <cstdint>

namespace gpupool {

class WordLock {
 public:
  bool try_lock() noexcept {
    std::uint32_t expected = kFree;
    return state_.load(std::memory_order_relaxed) == kFree &&
           state_.compare_exchange_strong(expected, kHeld, std::memory_order_acquire,
                                          std::memory_order_relaxed);
  }

  void lock() noexcept {
    std::uint32_t expected = kFree;
    if (state_.compare_exchange_strong(expected, kHeld, std::memory_order_acquire,
                                       std::memory_order_relaxed)) [[likely]]
      return;
    lock_contended();
  }

  void unlock() noexcept {
    if (state_.exchange(kFree, std::memory_order_release) == kWaited) [[unlikely]]
      state_.notify_one();
  }

 private:
  static constexpr std::uint32_t kFree = 0, kHeld = 1, kWaited = 2;
  static constexpr int kSpins = 100;

  [[gnu::noinline]] void lock_contended() noexcept {
    for (int i = 0; i < kSpins; ++i) {
      pause();
      if (try_lock()) return;
    }
    // From here on the word says "waited for" whenever this thread may sleep, so that the
    // holder's unlock wakes it; taking the lock as 2 is safe (one wake too many at worst).
    while (state_.exchange(kWaited, std::memory_order_acquire) != kFree)
      state_.wait(kWaited, std::memory_order_relaxed);
  }

  static void pause() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  std::atomic<std::uint32_t> state_{kFree};
};

}  // namespace gpupool
