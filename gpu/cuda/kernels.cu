// CUDA kernels of gpupool:kernels: cuBLAS GEMM-form distances with an fp32 epilogue, a direct-form
// int8 kernel, row norms, conversions and a block-per-query running top-k selection.
#include "kernels.cuh"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <map>
#include <mutex>

namespace gpupool::cudak {

namespace {

Status cuda_status(cudaError_t e, const char* what) {
  Status s;
  if (e != cudaSuccess) {
    s.cuda = static_cast<int>(e);
    s.what = what;
  }
  return s;
}
Status launch_status(const char* what) { return cuda_status(cudaGetLastError(), what); }

// One cuBLAS handle per device, used under a lock (cublasSetStream + enqueue).
std::mutex g_handles_mutex;
std::map<int, cublasHandle_t> g_handles;

__device__ __forceinline__ float load(const void* data, Element e, std::size_t index) {
  switch (e) {
    case Element::Fp32: return static_cast<const float*>(data)[index];
    case Element::Fp16: return __half2float(static_cast<const __half*>(data)[index]);
    case Element::Bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[index]);
    case Element::Int8: return static_cast<float>(static_cast<const std::int8_t*>(data)[index]);
  }
  return 0.0f;
}

__device__ __forceinline__ float clamp_low(float v, float low) { return v < low ? low : v; }

// Same order as the CPU kernels: smaller first, NaN after numbers, ties by index, -1 last.
__device__ __forceinline__ bool better(float da, int ia, float db, int ib) {
  if ((ia < 0) != (ib < 0)) return ib < 0;
  bool na = isnan(da), nb = isnan(db);
  if (na != nb) return nb;
  if (!na && da != db) return da < db;
  return ia < ib;
}

__global__ void row_norms_kernel(Matrix m, std::size_t dim, float* out) {
  std::size_t row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= m.rows) return;
  float acc = 0.0f;
  for (std::size_t c = lane; c < dim; c += 32) {
    float v = load(m.data, m.element, row * dim + c);
    acc += v * v;
  }
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  if (lane == 0) {
    float s = m.element == Element::Int8 ? m.scales[row] : 1.0f;
    out[row] = acc * s * s;
  }
}

// dot (from the GEMM) → distance of query row i and corpus row j. For fp32-accurate L2 (q32 and
// x32 given), pairs whose GEMM form cancelled badly (result below 2^-10 of |q|^2 + |x|^2) are
// recomputed in the direct form from the fp32 rows.
__device__ __forceinline__ float finish_distance(float dot, Metric metric, const float* qn,
                                                 const float* xn, const float* q32,
                                                 const float* x32, std::size_t dim,
                                                 std::size_t i, std::size_t j) {
  if (metric == Metric::InnerProduct) return -dot;
  if (metric == Metric::L2) {
    float sum = qn[i] + xn[j];
    float value = sum - 2.0f * dot;
    if (q32 && !(value > sum * 0x1p-10f)) {
      float acc = 0.0f;
      for (std::size_t c = 0; c < dim; ++c) {
        float d = q32[i * dim + c] - x32[j * dim + c];
        acc += d * d;
      }
      value = acc;
    }
    return clamp_low(value, 0.0f);
  }
  float a = sqrtf(qn[i]), b = sqrtf(xn[j]);
  if (a == 0.0f || b == 0.0f) return isnan(dot) ? dot : 1.0f;
  float value = 1.0f - dot / (a * b);
  return value > 2.0f ? 2.0f : clamp_low(value, 0.0f);
}

__global__ void epilogue_kernel(float* out, std::size_t ld, std::size_t nq, std::size_t nx,
                                Metric metric, const float* qn, const float* xn,
                                const float* q32, const float* x32, std::size_t dim) {
  std::size_t j = blockIdx.x * blockDim.x + threadIdx.x;
  std::size_t i = blockIdx.y;
  if (j >= nx || i >= nq) return;
  out[i * ld + j] = finish_distance(out[i * ld + j], metric, qn, xn, q32, x32, dim, i, j);
}

