// The host's running lists and the exact fold (see running_lists.hpp).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>
#include "parallel.hpp"
#include "running_lists.hpp"

namespace gpupool::exact {

namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

}  // namespace

RunningLists::RunningLists(std::size_t queries, std::size_t k)
    : queries_(queries), k_(k), entries_(queries * k), filled_(queries, 0) {}

double RunningLists::kth(std::size_t q) const noexcept {
  return filled_[q] < k_ ? kInfinity : entries_[q * k_ + k_ - 1].distance;
}

void RunningLists::offer(std::size_t q, Entry e) noexcept {
  Entry* list = entries_.data() + q * k_;
  std::uint32_t& n = filled_[q];
  if (n == k_ && !(e < list[k_ - 1])) return;
  Entry* at = std::lower_bound(list, list + n, e);
  // A row offered again (a chunk searched again with more candidates) has the same distance.
  if (at != list + n && at->row == e.row) return;
  if (n == k_) --n;  // the k-th leaves
  std::move_backward(at, list + n, list + n + 1);
  *at = e;
  ++n;
}

std::vector<std::size_t> RunningLists::fold_exact(const ChunkCandidates& c,
                                                  std::span<const std::size_t> lists,
                                                  std::span<const double> bounds,
                                                  const HostQueries& queries,
                                                  std::size_t first_query, const StoredRows& chunk,
                                                  std::size_t first_row, Metric metric,
                                                  FoldCounts& counts) {
  std::vector<char> failed(c.queries, 0);
  std::vector<std::uint64_t> recomputed(c.queries, 0), present_of(c.queries, 0);
  parallel_ranges(c.queries, 64, [&](std::size_t begin, std::size_t end) {
    std::vector<double> scratch(chunk.dim);
    for (std::size_t i = begin; i < end; ++i) {
      const std::size_t q = lists.empty() ? i : lists[i], query = first_query + q;
      const double bound = bounds[i];
      const float* d = c.distances.data() + i * c.capacity;
      const std::int32_t* rows = c.indices.data() + i * c.capacity;
      std::size_t present = 0;
      for (std::size_t j = 0; j < c.capacity && rows[j] >= 0; ++j, ++present) {
        const double approximate = d[j] * c.unit;
        // NaN never passes: exact mode refuses non-finite rows, so a NaN here cannot be a row's.
        if (!(approximate - bound <= kth(q))) continue;
        // A bound of 0: the device's arithmetic was exact (arithmetic.hpp), its distance is.
        double exact = approximate;
        if (bound != 0) {
          exact = exact_distance(queries, query, chunk, static_cast<std::size_t>(rows[j]), metric,
                                 scratch.data());
          ++recomputed[i];
        }
        offer(q, Entry{exact, static_cast<std::int64_t>(first_row) + rows[j]});
      }
      present_of[i] = present;
      // Every row within the query's upper bound was a candidate (the rest lie beyond the k-th
      // so far plus the bound), or the left-out ones are provably worse than the last.
      if (present < c.capacity || present >= chunk.rows) continue;
      const double left_out_at_least = static_cast<double>(d[c.capacity - 1]) * c.unit - bound;
      const double kth_now = kth(q);
      const bool proven = left_out_at_least > kth_now || (bound == 0 && left_out_at_least >= kth_now);
      if (!proven) failed[i] = 1;
    }
  });
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < c.queries; ++i) {
    counts.recomputed += recomputed[i];
    counts.candidates += present_of[i];
    if (failed[i]) out.push_back(i);
  }
  return out;
}

void RunningLists::fold_all_rows(std::size_t q, const HostQueries& queries,
                                 std::size_t first_query, const StoredRows& chunk,
                                 std::size_t first_row, Metric metric, FoldCounts& counts) {
  std::vector<double> scratch(chunk.dim);
  const std::size_t query = first_query + q;
  for (std::size_t r = 0; r < chunk.rows; ++r)
    offer(q, Entry{exact_distance(queries, query, chunk, r, metric, scratch.data()),
                   static_cast<std::int64_t>(first_row + r)});
  counts.recomputed += chunk.rows;
}

void RunningLists::fold_every_row(const HostQueries& queries, const StoredRows& chunk,
                                  std::size_t first_row, Metric metric, FoldCounts& counts) {
  // Each thread takes some queries' lists through every row.
  parallel_ranges(queries_, 1, [&](std::size_t begin, std::size_t end) {
    std::vector<double> scratch(chunk.dim);
    for (std::size_t q = begin; q < end; ++q)
      for (std::size_t r = 0; r < chunk.rows; ++r)
        offer(q, Entry{exact_distance(queries, q, chunk, r, metric, scratch.data()),
                       static_cast<std::int64_t>(first_row + r)});
  });
  counts.recomputed += queries_ * chunk.rows;
}

void RunningLists::fold_fast(const ChunkCandidates& c, std::size_t first_row) {
  parallel_ranges(c.queries, 256, [&](std::size_t begin, std::size_t end) {
    for (std::size_t q = begin; q < end; ++q)
      for (std::size_t j = 0; j < c.capacity; ++j) {
        const std::int32_t row = c.indices[q * c.capacity + j];
        if (row < 0) break;
        // knn orders NaN after every number; +inf keeps that order here.
        const double d = c.distances[q * c.capacity + j] * c.unit;
        offer(q, Entry{std::isnan(d) ? kInfinity : d, static_cast<std::int64_t>(first_row) + row});
      }
  });
}

std::vector<float> RunningLists::distances_fp32() const {
  std::vector<float> out(queries_ * k_, std::numeric_limits<float>::infinity());
  for (std::size_t q = 0; q < queries_; ++q)
    for (std::size_t j = 0; j < filled_[q]; ++j)
      out[q * k_ + j] = static_cast<float>(entries_[q * k_ + j].distance);
  return out;
}

std::vector<double> RunningLists::distances_fp64() const {
  std::vector<double> out(queries_ * k_, kInfinity);
  for (std::size_t q = 0; q < queries_; ++q)
    for (std::size_t j = 0; j < filled_[q]; ++j) out[q * k_ + j] = entries_[q * k_ + j].distance;
  return out;
}

std::vector<std::int32_t> RunningLists::rows() const {
  std::vector<std::int32_t> out(queries_ * k_, -1);
  for (std::size_t q = 0; q < queries_; ++q)
    for (std::size_t j = 0; j < filled_[q]; ++j)
      out[q * k_ + j] = static_cast<std::int32_t>(entries_[q * k_ + j].row);
  return out;
}

}  // namespace gpupool::exact
