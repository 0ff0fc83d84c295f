// The exact-kNN job over several devices (see sharded_knn.hpp): the split, the devices' threads,
// and the merge of their lists.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <fmt/format.h>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>
#include "base_stream.hpp"
#include "job_sizing.hpp"
#include "sharded_knn.hpp"

namespace gpupool::exact {

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The devices' errors: the first real failure is the job's; the devices it stopped report
// "stopped", which says nothing new.
class FirstFailure {
 public:
  // Records `error` unless a failure came first; true when it is the first.
  bool record(GpuError error) {
    std::lock_guard lock(mutex_);
    if (error_) return false;
    error_ = std::move(error);
    return true;
  }
  std::optional<GpuError> take() {
    std::lock_guard lock(mutex_);
    return std::move(error_);
  }

 private:
  std::mutex mutex_;
  std::optional<GpuError> error_;
};

// The ranking value of entry i of a share's lists.
double ranking_value(const Neighbours& lists, std::size_t i, bool fast) {
  return fast ? lists.ranked_distances[i] : lists.distances_fp64[i];
}

}  // namespace

std::vector<RowShare> split_rows(RowShare range, std::size_t parts, std::size_t alignment,
                                 std::size_t min_rows) {
  parts = std::max<std::size_t>(parts, 1);
  alignment = std::max<std::size_t>(alignment, 1);
  const std::size_t begin = range.first_row, end = range.first_row + range.rows;
  // The grid's cells the range touches are dealt out evenly, whole, over the shares used: as
  // many as there are parts, cells, and full lists' worth of rows.
  const std::size_t first_cell = begin / alignment;
  const std::size_t cells = range.rows == 0 ? 0 : (end - 1) / alignment - first_cell + 1;
  const std::size_t used = std::max<std::size_t>(
      1, std::min({parts, cells, range.rows / std::max<std::size_t>(min_rows, 1)}));
  // cuts[i] .. cuts[i + 1] is share i; the shares past `used` are empty, at the range's end.
  std::vector<std::size_t> cuts(parts + 1, end);
  cuts[0] = begin;
  for (std::size_t i = 1; i < used; ++i) {
    // In 128-bit arithmetic: cells × i may pass 2^64.
    const auto cell = first_cell + static_cast<std::size_t>(
                                       static_cast<unsigned __int128>(cells) * i / used);
    cuts[i] = std::clamp(cell * alignment, cuts[i - 1], end);
  }
  // A share too small for a full list joins its neighbour (the previous one where there is one):
  // each join leaves one share fewer with rows, so this ends.
  auto rows_of = [&](std::size_t i) { return cuts[i + 1] - cuts[i]; };
  for (bool joined = true; joined;) {
    joined = false;
    for (std::size_t i = 0; i < parts && !joined; ++i) {
      if (rows_of(i) == 0 || rows_of(i) >= min_rows) continue;
      std::optional<std::size_t> previous, next;
      for (std::size_t p = i; p-- > 0;)
        if (rows_of(p) > 0) { previous = p; break; }
      for (std::size_t n = i + 1; n < parts; ++n)
        if (rows_of(n) > 0) { next = n; break; }
      if (previous) {
        for (std::size_t j = *previous + 1; j <= i; ++j) cuts[j] = cuts[i + 1];
        joined = true;
      } else if (next) {
        for (std::size_t j = i + 1; j <= *next; ++j) cuts[j] = cuts[i];
        joined = true;
      }
    }
  }
  std::vector<RowShare> shares(parts);
  for (std::size_t i = 0; i < parts; ++i) shares[i] = RowShare{cuts[i], rows_of(i)};
  return shares;
}

std::size_t job_block_rows(std::size_t file_rows, const JobOptions& options) noexcept {
  return chunk_cap(file_rows, options.max_chunk_rows);
}

std::size_t share_alignment(std::size_t file_rows, const JobOptions& options) noexcept {
  return options.fast ? job_block_rows(file_rows, options) : 1;
}

Result<Neighbours> merge_neighbours(std::span<const ShareLists> shares, bool fast) {
  if (shares.empty()) return make_error(ErrorKind::InvalidInput, "no lists to merge");
  const std::size_t queries = shares.front().lists->queries, k = shares.front().lists->k;
  for (const ShareLists& share : shares) {
    const Neighbours& lists = *share.lists;
    const std::size_t entries = queries * k;
    if (lists.queries != queries || lists.k != k || lists.indices.size() != entries ||
        lists.distances.size() != entries ||
        (fast ? lists.ranked_distances : lists.distances_fp64).size() != entries)
      return make_error(ErrorKind::InvalidInput,
                        fmt::format("lists of {} queries × {} (with {} ids) cannot be merged "
                                    "with lists of {} queries × {}; expected the same shape",
                                    lists.queries, lists.k, lists.indices.size(), queries, k));
  }
  Neighbours out{.queries = queries, .k = k, .distances = {}, .distances_fp64 = {}, .indices = {},
                 .integer_distances = !fast, .beyond_fp32 = {}, .beyond_fp32_distance = 0,
                 .ranked_distances = {}};
  out.indices.assign(queries * k, -1);
  out.distances.assign(queries * k, std::numeric_limits<float>::infinity());
  std::vector<double>& values = fast ? out.ranked_distances : out.distances_fp64;
  values.assign(queries * k, std::numeric_limits<double>::infinity());
  for (const ShareLists& share : shares) out.integer_distances &= share.lists->integer_distances;

  // Per query, a k-way merge: each share's list is sorted by (value, row), rows of different
  // shares never equal, so the merged order is the one-device order.
  std::vector<std::size_t> next(shares.size());
  for (std::size_t q = 0; q < queries; ++q) {
    std::fill(next.begin(), next.end(), std::size_t{0});
    for (std::size_t rank = 0; rank < k; ++rank) {
      std::optional<std::size_t> best;
      double best_value = 0;
      std::int64_t best_row = 0;
      for (std::size_t s = 0; s < shares.size(); ++s) {
        if (next[s] >= k) continue;
        const Neighbours& lists = *shares[s].lists;
        const std::size_t at = q * k + next[s];
        if (lists.indices[at] < 0) continue;  // the rest of a short list
        const double value = ranking_value(lists, at, fast);
        const std::int64_t row = static_cast<std::int64_t>(shares[s].first_row) + lists.indices[at];
        if (!best || value < best_value || (value == best_value && row < best_row)) {
          best = s;
          best_value = value;
          best_row = row;
        }
      }
      if (!best) break;  // every list is used up: the rest stays -1 / +inf
      const std::size_t from = q * k + next[*best]++, to = q * k + rank;
      out.indices[to] = static_cast<std::int32_t>(best_row);
      out.distances[to] = shares[*best].lists->distances[from];
      values[to] = best_value;
      if (!out.beyond_fp32 && std::isfinite(best_value) && !std::isfinite(out.distances[to])) {
        out.beyond_fp32 = to;
        out.beyond_fp32_distance = best_value;
      }
    }
  }
  // beyond_fp32 is the first such entry in (query, rank) order, as the one-device job names it:
  // the loop above visits entries in that order.
  return out;
}

