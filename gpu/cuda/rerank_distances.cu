// Exact re-rank distances (kernels.cuh, rerank_distances): each candidate's distance from the fp32
// rows in the direct form, a warp a candidate, in a fixed order of fp32 FMAs.
#include "kernels.cuh"
#include "distance_rules.cuh"
#include "launch_status.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace gpupool::cuda_kernels {

namespace {

// One warp per (query row, candidate): lane l sums elements l, l + 32, ... of the pair with
// fp32 FMA in that order (a warp reads 128 contiguous bytes of the candidate's row per step), then
// an xor butterfly adds the lanes in a fixed order, so every run gives the same bits.
constexpr int kRerankWarps = 8;
constexpr std::size_t kRerankBlocks = 4096;  // about 4 waves of 8 blocks per SM (132 SMs)

__device__ void rerank_slot(const float* q, const float* x32, std::size_t dim, Metric metric,
                            int j, float* out, int lane) {
  if (j < 0) {
    if (lane == 0) *out = __int_as_float(0x7fc00000);
    return;
  }
  const float* x = x32 + static_cast<std::size_t>(j) * dim;
  float acc = 0.0f, qq = 0.0f, xx = 0.0f;
  for (std::size_t e = lane; e < dim; e += 32) {
    float a = q[e], b = x[e];
    if (metric == Metric::L2) {
      float d = a - b;
      acc = fmaf(d, d, acc);
    } else {
      acc = fmaf(a, b, acc);
      if (metric == Metric::Cosine) {
        qq = fmaf(a, a, qq);
        xx = fmaf(b, b, xx);
      }
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    qq += __shfl_xor_sync(0xffffffffu, qq, offset);
    xx += __shfl_xor_sync(0xffffffffu, xx, offset);
  }
  if (lane != 0) return;
  // L2 is already the direct-form sum; inner product and cosine share the GEMM epilogue's
  // finish (qq / xx as the squared norms of this one pair).
  *out = metric == Metric::L2 ? clamp_low(acc, 0.0f)
                              : finish_distance(acc, metric, qq, xx, nullptr, nullptr, 0);
}

// Block (row, y) takes the row's candidates y·8 + w, stepping by gridDim.y·8 (w: its warp), up to
// the row's count: the filter's lists are mostly empty slots (capacity 4× the expected count),
// which a warp per slot paid for (ncu: about 1.1 ms an fp32-accurate kNN call, docs/kernels.md).
__global__ void __launch_bounds__(kRerankWarps * 32)
    rerank_kernel(const float* q32, const float* x32, std::size_t dim, Metric metric,
                  const std::int32_t* cand_i, std::size_t candidates, float* cand_d,
                  const std::uint32_t* row_counts) {
  std::size_t row = blockIdx.x;
  std::size_t used = candidates;
  if (row_counts) used = min(used, static_cast<std::size_t>(row_counts[row]));
  std::size_t step = static_cast<std::size_t>(gridDim.y) * kRerankWarps;
  for (std::size_t c = blockIdx.y * kRerankWarps + threadIdx.x / 32; c < used; c += step) {
    std::size_t slot = row * candidates + c;
    rerank_slot(q32 + row * dim, x32, dim, metric, cand_i[slot], &cand_d[slot], threadIdx.x % 32);
  }
}

}  // namespace

Status rerank_distances(const float* queries, const float* corpus, std::size_t rows,
                        std::size_t dim, Metric metric, const std::int32_t* cand_i,
                        std::size_t candidates, float* cand_d, void* stream,
                        const std::uint32_t* row_counts) {
  if (rows == 0 || candidates == 0) return {};
  // Counted lists (mostly empty): about kRerankBlocks blocks in all. gridDim.y stays within
  // CUDA's 65535; the warps loop over the rest.
  std::size_t per_row = blocks_for(candidates, kRerankWarps);
  if (row_counts) per_row = std::min(per_row, (kRerankBlocks + rows - 1) / rows);
  per_row = std::min<std::size_t>(per_row, 65535);
  dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(per_row));
  rerank_kernel<<<grid, kRerankWarps * 32, 0, static_cast<cudaStream_t>(stream)>>>(
      queries, corpus, dim, metric, cand_i, candidates, cand_d, row_counts);
  return launch_status("re-rank distance kernel");
}

}  // namespace gpupool::cuda_kernels
