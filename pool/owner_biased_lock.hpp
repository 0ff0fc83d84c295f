// OwnerBiasedLock: a lock that one thread — the owner — takes and releases with plain loads and
// stores, no atomic read-modify-write, while any other thread may still take it.
//
// Why: a thread cache (pool/thread_cache.cppm) is locked by its own thread on every hit and every
// cached free, and by other threads rarely (stats, trims, a buffer freed on another thread). An
// uncontended atomic exchange still costs tens of cycles, a large part of a pool hit.
//
// How (an asymmetric Dekker handshake): the owner announces itself (`owner_inside_`) and then
// reads whether another thread wants the lock (`owner_must_lock_`), with only a compiler fence
// between; the other thread takes a spin lock, raises `owner_must_lock_`, and issues a process-wide
// memory barrier (Linux membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED) that orders the owner's
// store before its load on every CPU. After it, either the owner saw the request (and queues on
// the spin lock) or the other thread sees the owner inside and waits for it to leave.
//
// A membarrier costs microseconds, about a thousand owner holds' savings, so a lock that other
// threads take often stops being biased for good: every holder then takes the spin lock, as if
// there were no owner. The bias is off from the start where membarrier is missing and under
// ThreadSanitizer (which cannot see the barrier's ordering, and would report the owner's holds as
// races).
#pragma once

#include <atomic>
#include <cstdint>

#if defined(__linux__)
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__SANITIZE_THREAD__)
#define GPUPOOL_THREAD_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define GPUPOOL_THREAD_SANITIZER 1
#endif
#endif

namespace gpupool {

// A test-and-test-and-set lock: uncontended, one atomic exchange per hold (std::mutex costs two
// read-modify-writes).
class SpinLock {
 public:
  inline void lock() noexcept {
    while (locked_.exchange(true, std::memory_order_acquire))
      while (locked_.load(std::memory_order_relaxed)) pause();
  }
  inline void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  static inline void pause() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  std::atomic<bool> locked_{false};
};

class OwnerBiasedLock {
 public:
  // Owned by the calling thread, biased if the process-wide barrier is available.
  OwnerBiasedLock() noexcept
      : owner_(this_thread()), owner_must_lock_(!barrier_available()) {}
  OwnerBiasedLock(const OwnerBiasedLock&) = delete;
  OwnerBiasedLock& operator=(const OwnerBiasedLock&) = delete;

  inline void lock() noexcept {
    if (owner_.load(std::memory_order_relaxed) == this_thread()) [[likely]] {
      owner_inside_.store(true, std::memory_order_relaxed);
      std::atomic_signal_fence(std::memory_order_seq_cst);  // the store stays before the load
      if (!owner_must_lock_.load(std::memory_order_acquire)) [[likely]] {
        owner_holds_.store(owner_holds_.load(std::memory_order_relaxed) + 1,
                           std::memory_order_relaxed);
        return;
      }
      owner_inside_.store(false, std::memory_order_release);
      spin_.lock();
      owner_holds_spin_ = true;
      return;
    }
    lock_from_another_thread();
  }

  inline void unlock() noexcept {
    if (owner_.load(std::memory_order_relaxed) == this_thread()) [[likely]] {
      if (owner_holds_spin_) [[unlikely]] {
        owner_holds_spin_ = false;
        spin_.unlock();
        return;
      }
      owner_inside_.store(false, std::memory_order_release);
      return;
    }
    unlock_from_another_thread();
  }

  // The owner is gone (its thread ends, or it hands the lock over): from now on every holder
  // takes the spin lock. Any thread may call it, never while holding the lock.
  void disown() noexcept {
    spin_.lock();
    raise_request();
    owner_.store(nullptr, std::memory_order_relaxed);
    spin_.unlock();  // owner_must_lock_ stays raised
  }

  // Whether the owner still takes the lock without a read-modify-write (tests, reports).
  bool biased() const noexcept {
    return owner_.load(std::memory_order_relaxed) != nullptr &&
           !owner_must_lock_.load(std::memory_order_relaxed);
  }

  // Whether this process can bias a lock at all (Linux with membarrier, not under TSan).
  static bool barrier_available() noexcept {
#if defined(__linux__) && defined(SYS_membarrier) && \
    !defined(GPUPOOL_THREAD_SANITIZER)
    static const bool registered =
        syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
    return registered;
#else
    return false;
#endif
  }

  // Holds by other threads after which, if they are more than one per kOwnerHoldsPerBarrier of
  // the owner's, the bias ends.
  static constexpr std::uint64_t kHoldsBeforeJudging = 64;
  static constexpr std::uint64_t kOwnerHoldsPerBarrier = 1024;

 private:
  // Unique among live threads, read in one instruction.
  static inline const void* this_thread() noexcept { return __builtin_thread_pointer(); }

  [[gnu::noinline]] void lock_from_another_thread() noexcept {
    spin_.lock();
    if (!owner_must_lock_.load(std::memory_order_relaxed)) raise_request();
    ++other_holds_;
  }

  [[gnu::noinline]] void unlock_from_another_thread() noexcept {
    if (still_biased()) owner_must_lock_.store(false, std::memory_order_release);
    spin_.unlock();
  }

  // Under spin_: asks the owner to take the spin lock, and waits until it is outside.
  void raise_request() noexcept {
    owner_must_lock_.store(true, std::memory_order_relaxed);
    process_wide_barrier();
    while (owner_inside_.load(std::memory_order_acquire)) {
    }
  }

  // Under spin_, by another thread: whether the owner keeps its bias after this hold.
  bool still_biased() const noexcept {
    if (!barrier_available() || owner_.load(std::memory_order_relaxed) == nullptr) return false;
    if (other_holds_ < kHoldsBeforeJudging) return true;
    return other_holds_ * kOwnerHoldsPerBarrier <= owner_holds_.load(std::memory_order_relaxed);
  }

  // Every running thread of this process executes a full memory barrier before this returns.
  // Without the barrier the lock is never biased, and the spin lock's exchange orders instead.
  static void process_wide_barrier() noexcept {
#if defined(__linux__) && defined(SYS_membarrier) && \
    !defined(GPUPOOL_THREAD_SANITIZER)
    if (barrier_available()) syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0);
#endif
  }

  std::atomic<const void*> owner_;
  std::atomic<bool> owner_inside_{false};
  std::atomic<bool> owner_must_lock_;
  std::atomic<std::uint64_t> owner_holds_{0};  // written by the owner only (no read-modify-write)
  bool owner_holds_spin_ = false;              // the owner's, while it holds spin_
  std::uint64_t other_holds_ = 0;              // under spin_
  SpinLock spin_;
};

}  // namespace gpupool