// int8: direct form in fp32 on dequantised values, 16×16 pairs per block through shared memory.
__global__ void int8_distance_kernel(Matrix q, Matrix x, std::size_t x0, std::size_t nx,
                                     std::size_t dim, Metric metric, float* out, std::size_t ld) {
  __shared__ float qs[16][17], xs[16][17];
  std::size_t i = blockIdx.y * 16 + threadIdx.y, j = blockIdx.x * 16 + threadIdx.x;
  std::size_t qrow = blockIdx.y * 16 + threadIdx.x;       // row this thread loads (queries)
  std::size_t xrow = x0 + blockIdx.x * 16 + threadIdx.y;  // row this thread loads (corpus)
  float l2 = 0, dot = 0, qq = 0, xx = 0;
  for (std::size_t c0 = 0; c0 < dim; c0 += 16) {
    std::size_t c = c0 + threadIdx.y;
    qs[threadIdx.x][threadIdx.y] =
        (qrow < q.rows && c < dim) ? load(q.data, q.element, qrow * dim + c) * q.scales[qrow] : 0.f;
    std::size_t c2 = c0 + threadIdx.x;
    xs[threadIdx.y][threadIdx.x] = (xrow < x0 + nx && c2 < dim)
                                       ? load(x.data, x.element, xrow * dim + c2) * x.scales[xrow]
                                       : 0.f;
    __syncthreads();
    for (int t = 0; t < 16; ++t) {
      float a = qs[threadIdx.y][t], b = xs[threadIdx.x][t];
      float d = a - b;
      l2 += d * d;
      dot += a * b;
      qq += a * a;
      xx += b * b;
    }
    __syncthreads();
  }
  if (i >= q.rows || j >= nx) return;
  float value;
  if (metric == Metric::L2) value = clamp_low(l2, 0.0f);
  else if (metric == Metric::InnerProduct) value = -dot;
  else if (qq == 0.0f || xx == 0.0f) value = isnan(dot) ? dot : 1.0f;
  else {
    value = 1.0f - dot / (sqrtf(qq) * sqrtf(xx));
    value = value > 2.0f ? 2.0f : clamp_low(value, 0.0f);
  }
  out[i * ld + j] = value;
}

__global__ void topk_init_kernel(float* d, std::int32_t* idx, std::size_t count) {
  std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (t < count) {
    d[t] = __int_as_float(0x7fc00000);
    idx[t] = -1;
  }
}

__device__ void bitonic_sort(float* d, int* id, int n) {  // n a power of two, whole block
  for (int size = 2; size <= n; size <<= 1)
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < n / 2; t += blockDim.x) {
        int lo = 2 * t - (t & (stride - 1)), hi = lo + stride;
        bool ascending = (lo & size) == 0;
        if (better(d[hi], id[hi], d[lo], id[lo]) == ascending) {
          float td = d[lo]; d[lo] = d[hi]; d[hi] = td;
          int ti = id[lo]; id[lo] = id[hi]; id[hi] = ti;
        }
      }
      __syncthreads();
    }
}

// 256 threads × 4 independent loads each per step: enough reads in flight to stream the tile
// (one load per thread and 512 threads left the scan latency-bound), and one step's 1024
// candidates always fit beside k <= 1024 in the 2048 slots.
constexpr int kTopkThreads = 256;
constexpr int kTopkPerThread = 4;
static_assert(kTopkThreads * kTopkPerThread + 1024 <= static_cast<int>(kTopkSlots));

