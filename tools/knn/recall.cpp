// recall@k with tie tolerance (see recall.hpp).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <fmt/format.h>
#include <limits>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <vector>
#include "recall.hpp"
#include "vector_io.hpp"

namespace gpupool::exact {

namespace {

template <class T>
Result<void> check_table(const Table<T>& table, std::string_view name, std::size_t k,
                         std::size_t rows) {
  if (table.values.size() != table.rows * table.cols)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{} holds {} values for {} × {}; expected rows × cols", name,
                                  table.values.size(), table.rows, table.cols));
  if (table.cols < k)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{} has {} neighbours per query; expected at least k = {}", name,
                                  table.cols, k));
  if (table.rows != rows)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("{} has {} queries; expected {} as the truth has", name,
                                  table.rows, rows));
  return {};
}

Result<void> check_inputs(const RecallInputs& in, std::size_t k) {
  if (k == 0) return make_error(ErrorKind::InvalidInput, "k = 0; expected at least 1");
  std::size_t rows = in.truth.rows;
  if (auto ok = check_table(in.truth, "the truth", k, rows); !ok) return ok;
  if (auto ok = check_table(in.result, "the result", k, rows); !ok) return ok;
  if (in.truth_distances.has_value() != in.result_distances.has_value())
    return make_error(ErrorKind::InvalidInput,
                      "distances were given for only one of truth and result; expected both or "
                      "neither");
  if (!in.truth_distances) return {};
  if (in.truth_distances->cols != in.truth.cols)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("the truth distances have {} columns; expected {} as the truth ids",
                                  in.truth_distances->cols, in.truth.cols));
  if (in.result_distances->cols != in.result.cols)
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("the result distances have {} columns; expected {} as the result ids",
                                  in.result_distances->cols, in.result.cols));
  if (auto ok = check_table(*in.truth_distances, "the truth distances", k, rows); !ok) return ok;
  return check_table(*in.result_distances, "the result distances", k, rows);
}

struct QueryHits {
  std::size_t hits = 0, tie_hits = 0;
};

QueryHits count_query(const RecallInputs& in, std::size_t q, std::size_t k, double tolerance) {
  std::unordered_set<std::int32_t> truth(in.truth.row(q), in.truth.row(q) + k), seen;
  std::optional<double> threshold;
  if (in.truth_distances) {
    double kth = in.truth_distances->row(q)[k - 1];
    threshold = kth + tolerance * std::max(1.0, std::fabs(kth));
  }
  QueryHits counted;
  for (std::size_t j = 0; j < k; ++j) {
    std::int32_t id = in.result.row(q)[j];
    if (id < 0 || !seen.insert(id).second) continue;  // empty slot or a repeated id
    if (truth.contains(id)) {
      ++counted.hits;
    } else if (threshold && in.result_distances->row(q)[j] <= *threshold) {
      ++counted.hits;
      ++counted.tie_hits;
    }
  }
  return counted;
}

template <class T>
Result<Table<T>> read_table(const std::filesystem::path& path) {
  auto reader = io::VectorReader::open(path);
  if (!reader) return std::unexpected(reader.error());
  Table<T> table{reader->rows(), reader->dim(), {}};
  table.values.resize(table.rows * table.cols);
  if (table.rows == 0) return table;
  Result<std::size_t> got = [&] {
    if constexpr (std::is_same_v<T, float>) return reader->read(table.values, table.rows);
    else return reader->read_ints(table.values, table.rows);
  }();
  if (!got) return std::unexpected(got.error());
  return table;
}

}  // namespace

Result<RecallReport> compute_recall(const RecallInputs& inputs, std::size_t k, double tolerance) {
  if (auto ok = check_inputs(inputs, k); !ok) return std::unexpected(ok.error());
  if (!(tolerance >= 0))
    return make_error(ErrorKind::InvalidInput,
                      fmt::format("tolerance = {}; expected a number >= 0", tolerance));
  RecallReport report{.queries = inputs.truth.rows, .k = k,
                      .tie_tolerant = inputs.truth_distances.has_value()};
  report.worst_query_recall = inputs.truth.rows ? 1.0 : 0.0;
  for (std::size_t q = 0; q < inputs.truth.rows; ++q) {
    QueryHits counted = count_query(inputs, q, k, tolerance);
    report.hits += counted.hits;
    report.tie_hits += counted.tie_hits;
    report.worst_query_recall = std::min(
        report.worst_query_recall, static_cast<double>(counted.hits) / static_cast<double>(k));
  }
  if (report.queries)
    report.recall = static_cast<double>(report.hits) / static_cast<double>(report.queries * k);
  return report;
}

Result<RecallReport> recall_from_files(const RecallFiles& files, std::size_t k, double tolerance) {
  RecallInputs inputs;
  auto truth = read_table<std::int32_t>(files.truth);
  if (!truth) return std::unexpected(truth.error());
  auto result = read_table<std::int32_t>(files.result);
  if (!result) return std::unexpected(result.error());
  inputs.truth = std::move(*truth);
  inputs.result = std::move(*result);
  if (files.truth_distances) {
    auto distances = read_table<float>(*files.truth_distances);
    if (!distances) return std::unexpected(distances.error());
    inputs.truth_distances = std::move(*distances);
  }
  if (files.result_distances) {
    auto distances = read_table<float>(*files.result_distances);
    if (!distances) return std::unexpected(distances.error());
    inputs.result_distances = std::move(*distances);
  }
  return compute_recall(inputs, k, tolerance);
}

}  // namespace gpupool::exact
