// Conversions between element types (kernels.cuh: convert, convert_stored): fp32 to fp16 / bf16,
// to int8 with a scale per row, back to fp32, and values as vector files store them into what
// the kernels read.
#include "kernels.cuh"
#include "element_load.cuh"
#include "launch_status.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace gpupool::cuda_kernels {

namespace {

__global__ void convert_elementwise_kernel(Matrix in, std::size_t dim, std::size_t n, Element out_e,
                                           void* out) {
  std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (t >= n) return;
  float v = load_element(in.data, in.element, t);
  if (in.element == Element::Int8) v *= in.scales[t / dim];
  switch (out_e) {
    case Element::Fp32: static_cast<float*>(out)[t] = v; break;
    case Element::Fp16: static_cast<__half*>(out)[t] = __float2half_rn(v); break;
    case Element::Bf16: static_cast<__nv_bfloat16*>(out)[t] = __float2bfloat16_rn(v); break;
    default: break;
  }
}

__device__ float load_stored(const void* stored, int element, std::size_t i) {
  switch (element) {
    case 0: return static_cast<const std::uint8_t*>(stored)[i];
    case 1: return static_cast<const std::int8_t*>(stored)[i];
    case 2: return __half2float(static_cast<const __half*>(stored)[i]);
    default: return static_cast<const float*>(stored)[i];
  }
}

// Grid-stride over the values; each thread converts kStoredPerThread neighbours per step so that
// byte-wide loads and stores still move whole words per warp.
constexpr unsigned kStoredPerThread = 4;
__global__ void convert_stored_kernel(const void* stored, int element, std::size_t count,
                                      float offset, int exponent, Element out_e, void* out) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x * kStoredPerThread;
  for (std::size_t first = (blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x) *
                           kStoredPerThread;
       first < count; first += stride) {
    const std::size_t end = first + kStoredPerThread < count ? first + kStoredPerThread : count;
    for (std::size_t i = first; i < end; ++i) {
      float v = load_stored(stored, element, i) + offset;
      if (exponent != 0) v = scalbnf(v, exponent);
      switch (out_e) {
        case Element::Fp32: static_cast<float*>(out)[i] = v; break;
        case Element::Fp16: static_cast<__half*>(out)[i] = __float2half_rn(v); break;
        case Element::Bf16: static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v); break;
        case Element::Int8:
          static_cast<std::int8_t*>(out)[i] =
              isnan(v) ? std::int8_t{0}
                       : static_cast<std::int8_t>(fminf(fmaxf(roundf(v), -128.0f), 127.0f));
          break;
      }
    }
  }
}

// fp32 → int8, one block (256 threads) per row: scale = max|x| / 127 (0 for a zero row, NaN with
// zeros for a row holding NaN or infinity).
__global__ void quantize_kernel(const float* in, std::size_t dim, std::int8_t* out, float* scales) {
  __shared__ float maxima[256];
  __shared__ int finite_all;
  std::size_t row = blockIdx.x;
  if (threadIdx.x == 0) finite_all = 1;
  __syncthreads();
  float m = 0.0f;
  for (std::size_t c = threadIdx.x; c < dim; c += blockDim.x) {
    float v = in[row * dim + c];
    if (!isfinite(v)) finite_all = 0;
    m = fmaxf(m, fabsf(v));
  }
  maxima[threadIdx.x] = m;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s /= 2) {
    if (static_cast<int>(threadIdx.x) < s)
      maxima[threadIdx.x] = fmaxf(maxima[threadIdx.x], maxima[threadIdx.x + s]);
    __syncthreads();
  }
  float max_abs = maxima[0];
  bool finite = finite_all != 0;
  float scale = max_abs / 127.0f;
  for (std::size_t c = threadIdx.x; c < dim; c += blockDim.x) {
    float q = 0.0f;
    if (finite && max_abs != 0.0f) q = fminf(fmaxf(rintf(in[row * dim + c] / scale), -127.f), 127.f);
    out[row * dim + c] = static_cast<std::int8_t>(q);
  }
  if (threadIdx.x == 0) scales[row] = !finite ? __int_as_float(0x7fc00000) : (max_abs == 0.f ? 0.f : scale);
}

}  // namespace

Status convert(const Matrix& in, std::size_t dim, Element out, void* out_data, float* out_scales,
               void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (out == Element::Int8) {
    quantize_kernel<<<static_cast<unsigned>(in.rows), 256, 0, s>>>(
        static_cast<const float*>(in.data), dim, static_cast<std::int8_t*>(out_data), out_scales);
    return launch_status("quantize kernel");
  }
  std::size_t n = in.rows * dim;
  convert_elementwise_kernel<<<blocks_for(n, 256), 256, 0, s>>>(in, dim, n, out, out_data);
  return launch_status("convert kernel");
}

Status convert_stored(const void* stored, int stored_element, std::size_t count, float offset,
                      int exponent, Element out, void* out_data, void* stream) {
  if (count == 0) return {};
  const std::size_t threads = (count + kStoredPerThread - 1) / kStoredPerThread;
  const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>((threads + 255) / 256, 65535u * 4));
  convert_stored_kernel<<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      stored, stored_element, count, offset, exponent, out, out_data);
  return launch_status("convert_stored kernel");
}

}  // namespace gpupool::cuda_kernels
