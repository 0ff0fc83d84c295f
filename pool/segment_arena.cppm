// SegmentArena: large blocks carved from device segments, good fit, coalesced on free.
//
// Blocks above 64 KiB (4 KiB with virtual segments: pool/size_classes.cppm) do not get one device allocation
// each: a class-per-block cache strands memory in classes the workload has stopped asking for
// (peak reserved / peak requested ≈ 1.9 on a uniform 1 B–4 MiB trace; 1.09 with segments). Instead
// they are cut from segments — a few tens of MiB each, or exactly the block when the device is
// nearly full — and a freed block merges with its free neighbours, so the memory serves whatever
// size comes next. docs/pool.md has the measurements behind the choice.
//
// Every operation is O(1), as in TLSF. Each segment is a chain of spans in address order, free or
// taken, each linked to its neighbours: boundary tags kept on the host (device memory cannot hold
// them). A block is handed out with its span's id, and its free finds both neighbours through
// that span, with no search by address. Free spans sit in bins by size class (the pool's own
// classes, 16 per power of two), each a list threaded through the spans themselves, newest
// first, with a bitmap of the non-empty bins: a request takes the smallest of the first few spans
// of its own bin that holds it, else a span of the first non-empty bin above (within 1/16 of the
// best fit). Filing a span is a few pointer writes — no container grows on the way.
//
// The arena is plain data: no device calls and no locking. DevicePool owns one per (stream,
// thread shard) behind a mutex, asks the device for segments and gives fully free ones back.
module;
#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
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
  // A block taken from the arena: its address and the span that give_back() needs.
  struct Block {
    void* ptr;
    std::uint32_t span;
  };

  // A block of `bytes` (a multiple of the alignment), or nullopt when no free span holds it. The
  // span's remainder stays free, in place.
  std::optional<Block> take(std::size_t bytes) {
    const std::optional<std::uint32_t> found = find_free(bytes);
    if (!found) return std::nullopt;
    const std::uint32_t id = *found;
    segments_[spans_[id].segment].free_bytes -= bytes;
    free_bytes_ -= bytes;
    if (spans_[id].bytes == bytes) {
      unbin(id);
      spans_[id].free = false;
      return Block{reinterpret_cast<void*>(spans_[id].address), id};
    }
    // The block is a new span in front of the free one, which keeps the rest.
    const std::uint32_t taken = new_span();
    Span& rest = spans_[id];
    spans_[taken] = Span{rest.address, bytes, rest.prev, id, kNone, kNone, rest.segment, -1, false};
    link_before(taken, rest.prev);
    rest.prev = taken;
    rest.address += bytes;
    rest.bytes -= bytes;
    bin(id);  // the rest keeps its place when it stays in the same bin
    return Block{reinterpret_cast<void*>(spans_[taken].address), taken};
  }

  // Adopts a fresh device segment whose whole extent is free.
  void add_segment(void* base, std::size_t bytes) {
    if (!heads_) {  // on first use: most of a pool's arenas (a shard per stream) never hold one
      heads_ = std::make_unique<std::uint32_t[]>(kBins);
      std::fill_n(heads_.get(), kBins, kNone);
    }
    const auto address = reinterpret_cast<std::uintptr_t>(base);
    std::uint32_t segment;
    if (!unused_segments_.empty()) {
      segment = unused_segments_.back();
      unused_segments_.pop_back();
    } else {
      segment = static_cast<std::uint32_t>(segments_.size());
      segments_.emplace_back();
    }
    const std::uint32_t span = new_span();
    spans_[span] = Span{address, bytes, kNone, kNone, kNone, kNone, segment, -1, true};
    segments_[segment] = SegmentInfo{address, bytes, bytes, span};
    by_base_.emplace(address, segment);
    bin(span);
    free_bytes_ += bytes;
    segment_bytes_ += bytes;
  }

  // Takes block `span` back, merging it with the free spans on either side in its segment.
  void give_back(std::uint32_t span) {
    Span& block = spans_[span];
    block.free = true;
    segments_[block.segment].free_bytes += block.bytes;
    free_bytes_ += block.bytes;
    if (const std::uint32_t next = block.next; next != kNone && spans_[next].free) {
      unbin(next);
      block.bytes += spans_[next].bytes;
      block.next = spans_[next].next;
      if (block.next != kNone) spans_[block.next].prev = span;
      release(next);
    }
    std::uint32_t merged = span;
    if (const std::uint32_t prev = block.prev; prev != kNone && spans_[prev].free) {
      unbin(prev);
      spans_[prev].bytes += block.bytes;
      spans_[prev].next = block.next;
      if (block.next != kNone) spans_[block.next].prev = prev;
      release(span);
      merged = prev;
    }
    bin(merged);
  }

  // Removes one segment no live block uses, of at least `bytes`, and returns it (for another
  // arena to add); nullopt when there is none.
  std::optional<Segment> remove_free_segment(std::size_t bytes) {
    for (auto it = by_base_.begin(); it != by_base_.end(); ++it) {
      const SegmentInfo& info = segments_[it->second];
      if (info.free_bytes != info.bytes || info.bytes < bytes) continue;
      const Segment removed{reinterpret_cast<void*>(info.base), info.bytes};
      erase_free_segment(it);
      return removed;
    }
    return std::nullopt;
  }

  // Removes the segments no live block uses and returns them, for the caller to free on the
  // device; stops once `enough` bytes are out.
  std::vector<Segment> remove_free_segments(std::size_t enough = SIZE_MAX) {
    std::vector<Segment> removed;
    std::size_t bytes_out = 0;
    for (auto it = by_base_.begin(); it != by_base_.end() && bytes_out < enough;) {
      const SegmentInfo& info = segments_[it->second];
      if (info.free_bytes != info.bytes) {
        ++it;
        continue;
      }
      bytes_out += info.bytes;
      removed.push_back({reinterpret_cast<void*>(info.base), info.bytes});
      it = erase_free_segment(it);
    }
    return removed;
  }
  // Removes the segment at `base` if no live block uses it.
  bool remove_segment_if_free(void* base) {
    auto it = by_base_.find(reinterpret_cast<std::uintptr_t>(base));
    if (it == by_base_.end()) return false;
    const SegmentInfo& info = segments_[it->second];
    if (info.free_bytes != info.bytes) return false;
    erase_free_segment(it);
    return true;
  }

  // f(address, bytes) for every free span, in address order.
  template <class F>
  void for_each_free_range(F&& f) const {
    for (const auto& [base, segment] : by_base_)
      for (std::uint32_t id = segments_[segment].first; id != kNone; id = spans_[id].next)
        if (spans_[id].free) f(spans_[id].address, spans_[id].bytes);
  }

  std::size_t free_bytes() const noexcept { return free_bytes_; }
  std::size_t segment_bytes() const noexcept { return segment_bytes_; }
  // Free bytes inside segments that still hold live blocks: no trim can give them back.
  std::size_t stranded_bytes() const noexcept {
    std::size_t stranded = 0;
    for (const auto& [base, segment] : by_base_) {
      const SegmentInfo& info = segments_[segment];
      if (info.free_bytes != info.bytes) stranded += info.free_bytes;
    }
    return stranded;
  }
  std::size_t largest_free() const noexcept {
    for (int word = kWords - 1; word >= 0 && heads_; --word) {
      if (!nonempty_[word]) continue;
      const int b = word * 64 + 63 - std::countl_zero(nonempty_[word]);
      std::size_t largest = 0;
      for (std::uint32_t id = heads_[b]; id != kNone; id = spans_[id].next_free)
        largest = std::max(largest, spans_[id].bytes);
      return largest;
    }
    return 0;
  }

 private:
  static constexpr std::uint32_t kNone = UINT32_MAX;
  struct SegmentInfo {
    std::uintptr_t base;
    std::size_t bytes;
    std::size_t free_bytes;
    std::uint32_t first;  // its lowest span
  };
  struct Span {
    std::uintptr_t address;
    std::size_t bytes;
    std::uint32_t prev, next;            // neighbours in the segment, by address; kNone at its ends
    std::uint32_t prev_free, next_free;  // neighbours in its bin's list while free
    std::uint32_t segment;               // spans of different segments never merge, even when adjacent
    int bin;                             // -1 while taken
    bool free;
  };
  // Bin b holds the free spans whose size is at least class b's bytes and below class b+1's.
  static constexpr int kBins = size_classes::kClassCount;
  static constexpr int kWords = (kBins + 63) / 64;
  static constexpr std::size_t kFloorScan = 8;
  static constexpr std::size_t kPickScan = 4;

  // A segment that is one free span.
  std::map<std::uintptr_t, std::uint32_t>::iterator erase_free_segment(
      std::map<std::uintptr_t, std::uint32_t>::iterator it) {
    const std::uint32_t segment = it->second;
    const std::uint32_t span = segments_[segment].first;
    unbin(span);
    release(span);
    free_bytes_ -= segments_[segment].bytes;
    segment_bytes_ -= segments_[segment].bytes;
    unused_segments_.push_back(segment);
    return by_base_.erase(it);
  }

  // Makes `span` the successor of `prev` (or its segment's first span when prev is kNone).
  void link_before(std::uint32_t span, std::uint32_t prev) {
    if (prev == kNone) segments_[spans_[span].segment].first = span;
    else spans_[prev].next = span;
  }

  static int floor_bin(std::size_t bytes) noexcept {
    return static_cast<int>(size_classes::floor_class_of(bytes));
  }

  // A free span of at least `bytes`: in the bin of `bytes` itself when one of its first few spans
  // is large enough (a block of its own size rather than a class's: the bin holds larger and
  // smaller spans), else from the first non-empty bin above, where every span fits.
  std::optional<std::uint32_t> find_free(std::size_t bytes) const noexcept {
    if (!heads_) return std::nullopt;
    const int floor = floor_bin(bytes);
    const bool class_size =
        size_classes::class_bytes(static_cast<std::uint32_t>(floor)) == bytes;
    const int c = class_size ? floor : floor + 1;  // the class of `bytes`
    if (!class_size) {  // the floor bin: spans from a smaller size up to above `bytes`
      std::uint32_t best = kNone;
      std::size_t scanned = 0;
      for (std::uint32_t id = heads_[floor]; id != kNone && scanned < kFloorScan;
           id = spans_[id].next_free, ++scanned)
        if (spans_[id].bytes >= bytes && (best == kNone || spans_[id].bytes < spans_[best].bytes))
          best = id;
      if (best != kNone) return best;
    }
    const int b = first_bin_from(c);  // from here up, every span holds `bytes`
    if (b < 0) return std::nullopt;
    return pick(b);
  }
  // The first non-empty bin from `b` up, or -1: every span there holds class `b`'s bytes.
  int first_bin_from(int b) const noexcept {
    if (b >= kBins) return -1;
    int word = b / 64;
    std::uint64_t bits = nonempty_[word] & (~std::uint64_t{0} << (b % 64));
    while (!bits) {
      if (++word == kWords) return -1;
      bits = nonempty_[word];
    }
    return word * 64 + std::countr_zero(bits);
  }
  // The smallest of the first few spans of the bin (they differ by at most 1/16): closer to best
  // fit at the cost of a short scan.
  std::uint32_t pick(int b) const noexcept {
    std::uint32_t best = heads_[b];
    std::size_t scanned = 1;
    for (std::uint32_t id = spans_[best].next_free; id != kNone && scanned < kPickScan;
         id = spans_[id].next_free, ++scanned)
      if (spans_[id].bytes < spans_[best].bytes) best = id;
    return best;
  }

  std::uint32_t new_span() {
    if (!unused_spans_.empty()) {
      const std::uint32_t id = unused_spans_.back();
      unused_spans_.pop_back();
      return id;
    }
    spans_.emplace_back();
    return static_cast<std::uint32_t>(spans_.size() - 1);
  }
  void release(std::uint32_t id) { unused_spans_.push_back(id); }

  void unbin(std::uint32_t id) noexcept {
    Span& span = spans_[id];
    if (span.prev_free != kNone) spans_[span.prev_free].next_free = span.next_free;
    else heads_[span.bin] = span.next_free;
    if (span.next_free != kNone) spans_[span.next_free].prev_free = span.prev_free;
    const auto b = static_cast<unsigned>(span.bin);
    if (heads_[b] == kNone) nonempty_[b / 64] &= ~(std::uint64_t{1} << (b % 64));
    span.bin = -1;
  }
  // Files free span `id` first in the bin of its size (where it is already, it stays).
  void bin(std::uint32_t id) noexcept {
    Span& span = spans_[id];
    const int b = floor_bin(span.bytes);
    if (span.bin == b) return;
    if (span.bin >= 0) unbin(id);
    span.bin = b;
    span.prev_free = kNone;
    span.next_free = heads_[b];
    if (span.next_free != kNone) spans_[span.next_free].prev_free = id;
    heads_[b] = id;
    nonempty_[static_cast<unsigned>(b) / 64] |= std::uint64_t{1} << (static_cast<unsigned>(b) % 64);
  }

  std::vector<SegmentInfo> segments_;               // by id
  std::vector<std::uint32_t> unused_segments_;      // ids of segments_ free for reuse
  std::map<std::uintptr_t, std::uint32_t> by_base_;  // segment base → id (trims, figures)
  std::vector<Span> spans_;                         // by id
  std::vector<std::uint32_t> unused_spans_;         // ids of spans_ free for reuse
  std::unique_ptr<std::uint32_t[]> heads_;          // each bin's first span; made with the first segment
  std::array<std::uint64_t, kWords> nonempty_{};
  std::size_t free_bytes_ = 0;
  std::size_t segment_bytes_ = 0;
};

}  // namespace gpupool
