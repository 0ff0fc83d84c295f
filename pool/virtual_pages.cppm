// VirtualPages: which pages of a stream's virtual segments have physical memory behind them.
//
// A virtual segment is an address range reserved on the device with no memory behind it
// (Device::reserve_addresses). Its SegmentArena carves blocks from it as from any segment; a page
// gets physical memory (Device::create_page + map_pages) when a block first touches it, and a
// page lying wholly in free space can be unmapped — from the middle of the segment as well as its
// end — to be mapped again wherever a block needs one, or given back to the device. So free
// space is never stranded the way it is in a plain segment that still holds one live block: at
// most the parts of the pages at a live block's two ends.
//
// Plain data, like SegmentArena: no device calls, no locking; DevicePool keeps one beside each
// virtual arena, under the same mutex (pool/virtual_segments.cpp).
module;
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>
module gpupool:virtual_pages;
import :device;
import :segment_arena;

namespace gpupool {

class VirtualPages {
 public:
  explicit VirtualPages(std::size_t page_bytes) : page_(page_bytes) {}

  std::size_t page_bytes() const noexcept { return page_; }
  std::size_t mapped_bytes() const noexcept { return mapped_pages_ * page_; }

  // A reserved range, page aligned, every page unmapped.
  void add_range(void* base, std::size_t bytes) {
    ranges_.emplace(address_of(base), Range{bytes, std::vector<Slot>(bytes / page_), 0});
  }
  // The reserved ranges with no page mapped, taken out of the table for the caller to release.
  struct Reserved { void* base; std::size_t bytes; };
  std::vector<Reserved> remove_unmapped_ranges() {
    std::vector<Reserved> removed;
    for (auto it = ranges_.begin(); it != ranges_.end();) {
      if (it->second.mapped_end != 0) {
        ++it;
        continue;
      }
      removed.push_back({reinterpret_cast<void*>(it->first), it->second.bytes});
      it = ranges_.erase(it);
    }
    return removed;
  }

  // The addresses of the pages that [address, address + bytes) touches and that have no memory.
  std::vector<std::uintptr_t> unmapped_in(std::uintptr_t address, std::size_t bytes) const {
    std::vector<std::uintptr_t> pages;
    const auto& [base, range] = *range_of(address);
    for (std::size_t i = (address - base) / page_; base + i * page_ < address + bytes; ++i)
      if (!range.slots[i].mapped) pages.push_back(base + i * page_);
    return pages;
  }

  // How many of the pages that [address, address + bytes) touches have no memory.
  std::size_t unmapped_count(std::uintptr_t address, std::size_t bytes) const noexcept {
    const auto& [base, range] = *range_of(address);
    std::size_t count = 0;
    for (std::size_t i = (address - base) / page_; base + i * page_ < address + bytes; ++i)
      count += range.slots[i].mapped ? 0 : 1;
    return count;
  }

  // Whether every page that [address, address + bytes) touches has memory (no allocation: the
  // question a hit asks).
  bool all_mapped(std::uintptr_t address, std::size_t bytes) const noexcept {
    const auto& [base, range] = *range_of(address);
    const std::size_t end = (address + bytes - base + page_ - 1) / page_;
    if (end > range.mapped_end) return false;
    for (std::size_t i = (address - base) / page_; i < end; ++i)
      if (!range.slots[i].mapped) return false;
    return true;
  }

  // f(address, bytes) for each run of consecutive mapped pages.
  template <class F>
  void for_each_mapped_run(F&& f) const {
    for (const auto& [base, range] : ranges_)
      for (std::size_t i = 0; i < range.mapped_end;) {
        if (!range.slots[i].mapped) {
          ++i;
          continue;
        }
        std::size_t end = i + 1;
        while (end < range.mapped_end && range.slots[end].mapped) ++end;
        f(base + i * page_, (end - i) * page_);
        i = end;
      }
  }

