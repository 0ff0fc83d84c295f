// Virtual segments (PoolConfig::virtual_segments): blocks above 4 KiB carved from address ranges
// reserved without memory, one range per (stream, thread shard) growing by more ranges only when
// one is too fragmented to hold a block. A block's pages get memory when it is taken:
//
//   take_from_virtual_arena()  room under the hard limit, then the OOM ladder around
//   try_take_virtual()         a block from the shard's arena (a new range if none fits), then
//   back_with_pages()          new pages for the pages it touches that have none
//
// A free is the arena's merge and nothing else. Trims (release_free_pages) unmap the pages lying
// wholly in free space, from the middle of a range as well as its end — so under the hard limit
// or out of device memory, the free space between live blocks becomes pages for the block that
// needs them, which plain segments cannot do once a segment holds one live block.
//
// While memory is plentiful, pages move only under a page budget (PoolConfig::virtual_page_slack,
// off by default), when a block would otherwise raise the most the pool has reserved past
// (1 + slack) x the most bytes in use (page_budget, move_free_pages). A move synchronizes the
// device and unmaps (a TLB shootdown): moving on every miss made PyTorch's ResNet-50 training
// steps 2.8x slower on an H200, and even held to a budget of 0.01 the moves recur every step of
// a workload that repeats (1.9x slower steps). Held to it, PyTorch's recorded training traces
// reserve their peak plus the slack plus the free parts of pages shared with live blocks, where
// without moves a block too large for any hole maps new pages beside hundreds of MiB of free
// ones (docs/pool.md).
module;
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <functional>
#include <memory>
#include <mutex>
#include "word_lock.hpp"  // the arena shards' lock
#include <optional>
#include <span>
#include <vector>
module gpupool;
import :device_pool;
import :segment_arena;
import :virtual_pages;

