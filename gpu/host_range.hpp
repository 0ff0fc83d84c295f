// HostRange: one range of host address space, mapped once, carved into 256-byte aligned blocks
// first fit and coalesced on free. The simulated device's memory when its config asks for
// reserved memory: an allocation then costs no system call, no page faults after first use and no
// sanitizer bookkeeping (ASan shadows a heap block of 2 MiB with 256 KiB it must write on every
// allocation and free).
//
// Plain data behind the device's lock: no locking here. take() may fail on a fragmented range
// while the device's capacity still has room; the device falls back to the heap then, so the
// range never changes what succeeds.
#pragma once
#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <optional>

namespace gpupool::detail {

class HostRange {
 public:
  static constexpr std::size_t kAlignment = 256;

  // Reserves `bytes` of address space (pages are backed only when touched); empty if the host
  // refuses, which callers treat as "no range".
  explicit HostRange(std::size_t bytes) {
    bytes = round_up(bytes);
    if (bytes == 0) return;
    void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) return;
    base_ = static_cast<std::byte*>(base);
    bytes_ = bytes;
    free_.emplace(0, bytes);
  }
  ~HostRange() {
    if (base_) ::munmap(base_, bytes_);
  }
  HostRange(const HostRange&) = delete;
  HostRange& operator=(const HostRange&) = delete;

  // A block of at least `bytes` from the lowest free range that holds it, or nullopt.
  std::optional<void*> take(std::size_t bytes) {
    bytes = round_up(bytes);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      auto [offset, size] = *it;
      if (size < bytes) continue;
      free_.erase(it);
      if (size > bytes) free_.emplace(offset + bytes, size - bytes);
      return base_ + offset;
    }
    return std::nullopt;
  }

  // Returns a block take() gave for `bytes`, merging it with its free neighbours.
  void give_back(void* ptr, std::size_t bytes) {
    std::size_t offset = static_cast<std::size_t>(static_cast<std::byte*>(ptr) - base_);
    bytes = round_up(bytes);
    auto next = free_.lower_bound(offset);
    if (next != free_.end() && next->first == offset + bytes) {
      bytes += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto previous = std::prev(next);
      if (previous->first + previous->second == offset) {
        previous->second += bytes;
        return;
      }
    }
    free_.emplace(offset, bytes);
  }

  bool holds(const void* ptr) const {
    auto* p = static_cast<const std::byte*>(ptr);
    return base_ && p >= base_ && p < base_ + bytes_;
  }

 private:
  static std::size_t round_up(std::size_t bytes) {
    return (bytes + kAlignment - 1) / kAlignment * kAlignment;
  }

  std::byte* base_ = nullptr;
  std::size_t bytes_ = 0;
  std::map<std::size_t, std::size_t> free_;  // offset -> bytes of each free range, disjoint
};

}  // namespace gpupool::detail