  void set_mapped(std::uintptr_t page_address, PhysicalPage page) {
    auto& [base, range] = *range_of(page_address);
    const std::size_t i = (page_address - base) / page_;
    range.slots[i] = Slot{page, true};
    range.mapped_end = std::max(range.mapped_end, i + 1);
    ++mapped_pages_;
  }
  PhysicalPage set_unmapped(std::uintptr_t page_address) {
    auto& [base, range] = *range_of(page_address);
    const std::size_t i = (page_address - base) / page_;
    const PhysicalPage page = range.slots[i].page;
    range.slots[i] = Slot{};
    while (range.mapped_end > 0 && !range.slots[range.mapped_end - 1].mapped) --range.mapped_end;
    --mapped_pages_;
    return page;
  }

  // Mapped pages lying wholly inside the arena's free ranges, at most `limit` of them: memory no
  // block uses, to be unmapped.
  std::vector<std::uintptr_t> free_mapped_pages(const SegmentArena& arena,
                                                std::size_t limit) const {
    std::vector<std::uintptr_t> pages;
    arena.for_each_free_range([&](std::uintptr_t start, std::size_t bytes) {
      for_each_mapped_page(start, bytes, [&](std::uintptr_t page, bool whole) {
        if (whole && pages.size() < limit) pages.push_back(page);
      });
    });
    return pages;
  }

  // The same, the highest addresses first: the pages a good fit reaches last, so that a page
  // moved away is the least likely to be needed back soon.
  std::vector<std::uintptr_t> highest_free_mapped_pages(const SegmentArena& arena,
                                                        std::size_t limit) const {
    std::vector<std::uintptr_t> pages = free_mapped_pages(arena, SIZE_MAX);
    std::reverse(pages.begin(), pages.end());
    if (pages.size() > limit) pages.resize(limit);
    return pages;
  }

  // Free bytes of mapped pages that also hold part of a live block: no trim can give them back.
  std::size_t stranded_bytes(const SegmentArena& arena) const {
    std::size_t stranded = 0;
    arena.for_each_free_range([&](std::uintptr_t start, std::size_t bytes) {
      for_each_mapped_page(start, bytes, [&](std::uintptr_t page, bool whole) {
        if (!whole) stranded += overlap(page, start, bytes);
      });
    });
    return stranded;
  }

  // The longest run of free bytes with memory behind them.
  std::size_t largest_free(const SegmentArena& arena) const {
    std::size_t largest = 0;
    arena.for_each_free_range([&](std::uintptr_t start, std::size_t bytes) {
      std::size_t run = 0;
      std::uintptr_t next = 0;
      for_each_mapped_page(start, bytes, [&](std::uintptr_t page, bool) {
        if (page != next) run = 0;
        run += overlap(page, start, bytes);
        next = page + page_;
        largest = std::max(largest, run);
      });
    });
    return largest;
  }

 private:
  struct Slot {
    PhysicalPage page;
    bool mapped = false;
  };
  struct Range {
    std::size_t bytes;
    std::vector<Slot> slots;     // one per page
    std::size_t mapped_end;      // one past the last mapped page: walks stop there
  };

  static std::uintptr_t address_of(void* p) { return reinterpret_cast<std::uintptr_t>(p); }
  std::map<std::uintptr_t, Range>::iterator range_of(std::uintptr_t address) {
    return std::prev(ranges_.upper_bound(address));
  }
  std::map<std::uintptr_t, Range>::const_iterator range_of(std::uintptr_t address) const {
    return std::prev(ranges_.upper_bound(address));
  }
  std::size_t overlap(std::uintptr_t page, std::uintptr_t start, std::size_t bytes) const {
    return std::min(page + page_, start + bytes) - std::max(page, start);
  }

  // f(page address, whether the page lies wholly inside [start, start + bytes)) for each mapped
  // page that the range touches (a free range never crosses a reserved range's end).
  template <class F>
  void for_each_mapped_page(std::uintptr_t start, std::size_t bytes, F&& f) const {
    const auto& [base, range] = *range_of(start);
    const std::size_t end = std::min((start + bytes - base + page_ - 1) / page_, range.mapped_end);
    for (std::size_t i = (start - base) / page_; i < end; ++i) {
      if (!range.slots[i].mapped) continue;
      const std::uintptr_t page = base + i * page_;
      f(page, page >= start && page + page_ <= start + bytes);
    }
  }

  std::size_t page_;
  std::map<std::uintptr_t, Range> ranges_;  // by base address
  std::size_t mapped_pages_ = 0;
};

}  // namespace gpupool
