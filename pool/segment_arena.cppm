// SegmentArena: large blocks carved from device segments, good fit, coalesced on free.
//
// Blocks above 64 KiB (pool/size_classes.cppm's kArenaThreshold) do not get one device allocation
// each: a class-per-block cache strands memory in classes the workload has stopped asking for
// (peak reserved / peak requested ≈ 1.9 on a uniform 1 B–4 MiB trace; 1.09 with segments). Instead they are cut from
// segments — a few tens of MiB each, or exactly the block when the device is nearly full — and
// a freed block merges with its free neighbours, so the memory serves whatever size comes next.
// docs/pool.md has the measurements behind the choice.
//
// Every operation is O(1) (as in TLSF): free ranges sit in bins by size class (the pool's own
// classes, 16 per power of two) with a bitmap of the non-empty bins, so a request takes a range
// from its own bin when one of the last few there fits, else from the first non-empty bin above —
// within 1/16 of the best fit — and a free
// finds its neighbours by address in two hash maps (range starts, range ends). The ordered trees
// this replaced cost most of the time of a random allocation trace.
//
// The arena is plain data: no device calls and no locking. DevicePool owns one per (stream,
// thread shard) behind a mutex, asks the device for segments and gives fully free ones back.
module;
#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>
module gpupool:segment_arena;
import :size_classes;

namespace gpupool {

class SegmentArena {
 public:
  struct Segment {
    void* base;
    std::size_t bytes;
  };

  // A block of `bytes` (a multiple of the alignment) from a free range of the smallest bin that
  // holds it, or nullopt. The range's remainder stays where it was.
  std::optional<void*> take(std::size_t bytes) {
    const std::optional<std::uint32_t> found = find_range(bytes);
    if (!found) return std::nullopt;
    const std::uint32_t id = *found;
    Range& range = ranges_[id];
    const std::uintptr_t address = range.address;
    segments_.find(range.segment)->second.free_bytes -= bytes;
    free_bytes_ -= bytes;
    if (range.bytes == bytes) {
      by_start_.erase(address);
      by_end_.erase(address + bytes);
      unbin(id);
      release(id);
    } else {  // the remainder keeps its end, so only its start key moves
      rekey(by_start_, address, address + bytes);
      range.address += bytes;
      range.bytes -= bytes;
      rebin(id);
    }
    return reinterpret_cast<void*>(address);
  }

  // Adopts a fresh device segment whose whole extent is free.
  void add_segment(void* base, std::size_t bytes) {
    if (!bins_) bins_ = std::make_unique<std::vector<std::uint32_t>[]>(kBins);  // on first use
    auto address = reinterpret_cast<std::uintptr_t>(base);
    segments_.emplace(address, SegmentInfo{bytes, bytes});
    insert_free(address, bytes, address);
    free_bytes_ += bytes;
    segment_bytes_ += bytes;
  }

  // Takes a block back, merging it with the free ranges on either side in the same segment
  // (re-using their records and hash nodes: a merge allocates nothing).
  void give_back(void* ptr, std::size_t bytes) {
    auto address = reinterpret_cast<std::uintptr_t>(ptr);
    auto segment_it = std::prev(segments_.upper_bound(address));
    const std::uintptr_t segment = segment_it->first;
    segment_it->second.free_bytes += bytes;
    free_bytes_ += bytes;
    const std::optional<std::uint32_t> before = neighbour(by_end_, address, segment);
    const std::optional<std::uint32_t> after = neighbour(by_start_, address + bytes, segment);
    if (before && after) {  // before grows over the block and `after`; `after` goes
      Range& first = ranges_[*before];
      const Range second = ranges_[*after];
      by_end_.erase(address);
      by_start_.erase(second.address);
      by_end_[second.address + second.bytes] = *before;
      unbin(*after);
      release(*after);
      first.bytes += bytes + second.bytes;
      rebin(*before);
    } else if (before) {
      rekey(by_end_, address, address + bytes);
      ranges_[*before].bytes += bytes;
      rebin(*before);
    } else if (after) {
      rekey(by_start_, address + bytes, address);
      ranges_[*after].address = address;
      ranges_[*after].bytes += bytes;
      rebin(*after);
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
      bytes_out += it->second.bytes;
      removed.push_back({reinterpret_cast<void*>(it->first), it->second.bytes});
      it = erase_free_segment(it);
    }
    return removed;
  }
  // Removes the segment at `base` if no live block uses it.
  bool remove_segment_if_free(void* base) {
    auto it = segments_.find(reinterpret_cast<std::uintptr_t>(base));
    if (it == segments_.end() || it->second.free_bytes != it->second.bytes) return false;
    erase_free_segment(it);
    return true;
  }

  // f(address, bytes) for every free range.
  template <class F>
  void for_each_free_range(F&& f) const {
    for (const auto& [address, id] : by_start_) f(address, ranges_[id].bytes);
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
    for (int word = kWords - 1; word >= 0 && bins_; --word) {
      if (!nonempty_[word]) continue;
      const int bin = word * 64 + 63 - std::countl_zero(nonempty_[word]);
      std::size_t largest = 0;
      for (std::uint32_t id : bins_[bin]) largest = std::max(largest, ranges_[id].bytes);
      return largest;
    }
    return 0;
  }

 private:
  struct SegmentInfo {
    std::size_t bytes;
    std::size_t free_bytes;
  };
  struct Range {
    std::uintptr_t address;
    std::size_t bytes;
    std::uintptr_t segment;  // ranges of different segments never merge, even when adjacent
    int bin;
    std::uint32_t slot;      // index in bins_[bin]
  };
  // Bin b holds the ranges whose size is at least class b's bytes and below class b+1's.
  static constexpr int kBins = size_classes::kClassCount;
  static constexpr int kWords = (kBins + 63) / 64;
  using AddressIndex = std::unordered_map<std::uintptr_t, std::uint32_t>;

