// The running top-k lists (kernels.cuh: topk_init, topk_update, topk_update_split,
// apply_upper_bounds): one block a row folds candidates — distances, or GEMM dot products finished
// into distances as they are read (dot_epilogue.cuh) — into the row's sorted list in shared
// memory; for few rows, slices of the candidates into partial lists merged afterwards.
#include "kernels.cuh"
#include "block_sorts.cuh"
#include "distance_rules.cuh"
#include "dot_epilogue.cuh"
#include "launch_status.cuh"

#include <cuda_runtime.h>

#include <cstdint>

namespace gpupool::cuda_kernels {

namespace {

__global__ void topk_init_kernel(float* d, std::int32_t* idx, std::size_t count) {
  std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (t < count) {
    d[t] = __int_as_float(0x7fc00000);
    idx[t] = -1;
  }
}

__global__ void apply_upper_bounds_kernel(const float* bounds, std::size_t rows, std::size_t k,
                                          float* d, std::int32_t* idx) {
  std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (t >= rows * k || d[t] <= bounds[t / k]) return;
  d[t] = __int_as_float(0x7fc00000);
  idx[t] = -1;
}

// The corpus row of candidate column `column` (Epilogue::piece_length: gathered pieces). Columns
// and rows are int32 indices, so 32-bit division (a 64-bit one is a long subroutine).
__device__ __forceinline__ int corpus_row(const Epilogue& e, std::int64_t column) {
  if (e.piece_length == 0) return static_cast<int>(column);
  auto c = static_cast<std::uint32_t>(column), length = static_cast<std::uint32_t>(e.piece_length);
  return static_cast<int>(c / length * static_cast<std::uint32_t>(e.piece_period) + c % length);
}

// 128 threads × 7 independent loads each per step: small blocks (12 fit on an SM, so 1024 rows
// run in one wave; 256-thread blocks at 42 registers took two) with many reads in flight, and one
// step's 896 candidates always fit beside k <= 1024 in the 2048 slots (256 threads × 4, in two
// waves, took 1.4 ms per 1 GiB tile on an H100). 7, not 8: a first step beside k <= 128 then
// sorts 1024 slots, not 2048 (every row sorts at once: that sort was most of a kNN sample's top-k
// pass).
constexpr int kTopkThreads = 128;
constexpr int kTopkPerThread = 7;
static_assert(kTopkThreads * kTopkPerThread + 1024 <= static_cast<int>(kTopkSlots));
// Eight blocks a multiprocessor (at most 64 registers a thread), so that 1024 rows still run in
// one wave on 132 multiprocessors.
constexpr int kTopkBlocksPerMultiprocessor = 8;

// A candidate's index with `base` added (fold_topk: a chunk's rows counted from the corpus's
// first); -1, an empty slot, stays -1.
__device__ __forceinline__ int offset_index(int index, std::int64_t base) {
  return index < 0 ? index : static_cast<int>(index + base);
}

// One block per (row, slice of `slice` candidates): the running top-k list sits sorted in slots
// [0, k); candidates better than its worst are appended after it; when the slots could overflow,
// sort and keep the first k. Block (row, s) folds its slice into list row * gridDim.y + s.
// With epilogue.dim != 0, candidates are dot products turned into distances as they are read.
__global__ void __launch_bounds__(kTopkThreads, kTopkBlocksPerMultiprocessor)
    topk_update_kernel(const float* cand, const std::int32_t* cand_idx,
                                   std::size_t count, std::size_t slice, std::size_t cand_ld,
                                   std::int64_t base, int k, float* run_d, std::int32_t* run_i,
                                   Epilogue epilogue, const std::uint32_t* row_counts) {
  __shared__ float sd[kTopkSlots];
  __shared__ int si[kTopkSlots];
  __shared__ int added;
  std::size_t row = blockIdx.x;
  std::size_t list = row * gridDim.y + blockIdx.y;
  if (row_counts && row_counts[row] < count) count = row_counts[row];
  std::size_t first = blockIdx.y * slice;
  if (first >= count) return;  // the whole block: no barrier is skipped by part of it
  std::size_t last = first + slice < count ? first + slice : count;
  for (int t = threadIdx.x; t < static_cast<int>(kTopkSlots); t += blockDim.x) {
    sd[t] = t < k ? run_d[list * k + t] : __int_as_float(0x7fc00000);
    si[t] = t < k ? run_i[list * k + t] : -1;
  }
  if (threadIdx.x == 0) added = 0;
  __syncthreads();
  const int capacity = static_cast<int>(kTopkSlots) - k;
  auto compact = [&] {
    int n = 1;
    while (n < k + added) n <<= 1;
    bitonic_sort(BlockSorts{}, sd, si, nullptr, n);
    for (int t = k + threadIdx.x; t < n; t += blockDim.x) {
      sd[t] = __int_as_float(0x7fc00000);
      si[t] = -1;
    }
    __syncthreads();
    if (threadIdx.x == 0) added = 0;
    __syncthreads();
  };
  const std::size_t step = static_cast<std::size_t>(blockDim.x) * kTopkPerThread;
  const float* row_cand = cand + row * cand_ld;
  PairFigures query;  // this row's figures, once
  if (epilogue.dim != 0) query = {query_norm(epilogue, row), 0.0f, query_scale(epilogue, row), 1.0f};
  for (std::size_t start = first; start < last; start += step) {
    int pending = added;  // every thread reads it before anyone changes it
    bool unfilled = si[k - 1] < 0;  // fewer than k so far: every candidate would be appended
    const std::size_t end = start + step < last ? start + step : last;
    __syncthreads();
    // Compact when the slots could overflow, and as soon as a list short of k has candidates:
    // its worst then becomes a real threshold before the next step appends everything again.
    if (pending + static_cast<int>(step) > capacity || (unfilled && pending > 0)) compact();
    float worst_d = sd[k - 1];
    int worst_i = si[k - 1];
    // The step's loads all go out before any is used (candidates and their rows' figures).
    float d[kTopkPerThread];
    PairFigures f[kTopkPerThread];
#pragma unroll
    for (int v = 0; v < kTopkPerThread; ++v) {
      std::size_t j = start + v * blockDim.x + threadIdx.x;
      d[v] = j < end ? row_cand[j] : 0.0f;
      f[v] = query;
      if (epilogue.dim != 0 && j < end) load_row_figures(epilogue, j, f[v]);
    }
#pragma unroll
    for (int v = 0; v < kTopkPerThread; ++v) {
      std::size_t j = start + v * blockDim.x + threadIdx.x;
      if (j >= end) continue;
      float value = d[v];
      if (epilogue.dim != 0) value = finish(value, epilogue, f[v], row, j);
      // A candidate worse than the list's worst (both numbers, the worst a real row: any row
      // beats an empty slot, index -1) loses whatever its index, so its index (a load, or a
      // gathered column's corpus row) is looked up only for the rest: most candidates.
      if (worst_i >= 0 && value > worst_d) continue;
      int id = cand_idx ? offset_index(cand_idx[row * cand_ld + j], base)
                        : corpus_row(epilogue, base + j);
      if (better(value, id, worst_d, worst_i)) {
        int pos = atomicAdd(&added, 1);
        sd[k + pos] = value;
        si[k + pos] = id;
      }
    }
    __syncthreads();
  }
  if (added > 0) compact();
  for (int t = threadIdx.x; t < k; t += blockDim.x) {
    run_d[list * k + t] = sd[t];
    run_i[list * k + t] = si[t];
  }
}

}  // namespace

Status topk_init(float* run_d, std::int32_t* run_i, std::size_t count, void* stream) {
  topk_init_kernel<<<blocks_for(count, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(run_d, run_i,
                                                                                         count);
  return launch_status("top-k init kernel");
}

Status apply_upper_bounds(const float* bounds, std::size_t rows, std::size_t k, float* run_d,
                          std::int32_t* run_i, void* stream) {
  std::size_t count = rows * k;
  if (count == 0) return {};
  apply_upper_bounds_kernel<<<blocks_for(count, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      bounds, rows, k, run_d, run_i);
  return launch_status("upper bounds kernel");
}

Status topk_update(const float* cand, const std::int32_t* cand_idx, std::size_t rows,
                   std::size_t count, std::size_t cand_ld, std::int64_t base, std::size_t k,
                   float* run_d, std::int32_t* run_i, void* stream, const Epilogue* epilogue,
                   const std::uint32_t* row_counts) {
  if (rows == 0 || count == 0) return {};
  Epilogue e = epilogue ? *epilogue : Epilogue{};
  topk_update_kernel<<<static_cast<unsigned>(rows), kTopkThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      cand, cand_idx, count, count, cand_ld, base, static_cast<int>(k), run_d, run_i, e, row_counts);
  return launch_status("top-k update kernel");
}

std::size_t topk_slices(std::size_t rows, std::size_t count, std::size_t k) {
  if (rows >= kTopkBusyBlocks) return 1;
  std::size_t wanted = (kTopkBusyBlocks + rows - 1) / rows;
  std::size_t by_length = count / kTopkMinSlice;
  std::size_t by_merge = kTopkMaxMerge / k;
  std::size_t slices = wanted < by_length ? wanted : by_length;
  slices = slices < by_merge ? slices : by_merge;
  return slices > 1 ? slices : 1;
}

Status topk_update_split(const float* cand, std::size_t rows, std::size_t count,
                         std::size_t cand_ld, std::int64_t base, std::size_t k,
                         std::size_t slices, float* part_d, std::int32_t* part_i, float* run_d,
                         std::int32_t* run_i, void* stream, const Epilogue* epilogue) {
  if (rows == 0 || count == 0) return {};
  auto s = static_cast<cudaStream_t>(stream);
  if (Status st = topk_init(part_d, part_i, rows * slices * k, stream); !st.ok()) return st;
  Epilogue e = epilogue ? *epilogue : Epilogue{};
  std::size_t slice = (count + slices - 1) / slices;
  dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(slices));
  topk_update_kernel<<<grid, kTopkThreads, 0, s>>>(cand, nullptr, count, slice, cand_ld, base,
                                                   static_cast<int>(k), part_d, part_i, e,
                                                   nullptr);
  if (Status st = launch_status("top-k slice kernel"); !st.ok()) return st;
  // The slices' lists (final distances, their own indices) into the running lists.
  return topk_update(part_d, part_i, rows, slices * k, slices * k, 0, k, run_d, run_i, stream);
}

}  // namespace gpupool::cuda_kernels
