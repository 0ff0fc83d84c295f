// Internal: sorts of (distance, index) lists in shared memory, in knn's order (distance_rules.cuh),
// by threads that work on one list together: a warp, a group of warps on a named barrier, or the
// whole block. Used by the few-queries kernel (its per-query lists), its merge kernel and the
// running top-k (running_topk.cu). Only device code: include it from .cu files.
#pragma once

#include "distance_rules.cuh"

namespace gpupool::cuda_kernels {

// The threads that sort one list together, whole warps: one warp (the thread's lane), a group
// of warps on a named barrier, or the whole block. first() is the thread's rank in the group.
struct WarpSorts {
  int lane;
  __device__ int first() const { return lane; }
  __device__ static int step() { return 32; }
  __device__ static void sync() { __syncwarp(); }
};
struct GroupSorts {
  int rank, threads, barrier;  // barrier: a named barrier (1-15) that only this group uses
  __device__ int first() const { return rank; }
  __device__ int step() const { return threads; }
  __device__ void sync() const {
    asm volatile("bar.sync %0, %1;" ::"r"(barrier), "r"(threads) : "memory");
  }
};
struct BlockSorts {
  __device__ static int first() { return threadIdx.x; }
  __device__ static int step() { return blockDim.x; }
  __device__ static void sync() { __syncthreads(); }
};

// A bitonic sort of a list's first n slots (n a power of two), knn's order, by the threads of
// `group`; `with` (if not null) moves along.
template <class Group>
__device__ void bitonic_sort(Group group, float* d, int* id, int* with, int n) {
  for (int size = 2; size <= n; size <<= 1)
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      for (int t = group.first(); t < n / 2; t += group.step()) {
        const int lo = 2 * t - (t & (stride - 1)), hi = lo + stride;
        const bool ascending = (lo & size) == 0;
        if (better(d[hi], id[hi], d[lo], id[lo]) == ascending) {
          const float td = d[lo];
          d[lo] = d[hi];
          d[hi] = td;
          const int ti = id[lo];
          id[lo] = id[hi];
          id[hi] = ti;
          if (with) {
            const int tw = with[lo];
            with[lo] = with[hi];
            with[hi] = tw;
          }
        }
      }
      group.sync();
    }
}

// The same sort by the whole block (whole warps) with one entry a thread (n <= blockDim.x), the
// entries in registers: a step of stride below 32 pairs two lanes of one warp, which trade entries
// by shuffles, and only the steps of longer strides go through shared memory and the block's
// barriers (6 of a 256-entry sort's 36 steps, against all 36 in the loop above, each a chain of
// shared-memory loads, compares and stores that the whole block waits out). The merge kernel's
// sorts take it; the few-queries kernel's lists do not: inlined there it raised the kernel's
// registers and made one query's int8 rounds slower than the sorts it saved (docs/benchmarks.md,
// "few queries").
__device__ inline void block_sort_in_registers(float* d, int* id, int* with, int n) {
  const int i = static_cast<int>(threadIdx.x);
  const bool mine = i < n;
  float value = mine ? d[i] : __int_as_float(0x7fc00000);
  int index = mine ? id[i] : -1, moved = mine && with ? with[i] : 0;
  for (int size = 2; size <= n; size <<= 1)
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      float other;
      int other_index, other_moved;
      if (stride >= 32) {
        __syncthreads();  // the last shared step's reads are done
        if (mine) {
          d[i] = value, id[i] = index;
          if (with) with[i] = moved;
        }
        __syncthreads();
        other = mine ? d[i ^ stride] : value;
        other_index = mine ? id[i ^ stride] : index;
        other_moved = mine && with ? with[i ^ stride] : moved;
      } else {
        other = __shfl_xor_sync(0xffffffffu, value, stride);
        other_index = __shfl_xor_sync(0xffffffffu, index, stride);
        other_moved = __shfl_xor_sync(0xffffffffu, moved, stride);
      }
      // The lower slot of an ascending pair (the upper of a descending one) keeps the better
      // entry, its partner the other; equal entries stay where they are.
      const bool keeps_better = ((i & stride) == 0) == ((i & size) == 0);
      const bool take = keeps_better ? better(other, other_index, value, index)
                                     : better(value, index, other, other_index);
      if (mine && take) value = other, index = other_index, moved = other_moved;
    }
  __syncthreads();
  if (mine) {
    d[i] = value, id[i] = index;
    if (with) with[i] = moved;
  }
  __syncthreads();
}
// A sort by the whole block: in registers where it has a thread for each entry, else in shared
// memory step by step.
__device__ inline void block_sort(float* d, int* id, int* with, int n) {
  if (n <= static_cast<int>(blockDim.x))
    block_sort_in_registers(d, id, with, n);
  else
    bitonic_sort(BlockSorts{}, d, id, with, n);
}

}  // namespace gpupool::cuda_kernels
