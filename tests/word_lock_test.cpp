// The arena shards' lock (pool/word_lock.hpp): a one-word mutex that spins briefly, then sleeps.
// Exclusion is checked by critical sections that break an invariant while they run; long holds
// send the other threads past their spins into the sleeping path, so that the wake-ups are tested
// (a lost wake-up hangs the case: CTest's timeout catches it).
#include <catch2/catch.hpp>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>
#include "../pool/word_lock.hpp"

using gpupool::WordLock;

namespace {

// Two counters that agree outside the lock and disagree inside it: a holder that finds them
// apart shares the lock with another.
struct Guarded {
  std::uint64_t first = 0, second = 0;
  std::uint64_t overlaps = 0;
  void step(std::chrono::microseconds hold = std::chrono::microseconds(0)) {
    volatile std::uint64_t* a = &first;  // each access a real load or store
    volatile std::uint64_t* b = &second;
    if (*a != *b) ++overlaps;
    *a = *a + 1;
    if (hold.count() > 0) std::this_thread::sleep_for(hold);
    for (int spin = 0; spin < 8; ++spin) (void)*a;
    *b = *b + 1;
  }
};

void hold_on_threads(WordLock& lock, Guarded& guarded, int threads, int holds,
                     std::chrono::microseconds hold) {
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t)
    workers.emplace_back([&] {
      for (int i = 0; i < holds; ++i) {
        std::lock_guard guard(lock);
        guarded.step(hold);
      }
    });
  for (std::thread& w : workers) w.join();
}

}  // namespace

TEST_CASE("a word lock excludes: short holds on many threads add up exactly", "[pool][lock]") {
  WordLock lock;
  Guarded guarded;
  constexpr int kThreads = 8, kHolds = 20'000;
  hold_on_threads(lock, guarded, kThreads, kHolds, std::chrono::microseconds(0));
  CHECK(guarded.overlaps == 0);
  CHECK(guarded.first == std::uint64_t{kThreads} * kHolds);
  CHECK(guarded.second == guarded.first);
}

TEST_CASE("a word lock's waiters sleep through long holds and all wake", "[pool][lock]") {
  WordLock lock;
  Guarded guarded;
  // Holds of 200 µs outlast the spins: the waiters mark the word and sleep, and every release
  // must wake one of them, or the case never ends.
  constexpr int kThreads = 4, kHolds = 50;
  hold_on_threads(lock, guarded, kThreads, kHolds, std::chrono::microseconds(200));
  CHECK(guarded.overlaps == 0);
  CHECK(guarded.first == std::uint64_t{kThreads} * kHolds);
}

TEST_CASE("a word lock's try_lock fails while it is held and succeeds once it is free",
          "[pool][lock]") {
  WordLock lock;
  REQUIRE(lock.try_lock());
  bool taken_elsewhere = true;
  std::thread([&] { taken_elsewhere = lock.try_lock(); }).join();
  CHECK_FALSE(taken_elsewhere);
  lock.unlock();
  std::thread([&] {
    taken_elsewhere = lock.try_lock();
    if (taken_elsewhere) lock.unlock();
  }).join();
  CHECK(taken_elsewhere);
  // A lock that was slept on (marked "waited for") is free again after the last holder leaves.
  std::atomic<bool> holding{false};
  std::thread holder([&] {
    std::lock_guard guard(lock);
    holding = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  });
  while (!holding) std::this_thread::yield();
  lock.lock();  // waits for the holder, past the spins
  lock.unlock();
  holder.join();
  CHECK(lock.try_lock());
  lock.unlock();
}
