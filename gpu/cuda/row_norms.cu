// Squared norms of rows of any element type (kernels.cuh, row_norms): a warp a row, or a group of
// lanes a row reading 16-byte pieces where the rows are whole, aligned pieces.
#include "kernels.cuh"
#include "element_load.cuh"
#include "launch_status.cuh"
#include "piece_squares.cuh"

#include <cuda_runtime.h>

#include <cstdint>

namespace gpupool::cuda_kernels {

namespace {

__global__ void row_norms_kernel(Matrix m, std::size_t dim, float* out) {
  std::size_t row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= m.rows) return;
  float acc = 0.0f;
  for (std::size_t c = lane; c < dim; c += 32) {
    float v = load_element(m.data, m.element, row * dim + c);
    acc += v * v;
  }
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  if (lane == 0) {
    float s = m.element == Element::Int8 ? m.scales[row] : 1.0f;
    out[row] = acc * s * s;
  }
}

// Row norms of fp16 / bf16 / int8 rows that are whole, aligned 16-byte pieces: `group` lanes (a
// power of two, at most 32) a row, one 16-byte load per piece. row_norms_kernel's one value per
// lane ran at 1.8 TB/s on an H200 for fp16 rows of 256 bytes (149 µs for 2^20 rows). Fp32 rows
// stay there: scale_to_fp16_kernel sums in its order.
// One kernel an element type (piece_squares.cuh's sum, the resident matrix's too).
template <Element kElement>
__global__ void row_norms_pieces_kernel(Matrix m, std::size_t pieces, unsigned group, float* out) {
  const std::size_t thread = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  const std::size_t row = thread / group;
  const unsigned lane = thread % group;
  float acc = 0.0f;
  if (row < m.rows) {
    const uint4* src = static_cast<const uint4*>(m.data) + row * pieces;
    for (std::size_t p = lane; p < pieces; p += group) acc += piece_squares<kElement>(src[p]);
  }
  for (unsigned offset = group / 2; offset > 0; offset /= 2)
    acc += __shfl_down_sync(0xffffffffu, acc, offset, group);
  if (lane != 0 || row >= m.rows) return;
  float s = kElement == Element::Int8 ? m.scales[row] : 1.0f;
  out[row] = acc * s * s;
}

}  // namespace

Status row_norms(const Matrix& m, std::size_t dim, float* out, void* stream) {
  if (m.rows == 0) return {};
  auto s = static_cast<cudaStream_t>(stream);
  const std::size_t row_bytes = dim * element_bytes(m.element);
  const bool pieces = m.element != Element::Fp32 && row_bytes % 16 == 0 &&
                      reinterpret_cast<std::uintptr_t>(m.data) % 16 == 0;
  if (pieces) {
    const std::size_t per_row = row_bytes / 16;
    unsigned group = 1;
    while (group < 32 && group < per_row) group *= 2;
    const dim3 blocks(blocks_for(m.rows * group, 256));
    switch (m.element) {
      case Element::Int8:
        row_norms_pieces_kernel<Element::Int8><<<blocks, 256, 0, s>>>(m, per_row, group, out);
        break;
      case Element::Bf16:
        row_norms_pieces_kernel<Element::Bf16><<<blocks, 256, 0, s>>>(m, per_row, group, out);
        break;
      default:
        row_norms_pieces_kernel<Element::Fp16><<<blocks, 256, 0, s>>>(m, per_row, group, out);
    }
  } else {
    row_norms_kernel<<<blocks_for(m.rows, 8), 256, 0, s>>>(m, dim, out);
  }
  return launch_status("row_norms kernel");
}

}  // namespace gpupool::cuda_kernels
