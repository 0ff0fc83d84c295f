// gpupool::exact — recall@k of a kNN result against ground truth, tolerant of ties.
//
// Per query, a result neighbour among the first k counts when it is among the first k true
// neighbours, or — when distances are given for both — when its distance is within the
// tolerance of the k-th true distance or better:
//     d_result <= d_truth[k-1] + tolerance * max(1, |d_truth[k-1]|)
// so that a result that picked another of several equally distant neighbours is not penalised.
// Each neighbour id counts once per query; recall@k = hits / (queries × k).
//
// This header imports gpupool: include it after your other headers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <expected>
#include <filesystem>
#include <optional>
#include <vector>
import gpupool;

namespace gpupool::exact {

// A row-major table of `rows` × `cols` values (neighbour ids or distances).
template <class T>
struct Table {
  std::size_t rows = 0;
  std::size_t cols = 0;
  std::vector<T> values;
  const T* row(std::size_t r) const { return values.data() + r * cols; }
};

struct RecallInputs {
  Table<std::int32_t> truth;
  Table<std::int32_t> result;
  std::optional<Table<float>> truth_distances;   // both or neither
  std::optional<Table<float>> result_distances;
};

struct RecallReport {
  std::size_t queries = 0;
  std::size_t k = 0;
  std::size_t hits = 0;          // counted neighbours over all queries
  std::size_t tie_hits = 0;      // of those, counted through the distance tolerance
  double recall = 0;             // hits / (queries × k)
  double worst_query_recall = 0;
  bool tie_tolerant = false;     // distances were given
};

// InvalidInput for k = 0, tables with fewer than k columns, row counts that differ, only one
// distance table, or distance tables whose shape differs from their id table.
Result<RecallReport> compute_recall(const RecallInputs& inputs, std::size_t k, double tolerance);

struct RecallFiles {
  std::filesystem::path truth, result;
  std::optional<std::filesystem::path> truth_distances, result_distances;
};
// Reads the files (ids: ivecs or npy int; distances: fvecs or npy float) and computes recall.
Result<RecallReport> recall_from_files(const RecallFiles& files, std::size_t k, double tolerance);

}  // namespace gpupool::exact