Result<ShardedResult> run_sharded_knn(std::span<const DeviceSlot> slots, const VectorSet& queries,
                                      const std::filesystem::path& base, const JobOptions& options,
                                      std::optional<RowShare> range,
                                      std::function<void(std::size_t, const Progress&)> on_progress) {
  const auto start = std::chrono::steady_clock::now();
  if (slots.empty())
    return make_error(ErrorKind::InvalidInput, "no devices for the job; expected at least one");
  auto probe = io::VectorReader::open(base);
  if (!probe) return std::unexpected(probe.error());
  const std::size_t file_rows = probe->rows();
  const RowShare whole = range.value_or(RowShare{0, file_rows});
  if (whole.first_row > file_rows || whole.rows > file_rows - whole.first_row)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("base rows {}..{} of {}: the file holds {} rows", whole.first_row,
                                  whole.first_row + whole.rows, base.string(), file_rows));
  if (whole.rows < options.k)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("k = {} is larger than the base rows {}..{} of {} ({} rows); "
                                  "expected k <= {}", options.k, whole.first_row,
                                  whole.first_row + whole.rows, base.string(), whole.rows,
                                  whole.rows));
  const std::vector<RowShare> shares =
      split_rows(whole, slots.size(), share_alignment(file_rows, options), options.k);

  std::vector<DevicePart> parts(slots.size());
  std::vector<std::optional<JobResult>> results(slots.size());
  // The devices search within each other's k-th distances (the exact mode reads them).
  SharedBounds bounds(queries.rows);
  std::atomic<bool> stop{false};
  FirstFailure failure;
  auto run_slot = [&](std::size_t i) {
    const RowShare share = shares[i];
    parts[i].device = slots[i].device.describe();
    parts[i].share = share;
    if (share.rows == 0) return;
    auto fail = [&](GpuError error) {
      if (failure.record(error.with_context(fmt::format(
              "device {} ({}), base rows {}..{}", i, parts[i].device, share.first_row,
              share.first_row + share.rows - 1))))
        stop.store(true);
    };
    auto reader = io::VectorReader::open(base);
    if (!reader) return fail(reader.error());
    if (auto at = go_to_row(*reader, share.first_row); !at) return fail(at.error());
    JobOptions mine = options;
    mine.base_rows = share.rows;
    mine.block_rows = job_block_rows(file_rows, options);
    mine.stop = &stop;
    if (!options.shared_bounds) mine.shared_bounds = &bounds;
    if (on_progress) mine.on_progress = [&on_progress, i](const Progress& p) { on_progress(i, p); };
    GpuMemoryPool pool = slots[i].pool;
    auto result = run_exact_knn(pool, slots[i].device, queries, *reader, mine);
    if (!result) return fail(result.error());
    results[i] = std::move(*result);
  };
  // Slot 0 runs on this thread; the others on threads of their own, or after it where the
  // system gives no thread.
  std::vector<std::thread> threads;
  std::vector<std::size_t> inline_slots;
  for (std::size_t i = 1; i < slots.size(); ++i) {
    try {
      threads.emplace_back(run_slot, i);
    } catch (const std::system_error&) {
      inline_slots.push_back(i);
    }
  }
  run_slot(0);
  for (std::size_t i : inline_slots) run_slot(i);
  for (std::thread& thread : threads) thread.join();
  if (auto error = failure.take()) return std::unexpected(std::move(*error));

  const auto merge_start = std::chrono::steady_clock::now();
  std::vector<ShareLists> lists;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    if (!results[i]) continue;
    parts[i].summary = results[i]->summary;
    lists.push_back(ShareLists{&results[i]->neighbours, shares[i].first_row});
  }
  auto merged = merge_neighbours(lists, options.fast);
  if (!merged) return std::unexpected(merged.error());
  ShardedResult out{std::move(*merged), std::move(parts), 0, seconds_since(merge_start)};
  out.seconds = seconds_since(start);
  return out;
}

}  // namespace gpupool::exact
