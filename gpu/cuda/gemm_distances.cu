// Distances in the GEMM form ‖q‖² + ‖x‖² − 2 q·x (kernels.cuh: dot_products, distances, pairwise):
// cuBLAS's dot products and the epilogue pass that finishes them into distances, and the whole
// Q × N matrix — the fused kernel (distance_matrix.cuh) where it takes the rows, else cuBLAS.
#include "kernels.cuh"
#include "distance_matrix.cuh"
#include "dot_epilogue.cuh"
#include "launch_status.cuh"

#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <map>
#include <mutex>

namespace gpupool::cuda_kernels {

namespace {

// One cuBLAS handle per device, used under a lock (cublasSetStream + enqueue).
std::mutex g_handles_mutex;
std::map<int, cublasHandle_t> g_handles;

// kEpiloguePerThread independent elements per thread: one per thread left the pass at about
// 2 TB/s, latency-bound.
constexpr int kEpiloguePerThread = 4;

__global__ void epilogue_kernel(float* out, std::size_t ld, std::size_t nq, std::size_t nx,
                                Epilogue e) {
  std::size_t first = blockIdx.x * static_cast<std::size_t>(blockDim.x) * kEpiloguePerThread;
  std::size_t i = blockIdx.y;
  if (i >= nq) return;
  float dot[kEpiloguePerThread];
#pragma unroll
  for (int v = 0; v < kEpiloguePerThread; ++v) {
    std::size_t j = first + v * blockDim.x + threadIdx.x;
    dot[v] = j < nx ? out[i * ld + j] : 0.0f;
  }
#pragma unroll
  for (int v = 0; v < kEpiloguePerThread; ++v) {
    std::size_t j = first + v * blockDim.x + threadIdx.x;
    if (j < nx) out[i * ld + j] = finish(dot[v], e, i, j);
  }
}

}  // namespace

Status set_device(int ordinal) { return cuda_status(cudaSetDevice(ordinal), "cudaSetDevice"); }

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
                 std::size_t dim, bool tf32, const Epilogue& epilogue, float* out, std::size_t ld,
                 void* stream) {
  if (q.rows == 0 || nx == 0) return {};
  if (Status st = dot_products(ordinal, q, x, x0, nx, dim, tf32, out, ld, stream); !st.ok())
    return st;
  dim3 grid(blocks_for(nx, 256 * kEpiloguePerThread), static_cast<unsigned>(q.rows));
  epilogue_kernel<<<grid, 256, 0, static_cast<cudaStream_t>(stream)>>>(out, ld, q.rows, nx,
                                                                       epilogue);
  return launch_status("distance epilogue kernel");
}

PairwiseScratch pairwise_scratch(const Matrix& q, const Matrix& x, std::size_t dim, Metric metric,
                                 bool tf32, bool halves) {
  PairwiseScratch s;
  auto take = [&s](std::size_t bytes) {
    const std::size_t offset = s.bytes;
    s.bytes += (bytes + 255) / 256 * 256;
    return offset;
  };
  const bool fused = fused_matrix(x.element, q.rows, dim, tf32);
  if (metric != Metric::InnerProduct) {
    s.q_norms = take(q.rows * sizeof(float));
    if (!(fused && matrix_sums_corpus_norms(x, q.rows, dim, !tf32)))
      s.x_norms = take(x.rows * sizeof(float));
  }
  if (!fused && x.element == Element::Int8) {
    s.q16 = take(q.rows * dim * 2);
    s.x16 = take(x.rows * dim * 2);
  }
  if (halves && matrix_takes_halves(q, x, dim, !tf32)) {
    const std::size_t row_bytes = 2 * fp16_halves_dim(dim) * sizeof(__half);
    s.q_halves = take(q.rows * row_bytes);
    s.x_halves = take(x.rows * row_bytes);
    s.q_scales = take(q.rows * sizeof(float));
    s.x_scales = take(x.rows * sizeof(float));
  }
  return s;
}

namespace {

// The fp32-accurate matrix's operands as split_to_fp16's halves (with the rows' norms, where
// `norms`, from the same pass), and the fused kernel's arguments on them.
Status split_operands(const Matrix& q, const Matrix& x, std::size_t dim, void* q_halves,
                      void* x_halves, float* q_scales, float* x_scales, float* q_norms,
                      float* x_norms, MatrixArgs& args, void* stream) {
  if (Status st = split_to_fp16(static_cast<const float*>(q.data), q.rows, dim, q_halves,
                                q_scales, q_norms, stream);
      !st.ok())
    return st;
  if (Status st = split_to_fp16(static_cast<const float*>(x.data), x.rows, dim, x_halves,
                                x_scales, x_norms, stream);
      !st.ok())
    return st;
  args.q_halves = q_halves;
  args.x_halves = x_halves;
  args.q.scales = q_scales;
  args.x.scales = x_scales;
  return {};
}

}  // namespace

Status pairwise(int ordinal, const Matrix& q, const Matrix& x, std::size_t dim, Metric metric,
                bool tf32, const PairwiseScratch& layout, void* scratch, float* out, void* stream) {
  auto at = [scratch](std::size_t offset) -> void* {
    return offset == PairwiseScratch::kNone ? nullptr : static_cast<char*>(scratch) + offset;
  };
  Epilogue e;
  e.metric = metric;
  e.dim = dim;
  e.q_norms = static_cast<const float*>(at(layout.q_norms));
  e.x_norms = static_cast<const float*>(at(layout.x_norms));
  if (layout.x_halves != PairwiseScratch::kNone) {
    MatrixArgs fused{q, x, dim, metric, !tf32, e.q_norms, e.x_norms, out};
    if (Status st = split_operands(q, x, dim, at(layout.q_halves), at(layout.x_halves),
                                   static_cast<float*>(at(layout.q_scales)),
                                   static_cast<float*>(at(layout.x_scales)),
                                   const_cast<float*>(e.q_norms), const_cast<float*>(e.x_norms),
                                   fused, stream);
        !st.ok())
      return st;
    return distance_matrix(fused, stream);
  }
  if (e.q_norms)
    if (Status st = row_norms(q, dim, const_cast<float*>(e.q_norms), stream); !st.ok()) return st;
  if (e.x_norms)
    if (Status st = row_norms(x, dim, const_cast<float*>(e.x_norms), stream); !st.ok()) return st;
  if (fused_matrix(x.element, q.rows, dim, tf32)) {
    MatrixArgs fused{q, x, dim, metric, !tf32, e.q_norms, e.x_norms, out};
    return distance_matrix(fused, stream);
  }
  if (metric == Metric::L2 && x.element == Element::Fp32 && !tf32) {  // cancellation re-compute
    e.q32 = static_cast<const float*>(q.data);
    e.x32 = static_cast<const float*>(x.data);
  }
  Matrix gq = q, gx = x;
  if (x.element == Element::Int8) {
    void* q16 = at(layout.q16);
    void* x16 = at(layout.x16);
    if (Status st = widen_int8(q, 0, q.rows, dim, q16, stream); !st.ok()) return st;
    if (Status st = widen_int8(x, 0, x.rows, dim, x16, stream); !st.ok()) return st;
    gq = Matrix{q16, Element::Fp16, nullptr, q.rows};
    gx = Matrix{x16, Element::Fp16, nullptr, x.rows};
    e.q_scales = q.scales;
    e.x_scales = x.scales;
  }
  return distances(ordinal, gq, gx, 0, x.rows, dim, tf32, e, out, x.rows, stream);
}

}  // namespace gpupool::cuda_kernels
