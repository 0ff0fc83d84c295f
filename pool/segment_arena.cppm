// SegmentArena: large blocks carved from device segments, best fit, coalesced on free.
//
// Blocks above 64 KiB (pool/size_classes.cppm's kArenaThreshold) do not get one device allocation
// each: a class-per-block cache strands memory in classes the workload has stopped asking for
// (peak reserved / peak requested ≈ 1.9 on a uniform 1 B–4 MiB trace; 1.09 with segments). Instead they are cut from
// segments — a few tens of MiB each, or exactly the block when the device is nearly full — and
// a freed block merges with its free neighbours, so the memory serves whatever size comes next.
// docs/pool.md has the measurements behind the choice.
//
// The arena is plain data: no device calls and no locking. DevicePool owns one per (stream,
// thread shard) behind a mutex, asks the device for segments and gives fully free ones back.
module;
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>
module gpupool:segment_arena;

namespace gpupool {

class SegmentArena {
 public:
  struct Segment {
    void* base;
    std::size_t bytes;
  };

  // A block of `bytes` from the smallest free range that holds it, or nullopt.
  std::optional<void*> take(std::size_t bytes) {
    auto fit = by_size_.lower_bound({bytes, 0});
    if (fit == by_size_.end()) return std::nullopt;
    auto [range_bytes, address] = *fit;
    by_size_.erase(fit);
    auto range = free_.find(address);
    const std::uintptr_t segment = range->second.segment;
    free_.erase(range);
    if (range_bytes > bytes) insert_free(address + bytes, range_bytes - bytes, segment);
    segments_[segment].free_bytes -= bytes;
    free_bytes_ -= bytes;
    return reinterpret_cast<void*>(address);
  }

  // Adopts a fresh device segment whose whole extent is free.
  void add_segment(void* base, std::size_t bytes) {
    auto address = reinterpret_cast<std::uintptr_t>(base);
    segments_.emplace(address, SegmentInfo{bytes, bytes});
    insert_free(address, bytes, address);
    free_bytes_ += bytes;
    segment_bytes_ += bytes;
  }

  // Takes a block back, merging it with the free ranges on either side in the same segment.
  void give_back(void* ptr, std::size_t bytes) {
    auto address = reinterpret_cast<std::uintptr_t>(ptr);
    auto segment_it = std::prev(segments_.upper_bound(address));
    const std::uintptr_t segment = segment_it->first;
    segment_it->second.free_bytes += bytes;
    free_bytes_ += bytes;
    std::uintptr_t begin = address;
    std::size_t size = bytes;
    auto next = free_.lower_bound(address);
    if (next != free_.end() && next->first == address + bytes && next->second.segment == segment) {
      size += next->second.bytes;
      by_size_.erase({next->second.bytes, next->first});
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto before = std::prev(next);
      if (before->first + before->second.bytes == address && before->second.segment == segment) {
        begin = before->first;
        size += before->second.bytes;
        by_size_.erase({before->second.bytes, before->first});
        free_.erase(before);
      }
    }
    insert_free(begin, size, segment);
  }

  // Removes the segments no live block uses and returns them, for the caller to free on the
  // device; stops once `enough` bytes are out.
  std::vector<Segment> remove_free_segments(std::size_t enough = SIZE_MAX) {
    std::vector<Segment> removed;
    std::size_t bytes_out = 0;
    for (auto it = segments_.begin(); it != segments_.end() && bytes_out < enough;) {
      if (it->second.free_bytes != it->second.bytes) {
        ++it;
        continue;
      }
      auto range = free_.find(it->first);
      by_size_.erase({range->second.bytes, range->first});
      free_.erase(range);
      free_bytes_ -= it->second.bytes;
      segment_bytes_ -= it->second.bytes;
      bytes_out += it->second.bytes;
      removed.push_back({reinterpret_cast<void*>(it->first), it->second.bytes});
      it = segments_.erase(it);
    }
    return removed;
  }

  std::size_t free_bytes() const noexcept { return free_bytes_; }
  std::size_t segment_bytes() const noexcept { return segment_bytes_; }
  // Free bytes inside segments that still hold live blocks: no trim can give them back.
  std::size_t stranded_bytes() const noexcept {
    std::size_t stranded = 0;
    for (const auto& [address, info] : segments_)
      if (info.free_bytes != info.bytes) stranded += info.free_bytes;
    return stranded;
  }
  std::size_t largest_free() const noexcept {
    return by_size_.empty() ? 0 : std::prev(by_size_.end())->first;
  }

 private:
  struct SegmentInfo {
    std::size_t bytes;
    std::size_t free_bytes;
  };
  struct FreeRange {
    std::size_t bytes;
    std::uintptr_t segment;  // ranges of different segments never merge, even when adjacent
  };

  void insert_free(std::uintptr_t address, std::size_t bytes, std::uintptr_t segment) {
    free_.emplace(address, FreeRange{bytes, segment});
    by_size_.emplace(bytes, address);
  }

  std::map<std::uintptr_t, SegmentInfo> segments_;        // by base address
  std::map<std::uintptr_t, FreeRange> free_;              // by address, for merging
  std::set<std::pair<std::size_t, std::uintptr_t>> by_size_;  // (bytes, address), for best fit
  std::size_t free_bytes_ = 0;
  std::size_t segment_bytes_ = 0;
};

}  // namespace gpupool
