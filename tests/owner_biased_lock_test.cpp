// The thread caches' lock (pool/owner_biased_lock.hpp): its owner holds it with plain loads and
// stores, other threads with a spin lock and a process-wide barrier. Exclusion is checked by
// critical sections that break an invariant while they run; under TSan the bias is off and the
// same cases check the spin lock.
#include <catch2/catch.hpp>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>
#include "../pool/owner_biased_lock.hpp"

using gpupool::OwnerBiasedLock;

namespace {

// Two counters that agree outside the lock and disagree inside it: a holder that finds them
// apart shares the lock with another.
struct Guarded {
  std::uint64_t first = 0, second = 0;
  std::uint64_t overlaps = 0;
  void step() {
    // volatile: each access is a real load or store, so an overlap has a window to show in
    volatile std::uint64_t* a = &first;
    volatile std::uint64_t* b = &second;
    if (*a != *b) ++overlaps;
    *a = *a + 1;
    for (int spin = 0; spin < 8; ++spin) (void)*a;
    *b = *b + 1;
  }
};

// `holds` holds by this thread (the lock's maker) and as many by another thread at once.
void hold_here_and_on_another_thread(OwnerBiasedLock& lock, Guarded& guarded, int holds) {
  auto hold = [&] {
    for (int i = 0; i < holds; ++i) {
      lock.lock();
      guarded.step();
      lock.unlock();
    }
  };
  std::thread other(hold);
  hold();
  other.join();
}

}  // namespace

TEST_CASE("an owner-biased lock excludes: the owner's holds and other threads' add up exactly",
          "[pool][lock]") {
  OwnerBiasedLock lock;
  Guarded guarded;
  // Other threads hold it rarely, spread over the owner's run, so that the bias stays and every
  // one of their holds goes through the handshake with an owner that is busy holding it.
  constexpr std::uint64_t kOtherHolds = 40;
  constexpr int kOthers = 3;
  std::atomic<int> running{kOthers};
  std::vector<std::thread> others;
  for (int t = 0; t < kOthers; ++t)
    others.emplace_back([&] {
      for (std::uint64_t i = 0; i < kOtherHolds; ++i) {
        lock.lock();
        guarded.step();
        lock.unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      running.fetch_sub(1);
    });
  std::uint64_t owner_holds = 0;
  while (running.load(std::memory_order_relaxed) > 0) {  // this thread made the lock: its owner
    lock.lock();
    guarded.step();
    lock.unlock();
    ++owner_holds;
  }
  for (std::thread& t : others) t.join();
  CHECK(guarded.overlaps == 0);
  CHECK(guarded.first == owner_holds + kOthers * kOtherHolds);
  CHECK(guarded.second == guarded.first);
}

TEST_CASE("an owner-biased lock is biased where the process has the barrier, and stays so while "
          "other threads hold it rarely",
          "[pool][lock]") {
  OwnerBiasedLock lock;
  CHECK(lock.biased() == OwnerBiasedLock::barrier_available());
  if (!OwnerBiasedLock::barrier_available()) return;  // TSan, or no membarrier: a spin lock
  const std::uint64_t owner_holds =
      2 * OwnerBiasedLock::kHoldsBeforeJudging * OwnerBiasedLock::kOwnerHoldsPerBarrier;
  for (std::uint64_t i = 0; i < owner_holds; ++i) {
    lock.lock();
    lock.unlock();
  }
  std::thread other([&] {
    for (std::uint64_t i = 0; i < 2 * OwnerBiasedLock::kHoldsBeforeJudging; ++i) {
      lock.lock();
      lock.unlock();
    }
  });
  other.join();
  CHECK(lock.biased());
}

TEST_CASE("an owner-biased lock that other threads hold often stops being biased, and still "
          "excludes",
          "[pool][lock]") {
  OwnerBiasedLock lock;
  Guarded guarded;
  std::thread other([&] {
    for (std::uint64_t i = 0; i < OwnerBiasedLock::kHoldsBeforeJudging + 1; ++i) {
      lock.lock();
      guarded.step();
      lock.unlock();
    }
  });
  other.join();
  CHECK_FALSE(lock.biased());
  hold_here_and_on_another_thread(lock, guarded, 20'000);
  CHECK(guarded.overlaps == 0);
  CHECK(guarded.first == OwnerBiasedLock::kHoldsBeforeJudging + 1 + 40'000);
}

TEST_CASE("a disowned lock has no owner: its maker takes the spin lock like any thread",
          "[pool][lock]") {
  OwnerBiasedLock lock;
  lock.disown();
  CHECK_FALSE(lock.biased());
  Guarded guarded;
  hold_here_and_on_another_thread(lock, guarded, 20'000);
  CHECK(guarded.overlaps == 0);
  CHECK(guarded.first == 40'000);
}
