// gpupool::exact — each query's smallest k-th distance so far over the devices of one job.
//
// A device's k-th distance so far is the distance of k rows of the base, so the whole base's k-th
// is at most that: every device may search within the smallest of them, since a row beyond it
// cannot be among its query's k nearest (rows at the bound itself stay in: ties are decided by
// row number in the merge). Without it each device's lists start empty and its first chunks send
// the host a full list of candidates for every query. Devices lower the figures after each chunk
// and read them when they set the next chunk's bounds. Exact mode only: the figures are exact
// distances in the data's units.
#pragma once
#include <atomic>
#include <cstddef>
#include <limits>
#include <vector>

namespace gpupool::exact {

class SharedBounds {
 public:
  explicit SharedBounds(std::size_t queries) : kth_(queries) {
    for (auto& kth : kth_) kth.store(std::numeric_limits<double>::infinity(), std::memory_order_relaxed);
  }
  std::size_t queries() const noexcept { return kth_.size(); }
  // +inf until a device has k rows for the query.
  double kth(std::size_t query) const noexcept { return kth_[query].load(std::memory_order_relaxed); }
  // Query `query`'s k-th so far on one device: kept where it is smaller.
  void lower(std::size_t query, double kth) noexcept {
    double now = kth_[query].load(std::memory_order_relaxed);
    while (kth < now && !kth_[query].compare_exchange_weak(now, kth, std::memory_order_relaxed)) {
    }
  }

 private:
  std::vector<std::atomic<double>> kth_;
};

}  // namespace gpupool::exact
