// The rows copied into the forms other kernels multiply (kernels.cuh): int8 widened to fp16 for
// the fp16 GEMM, fp32 split into 3×TF32 parts, fp32 scaled to fp16 (the fp32-accurate filter's
// operands) or split into fp16 halves (the fp32-accurate matrix's), and the kNN sample's pieces
// gathered side by side.
#include "kernels.cuh"
#include "launch_status.cuh"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace gpupool::cuda_kernels {

namespace {

// fp32 → three tf32 parts laid out side by side, so that one TF32 GEMM over 3·dim sums
// hi·hi + hi·lo + lo·hi (3×TF32: close to fp32 accuracy on the tensor cores). hi is a rounded
// to tf32 (10 mantissa bits, exact in what the tensor cores read), lo = a − hi (exact in fp32).
// Queries are laid out [hi, hi, lo], corpus rows [hi, lo, hi].
__global__ void split_tf32_kernel(const float* in, std::size_t rows, std::size_t dim, bool corpus,
                                  float* out) {
  std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (t >= rows * dim) return;
  std::size_t r = t / dim, c = t % dim;
  float a = in[t];
  float hi = __uint_as_float((__float_as_uint(a) + 0x1000u) & 0xffffe000u);
  if (!isfinite(a)) hi = a;
  float lo = a - hi;
  float* row = out + r * 3 * dim;
  row[c] = hi;
  row[dim + c] = corpus ? lo : hi;
  row[2 * dim + c] = corpus ? hi : lo;
}

// The power of two that scale_to_fp16 and split_to_fp16 scale a row by (its largest |value|
// into [2^14, 2^15)), from the row's largest |value| and whether all its values are finite: none
// (scalable false) for a row that is not finite or lies outside scale_to_fp16's exponent range.
struct Fp16Scale {
  int exponent = 0;
  bool scalable = false;
  Fp16Scale() = default;
  __device__ Fp16Scale(float largest, bool finite)
      : exponent(largest > 0.0f ? ilogbf(largest) : 0),
        scalable(finite && exponent >= kScaledFp16MinExponent &&
                 exponent <= kScaledFp16MaxExponent) {}
  __device__ float inverse() const { return scalable ? ldexpf(1.0f, 14 - exponent) : 1.0f; }
  __device__ float back() const { return ldexpf(1.0f, exponent - 14); }
};

// A warp's pass over one fp32 row: its squared norm (lane 0's, summed in row_norms_kernel's
// order: the same bits) and its Fp16Scale.
struct RowScale {
  float norm = 0.0f;
  Fp16Scale scale;
  __device__ RowScale(const float* src, std::size_t dim, unsigned lane) {
    float largest = 0.0f;
    bool finite = true;
#pragma unroll 4
    for (std::size_t c = lane; c < dim; c += 32) {
      float v = src[c];
      norm += v * v;
      finite &= fabsf(v) <= 3.402823466e38f;  // false for NaN and infinity
      largest = fmaxf(largest, fabsf(v));
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
      norm += __shfl_down_sync(0xffffffffu, norm, offset);
    }
    scale = Fp16Scale(largest, __all_sync(0xffffffffu, finite));
  }
};

// One warp per row: RowScale's pass, then the scaled copy (see scale_to_fp16 in kernels.cuh).
// One pass over the fp32 rows for both.
__global__ void scale_to_fp16_kernel(const float* in, std::size_t rows, std::size_t dim,
                                     std::size_t padded_dim, __half* out, float* scales,
                                     float* norms) {
  std::size_t row = (blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x) / 32;
  unsigned lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float* src = in + row * dim;
  const RowScale scan(src, dim, lane);
  const float inverse = scan.scale.inverse();
  __half* dst = out + row * padded_dim;
#pragma unroll 4
  for (std::size_t c = lane; c < padded_dim; c += 32) {
    float v = c < dim ? src[c] * inverse : 0.0f;
    dst[c] = scan.scale.scalable || c >= dim ? __float2half_rn(v) : __float2half_rn(NAN);
  }
  if (lane != 0) return;
  scales[row] = scan.scale.scalable ? scan.scale.back() : 1.0f;
  if (norms) norms[row] = scan.norm;
}

// One warp per row of dim % 4 == 0 floats from a 16-byte aligned start, a 16-byte piece a lane:
// the row's largest |value|, finiteness and squared norm, then its hi and lo halves (split_to_fp16
// in kernels.cuh), zeros with scale NaN where the row cannot be scaled. (RowScale's pass and a
// value a lane, as scale_to_fp16 runs, took 0.54 ms for 2^20 rows of 128: 2 TB/s.)
__global__ void split_to_fp16_kernel(const float4* in, std::size_t rows, std::size_t pieces,
                                     std::size_t half_pieces, uint2* out, float* scales,
                                     float* norms) {
  const std::size_t row = (blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x) / 32;
  const unsigned lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float4* src = in + row * pieces;
  float largest = 0.0f, norm = 0.0f;
  bool finite = true;
  for (std::size_t p = lane; p < pieces; p += 32) {
    const float4 v = src[p];
    norm += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    constexpr float kMax = 3.402823466e38f;  // each test false for NaN and infinity
    finite &= fabsf(v.x) <= kMax && fabsf(v.y) <= kMax && fabsf(v.z) <= kMax && fabsf(v.w) <= kMax;
    largest = fmaxf(largest, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
    norm += __shfl_xor_sync(0xffffffffu, norm, offset);
  }
  finite = __all_sync(0xffffffffu, finite);
  const Fp16Scale scale(largest, finite);
  const float inverse = scale.scalable ? scale.inverse() : 0.0f;  // 0: zeros
  uint2* dst = out + row * 2 * half_pieces;
  for (std::size_t p = lane; p < half_pieces; p += 32) {
    const float4 v = p < pieces ? src[p] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float scaled[4] = {v.x * inverse, v.y * inverse, v.z * inverse, v.w * inverse};
    __half hi[4], lo[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // scaled: exact (a power of two); scaled − hi: exact in fp32
      hi[i] = __float2half_rn(scaled[i]);
      lo[i] = __float2half_rn(scaled[i] - __half2float(hi[i]));
    }
    dst[p] = *reinterpret_cast<const uint2*>(hi);
    dst[half_pieces + p] = *reinterpret_cast<const uint2*>(lo);
  }
  if (lane != 0) return;
  scales[row] = scale.scalable ? scale.back() : NAN;
  if (norms) norms[row] = norm;
}

__global__ void widen_int8_kernel(const std::int8_t* in, std::size_t n, __half* out) {
  std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (t < n) out[t] = __int2half_rn(in[t]);
}

}  // namespace

Status widen_int8(const Matrix& m, std::size_t row0, std::size_t rows, std::size_t dim,
                  void* out, void* stream) {
  std::size_t n = rows * dim;
  if (n == 0) return {};
  widen_int8_kernel<<<blocks_for(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const std::int8_t*>(m.data) + row0 * dim, n, static_cast<__half*>(out));
  return launch_status("int8 widen kernel");
}

Status scale_to_fp16(const float* in, std::size_t rows, std::size_t dim, void* out, float* scales,
                     float* norms, void* stream) {
  if (rows == 0) return {};
  scale_to_fp16_kernel<<<blocks_for(rows, 8), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      in, rows, dim, scaled_fp16_dim(dim), static_cast<__half*>(out), scales, norms);
  return launch_status("fp16 scaling kernel");
}

