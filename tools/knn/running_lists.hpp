// gpupool::exact — every query's k best rows so far, on the host, ranked by (distance, row).
//
// A chunk's device candidates come in as (d̃, row) lists of `capacity` entries, knn's order,
// searched within each query's upper bound (its k-th so far plus the bound). In the exact mode
// each candidate that could still enter its query's list (d̃ - bound <= the list's k-th distance)
// gets its fp64 distance (exact_distance) from the chunk's rows, still in host memory — or, where
// the bound is 0 (exact integer arithmetic), keeps the device's, which is that value — and enters
// by it; then the chunk is proven complete for the query: a list shorter than `capacity` held
// every row within the upper bound (the others cannot enter), and a full one left out only rows
// with d̃ >= its last, so an fp64 distance >= that minus the bound, which must exceed the list's
// k-th (or equal it when the bound is 0: rows come in order, so a tie goes to the row already in
// the list). A query that fails the proof is named, for the caller to search again with more
// candidates. In the fast mode the device's distances enter as they are.
//
// Lists are plain sorted arrays per query: the k-th is the last; a chunk touches each list once.
//
// This header imports gpupool: include it after your other headers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>
#include "stored_rows.hpp"
import gpupool;

namespace gpupool::exact {

// One chunk's device result for some queries, read back to the host.
struct ChunkCandidates {
  std::size_t queries = 0;
  std::size_t capacity = 0;              // entries per query (knn's k of this call)
  double unit = 1;                       // distances × unit are the data's (a power of two)
  std::vector<float> distances;          // queries × capacity, each row ascending, device units
  std::vector<std::int32_t> indices;     // chunk rows, -1 for none
};

// How much of the exact path a fold did.
struct FoldCounts {
  std::uint64_t candidates = 0;   // device candidates looked at
  std::uint64_t recomputed = 0;   // whose fp64 distance was computed (bounds above 0 only)
};

class RunningLists {
 public:
  RunningLists(std::size_t queries, std::size_t k);

  std::size_t queries() const noexcept { return queries_; }
  std::size_t k() const noexcept { return k_; }
  // Query q's k-th distance so far (+inf until k rows are in).
  double kth(std::size_t q) const noexcept;

  // The exact fold of one chunk (rows `chunk`, base rows first_row...). Candidate row c is list
  // `lists[c]`'s (lists empty: row c is list c); list q is query first_query + q of `queries`;
  // `bounds[c]` is row c's error bound (arithmetic.hpp). Returns the candidate rows whose proof
  // failed.
  std::vector<std::size_t> fold_exact(const ChunkCandidates& candidates,
                                      std::span<const std::size_t> lists,
                                      std::span<const double> bounds, const HostQueries& queries,
                                      std::size_t first_query, const StoredRows& chunk,
                                      std::size_t first_row, Metric metric, FoldCounts& counts);
  // Every row of `chunk` into list q in fp64: the exact fold when candidates cannot prove a chunk.
  void fold_all_rows(std::size_t q, const HostQueries& queries, std::size_t first_query,
                     const StoredRows& chunk, std::size_t first_row, Metric metric,
                     FoldCounts& counts);
  // Every row of `chunk` into every list q (query q of `queries`), in fp64: the host's own
  // brute force, for --verify.
  void fold_every_row(const HostQueries& queries, const StoredRows& chunk, std::size_t first_row,
                      Metric metric, FoldCounts& counts);
  // The device's distances as they are (the fast mode).
  void fold_fast(const ChunkCandidates& candidates, std::size_t first_row);

  // Distances (rounded to fp32, or as fp64) and rows, queries × k; -1 / +inf where a list is short.
  std::vector<float> distances_fp32() const;
  std::vector<double> distances_fp64() const;
  std::vector<std::int32_t> rows() const;

 private:
  struct Entry {
    double distance;
    std::int64_t row;
    bool operator<(const Entry& o) const noexcept {
      return distance < o.distance || (distance == o.distance && row < o.row);
    }
  };
  // Puts e into query q's list if it beats the k-th and is not in it yet.
  void offer(std::size_t q, Entry e) noexcept;

  std::size_t queries_, k_;
  std::vector<Entry> entries_;      // queries × k, each list sorted, `filled_` of each in use
  std::vector<std::uint32_t> filled_;
};

}  // namespace gpupool::exact
