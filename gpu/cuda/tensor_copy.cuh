// Internal: Hopper's tensor copy engine (TMA) and the shared-memory barriers (mbarrier) that its
// copies complete on, for the resident-query kernels (gpu/cuda/resident_tiles.cuh).
//
// Why: one thread's single instruction brings a whole 128-row chunk of the corpus into shared
// memory, already in the 128-byte swizzle that wgmma reads, zero-filled past the last row and
// past the end of each row; the threads that read it wait on its barrier instead of meeting at a
// block-wide __syncthreads, so the two warpgroups of a block need not run in step. Everything
// here exists on plain sm_90 (the PTX fallback compiles it too). Include it from .cu files.
#pragma once

#include "kernels.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace gpupool::cuda_kernels::tensor_copy {

inline constexpr int kBoxBytes = 128;  // bytes of each row per copy: one swizzle row
inline constexpr int kBoxRows = 128;

__device__ __forceinline__ std::uint32_t shared_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// A barrier that completes once `arrivals` threads have arrived (and the bytes they announced
// have landed); it then starts its next phase. Phases alternate parity 0, 1, 0, ...
__device__ __forceinline__ void init_barrier(std::uint64_t* barrier, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(barrier)),
               "r"(arrivals)
               : "memory");
}
// Makes initialised barriers visible to the copy engine (then a __syncthreads for the threads).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// This thread's arrival, announcing `bytes` that copies will deliver before the phase completes.
__device__ __forceinline__ void arrive_expecting(std::uint64_t* barrier, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                   shared_address(barrier)),
               "r"(bytes)
               : "memory");
}
// Waits until the phase of parity `parity` has completed (its copies' bytes are visible).
__device__ __forceinline__ void wait_barrier(std::uint64_t* barrier, std::uint32_t parity) {
  const std::uint32_t address = shared_address(barrier);
  std::uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(address), "r"(parity)
        : "memory");
  } while (!done);
}

// Copies the box at (byte `column`, row `row`) of the tensor `map` describes into shared memory
// at `destination` (1024-byte aligned for the swizzle), completing on `barrier`.
__device__ __forceinline__ void load_box(void* destination, const CUtensorMap& map, int column,
                                         int row, std::uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(shared_address(destination)),
      "l"(reinterpret_cast<std::uint64_t>(&map)), "r"(column), "r"(row),
      "r"(shared_address(barrier))
      : "memory");
}

// Adds one to a shared counter with acquire-release order among the block's threads (so that
// what the other adders did before theirs is done before what this one does after) and returns
// the value before.
__device__ __forceinline__ std::uint32_t count_up(std::uint32_t* counter) {
  std::uint32_t before;
  asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], 1;\n"
               : "=r"(before)
               : "r"(shared_address(counter))
               : "memory");
  return before;
}

// The tensor map of `rows` rows of `row_bytes` bytes (a multiple of 16) at `data` (16-byte
// aligned), read in boxes of kBoxBytes × kBoxRows with the 128-byte swizzle; what lies past the
// last row or past a row's end reads as zeros. The encoder is the driver's, reached through the
// runtime (no link against libcuda).
inline Status encode_rows(const void* data, std::size_t rows, std::size_t row_bytes,
                          CUtensorMap& map) {
  using Encode = PFN_cuTensorMapEncodeTiled_v12000;
  static const Encode encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found{};
    cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000,
                                                     cudaEnableDefault, &found);
    return e == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<Encode>(function)
               : nullptr;
  }();
  if (!encode)
    return cuda_failure(cudaErrorNotSupported,
                        "the driver has no cuTensorMapEncodeTiled (tensor copies need CUDA 12+)");
  const cuuint64_t dims[2] = {row_bytes, rows};
  const cuuint64_t strides[1] = {row_bytes};
  const cuuint32_t box[2] = {kBoxBytes, kBoxRows};
  const cuuint32_t element_strides[2] = {1, 1};
  CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(data), dims,
                      strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return cuda_failure(cudaErrorInvalidValue,
                        "encoding the corpus rows' tensor map (cuTensorMapEncodeTiled)");
  return {};
}

}  // namespace gpupool::cuda_kernels::tensor_copy