Status split_to_fp16(const float* in, std::size_t rows, std::size_t dim, void* out, float* scales,
                     float* norms, void* stream) {
  if (rows == 0) return {};
  if (dim % 4 != 0 || reinterpret_cast<std::uintptr_t>(in) % 16 != 0 ||
      reinterpret_cast<std::uintptr_t>(out) % 16 != 0)
    return cuda_failure(cudaErrorInvalidValue,
                        "fp16 halves kernel (rows of whole 16-byte pieces, 16-byte aligned)");
  split_to_fp16_kernel<<<blocks_for(rows, 8), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const float4*>(in), rows, dim / 4, fp16_halves_dim(dim) / 4,
      static_cast<uint2*>(out), scales, norms);
  return launch_status("fp16 halves kernel");
}

Status gather_pieces(const void* rows, std::size_t row_bytes, std::size_t pieces,
                     std::size_t period, std::size_t length, void* out, void* stream) {
  if (pieces == 0 || length == 0) return {};
  return cuda_status(cudaMemcpy2DAsync(out, length * row_bytes, rows, period * row_bytes,
                                       length * row_bytes, pieces, cudaMemcpyDeviceToDevice,
                                       static_cast<cudaStream_t>(stream)),
                     "cudaMemcpy2DAsync (gathering the kNN sample)");
}

Status split_tf32(const Matrix& m, std::size_t row0, std::size_t rows, std::size_t dim,
                  bool corpus, float* out, void* stream) {
  std::size_t n = rows * dim;
  if (n == 0) return {};
  split_tf32_kernel<<<blocks_for(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const float*>(m.data) + row0 * dim, rows, dim, corpus, out);
  return launch_status("3xTF32 split kernel");
}

}  // namespace gpupool::cuda_kernels
