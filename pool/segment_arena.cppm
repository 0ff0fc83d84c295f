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

  // A block of `bytes` from the smallest free range that holds it, or nullopt. The range's
  // remainder keeps the range's tree nodes (re-keyed, not reallocated): no heap traffic.
  std::optional<void*> take(std::size_t bytes) {
    auto fit = by_size_.lower_bound({bytes, 0});
    if (fit == by_size_.end()) return std::nullopt;
    auto [range_bytes, address] = *fit;
    auto size_node = by_size_.extract(fit);
    auto range = free_.find(address);
    const std::uintptr_t segment = range->second.segment;
    if (range_bytes > bytes) {
      auto range_node = free_.extract(range);
      range_node.key() = address + bytes;
      range_node.mapped().bytes = range_bytes - bytes;
      free_.insert(std::move(range_node));
      size_node.value() = {range_bytes - bytes, address + bytes};
      by_size_.insert(std::move(size_node));
    } else {
      free_.erase(range);
    }
    segments_.find(segment)->second.free_bytes -= bytes;
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

  // Takes a block back, merging it with the free ranges on either side in the same segment
  // (re-using their tree nodes: a merge allocates nothing).
  void give_back(void* ptr, std::size_t bytes) {
    auto address = reinterpret_cast<std::uintptr_t>(ptr);
    auto segment_it = std::prev(segments_.upper_bound(address));
    const std::uintptr_t segment = segment_it->first;
    segment_it->second.free_bytes += bytes;
    free_bytes_ += bytes;
    auto next = free_.lower_bound(address);
    auto before = next == free_.begin() ? free_.end() : std::prev(next);
    const bool merge_next =
        next != free_.end() && next->first == address + bytes && next->second.segment == segment;
    const bool merge_before = before != free_.end() &&
                              before->first + before->second.bytes == address &&
                              before->second.segment == segment;
    if (merge_before) {  // grows in place: its key (address) stays
      std::size_t size = before->second.bytes + bytes;
      if (merge_next) {
        size += next->second.bytes;
        by_size_.erase({next->second.bytes, next->first});
        free_.erase(next);
      }
      resize(before, size);
    } else if (merge_next) {  // starts earlier now: re-keyed
      const std::size_t size = next->second.bytes + bytes;
      auto size_node = by_size_.extract({next->second.bytes, next->first});
      auto range_node = free_.extract(next);
      range_node.key() = address;
      range_node.mapped().bytes = size;
      free_.insert(std::move(range_node));
      size_node.value() = {size, address};
      by_size_.insert(std::move(size_node));
    } else {
      insert_free(address, bytes, segment);
    }
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

  void resize(std::map<std::uintptr_t, FreeRange>::iterator range, std::size_t bytes) {
    auto size_node = by_size_.extract({range->second.bytes, range->first});
    size_node.value().first = bytes;
    by_size_.insert(std::move(size_node));
    range->second.bytes = bytes;
  }

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
