// Internal: one value of a matrix of any element type, as fp32 — for the kernels that read a
// value a lane (row norms of unaligned rows, conversions).
#pragma once

#include "kernels.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

namespace gpupool::cuda_kernels {

__device__ __forceinline__ float load_element(const void* data, Element e, std::size_t index) {
  switch (e) {
    case Element::Fp32: return static_cast<const float*>(data)[index];
    case Element::Fp16: return __half2float(static_cast<const __half*>(data)[index]);
    case Element::Bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[index]);
    case Element::Int8: return static_cast<float>(static_cast<const std::int8_t*>(data)[index]);
  }
  return 0.0f;
}

}  // namespace gpupool::cuda_kernels