namespace gpupool {

Result<DevicePool::Taken> DevicePool::take_from_virtual_arena(ArenaShard& shard,
                                                              std::uint32_t size_class,
                                                              std::size_t block_bytes,
                                                              std::size_t requested_bytes) {
  // Room for the pages the block may need, made before any shard lock is held (trims take them).
  limit_.make_room(block_bytes + 2 * page_bytes_, reservations_, *this);
  // A hit reads no figure the device would have to give (pressure reads its memory).
  bool hit = true;
  std::optional<double> pressure_before;  // set when pages are made
  std::uint32_t span = 0;
  PageBudget budget = page_budget(block_bytes, /*exact=*/false);
  auto attempt = [&] {
    return try_take_virtual(shard, block_bytes, requested_bytes, span, hit, pressure_before,
                            budget);
  };
  auto ptr = through_oom_ladder(requested_bytes, attempt);
  if (ptr && !*ptr) {
    // The block would pass the budget read from the peak alone: again with the exact one, read
    // with no shard lock held (it takes the thread caches' locks).
    budget = page_budget(block_bytes, /*exact=*/true);
    ptr = through_oom_ladder(requested_bytes, attempt);
  }
  if (pressure_before) after_reservation_growth(*pressure_before);
  if (!ptr) return std::unexpected(ptr.error());
  return Taken{{*ptr, nullptr, &shard, block_bytes, size_class, Precision::Bytes, span}, hit};
}

// The page budget (PageBudget): unbounded where pages move only under a limit.
DevicePool::PageBudget DevicePool::page_budget(std::size_t block_bytes, bool exact) const {
  if (page_budget_factor_ == 0.0) return {};
  const std::size_t in_use = exact ? live_bytes().in_use : 0;
  // An initial reservation is memory the user asked to keep: the budget never moves it away.
  const std::size_t most = std::max(
      {exact ? std::max(counters_.most_in_use(in_use), in_use + block_bytes)
             : counters_.most_in_use(0),
       policies_->config.initial_reservation});
  const double scaled = page_budget_factor_ * static_cast<double>(most);
  // Never below the most the pool has reserved: a move only keeps that peak from growing, and
  // below it new pages cost no more than a move (which leaves the layout to move again).
  const std::size_t limit = std::max(
      scaled < 0x1p63 ? static_cast<std::size_t>(scaled) : SIZE_MAX, reservations_.most());
  return {limit, most, exact};
}

// One attempt, under the shard's lock. On failure the block goes back to the arena; pages made
// for it stay reserved only where they were mapped. Null (the block back in the arena) when the
// block's new pages would pass a budget that is not exact: the caller asks again with one.
Result<void*> DevicePool::try_take_virtual(ArenaShard& shard, std::size_t block_bytes,
                                           std::size_t requested_bytes, std::uint32_t& span,
                                           bool& hit, std::optional<double>& pressure_before,
                                           const PageBudget& budget) {
  std::unique_lock lock = lock_own_shard(shard);
  if (!shard.pages) shard.pages = std::make_unique<VirtualPages>(page_bytes_);
  auto block = shard.arena.take(block_bytes);
  if (!block) {
    if (auto reserved = reserve_virtual_range(shard, block_bytes); !reserved)
      return std::unexpected(reserved.error());
    block = shard.arena.take(block_bytes);  // the new range holds the block
  }
  const auto address = reinterpret_cast<std::uintptr_t>(block->ptr);
  std::vector<PhysicalPage> moved;
  if (budget.limit != SIZE_MAX) {
    const std::size_t new_pages = shard.pages->unmapped_count(address, block_bytes);
    const std::size_t after = reservations_.reserved() + new_pages * page_bytes_;
    // Nothing to move (a pool warming up): new pages, without reading the exact budget.
    if (new_pages && after > budget.limit &&
        !shard.pages->free_mapped_pages(shard.arena, 1).empty()) {
      if (!budget.exact) {
        shard.arena.give_back(block->span);
        return nullptr;
      }
      moved = move_free_pages(shard, new_pages, after - budget.floor);
    }
  }
  auto backed = back_with_pages(shard, address, block_bytes, requested_bytes, hit,
                                pressure_before, std::move(moved));
  if (!backed) {
    shard.arena.give_back(block->span);
    return std::unexpected(backed.error());
  }
  span = block->span;
  return block->ptr;
}

// A new address range for the shard: the device's memory (a shard never needs more at once),
// or the block where that is smaller.
Result<void> DevicePool::reserve_virtual_range(ArenaShard& shard, std::size_t block_bytes) {
  const std::size_t wanted = std::max(device_.properties().total_memory, block_bytes);
  const std::size_t bytes = (wanted + page_bytes_ - 1) / page_bytes_ * page_bytes_;
  auto base = device_.reserve_addresses(bytes);
  if (!base) return std::unexpected(base.error());
  shard.pages->add_range(*base, bytes);
  shard.arena.add_segment(*base, bytes);
  return {};
}

// Unmaps up to `excess_bytes` of the shard's pages lying wholly in free space (rounded up to
// pages), the highest first, once the device has finished the work queued before. The first
// `wanted` come back, still reserved, for the block that needs them; the rest go back to the
// device, so that reserved bytes fall back to the most in use and the next blocks map new pages
// without another move. Caller holds the shard's lock.
std::vector<PhysicalPage> DevicePool::move_free_pages(ArenaShard& shard, std::size_t wanted,
                                                      std::size_t excess_bytes) {
  std::vector<PhysicalPage> moved;
  const std::size_t count = (excess_bytes + page_bytes_ - 1) / page_bytes_;
  const std::vector<std::uintptr_t> free = shard.pages->highest_free_mapped_pages(shard.arena, count);
  if (free.empty() || !device_.synchronize()) return moved;
  // Highest first: a run of consecutive pages ends where the next address is one page lower.
  for (std::size_t first = 0; first < free.size();) {
    std::size_t end = first + 1;
    while (end < free.size() && free[end] + page_bytes_ == free[end - 1]) ++end;
    if (!device_.unmap_pages(reinterpret_cast<void*>(free[end - 1]), end - first)) break;
    for (std::size_t i = first; i < end; ++i) {
      const PhysicalPage page = shard.pages->set_unmapped(free[i]);
      if (moved.size() < wanted) moved.push_back(page);
      else release_page(page);
    }
    first = end;
  }
  counters_.count_trim();  // a move takes pages out of the cache, as a trim does
  return moved;
}

// Memory for the pages of [address, address + bytes) that have none: the `moved` pages first,
// then new ones. Caller holds the shard's lock.
Result<void> DevicePool::back_with_pages(ArenaShard& shard, std::uintptr_t address,
                                         std::size_t bytes, std::size_t requested_bytes,
                                         bool& hit, std::optional<double>& pressure_before,
                                         std::vector<PhysicalPage> moved) {
  const std::vector<std::uintptr_t> needed = shard.pages->unmapped_in(address, bytes);
  if (needed.empty()) return {};
  hit = false;
  std::vector<PhysicalPage> pages = std::move(moved);
  pages.reserve(needed.size());
  auto give_up = [&](std::size_t from, GpuError error) -> Result<void> {
    for (std::size_t i = from; i < pages.size(); ++i) release_page(pages[i]);
    return std::unexpected(std::move(error));
  };
  if (!pressure_before) pressure_before = pressure();
  while (pages.size() < needed.size()) {
    auto page = create_page_within_limit(requested_bytes);
    if (!page) return give_up(0, page.error());
    pages.push_back(*page);
  }
  // Mapped in runs of consecutive pages, one device call each, then opened to the peers.
  const std::vector<Device> peers = granted_peers();
  for (std::size_t first = 0; first < needed.size();) {
    std::size_t end = first + 1;
    while (end < needed.size() && needed[end] == needed[end - 1] + page_bytes_) ++end;
    void* const run = reinterpret_cast<void*>(needed[first]);
    auto mapped = device_.map_pages(run, std::span(pages).subspan(first, end - first));
    if (!mapped) return give_up(first, mapped.error());
    for (const Device& peer : peers)
      if (auto granted = device_.grant_access(run, (end - first) * page_bytes_, peer); !granted) {
        (void)device_.unmap_pages(run, end - first);
        return give_up(first, granted.error());
      }
    for (std::size_t i = first; i < end; ++i) shard.pages->set_mapped(needed[i], pages[i]);
    first = end;
  }
  return {};
}

Result<PhysicalPage> DevicePool::create_page_within_limit(std::size_t requested_bytes) {
  if (auto admitted = limit_.admit(page_bytes_, requested_bytes, /*may_trim=*/false,
                                   reservations_, *this, device_.id());
      !admitted)
    return std::unexpected(admitted.error());
  auto page = device_.create_page();
  if (!page) {
    reservations_.cancel(page_bytes_);
    return page;
  }
  reservations_.allocated();
  return page;
}

void DevicePool::release_page(PhysicalPage page) noexcept {
  device_.release_page(page);
  reservations_.freed(page_bytes_);
}

// Unmaps and gives back the pages lying wholly in the shard's free space, until `enough` bytes
// are out; with no bound, also the address ranges left with no memory at all.
std::size_t DevicePool::release_free_pages(ArenaShard& shard, std::size_t enough) {
  std::lock_guard lock(shard.mutex);
  if (!shard.pages) return 0;
  const std::size_t limit = enough == SIZE_MAX ? SIZE_MAX : (enough + page_bytes_ - 1) / page_bytes_;
  const std::vector<std::uintptr_t> free = shard.pages->free_mapped_pages(shard.arena, limit);
  std::size_t released = 0;
  if (!free.empty() && device_.synchronize()) {
    for (std::uintptr_t page : free) {
      if (!device_.unmap_pages(reinterpret_cast<void*>(page), 1)) break;
      release_page(shard.pages->set_unmapped(page));
      released += page_bytes_;
    }
    counters_.count_trim();
  }
  if (enough == SIZE_MAX)
    for (const VirtualPages::Reserved& range : shard.pages->remove_unmapped_ranges()) {
      // A range without memory holds no block (a block's pages are mapped when it is taken).
      if (shard.arena.remove_segment_if_free(range.base))
        device_.release_addresses(range.base, range.bytes);
      else
        shard.pages->add_range(range.base, range.bytes);
    }
  return released;
}

}  // namespace gpupool