// One block per row: the running top-k sits sorted in slots [0, k); candidates better than its
// worst are appended after it; when the slots could overflow, sort and keep the first k.
// With epilogue.dim != 0, candidates are dot products turned into distances as they are read.
__global__ void topk_update_kernel(const float* cand, const std::int32_t* cand_idx,
                                   std::size_t count, std::size_t cand_ld, std::int64_t base,
                                   int k, float* run_d, std::int32_t* run_i, Epilogue epilogue) {
  __shared__ float sd[kTopkSlots];
  __shared__ int si[kTopkSlots];
  __shared__ int added;
  std::size_t row = blockIdx.x;
  for (int t = threadIdx.x; t < static_cast<int>(kTopkSlots); t += blockDim.x) {
    sd[t] = t < k ? run_d[row * k + t] : __int_as_float(0x7fc00000);
    si[t] = t < k ? run_i[row * k + t] : -1;
  }
  if (threadIdx.x == 0) added = 0;
  __syncthreads();
  const int capacity = static_cast<int>(kTopkSlots) - k;
  auto compact = [&] {
    int n = 1;
    while (n < k + added) n <<= 1;
    bitonic_sort(sd, si, n);
    for (int t = k + threadIdx.x; t < n; t += blockDim.x) {
      sd[t] = __int_as_float(0x7fc00000);
      si[t] = -1;
    }
    __syncthreads();
    if (threadIdx.x == 0) added = 0;
    __syncthreads();
  };
  const std::size_t step = static_cast<std::size_t>(blockDim.x) * kTopkPerThread;
  for (std::size_t start = 0; start < count; start += step) {
    int pending = added;  // every thread reads it before anyone changes it
    __syncthreads();
    if (pending + static_cast<int>(step) > capacity) compact();
    float worst_d = sd[k - 1];
    int worst_i = si[k - 1];
    float d[kTopkPerThread];
#pragma unroll
    for (int v = 0; v < kTopkPerThread; ++v) {
      std::size_t j = start + v * blockDim.x + threadIdx.x;
      d[v] = j < count ? cand[row * cand_ld + j] : 0.0f;
    }
#pragma unroll
    for (int v = 0; v < kTopkPerThread; ++v) {
      std::size_t j = start + v * blockDim.x + threadIdx.x;
      if (j >= count) continue;
      float value = d[v];
      if (epilogue.dim != 0)
        value = finish_distance(value, epilogue.metric, epilogue.q_norms, epilogue.x_norms,
                                epilogue.q32, epilogue.x32, epilogue.dim, row, j);
      int id = cand_idx ? cand_idx[row * cand_ld + j] : static_cast<int>(base + j);
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
    run_d[row * k + t] = sd[t];
    run_i[row * k + t] = si[t];
  }
}

__global__ void convert_elementwise_kernel(Matrix in, std::size_t dim, std::size_t n, Element out_e,
                                           void* out) {
  std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (t >= n) return;
  float v = load(in.data, in.element, t);
  if (in.element == Element::Int8) v *= in.scales[t / dim];
  switch (out_e) {
    case Element::Fp32: static_cast<float*>(out)[t] = v; break;
    case Element::Fp16: static_cast<__half*>(out)[t] = __float2half_rn(v); break;
    case Element::Bf16: static_cast<__nv_bfloat16*>(out)[t] = __float2bfloat16_rn(v); break;
    default: break;
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

unsigned blocks_for(std::size_t n, unsigned threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

}  // namespace

Status set_device(int ordinal) { return cuda_status(cudaSetDevice(ordinal), "cudaSetDevice"); }

Status row_norms(const Matrix& m, std::size_t dim, float* out, void* stream) {
  if (m.rows == 0) return {};
  row_norms_kernel<<<blocks_for(m.rows, 8), 256, 0, static_cast<cudaStream_t>(stream)>>>(m, dim, out);
  return launch_status("row_norms kernel");
}

Status dot_products(int ordinal, const Matrix& q, const Matrix& x, std::size_t x0, std::size_t nx,
                    std::size_t dim, bool tf32, float* out, std::size_t ld, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (q.rows == 0 || nx == 0) return {};
  if (nx > INT_MAX || q.rows > INT_MAX || dim > INT_MAX || ld > INT_MAX) {
    Status st;
    st.cublas = CUBLAS_STATUS_INVALID_VALUE;
    st.what = "cublasGemmEx (a dimension exceeds INT_MAX)";
    return st;
  }
  cudaDataType_t type = x.element == Element::Fp32   ? CUDA_R_32F
                        : x.element == Element::Fp16 ? CUDA_R_16F
                                                     : CUDA_R_16BF;
  std::size_t esize = x.element == Element::Fp32 ? 4 : 2;
  cublasComputeType_t compute =
      (x.element == Element::Fp32 && tf32) ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const float alpha = 1.0f, beta = 0.0f;
  {
    std::lock_guard lock(g_handles_mutex);
    cublasHandle_t& handle = g_handles[ordinal];
    if (!handle) {
      cublasStatus_t st = cublasCreate(&handle);
      if (st != CUBLAS_STATUS_SUCCESS) {
        handle = nullptr;
        Status r;
        r.cublas = static_cast<int>(st);
        r.what = "cublasCreate";
        return r;
      }
    }
    cublasStatus_t st = cublasSetStream(handle, s);
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasSetMathMode(handle, compute == CUBLAS_COMPUTE_32F_FAST_TF32
                                         ? CUBLAS_TF32_TENSOR_OP_MATH
                                         : CUBLAS_DEFAULT_MATH);
    // Column-major view: C (nx × nq, ldc = ld) = X^T (nx × dim) · Q (dim × nq).
    const void* a = static_cast<const char*>(x.data) + x0 * dim * esize;
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(nx),
                        static_cast<int>(q.rows), static_cast<int>(dim), &alpha, a, type,
                        static_cast<int>(dim), q.data, type, static_cast<int>(dim), &beta, out,
                        CUDA_R_32F, static_cast<int>(ld), compute, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) {
      Status r;
      r.cublas = static_cast<int>(st);
      r.what = "cublasGemmEx";
      return r;
    }
  }
  return {};
}

Status distances(int ordinal, const Matrix& q, const Matrix& x, std::size_t x0, std::size_t nx,
                 std::size_t dim, Metric metric, bool tf32, const float* q_norms,
                 const float* x_norms, float* out, std::size_t ld, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (q.rows == 0 || nx == 0) return {};
  if (x.element == Element::Int8) {
    dim3 block(16, 16), grid(blocks_for(nx, 16), blocks_for(q.rows, 16));
    int8_distance_kernel<<<grid, block, 0, s>>>(q, x, x0, nx, dim, metric, out, ld);
    return launch_status("int8 distance kernel");
  }
  if (Status st = dot_products(ordinal, q, x, x0, nx, dim, tf32, out, ld, stream); !st.ok())
    return st;
  bool refine = metric == Metric::L2 && x.element == Element::Fp32 && !tf32;
  dim3 grid(blocks_for(nx, 256), static_cast<unsigned>(q.rows));
  epilogue_kernel<<<grid, 256, 0, s>>>(
      out, ld, q.rows, nx, metric, q_norms, x_norms, refine ? static_cast<const float*>(q.data) : nullptr,
      refine ? static_cast<const float*>(x.data) + x0 * dim : nullptr, dim);
  return launch_status("distance epilogue kernel");
}

Status pairwise(int ordinal, const Matrix& q, const Matrix& x, std::size_t dim, Metric metric,
                bool tf32, float* out, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  float* norms = nullptr;
  bool need_norms = metric != Metric::InnerProduct && x.element != Element::Int8;
  if (need_norms) {
    Status st = cuda_status(cudaMallocAsync(reinterpret_cast<void**>(&norms),
                                            (q.rows + x.rows) * sizeof(float), s),
                            "cudaMallocAsync (norms)");
    if (!st.ok()) return st;
    if (st = row_norms(q, dim, norms, stream); st.ok()) st = row_norms(x, dim, norms + q.rows, stream);
    if (!st.ok()) {
      cudaFreeAsync(norms, s);
      return st;
    }
  }
  Status st = distances(ordinal, q, x, 0, x.rows, dim, metric, tf32, norms,
                        norms ? norms + q.rows : nullptr, out, x.rows, stream);
  if (norms) {
    Status freed = cuda_status(cudaFreeAsync(norms, s), "cudaFreeAsync (norms)");
    if (st.ok()) st = freed;
  }
  return st;
}

Status topk_init(float* run_d, std::int32_t* run_i, std::size_t count, void* stream) {
  topk_init_kernel<<<blocks_for(count, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(run_d, run_i,
                                                                                         count);
  return launch_status("top-k init kernel");
}

Status topk_update(const float* cand, const std::int32_t* cand_idx, std::size_t rows,
                   std::size_t count, std::size_t cand_ld, std::int64_t base, std::size_t k,
                   float* run_d, std::int32_t* run_i, void* stream, const Epilogue* epilogue) {
  if (rows == 0 || count == 0) return {};
  Epilogue e = epilogue ? *epilogue : Epilogue{};
  topk_update_kernel<<<static_cast<unsigned>(rows), kTopkThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      cand, cand_idx, count, cand_ld, base, static_cast<int>(k), run_d, run_i, e);
  return launch_status("top-k update kernel");
}

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

}  // namespace gpupool::cudak