  // A segment that is one free range.
  std::map<std::uintptr_t, SegmentInfo>::iterator erase_free_segment(
      std::map<std::uintptr_t, SegmentInfo>::iterator it) {
    const std::uint32_t id = by_start_.find(it->first)->second;
    by_start_.erase(it->first);
    by_end_.erase(it->first + it->second.bytes);
    unbin(id);
    release(id);
    free_bytes_ -= it->second.bytes;
    segment_bytes_ -= it->second.bytes;
    return segments_.erase(it);
  }

  static bool is_class_size(std::size_t bytes) noexcept {
    return size_classes::class_bytes(size_classes::class_of(bytes)) == bytes;
  }
  static int floor_bin(std::size_t bytes) noexcept {
    const auto c = static_cast<int>(size_classes::class_of(bytes));
    return is_class_size(bytes) ? c : c - 1;
  }

  // The first non-empty bin from `bin` up, or -1: every range there holds class `bin`'s bytes.
  int first_bin_from(int bin) const noexcept {
    if (bin >= kBins) return -1;
    int word = bin / 64;
    std::uint64_t bits = nonempty_[word] & (~std::uint64_t{0} << (bin % 64));
    while (!bits) {
      if (++word == kWords) return -1;
      bits = nonempty_[word];
    }
    return word * 64 + std::countr_zero(bits);
  }
  // A free range of at least `bytes`: in the bin of `bytes` itself when one of its last few
  // ranges is large enough (a block of its own size rather than a class's: the bin holds larger
  // and smaller ranges), else from the first non-empty bin above, where every range fits.
  std::optional<std::uint32_t> find_range(std::size_t bytes) const noexcept {
    if (!bins_) return std::nullopt;
    const int floor = floor_bin(bytes);
    if (!is_class_size(bytes)) {
      const std::vector<std::uint32_t>& ids = bins_[floor];
      std::optional<std::uint32_t> best;
      const std::size_t scan = std::min<std::size_t>(ids.size(), kFloorScan);
      for (std::size_t i = ids.size() - scan; i < ids.size(); ++i)
        if (ranges_[ids[i]].bytes >= bytes && (!best || ranges_[ids[i]].bytes < ranges_[*best].bytes))
          best = ids[i];
      if (best) return best;
    }
    const int bin = first_bin_from(is_class_size(bytes) ? floor : floor + 1);
    if (bin < 0) return std::nullopt;
    return pick(bin);
  }
  static constexpr std::size_t kFloorScan = 8;

  // The smallest of a few ranges of the bin (they differ by at most 1/16): closer to best fit at
  // the cost of a short scan.
  std::uint32_t pick(int bin) const noexcept {
    const std::vector<std::uint32_t>& ids = bins_[bin];
    std::uint32_t best = ids.back();
    const std::size_t scan = std::min<std::size_t>(ids.size(), 4);
    for (std::size_t i = ids.size() - scan; i < ids.size(); ++i)
      if (ranges_[ids[i]].bytes < ranges_[best].bytes) best = ids[i];
    return best;
  }

  std::optional<std::uint32_t> neighbour(const AddressIndex& index, std::uintptr_t key,
                                         std::uintptr_t segment) const {
    auto it = index.find(key);
    if (it == index.end() || ranges_[it->second].segment != segment) return std::nullopt;
    return it->second;
  }
  static void rekey(AddressIndex& index, std::uintptr_t from, std::uintptr_t to) {
    auto node = index.extract(from);
    node.key() = to;
    index.insert(std::move(node));
  }

  void insert_free(std::uintptr_t address, std::size_t bytes, std::uintptr_t segment) {
    std::uint32_t id;
    if (!unused_.empty()) {
      id = unused_.back();
      unused_.pop_back();
    } else {
      id = static_cast<std::uint32_t>(ranges_.size());
      ranges_.emplace_back();
    }
    ranges_[id] = Range{address, bytes, segment, -1, 0};
    by_start_.emplace(address, id);
    by_end_.emplace(address + bytes, id);
    rebin(id);
  }
  void release(std::uint32_t id) { unused_.push_back(id); }

  void unbin(std::uint32_t id) noexcept {
    Range& range = ranges_[id];
    std::vector<std::uint32_t>& ids = bins_[range.bin];
    const std::uint32_t moved = ids.back();
    ids[range.slot] = moved;
    ranges_[moved].slot = range.slot;
    ids.pop_back();
    if (ids.empty()) nonempty_[range.bin / 64] &= ~(std::uint64_t{1} << (range.bin % 64));
    range.bin = -1;
  }
  void rebin(std::uint32_t id) {
    Range& range = ranges_[id];
    const int bin = floor_bin(range.bytes);
    if (range.bin == bin) return;
    if (range.bin >= 0) unbin(id);
    range.bin = bin;
    range.slot = static_cast<std::uint32_t>(bins_[bin].size());
    bins_[bin].push_back(id);
    nonempty_[bin / 64] |= std::uint64_t{1} << (bin % 64);
  }

  std::map<std::uintptr_t, SegmentInfo> segments_;  // by base address
  std::vector<Range> ranges_;                      // free ranges, by id
  std::vector<std::uint32_t> unused_;              // ids of ranges_ free for reuse
  std::unique_ptr<std::vector<std::uint32_t>[]> bins_;  // kBins of them, made with the first segment
  std::array<std::uint64_t, kWords> nonempty_{};
  AddressIndex by_start_, by_end_;                 // range start / end address → id
  std::size_t free_bytes_ = 0;
  std::size_t segment_bytes_ = 0;
};

}  // namespace gpupool
