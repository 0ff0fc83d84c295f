// Internal: kNN for a handful of queries (gpu/cuda/few_queries_knn.cu). With few queries the
// arithmetic is small and the corpus read is the whole cost, so one kernel reads every corpus row
// once, for all queries at the same time: the corpus is cut into one slice per block (one wave of
// blocks), each block keeps its own top-k per query in shared memory, and a merge kernel takes the
// k best of the blocks' lists. Dot products on the tensor cores (mma.sync: fp16 / bf16 with fp32 accumulation,
// int8 exactly in int32) or, for fp32 rows, fp32 FMA (exact fp32, as the tiled path's SGEMM);
// distances and the running lists follow distance_rules.cuh (ties by index, NaN last).
// gpu/cuda_backend.cpp takes it where few_queries_takes says.
#pragma once

#include "kernels.cuh"

#include <cstddef>
#include <cstdint>

namespace gpupool::cuda_kernels {

// Up to 8 queries (one group of 8, the mma's n), or 32 for int8 rows; k up to 128; rows of whole
// 16-byte pieces and at most 512 bytes (a thread holds two rows' pieces in registers), 16-byte
// aligned. Where the tiled path or the filter measured faster (H200, (Q, 2^20, 128), k = 10):
// at 16 queries fp16 / fp32 ran 1.05x slower here, at 32 1.1-1.8x, at 64 2.7x (the filter);
// int8 ran faster up to 32 (0.49 against 0.77 ms), 3x slower at 64.
inline constexpr std::size_t kFewQueriesMax = 8;
inline constexpr std::size_t kFewQueriesMaxInt8 = 32;
inline constexpr std::size_t kFewQueriesMaxK = 128;
inline constexpr std::size_t kFewQueriesMaxRowBytes = 512;

inline bool few_queries_takes(const Matrix& q, const Matrix& x, std::size_t dim, std::size_t k) {
  const std::size_t row_bytes = dim * element_bytes(x.element);
  const std::size_t most = x.element == Element::Int8 ? kFewQueriesMaxInt8 : kFewQueriesMax;
  const auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  return q.rows >= 1 && q.rows <= most && k >= 1 && k <= kFewQueriesMaxK &&
         row_bytes % 16 == 0 && row_bytes <= kFewQueriesMaxRowBytes && aligned(q.data) &&
         aligned(x.data);
}

struct FewQueriesArgs {
  Matrix q;  // few_queries_takes' shapes; int8: scales in Matrix::scales
  Matrix x;  // x.norms (the caller's): read for fp16 / bf16 rows, L2 and cosine
  std::size_t dim = 0;
  Metric metric = Metric::L2;
  // fp32 rows in fp32-accurate mode: L2 pairs whose GEMM form cancelled are recomputed in the
  // direct form from the fp32 rows (finish_distance), as in the tiled path.
  bool exact_l2 = false;
  std::size_t k = 0;
  float* out_d = nullptr;  // Q × k, knn's order
  std::int32_t* out_i = nullptr;
};

// How many blocks (and so partial lists a query) the kernel runs for these arguments on the
// current device: one wave, each block a slice of whole 128-row rounds; 0 where its shared memory
// cannot hold two stages of rows beside the lists (the caller takes another path).
std::size_t few_queries_blocks(const FewQueriesArgs& a);
// The kNN: the blocks' lists into part_d / part_i (Q × blocks × k, scratch), then merged into
// out_d / out_i. `blocks`: few_queries_blocks of the same arguments.
Status few_queries_knn(const FewQueriesArgs& a, std::size_t blocks, float* part_d,
                       std::int32_t* part_i, void* stream);

}  // namespace gpupool::cuda_kernels
