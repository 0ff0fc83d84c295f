// Test support shared by the CPU and GPU tests of the exact knn job: the exact mode's definition,
// computed by the host alone. Include after the tools/knn headers (they import gpupool).
#pragma once
#include <cstddef>
#include <span>
#include "exact_knn.hpp"
#include "running_lists.hpp"
#include "stored_rows.hpp"

namespace gpupool::test {

// Every base row's fp64 distance (exact_distance), ranked by (distance, row), distances rounded
// to fp32 — the host's own brute force.
inline exact::Neighbours fp64_reference(const exact::VectorSet& queries, const exact::VectorSet& base,
                                        std::size_t k, Metric metric) {
  exact::HostQueries host = exact::host_queries(queries.values, queries.rows, queries.dim);
  exact::RunningLists lists(queries.rows, k);
  exact::FoldCounts counts;
  lists.fold_every_row(host,
                       exact::StoredRows{reinterpret_cast<const std::byte*>(base.values.data()),
                                         StoredElement::Fp32, base.rows, base.dim},
                       0, metric, counts);
  return {queries.rows, k, lists.distances_fp32(), lists.distances_fp64(), lists.rows(), false};
}

}  // namespace gpupool::test
